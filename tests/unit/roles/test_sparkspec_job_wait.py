"""The sparkspec role's sparkspec_job_wait module (the long poll behind sparkspec_progress), run as
Ansible runs a module: its file with the arguments in a JSON file. An ended job's result comes back
as async_status gives it and its results file is gone; a running job returns at the wait's end with
the progress text; a job id that is not async_wrapper's is refused before any file is read."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[3] / "roles/sparkspec/library/sparkspec_job_wait.py"
JID = "j123456789.4242"


def _run(tmp_path: Path, **args: object) -> tuple[dict, float]:
    (tmp_path / "args.json").write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(MODULE), str(tmp_path / "args.json")],
                          capture_output=True, text=True, check=False, timeout=60)
    took = time.monotonic() - start
    return json.loads(proc.stdout.strip().splitlines()[-1]), took


def _write(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.rename(path)   # as async_wrapper writes: whole documents only


def test_a_job_that_ends_during_the_wait_returns_its_result_and_its_file_is_removed(
        tmp_path: Path) -> None:
    jobs = tmp_path / "async"
    jobs.mkdir()
    _write(jobs / JID, {"started": 1, "finished": 0, "ansible_job_id": JID})
    result = {"rc": 0, "stdout": '{"changed": true}', "stderr": "", "cmd": ["x"], "changed": True}
    timer = threading.Timer(1.0, _write, (jobs / JID, result))
    timer.start()
    try:
        got, took = _run(tmp_path, jid=JID, async_dir=str(jobs), wait=20)
    finally:
        timer.join()
    assert got["finished"] is True and got["ansible_job_id"] == JID
    assert {k: got[k] for k in result} == result
    assert not (jobs / JID).exists()
    assert took < 15, f"the wait did not return when the job ended ({took:.1f} s of a 20 s wait)"


def test_a_running_job_returns_at_the_wait_end_with_the_progress_text(tmp_path: Path) -> None:
    jobs = tmp_path / "async"
    jobs.mkdir()
    _write(jobs / JID, {"started": 1, "finished": 0, "ansible_job_id": JID})
    (jobs / "progress.json").write_text('{"done": 5, "total": 10}')
    got, _ = _run(tmp_path, jid=JID, async_dir=str(jobs), wait=0.3,
                  progress=str(jobs / "progress.json"))
    assert (got["finished"], got["progress"]) == (False, '{"done": 5, "total": 10}')
    assert (jobs / JID).exists()
    got, _ = _run(tmp_path, jid=JID, async_dir=str(jobs), wait=0,
                  progress=str(jobs / "absent.json"))
    assert (got["finished"], got["progress"]) == (False, None)


@pytest.mark.parametrize(("jid", "wait", "message"), [
    ("../../etc/passwd", 1, "is not an async job id"),
    ("j1.2/../../x", 1, "is not an async job id"),
    (JID, 61, "give 0-60 seconds"),
    ("j999.1", 1, "could not find job"),
], ids=["path", "path-after-id", "wait", "absent"])
def test_refused(tmp_path: Path, jid: str, wait: float, message: str) -> None:
    (tmp_path / "async").mkdir()
    got, _ = _run(tmp_path, jid=jid, async_dir=str(tmp_path / "async"), wait=wait)
    assert got.get("failed") is True and message in got["msg"], got
