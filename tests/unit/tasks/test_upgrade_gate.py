"""The upgrade's tok/s gate (tasks.upgrade.gate): the tolerance from the two benches' spread, a
fixed max slowdown, and results that cannot be compared."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sparkspec.errors import UserError
from tasks.upgrade.gate import Z, judge, mismatch


def _result(mean: float, std: float, n: int = 15, release: str = "0.31.0",
            **extra: Any) -> dict[str, Any]:
    return {"per_request_tok_s_mean": mean, "per_request_tok_s_std": std, "completed": n,
            "vllm_release": release, "method": "baseline", "suite": "all",
            "max_concurrency": 2, "max_tokens": 48, "temperature": 0.0, "num_prompts": n,
            "profile": "sim-tiny", **extra}


def test_the_tolerance_is_two_standard_errors_of_the_difference() -> None:
    old, new = _result(50.0, 1.5, 15), _result(48.0, 2.0, 15, "0.32.0")
    verdict = judge(old, new)
    tolerance = Z * math.sqrt(1.5**2 / 15 + 2.0**2 / 15) / 50.0
    assert verdict.tolerance == pytest.approx(tolerance)       # 2.6 %
    assert not verdict.keep                                   # 48.0 < 50 * (1 - 0.026)
    assert "48.0 tok/s per request on vLLM 0.32.0 against 50.0 on 0.31.0" in verdict.line
    assert judge(old, _result(48.8, 2.0, 15, "0.32.0")).keep  # 48.8 >= 48.7


def test_a_noisier_bench_allows_more_and_a_fixed_slowdown_overrides_it() -> None:
    old, new = _result(50.0, 10.0), _result(45.0, 10.0, release="0.32.0")
    assert judge(old, new).keep                              # 10 % down, within 2 SE (14.6 %)
    assert not judge(old, new, max_slowdown=0.05).keep
    assert judge(old, new, max_slowdown=0.1).source == "max_slowdown"


@pytest.mark.parametrize(("result", "expected"), [
    ({"per_request_tok_s_mean": 10.0}, "not a bench result"),
    (_result(10.0, 1.0, n=1), "1 completed requests"),
    (_result(0.0, 0.0), "at 0.0 tok/s"),
    (_result(float("nan"), 1.0), "at nan tok/s"),
])
def test_a_result_the_gate_cannot_read_is_one_line(result: dict[str, Any], expected: str) -> None:
    with pytest.raises(UserError, match=expected):
        judge(_result(10.0, 1.0), result)


def test_results_of_different_workloads_are_not_compared() -> None:
    assert mismatch(_result(10.0, 1.0), _result(11.0, 1.0, release="0.32.0")) == ""
    assert mismatch(_result(10.0, 1.0), _result(11.0, 1.0, max_concurrency=1)) == \
        "max_concurrency 2 then 1"


@pytest.mark.parametrize("value", ["1", "1.5", "-0.1", "fast", "nan"])
def test_a_max_slowdown_that_is_not_a_fraction_is_one_line(value: str) -> None:
    from invoke import Exit

    from tasks.upgrade import _slowdown

    with pytest.raises(Exit) as err:
        _slowdown(value)
    assert err.value.code == 2 and "is not a fraction from 0 to below 1" in str(err.value.message)


def test_a_max_slowdown_fraction_or_auto() -> None:
    from tasks.upgrade import _slowdown

    assert _slowdown("0.05") == 0.05 and _slowdown("auto") is None and _slowdown(None) is None
