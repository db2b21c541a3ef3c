"""The package index's recorded answers (tests/data/index-answers, see its README): what vLLM 0.32.0
pins for a DGX Spark (Linux aarch64, CPython 3.12), that each pin is served there, that the served
torch is a CUDA 13 build, and that pins the index does not carry are refused. No network: the
answers were recorded with ``python -m tests.support.index_answers record``; the recorder's parsing
and the loader's markers are tested on hand-written input."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from tests.support import index_answers as ia

ANSWER_FILES = sorted(ia.ANSWERS_DIR.glob("*.json"))
# Tags a wheel may carry to install on the Spark's CPython 3.12 (pip was asked for manylinux_2_28).
SPARK_PLATFORMS = [f"manylinux_2_{minor}_aarch64" for minor in range(28, 16, -1)]
SPARK_TAGS = {*cpython_tags((3, 12), platforms=SPARK_PLATFORMS),
              *compatible_tags((3, 12), "cp312", platforms=SPARK_PLATFORMS)}


def by_name(requirements: list[str]) -> dict[str, list[Requirement]]:
    out: dict[str, list[Requirement]] = {}
    for text in requirements:
        req = Requirement(text)
        out.setdefault(canonicalize_name(req.name), []).append(req)
    return out


def only(reqs: dict[str, list[Requirement]], name: str) -> Requirement:
    assert name in reqs, f"{name} not among the requirements that apply: {sorted(reqs)}"
    assert len({str(r) for r in reqs[name]}) == 1, \
        f"{name} required in more than one way: {reqs[name]}"
    return reqs[name][0]


def served_answer(name: str, version: str) -> dict:
    data = ia.answer(name, version)
    assert data is not None, f"{name}=={version} was not recorded"
    assert data["served"] is True, f"{name}=={version} refused: {data.get('error')}"
    return data


# ---- every recorded answer -----------------------------------------------------------------------


def test_answers_were_recorded() -> None:
    assert ANSWER_FILES, f"no answers in {ia.ANSWERS_DIR}"
    assert len(ia.answers()) == len(ANSWER_FILES)


@pytest.mark.parametrize("path", ANSWER_FILES, ids=lambda p: p.name)
def test_answer_parses(path: Path) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    name, version = ia.parse_pin(data["requested"])
    assert (data["name"], Version(data["version"])) == (name, Version(version))
    assert path == ia.answer_path(name, version), "file name does not match the pin it answers"
    assert ia.answer(name, version) == data
    assert (data["platform"], data["python_version"]) == (ia.PLATFORM, ia.PYTHON_VERSION)
    date = datetime.fromisoformat(data["date"].replace("Z", "+00:00"))
    assert data["date"].endswith("Z") and date.utcoffset() == UTC.utcoffset(None)
    argv = shlex.split(data["command"])
    assert argv[-1] == data["requested"]
    asked = (("--platform", ia.PLATFORM), ("--python-version", ia.PYTHON_VERSION),
             ("--report", "R.json"))
    for flag, value in asked:
        assert argv[argv.index(flag) + 1] == value
    assert {"install", "--dry-run", "--no-deps", "--ignore-installed",
            "--only-binary=:all:"} <= set(argv)
    if data["served"]:
        assert re.fullmatch(r"[0-9a-f]{64}", data["sha256"])
        assert data["url"].rsplit("/", 1)[-1] == data["file"]
        wheel_name, wheel_version, _, tags = parse_wheel_filename(data["file"])
        assert (wheel_name, wheel_version) == (name, Version(data["version"]))
        assert tags & SPARK_TAGS, f"{data['file']} does not install on CPython 3.12 aarch64"
        if data["requires_python"]:
            assert "3.12.3" in SpecifierSet(data["requires_python"])
        for text in data["requires_dist"]:
            Requirement(text)
    else:
        assert data["error"] == data["errors"][-1]
        refusal = f"No matching distribution found for {data['requested']}"
        assert any(refusal in line for line in data["errors"])


# ---- what vLLM 0.32.0 needs, and that it is served -----------------------------------------------


def test_vllm_0_32_0_is_served_as_an_aarch64_wheel() -> None:
    data = served_answer("vllm", "0.32.0")
    assert data["file"].endswith("-manylinux_2_28_aarch64.whl")
    assert "3.12.3" in SpecifierSet(data["requires_python"])


def test_vllm_pins_torch_flashinfer_and_fastsafetensors() -> None:
    reqs = by_name(ia.requires("vllm", "0.32.0"))
    assert str(only(reqs, "torch").specifier) == "==2.13.0"
    assert str(only(reqs, "flashinfer-python").specifier) == "==0.7.0.post1"
    assert str(only(reqs, "fastsafetensors").specifier) == ">=0.3.3"


@pytest.mark.parametrize("name", ["torch", "flashinfer-python", "nvidia-cutlass-dsl"])
def test_each_exact_pin_of_vllm_is_served(name: str) -> None:
    req = only(by_name(ia.requires("vllm", "0.32.0")), name)
    (spec,) = req.specifier
    assert spec.operator == "=="
    assert ia.served(name, spec.version)
    assert Version(served_answer(name, spec.version)["version"]) in req.specifier


def test_a_served_fastsafetensors_meets_vllms_floor() -> None:
    floor = only(by_name(ia.requires("vllm", "0.32.0")), "fastsafetensors").specifier
    recorded = [a for a in ia.answers() if a["name"] == "fastsafetensors" and a["served"]]
    assert recorded, "no served fastsafetensors recorded"
    for data in recorded:
        assert Version(data["version"]) in floor, \
            f"fastsafetensors {data['version']} is below vLLM's {floor}"


def test_vllm_asks_cutlass_dsl_for_cuda_13_and_that_extra_is_served() -> None:
    req = only(by_name(ia.requires("vllm", "0.32.0")), "nvidia-cutlass-dsl")
    assert "cu13" in req.extras
    (spec,) = req.specifier
    plain = by_name(ia.requires("nvidia-cutlass-dsl", spec.version))
    with_cu13 = by_name(ia.requires("nvidia-cutlass-dsl", spec.version, extras=req.extras))
    assert "nvidia-cutlass-dsl-libs-cu13" not in plain
    assert str(only(with_cu13, "nvidia-cutlass-dsl-libs-cu13").specifier) == f"=={spec.version}"


def test_flashinfer_accepts_the_torch_vllm_pins() -> None:
    vllm = by_name(ia.requires("vllm", "0.32.0"))
    (torch_pin,) = only(vllm, "torch").specifier
    (fi_pin,) = only(vllm, "flashinfer-python").specifier
    torch_reqs = by_name(ia.requires("flashinfer-python", fi_pin.version)).get("torch", [])
    assert torch_reqs, "flashinfer-python no longer names torch"
    assert all(Version(torch_pin.version) in r.specifier for r in torch_reqs)


def test_vllm_requires_keeps_aarch64_and_drops_other_machines_and_extras() -> None:
    recorded = served_answer("vllm", "0.32.0")["requires_dist"]
    kept = ia.requires("vllm", "0.32.0")
    aarch64_only = [r for r in recorded if 'platform_machine == "aarch64"' in r]
    s390x_only = [r for r in recorded if re.search(r';\s*platform_machine == "s390x"\s*$', r)]
    extras_only = [r for r in recorded if re.search(r';\s*extra == "[^"]+"\s*$', r)]
    assert aarch64_only and s390x_only and extras_only, \
        "the recorded metadata lacks the markers read here"
    assert set(aarch64_only) <= set(kept)
    assert not (set(s390x_only) | set(extras_only)) & set(kept)


# ---- torch 2.13.0 is a CUDA 13 build -------------------------------------------------------------


def test_torch_2_13_0_is_a_cuda_13_build_for_aarch64() -> None:
    data = served_answer("torch", "2.13.0")
    assert Version(data["version"]).local is None, "the index's torch carries a local label"
    _, _, _, tags = parse_wheel_filename(data["file"])
    assert {t.platform for t in tags} == {"manylinux_2_28_aarch64"}
    reqs = by_name(ia.requires("torch", "2.13.0"))
    cuda13 = sorted(n for n in reqs if n.endswith("-cu13"))
    cuda12 = sorted(n for n in reqs if re.search(r"-cu1[0-2]$", n))
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13"} <= set(cuda13), cuda13
    assert not cuda12, f"torch 2.13.0 names CUDA 12 packages: {cuda12}"
    (toolkit,) = only(reqs, "cuda-toolkit").specifier
    assert toolkit.operator == "==" and Version(toolkit.version).release[:2] == (13, 0)
    assert {"cudart", "cublas", "nvrtc"} <= only(reqs, "cuda-toolkit").extras


# ---- refusals ------------------------------------------------------------------------------------


def test_torch_with_a_cu130_label_is_not_served_though_2_13_0_is() -> None:
    assert not ia.served("torch", "2.13.0+cu130")
    refused = ia.answer("torch", "2.13.0+cu130")
    assert refused is not None and refused["versions_offered"], refused
    assert "2.13.0" in refused["versions_offered"]
    assert ia.served("torch", "2.13.0")
    with pytest.raises(LookupError, match="not served"):
        ia.requires("torch", "2.13.0+cu130")


def test_vllm_0_20_1_is_not_served_for_aarch64() -> None:
    assert not ia.served("vllm", "0.20.1")
    refused = ia.answer("vllm", "0.20.1")
    assert refused is not None and "0.20.1" not in (refused["versions_offered"] or [])
    assert "0.32.0" in (refused["versions_offered"] or [])


def test_an_unrecorded_pin_is_no_evidence(tmp_path: Path) -> None:
    assert ia.answer("vllm", "0.32.0", tmp_path) is None
    with pytest.raises(LookupError, match="no recorded answer"):
        ia.served("vllm", "0.32.0", tmp_path)
    with pytest.raises(LookupError, match="no recorded answer"):
        ia.requires("vllm", "0.32.0", directory=tmp_path)


# ---- the loader's markers (hand-written) ---------------------------------------------------------

HAND_WRITTEN = [
    "plain",
    'x86-only; platform_machine == "x86_64"',
    'aarch64-only; platform_machine == "aarch64"',
    'not-s390x>=1; platform_machine != "s390x"',
    'windows; sys_platform == "win32"',
    'mac; sys_platform == "darwin"',
    'linux-system; platform_system == "Linux"',
    'old-python; python_version < "3.12"',
    'new-python; python_version >= "3.12"',
    'patched; python_full_version >= "3.12.4"',
    'pypy; implementation_name == "pypy"',
    'bench; extra == "bench"',
    'linux-py; platform_system == "Linux" and python_version < "3.15"',
    'either; platform_machine == "arm64" or platform_machine == "aarch64"',
]


def test_markers_that_exclude_linux_aarch64_py312_are_dropped() -> None:
    assert ia.applicable(HAND_WRITTEN) == [
        "plain",
        'aarch64-only; platform_machine == "aarch64"',
        'not-s390x>=1; platform_machine != "s390x"',
        'linux-system; platform_system == "Linux"',
        'new-python; python_version >= "3.12"',
        'linux-py; platform_system == "Linux" and python_version < "3.15"',
        'either; platform_machine == "arm64" or platform_machine == "aarch64"',
    ]


def test_an_extra_asked_for_is_kept() -> None:
    kept = ia.applicable(HAND_WRITTEN, extras=["bench"])
    assert 'bench; extra == "bench"' in kept
    assert len(kept) == len(ia.applicable(HAND_WRITTEN)) + 1


def test_requires_reads_markers_of_a_recorded_answer(tmp_path: Path) -> None:
    (tmp_path / "demo-1.0.json").write_text(json.dumps(
        {"requested": "demo==1.0", "name": "demo", "version": "1.0", "served": True,
         "requires_dist": HAND_WRITTEN}))
    assert ia.served("demo", "1.0", tmp_path)
    assert ia.requires("Demo", "1.0", directory=tmp_path) == ia.applicable(HAND_WRITTEN)


# ---- the recorder's parsing of pip (hand-written pip output) -------------------------------------

REPORT = {"install": [{
    "download_info": {"url": "https://files.example/p/demo-1.0-py3-none-any.whl",
                      "archive_info": {"hash": "sha256=" + "ab" * 32}},
    "metadata": {"name": "Demo", "version": "1.0", "requires_python": ">=3.10",
                 "requires_dist": ["a>=1"]},
}]}


def test_outcome_of_a_served_pin() -> None:
    data = ia.outcome("demo==1.0", 0, "", REPORT)
    assert data["served"] is True
    assert (data["name"], data["version"], data["file"]) == ("demo", "1.0",
                                                             "demo-1.0-py3-none-any.whl")
    assert data["sha256"] == "ab" * 32 and data["requires_dist"] == ["a>=1"]
    with pytest.raises(ia.IndexQueryError, match="report is for demo==1.0"):
        ia.outcome("demo==2.0", 0, "", REPORT)


def test_outcome_of_a_refused_pin() -> None:
    stderr = ("ERROR: Could not find a version that satisfies the requirement demo==9"
              " (from versions: 1.0, 2.0)\n"
              "ERROR: No matching distribution found for demo==9\n")
    data = ia.outcome("demo==9", 1, stderr, None)
    assert data["served"] is False
    assert data["error"] == "ERROR: No matching distribution found for demo==9"
    assert data["versions_offered"] == ["1.0", "2.0"]


def fake_pip(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """record_one runs ``code`` (in the temp folder, as it runs pip) instead of pip."""
    monkeypatch.setattr(ia, "pip_argv", lambda pin: [sys.executable, "-c", code])


def test_record_writes_what_pip_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip(monkeypatch, f"import json; json.dump({REPORT!r}, open('R.json', 'w'))")
    path, data = ia.record_one("demo==1.0", tmp_path)
    assert (path == tmp_path / "demo-1.0.json"
            and [p.name for p in tmp_path.iterdir()] == ["demo-1.0.json"])
    assert json.loads(path.read_text()) == data and data["served"]
    assert data["file"] == "demo-1.0-py3-none-any.whl"
    assert path.stat().st_mode & 0o777 == 0o644
    assert data["command"] == ia.command_line("demo==1.0") and data["date"].endswith("Z")
    assert data["command"].startswith(f"PIP_CONSTRAINT={os.devnull} ")


def test_record_writes_a_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip(monkeypatch, "import sys; sys.stderr.write("
                          "'ERROR: No matching distribution found for demo==9\\n'); sys.exit(1)")
    assert ia.record(tmp_path, ["demo==9"]) == [tmp_path / "demo-9.json"]
    assert not ia.served("demo", "9", tmp_path)
    assert ia.answer("demo", "9", tmp_path)["versions_offered"] is None


def test_a_failure_that_is_no_refusal_records_nothing(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip(monkeypatch, "import sys; sys.stderr.write('WARNING: Retrying\\nERROR: Could not "
                          "install packages due to an OSError: connection refused\\n'); "
                          "sys.exit(1)")
    with pytest.raises(ia.IndexQueryError, match="without refusing"):
        ia.record(tmp_path, ["demo==1.0"])
    assert not list(tmp_path.iterdir())
    assert ia.main(["record", "--out", str(tmp_path), "demo==1.0"]) == 1
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("pin", ["demo>=1", "demo==1.*", "demo", "demo[x]==1", "demo===1",
                                 "demo==1; os_name=='nt'"])
def test_only_exact_pins_are_asked(pin: str) -> None:
    with pytest.raises(ValueError, match="exact pin|not a requirement"):
        ia.parse_pin(pin)
