"""What the operate commands read of a vLLM server: /health, /metrics (counters through
:func:`sparkspec.bench.metrics.parse`; the gauges and info labels it does not keep through the same
prometheus_client parser), and the systemctl answers they act on. Every read is bounded in size and time."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from sparkspec.bench import metrics
from sparkspec.errors import UserError

RUNNING = "vllm:num_requests_running"
CACHE_CONFIG = "vllm:cache_config_info"
SMALL_BODY = 64 << 10  # bytes of a /health or completion answer
ACTIVE = frozenset({"active", "activating", "reloading", "refreshing"})

Systemctl = Callable[[Sequence[str]], str]
"""Runs ``systemctl ARGS`` and returns its stdout (tests pass a fake)."""


def systemctl(args: Sequence[str]) -> str:
    """``systemctl ARGS``'s stdout; a missing systemctl, a hang or a failed action is one line."""
    try:
        proc = subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"systemctl {' '.join(args)}: {exc}; check that systemd runs here") from None
    if proc.returncode != 0 and args[:1] not in (["is-active"], ["show"]):
        tail = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"systemctl {' '.join(args)} exited {proc.returncode}: {metrics.clean(tail)}")
    return proc.stdout


def client(timeout: float) -> httpx.Client:
    """An HTTP client for a local vLLM: bounded in time, proxies from the environment ignored."""
    return httpx.Client(timeout=httpx.Timeout(timeout), trust_env=False)


def healthy(http: httpx.Client, url: str) -> bool:
    """Whether GET /health answers 200 (any failure, a timeout included, is False)."""
    try:
        status, _ = metrics.get_bounded(http, url + "/health", None, SMALL_BODY)
    except UserError:
        return False
    return status == 200


@dataclass(frozen=True)
class Sample:
    """One /metrics read: the counters the operate commands watch, and the running requests gauge."""

    generation_tokens: float
    running: float
    has_spec_decode: bool
    draft_tokens: float
    accepted_tokens: float


def _families(text: str, names: set[str]) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in names:
                    found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise UserError(f"/metrics: not Prometheus text ({metrics.clean(str(exc))})") from None
    return found


def read_metrics(http: httpx.Client, url: str, api_key: str | None = None) -> tuple[Sample, str]:
    """The counters and gauge of one /metrics read, and its text; one line (UserError) when it fails."""
    status, body = metrics.get_bounded(http, url + "/metrics", api_key)
    if status != 200:
        raise UserError(f"{url}/metrics: HTTP {status}")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{url}/metrics: not UTF-8 text") from None
    snap = metrics.parse(text)
    running = sum(v for _, v in _families(text, {RUNNING}).get(RUNNING, []))
    if not (math.isfinite(running) and running >= 0):
        raise UserError(f"{url}/metrics: {RUNNING} is {running}, not a count")
    return Sample(snap.generation_tokens, running, snap.has_spec_decode, snap.num_draft_tokens,
                  snap.num_accepted_tokens), text


def info_labels(text: str, name: str = CACHE_CONFIG) -> dict[str, str]:
    """The labels of an info gauge (vLLM's cache config: num_gpu_blocks, block_size, cache_dtype, ...), as
    strings; the first sample's when there are several (one per engine), {} when absent."""
    samples = _families(text, {name}).get(name, [])
    return {k: metrics.clean(v) for k, v in sorted(samples[0][0].items())} if samples else {}
