"""The upgrade's tok/s gate: the new release's bench result against the old release's, with a
tolerance from the two benches' own spread (docs/building-vllm.md "Upgrades")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sparkspec.errors import UserError

# Two standard errors of the difference of two means: a release of equal speed passes with about
# 97.7 % (one-sided, normal approximation).
Z = 2.0
# What must match for two results to measure the same thing.
SAME = ("method", "suite", "max_concurrency", "max_tokens", "temperature", "num_prompts",
        "profile")
METRIC = "per_request_tok_s_mean"


@dataclass(frozen=True)
class Verdict:
    keep: bool
    old: float          # tok/s per request, the old release's record
    new: float
    tolerance: float    # the slowdown allowed, a fraction of old
    source: str         # "spread" or "max_slowdown"
    line: str


def figures(result: Mapping[str, Any], name: str) -> tuple[float, float, int]:
    """tok/s per request, its spread and the completed requests of a bench result."""
    try:
        mean, std = float(result[METRIC]), float(result["per_request_tok_s_std"] or 0.0)
        count = int(result["completed"])
    except (KeyError, TypeError, ValueError):
        raise UserError(f"{name}: not a bench result with {METRIC}, its std and completed; "
                        "run invoke verify again") from None
    if count < 2 or not math.isfinite(mean) or mean <= 0:
        raise UserError(f"{name}: {count} completed requests at {mean} tok/s; the gate needs at "
                        "least 2 with a positive rate (verify_requests)")
    return mean, std, count


def mismatch(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """'' when both results measured the same workload, else the first key that differs."""
    for name in SAME:
        if old.get(name) != new.get(name):
            return f"{name} {old.get(name)!r} then {new.get(name)!r}"
    return ""


def judge(old: Mapping[str, Any], new: Mapping[str, Any],
          max_slowdown: float | None = None) -> Verdict:
    """Keep the new release when its tok/s per request is at least the old one's less the
    tolerance: ``max_slowdown`` where given, else Z standard errors of the difference of the two
    means (each bench's per-request spread over its completed requests)."""
    m0, s0, n0 = figures(old, "the old release's result")
    m1, s1, n1 = figures(new, "the new release's result")
    if max_slowdown is None:
        tolerance, source = Z * math.sqrt(s0 * s0 / n0 + s1 * s1 / n1) / m0, "spread"
    else:
        tolerance, source = max_slowdown, "max_slowdown"
    floor = m0 * (1 - tolerance)
    keep = m1 >= floor
    line = (f"{m1:.1f} tok/s per request on vLLM {new.get('vllm_release', '?')} against "
            f"{m0:.1f} on {old.get('vllm_release', '?')} ({m1 / m0:.3f}x; floor {floor:.1f}: "
            f"{tolerance:.1%} below, from the "
            f"{'benches spread' if source == 'spread' else source})")
    return Verdict(keep, m0, m1, tolerance, source, line)
