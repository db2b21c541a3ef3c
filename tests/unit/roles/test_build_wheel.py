"""The sparkspec_tools role's controller-side wheel build
(roles/sparkspec_tools/files/build_wheel.py) on a copy of the project: an unchanged source reuses
the wheel without a build; a changed source file, or a wheel whose bytes are no longer the recorded
ones, builds again; the bytes are reproducible (SOURCE_DATE_EPOCH)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "roles/sparkspec_tools/files/build_wheel.py"


def _build(project: Path, dist: Path) -> dict:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(project), str(dist)],
                          capture_output=True, text=True,
                          env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"}, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_reuses_an_unchanged_build_and_rebuilds_a_changed_one(tmp_path: Path) -> None:
    project, dist = tmp_path / "project", tmp_path / "dist"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    first = _build(project, dist)
    assert first["built"] is True and Path(first["wheel"]).name.startswith("sparkspec-")
    again = _build(project, dist)
    assert again == {**first, "built": False}
    (project / "src/sparkspec/__pycache__").mkdir(exist_ok=True)
    # caches are not source
    (project / "src/sparkspec/__pycache__/x.cpython-311.pyc").write_bytes(b"cache")
    assert _build(project, dist)["built"] is False
    init = project / "src/sparkspec/__init__.py"
    original = init.read_text()
    init.write_text(original + "# changed\n")
    changed = _build(project, dist)
    assert changed["built"] is True and changed["sha256"] != first["sha256"]
    init.write_text(original)
    back = _build(project, dist)
    assert back["built"] is True and \
        back["sha256"] == first["sha256"], "the bytes are not reproducible"
    # a wheel that lost its recorded bytes is built again
    Path(back["wheel"]).write_bytes(b"not the wheel")
    assert _build(project, dist) == {**first, "built": True}


def test_a_folder_without_the_project_is_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), str(tmp_path / "dist")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"sparkspec_tools: {tmp_path} holds no pyproject.toml; point sparkspec_tools_source "
        "at the project"]
