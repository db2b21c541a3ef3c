"""The deploy role's health waiter: healthy, crashed (restarted, about to restart, failed) and timed
out, run as the role runs it, against a real local HTTP server and a `systemctl` stand-in on PATH
that reports a unit state."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "roles/deploy/files/wait_healthy.py"


@pytest.fixture()
def server() -> Iterator[tuple[str, dict[str, int]]]:
    status = {"code": 503}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(status["code"])
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", status
    httpd.shutdown()


def wait(tmp_path: Path, url: str, states: list[str], timeout: float = 30,
         extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run the waiter; `systemctl show` answers the given states in turn (the last one repeats)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    for i, state in enumerate(states):
        (tmp_path / f"state{i}").write_text(state.replace(" ", "\n") + "\n")
    (bindir / "systemctl").write_text(
        "#!/bin/sh\n"
        f'n=$(cat {tmp_path}/calls 2>/dev/null || echo 0); echo $((n + 1)) > {tmp_path}/calls\n'
        f'[ $n -ge {len(states)} ] && n={len(states) - 1}\n'
        f'cat {tmp_path}/state$n\n')
    (bindir / "systemctl").chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    return subprocess.run([sys.executable, str(SCRIPT), url, "sparkspec-vllm.service", str(timeout),
                           "0.2", *extra],
                          capture_output=True, text=True, env=env, timeout=120)


RUNNING = "ActiveState=active SubState=running Result=success NRestarts=0"


def test_healthy_unit_passes(tmp_path: Path, server: tuple[str, dict[str, int]]) -> None:
    url, status = server
    status["code"] = 200
    run = wait(tmp_path, url, [RUNNING])
    assert run.returncode == 0 and run.stdout.startswith("healthy after"), run.stdout + run.stderr


@pytest.mark.parametrize(("state", "words"), [
    ("ActiveState=active SubState=running Result=success NRestarts=1",
     "crashed and systemd restarted it (1 time"),
    ("ActiveState=activating SubState=auto-restart Result=exit-code NRestarts=0",
     "about to restart it"),
    ("ActiveState=failed SubState=failed Result=exit-code NRestarts=0",
     "the unit is failed (result: exit-code)"),
])
def test_crash_ends_the_wait_at_once(tmp_path: Path, server: tuple[str, dict[str, int]], state: str,
                                     words: str) -> None:
    url, _ = server  # /health answers 503 throughout: only the unit's state can end the wait early
    run = wait(tmp_path, url, [RUNNING, RUNNING, state], timeout=60)
    assert run.returncode == 1 and words in run.stdout, run.stdout + run.stderr
    assert run.stdout.count("\n") == 1 and "s after the start" in run.stdout


def test_loading_unit_times_out(tmp_path: Path, server: tuple[str, dict[str, int]]) -> None:
    url, _ = server
    run = wait(tmp_path, url, [RUNNING], timeout=1)
    assert run.returncode == 1 and \
        "did not answer 200 within 1 s" in run.stdout, run.stdout + run.stderr


def test_journal_lines_named_by_a_pattern_are_printed(tmp_path: Path,
                                                      server: tuple[str, dict[str, int]]) -> None:
    """--journal-fail: after /health answers, this invocation's journal lines that a pattern matches
    come out as `journal: LINE` (secrets masked), the others not; the waiter still exits 0 (the role
    decides)."""
    url, status = server
    status["code"] = 200
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "journalctl").write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {tmp_path}/journal-args\n'
        "printf 'Loading weights\\nlayers.3.weight_scale_inv skipped (api_key=abc123)"
        "\\nReady\\n'\n")
    (bindir / "journalctl").chmod(0o755)
    run = wait(tmp_path, url, [RUNNING + " InvocationID=9f2c41d0"],
               extra=("--journal-fail", "weight_scale_inv.*skip", "--journal-fail", "^Nope"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[1:] == ["journal: layers.3.weight_scale_inv skipped "
                                           "(api_key=***)"], run.stdout
    # the invocation's journal only (its id from systemctl show), not the unit's older starts
    assert "_SYSTEMD_INVOCATION_ID=9f2c41d0" in (tmp_path / "journal-args").read_text()
