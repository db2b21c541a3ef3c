"""The path vllm_build takes on a Spark, with the role's real defaults: what cannot run here (a CUDA
build of vLLM) is checked as invariants of the environment and the command sequence the role would
run, not as a golden copy.

- The environment: the role's own expressions (roles/vllm_build/vars/main.yml, the job count of its
  preflight, the pip options of the contract role) rendered by Ansible for a Spark's facts (119 GB
  available), without and with an air-gapped mirror.
- The sequence: the role's task files read in the order tasks/main.yml imports them, each pip step
  expanded, so a reordering, a pip call outside the guarded step or a lost flag fails here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.lib.play import run_playbook

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "vllm_build"
SPARK_MEM_AVAILABLE_GB = 119.0   # a GB10's 128 GB less the system's share
# the stamp's venv (vllm_build_root from the defaults)
VENV = "/opt/sparkspec/vllm-builds/vllm-0123456789ab"


def _task(path: Path, name: str) -> dict[str, Any]:
    return next(t for t in yaml.safe_load(path.read_text()) if t.get("name") == name)


def render(tmp_path: Path, **extra: object) -> dict[str, Any]:
    """The compile's and the pip steps' environments as the role computes them for a Spark."""
    out = tmp_path / "rendered.json"
    facts = {"mem_available_gb": SPARK_MEM_AVAILABLE_GB, "cuda": "13.0", "disk_free_gb": 400}
    tasks = [
        _task(ROOT / "roles/sparkspec/tasks/pip_config.yml", "Point pip at its options file"),
        _task(ROLE / "tasks/guards.yml", "Set what the guards read"),
        {"name": "Write what the role would use", "ansible.builtin.copy": {
            "dest": str(out), "mode": "0600",
            "content": "{{ {'env': _vllm_build_env, 'pip_env': _vllm_build_pip_env, "
                       "'sass': _vllm_build_sass, 'jobs': _vllm_build_jobs} | to_json }}"}},
    ]
    playbook = tmp_path / "render.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "Render vllm_build for a Spark", "hosts": "localhost", "gather_facts": False,
        "vars_files": [str(ROOT / "roles/sparkspec/defaults/main.yml"),
                       str(ROLE / "defaults/main.yml"), str(ROLE / "vars/main.yml")],
        "vars": {"_vllm_build_facts_probe": {"stdout": json.dumps(facts)}, "_vllm_build_venv": VENV,
                 "_vllm_build_stamp12": "0123456789ab", "role_path": str(ROLE)},
        "tasks": tasks}], sort_keys=False))
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    # a site's index for the CUDA torch (extra vars: the contract's defaults file would win over
    # play vars)
    extra = {"sparkspec_pip_env": {"PIP_INDEX_URL": "https://x/simple"}, **extra}
    result = run_playbook(playbook, inventory, "localhost", extra_vars=extra, quiet=True)
    assert result.rc == 0, result
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return render(tmp_path_factory.mktemp("spark"))


def test_the_compile_environment_on_a_spark(spark: dict[str, Any]) -> None:
    env, defaults = spark["env"], yaml.safe_load((ROLE / "defaults/main.yml").read_text())
    cuda = defaults["vllm_build_cuda_home"]
    assert env["VLLM_TARGET_DEVICE"] == "cuda"
    assert env["TORCH_CUDA_ARCH_LIST"] == "12.1a" and spark["sass"] == "sm_121a"
    assert env["CUDA_HOME"] == cuda and env["TRITON_PTXAS_PATH"] == f"{cuda}/bin/ptxas"
    # this nvcc, this venv's python and pip
    assert env["PATH"].split(":")[:2] == [f"{cuda}/bin", f"{VENV}/bin"]
    # MemAvailable / 8 GB a job, and setup.py runs MAX_JOBS / NVCC_THREADS nvcc processes of
    # NVCC_THREADS each
    assert spark["jobs"] == int(SPARK_MEM_AVAILABLE_GB // 8) == 14 and env["MAX_JOBS"] == "14"
    assert env["NVCC_THREADS"] == "2"
    assert env["CCACHE_DIR"] == defaults["vllm_build_ccache_dir"]
    # downloads stay on without a mirror; the one source folder forced is the stamp's
    # flash-attention copy, whose arch lists the role edited (vLLM's own fetch would build FA2
    # without sm_121a)
    assert "FETCHCONTENT" not in env["CMAKE_ARGS"]
    assert {k: v for k, v in env.items() if k.endswith("_SRC_DIR")} == \
        {"VLLM_FLASH_ATTN_SRC_DIR": "/var/tmp/sparkspec-vllm-build/fa-0123456789ab"}


def test_torch_is_pinned_on_every_pip_call(spark: dict[str, Any]) -> None:
    constraint = f"{VENV}/sparkspec-constraints.txt"
    for name in ("env", "pip_env"):   # the compile (pip wheel) and every pip step
        assert spark[name]["PIP_CONSTRAINT"] == constraint, name
        # the index: never on a command line
        assert spark[name]["PIP_CONFIG_FILE"].endswith("/pip.conf"), name
        assert not [v for v in spark[name].values() if "https://x/simple" in v], name


def test_an_air_gapped_spark_builds_every_dependency_from_the_mirror(tmp_path: Path) -> None:
    env = render(tmp_path, vllm_build_mirror_dir="/srv/vllm-mirror")["env"]
    assert "-DFETCHCONTENT_FULLY_DISCONNECTED=ON" in env["CMAKE_ARGS"].split()
    wanted = yaml.safe_load((ROLE / "defaults/main.yml").read_text())["vllm_build_mirror_src_dirs"]
    # every one from the mirror, but flash-attention: the stamp's copy of the mirror's, edited
    # (tasks/patch.yml)
    assert {k: v for k, v in env.items() if k.endswith("_SRC_DIR")} == \
        {**{k: f"/srv/vllm-mirror/{sub}" for k, sub in wanted.items()},
         "VLLM_FLASH_ATTN_SRC_DIR": "/var/tmp/sparkspec-vllm-build/fa-0123456789ab"}


# --- the sequence ---------------------------------------------------------------------------------
def _walk(tasks: list[dict[str, Any]], file: str,
          extra_vars: dict[str, Any]) -> list[dict[str, Any]]:
    """The tasks in the order they run, blocks opened and task files followed; each step carries the
    file it is in and the vars of the include it came through."""
    steps: list[dict[str, Any]] = []
    for task in tasks:
        include = (task.get("ansible.builtin.import_tasks")
                   or task.get("ansible.builtin.include_tasks"))
        if include:
            steps += _walk(yaml.safe_load((ROLE / "tasks" / include).read_text()), include,
                           {**extra_vars, **task.get("vars", {})})
        elif "block" in task:
            steps += _walk(task["block"] + task.get("rescue", []), file, extra_vars)
        else:
            steps.append({**task, "_file": file, "_vars": extra_vars})
    return steps


def _argv(step: dict[str, Any]) -> list[str]:
    for module in ("ansible.builtin.command", "sparkspec_progress"):
        if module in step:
            argv = step[module].get("argv", [])
            return argv if isinstance(argv, list) else [argv]
    return []


@pytest.fixture(scope="module")
def sequence() -> list[dict[str, Any]]:
    return _walk(yaml.safe_load((ROLE / "tasks/main.yml").read_text()), "main.yml", {})


def _index(sequence: list[dict[str, Any]], what: str, match: Any) -> int:
    found = [i for i, step in enumerate(sequence) if match(step)]
    assert found, f"no step {what} in the role"
    return found[0]


def test_the_stages_run_in_the_recipes_order(sequence: list[dict[str, Any]]) -> None:
    def pip(args_start: str) -> Any:
        return lambda s: s["_file"] == "pip_step.yml" and "sparkspec_progress" in s and \
            str(s["_vars"].get("_vllm_build_pip_args", [""])[1:2]).find(args_start) >= 0

    order = [
        ("the guards", lambda s: s.get("name") == "Check CUDA"),
        ("the system packages", lambda s: "ansible.builtin.apt" in s),
        ("the download", lambda s: "ansible.builtin.get_url" in s),
        ("flash-attention's clone", lambda s: "ansible.builtin.git" in s
         and s["ansible.builtin.git"]["version"] == "{{ vllm_build_fa_commit }}"),
        ("the unpack", lambda s: "ansible.builtin.unarchive" in s),
        ("the patch series", lambda s: _argv(s)[:1] == ["patch"]),
        ("flash-attention's copy",
         lambda s: "_vllm_build_fa_src" in str(s.get("ansible.builtin.shell", {}))),
        ("flash-attention's arch edit", lambda s: "fa-archs" in _argv(s)),
        ("use_existing_torch.py", lambda s: "{{ vllm_build_use_existing_torch }}" in _argv(s)),
        ("dropping FlashInfer", lambda s: "ansible.builtin.lineinfile" in s),
        ("the venv", lambda s: _argv(s)[1:3] == ["-m", "venv"]),
        ("the torch constraint",
         lambda s: str(s.get("ansible.builtin.copy", {}).get("dest", "")).endswith(
             "sparkspec-constraints.txt")),
        ("the torch install", pip("vllm_build_torch")),
        ("the build requirements", pip("-r")),
        ("the compile", lambda s: "wheel" in _argv(s)),
        ("FlashInfer into the wheelhouse",
         lambda s: s["_file"] == "pip_step.yml" and "sparkspec_progress" in s
         and str(s["_vars"].get("_vllm_build_pip_args", "")).startswith(
             "{{ ['wheel', '--no-deps'")),
        ("the wheel install", pip("_vllm_build_wheel.files[0].path")),
        ("FlashInfer from the wheelhouse",
         lambda s: s["_file"] == "pip_step.yml" and "sparkspec_progress" in s
         and str(s["_vars"].get("_vllm_build_pip_args", "")).startswith(
             "{{ ['install', '--find-links'")),
        ("the import as the service user",
         lambda s: s.get("become_user") == "{{ sparkspec_user }}"),
        ("the SASS check", lambda s: "sass" in _argv(s)),
        ("the record", lambda s: str(s.get("ansible.builtin.copy", {}).get("dest", "")).endswith(
            "sparkspec-build.json")),
        ("the switch", lambda s: s.get("name") == "Point the unit's venv at the checked build"),
    ]
    at = [_index(sequence, what, match) for what, match in order]
    assert at == sorted(at), [what for _, (what, _) in sorted(zip(at, order, strict=True))]


def test_no_build_isolation_and_nothing_but_the_wheel_in_the_compile(
        sequence: list[dict[str, Any]]) -> None:
    compiles = [s for s in sequence if "wheel" in _argv(s)]
    assert len(compiles) == 1
    argv = compiles[0]["sparkspec_progress"]["argv"]
    assert argv[argv.index("-m"):argv.index("-m") + 3] == ["-m", "pip", "wheel"]
    # the venv that holds the CUDA torch
    assert argv[argv.index("-m") - 1] == "{{ _vllm_build_venv }}/bin/python"
    assert {"--no-build-isolation", "--no-deps"} <= set(argv)
    assert compiles[0]["environment"] == "{{ _vllm_build_env }}"


def test_every_pip_call_is_a_guarded_step(sequence: list[dict[str, Any]]) -> None:
    """pip changes a venv in two places only: the compile, and pip_step.yml, whose every run is
    followed by the torch guard (torch still the pinned CUDA build, else the failure names the
    step); a cluster's reads of a venv's packages (`pip list --format=freeze`, tasks/cluster.yml)
    change nothing."""
    calls = [s for s in sequence if "pip" in _argv(s) or "ansible.builtin.pip" in s]
    reads = [s for s in calls if _argv(s)[-3:-1] == ["list", "--format=freeze"]]
    assert [s["_file"] for s in reads] == ["cluster.yml", "cluster.yml"]
    assert calls and all(s["_file"] == "pip_step.yml" or "wheel" in _argv(s) or s in reads
                         for s in calls), [s.get("name") for s in calls]
    steps = yaml.safe_load((ROLE / "tasks/pip_step.yml").read_text())
    assert [list(k for k in s if k.startswith(("ansible.", "sparkspec_")))[0] for s in steps] == \
        ["sparkspec_progress", "ansible.builtin.assert", "ansible.builtin.command",
         "ansible.builtin.assert"]
    assert steps[0]["environment"] == (
        "{{ _vllm_build_pip_env | combine(_vllm_build_step_env | default({})) }}")
    assert _argv(steps[2])[2] == "torch"
    assert "_vllm_build_torch_req_pin[1]" in steps[3]["ansible.builtin.assert"]["that"]
    included = [s for s in sequence if s["_file"] == "pip_step.yml" and "sparkspec_progress" in s]
    # the head: torch, the build requirements, FlashInfer's wheels, vLLM's wheel, FlashInfer; a
    # cluster's worker (tasks/cluster.yml): torch, the head's vLLM wheel, the head's other wheels
    assert len(included) == 8
    # the torch index reaches the torch step alone (no other step gains an index: dependency
    # confusion)
    with_index = [s["_vars"]["_vllm_build_pip_args"] for s in included
                  if "_vllm_build_step_env" in s["_vars"]]
    assert with_index == [["install", "{{ _vllm_build_torch_req }}"]] * 2
    assert "'PIP_INDEX_URL': vllm_build_torch_index_url" in next(
        s["_vars"]["_vllm_build_step_env"] for s in included
        if "_vllm_build_step_env" in s["_vars"])
