"""``vllm_build_helper.py fa-archs``: flash-attention's own arch selection keeps 12.1a for FA2 only
after the edit.

vLLM 0.32.0 builds ``_vllm_fa2_C`` from vllm-project/flash-attention, a CMake project with its own
supported-arch list (ending at 12.0) and its own FA2 list (``"8.0+PTX"``, earlier
``"8.0;9.0;10.0;10.1;12.0"``). The two FA copies under tests/data/flash-attention (see SOURCES.md
there) are evaluated with their own cmake/utils.cmake through ``cmake -P``: the supported-arch
block, the CUDA_ARCHS selection and the FA2 line are taken from the copy's CMakeLists.txt by regex,
so what ``fa-archs`` wrote is what runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HELPER = ROOT / "roles" / "vllm_build" / "files" / "vllm_build_helper.py"
DATA = ROOT / "tests" / "data" / "flash-attention"
COMMITS = ("617264c1", "6d21ae21")
# What torch's CMake puts in CMAKE_CUDA_FLAGS for TORCH_CUDA_ARCH_LIST=12.1a / 12.1 (FA reads the
# archs from it when built on its own); the rest of the flags only has to be non-empty
# (clear_cuda_arches needs a string).
TORCH_FLAGS = {"12.1a": "-Xfatbin -compress-all -gencode arch=compute_121a,code=sm_121a",
               "12.1": "-Xfatbin -compress-all -gencode arch=compute_121,code=sm_121"}


@pytest.fixture(scope="session")
def cmake() -> str:
    found = shutil.which("cmake")
    if found is None:
        from tests.support.torch_standin import buildenv

        found = str(buildenv.build_venv() / "bin" / "cmake")
    return found


def fa_copy(tmp: Path, commit: str) -> Path:
    dest = tmp / f"fa-{commit}"
    shutil.copytree(DATA / commit, dest)
    return dest


def fa_archs(src: Path, arch: str = "12.1a") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HELPER), "fa-archs", str(src), arch],
                          capture_output=True, text=True, check=False)


def _grab(pattern: str, text: str) -> str:
    found = re.findall(pattern, text, re.MULTILINE | re.DOTALL)
    assert len(found) == 1, pattern
    return found[0]


def fa2_archs(cmake: str, src: Path, *, nvcc: str = "13.0", flags: str = TORCH_FLAGS["12.1a"],
              cuda_archs: str = "") -> tuple[str, str]:
    """(CUDA_ARCHS, FA2_ARCHS) as FA's CMakeLists.txt in ``src`` computes them, through its own
    utils.cmake. ``cuda_archs`` preset: what vLLM's CMake hands down to FA (FA skips its own
    extraction then)."""
    text = (src / "CMakeLists.txt").read_text()
    supported = _grab(r"^set\(CUDA_SUPPORTED_ARCHS .*?^endif\(\)\n", text)
    select = _grab(r"^[ \t]*clear_cuda_arches\(CUDA_ARCH_FLAGS\).*?"
                   r'^[ \t]*message\(STATUS "CUDA supported target architectures[^\n]*\n', text)
    fa2 = _grab(r"^[ \t]*cuda_archs_loose_intersection\(FA2_ARCHS [^\n]*\n", text)
    script = src / "select_archs.cmake"
    script.write_text(
        "cmake_minimum_required(VERSION 3.21)\n"
        f'set(CMAKE_CUDA_COMPILER_VERSION "{nvcc}")\n'
        f'set(CMAKE_CUDA_FLAGS "{flags}")\n'
        f'set(CUDA_ARCHS "{cuda_archs}")\n'
        f"include({src / 'cmake' / 'utils.cmake'})\n"
        f"{supported}{select}{fa2}"
        'message(NOTICE "RESULT=${CUDA_ARCHS}|${FA2_ARCHS}")\n'
    )
    result = subprocess.run([cmake, "-P", str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [x for x in result.stderr.splitlines() if x.startswith("RESULT=")]
    cuda, fa2_out = line.removeprefix("RESULT=").split("|")
    return cuda, fa2_out


def test_the_copies_are_the_recorded_files() -> None:
    sources = (DATA / "SOURCES.md").read_text()
    recorded = dict(re.findall(r"^\| `([^`]+)` \| ([0-9a-f]{64}) \|$", sources, re.MULTILINE))
    assert sorted(recorded) == sorted(f"{c}/{p}" for c in COMMITS for p in ("CMakeLists.txt",
                                                                            "cmake/utils.cmake"))
    for rel, digest in recorded.items():
        assert hashlib.sha256((DATA / rel).read_bytes()).hexdigest() == digest, rel


# Unedited FA: 12.1a collapses to 12.0 in FA's own list; FA2 then gets sm_80 + PTX (617264c1) or
# sm_120 (6d21ae21), never sm_121a. Edited: 12.1 stays, and FA2 gets 12.1a.
UNEDITED = {"617264c1": ("12.0", "8.0+PTX"), "6d21ae21": ("12.0", "12.0")}


@pytest.mark.parametrize("commit", COMMITS)
def test_unedited_fa_drops_12_1a_from_fa2(cmake: str, tmp_path: Path, commit: str) -> None:
    assert fa2_archs(cmake, fa_copy(tmp_path, commit)) == UNEDITED[commit]
    # The same when FA is built under vLLM and the patched vLLM hands it CUDA_ARCHS=12.1a.
    assert fa2_archs(cmake, fa_copy(tmp_path / "v", commit), cuda_archs="12.1a") == UNEDITED[commit]


@pytest.mark.parametrize("commit", COMMITS)
@pytest.mark.parametrize("nvcc", ["13.0", "13.4", "12.9"])  # FA's CUDA >= 13.0 and >= 12.8 branches
def test_edited_fa_builds_fa2_for_12_1a(cmake: str, tmp_path: Path, commit: str, nvcc: str) -> None:
    src = fa_copy(tmp_path, commit)
    result = fa_archs(src)
    assert result.returncode == 0, result.stderr
    assert fa2_archs(cmake, src, nvcc=nvcc) == ("12.1", "12.1a")
    assert fa2_archs(cmake, src, nvcc=nvcc, cuda_archs="12.1a") == ("12.1", "12.1a")


@pytest.mark.parametrize("commit", COMMITS)
def test_edited_fa_with_12_1(cmake: str, tmp_path: Path, commit: str) -> None:
    src = fa_copy(tmp_path, commit)
    assert fa_archs(src, "12.1").returncode == 0
    assert fa2_archs(cmake, src, flags=TORCH_FLAGS["12.1"]) == ("12.1", "12.1")


def test_the_edit_needs_vllms_arch_patch_too(cmake: str, tmp_path: Path) -> None:
    """An unpatched vLLM hands FA CUDA_ARCHS=12.0 (its own collapse): the FA edit alone cannot bring
    12.1a back."""
    src = fa_copy(tmp_path, "617264c1")
    assert fa_archs(src).returncode == 0
    assert fa2_archs(cmake, src, cuda_archs="12.0") == ("12.0", "8.0+PTX")


@pytest.mark.parametrize("commit", COMMITS)
def test_the_json_line_the_edited_lines_and_idempotence(tmp_path: Path, commit: str) -> None:
    src = fa_copy(tmp_path, commit)
    cmakelists = src / "CMakeLists.txt"
    cmakelists.chmod(0o640)
    before = cmakelists.read_text().splitlines()
    first = fa_archs(src)
    assert first.returncode == 0 and first.stderr == ""
    (line,) = first.stdout.splitlines()
    doc = json.loads(line)
    assert doc["changed"] is True and doc["file"] == str(cmakelists)
    after = cmakelists.read_text().splitlines()
    assert len(after) == len(before)
    changed = [i + 1 for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
    assert changed == sorted(edit["line"] for edit in doc["edits"])
    for edit in doc["edits"]:
        assert before[edit["line"] - 1].strip() == edit["old"]
        assert after[edit["line"] - 1].strip() == edit["new"]
    # the CUDA >= 13.0 and >= 12.8 lists, or the >= 12.8 one
    want_supported = 2 if commit == "617264c1" else 1
    assert sum('"12.0" "12.1")' in edit["new"] for edit in doc["edits"]) == want_supported
    assert sum(';12.1a" "${CUDA_ARCHS}")' in edit["new"] for edit in doc["edits"]) == 1
    assert stat.S_IMODE(cmakelists.stat().st_mode) == 0o640
    assert sorted(p.name for p in src.iterdir()) == ["CMakeLists.txt", "cmake"]  # no temp file left
    content, mtime = cmakelists.read_bytes(), cmakelists.stat().st_mtime_ns
    second = fa_archs(src)
    assert second.returncode == 0
    assert json.loads(second.stdout) == {"changed": False, "file": str(cmakelists), "edits": []}
    assert cmakelists.read_bytes() == content and cmakelists.stat().st_mtime_ns == mtime


def _refused(src: Path, *, arch: str = "12.1a") -> str:
    cmakelists = src / "CMakeLists.txt"
    content, mtime = cmakelists.read_bytes(), cmakelists.stat().st_mtime_ns
    result = fa_archs(src, arch)
    assert result.returncode == 1 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert cmakelists.read_bytes() == content and cmakelists.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in src.iterdir()) == ["CMakeLists.txt", "cmake"]
    return line


@pytest.mark.parametrize("commit", COMMITS)
def test_a_cmakelists_without_the_fa2_line_is_refused(tmp_path: Path, commit: str) -> None:
    src = fa_copy(tmp_path, commit)
    cmakelists = src / "CMakeLists.txt"
    text = cmakelists.read_text()
    cmakelists.write_text(re.sub(r"cuda_archs_loose_intersection\(FA2_ARCHS [^\n]*",
                                 "set(FA2_ARCHS ${CUDA_ARCHS})", text))
    line = _refused(src)
    assert line.startswith(f"{cmakelists}: 0 lines cuda_archs_loose_intersection(FA2_ARCHS")
    assert "set vllm_build_fa_arch_patch: false, or use a flash-attention source" in line


def test_a_cmakelists_without_the_supported_list_is_refused(tmp_path: Path) -> None:
    src = fa_copy(tmp_path, "617264c1")
    cmakelists = src / "CMakeLists.txt"
    cmakelists.write_text(re.sub(r'"12\.0"\)', '"11.0")', cmakelists.read_text()))
    line = _refused(src)
    assert line.startswith(f"{cmakelists}: no CUDA_SUPPORTED_ARCHS list ending at a 12.x "
                           "below 12.1")
    assert "vllm_build_fa_arch_patch: false" in line


def test_a_symlinked_cmakelists_is_refused(tmp_path: Path) -> None:
    real = fa_copy(tmp_path, "617264c1") / "CMakeLists.txt"
    src = tmp_path / "linked"
    (src / "cmake").mkdir(parents=True)
    (src / "CMakeLists.txt").symlink_to(real)
    content = real.read_bytes()
    line = _refused(src)
    assert line == (f"{src / 'CMakeLists.txt'}: a symlink, refused (give fa-archs a real copy of "
                    "the FA source)")
    assert real.read_bytes() == content


@pytest.mark.parametrize("arch", ["sm_121a", "12.1f", ""])
def test_a_bad_arch_is_refused(tmp_path: Path, arch: str) -> None:
    assert "is not of the form 12.1a or 12.1" in _refused(fa_copy(tmp_path, "617264c1"), arch=arch)


def test_a_missing_cmakelists_is_refused(tmp_path: Path) -> None:
    result = fa_archs(tmp_path / "nowhere")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1
    assert "CMakeLists.txt: not found" in result.stderr
    assert not os.path.exists(tmp_path / "nowhere")
