"""The cluster's resolution (sparkspec.registry.cluster): each node's rank, vLLM arguments and link
environment, and every bad inventory refused in one line naming the node or key and the fix."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sparkspec import registry
from sparkspec.errors import UserError
from sparkspec.registry.cluster import check_layout, resolve_cluster
from tests.support.systemd_rules import exec_command, render_resolved, small_contract, unit_entries

SPEC = {"group": "spark_cluster", "nnodes": 2, "tensor_parallel_size": 2}
MEMBERS = {
    "spark02": {"role": "worker", "interface": "enp1s0f0np0", "address": "192.168.100.11",
                "rdma_devices": ["rocep1s0f0", "roceP2p1s0f0"]},
    "spark01": {"role": "head", "interface": "enp1s0f0np0", "address": "192.168.100.10",
                "rdma_devices": ["rocep1s0f0", "roceP2p1s0f0"]},
}
# Qwen3.5-122B-A10B's text_config (../shared/FORMATS.md): 32 heads, 2 KV heads, 48 layers, 16/64
# linear heads.
QWEN35_122B = {"model_type": "qwen3_5_moe", "text_config": {
    "num_attention_heads": 32, "num_key_value_heads": 2, "num_hidden_layers": 48,
    "linear_num_key_heads": 16, "linear_num_value_heads": 64}}


def place(me: str, spec: Any = None, members: Any = None, speculative: str | None = None,
          accelerator: str = "gb10") -> dict[str, Any] | None:
    return resolve_cluster(SPEC if spec is None else spec, MEMBERS if members is None else members,
                           me, speculative=speculative, accelerator=accelerator)


def test_head_is_rank_0_whatever_the_inventory_order() -> None:
    head, worker = place("spark01"), place("spark02")
    assert head and worker
    assert (head["rank"], worker["rank"]) == (0, 1)
    assert [m["host"] for m in head["members"]] == ["spark01", "spark02"]
    assert head["args"] == ["--nnodes", "2", "--node-rank", "0", "--master-addr", "192.168.100.10",
                            "--master-port", "29501", "--tensor-parallel-size", "2",
                            "--pipeline-parallel-size", "1"]
    assert worker["args"] == [*head["args"][:3], "1", *head["args"][4:], "--headless"]
    assert head["peers"] == ["spark02=192.168.100.11:29502"]
    assert worker["peers"] == ["spark01=192.168.100.10:29502"]
    assert worker["listen"] == "192.168.100.11:29502"


def test_link_environment_names_the_port_and_both_roce_devices() -> None:
    env = place("spark02")["env"]  # type: ignore[index]
    assert env["VLLM_HOST_IP"] == "192.168.100.11"
    for name in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "UCX_NET_DEVICES",
                 "OMPI_MCA_btl_tcp_if_include"):
        assert env[name] == "enp1s0f0np0"
    assert (env["NCCL_IB_HCA"], env["NCCL_IB_DISABLE"], env["NCCL_IGNORE_CPU_AFFINITY"]) == \
        ("rocep1s0f0,roceP2p1s0f0", "0", "1")
    sockets = copy.deepcopy(MEMBERS)
    sockets["spark02"]["rdma_devices"] = []
    env = place("spark02", members=sockets)["env"]  # type: ignore[index]
    assert env["NCCL_IB_DISABLE"] == "1" and "NCCL_IB_HCA" not in env


def test_no_cluster_is_none() -> None:
    assert resolve_cluster({}, {}, "spark01", speculative=None, accelerator="gb10") is None


def _members(**changes: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(MEMBERS)
    for host, change in changes.items():
        out[host] = {**out[host], **change} if change else None
    return out


@pytest.mark.parametrize(("spec", "members", "me", "speculative", "accel", "expect"), [
    (SPEC, _members(spark02={"role": "head"}), "spark01", None, "gb10",
     "2 heads (spark02, spark01)"),
    (SPEC, _members(spark01={"role": "worker"}), "spark01", None, "gb10", "no head"),
    (SPEC, _members(spark02={}), "spark01", None, "gb10",
     "sparkspec_cluster_node of spark02: missing"),
    (SPEC, _members(spark02={"role": "leader"}), "spark01", None, "gb10", "is not head or worker"),
    ({**SPEC, "nnodes": 3, "tensor_parallel_size": 3}, MEMBERS, "spark01", None, "gb10",
     "is 3 and the group has 2 hosts"),
    ({**SPEC, "tensor_parallel_size": 1}, MEMBERS, "spark01", None, "gb10",
     "set tensor_parallel_size: 2"),
    ({**SPEC, "tensor_parallel_size": 1, "pipeline_parallel_size": 2}, MEMBERS, "spark01", "mtp",
     "gb10", "speculative decoding across nodes needs tensor parallel"),
    ({**SPEC, "tensor_parallel_size": 1, "pipeline_parallel_size": 2}, MEMBERS, "spark01", None,
     "none", "AssertionError in sync_and_gather_intermediate_tensors"),
    ({**SPEC, "backend": "slurm"}, MEMBERS, "spark01", None, "gb10", "is not a backend; use mp"),
    ({**SPEC, "ray_port": 29502}, MEMBERS, "spark01", None, "gb10", "is also peer_port"),
    ({**SPEC, "ray_object_store_mb": 10}, MEMBERS, "spark01", None, "gb10", "ray_object_store_mb"),
    ({**SPEC, "peer_port": 29501}, MEMBERS, "spark01", None, "gb10", "also master_port"),
    ({**SPEC, "lost_after": 90}, MEMBERS, "spark01", None, "gb10", "lost_after"),
    ({**SPEC, "group": "spark cluster"}, MEMBERS, "spark01", None, "gb10",
     "not an inventory group name"),
    ({**SPEC, "tensor_parallell_size": 2}, MEMBERS, "spark01", None, "gb10",
     "did you mean tensor_parallel_size"),
    (SPEC, MEMBERS, "spark03", None, "gb10",
     "spark03 sets sparkspec_cluster but is not in the group"),
    (SPEC, {}, "spark01", None, "gb10", "the group has no hosts"),
    (SPEC, {**MEMBERS, "spark 03; x": MEMBERS["spark02"]}, "spark01", None, "gb10",
     "is not a host name the peer check takes"),
    (SPEC, _members(spark02={"address": "192.168.100.10"}), "spark01", None, "gb10",
     "is also spark02's"),
    (SPEC, _members(spark02={"address": "spark01.lan"}), "spark01", None, "gb10",
     "is not an IP address"),
    (SPEC, _members(spark02={"interface": "eth0 --x"}), "spark01", None, "gb10",
     "not a network interface"),
    (SPEC, _members(spark02={"interface": "a/b"}), "spark01", None, "gb10",
     "not a network interface"),
    (SPEC, _members(spark02={"rdma_devices": "rocep1s0f0"}), "spark01", None, "gb10",
     "list of RDMA device"),
    (SPEC, _members(spark02={"rdma_devices": ["x,y"]}), "spark01", None, "gb10",
     "list of RDMA device"),
])
def test_bad_cluster_is_one_line_naming_the_fix(spec: Any, members: Any, me: str,
                                                speculative: str | None, accel: str,
                                                expect: str) -> None:
    with pytest.raises(UserError) as info:
        place(me, spec, members, speculative, accel)
    assert expect in str(info.value) and "\n" not in str(info.value)


def test_layout_against_the_122b() -> None:
    layout = {**place("spark01"), "group": "spark_cluster"}  # type: ignore[dict-item]
    check_layout(layout, QWEN35_122B, "qwen3.5-122b")                     # TP 2: fits
    # 2 KV heads replicated over 4
    check_layout({**layout, "tensor_parallel_size": 4}, QWEN35_122B, "m")
    with pytest.raises(UserError, match="does not divide qwen3.5-122b's 32 attention heads"):
        check_layout({**layout, "tensor_parallel_size": 3}, QWEN35_122B, "qwen3.5-122b")
    with pytest.raises(UserError, match="one must divide the other"):
        check_layout(layout, {"num_attention_heads": 6, "num_key_value_heads": 3,
                              "num_hidden_layers": 2}, "m")
    with pytest.raises(UserError, match="linear_num_key_heads"):
        check_layout({**layout, "tensor_parallel_size": 32}, QWEN35_122B, "m")
    with pytest.raises(UserError, match="more than m's 2 layers"):
        check_layout({**layout, "tensor_parallel_size": 1, "pipeline_parallel_size": 3},
                     {"num_attention_heads": 4, "num_hidden_layers": 2}, "m")
    with pytest.raises(UserError, match="config.json has no"):
        check_layout(layout, {"architectures": ["X"]}, "m")


def _resolved(me: str, method: str = "baseline") -> dict[str, Any]:
    contract = {**small_contract(), "cluster": SPEC, "method": method}
    return registry.resolve(contract, cluster={"me": me, "members": MEMBERS, "accelerator": "gb10"})


def test_vllm_command_head_serves_http_worker_is_headless() -> None:
    service = {"unit": "u", "bind_address": "0.0.0.0", "port": 8000, "user": "sparkspec"}
    head = registry.vllm_command(_resolved("spark01", "ngram"), service)
    worker = registry.vllm_command(_resolved("spark02", "ngram"), service)
    model = head["args"][0]
    # `vllm serve MODEL`: --model refused
    assert model.startswith("/") and "--model" not in head["args"]
    assert (head["args"][head["args"].index("--port") + 1] == "8000"
            and "--headless" not in head["args"])
    assert "--port" not in worker["args"] and "--host" not in worker["args"]
    assert worker["args"][-1] == "--headless"
    assert "--speculative-config" in worker["args"]  # every rank runs the same engine config
    assert head["record"]["url"] == "http://127.0.0.1:8000" and worker["record"]["url"] == ""
    assert worker["record"]["cluster"]["head"] == {"host": "spark01", "address": "192.168.100.10"}
    assert worker["env"]["VLLM_HOST_IP"] == "192.168.100.11"
    assert head["env"]["VLLM_HOST_IP"] == "192.168.100.10"


def test_single_host_is_unchanged() -> None:
    resolved = registry.resolve(small_contract())
    assert resolved["cluster"] is None
    args = registry.vllm_command(resolved, {"unit": "u", "bind_address": "127.0.0.1", "port": 8000,
                                            "user": "sparkspec"})["args"]
    assert args[0] == "--model" and "--nnodes" not in args


@pytest.mark.parametrize("me", ["spark01", "spark02"])
def test_unit_runs_vllm_serve_under_the_peer_check(me: str) -> None:
    text, argv = render_resolved(_resolved(me, "ngram"))
    service = {k: v for section, k, v in unit_entries(text) if section == "Service"}
    assert exec_command(service["ExecStart"]).exec_argv() == argv
    assert argv[1:3] == ["cluster", "supervise"] and argv[argv.index("--") + 2] == "serve"
    assert service["RestartPreventExitStatus"] == "4"
    entries = [(k, v) for section, k, v in unit_entries(text) if section == "Service"]
    assert (("LimitMEMLOCK", "infinity") in entries
            and ("DeviceAllow", "char-infiniband_verbs rw") in entries)
