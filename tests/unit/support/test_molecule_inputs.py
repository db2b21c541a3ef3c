"""The molecule scenarios' inputs (tests/support/molecule_inputs.py): written once, reused while
their sources are unchanged, written again when one changes; an unknown role is refused in one
line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from sparkspec.errors import UserError
from tests.conftest import ROOT
from tests.support import molecule_inputs


def test_every_scenario_prepares_its_inputs_with_the_entry_point():
    for role in molecule_inputs.roles():
        text = (ROOT / "roles" / role / "molecule" / "default" / "molecule.yml").read_text()
        assert f"-m tests.support.molecule_inputs {role}\n" in text, role
        assert "test_sequence: [dependency, " in text, role


def test_an_unknown_role_is_refused_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "tests.support.molecule_inputs", "nosuchrole"],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 2
    line = (f"{molecule_inputs.PROG}: error: role 'nosuchrole' has no molecule "
            f"scenario; give one of {', '.join(molecule_inputs.roles())}")
    assert proc.stderr.splitlines() == [line]
    with pytest.raises(UserError, match="no molecule scenario"):
        molecule_inputs.prepare("nosuchrole")


def test_vllm_build_inputs_are_cached_until_a_source_changes(tmp_path, monkeypatch):
    source = tmp_path / "source.txt"
    source.write_text("one\n")
    monkeypatch.setattr(molecule_inputs, "STANDIN_SOURCES",
                        (*molecule_inputs.STANDIN_SOURCES, source))
    cache = tmp_path / "cache"
    record = molecule_inputs.vllm_build(cache)
    first = json.loads(record.read_text())
    tarball = cache / "vllm_build" / "vllm-0.32.0.tar.gz"
    assert first["dir"] == str(cache / "vllm_build")
    assert first["sha256"] == hashlib.sha256(tarball.read_bytes()).hexdigest()
    wheels = sorted(p.name for p in (cache / "vllm_build" / "wheels").iterdir())
    assert [w.split("-")[:2] for w in wheels] == [["flashinfer_python", "0.7.0.post1+standin"],
                                                  ["torch", "2.13.0+cpu"],
                                                  ["torch", "2.13.0+cu130"]]
    stat = tarball.stat()

    assert molecule_inputs.vllm_build(cache) == record   # unchanged sources: nothing written
    assert tarball.stat().st_mtime_ns == stat.st_mtime_ns and \
        json.loads(record.read_text()) == first

    source.write_text("two\n")
    molecule_inputs.vllm_build(cache)
    again = json.loads(record.read_text())
    assert again["digest"] != first["digest"]
    assert again["sha256"] == hashlib.sha256(tarball.read_bytes()).hexdigest()
