"""From a sweep's bench results to the verdict per workload: for each suite (and the whole run) at
each concurrency level, the prediction from the k_max run (tasks.tune.model), set against every k
measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from sparkspec.bench.metrics import Snapshot
from sparkspec.errors import UserError
from sparkspec.jsonfile import expect
from tasks.tune.model import Tuning, tune

FIX = "run the sweep again (the file is not a `sparkspec bench` result)"
MAX_COUNT = 2**53        # requests, drafts, tokens: exact as a float, far above any run
MAX_TOK_S = 1e6          # per-request tok/s (and its std): far above any server
WHOLE = "all prompts"
NEAR_ZERO = 0.05   # a_0 below this: the drafter almost never lands a token on this workload


@dataclass(frozen=True)
class Point:
    """One scope (the whole run, or one suite) of one bench result."""

    tok_s: float              # mean per-request tok/s
    std: float                # their population std
    requests: int
    run: Snapshot | None      # the counter delta; None where the server drafted nothing

    @property
    def se(self) -> float:
        return self.std / math.sqrt(self.requests) if self.requests else math.inf


@dataclass
class Case:
    """One workload (a suite, or all prompts) at one concurrency level."""

    suite: str
    concurrency: int
    k_max: int
    baseline: Point
    measured: dict[int, Point]
    tuning: Tuning | None = None
    best_measured: int | None = None   # argmax of measured tok/s over k >= 1; None: none measured
    verdict: str = ""
    notes: list[str] = field(default_factory=list)


def _count(doc: dict[str, Any], key: str, where: str, required: bool = True,
           integer: bool = True) -> float | None:
    """A count (an integer in 0..2^53) or, ``integer`` False, a speed (a number in 0..1e6); None if
    absent."""
    value = expect(doc, key, (int, type(None)) if integer else (int, float, type(None)), where,
                   FIX, required=required)
    if value is None:
        return None
    high = MAX_COUNT if integer else MAX_TOK_S
    if not (0 <= value <= high and math.isfinite(value)):
        raise UserError(f"{where}: {key!r} is {str(value)[:40]}, not a number in 0..{high:g}; "
                        f"{FIX}")
    return float(value)


def point(doc: dict[str, Any], where: str, k_max: int | None) -> Point:
    """A scope of a bench result; ``k_max``: the run's k (None: baseline, whose counters are not
    read)."""
    tok_s = _count(doc, "per_request_tok_s_mean", where, integer=False)
    requests = _count(doc, "completed", where)
    if not tok_s or not requests:
        raise UserError(f"{where}: no request completed with a speed (per_request_tok_s_mean "
                        f"{tok_s}, completed {requests}); {FIX}")
    std = _count(doc, "per_request_tok_s_std", where, required=False, integer=False)
    run = None
    drafts = _count(doc, "spec_decode_num_drafts", where, required=False)
    if k_max is not None and drafts:
        rates = expect(doc, "spec_decode_per_position_acceptance_rates", list, where, FIX)
        counts: dict[int, float] = {}
        for i, rate in enumerate(rates):
            if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 <= rate <= 1:
                raise UserError(f"{where}: spec_decode_per_position_acceptance_rates[{i}] is "
                                f"{rate!r}, not a fraction; {FIX}")
            if i >= k_max and rate:
                raise UserError(f"{where}: position {i} accepted tokens in a run at k {k_max}; the "
                                f"result is not this row's; {FIX}")
            if i < k_max:
                counts[i] = round(rate * drafts)
        # vLLM exports every position 0..k-1 (its counter per position, from start)
        if len(rates) < k_max:
            raise UserError(f"{where}: {len(rates)} per-position rates for a run at k {k_max}; the "
                            f"result is not this row's; {FIX}")
        generation = _count(doc, "server_generation_tokens", where)
        run = Snapshot(generation_tokens=generation or 0.0, has_spec_decode=True,
                       num_drafts=drafts,
                       num_draft_tokens=_count(doc, "spec_decode_draft_tokens", where) or 0.0,
                       num_accepted_tokens=(_count(doc, "spec_decode_accepted_tokens", where)
                                            or 0.0),
                       accepted_per_pos=counts)
    return Point(tok_s, std or 0.0, int(requests), run)


def scopes(doc: dict[str, Any], where: str, k_max: int | None) -> dict[str, Point]:
    """The whole run and each suite of a result (a single-suite run is its whole run only)."""
    out = {WHOLE: point(doc, where, k_max)}
    suites = expect(doc, "suites", (dict, type(None)), where, FIX, required=False) or {}
    for name, sub in suites.items():
        if name == WHOLE or not str(name).isprintable() or not 0 < len(str(name)) <= 128:
            raise UserError(f"{where}: a suite named {str(name)[:40]!r}; {FIX}")
        out[str(name)] = point(sub, f"{where}: suites.{name}", k_max)
    return out


def _known(p: Point) -> bool:
    """A spread to judge within: two requests at least, and their std."""
    return p.requests >= 2 and p.std > 0


def _apart(a: Point, b: Point) -> bool:
    return abs(a.tok_s - b.tok_s) > 1.96 * math.hypot(a.se, b.se)


def judge(case: Case, block_size: int | None = None) -> Case:
    """The prediction from the k_max run and the verdict against every measured k."""
    if case.measured:
        case.best_measured = max(case.measured, key=lambda k: (case.measured[k].tok_s, -k))
    top = case.measured.get(case.k_max)
    if top is None:
        case.verdict = f"k_max {case.k_max} was not measured: no prediction"
        return case
    if top.run is None or not top.run.num_drafts:
        case.verdict = "no prediction: the method drafted nothing in the k_max run"
        return case
    others = {k: p.tok_s for k, p in case.measured.items() if k != case.k_max}
    try:
        case.tuning = tune(top.run, case.k_max, case.baseline.tok_s, top.tok_s, others,
                           block_size=block_size)
    except UserError as exc:
        case.verdict = f"no prediction: {exc}"
        return case
    rates = case.tuning.survival.rates
    if rates[0].estimate < NEAR_ZERO:
        case.notes.append(f"acceptance is near zero (a_0 = {100 * rates[0].estimate:.1f} %): "
                          "on this model and workload drafting cannot pay for itself, whatever k")
    best = case.best_measured
    assert best is not None   # k_max was measured
    predicted = case.tuning.best_k
    if case.baseline.tok_s > case.measured[best].tok_s:
        case.notes.append(f"baseline ({case.baseline.tok_s:.1f} tok/s) beats every k measured: "
                          "serve without drafting for this workload")
    if len(case.measured) == 1:
        case.verdict = (f"predicted best k {predicted} (only k_max {case.k_max} measured: sweep "
                        "more k to check)")
    elif predicted not in case.measured:
        case.verdict = (f"predicted best k {predicted} was not measured; best measured k {best} "
                        f"({case.measured[best].tok_s:.1f} tok/s)")
    elif predicted == best:
        case.verdict = f"predicted best k {predicted} = best measured k {best}"
    elif not (_known(case.measured[predicted]) and _known(case.measured[best])):
        case.verdict = (f"predicted best k {predicted}, best measured k {best} "
                        f"({case.measured[predicted].tok_s:.1f} vs "
                        f"{case.measured[best].tok_s:.1f} tok/s); "
                        "spread unknown (one request, or no per-request std): measure more "
                        "--requests")
    elif not _apart(case.measured[predicted], case.measured[best]):
        case.verdict = (f"predicted best k {predicted} matches best measured k {best} within their "
                        f"spread ({case.measured[predicted].tok_s:.1f} vs "
                        f"{case.measured[best].tok_s:.1f} tok/s)")
    else:
        miss = 100 * (1 - case.measured[predicted].tok_s / case.measured[best].tok_s)
        case.verdict = (f"MISSED: predicted best k {predicted} measured "
                        f"{case.measured[predicted].tok_s:.1f} "
                        f"tok/s, {miss:.1f} % below best measured k {best} "
                        f"({case.measured[best].tok_s:.1f}); " + _why(case, predicted, best))
    return case


def _why(case: Case, predicted: int, best: int) -> str:
    assert case.tuning is not None
    errors = {e.k: e.error_pct for e in case.tuning.errors}
    return (f"the model was off by {errors.get(predicted, 0):+.1f} % at k {predicted} and "
            f"{errors.get(best, 0):+.1f} % at k {best} (the linear step cost or the prefix rule "
            "does not hold for this drafter here)")


def cases(results: dict[tuple[int, int], dict[str, Any]], where: dict[tuple[int, int], str],
          k_max: int, levels: list[int], block_size: int | None = None) -> list[Case]:
    """Every (scope, level) with its verdict, from results keyed by (k, concurrency) (k 0:
    baseline)."""
    out: list[Case] = []
    for level in levels:
        if (0, level) not in results:
            continue
        base = scopes(results[(0, level)], where[(0, level)], None)
        drafted = {k: scopes(doc, where[(k, c)], k)
                   for (k, c), doc in results.items() if k and c == level}
        for scope, baseline in base.items():
            measured = {k: s[scope] for k, s in sorted(drafted.items()) if scope in s}
            out.append(judge(Case(scope, level, k_max, baseline, measured), block_size))
    return out


def recommend(found: list[Case]) -> tuple[int | None, str]:
    """The k `--apply` writes: the prediction for all prompts at the first level, when the
    measurements back it (the predicted k is the best measured, or within its spread, and beats
    baseline); else None and why."""
    case = next((c for c in found if c.suite == WHOLE), None)
    if case is None or case.tuning is None:
        return None, f"no k was predicted ({case.verdict if case else 'no result'})"
    k = case.tuning.best_k
    if case.verdict.startswith("MISSED") or "spread unknown" in case.verdict:
        return None, f"the measurements do not back the predicted k {k} ({case.verdict})"
    measured = case.measured.get(k)
    speed = measured.tok_s if measured else case.tuning.predictions[k - 1].tok_s.estimate
    if case.baseline.tok_s >= speed:
        return None, (f"baseline ({case.baseline.tok_s:.1f} tok/s) is faster than k {k} "
                      f"({speed:.1f}): serve without drafting for this workload")
    return k, case.verdict


def batch_schedule(found: list[Case]) -> list[list[int]] | None:
    """vLLM's num_speculative_tokens_per_batch_size for the whole run's best k per level (vLLM
    0.32.0, vllm/v1/spec_decode/dynamic/utils.py: inclusive [start, end, k] ranges from batch size
    1, the last k carried to max_num_seqs), or None with fewer than two levels predicted or one k
    best at every level."""
    best = {c.concurrency: c.tuning.best_k
            for c in found if c.suite == WHOLE and c.tuning is not None}
    if len(best) < 2 or len(set(best.values())) == 1:
        return None
    levels = sorted(best)
    ends = [nxt - 1 for nxt in levels[1:]] + [levels[-1]]
    return [[1 if i == 0 else lvl, end, best[lvl]]
            for i, (lvl, end) in enumerate(zip(levels, ends, strict=True))]
