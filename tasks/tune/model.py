"""Tokens per verification step and tok/s for every k, from one run at k_max and a baseline.

Pure, no I/O.

The model and its formulas: docs/methods.md, "Choosing k".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from itertools import pairwise
from statistics import NormalDist
from typing import TYPE_CHECKING, Any, cast

from sparkspec.bench.metrics import Snapshot
from sparkspec.errors import UserError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Z95 = NormalDist().inv_cdf(0.975)  # 1.959963984540054: two-sided 95 %
GRID, ZOOMS = 100, 6  # fit_from_speeds: a 100-step grid over c, zoomed in 6 times (to about 1e-10)


class _AsDict:
    def as_dict(self) -> dict[str, Any]:
        """The fields (nested results included) as plain JSON-ready values."""
        return asdict(cast("DataclassInstance", self))


@dataclass(frozen=True)
class Interval(_AsDict):
    """A figure with its 95 % low and high."""

    estimate: float
    low: float
    high: float

    def overlaps(self, other: Interval) -> bool:
        return self.low <= other.high and other.low <= self.high


@dataclass(frozen=True)
class Survival(_AsDict):
    """What one run at k_max measured: the per-position survival rates and the draft fraction."""

    k_max: int
    num_drafts: float
    steps: float
    draft_fraction: float
    rates: tuple[Interval, ...]  # a_0 .. a_(k_max-1), Wilson 95 %
    geometric_rate: float  # conditional acceptance a, ML estimate (docs/methods.md, "Choosing k")
    block_size: int | None  # DFlash's block; None for a chain drafter
    notes: tuple[str, ...]  # what was kept as measured and why


@dataclass(frozen=True)
class Measured(_AsDict):
    """A measured run: k (0: baseline), per-sequence tok/s, tokens per step E(k) (1: no drafts)."""

    k: int
    tok_s: float
    tokens_per_step: float = 1.0

    @property
    def step_seconds(self) -> float:
        return self.tokens_per_step / self.tok_s


@dataclass(frozen=True)
class StepCost(_AsDict):
    """t(k) = t0 + k * delta seconds per verification step."""

    t0: float
    delta: float
    method: str  # "two-point" or "least-squares"
    runs: int
    notes: tuple[str, ...]

    def seconds(self, k: int) -> float:
        t = self.t0 + k * self.delta
        if not t > 0:
            raise UserError(f"step cost t({k}) = {t:.6g} s is not positive "
                            f"(delta {self.delta:.6g} s); the runs disagree with the cost model: "
                            "re-measure baseline and k_max on one workload")
        return t


@dataclass(frozen=True)
class Prediction(_AsDict):
    k: int
    tokens_per_step: Interval  # E(k)
    geometric_tokens_per_step: float  # E_geo(k)
    tok_s: Interval


@dataclass(frozen=True)
class PredictionError(_AsDict):
    k: int
    predicted_tok_s: float
    measured_tok_s: float
    error_pct: float  # (predicted - measured) / measured * 100


@dataclass(frozen=True)
class Tuning(_AsDict):
    """What ``tune`` found: the run's survival, the fitted cost, a prediction per k, the best k."""

    survival: Survival
    cost: StepCost
    predictions: tuple[Prediction, ...]
    best_k: int  # argmax of predicted tok/s (the smaller k on a tie)
    overlapping: tuple[int, ...]  # other k whose tok/s interval overlaps best_k's: not told apart
    # every measured k, k_max too (0 by construction in a two-point fit)
    errors: tuple[PredictionError, ...]


@dataclass(frozen=True)
class PrefixVerdict(_AsDict):
    holds: bool  # every a_i (i < k_short) of the two runs within each other's Wilson interval
    k_short: int
    k_long: int
    worst_position: int
    worst_difference: float  # a_i(short run) - a_i(long run) at worst_position
    differences: tuple[float, ...]


@dataclass(frozen=True)
class SpeedFit(_AsDict):
    """Acceptance and step cost implied by speeds alone, with constant conditional acceptance c."""

    conditional_rate: float  # c
    survival_rates: tuple[float, ...]  # a_i = c^(i+1)
    cost: StepCost  # t0 from baseline, delta by least squares
    predictions: Mapping[int, float]  # k -> tok/s
    errors: tuple[PredictionError, ...]


def _number(name: str, value: float, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise UserError(f"{name} is {value!r}, not a finite non-negative number; {fix}")
    return float(value)


def _positive(name: str, value: float, fix: str) -> float:
    if _number(name, value, fix) == 0:
        raise UserError(f"{name} is 0, not positive; {fix}")
    return float(value)


def _k(k: int, k_max: int | None = None, block_size: int | None = None, name: str = "k") -> int:
    if type(k) is not int or k < 1:
        raise UserError(f"{name} is {k!r}, not a positive integer; give {name} >= 1 drafted tokens")
    if block_size is not None and k > block_size - 1:
        raise UserError(f"{name} {k} is above DFlash's limit {block_size - 1} (block_size "
                        f"{block_size} - 1); give {name} <= {block_size - 1}")
    if k_max is not None and k > k_max:
        raise UserError(f"k {k} is above k_max {k_max}, the longest draft measured; measure a run "
                        f"at k >= {k}")
    return k


def wilson(successes: float, trials: float, z: float = Z95) -> Interval:
    """The Wilson interval of successes / trials: correct near 0 and 1, where p +- z*se is not."""
    n = _positive("trials", trials, "a proportion needs at least one trial")
    x = _number("successes", successes, "give a count")
    if x > n:
        raise UserError(f"successes {x:g} exceed trials {n:g}; give counts from one run")
    p, zz = x / n, z * z
    centre = (p + zz / (2 * n)) / (1 + zz / n)
    half = z / (1 + zz / n) * math.sqrt(p * (1 - p) / n + zz / (4 * n * n))
    # the interval holds p (at p = 0 or 1 its bound is p itself): min/max undo float rounding only,
    # which left the high bound 1e-16 below p = 1 and broke the plot's error bars
    return Interval(p, min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half)))


def _rise_notes(rates: Sequence[Interval]) -> list[str]:
    return [f"a_{i} ({b.estimate:.4f}) rises above a_{i - 1} ({a.estimate:.4f}), "
            f"{'within' if a.overlaps(b) else 'beyond'} count noise: kept as measured, not clamped"
            for i, (a, b) in enumerate(pairwise(rates), 1) if b.estimate > a.estimate]


def _counts(run: Snapshot, k_max: int,
            generation_tokens: float | None) -> tuple[float, float, float, list[float]]:
    """(drafts, accepted, generation tokens, per-position counts) of a run, each checked."""
    fix = "take the delta of two /metrics snapshots around one run"
    drafts = _number("num_drafts", run.num_drafts, fix)
    if drafts == 0:
        raise UserError("no drafts were proposed: the method drafted nothing in this run; "
                        "measure a run where it drafts")
    accepted = _number("num_accepted_tokens", run.num_accepted_tokens, fix)
    generation = _positive("generation tokens", run.generation_tokens if generation_tokens is None
                           else generation_tokens,
                           "pass the run's vllm:generation_tokens_total delta")
    if sorted(run.accepted_per_pos) != list(range(k_max)):
        raise UserError(f"accepted_per_pos has positions {sorted(run.accepted_per_pos)}, not "
                        f"0..{k_max - 1}; k_max must be the run's num_speculative_tokens")
    counts = [_number(f"accepted_per_pos[{i}]", run.accepted_per_pos[i], fix)
              for i in range(k_max)]
    if max(counts) > drafts:
        raise UserError(f"accepted_per_pos has {max(counts):g}, more than num_drafts {drafts:g}; "
                        f"{fix}")
    if generation - accepted < drafts:
        raise UserError(f"num_drafts {drafts:g} exceeds the steps {generation - accepted:g} "
                        f"(generation {generation:g} - accepted {accepted:g}); {fix}")
    return drafts, accepted, generation, counts


def survival(run: Snapshot, k_max: int, generation_tokens: float | None = None,
             block_size: int | None = None) -> Survival:
    """Survival rates and draft fraction from a counter delta over one run at ``k_max`` (vLLM's
    num_speculative_tokens); ``generation_tokens`` overrides the delta's; ``block_size`` marks
    DFlash."""
    if block_size is not None and (type(block_size) is not int or block_size < 2):
        raise UserError(f"block_size is {block_size!r}, not an integer >= 2; read it from the "
                        "head's config")
    _k(k_max, None, block_size, "k_max")
    drafts, accepted, generation, counts = _counts(run, k_max, generation_tokens)
    steps = generation - accepted
    rates = tuple(wilson(c, drafts) for c in counts)
    notes = _rise_notes(rates)
    if abs(sum(counts) - accepted) > 0.5:
        notes.append(f"per-position counts sum to {sum(counts):g}, not num_accepted_tokens "
                     f"{accepted:g}: E(k) uses the per-position counts, the steps use "
                     "num_accepted_tokens")
    if block_size is not None:
        notes.append("DFlash: one draft pass per step, so the linear cost makes a k below k_max "
                     "look faster than it is; check a second k with prefix_rule")
    tried = drafts + sum(counts[:-1])  # position i is tried by the drafts that accepted 0..i-1
    return Survival(k_max, drafts, steps, drafts / steps, rates, sum(counts) / tried, block_size,
                    tuple(notes))


def expected_tokens(s: Survival, k: int) -> Interval:
    """E(k) = 1 + f * (a_0 + ... + a_(k-1)), low and high from the Wilson bounds of every a_i."""
    _k(k, s.k_max, s.block_size)
    head, f = s.rates[:k], s.draft_fraction
    return Interval(*(1 + f * sum(getattr(r, end) for r in head)
                      for end in ("estimate", "low", "high")))


def geometric_tokens(a: float, k: int, draft_fraction: float = 1.0) -> float:
    """E_geo(k) = 1 + f * (a + ... + a^k): (1 - a^(k+1)) / (1 - a) at f = 1, k + 1 at a = 1."""
    _k(k)
    for name, value in (("conditional acceptance a", a), ("draft fraction", draft_fraction)):
        if _number(name, value, "give a rate in [0, 1]") > 1:
            raise UserError(f"{name} is {value!r}, above 1; give a rate in [0, 1]")
    return 1 + draft_fraction * sum(a ** i for i in range(1, k + 1))


def _measured(run: Measured) -> Measured:
    if type(run.k) is not int or run.k < 0:
        raise UserError(f"a measured run's k is {run.k!r}, not an integer >= 0; give 0 for "
                        "baseline")
    _positive(f"tok/s at k {run.k}", run.tok_s, "give the run's per-sequence tok/s")
    if _positive(f"tokens per step at k {run.k}", run.tokens_per_step,
                 "give E(k) of that run") < 1:
        raise UserError(f"tokens per step at k {run.k} is {run.tokens_per_step!r}, below 1; "
                        "give E(k) >= 1")
    return run


def _cost_notes(delta: float) -> tuple[str, ...]:
    return () if delta >= 0 else (f"delta is negative ({delta:.6g} s): a drafted step took less "
                                  "time than a baseline step; kept as fitted, check that the runs "
                                  "used one workload",)


def fit_two_point(baseline_tok_s: float, top: Measured) -> StepCost:
    """t0 from the baseline run, delta from the k_max run (``top``, E(k_max) as tokens_per_step)."""
    t0 = 1 / _positive("baseline tok/s", baseline_tok_s,
                       "give the baseline run's per-sequence tok/s")
    _measured(top)
    if top.k < 1:
        raise UserError(f"the drafted run's k is {top.k}; give the run at k_max >= 1")
    delta = (top.step_seconds - t0) / top.k
    return StepCost(t0, delta, "two-point", 2, _cost_notes(delta))


def fit_least_squares(runs: Sequence[Measured]) -> StepCost:
    """(t0, delta) minimising sum(((t0 + k*delta) - t_k) / t_k)^2 over every measured run."""
    checked = [_measured(r) for r in runs]
    if len({r.k for r in checked}) < 2:
        raise UserError(f"{len(checked)} run(s) at {len({r.k for r in checked})} distinct k; "
                        "fitting t0 and delta needs runs at two k at least (baseline and k_max)")
    rows = [(float(r.k), r.step_seconds, 1 / r.step_seconds ** 2) for r in checked]  # k, t, weight
    s0, s1, s2 = (sum(w * k ** p for k, _, w in rows) for p in (0, 1, 2))
    b0, b1 = (sum(w * k ** p * t for k, t, w in rows) for p in (0, 1))
    det = s0 * s2 - s1 * s1
    t0, delta = (s2 * b0 - s1 * b1) / det, (s0 * b1 - s1 * b0) / det
    return StepCost(t0, delta, "least-squares", len(checked), _cost_notes(delta))


def predict(s: Survival, cost: StepCost, k: int) -> Prediction:
    """E(k), E_geo(k) and tok/s(k) = E(k) / t(k), the interval from E(k)'s."""
    e = expected_tokens(s, k)
    t = cost.seconds(k)
    return Prediction(k, e, geometric_tokens(s.geometric_rate, k, s.draft_fraction),
                      Interval(e.estimate / t, e.low / t, e.high / t))


def prediction_errors(predicted: Mapping[int, float],
                      measured: Mapping[int, float]) -> tuple[PredictionError, ...]:
    """Percent error of the prediction at each measured k (refused for a k not predicted)."""
    out = []
    for k in sorted(measured):
        if k not in predicted:
            raise UserError(f"k {k} was measured but not predicted; predict k in 1..k_max only")
        v = _positive(f"measured tok/s at k {k}", measured[k], "give the run's per-sequence tok/s")
        out.append(PredictionError(k, predicted[k], v, (predicted[k] - v) / v * 100))
    return tuple(out)


def tune(run: Snapshot, k_max: int, baseline_tok_s: float, top_tok_s: float,
         measured: Mapping[int, float] | None = None, least_squares: bool = False,
         generation_tokens: float | None = None, block_size: int | None = None) -> Tuning:
    """Predictions for k = 1..k_max from the run at k_max (counter delta ``run``, speed
    ``top_tok_s``) and the baseline; ``measured`` adds tok/s at other k: compared with the
    predictions, and, with ``least_squares``, fitted with baseline and k_max (their E(k) by the
    prefix rule) instead of the two-point fit."""
    s = survival(run, k_max, generation_tokens, block_size)
    others = dict(measured or {})
    for k in others:
        _k(k, k_max, block_size)
    if others.get(k_max, top_tok_s) != top_tok_s:
        raise UserError(f"measured gives {others[k_max]!r} tok/s at k_max {k_max}, top_tok_s "
                        f"{top_tok_s!r}; give the k_max run's speed once")
    top = Measured(k_max, top_tok_s, expected_tokens(s, k_max).estimate)
    if least_squares:
        runs = [Measured(0, baseline_tok_s), top,
                *(Measured(k, v, expected_tokens(s, k).estimate)
                  for k, v in others.items() if k != k_max)]
        cost = fit_least_squares(runs)
    else:
        cost = fit_two_point(baseline_tok_s, top)
    predictions = tuple(predict(s, cost, k) for k in range(1, k_max + 1))
    best = max(predictions, key=lambda p: (p.tok_s.estimate, -p.k))
    overlapping = tuple(p.k for p in predictions if p.k != best.k and p.tok_s.overlaps(best.tok_s))
    errors = prediction_errors({p.k: p.tok_s.estimate for p in predictions},
                               {**others, k_max: top_tok_s})
    return Tuning(s, cost, predictions, best.k, overlapping, errors)


def prefix_rule(shorter: Survival, longer: Survival) -> PrefixVerdict:
    """Whether a_i of a run at k1 matches a_i of a run at k2 > k1 for every i < k1, within their
    Wilson intervals (it must for a chain drafter; DFlash's block drafter may condition on k)."""
    if shorter.k_max >= longer.k_max:
        raise UserError(f"the runs are at k {shorter.k_max} and {longer.k_max}; give the shorter "
                        "run first, at a smaller k")
    pairs = list(zip(shorter.rates, longer.rates[:shorter.k_max], strict=True))
    diffs = tuple(a.estimate - b.estimate for a, b in pairs)
    worst = max(range(len(diffs)), key=lambda i: abs(diffs[i]))
    return PrefixVerdict(all(a.overlaps(b) for a, b in pairs), shorter.k_max, longer.k_max, worst,
                         diffs[worst], diffs)


def _speed_objective(c: float, t0: float, speeds: Mapping[int, float]) -> tuple[float, float]:
    """(relative residual sum of squares, delta) for conditional acceptance c with t0 fixed."""
    ts = {k: geometric_tokens(c, k) / v for k, v in speeds.items()}
    w = {k: 1 / t ** 2 for k, t in ts.items()}
    delta = sum(w[k] * k * (t - t0) for k, t in ts.items()) / sum(w[k] * k * k for k in ts)
    return sum(w[k] * (t0 + k * delta - t) ** 2 for k, t in ts.items()), delta


def fit_from_speeds(baseline_tok_s: float, speeds: Mapping[int, float]) -> SpeedFit:
    """Conditional acceptance c and delta from tok/s alone (no counters), every step drafting (f =
    1): t0 = 1 / baseline, then (c, delta) minimising the relative step-time residuals of the runs
    at k >= 1 (a grid over c in [0, 1], zoomed in around its best point; delta in closed form for
    each c). Two runs may fit exactly in more than one way; a third is what tests the assumption."""
    t0 = 1 / _positive("baseline tok/s", baseline_tok_s, "give the baseline's per-sequence tok/s")
    for k, v in speeds.items():
        _k(k)
        _positive(f"tok/s at k {k}", v, "give the run's per-sequence tok/s")
    if len(speeds) < 2:
        raise UserError(f"{len(speeds)} drafted run(s); fitting c and delta needs runs at two k at "
                        "least")
    lo, hi, c = 0.0, 1.0, 0.0
    for _ in range(ZOOMS):
        step = (hi - lo) / GRID
        c = min((min(hi, lo + i * step) for i in range(GRID + 1)),
                key=lambda x: _speed_objective(x, t0, speeds)[0])
        lo, hi = max(0.0, c - step), min(1.0, c + step)
    delta = _speed_objective(c, t0, speeds)[1]
    cost = StepCost(t0, delta, "least-squares", len(speeds) + 1, _cost_notes(delta))
    top = max(speeds)
    predicted = {k: geometric_tokens(c, k) / cost.seconds(k) for k in range(1, top + 1)}
    return SpeedFit(c, tuple(c ** (i + 1) for i in range(top)), cost, predicted,
                    prediction_errors(predicted, speeds))
