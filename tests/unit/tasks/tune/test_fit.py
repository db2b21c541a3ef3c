"""From bench results to verdicts (tasks.tune.fit): bench-result dicts built by hand in the shape
`sparkspec bench` writes (sparkspec.bench.metrics.summarize and spec_decode_figures), the expected
figures computed by hand in the comments with tune_model's formulas:
E(k) = 1 + f * (a_0 + ... + a_(k-1)), f = drafts / (generation - accepted),
t0 = 1 / baseline tok/s, delta = (E(k_max) / tok_s(k_max) - t0) / k_max,
predicted tok/s(k) = E(k) / (t0 + k * delta)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sparkspec.errors import UserError
from tasks.tune import fit
from tasks.tune.fit import WHOLE, Case


def _result(tok_s: float, std: float = 1.0, completed: int = 100, drafts: int | None = None,
            rates: list[Any] | None = None, accepted: int | None = None,
            generation: int | None = None, suites: dict[str, Any] | None = None) -> dict[str, Any]:
    """A bench result's figures; without drafts, a baseline's (spec_decode_* None, as the bench
    writes)."""
    doc: dict[str, Any] = {"per_request_tok_s_mean": tok_s, "per_request_tok_s_std": std,
                           "completed": completed, "spec_decode_num_drafts": drafts,
                           "spec_decode_draft_tokens":
                               None if drafts is None else drafts * len(rates or []),
                           "spec_decode_accepted_tokens": accepted,
                           "spec_decode_per_position_acceptance_rates": rates,
                           "server_generation_tokens": generation}
    if suites is not None:
        doc["suites"] = suites
    return doc


# The chain run at k_max 3: 100 drafts, a = [0.8, 0.6, 0.3] (80, 60, 30 accepted per position),
# 170 accepted, 270 generated: steps = 270 - 170 = 100, f = 100 / 100 = 1; E(1) = 1.8,
# E(2) = 2.4, E(3) = 2.7. At 60 tok/s against a 40 tok/s baseline: t0 = 0.025,
# t(3) = 2.7 / 60 = 0.045, delta = 0.02 / 3 = 0.0066667; predicted k1: 1.8 / 0.0316667 = 56.842,
# k2: 2.4 / 0.0383333 = 62.609, k3: 60: best k 2.
TOP = _result(60.0, drafts=100, rates=[0.8, 0.6, 0.3], accepted=170, generation=270)


def _case(baseline: float, measured: dict[int, dict[str, Any]], k_max: int = 3) -> Case:
    base = fit.point(_result(baseline), "base.json", None)
    return fit.judge(Case(WHOLE, 1, k_max, base,
                          {k: fit.point(doc, f"k{k}.json", k) for k, doc in measured.items()}))


# --- point ----------------------------------------------------------------------------------------

def test_point_rebuilds_per_position_counts_and_refuses_missing_positions() -> None:
    # 200 drafts at k_max 4: counts 0.5*200 = 100, 0.25*200 = 50, 0, 0
    doc = _result(30.0, std=6.0, completed=36, drafts=200, rates=[0.5, 0.25, 0.0, 0.0],
                  accepted=150, generation=600)
    p = fit.point(doc, "r.json", 4)
    assert (p.tok_s, p.std, p.requests) == (30.0, 6.0, 36)
    assert p.se == pytest.approx(1.0)   # 6 / sqrt(36)
    assert p.run is not None
    assert p.run.accepted_per_pos == {0: 100, 1: 50, 2: 0, 3: 0}
    # vLLM exports every position 0..k-1: a shorter list is not this row's result
    short = _result(30.0, std=6.0, completed=36, drafts=200, rates=[0.5, 0.25], accepted=150,
                    generation=600)
    with pytest.raises(UserError, match="2 per-position rates for a run at k 4"):
        fit.point(short, "r.json", 4)
    assert (p.run.num_drafts, p.run.num_accepted_tokens, p.run.generation_tokens) == (200, 150, 600)
    assert p.run.num_draft_tokens == 800   # 200 drafts x 4 positions


def test_point_rounds_a_rate_back_to_its_count() -> None:
    # 7 drafts, 3 and 1 accepted: the bench wrote 3/7 and 1/7, which give back 3 and 1
    p = fit.point(_result(20.0, drafts=7, rates=[3 / 7, 1 / 7], accepted=4, generation=11),
                  "r.json", 2)
    assert p.run is not None and p.run.accepted_per_pos == {0: 3, 1: 1}


def test_point_ignores_a_zero_rate_past_k_max_and_refuses_a_nonzero_one() -> None:
    ok = fit.point(_result(20.0, drafts=10, rates=[0.5, 0.0, 0.0], accepted=5, generation=15),
                   "r.json", 1)
    assert ok.run is not None and ok.run.accepted_per_pos == {0: 5}
    with pytest.raises(UserError,
                       match=r"^r\.json: position 2 accepted tokens in a run at k 2; the result is "
                             r"not this row's"):
        fit.point(_result(20.0, drafts=10, rates=[0.5, 0.2, 0.1], accepted=8, generation=18),
                  "r.json", 2)


@pytest.mark.parametrize("rate", [1.5, -0.1, "0.5", True, None])
def test_point_refuses_a_rate_that_is_not_a_fraction(rate: Any) -> None:
    doc = _result(20.0, drafts=10, rates=[0.5, rate], accepted=5, generation=15)
    with pytest.raises(UserError,
                       match=r"^r\.json: spec_decode_per_position_acceptance_rates\[1\] is .*not a "
                             r"fraction"):
        fit.point(doc, "r.json", 2)


@pytest.mark.parametrize(("key", "value", "match"), [
    ("per_request_tok_s_mean", -1.0,
     r"'per_request_tok_s_mean' is -1\.0, not a number in 0\.\.1e\+06"),
    ("per_request_tok_s_mean", math.nan,
     r"'per_request_tok_s_mean' is nan, not a number in 0\.\.1e\+06"),
    ("per_request_tok_s_mean", 10**400, r"'per_request_tok_s_mean' is 1000000000"),
    ("per_request_tok_s_std", math.inf, r"'per_request_tok_s_std' is inf, not a number"),
    ("completed", -3, r"'completed' is -3, not a number in 0\.\.9\.0072e\+15"),
    ("completed", 0.5, r"'completed' is float 0\.5, expected int"),
    ("completed", True, r"'completed' is bool True, expected"),
    ("per_request_tok_s_std", "1.0", r"'per_request_tok_s_std' is str"),
    ("spec_decode_num_drafts", -10, r"'spec_decode_num_drafts' is -10, not a number in 0"),
    ("spec_decode_num_drafts", 1e-300, r"'spec_decode_num_drafts' is float 1e-300, expected int"),
    ("completed", 0, r"no request completed with a speed"),
    ("per_request_tok_s_mean", None, r"no request completed with a speed"),
])
def test_point_refuses_bad_figures(key: str, value: Any, match: str) -> None:
    doc = {**_result(20.0, drafts=10, rates=[0.5], accepted=5, generation=15), key: value}
    with pytest.raises(UserError, match=rf"^r\.json: {match}"):
        fit.point(doc, "r.json", 1)


def test_point_needs_completed_and_an_object() -> None:
    doc = _result(20.0)
    del doc["completed"]
    with pytest.raises(UserError, match=r"^r\.json: has no 'completed'; run the sweep again"):
        fit.point(doc, "r.json", None)
    with pytest.raises(UserError, match=r"^r\.json: is not a JSON object"):
        fit.point([1, 2], "r.json", None)  # type: ignore[arg-type]


def test_a_baseline_point_reads_no_counters() -> None:
    # k_max None: the rates are never read (a baseline result has none), std missing counts as 0
    doc = _result(40.0, drafts=5, rates=["junk"], accepted=1, generation=6)
    del doc["per_request_tok_s_std"]
    p = fit.point(doc, "b.json", None)
    assert (p.tok_s, p.std, p.requests, p.run) == (40.0, 0.0, 100, None)


def test_scopes_are_the_whole_run_and_each_suite() -> None:
    doc = _result(50.0, suites={"structured": _result(55.0, completed=4),
                                "open": _result(45.0, completed=9)})
    got = fit.scopes(doc, "b.json", None)
    assert list(got) == [WHOLE, "structured", "open"]
    assert [(p.tok_s, p.requests) for p in got.values()] == [(50.0, 100), (55.0, 4), (45.0, 9)]
    assert list(fit.scopes(_result(50.0), "b.json", None)) == [WHOLE]
    with pytest.raises(UserError, match=r"^b\.json: suites\.open: has no 'completed'"):
        fit.scopes(_result(50.0, suites={"open": {"per_request_tok_s_mean": 1.0}}), "b.json", None)
    with pytest.raises(UserError, match=r"^b\.json: 'suites' is list"):
        fit.scopes({**_result(50.0), "suites": []}, "b.json", None)


# --- judge ----------------------------------------------------------------------------------------

def test_predicted_best_is_the_measured_best() -> None:
    c = _case(40.0, {1: _result(50.0), 2: _result(62.0), 3: TOP})
    assert c.tuning is not None and c.tuning.best_k == 2
    predicted = [p.tok_s.estimate for p in c.tuning.predictions]
    assert predicted == pytest.approx([56.8421, 62.6087, 60.0], abs=1e-4)
    assert c.best_measured == 2
    assert c.verdict == "predicted best k 2 = best measured k 2"
    assert c.notes == []


def test_a_different_best_within_the_spread_is_a_match() -> None:
    # k1 63 vs k2 62 tok/s; std 10 over 25 requests: se 2 each, 1.96 * hypot(2, 2) = 5.54 > 1
    c = _case(40.0, {1: _result(63.0, std=10, completed=25), 2: _result(62.0, std=10, completed=25),
                     3: TOP})
    assert (c.tuning.best_k if c.tuning else None, c.best_measured) == (2, 1)
    assert c.verdict == ("predicted best k 2 matches best measured k 1 within their spread "
                         "(62.0 vs 63.0 tok/s)")
    # the same means with std 1 over 100 requests: se 0.1 each, 1.96 * 0.1414 = 0.28 < 1: told apart
    tight = _case(40.0, {1: _result(63.0), 2: _result(62.0), 3: TOP})
    assert tight.verdict.startswith("MISSED: predicted best k 2 measured 62.0 tok/s, 1.6 % below")


def test_a_clear_miss_gives_the_percent_and_the_model_errors() -> None:
    # k2 measured 50, k1 70: 1 - 50/70 = 28.57 % below; errors: k2 (62.6087 - 50) / 50 = +25.2 %,
    # k1 (56.8421 - 70) / 70 = -18.8 %
    c = _case(40.0, {1: _result(70.0), 2: _result(50.0), 3: TOP})
    assert c.verdict.startswith("MISSED: predicted best k 2 measured 50.0 tok/s, 28.6 % below "
                                "best measured k 1 (70.0); ")
    assert "off by +25.2 % at k 2 and -18.8 % at k 1" in c.verdict


def test_near_zero_acceptance_and_baseline_beating_every_k_add_notes() -> None:
    # 1000 drafts at k_max 2, a = [0.02, 0.0], 20 accepted, 1020 generated: f = 1000 / 1000 = 1,
    # E(1) = E(2) = 1.02; baseline 40 (t0 0.025), k2 at 38: t(2) = 1.02 / 38 = 0.0268421,
    # delta = 0.0009211; k1: 1.02 / 0.0259211 = 39.35 > k2 38: best k 1
    low = _result(38.0, drafts=1000, rates=[0.02, 0.0], accepted=20, generation=1020)
    c = _case(40.0, {2: low}, k_max=2)
    assert c.tuning is not None and c.tuning.best_k == 1
    assert c.tuning.predictions[0].tok_s.estimate == pytest.approx(39.3503, abs=1e-4)
    assert c.verdict == "predicted best k 1 (only k_max 2 measured: sweep more k to check)"
    assert c.notes[0].startswith("acceptance is near zero (a_0 = 2.0 %)")
    assert c.notes[1].startswith("baseline (40.0 tok/s) beats every k measured")


def test_baseline_faster_than_every_k_is_a_note_without_the_acceptance_one() -> None:
    # baseline 70: t0 = 0.0142857, delta = (0.045 - 0.0142857) / 3 = 0.0102381;
    # k1: 1.8 / 0.0245238 = 73.40, k2: 2.4 / 0.0347619 = 69.04, k3: 60: best k 1,
    # measured k1 65 < baseline 70
    c = _case(70.0, {1: _result(65.0), 3: TOP})
    assert c.verdict == "predicted best k 1 = best measured k 1"
    assert c.notes == ["baseline (70.0 tok/s) beats every k measured: serve without "
                       "drafting for this workload"]


def test_no_prediction_without_drafts_or_without_the_k_max_run() -> None:
    # zero drafts: the bench writes num_drafts 0 and no rates
    empty = _result(30.0, drafts=0, rates=None, accepted=0, generation=300)
    c = _case(40.0, {1: _result(35.0), 3: empty})
    assert c.verdict == "no prediction: the method drafted nothing in the k_max run"
    # k 1 measured faster (35 tok/s) than the k_max run
    assert (c.tuning, c.best_measured) == (None, 1)
    missing = _case(40.0, {1: _result(35.0)})
    assert missing.verdict == "k_max 3 was not measured: no prediction"
    # counters that contradict each other: 100 drafts but 200 - 170 = 30 steps
    bad = _result(60.0, drafts=100, rates=[0.8, 0.6, 0.3], accepted=170, generation=200)
    assert _case(40.0, {3: bad}).verdict.startswith(
        "no prediction: num_drafts 100 exceeds the steps 30")


def test_best_measured_is_set_without_a_prediction() -> None:
    empty = _result(30.0, drafts=0, rates=None, accepted=0, generation=300)
    assert _case(40.0, {1: _result(35.0), 3: empty}).best_measured == 1


# --- cases and the batch schedule -----------------------------------------------------------------

def _sweep() -> tuple[dict[tuple[int, int], dict[str, Any]], dict[tuple[int, int], str]]:
    # structured at k3: 50 drafts, a = [0.9, 0.8, 0.6], accepted 115, generated 165:
    # f = 50 / 50 = 1, E = 1.9, 2.7, 3.3; baseline 45: t0 = 0.0222222, t(3) = 3.3 / 70 = 0.0471429,
    # delta = 0.0083069; k1: 1.9 / 0.0305291 = 62.24, k2: 2.7 / 0.0388360 = 69.52, k3 70: best 3
    # (measured: k3 70 > k1 55).
    # open at k3: a = [0.7, 0.4, 0.0], accepted 55, generated 105: f = 1, E = 1.7, 2.1, 2.1;
    # baseline 35: t0 = 0.0285714, t(3) = 2.1 / 50 = 0.042, delta = 0.0044762;
    # k1: 1.7 / 0.0330476 = 51.44, k2: 2.1 / 0.0375238 = 55.96, k3 50: best 2, not measured.
    structured = _result(70.0, drafts=50, rates=[0.9, 0.8, 0.6], accepted=115, generation=165)
    opened = _result(50.0, drafts=50, rates=[0.7, 0.4, 0.0], accepted=55, generation=105)
    results = {(0, 1): _result(40.0, suites={"structured": _result(45.0), "open": _result(35.0)}),
               (3, 1): {**TOP, "suites": {"structured": structured, "open": opened}},
               (1, 1): _result(50.0, suites={"structured": _result(55.0), "open": _result(45.0)})}
    return results, {key: f"r{key[0]}-{key[1]}.json" for key in results}


def test_cases_judge_every_suite_and_the_whole_run() -> None:
    results, where = _sweep()
    found = fit.cases(results, where, 3, [1, 4])   # level 4 has no baseline: skipped
    assert [(c.suite, c.concurrency) for c in found] == [(WHOLE, 1), ("structured", 1), ("open", 1)]
    assert all(sorted(c.measured) == [1, 3] for c in found)
    whole, structured, opened = found
    assert whole.verdict == "predicted best k 2 was not measured; best measured k 3 (60.0 tok/s)"
    assert structured.tuning is not None
    assert [p.tok_s.estimate for p in structured.tuning.predictions] == \
        pytest.approx([62.24, 69.52, 70.0], abs=0.01)
    assert structured.verdict == "predicted best k 3 = best measured k 3"
    assert opened.tuning is not None
    assert [p.tok_s.estimate for p in opened.tuning.predictions] == \
        pytest.approx([51.44, 55.96, 50.0], abs=0.01)
    assert opened.verdict == "predicted best k 2 was not measured; best measured k 3 (50.0 tok/s)"
    assert opened.baseline.tok_s == 35.0


def test_cases_name_the_file_of_a_bad_suite() -> None:
    results, where = _sweep()
    results[(1, 1)]["suites"]["open"]["completed"] = -1
    with pytest.raises(UserError, match=r"^r1-1\.json: suites\.open: 'completed' is -1"):
        fit.cases(results, where, 3, [1])


def _whole(concurrency: int, baseline: float, top: float) -> Case:
    # the chain run at k3: baseline 40, top 80: t(3) = 2.7 / 80 = 0.03375, delta = 0.0029167;
    # k1 64.48, k2 77.84, k3 80: best 3. Baseline 70, top 60: best 1 (73.40, 69.04, 60).
    base = fit.point(_result(baseline), "b", None)
    return fit.judge(Case(WHOLE, concurrency, 3, base,
                          {3: fit.point({**TOP, "per_request_tok_s_mean": top}, "t", 3)}))


def test_batch_schedule_from_the_best_k_per_level() -> None:
    one, four = _whole(1, 40.0, 80.0), _whole(4, 70.0, 60.0)
    assert (one.tuning and one.tuning.best_k, four.tuning and four.tuning.best_k) == (3, 1)
    assert fit.batch_schedule([one, four]) == [[1, 3, 3], [4, 4, 1]]
    assert fit.batch_schedule([four, one]) == [[1, 3, 3], [4, 4, 1]]  # by level, not by order given
    assert fit.batch_schedule([one]) is None
    # a suite's case is not the whole run's: one level of the whole run only
    suite = Case("open", 4, 3, four.baseline, four.measured, four.tuning)
    assert fit.batch_schedule([one, suite]) is None
    eight = _whole(8, 40.0, 80.0)
    assert fit.batch_schedule([one, four, eight]) == [[1, 3, 3], [4, 7, 1], [8, 8, 3]]
    assert fit.batch_schedule([one, eight]) is None   # k 3 best at both levels: no schedule needed


def test_a_spread_that_is_not_known_is_said_and_not_applied() -> None:
    # one request per k, no std: k 1 measured 80 against k_max's 60, but "within spread" cannot
    # be told
    one = {1: _result(80.0, std=None, completed=1)}
    c = _case(30.0, {**one, 3: {**TOP, "per_request_tok_s_std": None, "completed": 1}})
    assert (c.tuning and c.tuning.best_k, c.best_measured) == (3, 1)
    assert c.verdict == ("predicted best k 3, best measured k 1 (60.0 vs 80.0 tok/s); "
                         "spread unknown (one request, or no per-request std): "
                         "measure more --requests")
    assert fit.recommend([c])[0] is None


def test_recommend_writes_nothing_when_baseline_wins_or_the_prediction_missed() -> None:
    slow = _case(70.0, {1: _result(65.0), 3: TOP})   # baseline 70 beats every k
    k, why = fit.recommend([slow])
    assert k is None and "baseline (70.0 tok/s) is faster than k 1" in why
    # as in test_predicted_best_is_the_measured_best
    backed = _case(40.0, {1: _result(50.0), 2: _result(62.0), 3: TOP})
    assert fit.recommend([backed]) == (2, "predicted best k 2 = best measured k 2")
    # k 1 measured far above its prediction
    missed = _case(40.0, {1: _result(70.0), 2: _result(62.0), 3: TOP})
    assert missed.verdict.startswith("MISSED")
    k, why = fit.recommend([missed])
    assert k is None and why.startswith("the measurements do not back the predicted k 2")
