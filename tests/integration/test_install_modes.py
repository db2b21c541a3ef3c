"""Each install mode with spark01's settings (the example inventory, the roles' real defaults): the
vLLM fit (roles/vllm_install/tasks/fit.yml) passes, or refuses in one line naming the knob, before
any download. It runs here over Ansible's local connection, with a stand-in CUDA toolkit and
stand-in venvs (docs/design.md "Module notes")."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.lib.play import PlayResult, failure_summary, run_playbook
from tests.integration.test_vllm_build_badinput import toolkit

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "inventories" / "example"
HOST = "spark01"


def _example_host(name: str) -> dict[str, Any]:
    hosts = yaml.safe_load(
        (EXAMPLE / "hosts.yml").read_text())["all"]["children"]["sparks"]["hosts"]
    host_vars = EXAMPLE / "host_vars" / f"{name}.yml"
    return {**{k: v for k, v in hosts[name].items() if not k.startswith("ansible_")},
            **(yaml.safe_load(host_vars.read_text()) if host_vars.is_file() else {})}


def fit(tmp_path: Path, like: str = "spark01", **extra: Any) -> PlayResult:
    """vllm_install's fit for a host set up like the example's `like`, with ``extra`` as extra
    vars."""
    host = {**yaml.safe_load((EXAMPLE / "group_vars/all/main.yml").read_text()),
            **_example_host(like),
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "ansible_become": False,
            "sparkspec_home": str(tmp_path / "home"),
            "sparkspec_models_dir": str(tmp_path / "models"),
            "sparkspec_vllm_venv": str(tmp_path / "venvs" / "vllm"),
            "sparkspec_unit_name": "sparkspec-fit-test"}
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"sparks": {"hosts": {HOST: host}}}}}))
    playbook = tmp_path / "fit.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "The vLLM fit", "hosts": "sparks", "gather_facts": False,
        "tasks": [{"name": "Fit",
                   "ansible.builtin.import_role": {"name": "vllm_install", "tasks_from": "fit"}},
                  {"name": "Keep what the probe read", "ansible.builtin.copy": {
                      "dest": str(tmp_path / "probe.json"), "mode": "0600",
                      "content": "{{ _vllm_install_fit_probe.stdout | default('{}') }}"}}]}]))
    return run_playbook(playbook, inventory, HOST, extra_vars=extra, quiet=True)


def refused(result: PlayResult) -> str:
    assert result.rc != 0, "the fit passed"
    line = failure_summary(result, HOST)
    assert "\n" not in line.strip(), line
    return line


def _staged_gb(host: str) -> float:
    """The disk_gb of every profile the example inventory stages on host (the registry's sum)."""
    inv = ROOT / "inventories/example"
    profiles = yaml.safe_load(
        (inv / "group_vars/all/main.yml").read_text())["sparkspec_profiles"]
    hosts = yaml.safe_load(
        (inv / "hosts.yml").read_text())["all"]["children"]["sparks"]["hosts"]
    staged = hosts[host].get("sparkspec_stage_profiles") or [hosts[host]["sparkspec_profile"]]
    return float(sum(profiles[p]["disk_gb"] for p in staged))


def passed(result: PlayResult) -> None:
    assert result.rc == 0, failure_summary(result, HOST)


# The models on another filesystem than the build (tmpfs): the example's profiles need 260 GB, more
# than this machine's disk has, and the fit counts the build and the models together only where they
# share one.
OTHER_FS = "/dev/shm/sparkspec-fit-test-models"


def source_knobs(tmp_path: Path) -> dict[str, Any]:
    """vllm_build's folders under tmp_path and a stand-in CUDA 13.0 toolkit; every other knob its
    default."""
    return {"vllm_install_mode": "source", "vllm_build_work_dir": str(tmp_path / "work"),
            "vllm_build_root": str(tmp_path / "builds"), "vllm_build_python": sys.executable,
            "vllm_build_cuda_home": str(toolkit(tmp_path, "13.0")), "vllm_build_max_jobs": 1,
            "vllm_build_min_free_disk_gb": 0, "sparkspec_models_dir": OTHER_FS}


def fake_venv(tmp_path: Path, vllm: str = "0.32.0", cuda: str | None = "13.0") -> Path:
    """A venv at sparkspec_vllm_venv with a stand-in vllm (its dist-info) and torch
    (torch/version.py)."""
    venv = tmp_path / "venvs" / "vllm"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python3*/site-packages")
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text("")
    (site / f"vllm-{vllm}.dist-info").mkdir()
    (site / f"vllm-{vllm}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm}\n")
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("")
    (site / "torch" / "version.py").write_text(f"__version__ = '2.13.0'\ncuda = {cuda!r}\n")
    return venv


# --- the default, and each mode -------------------------------------------------------------------
def test_a_fresh_spark_is_told_which_mode_to_pick(tmp_path: Path) -> None:
    line = refused(fit(tmp_path))
    assert f"no vLLM in {tmp_path}/venvs/vllm" in line
    assert "vllm_install_mode is existing" in line
    assert "set vllm_install_mode to wheel (vllm==0.32.0 from the package index" in line
    assert "or source" in line


def test_wheel_mode_with_the_defaults_fits(tmp_path: Path) -> None:
    passed(fit(tmp_path, vllm_install_mode="wheel"))
    # nothing was made
    assert not (tmp_path / "venvs").exists() and not (tmp_path / "models").exists()


def test_source_mode_with_the_defaults_fits(tmp_path: Path) -> None:
    knobs = source_knobs(tmp_path)
    passed(fit(tmp_path, **knobs))
    assert (not Path(knobs["vllm_build_work_dir"]).exists()
            and not Path(knobs["vllm_build_root"]).exists())


def test_existing_mode_on_a_built_venv_fits_a_plain_profile(tmp_path: Path) -> None:
    fake_venv(tmp_path)
    passed(fit(tmp_path, like="spark02", vllm_install_mode="existing"))
    # read as the service user would: vLLM 0.32.0, a CUDA torch, and no fastsafetensors (the deploy
    # then serves --load-format auto and says so: test_load_format_falls_back)
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert probe["versions"]["vllm"] == "0.32.0" and probe["versions"]["cuda"] == "13.0"
    assert probe["modules"] == {"fastsafetensors": False}


# --- bad input ------------------------------------------------------------------------------------
def test_a_hybrid_profile_on_a_vllm_the_inc_patch_does_not_fit(tmp_path: Path) -> None:
    line = refused(fit(tmp_path, vllm_install_mode="wheel", vllm_install_package="vllm==0.20.1"))
    assert line.endswith("the INC patch vllm-0.32.0-inc-mixed-fp8.patch fits vLLM 0.31.0, "
                         "0.32.0, 0.33.0, 0.34.0, not vLLM 0.20.1 (vllm_install_mode wheel), and "
                         "the profile(s) qwen35-122b-hybrid need it (FP8 layers, vLLM #46311); set "
                         "vllm_install_package to vllm==0.32.0, or set "
                         "vllm_install_inc_patch: false if that vLLM has its own fix")


def test_a_plain_profile_does_not_need_the_inc_patch(tmp_path: Path) -> None:
    """The served release's INC patch stood in for by one that fits another release only."""
    fits = {"_vllm_install_inc_patch_fits": ["0.31.0"]}
    passed(fit(tmp_path, like="spark02", vllm_install_mode="wheel", **fits))
    assert "fits vLLM 0.31.0, not vLLM 0.32.0" in refused(
        fit(tmp_path, vllm_install_mode="wheel", **fits))


def test_a_pin_of_another_release_than_the_served_one(tmp_path: Path) -> None:
    url = "https://files.pythonhosted.org/packages/x/vllm-0.31.0.tar.gz"
    line = refused(fit(tmp_path, **source_knobs(tmp_path), vllm_build_tarball_url=url))
    assert line.endswith("vLLM 0.31.0 (vllm_install_mode source: the source tarball or git ref) "
                         "is not the release this host serves, 0.32.0 (sparkspec_vllm_release, or "
                         "a switch recorded on the host); drop the pin (the default follows the "
                         "release) or pin 0.32.0")
    line = refused(fit(tmp_path, like="spark02", vllm_install_mode="wheel",
                       vllm_install_package="vllm==0.33.0"))
    assert "vLLM 0.33.0 (vllm_install_mode wheel: vllm_install_package) is not the release" in line
    fake_venv(tmp_path, vllm="0.31.0")
    line = refused(fit(tmp_path, like="spark02", vllm_install_mode="existing"))
    assert line.endswith("is not the release this host serves, 0.32.0 (sparkspec_vllm_release, or "
                         "a switch recorded on the host); set sparkspec_vllm_release: 0.31.0 if "
                         "sparkspec knows that release, or install 0.32.0 there")


def test_a_release_the_index_lacks_a_pin_of(tmp_path: Path) -> None:
    """vLLM 0.34.0's wheel pins flashinfer-python 0.7.3, which the index does not serve."""
    line = refused(fit(tmp_path, like="spark02", vllm_install_mode="wheel",
                       sparkspec_vllm_release="0.34.0"))
    assert line.startswith("vLLM 0.34.0 needs flashinfer-python==0.7.3, which the package index "
                           "does not serve")
    passed(fit(tmp_path, like="spark02", vllm_install_mode="wheel",
               sparkspec_vllm_release="0.34.0",
               sparkspec_pip_env={"PIP_EXTRA_INDEX_URL": "https://flashinfer.ai/whl/cu130/"}))


def test_the_build_and_the_models_on_one_disk(tmp_path: Path) -> None:
    """Each fits alone (the build's guard: free >= its floor); together they do not."""
    free_gb = shutil.disk_usage(tmp_path).free / 1e9
    knobs = {**source_knobs(tmp_path), "sparkspec_models_dir": str(tmp_path / "models"),
             # room for other tests' writes meanwhile
             "vllm_build_min_free_disk_gb": int(free_gb) - 10}
    line = refused(fit(tmp_path, **knobs))
    assert f"{tmp_path}/work and {tmp_path}/models share a filesystem with" in line
    assert (f"the build needs {int(free_gb) - 10} GB (vllm_build_min_free_disk_gb) and the staged "
            f"profiles {float(_staged_gb('spark01'))} GB more") in line
    assert not (tmp_path / "work").exists() and not (tmp_path / "models").exists()


@pytest.mark.parametrize(("package", "why"), [
    ("vllm", 'vllm_install_package "vllm" names no vLLM version'),
    ("vllm>=0.32", 'vllm_install_package "vllm>=0.32" names no vLLM version'),
])
def test_a_wheel_without_a_version(tmp_path: Path, package: str, why: str) -> None:
    assert why in refused(fit(tmp_path, vllm_install_mode="wheel", vllm_install_package=package))


def test_a_wheel_file_gives_its_version(tmp_path: Path) -> None:
    passed(fit(tmp_path, vllm_install_mode="wheel",
               vllm_install_package="/srv/wheels/"
                                    "vllm-0.32.0+cu130-cp38-abi3-manylinux_2_28_aarch64.whl"))
    line = refused(fit(tmp_path, vllm_install_mode="wheel",
                       vllm_install_package="/srv/wheels/"
                                            "vllm-0.31.1-cp38-abi3-manylinux_2_28_aarch64.whl"))
    assert "not vLLM 0.31.1" in line


def test_an_existing_venv_without_the_inc_patch(tmp_path: Path) -> None:
    fake_venv(tmp_path)
    line = refused(fit(tmp_path, vllm_install_mode="existing"))
    assert (f"vLLM in {tmp_path}/venvs/vllm lacks the INC patch that the profile(s) "
            "qwen35-122b-hybrid need") in line
    assert "set vllm_install_patch_existing: true" in line


def test_an_existing_venv_with_a_cpu_torch_on_a_spark(tmp_path: Path) -> None:
    fake_venv(tmp_path, cuda=None)
    line = refused(fit(tmp_path, like="spark02", vllm_install_mode="existing"))
    assert line.endswith(f"torch 2.13.0 in {tmp_path}/venvs/vllm is not a CUDA build; reinstall "
                         "the CUDA torch there (docs/building-vllm.md) or set vllm_install_mode to "
                         "wheel or source")


@pytest.mark.parametrize(("knobs", "why"), [
    ({"vllm_build_torch_index_url": "https://user:secret@mirror.example/simple"},
     "carries credentials"),
    ({"vllm_build_torch_index_url": "mirror.example/simple"},
     "is not an http(s) or file URL of a package index"),
    ({"vllm_build_torch": "torch"}, 'vllm_build_torch "torch" is not a pin'),
    ({"vllm_build_fa_commit": "main"}, 'vllm_build_fa_commit "main" is not a commit id'),
    ({"vllm_build_torch_index_url": "https://mirror.example/simple\n--trusted-host x"},
     "is not an http(s) or file URL"),
    ({"vllm_build_fa_git_url": "--upload-pack=touch /tmp/owned"},
     'the repository URL "--upload-pack=touch /tmp/owned"'),
    ({"vllm_build_source": "git", "vllm_build_git_url": "-oProxyCommand=x"},
     'the repository URL "-oProxyCommand=x"'),
])
def test_source_knobs_refused_before_any_download(tmp_path: Path, knobs: dict[str, Any],
                                                   why: str) -> None:
    line = refused(fit(tmp_path, **source_knobs(tmp_path), **knobs))
    assert why in line
    assert "secret" not in line
    assert not (tmp_path / "work").exists()


# --- where the fit runs ---------------------------------------------------------------------------
@pytest.mark.parametrize("play", ["provision.yml", "deploy.yml"])
def test_the_fit_runs_right_after_preflight(play: str) -> None:
    tasks = yaml.safe_load((ROOT / "playbooks" / play).read_text())[0]["tasks"]
    roles = [(t["ansible.builtin.import_role"]["name"],
              t["ansible.builtin.import_role"].get("tasks_from"), t.get("tags"))
             for t in tasks if "ansible.builtin.import_role" in t]
    assert roles[:2] == [("preflight", None, ["preflight", "always"]),
                         ("vllm_install", "fit", ["preflight", "always"])]
    names = [r[0] for r in roles]
    assert "checkpoint_fetch" not in names or names.index("checkpoint_fetch") > 1


# --- the deploy's load format ---------------------------------------------------------------------
@pytest.mark.parametrize(("found", "knob", "served"), [
    # the venv lacks it: fall back
    ({"modules": {"fastsafetensors": False}}, "fastsafetensors", "auto"),
    ({"modules": {"fastsafetensors": True}}, "fastsafetensors", "fastsafetensors"),
    # no reading of the venv (invoke render): the knob stands
    (None, "fastsafetensors", "fastsafetensors"),
    ({"modules": {"fastsafetensors": False}}, "safetensors", "safetensors"),
])
def test_load_format_falls_back(tmp_path: Path, found: dict[str, Any] | None, knob: str,
                                served: str) -> None:
    expression = yaml.safe_load(
        (ROOT / "roles/deploy/vars/main.yml").read_text())["_deploy_load_format"]
    out = tmp_path / "served"
    playbook = tmp_path / "load_format.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "The deploy's load format", "hosts": "localhost", "gather_facts": False,
        "vars": {"sparkspec_resolved": {"serve": {"load_format": knob}},
                 "_deploy_load_format": expression,
                 **({"_vllm_install_found": found} if found is not None else {})},
        "tasks": [{"name": "Write it",
                   "ansible.builtin.copy": {"dest": str(out), "mode": "0600",
                                            "content": "{{ _deploy_load_format }}"}}]}]))
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}}))
    passed(run_playbook(playbook, inventory, "localhost", quiet=True))
    assert out.read_text().strip() == served
