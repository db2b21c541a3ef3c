"""Bad input to the vllm_build role (playbooks/build-vllm.yml), through the role as a user runs it:
each refusal is one line naming the knob and the fix, and comes before the host changes (no work
folder, no build venv, the unit's venv link untouched), or, for a source that cannot be fetched,
before anything is unpacked or built.

The play runs on this machine over Ansible's local connection, with every folder of the role under a
temporary root. What cannot exist here is a CUDA toolkit at another version: the toolkits below are
folders whose bin/nvcc prints what a real nvcc of that release prints for --version (the only thing
the guards run), next to ptxas and cuobjdump files, which the guards only look for.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from tasks.lib.play import PlayResult, failure_summary, run_playbook
from tests.support.torch_standin import buildenv

ROOT = Path(__file__).resolve().parents[2]
HOST = "localhost"
NVCC_VERSION = """\
nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release {release}, V{release}.{patch}
Build cuda_{release}.r{release}/compiler.36424714_0
"""


def toolkit(root: Path, release: str,
            tools: tuple[str, ...] = ("nvcc", "ptxas", "cuobjdump")) -> Path:
    """A CUDA home whose bin/nvcc answers --version for `release`."""
    home = root / f"cuda-{release}"
    (home / "bin").mkdir(parents=True)
    for tool in tools:
        text = NVCC_VERSION.format(release=release, patch=48) if tool == "nvcc" else ""
        script = home / "bin" / tool
        script.write_text(f"#!/bin/sh\ncat <<'EOF'\n{text}EOF\n")
        script.chmod(0o755)
    return home


@pytest.fixture()
def site(tmp_path: Path) -> dict[str, Path]:
    """An inventory for this machine with the contract's minimum and the role's folders under
    tmp_path."""
    folders = {name: tmp_path / name for name in ("work", "builds", "wheelhouse", "ccache")}
    link = tmp_path / "venvs" / "vllm"
    host_vars = {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "ansible_become": False,
        "sparkspec_profile": "tiny", "sparkspec_vllm_venv": str(link),
        "sparkspec_profiles": {"tiny": {"kind": "plain", "served_model_name": "tiny", "dir": "tiny",
                                        "disk_gb": 1,
                                        "model": {"repo": "sparkspec/sim-tiny",
                                                  "revision": "main"}}},
        "vllm_build_work_dir": str(folders["work"]), "vllm_build_root": str(folders["builds"]),
        "vllm_build_wheelhouse": str(folders["wheelhouse"]),
        "vllm_build_ccache_dir": str(folders["ccache"]),
        "vllm_build_system_packages": [], "vllm_build_python": sys.executable,
        "vllm_build_cuda_home": str(toolkit(tmp_path, "13.0")), "vllm_build_max_jobs": 1,
        "vllm_build_min_free_disk_gb": 0, "sparkspec_home": str(tmp_path / "home"),
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump(
        {"all": {"children": {"sparks": {"hosts": {HOST: host_vars}}}}}))
    return {"inventory": inventory, "link": link, "root": tmp_path, **folders}


def build(site: dict[str, Path], **extra: object) -> PlayResult:
    return run_playbook(ROOT / "playbooks" / "build-vllm.yml", site["inventory"], HOST,
                        extra_vars=extra, quiet=True)


def refused(result: PlayResult) -> str:
    assert result.rc != 0, "the play passed"
    line = failure_summary(result, HOST)
    assert "\n" not in line.strip(), line
    return line


def unchanged(site: dict[str, Path]) -> None:
    """Nothing of the role's exists: no work folder, no build, no link."""
    made = [name for name in ("work", "builds", "wheelhouse", "ccache") if site[name].exists()]
    assert made == [], f"the refused run created {made}"
    assert not site["link"].exists() and not site["link"].is_symlink()


@pytest.mark.parametrize(("extra", "expected"), [
    ({"vllm_build_arch_list": "9.0;12.0"},
     'vllm_build_arch_list "9.0;12.0" has no 12.1a (or 12.1): the build would carry no code for '
     'the Spark (SM121); set vllm_build_arch_list: "12.1a"'),
    ({"vllm_build_tarball_sha256": "d2c957d5"},
     'vllm_build_tarball_sha256 "d2c957d5" is not a sha256 (64 hex digits)'),
    ({"vllm_build_torch": "torch>=2.13"},
     'vllm_build_torch "torch>=2.13" is not a pin (name==version)'),
    ({"vllm_build_flashinfer": ["flashinfer-python==0.7.0.post1",
                                "/opt/w/flashinfer_cubin-0.7.0-py3-none-any.whl",
                                "--index-url=http://elsewhere/simple"]},
     'vllm_build_flashinfer entry "--index-url=http://elsewhere/simple" is neither a pin '
     '(name==version) nor an absolute path to a wheel on the host; give e.g. '
     'flashinfer-python==0.7.0.post1'),
    ({"vllm_build_max_jobs": 100000},
     "100000 build jobs (vllm_build_max_jobs) need about 800000 GB, MemAvailable is"),
    ({"vllm_build_min_free_disk_gb": 10 ** 9},
     "vllm_build_min_free_disk_gb is 1000000000; free disk space there"),
], ids=["arch-without-12.1", "digest-not-a-sha256", "torch-not-a-pin", "flashinfer-option",
        "memory-for-jobs", "disk"])
def test_knobs_and_resources_are_refused_before_any_change(site, extra, expected):
    line = refused(build(site, **extra))
    assert expected in line, line
    unchanged(site)


def test_missing_cuda_is_refused(site):
    line = refused(build(site, vllm_build_cuda_home=str(site["root"] / "no-cuda")))
    assert line.startswith(f"no CUDA at vllm_build_cuda_home {site['root'] / 'no-cuda'} "
                           "(no bin/nvcc); install the CUDA 13.0+ toolkit there or point "
                           "vllm_build_cuda_home at one"), line
    unchanged(site)


def test_cuda_below_13_is_refused(site):
    home = toolkit(site["root"], "12.8")
    line = refused(build(site, vllm_build_cuda_home=str(home)))
    assert line.startswith(f"CUDA 12.8 at vllm_build_cuda_home {home} is below 13.0 "
                           "(vLLM for SM121 needs CUDA >= 13.0)"), line
    unchanged(site)


def test_cuda_without_cuobjdump_is_refused(site):
    # as this machine's nvcc 13.0: no cuobjdump
    home = toolkit(site["root"], "13.1", tools=("nvcc", "ptxas"))
    line = refused(build(site, vllm_build_cuda_home=str(home)))
    assert (f"vllm_build_cuda_home {home} lacks bin/ptxas or bin/cuobjdump (the SASS check)"
            in line), line
    unchanged(site)


def test_a_venv_made_by_hand_is_never_replaced(site):
    (site["link"] / "bin").mkdir(parents=True)
    line = refused(build(site))
    assert line.startswith(f"{site['link']} is a folder, not a venv vllm_build made; "
                           "it stays yours"), line
    assert sorted(p.name for p in site["link"].iterdir()) == ["bin"]
    assert not site["work"].exists()


def test_a_tarball_that_does_not_match_its_digest_is_refused(site):
    tarball = site["root"] / "vllm-0.32.0.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(ROOT / "tests/support/vllm_standin/setup.py", arcname="vllm-0.32.0/setup.py")
    wrong = hashlib.sha256(b"another tarball").hexdigest()
    line = refused(build(site, vllm_build_tarball_url=tarball.as_uri(),
                         vllm_build_tarball_sha256=wrong))
    assert line.startswith(f"could not fetch vllm-0.32.0.tar.gz with sha256 {wrong} ("), line
    assert line.endswith("check vllm_build_tarball_url (or the file in vllm_build_mirror_dir) and "
                         "vllm_build_tarball_sha256"), line
    downloads = site["work"] / "downloads"
    assert not any(downloads.iterdir()), \
        "a tarball that failed its digest must not stay in the downloads"
    assert not site["builds"].exists() and not site["link"].is_symlink()


def test_an_unknown_git_ref_is_refused(site):
    repo = site["root"] / "vllm.git"
    for argv in (["init", "-q", "-b", "main", str(repo)],
                 ["-C", str(repo), "commit", "-q", "--allow-empty", "-m", "x"],
                 ["-C", str(repo), "tag", "v0.32.0"]):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], check=True,
                       capture_output=True)
    line = refused(build(site, vllm_build_source="git", vllm_build_git_url=str(repo),
                         vllm_build_git_ref="v9.9.9"))
    assert line.startswith(f"vllm_build_git_ref v9.9.9 could not be fetched from {repo} ("), line
    assert line.endswith("give a tag, branch or commit that exists there"), line
    assert not site["builds"].exists() and not site["link"].is_symlink()


def test_a_torch_that_is_not_a_cuda_build_is_refused(site, monkeypatch):
    """The stand-in vLLM tree as the release tarball (its sha256 pinned), and a torch pin that pip
    can only satisfy with a CPU build (the stand-in torch's cpu variant, the one wheel pip is
    given): the torch guard after the torch step fails the play, and the unit's venv link is never
    made."""
    # this machine's wheelhouse holds the real CPU torch
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    tarball = site["root"] / "vllm-0.32.0.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(ROOT / "tests/support/vllm_standin", arcname="vllm-0.32.0",
                filter=lambda info: (None if "__pycache__" in info.name
                                     or info.name.endswith(".egg-info") else info))
    wheels = site["root"] / "wheels"
    cpu = buildenv.torch_wheel(wheels, "cpu")
    result = build(site, vllm_build_tarball_url=tarball.as_uri(),
                   vllm_build_tarball_sha256=hashlib.sha256(tarball.read_bytes()).hexdigest(),
                   vllm_build_patches=[], vllm_build_torch="torch==2.13.0+cpu",
                   vllm_build_torch_index_url="",
                   # the stand-in tree builds no FA2 (and nothing reaches GitHub)
                   vllm_build_fa_arch_patch=False,
                   sparkspec_pip_env={"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)})
    line = refused(result)
    venvs = sorted(site["builds"].glob("vllm-*"))
    assert len(venvs) == 1, venvs
    assert line.startswith(f"torch 2.13.0+cpu in {venvs[0]} is not a CUDA build "
                           "(torch.version.cuda is None) after pip installed the torch pin "
                           "torch==2.13.0+cpu; set vllm_build_torch to a CUDA build"), line
    assert cpu.name.startswith("torch-2.13.0+cpu-")
    assert not site["link"].exists(), "a venv that failed a guard is never linked"
    assert not site["link"].is_symlink(), "a venv that failed a guard is never linked"


def test_vllm_install_in_source_mode_hands_over_to_vllm_build(site, tmp_path):
    """`vllm_install_mode: source` (what `invoke provision` runs) builds through vllm_build: its
    guards answer."""
    playbook = tmp_path / "install.yml"
    playbook.write_text(yaml.safe_dump([{"name": "Install vLLM from source", "hosts": "sparks",
                                         "gather_facts": True,
                                         "roles": [{"role": "vllm_install"}]}]))
    result = run_playbook(playbook, site["inventory"], HOST, quiet=True, extra_vars={
        "vllm_install_mode": "source", "vllm_build_arch_list": "12.0",
        # the system libraries vLLM loads: not this machine's business
        "_vllm_install_apt_packages": []})
    line = refused(result)
    assert line.startswith('vllm_build_arch_list "12.0" has no 12.1a (or 12.1)'), line
    unchanged(site)
