"""Bad input against a real vLLM: a wrong API key, and a server killed in the middle of a run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import API_KEY, Cli, Server

pytestmark = pytest.mark.slow


def test_wrong_api_key_is_refused_and_a_killed_server_leaves_no_result(
        keyed_server: Server, cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    key_file = tmp_path / "wrong-key"
    key_file.write_text("wrong-key\n")
    key_file.chmod(0o600)
    wrong = cli("bench", "--url", keyed_server.url, "--model", keyed_server.model, "--api-key-file",
                str(key_file), "--output", str(out))
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1
    assert "401 Unauthorized" in wrong.stderr and "--api-key" in wrong.stderr and not out.exists()
    assert "wrong-key" not in wrong.stderr

    # Enough work that the run is still going when the server dies.
    proc = subprocess.Popen([sys.executable, "-m", "sparkspec.cli", "bench",
                             "--url", keyed_server.url,
                             "--model", keyed_server.model, "--suite", "open",
                             "--requests", "400", "--max-tokens", "200", "--ignore-eos", "--output",
                             str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, SPARKSPEC_API_KEY=API_KEY))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        with urllib.request.urlopen(keyed_server.url + "/metrics", timeout=10) as r:
            done = [ln for ln in r.read().decode().splitlines()
                    if ln.startswith("vllm:request_success_total")]
        if sum(float(ln.rsplit(" ", 1)[1]) for ln in done) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, "the bench finished before the server could be killed"
    keyed_server.kill()
    stdout, stderr = proc.communicate(timeout=300)
    # a run that did not finish writes nothing: one line naming the URL, exit 1
    assert proc.returncode == 1, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("sparkspec: error: "), stderr
    assert "/v1/chat/completions" in lines[0] and "nothing written" in lines[0], lines[0]
    assert API_KEY not in stderr and not out.exists()
