"""What the operate commands read of a vLLM server: /health, /metrics (counters through
:func:`sparkspec.bench.metrics.parse`; the gauges and info labels it does not keep through the same
prometheus_client parser), and the systemctl answers they act on. Every read is bounded in size and
time."""

from __future__ import annotations

import math
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from sparkspec.bench import metrics
from sparkspec.errors import UserError
from sparkspec.validate import read_regular

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"   # a gauge; absent from older builds
CACHE_CONFIG = "vllm:cache_config_info"
SMALL_BODY = 64 << 10  # bytes of a /health or completion answer
MAX_METRICS = 8 << 20  # bytes of a /metrics answer (the watchdog's and the measurement's reads)
DEADLINE_S = 30.0  # seconds a whole request (headers and body) may take unless told otherwise
SYSTEMCTL = "/usr/bin/systemctl"  # absolute: never found on PATH; tests set this constant
KEY_ENV = "VLLM_API_KEY"  # the key's fallback when no --api-key-file is given
MAX_KEY_FILE = 4096  # bytes of an --api-key-file
ACTIVE = frozenset({"active", "activating", "reloading", "refreshing"})

Systemctl = Callable[[Sequence[str]], str]
"""Runs ``systemctl ARGS`` and returns its stdout (tests pass a fake)."""


def systemctl(args: Sequence[str]) -> str:
    """``systemctl ARGS``'s stdout; a missing systemctl, a hang or a failed action is one line."""
    try:
        proc = subprocess.run([SYSTEMCTL, *args], capture_output=True, text=True, timeout=120,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"systemctl {' '.join(args)}: {exc}; check that systemd runs here") \
            from None
    if proc.returncode != 0 and args[:1] not in (["is-active"], ["show"]):
        tail = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"systemctl {' '.join(args)} exited {proc.returncode}: "
                        f"{metrics.clean(tail)}")
    return proc.stdout


def read_key(path: str | None, env: str = KEY_ENV) -> str | None:
    """The API key: the one line of the file at ``path`` (bounded; its text never quoted), else
    ``$env``, else None."""
    if path is None:
        return os.environ.get(env) or None
    fix = "write the key alone on one line (chmod 600)"
    data = read_regular(path, "API key file", MAX_KEY_FILE)
    try:
        lines = data.decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise UserError(f"{path}: the API key file is not ASCII text; {fix}") from None
    key = lines[0].strip() if len(lines) == 1 else ""
    if not key or not key.isprintable() or " " in key:
        raise UserError(f"{path}: the API key file does not hold one key on one line; {fix}")
    return key


def client(timeout: float) -> httpx.Client:
    """An HTTP client for a local vLLM: bounded in time, proxies from the environment ignored."""
    return httpx.Client(timeout=httpx.Timeout(timeout), trust_env=False)


def fetch(http: httpx.Client, method: str, url: str, api_key: str | None = None,
          limit: int = SMALL_BODY, deadline_s: float = DEADLINE_S,
          body: object = None) -> tuple[int, bytes]:
    """``method url``: its status and at most ``limit`` bytes of body within ``deadline_s`` of
    wall-clock time over the whole request (checked at every chunk, each read bounded by the same
    time), else one line (UserError) naming the URL; a time-out says "no answer within"."""
    return metrics.request_bounded(http, method, url, api_key, limit, deadline_s, body)


def healthy(http: httpx.Client, url: str, deadline_s: float = DEADLINE_S) -> bool:
    """Whether GET /health answers 200 (any failure, a timeout included, is False)."""
    try:
        status, _ = fetch(http, "GET", url + "/health", None, SMALL_BODY, deadline_s)
    except UserError:
        return False
    return status == 200


@dataclass(frozen=True)
class Sample:
    """One /metrics read: the counters the operate commands watch and the running requests gauge."""

    generation_tokens: float
    running: float
    has_spec_decode: bool
    draft_tokens: float
    accepted_tokens: float
    prompt_tokens: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None   # None: the build does not export the KV cache usage gauge


def _families(text: str, names: set[str]) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names:
                    found.setdefault(sample.name, []).append((dict(sample.labels),
                                                              float(sample.value)))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise UserError(f"/metrics: not Prometheus text ({metrics.clean(str(exc))})") from None
    return found


def read_metrics(http: httpx.Client, url: str, api_key: str | None = None, limit: int = MAX_METRICS,
                 deadline_s: float = DEADLINE_S) -> tuple[Sample, str]:
    """Counters and gauges of one /metrics read, and its text; one line (UserError) if it fails."""
    status, body = fetch(http, "GET", url + "/metrics", api_key, limit, deadline_s)
    if status != 200:
        raise UserError(f"{url}/metrics: HTTP {status}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{url}/metrics: not UTF-8 text") from None
    snap = metrics.parse(text)
    gauges = _families(text, {RUNNING, WAITING, KV_USAGE})
    running, waiting = (sum(v for _, v in gauges.get(name, [])) for name in (RUNNING, WAITING))
    for name, value in ((RUNNING, running), (WAITING, waiting)):
        if not (math.isfinite(value) and value >= 0):
            raise UserError(f"{url}/metrics: {name} is {value}, not a count")
    usage = [v for _, v in gauges.get(KV_USAGE, [])]   # one per engine; their sum shows any change
    kv_usage = sum(usage) if usage and all(math.isfinite(v) for v in usage) else None
    return Sample(snap.generation_tokens, running, snap.has_spec_decode, snap.num_draft_tokens,
                  snap.num_accepted_tokens, snap.prompt_tokens, waiting, kv_usage), text


def info_labels(text: str, name: str = CACHE_CONFIG) -> dict[str, str]:
    """The labels of an info gauge (vLLM's cache config: num_gpu_blocks, block_size, cache_dtype,
    ...), as strings; the first sample's when there are several (one per engine), {} when absent."""
    samples = _families(text, {name}).get(name, [])
    return {k: metrics.clean(v) for k, v in sorted(samples[0][0].items())} if samples else {}
