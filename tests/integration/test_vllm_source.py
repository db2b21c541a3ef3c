"""The patch series and vLLM's own arch selection, on the real vLLM 0.32.0 source tarball.

The release's sdist (44.5 MB, sha256 pinned below) is downloaded once into .cache/vllm-src/. On it:
the series roles/vllm_build applies (the SM121 arch patch, then the INC patch) applies with
``patch -p1 --fuzz=0``; ``python tools/use_existing_torch.py`` runs; and a CMake script made of the
tree's own cmake/utils.cmake and its CMakeLists.txt arch lines (the supported-arch list for the nvcc
version, then clear_cuda_gencode_flags, extract_unique_cuda_archs_ascending and
cuda_archs_loose_intersection, as CMakeLists.txt runs them) keeps ``12.1a`` with the arch patch and
collapses it to ``12.0`` without it. The stand-in tree's copies of those lines
(tests/support/vllm_standin) are checked against the tarball here too.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest

from tests.support.torch_standin import buildenv

ROOT = Path(__file__).resolve().parents[2]
URL = ("https://files.pythonhosted.org/packages/d5/df/"
       "5471312c76e335eaa2b8333e87ea39f0d37bfe24f10a582620e34ff12e33/"
       "vllm-0.32.0.tar.gz")
SHA256 = "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
TOP = "vllm-0.32.0"
ARCH_PATCH = ROOT / "roles" / "vllm_build" / "files" / "patches" / "vllm-0.32.0-sm121-arch.patch"
INC_PATCH = (ROOT / "roles" / "vllm_install" / "files" / "patches"
             / "vllm-0.32.0-inc-mixed-fp8.patch")
STANDIN = ROOT / "tests" / "support" / "vllm_standin"
# What torch's CMake puts in CMAKE_CUDA_FLAGS for TORCH_CUDA_ARCH_LIST=12.1a (vLLM reads the archs
# from it).
TORCH_FLAGS_12_1A = "-gencode arch=compute_121a,code=sm_121a"
TORCH_FLAGS_12_1 = "-gencode arch=compute_121,code=sm_121"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@pytest.fixture(scope="module")
def tarball() -> Path:
    """vllm-0.32.0.tar.gz, fetched once into .cache/vllm-src/ and checked against the pinned
    sha256."""
    cached = ROOT / ".cache" / "vllm-src" / f"{TOP}.tar.gz"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        part = cached.with_suffix(".part")
        with urllib.request.urlopen(URL, timeout=120) as response, part.open("wb") as out:
            shutil.copyfileobj(response, out)
        part.rename(cached)
    got = _sha256(cached)
    if got != SHA256:
        cached.unlink()
        pytest.fail(f"{cached}: sha256 {got}, want {SHA256} "
                    f"(deleted; the next run fetches {URL} again)")
    return cached


def extract(tarball: Path, dest: Path, *paths: str) -> Path:
    """The members of the release under ``paths`` (files or folders, relative to its root) in
    ``dest``."""
    with tarfile.open(tarball) as tf:
        members = [m for m in tf.getmembers()
                   if any(m.name == f"{TOP}/{p}" or m.name.startswith(f"{TOP}/{p}/")
                          for p in paths)]
        found = {p for p in paths for m in members if m.name == f"{TOP}/{p}"
                 or m.name.startswith(f"{TOP}/{p}/")}
        assert found == set(paths), f"not in {tarball.name}: {sorted(set(paths) - found)}"
        tf.extractall(dest, members=members, filter="data")
    return dest / TOP


def patch(tree: Path, patch_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["patch", "-p1", "--fuzz=0", "--forward", "-i", str(patch_file)],
                          cwd=tree, capture_output=True, text=True, check=False)


@pytest.fixture(scope="module")
def cmake_tree(tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The release's CMakeLists.txt and cmake/utils.cmake (unpatched; tests copy them)."""
    return extract(tarball, tmp_path_factory.mktemp("vllm-cmake"), "CMakeLists.txt",
                   "cmake/utils.cmake")


def test_the_patch_series_applies_without_fuzz(tarball: Path, tmp_path: Path) -> None:
    inc = "vllm/model_executor/layers/quantization/inc"
    tree = extract(tarball, tmp_path, "CMakeLists.txt", inc)
    for patch_file in (ARCH_PATCH, INC_PATCH):  # the order roles/vllm_build applies them in
        result = patch(tree, patch_file)
        assert result.returncode == 0, f"{patch_file.name}:\n{result.stdout}{result.stderr}"
    assert (tree / "CMakeLists.txt").read_text().count('11.0;12.0;12.1")') == 2
    # Applied patches do not apply again (the role's check that a series is already in a tree).
    assert patch(tree, ARCH_PATCH).returncode != 0


def test_use_existing_torch_runs_on_the_release(tarball: Path, tmp_path: Path) -> None:
    tree = extract(tarball, tmp_path, "tools/use_existing_torch.py", "requirements",
                   "pyproject.toml")
    before = (tree / "requirements" / "build" / "cuda.txt").read_text()
    assert re.search(r"^torch==2\.13\.0$", before, re.MULTILINE)
    result = subprocess.run([sys.executable, "tools/use_existing_torch.py"], cwd=tree,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert ">>> removed from requirements/build/cuda.txt: torch==2.13.0" in result.stdout
    for name in ("build/cuda.txt", "cuda.txt"):
        assert not re.search(r"^torch", (tree / "requirements" / name).read_text(),
                             re.MULTILINE), name
    assert '"torch ==' not in (tree / "pyproject.toml").read_text()
    # the role drops it
    assert "flashinfer-python==" in (tree / "requirements" / "cuda.txt").read_text()


def _block(text: str, start: str, end: str) -> str:
    """The lines of ``text`` from the one starting with ``start`` to the next one starting with
    ``end``."""
    lines = text.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    last = next(i for i in range(first + 1, len(lines)) if lines[i].startswith(end))
    return "".join(lines[first:last + 1])


def selected_archs(tree: Path, nvcc_version: str, cuda_flags: str) -> str:
    """CUDA_ARCHS as vLLM's CMakeLists.txt (in ``tree``) computes it for this nvcc and these torch
    flags."""
    cmakelists = (tree / "CMakeLists.txt").read_text()
    supported = _block(cmakelists, "# Supported NVIDIA architectures.", "endif()")
    select = _block(cmakelists, "  clear_cuda_gencode_flags(CUDA_ARCH_FLAGS)",
                    '  message(STATUS "CUDA supported target architectures')
    script = tree / "select_archs.cmake"
    script.write_text(
        # CMakeLists.txt's first line: its policies (IN_LIST)
        "cmake_minimum_required(VERSION 3.26)\n"
        f'set(CMAKE_CUDA_COMPILER_VERSION "{nvcc_version}")\n'
        f'set(CMAKE_CUDA_FLAGS "{cuda_flags}")\n'
        f"include({tree / 'cmake' / 'utils.cmake'})\n"
        f"{supported}{select}"
        'message(NOTICE "RESULT=${CUDA_ARCHS}")\n'
    )
    cmake = buildenv.build_venv() / "bin" / "cmake"
    result = subprocess.run([str(cmake), "-P", str(script)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("RESULT=")]
    return line.removeprefix("RESULT=")


@pytest.mark.parametrize(("nvcc", "arch_patch", "flags", "want"), [
    ("13.0.88", False, TORCH_FLAGS_12_1A, "12.0"),   # the Spark's CUDA 13.0: the collapse
    ("13.0.88", True, TORCH_FLAGS_12_1A, "12.1a"),
    ("13.4.0", False, TORCH_FLAGS_12_1A, "12.0"),    # the >= 13.4 list ends at 12.0 too
    ("13.4.0", True, TORCH_FLAGS_12_1A, "12.1a"),
    ("12.9.1", False, TORCH_FLAGS_12_1A, "12.1a"),   # CUDA 12.8-12.9's list still has 12.1
    # TORCH_CUDA_ARCH_LIST=12.1 collapses the same way
    ("13.0.88", False, TORCH_FLAGS_12_1, "12.0"),
    ("13.0.88", True, TORCH_FLAGS_12_1, "12.1"),
])
def test_vllms_own_arch_selection_keeps_12_1a_only_with_the_arch_patch(
        cmake_tree: Path, tmp_path: Path, nvcc: str, arch_patch: bool, flags: str,
        want: str) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(cmake_tree, tree)
    if arch_patch:
        assert patch(tree, ARCH_PATCH).returncode == 0
    assert selected_archs(tree, nvcc, flags) == want


def test_the_standin_carries_vllms_cmake_lines_verbatim(cmake_tree: Path) -> None:
    """The stand-in's marked blocks equal the release's lines, so its 12.1a -> 12.0 is vLLM's."""
    real = (cmake_tree / "CMakeLists.txt").read_text().splitlines(keepends=True)
    standin = (STANDIN / "CMakeLists.txt").read_text()
    blocks = re.findall(r"^# --- verbatim: vLLM 0\.32\.0 CMakeLists\.txt lines (\d+)-(\d+) ---\n"
                        r"(.*?)^# --- end verbatim ---$", standin, re.MULTILINE | re.DOTALL)
    assert [(a, b) for a, b, _ in blocks] == [("100", "132"), ("209", "234"), ("253", "267")]
    for first, last, text in blocks:
        # the CUDA block's closing endif() follows the end marker in the stand-in, as it does in
        # vLLM
        assert text == "".join(real[int(first) - 1:int(last)]), \
            f"CMakeLists.txt lines {first}-{last}"
    utils = (STANDIN / "cmake" / "utils.cmake").read_text()
    ranges = re.search(r"lines (\d+)-(\d+), (\d+)-(\d+) and (\d+)-(\d+) of the "
                       r"release", utils.replace("\n#", ""))
    assert ranges is not None
    real_utils = (cmake_tree / "cmake" / "utils.cmake").read_text().splitlines(keepends=True)
    bounds = [int(x) for x in ranges.groups()]
    copied = "\n".join("".join(real_utils[a - 1:b])
                       for a, b in zip(bounds[::2], bounds[1::2], strict=True))
    assert utils.endswith(copied)
    assert os.path.getsize(STANDIN / "cmake" / "utils.cmake") < 2 * len(copied)


def test_every_dependency_cmake_fetches_has_a_mirror_folder_in_the_role(tarball: Path,
                                                                        tmp_path: Path) -> None:
    """An air-gapped build turns CMake's downloads off; every dependency the release's CUDA build
    fetches must then come from a *_SRC_DIR variable the role sets. Read from the release: each
    CMake file that fetches from git (the CPU-only cpu_extension.cmake aside) reads its
    `$ENV{..._SRC_DIR}`, and that set of variables is the role's vllm_build_mirror_src_dirs."""
    import yaml

    tree = extract(tarball, tmp_path, "CMakeLists.txt", "cmake")
    read: set[str] = set()
    for path in [tree / "CMakeLists.txt", *sorted((tree / "cmake").rglob("*.cmake"))]:
        text = path.read_text()
        if path.name == "cpu_extension.cmake" or "GIT_REPOSITORY" not in text:
            continue
        names = set(re.findall(r"\$ENV\{(\w+_SRC_DIR)\}", text))
        assert names, f"{path.relative_to(tree)} fetches from git with no *_SRC_DIR override"
        read |= names
    defaults = yaml.safe_load((ROOT / "roles/vllm_build/defaults/main.yml").read_text())
    assert set(defaults["vllm_build_mirror_src_dirs"]) == read
    assert len(read) == 10, sorted(read)
