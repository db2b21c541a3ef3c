"""Each record of sparkspec.registry.releases against its release's own files: the sdist copies in
tests/data/vllm-releases (sha256 in SOURCES.md there) and the recorded index answers. Sdist, CUDA
pins, flash-attention commit, SpeculativeConfig fields, methods and deprecations, v1 runner. No
network."""

from __future__ import annotations

import ast
import hashlib
import re
from functools import cache
from pathlib import Path

import pytest

from sparkspec.registry import releases
from sparkspec.registry.releases import RELEASES, Release
from tests.support import index_answers

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data" / "vllm-releases"
SOURCES = (DATA / "SOURCES.md").read_text(encoding="utf-8")
FILES = ("CMakeLists.txt", "MANIFEST.txt", "cmake/external_projects/vllm_flash_attn.cmake",
         "requirements/cuda.txt", "vllm/config/speculative.py",
         *(f"vllm/model_executor/layers/quantization/inc/{p}"
           for p in ("config_parser.py", "inc.py", "schemes/factory.py")))
VERSIONS = list(RELEASES)


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def file_table() -> dict[str, str]:
    return dict(re.findall(r"^\| `([^`]+)` \| ([0-9a-f]{64}) \|$", SOURCES, re.MULTILINE))


def sdist_table() -> dict[str, tuple[str, str, int]]:
    rows = re.findall(r"^\| (\d+\.\d+\.\d+) \| (https://\S+) \| ([0-9a-f]{64}) \| (\d+) \|$",
                      SOURCES, re.MULTILINE)
    return {v: (url, sha, int(size)) for v, url, sha, size in rows}


def manifest(version: str) -> dict[str, str]:
    lines = (DATA / version / "MANIFEST.txt").read_text(encoding="utf-8").splitlines()
    pairs = [line.rpartition(": ") for line in lines if line and not line.startswith("#")]
    return {k: value for k, sep, value in pairs if sep}


@cache
def speculative(version: str) -> tuple[list[str], frozenset[str], frozenset[str]]:
    """(SpeculativeConfig's AnnAssign fields in order, SpeculativeMethod expanded, the fields whose
    docstring starts with "Deprecated") of the release's vllm/config/speculative.py."""
    tree = ast.parse((DATA / version / "vllm/config/speculative.py").read_text(encoding="utf-8"))
    aliases: dict[str, ast.expr] = {}
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig"]
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(target := node.targets[0], ast.Name):
            aliases[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            aliases[node.target.id] = node.value

    def expand(node: ast.expr) -> set[str]:
        if isinstance(node, ast.Name):
            return expand(aliases[node.id])
        assert isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("Literal"), \
            ast.unparse(node)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        out: set[str] = set()
        for item in items:
            if isinstance(item, ast.Constant):
                assert isinstance(item.value, str), ast.unparse(item)
                out.add(item.value)
            else:
                out |= expand(item)
        return out

    fields, deprecated = [], set()
    for stmt, after in zip(cls.body, [*cls.body[1:], None], strict=True):
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        fields.append(stmt.target.id)
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str) \
                and after.value.value.lstrip().startswith("Deprecated"):
            deprecated.add(stmt.target.id)
    return fields, frozenset(expand(aliases["SpeculativeMethod"])), frozenset(deprecated)


def cuda_pins(version: str) -> dict[str, list[str]]:
    """requirements/cuda.txt: name -> its specifiers, spaces removed (option lines skipped)."""
    pins: dict[str, list[str]] = {}
    for raw in (DATA / version / "requirements/cuda.txt").read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*([<>=!~][^;]*?)\s*(?:;.*)?", line)
        if m:
            pins.setdefault(m[1].lower(), []).append(m[2].replace(" ", ""))
    return pins


def test_every_record_has_its_files_and_sdist_in_sources() -> None:
    assert sorted(sdist_table()) == sorted(RELEASES)
    assert sorted(file_table()) == sorted(f"{v}/{p}" for v in RELEASES for p in FILES)
    on_disk = {p.relative_to(DATA).as_posix() for p in DATA.rglob("*") if p.is_file()}
    assert on_disk - {"SOURCES.md"} == set(file_table())


@pytest.mark.parametrize("version", VERSIONS)
def test_the_copies_are_the_recorded_files(version: str) -> None:
    for rel, digest in file_table().items():
        if rel.startswith(f"{version}/"):
            assert hashlib.sha256((DATA / rel).read_bytes()).hexdigest() == digest, rel


@pytest.mark.parametrize("version", VERSIONS)
def test_sdist_url_and_sha256(version: str) -> None:
    record: Release = RELEASES[version]
    url, sha256, size = sdist_table()[version]
    assert (record.sdist_url, record.sdist_sha256) == (url, sha256)
    assert url.endswith(f"/vllm-{version}.tar.gz") and size > 0


@pytest.mark.parametrize("version", VERSIONS)
def test_spec_fields(version: str) -> None:
    fields, _, _ = speculative(version)
    assert len(fields) == len(set(fields))
    assert RELEASES[version].spec_fields == frozenset(fields)


@pytest.mark.parametrize("version", VERSIONS)
def test_spec_methods(version: str) -> None:
    _, methods, _ = speculative(version)
    assert RELEASES[version].spec_methods == methods


@pytest.mark.parametrize("version", VERSIONS)
def test_spec_deprecated(version: str) -> None:
    _, _, deprecated = speculative(version)
    assert RELEASES[version].spec_deprecated == deprecated


@pytest.mark.parametrize("version", VERSIONS)
def test_cuda_pins(version: str) -> None:
    record, pins = RELEASES[version], cuda_pins(version)
    assert pins.get("torch") == [f"=={record.torch}"]
    assert pins.get("flashinfer-python") == [f"=={record.flashinfer}"]
    assert pins.get("fastsafetensors") == [record.fastsafetensors]


@pytest.mark.parametrize("version", VERSIONS)
def test_fa_commit(version: str) -> None:
    cmake = (DATA / version / "cmake/external_projects/vllm_flash_attn.cmake").read_text()
    assert re.findall(r"^\s*GIT_TAG\s+(\S+)\s*$", cmake, re.MULTILINE) == [
        RELEASES[version].fa_commit]


@pytest.mark.parametrize("version", VERSIONS)
def test_v1_runner(version: str) -> None:
    entry = manifest(version)["vllm/v1/worker/gpu_model_runner.py"]
    assert entry in ("yes", "no")
    assert RELEASES[version].v1_runner is (entry == "yes")


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])
def test_the_published_wheel_pins_the_record(version: str) -> None:
    record = RELEASES[version]
    requires = index_answers.requires("vllm", version)
    pinned = {m[1]: m[2] for r in requires
              if (m := re.fullmatch(r"(torch|flashinfer-python)\s*==\s*(\S+)", r))}
    assert pinned == {"torch": record.torch, "flashinfer-python": record.flashinfer}


def test_floor_is_the_oldest_record_and_default_a_record() -> None:
    assert releases.FLOOR == sorted(RELEASES, key=_version_key)[0]
    assert releases.DEFAULT in RELEASES
    assert sorted(p.name for p in DATA.iterdir() if p.is_dir()) == sorted(RELEASES,
                                                                          key=_version_key)
