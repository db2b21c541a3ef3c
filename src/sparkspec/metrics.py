"""vLLM's /metrics: counter snapshots, deltas over a run, and the spec-decode figures they give.

Parsed with prometheus_client's text parser; every counter is summed over its label sets (model_name, engine),
per-position acceptance keeps the ``position`` label. Formulas (as ``vllm bench serve`` reports them):
acceptance rate = accepted / draft tokens (percent); acceptance length = 1 + accepted / drafts;
per-position rate i = accepted_per_pos[i] / drafts (fractions). A server without spec-decode counters
(baseline) gives None for all of them, never 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from sparkspec.errors import UserError

GENERATION = "vllm:generation_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
REQUEST_SECONDS = "vllm:e2e_request_latency_seconds_sum"


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
    """Sum of finished requests' end-to-end latency as the server saw it (its busy time at concurrency 1)."""


def parse(text: str) -> Snapshot:
    """A snapshot from Prometheus text exposition (as served on /metrics)."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == ACCEPTED_PER_POS:
                    pos = int(sample.labels.get("position", "0"))
                    per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
                elif sample.name in (GENERATION, PROMPT, DRAFTS, DRAFT_TOKENS, ACCEPTED, REQUEST_SECONDS):
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    except ValueError as exc:
        raise UserError(f"/metrics: not Prometheus text ({exc}); point --url at a vLLM server") from None
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
        accepted_per_pos={p: after.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)
                          for p in positions},
        request_seconds=after.request_seconds - before.request_seconds,
    )


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def spec_decode_figures(d: Snapshot) -> dict[str, Any]:
    """The ``spec_decode_*`` result keys from a counter delta (None where not applicable)."""
    if not d.has_spec_decode:
        return {"spec_decode_acceptance_rate": None, "spec_decode_acceptance_length": None,
                "spec_decode_num_drafts": None, "spec_decode_draft_tokens": None,
                "spec_decode_accepted_tokens": None, "spec_decode_per_position_acceptance_rates": None}
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
    try:
        response = client.get(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else None)
    except httpx.TransportError as exc:
        raise UserError(f"{url}: unreachable ({exc.__class__.__name__}: {exc}); check --url and that "
                        "the server is up") from None
    if response.status_code != 200:
        raise UserError(f"{url}: HTTP {response.status_code}; --url must point at a vLLM server "
                        "with metrics enabled")
    return parse(response.text)


def settled(client: httpx.Client, base_url: str, before: Snapshot, min_generation: float,
            api_key: str | None = None, timeout: float = 10.0, interval: float = 0.2) -> Snapshot:
    """Scrape until the counters stop moving and cover ``min_generation`` new tokens (or ``timeout``).

    vLLM records iteration stats just after it hands out a step's tokens, so a scrape taken the instant the
    last stream ends can miss the final step.
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
