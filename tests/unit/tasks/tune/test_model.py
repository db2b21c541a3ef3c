"""The arithmetic of choosing k (tasks.tune.model, issue 25), checked against hand computations
written out in the comments, and the worked example of docs/methods.md ("Choosing k") recomputed
from its script."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from sparkspec.bench.metrics import Snapshot
from sparkspec.errors import UserError
from tasks.tune import model
from tasks.tune.model import Measured, StepCost

DOC = Path(__file__).resolve().parents[4] / "docs" / "methods.md"


def _run(drafts: float, per_pos: list[float], generation: float | None = None,
         accepted: float | None = None) -> Snapshot:
    """A counter delta; by default every step drafts (steps = drafts, so f = 1)."""
    accepted = sum(per_pos) if accepted is None else accepted
    generation = drafts + accepted if generation is None else generation
    return Snapshot(generation_tokens=generation, has_spec_decode=True, num_drafts=drafts,
                    num_draft_tokens=drafts * len(per_pos), num_accepted_tokens=accepted,
                    accepted_per_pos=dict(enumerate(per_pos)))


# The chain case: 100 drafts, per-position [80, 60, 30], 170 accepted, 270 generated.
# steps S = 270 - 170 = 100, f = 100 / 100 = 1; a = [0.8, 0.6, 0.3];
# E(1) = 1 + 0.8 = 1.8, E(2) = 1.8 + 0.6 = 2.4, E(3) = 2.4 + 0.3 = 2.7
# (= 270 / 100, tokens over steps).
CHAIN = _run(100, [80, 60, 30])


def test_survival_rates_and_tokens_per_step_of_a_chain() -> None:
    s = model.survival(CHAIN, 3)
    assert (s.steps, s.draft_fraction) == (100, 1.0)
    assert [r.estimate for r in s.rates] == pytest.approx([0.8, 0.6, 0.3])
    assert [model.expected_tokens(s, k).estimate for k in (1, 2, 3)] == \
        pytest.approx([1.8, 2.4, 2.7])
    assert s.notes == ()


def test_wilson_interval_of_80_in_100() -> None:
    # z = 1.959964, z^2 = 3.841459, n = 100, p = 0.8:
    # centre = (p + z^2/2n) / (1 + z^2/n) = (0.8 + 0.019207) / 1.038415 = 0.788902
    # half = z / (1 + z^2/n) * sqrt(p(1-p)/n + z^2/4n^2)
    #      = 1.959964 / 1.038415 * sqrt(0.0016 + 0.000096)
    #      = 1.887456 * 0.041183 = 0.077731 -> [0.711171, 0.866633]
    iv = model.wilson(80, 100)
    assert (round(iv.low, 4), round(iv.high, 4)) == (0.7112, 0.8666)
    assert iv.estimate == 0.8
    # at the edges the bound is the estimate itself: 0/10 -> low 0, 10/10 -> high 1, exactly
    assert model.wilson(0, 10).low == 0.0 and model.wilson(10, 10).high == 1.0


def test_wilson_interval_holds_its_estimate_at_both_edges() -> None:
    """Float rounding once left 42/42's high at 1 - 1e-16, below the estimate 1: a negative error
    bar, and `invoke tune` ended in matplotlib's traceback on sim01's n-gram at k = 4."""
    for trials in range(1, 500):
        for successes in (0, trials // 3, trials):
            iv = model.wilson(successes, trials)
            assert 0.0 <= iv.low <= iv.estimate <= iv.high <= 1.0, (successes, trials, iv)


def test_interval_of_tokens_per_step_sums_the_bounds() -> None:
    # Wilson over 100 drafts (same formula as above): 60/100 -> [0.502003, 0.690599],
    # 30/100 -> [0.218949, 0.395849]; E(3) low = 1 + 0.711171 + 0.502003 + 0.218949 = 2.432123,
    # high = 1 + 0.866633 + 0.690599 + 0.395849 = 2.953081
    e3 = model.expected_tokens(model.survival(CHAIN, 3), 3)
    assert (e3.low, e3.high) == pytest.approx((2.432123, 2.953081), abs=2e-6)


def test_two_point_cost_and_predictions() -> None:
    # baseline 40 tok/s: t0 = 1/40 = 0.025 s; k_max = 3 at 60 tok/s: t(3) = 2.7 / 60 = 0.045 s;
    # delta = (0.045 - 0.025) / 3 = 0.0066667 s.
    # t(1) = 0.0316667 -> 1.8 / 0.0316667 = 56.8421 tok/s;
    # t(2) = 0.0383333 -> 2.4 / 0.0383333 = 62.6087 tok/s;
    # t(3) = 0.045 -> 60 tok/s (the measured figure, by construction). Best k = 2.
    t = model.tune(CHAIN, 3, 40.0, 60.0)
    assert (t.cost.t0, t.cost.delta, t.cost.method) == pytest.approx((0.025, 0.02 / 3, "two-point"))
    assert [p.tok_s.estimate for p in t.predictions] == \
        pytest.approx([56.8421, 62.6087, 60.0], abs=1e-4)
    assert t.best_k == 2
    # tok/s(1) in [1.711171, 1.866633] / 0.0316667 = [54.04, 58.95];
    # tok/s(2) in [2.213174, 2.557232] / 0.0383333 = [57.73, 66.71];
    # tok/s(3) in [2.432123, 2.953081] / 0.045 = [54.05, 65.62]: both k 1 and k 3 overlap
    # k 2's interval
    assert t.overlapping == (1, 3)
    assert [(e.k, e.error_pct) for e in t.errors] == [(3, pytest.approx(0.0))]


def test_a_hundred_times_the_drafts_tells_the_k_apart() -> None:
    # 10000 drafts, same rates: a Wilson half-width is at most 1.96 * sqrt(0.25 / 10000) = 0.0098
    # (+ a hair), so tok/s(1) <= (1.8 + 0.0099) / 0.0316667 = 57.2,
    # tok/s(3) <= (2.7 + 3 * 0.0099) / 0.045 = 60.7 and tok/s(2) >= (2.4 - 2 * 0.0099) / 0.0383333
    # = 62.1: no overlap with the best k (2).
    t = model.tune(_run(10000, [8000, 6000, 3000]), 3, 40.0, 60.0)
    assert (t.best_k, t.overlapping) == (2, ())


def test_ngram_draft_fraction() -> None:
    # 50 drafts over 100 steps (generated 160, accepted 60: S = 160 - 60 = 100),
    # per-position [40, 20]: f = 50 / 100 = 0.5, a = [0.8, 0.4]; E(1) = 1 + 0.5 * 0.8 = 1.4,
    # E(2) = 1 + 0.5 * 1.2 = 1.6 (= 160 / 100)
    s = model.survival(_run(50, [40, 20], generation=160), 2)
    assert (s.steps, s.draft_fraction) == (100, 0.5)
    assert [model.expected_tokens(s, k).estimate for k in (1, 2)] == pytest.approx([1.4, 1.6])
    # generation tokens given apart from the delta (a Snapshot without them): the same figures
    bare = Snapshot(has_spec_decode=True, num_drafts=50, num_accepted_tokens=60,
                    accepted_per_pos={0: 40, 1: 20})
    assert model.survival(bare, 2, generation_tokens=160).draft_fraction == 0.5


def test_geometric_model() -> None:
    # a by maximum likelihood: accepted / positions tried = 170 / (100 + 80 + 60) = 0.708333;
    # E_geo(1) = 1 + a = 1.708333, E_geo(2) = 1 + a + a^2 = 1 + 0.708333 + 0.501736 = 2.210069,
    # E_geo(3) = (1 - a^4) / (1 - a) = (1 - 0.251739) / 0.291667 = 2.565466
    t = model.tune(CHAIN, 3, 40.0, 60.0)
    assert t.survival.geometric_rate == pytest.approx(0.708333, abs=1e-6)
    geo = [p.geometric_tokens_per_step for p in t.predictions]
    assert geo == pytest.approx([1.708333, 2.210069, 2.565466], abs=1e-6)
    # a = 0.5, k = 3: (1 - 0.0625) / 0.5 = 1.875; a = 1: k + 1 = 4;
    # f = 0.5: 1 + 0.5 * (0.5 + 0.25) = 1.375
    assert model.geometric_tokens(0.5, 3) == 1.875 and model.geometric_tokens(1.0, 3) == 4.0
    assert model.geometric_tokens(0.5, 2, 0.5) == 1.375


def test_least_squares_cost() -> None:
    # three runs on one line t = 0.025 + k * 0.02/3: k 0 at 40 tok/s (t = 0.025),
    # k 1 at 1.8 / 0.0316667 = 56.8421 tok/s, k 3 at 2.7 / 0.045 = 60: any weighting gives
    # t0 = 0.025, delta = 0.0066667
    runs = [Measured(0, 40.0), Measured(1, 1.8 / (0.025 + 0.02 / 3), 1.8), Measured(3, 60.0, 2.7)]
    cost = model.fit_least_squares(runs)
    assert (cost.t0, cost.delta, cost.runs) == pytest.approx((0.025, 0.02 / 3, 3))
    # off the line (k 1 at 50 tok/s, t = 0.036): numpy's weighted polyfit (weights 1/t on
    # the residuals)
    runs[1] = Measured(1, 50.0, 1.8)
    t = np.array([r.step_seconds for r in runs])
    slope, intercept = np.polyfit([0, 1, 3], t, 1, w=1 / t)
    cost = model.fit_least_squares(runs)
    assert (cost.t0, cost.delta) == pytest.approx((intercept, slope))
    # tune with least_squares: the k 1 run's E(1) = 1.8 comes from the k_max run (the prefix rule)
    tuned = model.tune(CHAIN, 3, 40.0, 60.0, measured={1: 50.0}, least_squares=True)
    assert (tuned.cost.t0, tuned.cost.delta, tuned.cost.method) == pytest.approx((intercept, slope,
                                                                                  "least-squares"))
    # errors at every measured k: k 1 predicted 1.8 / (t0 + delta) against 50
    assert [e.k for e in tuned.errors] == [1, 3]
    assert tuned.errors[0].error_pct == pytest.approx((1.8 / (intercept + slope) - 50) / 50 * 100)


def test_negative_delta_is_kept_and_said() -> None:
    # k 1 at 100 tok/s with E 1.5: t(1) = 0.015 < t0 = 0.025 -> delta = -0.01, kept, with a note
    cost = model.fit_two_point(40.0, Measured(1, 100.0, 1.5))
    assert cost.delta == pytest.approx(-0.01)
    assert cost.notes and "negative" in cost.notes[0]


def test_rising_rates_are_kept_and_said() -> None:
    # a = [0.5, 0.6] over 100 drafts: kept as measured, E(2) = 1 + 0.5 + 0.6 = 2.1; the
    # intervals overlap
    s = model.survival(_run(100, [50, 60]), 2)
    assert model.expected_tokens(s, 2).estimate == pytest.approx(2.1)
    assert len(s.notes) == 1 and "within count noise" in s.notes[0] and "not clamped" in s.notes[0]
    # a = [0.1, 0.9] over 1000 drafts: beyond count noise, still kept
    s = model.survival(_run(1000, [100, 900]), 2)
    assert "beyond count noise" in s.notes[0]
    # per-position counts that do not sum to the accepted tokens: said
    s = model.survival(_run(100, [80, 60], accepted=150, generation=250), 2)
    assert any("sum to 140" in n for n in s.notes)


def test_prefix_rule() -> None:
    long = model.survival(CHAIN, 3)  # a = [0.8, 0.6, 0.3] over 100 drafts
    # holds: 200 drafts with [158, 121] -> a = [0.79, 0.605]; differences [-0.01, +0.005],
    # worst at 0
    short = model.survival(_run(200, [158, 121]), 2)
    v = model.prefix_rule(short, long)
    assert (v.holds, v.k_short, v.k_long, v.worst_position) == (True, 2, 3, 0)
    assert v.worst_difference == pytest.approx(-0.01)
    # fails: 1000 drafts with [800, 400] -> a_1 = 0.4, Wilson high 0.430691 below the long run's
    # a_1 low 0.502003 (the intervals are apart); worst difference 0.4 - 0.6 = -0.2 at position 1
    v = model.prefix_rule(model.survival(_run(1000, [800, 400]), 2), long)
    assert (v.holds, v.worst_position) == (False, 1)
    assert v.worst_difference == pytest.approx(-0.2)


def test_dflash_block_limit() -> None:
    # block_size 16: k up to 15; the survival says so in a note
    s = model.survival(CHAIN, 3, block_size=16)
    assert any(n.startswith("DFlash") for n in s.notes)
    with pytest.raises(UserError, match=r"above DFlash's limit 3 \(block_size 4 - 1\)"):
        model.survival(_run(100, [80, 60, 30, 10]), 4, block_size=4)


def test_as_dict_is_json() -> None:
    d = json.loads(json.dumps(model.tune(CHAIN, 3, 40.0, 60.0).as_dict()))
    assert d["best_k"] == 2 and d["survival"]["rates"][0]["estimate"] == 0.8
    assert d["predictions"][1]["tok_s"]["estimate"] == pytest.approx(62.6087, abs=1e-4)


S3 = model.survival(CHAIN, 3)
BAD = [
    (lambda: model.expected_tokens(S3, 0), "k is 0, not a positive integer"),
    (lambda: model.expected_tokens(S3, -1), "k is -1, not a positive integer"),
    (lambda: model.expected_tokens(S3, True), "k is True, not a positive integer"),
    (lambda: model.expected_tokens(S3, 4), "k 4 is above k_max 3"),
    (lambda: model.survival(CHAIN, 0), "k_max is 0, not a positive integer"),
    (lambda: model.survival(CHAIN, 2), "accepted_per_pos has positions [0, 1, 2], not 0..1"),
    (lambda: model.survival(CHAIN, 3, block_size=1), "block_size is 1, not an integer >= 2"),
    (lambda: model.survival(_run(0, [0, 0]), 2),
     "no drafts were proposed: the method drafted nothing in this run"),
    (lambda: model.survival(_run(100, [80, -1], accepted=79), 2), "accepted_per_pos[1] is -1"),
    (lambda: model.survival(_run(100, [80, 60], accepted=-5), 2), "num_accepted_tokens is -5"),
    (lambda: model.survival(_run(100, [80, 60]), 2, generation_tokens=math.inf),
     "generation tokens is inf"),
    (lambda: model.survival(_run(100, [80, 60]), 2, generation_tokens=math.nan),
     "generation tokens is nan"),
    (lambda: model.survival(_run(100, [80, 60]), 2, generation_tokens=0), "generation tokens is 0"),
    (lambda: model.survival(_run(100, [120, 60], accepted=180), 2), "more than num_drafts 100"),
    (lambda: model.survival(_run(100, [80, 60], generation=200), 2),
     "num_drafts 100 exceeds the steps 60"),
    (lambda: model.tune(CHAIN, 3, 40.0, 60.0, measured={5: 50.0}), "k 5 is above k_max 3"),
    (lambda: model.tune(CHAIN, 3, 40.0, 60.0, measured={0: 40.0}),
     "k is 0, not a positive integer"),
    (lambda: model.tune(CHAIN, 3, 40.0, 60.0, measured={3: 61.0}),
     "give the k_max run's speed once"),
    (lambda: model.fit_two_point(0.0, Measured(3, 60.0, 2.7)), "baseline tok/s is 0"),
    (lambda: model.fit_two_point(-40.0, Measured(3, 60.0, 2.7)), "baseline tok/s is -40.0"),
    (lambda: model.fit_two_point(math.nan, Measured(3, 60.0, 2.7)), "baseline tok/s is nan"),
    (lambda: model.fit_two_point(40.0, Measured(0, 40.0)), "give the run at k_max >= 1"),
    (lambda: model.fit_two_point(40.0, Measured(3, 60.0, 0.5)),
     "tokens per step at k 3 is 0.5, below 1"),
    (lambda: model.fit_least_squares([Measured(-1, 40.0)]), "k is -1, not an integer >= 0"),
    (lambda: model.fit_least_squares([]), "0 run(s) at 0 distinct k"),
    (lambda: model.fit_least_squares([Measured(2, 50.0, 2.0), Measured(2, 51.0, 2.0)]),
     "at 1 distinct k"),
    (lambda: StepCost(0.01, -0.02, "two-point", 2, ()).seconds(1),
     "step cost t(1) = -0.01 s is not positive"),
    (lambda: model.prediction_errors({1: 50.0}, {2: 40.0}), "k 2 was measured but not predicted"),
    (lambda: model.prediction_errors({1: 50.0}, {1: -4.0}), "measured tok/s at k 1 is -4.0"),
    (lambda: model.wilson(5, 0), "trials is 0, not positive"),
    (lambda: model.wilson(11, 10), "successes 11 exceed trials 10"),
    (lambda: model.geometric_tokens(1.5, 2), "conditional acceptance a is 1.5, above 1"),
    (lambda: model.geometric_tokens(0.5, 2, 2.0), "draft fraction is 2.0, above 1"),
    (lambda: model.prefix_rule(S3, model.survival(_run(100, [80, 60]), 2)),
     "give the shorter run first"),
    (lambda: model.fit_from_speeds(36.5, {}), "0 drafted run(s)"),
    (lambda: model.fit_from_speeds(36.5, {1: 44.5}), "1 drafted run(s)"),
    (lambda: model.fit_from_speeds(36.5, {0: 36.5, 1: 44.5}), "k is 0, not a positive integer"),
    (lambda: model.fit_from_speeds(36.5, {1: 44.5, 2: math.inf}), "tok/s at k 2 is inf"),
]


@pytest.mark.parametrize(("call", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_input_is_one_line(call: object, message: str) -> None:
    with pytest.raises(UserError) as err:
        call()  # type: ignore[operator]
    text = str(err.value)
    assert message in text and "\n" not in text
    assert ";" in text or "no drafts" in text  # the thing, then the fix


# --- the worked example of docs/methods.md --------------------------------------------------------
def _doc_block(marker: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    found = re.search(rf"<!-- {marker} -->\n```\w+\n(.*?)```", text, re.DOTALL)
    assert found, f"docs/methods.md: no fenced block after <!-- {marker} -->"
    return found.group(1)


def test_the_doc_prints_what_its_script_computes() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_doc_block("worked-example-script"), str(DOC), "exec"), {})
    assert out.getvalue() == _doc_block("worked-example-output")


def test_the_worked_example_is_the_fit_the_doc_says() -> None:
    """Independently of the fit's code: the printed (c, delta) give the printed speeds by the
    formulas, and moving either raises the relative residuals (a minimum)."""
    shown = _doc_block("worked-example-output")
    head = re.search(r"t0 (\S+) ms  delta (\S+) ms  c (\S+)", shown)
    rates = re.search(r"a_0\.\.a_3 (?:\S+ ){3}(\S+)", shown)
    assert head and rates, "the worked example's output block lost its first two lines"
    t0_ms, delta_ms, c = (float(x) for x in head.groups())
    assert t0_ms == round(1000 / 36.5, 2)  # 27.40 ms, the baseline's step
    a3 = float(rates.group(1))
    assert a3 == pytest.approx(c ** 4, abs=2e-4)  # the survival at position 4 is c^4
    speeds = {1: 44.5, 2: 48.5, 4: 34.5}

    def tok_s(k: int, cc: float, d: float) -> float:
        return (1 - cc ** (k + 1)) / (1 - cc) / (1 / 36.5 + k * d)

    for k, predicted in re.findall(r"k (\d)  E \S+  predicted (\S+)", shown):
        assert tok_s(int(k), c, delta_ms / 1000) == pytest.approx(float(predicted), abs=0.1)

    def rss(cc: float, d: float) -> float:  # sum of ((fit - t) / t)^2 over the MTP runs
        t = {k: (1 - cc ** (k + 1)) / (1 - cc) / v for k, v in speeds.items()}
        return sum(((1 / 36.5 + k * d) - t[k]) ** 2 / t[k] ** 2 for k in speeds)

    fit = model.fit_from_speeds(36.5, speeds)
    best = rss(fit.conditional_rate, fit.cost.delta)
    for dc, dd in ((0.01, 0), (-0.01, 0), (0, 2e-4), (0, -2e-4)):
        assert rss(fit.conditional_rate + dc, fit.cost.delta + dd) > best


def test_the_prose_quotes_the_output() -> None:
    """The paragraph after the output block quotes its figures (rounded the way the prose says
    them)."""
    text = DOC.read_text(encoding="utf-8")
    prose = " ".join(text[text.index("The fit says a drafted token adds"):].split())
    shown = _doc_block("worked-example-output")
    fit = model.fit_from_speeds(36.5, {1: 44.5, 2: 48.5, 4: 34.5})
    said = [f"adds {fit.cost.delta * 1000:.2f} ms to a {fit.cost.t0 * 1000:.2f} ms step",
            f"conditional acceptance is {fit.conditional_rate * 100:.1f} %",
            f"= {fit.survival_rates[3] * 100:.1f} %"]
    said += [f"by {e.error_pct:+.1f} %".replace("-", "−") for e in fit.errors if e.k != 1]
    last = re.search(r"c (\S+)  E\(4\) (\S+)  delta (\S+) ms  "
                     r"k 1 predicted (\S+)  k 2 predicted (\S+)", shown)
    assert last, "the worked example's output block lost its last line"
    c4, e4, delta, k1, k2 = last.groups()
    said += [f"c = {float(c4):.3f}", f"E(4) = {float(e4):.2f}", f"delta = {delta} ms",
             f"predicted at {k1} and {k2} tok/s"]
    assert [s for s in said if s not in prose] == []
