"""The vLLM stand-in source tree (tests/support/vllm_standin) really builds, and collapses the arch
as vLLM does.

Built with nvcc from PATH in the cached build venv of tests.support.torch_standin.buildenv (cmake,
ninja, the stand-in torch 2.13.0+cu130, cuobjdump): TORCH_CUDA_ARCH_LIST=12.1a gives an extension
with sm_120 code only, unless roles/vllm_build/files/patches/vllm-0.32.0-sm121-arch.patch is applied
(then sm_121a only). The CMake lines doing this are vLLM 0.32.0's own
(tests/integration/test_vllm_source.py compares them with the tarball).
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.torch_standin import buildenv

ROOT = Path(__file__).resolve().parents[3]
STANDIN = ROOT / "tests" / "support" / "vllm_standin"
ARCH_PATCH = ROOT / "roles" / "vllm_build" / "files" / "patches" / "vllm-0.32.0-sm121-arch.patch"


@pytest.fixture(scope="module")
def venv() -> Path:
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: the stand-in's _C extension needs CUDA >= 13.0's nvcc "
                    "(see NOTES.md)")
    return buildenv.build_venv()


def _build_outputs(folder: str, names: list[str]) -> set[str]:
    """What a build leaves in the tree (build/ at the root only: requirements/build/ is source)."""
    root_only = {"build", ".deps"} if Path(folder) == STANDIN else set()
    return {n for n in names if n in root_only or n == "__pycache__" or n.endswith(".egg-info")}


def tree(tmp: Path, *, arch_patch: bool) -> Path:
    """A fresh copy of the stand-in source tree, with the arch patch applied (patch -p1 --fuzz=0) if
    asked."""
    src = tmp / "vllm-src"
    shutil.copytree(STANDIN, src, ignore=_build_outputs)
    if arch_patch:
        subprocess.run(["patch", "-p1", "--fuzz=0", "-i", str(ARCH_PATCH)], cwd=src, check=True,
                       capture_output=True)
    return src


KNOBS = ("MAX_JOBS", "NVCC_THREADS", "CMAKE_ARGS", "CUDA_HOME", "VLLM_TARGET_DEVICE",
         "TORCH_CUDA_ARCH_LIST", "VLLM_CUTLASS_SRC_DIR")


def pip_wheel(venv: Path, src: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``pip wheel . --no-build-isolation`` in ``src`` as the vllm_build role runs it (the venv's
    bin first on PATH, for cmake and ninja), with only the build knobs in ``env``."""
    run_env = {k: v for k, v in os.environ.items() if k not in KNOBS}
    run_env.update(env, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "wheel", "-v", "--no-deps",
         "--no-build-isolation", "--no-index", "--wheel-dir", str(src.parent / "wheelhouse"), "."],
        cwd=src, env=run_env, capture_output=True, text=True, check=False,
    )


def build(venv: Path, src: Path, **env: str) -> Path:
    """The stand-in built by pip_wheel, its wheel unpacked; returns the unpacked folder."""
    result = pip_wheel(venv, src, **env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = (src.parent / "wheelhouse").glob("vllm-0.32.0+standin-*.whl")
    unpacked = src.parent / "unpacked"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(unpacked)
    return unpacked


def elf_archs(venv: Path, so: Path) -> set[str]:
    """The SASS archs of ``so`` as ``cuobjdump --list-elf`` names them (sm_120, sm_121a, ...)."""
    out = subprocess.run([str(buildenv.cuobjdump(venv)), "--list-elf", str(so)],
                         capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"\.(sm_\d+[af]?)\.cubin", out))


def test_without_the_arch_patch_12_1a_collapses_to_sm_120(venv: Path, tmp_path: Path) -> None:
    mirror = tmp_path / "mirror" / "cutlass"
    mirror.mkdir(parents=True)
    wheel = build(venv, tree(tmp_path, arch_patch=False), TORCH_CUDA_ARCH_LIST="12.1a",
                  MAX_JOBS="6", NVCC_THREADS="3",
                  CMAKE_ARGS="-DFETCHCONTENT_FULLY_DISCONNECTED=ON -DVLLM_STANDIN_PROBE=1",
                  VLLM_CUTLASS_SRC_DIR=str(mirror))
    assert elf_archs(venv, wheel / "vllm" / "_C.abi3.so") == {"sm_120"}
    record = json.loads((wheel / "vllm" / "_standin_build.json").read_text())
    assert record["cmake"]["cuda_arch_flags"] == "-gencode arch=compute_121a,code=sm_121a"
    assert record["cmake"]["cuda_archs"] == ["12.0"]
    # vLLM's setup.py: MAX_JOBS // NVCC_THREADS parallel jobs; nvcc gets --threads; CMAKE_ARGS
    # is appended.
    assert record["num_jobs"] == 2
    assert "--threads=3" in record["cmake"]["gpu_flags"].split(";")
    assert "-DCMAKE_JOB_POOLS:STRING=compile=2" in record["cmake_args"]
    assert record["cmake_args"][-2:] == \
        ["-DFETCHCONTENT_FULLY_DISCONNECTED=ON", "-DVLLM_STANDIN_PROBE=1"]
    assert record["cmake"]["fetchcontent_fully_disconnected"] == "ON"
    assert record["cmake"]["src_dirs"] == {"VLLM_CUTLASS_SRC_DIR": str(mirror)}


def test_a_source_dir_override_that_is_not_a_folder_fails_the_configure(venv: Path,
                                                                        tmp_path: Path) -> None:
    result = pip_wheel(venv, tree(tmp_path, arch_patch=True), TORCH_CUDA_ARCH_LIST="12.1a",
                       VLLM_CUTLASS_SRC_DIR=str(tmp_path / "no-such-mirror"))
    assert result.returncode != 0
    said = " ".join((result.stdout + result.stderr).split())  # CMake wraps long messages
    assert ("VLLM_CUTLASS_SRC_DIR is not an existing directory: "
            f"'{tmp_path / 'no-such-mirror'}'") in said


def test_with_the_arch_patch_12_1a_stays_sm_121a(venv: Path, tmp_path: Path) -> None:
    wheel = build(venv, tree(tmp_path, arch_patch=True), TORCH_CUDA_ARCH_LIST="12.1a", MAX_JOBS="1")
    so = wheel / "vllm" / "_C.abi3.so"
    assert elf_archs(venv, so) == {"sm_121a"}
    record = json.loads((wheel / "vllm" / "_standin_build.json").read_text())
    assert record["cmake"]["cuda_archs"] == ["12.1a"]
    # The extension loads without a GPU and reports the archs it was compiled for.
    lib = ctypes.CDLL(str(so))
    lib.vllm_standin_archs.restype = ctypes.c_char_p
    assert lib.vllm_standin_archs() == b"12.1a"
    assert (wheel / "vllm-0.32.0+standin.dist-info").is_dir()


def test_a_cpu_torch_silently_builds_a_package_without_the_extension(venv: Path,
                                                                     tmp_path: Path) -> None:
    """vLLM's torch trap, mirrored: with a CPU torch in the build env, setup.py targets the CPU and
    the wheel has no _C at all (only the role's torch guard and SASS check catch it)."""
    cpu = tmp_path / "cpu-torch"
    with zipfile.ZipFile(buildenv.torch_wheel(tmp_path / "wheels", "cpu")) as zf:
        zf.extractall(cpu)
    wheel = build(venv, tree(tmp_path, arch_patch=True), TORCH_CUDA_ARCH_LIST="12.1a",
                  PYTHONPATH=str(cpu))
    assert not list((wheel / "vllm").glob("_C*.so"))
    assert (wheel / "vllm" / "__init__.py").is_file()


@pytest.mark.parametrize(("variant", "version", "cuda"), [("cu130", "2.13.0+cu130", "13.0"),
                                                         ("cpu", "2.13.0+cpu", None)])
def test_the_torch_standin_reports_its_cuda_build(tmp_path: Path, variant: str, version: str,
                                                  cuda: str | None) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(buildenv.torch_wheel(tmp_path, variant)) as zf:
        zf.extractall(site)
    out = subprocess.run([sys.executable, "-c",
                          "import torch; print(torch.__version__, torch.version.cuda)"],
                         env=dict(os.environ, PYTHONPATH=str(site)), capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == [version, str(cuda)]


def test_use_existing_torch_strips_the_torch_pins(tmp_path: Path) -> None:
    src = tree(tmp_path, arch_patch=False)
    subprocess.run([sys.executable, "tools/use_existing_torch.py"], cwd=src, check=True,
                   capture_output=True)
    assert "torch" not in (src / "requirements" / "build" / "cuda.txt").read_text()
    cuda = (src / "requirements" / "cuda.txt").read_text()
    assert "torch" not in cuda and "flashinfer-python==0.7.0.post1" in cuda
    assert '"torch ==' not in (src / "pyproject.toml").read_text()
