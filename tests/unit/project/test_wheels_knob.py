"""The SPARKSPEC_WHEELS knob (where torch's CPU build comes from): the first README command stops at
once, with one line naming the knob, when the knob points at nothing usable, and changes nothing
before it does."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def _quickstart(wheels: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "SPARKSPEC_WHEELS": wheels}
    start = time.monotonic()
    proc = subprocess.run([str(ROOT / "scripts" / "quickstart")], env=env, capture_output=True,
                          text=True, timeout=120, check=False, cwd=ROOT)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("kind",
                         ["empty folder", "missing folder", "folder of other wheels", "dead index"])
def test_quickstart_stops_within_a_minute_naming_the_knob(tmp_path, kind):
    if kind == "empty folder":
        wheels = str(tmp_path)
    elif kind == "missing folder":
        wheels = str(tmp_path / "nope")
    # a wheel of another package, and a file named like torch's that is none
    elif kind == "folder of other wheels":
        (tmp_path / "six-1.0-py3-none-any.whl").write_bytes(b"PK\x05\x06" + bytes(18))
        (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(
            b"not a wheel")
        wheels = str(tmp_path)
    else:
        wheels = "http://127.0.0.1:9/simple"
    source = ROOT / ".cache" / "torch-source"
    before = source.read_bytes() if source.exists() else None
    proc, took = _quickstart(wheels)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert took < 60
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bootstrap: error: SPARKSPEC_WHEELS=")
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "installing" not in proc.stdout  # stopped before pip or apt ran
    assert (source.read_bytes() if source.exists() else None) == before
