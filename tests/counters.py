"""vLLM's counters read straight off the /metrics text, independently of sparkspec.bench.metrics,
and the check that a `sparkspec bench` result gives exactly what their deltas give."""

from __future__ import annotations

import re
import urllib.request
from collections import defaultdict
from typing import Any

import pytest

SAMPLE = re.compile(r'^(vllm:[a-z_]+_total)(\{[^}]*\})? ([0-9.eE+-]+)$')


def raw_counters(base_url: str) -> dict[str, float]:
    """name (or name/position for the per-position counter) -> value summed over label sets."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        return counters_from_text(r.read().decode())


def counters_from_text(text: str) -> dict[str, float]:
    """The same, from /metrics text kept elsewhere (the verify role keeps it around its bench)."""
    sums: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if m := SAMPLE.match(line):
            pos = re.search(r'position="(\d+)"', m.group(2) or "")
            sums[m.group(1) + (f"/{pos.group(1)}" if pos else "")] += float(m.group(3))
    return dict(sums)


def assert_result_equals_counter_deltas(result: dict[str, Any], before: dict[str, float],
                                        after: dict[str, float]) -> None:
    """Output tokens and every spec_decode_* figure equal what the counter deltas give (drafts must
    be > 0)."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    assert result["total_output_tokens"] == d["vllm:generation_tokens_total"]
    assert result["total_input_tokens"] == d["vllm:prompt_tokens_total"]
    drafts = d["vllm:spec_decode_num_drafts_total"]
    draft_tokens = d["vllm:spec_decode_num_draft_tokens_total"]
    accepted = d["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and accepted > 0
    assert result["spec_decode_num_drafts"] == drafts
    assert result["spec_decode_draft_tokens"] == draft_tokens
    assert result["spec_decode_accepted_tokens"] == accepted
    assert result["spec_decode_acceptance_rate"] == pytest.approx(100.0 * accepted / draft_tokens)
    assert result["spec_decode_acceptance_length"] == pytest.approx(1.0 + accepted / drafts)
    positions = sorted(int(k.rsplit("/", 1)[1]) for k in d if k.startswith(
        "vllm:spec_decode_num_accepted_tokens_per_pos_total/"))
    assert positions == list(range(len(positions))) and positions
    per_pos = [d[f"vllm:spec_decode_num_accepted_tokens_per_pos_total/{i}"] / drafts
               for i in positions]
    assert result["spec_decode_per_position_acceptance_rates"] == pytest.approx(per_pos)
