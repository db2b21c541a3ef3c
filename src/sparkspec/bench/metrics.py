"""The figures of a run: the client's own (``summarize``) and vLLM's /metrics (counter snapshots,
deltas over a run, and the spec-decode figures they give); and the bounded, key-redacting reads of a
server's answers.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx2 as httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from sparkspec.errors import UserError

GENERATION = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUEST_SECONDS = "vllm:e2e_request_latency_seconds_sum"
MAX_BODY = 32 << 20  # bytes of a /metrics or /v1/models answer
MAX_POSITION = 1024  # speculative positions (num_speculative_tokens) a server can report
QUOTE = 200  # characters of server text quoted in an error


def clean(text: str, secret: str | None = None) -> str:
    """Server text fit to quote in one line: key replaced, control characters dropped, cut short."""
    if secret:  # in any case: a server may echo the header lowercased
        text = re.sub(re.escape(secret), "***", text, flags=re.IGNORECASE)
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= QUOTE else text[:QUOTE] + "..."


def auth(api_key: str | None) -> dict[str, str]:
    """The request headers that carry the API key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def get_bounded(client: httpx.Client, url: str, api_key: str | None,
                limit: int = MAX_BODY) -> tuple[int, bytes]:
    """GET ``url``: its status and at most ``limit`` bytes of body, else one line naming the URL."""
    return request_bounded(client, "GET", url, api_key, limit)


def request_bounded(client: httpx.Client, method: str, url: str, api_key: str | None, limit: int,
                    deadline_s: float | None = None, body: object = None) -> tuple[int, bytes]:
    """``method url`` (``body`` as JSON): its status and at most ``limit`` bytes of answer, else one
    line (UserError) naming the URL; with ``deadline_s``, within that much wall-clock time over the
    whole request (checked at every chunk, each read bounded by the same time: a time-out says "no
    answer within")."""
    end = None if deadline_s is None else time.monotonic() + deadline_s
    late = f"{url}: no answer within {deadline_s:g} s" if deadline_s is not None else ""
    timeout = httpx.USE_CLIENT_DEFAULT if deadline_s is None else httpx.Timeout(deadline_s)
    try:
        with client.stream(method, url, headers=auth(api_key), json=body,
                           timeout=timeout) as response:
            data = bytearray()
            for piece in response.iter_bytes():
                data += piece
                if len(data) > limit:
                    raise UserError(f"{url}: answers more than {limit} bytes; --url must point at "
                                    "a vLLM server")
                if end is not None and time.monotonic() > end:
                    raise UserError(late)
            return response.status_code, bytes(data)
    except httpx.TimeoutException as exc:
        if end is None:
            raise UserError(f"{url}: unreachable or a broken answer ({exc.__class__.__name__}: "
                            f"{clean(str(exc), api_key)}); check --url and that the server is up") \
                from None
        raise UserError(late) from None
    except httpx.HTTPError as exc:
        raise UserError(f"{url}: unreachable or a broken answer ({exc.__class__.__name__}: "
                        f"{clean(str(exc), api_key)}); check --url and that the server is up") \
            from None


@dataclass(frozen=True)
class Snapshot:
    """Counter values (or, after ``delta``, their increase over a run)."""

    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    has_spec_decode: bool = False
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)
    request_seconds: float = 0.0
    """Sum of finished requests' end-to-end latency as the server saw it (its busy time at
    concurrency 1)."""


def parse(text: str) -> Snapshot:
    """A snapshot from Prometheus text exposition (as served on /metrics)."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    wanted = (GENERATION, PROMPT, DRAFTS, DRAFT_TOKENS, ACCEPTED, REQUEST_SECONDS)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name != ACCEPTED_PER_POS and sample.name not in wanted:
                    continue
                if not (math.isfinite(sample.value) and sample.value >= 0):
                    raise UserError(f"/metrics: {sample.name} is {sample.value}, not a count; "
                                    "point --url at a vLLM server")
                if sample.name == ACCEPTED_PER_POS:
                    pos = int(sample.labels.get("position", "0"))
                    if not 0 <= pos <= MAX_POSITION:
                        raise ValueError(f"position {pos} out of range")
                    per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
                else:
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise UserError(f"/metrics: not Prometheus text ({clean(str(exc))}); point --url at a vLLM "
                        "server") from None
    return Snapshot(
        generation_tokens=sums.get(GENERATION, 0.0),
        prompt_tokens=sums.get(PROMPT, 0.0),
        has_spec_decode=DRAFTS in sums,
        num_drafts=sums.get(DRAFTS, 0.0),
        num_draft_tokens=sums.get(DRAFT_TOKENS, 0.0),
        num_accepted_tokens=sums.get(ACCEPTED, 0.0),
        accepted_per_pos=dict(sorted(per_pos.items())),
        request_seconds=sums.get(REQUEST_SECONDS, 0.0),
    )


def delta(before: Snapshot, after: Snapshot) -> Snapshot:
    positions = sorted(set(before.accepted_per_pos) | set(after.accepted_per_pos))
    return Snapshot(
        generation_tokens=after.generation_tokens - before.generation_tokens,
        prompt_tokens=after.prompt_tokens - before.prompt_tokens,
        has_spec_decode=after.has_spec_decode,
        num_drafts=after.num_drafts - before.num_drafts,
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_tokens=after.num_accepted_tokens - before.num_accepted_tokens,
        accepted_per_pos={p: after.accepted_per_pos.get(p, 0.0)
                          - before.accepted_per_pos.get(p, 0.0) for p in positions},
        request_seconds=after.request_seconds - before.request_seconds,
    )


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def spec_decode_figures(d: Snapshot) -> dict[str, Any]:
    """The ``spec_decode_*`` result keys from a counter delta (None where not applicable)."""
    if not d.has_spec_decode:
        return {"spec_decode_acceptance_rate": None, "spec_decode_acceptance_length": None,
                "spec_decode_num_drafts": None, "spec_decode_draft_tokens": None,
                "spec_decode_accepted_tokens": None,
                "spec_decode_per_position_acceptance_rates": None}
    rate = _ratio(d.num_accepted_tokens, d.num_draft_tokens)
    per_accepted = _ratio(d.num_accepted_tokens, d.num_drafts)
    per_pos = [_ratio(v, d.num_drafts) for v in d.accepted_per_pos.values()]
    return {
        "spec_decode_acceptance_rate": None if rate is None else rate * 100.0,
        "spec_decode_acceptance_length": None if per_accepted is None else 1.0 + per_accepted,
        "spec_decode_num_drafts": int(d.num_drafts),
        "spec_decode_draft_tokens": int(d.num_draft_tokens),
        "spec_decode_accepted_tokens": int(d.num_accepted_tokens),
        "spec_decode_per_position_acceptance_rates": None if d.num_drafts <= 0 else per_pos,
    }


def scrape(client: httpx.Client, base_url: str, api_key: str | None = None) -> Snapshot:
    url = base_url.rstrip("/") + "/metrics"
    status, body = get_bounded(client, url, api_key)
    if status != 200:
        raise UserError(f"{url}: HTTP {status}; --url must point at a vLLM server with metrics "
                        "enabled")
    try:
        return parse(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"{url}: not UTF-8 text; point --url at a vLLM server") from None
    except UserError as exc:
        raise UserError(f"{url.removesuffix('/metrics')}{exc}") from None


def settled(client: httpx.Client, base_url: str, before: Snapshot, min_generation: float,
            api_key: str | None = None, timeout: float = 10.0, interval: float = 0.2) -> Snapshot:
    """Scrape until the counters stop moving and cover ``min_generation`` new tokens (or
    ``timeout``).

    vLLM records iteration stats just after it hands out a step's tokens, so a scrape taken the
    instant the last stream ends can miss the final step.
    """
    deadline = time.monotonic() + timeout
    last = scrape(client, base_url, api_key)
    while time.monotonic() < deadline:
        time.sleep(interval)
        now = scrape(client, base_url, api_key)
        if now == last and now.generation_tokens - before.generation_tokens >= min_generation:
            return now
        last = now
    return last


def _stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None,
                f"p99_{name}_ms": None}
    ms = np.asarray(values_s) * 1000.0
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


class Timed(Protocol):
    """What summarize reads of a request's result (the client's RequestResult), so this module needs
    no import of the client, which imports it."""

    ttft: float
    e2e: float
    input_tokens: int
    output_tokens: int


def summarize(results: Sequence[Timed], duration: float) -> dict[str, Any]:
    """``vllm bench serve``'s figures (and the article's per-request tok/s) of finished requests."""
    out_tokens = sum(r.output_tokens for r in results)
    in_tokens = sum(r.input_tokens for r in results)
    speeds = [r.output_tokens / r.e2e for r in results if r.e2e > 0]
    figures: dict[str, Any] = {
        "completed": len(results),
        "failed": 0,  # a failed request ends the run; nothing is written
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(results) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
    }
    figures |= _stats("ttft", [r.ttft for r in results])
    figures |= _stats("tpot", [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in results
                               if r.output_tokens > 1])
    figures |= _stats("e2el", [r.e2e for r in results])
    figures["per_request_tok_s_mean"] = float(np.mean(speeds)) if speeds else None
    figures["per_request_tok_s_max"] = float(np.max(speeds)) if speeds else None
    # the spread of the per-request speeds (population std): `invoke tune` compares k within it
    figures["per_request_tok_s_std"] = float(np.std(speeds)) if speeds else None
    return figures
