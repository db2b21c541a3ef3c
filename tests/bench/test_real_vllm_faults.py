"""Bad input against a real vLLM: a wrong API key, and a server killed in the middle of a run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import API_KEY, Cli, Server

pytestmark = pytest.mark.slow


def test_wrong_api_key_is_refused_and_a_killed_server_leaves_a_marked_partial_result(
        keyed_server: Server, cli: Cli, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    wrong = cli("bench", "--url", keyed_server.url, "--model", keyed_server.model, "--api-key", "wrong-key",
                "--output", str(out))
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1
    assert "401 Unauthorized" in wrong.stderr and "--api-key" in wrong.stderr and not out.exists()

    # Enough work that the run is still going when the server dies.
    proc = subprocess.Popen([sys.executable, "-m", "sparkspec.cli", "bench", "--url", keyed_server.url,
                             "--model", keyed_server.model, "--api-key", API_KEY, "--suite", "open",
                             "--requests", "400", "--max-tokens", "200", "--ignore-eos", "--output", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        with urllib.request.urlopen(keyed_server.url + "/metrics", timeout=10) as r:
            done = [ln for ln in r.read().decode().splitlines() if ln.startswith("vllm:request_success_total")]
        if sum(float(ln.rsplit(" ", 1)[1]) for ln in done) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, "the bench finished before the server could be killed"
    keyed_server.kill()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    result = json.loads(out.read_text())
    assert result["partial"] is True and result["error"]
    assert result["completed"] >= 2 and result["total_output_tokens"] == 200 * result["completed"]
    assert result["completed"] < 400
    assert "PARTIAL" in stderr
