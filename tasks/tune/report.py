"""`invoke tune`'s report: a table per workload (k, measured tok/s, a_i, predicted tok/s, error),
the verdict, the best k per suite and per concurrency level, and a plot; written through
sparkspec.outputs (markdown, PNG and the JSON that `--apply` reads, all or none, never over a file
this command did not write)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparkspec.errors import UserError
from sparkspec.outputs import (
    PNG,
    Marker,
    Output,
    check_outputs,
    json_format,
    starts_with,
    write_outputs,
)
from tasks.report import cell, png_bytes
from tasks.tune.fit import WHOLE, Case, batch_schedule

TITLE = "# sparkspec tune"
MARKDOWN: Marker = starts_with(TITLE)
FORMAT = "sparkspec-tune/1"
JSON: Marker = json_format(FORMAT)


def outputs(folder: str, method: str) -> list[Output]:
    """tune-<method>.{md,png} under reports/<head>/ and the figures in tune/<method>.json below it
    (not beside: the verify role reads every reports/<host>/*.json as a bench result), checked
    before anything runs."""
    for below in (Path(folder), Path(folder) / "tune"):   # no folder of ours may lead elsewhere
        if below.is_symlink():
            raise UserError(f"{below}: a symbolic link; remove it (tune writes its report there)")
    base = f"{folder}/tune-{method}"
    found = check_outputs([Output(f"{base}.md", "report", MARKDOWN),
                           Output(f"{base}.png", "plot", PNG),
                           Output(f"{folder}/tune/{method}.json", "result", JSON)])
    return found


def _pct(value: float) -> str:
    return f"{100 * value:.1f}"


def _table(case: Case) -> list[str]:
    lines = ["| k | measured tok/s (± s.e.) | a_i of this run (%) | predicted tok/s [95 %] | "
             "E(k) | E_geo(k) | error |", "|---|---|---|---|---|---|---|"]
    base = case.baseline
    lines.append(f"| 0 (baseline) | {base.tok_s:.1f} ± {base.se:.1f} | | | 1 | 1 | |")
    preds = {p.k: p for p in case.tuning.predictions} if case.tuning else {}
    errors = {e.k: e.error_pct for e in case.tuning.errors} if case.tuning else {}
    for k in sorted(set(preds) | set(case.measured)):
        m = case.measured.get(k)
        measured = f"{m.tok_s:.1f} ± {m.se:.1f}" if m else "not measured"
        rates = ""
        if m is not None and m.run is not None and m.run.num_drafts:
            rates = " / ".join(_pct(m.run.accepted_per_pos.get(i, 0) / m.run.num_drafts)
                               for i in range(k))
        p = preds.get(k)
        predicted = (f"{p.tok_s.estimate:.1f} [{p.tok_s.low:.1f}-{p.tok_s.high:.1f}]" if p else "")
        e_k = f"{p.tokens_per_step.estimate:.2f}" if p else ""
        geo = f"{p.geometric_tokens_per_step:.2f}" if p else ""
        err = f"{round(errors[k], 1) + 0.0:+.1f} %" if k in errors else ""   # no "-0.0"
        mark = " **best**" if case.tuning and k == case.tuning.best_k else ""
        lines.append(f"| {k}{mark} | {measured} | {rates} | {predicted} | {e_k} | {geo} | {err} |")
    return lines


def markdown(method: str, head: str, settings: dict[str, Any], found: list[Case]) -> str:
    lines = [f"{TITLE}: {method} on {head}", "",
             "Workload: " + ", ".join(f"{k} {v}" for k, v in settings.items()), "",
             "Predicted from the k_max run alone (its per-position acceptance a_i and the step "
             "cost t(k) = t0 + k·δ fitted from baseline and k_max); every other k is measured to "
             "check it. docs/methods.md \"Choosing k\" has the model.", "",
             "## Best k", "",
             "| suite | concurrency | predicted best k | best measured k | verdict |",
             "|---|---|---|---|---|"]
    for c in found:
        predicted = str(c.tuning.best_k) if c.tuning else "-"
        measured = c.best_measured or "-"
        lines.append(f"| {cell(c.suite)} | {c.concurrency} | {predicted} | {measured} | "
                     f"{cell(c.verdict)} |")
    schedule = batch_schedule(found)
    levels = {c.concurrency for c in found if c.tuning is not None and c.suite == WHOLE}
    if not schedule and len(levels) > 1:
        lines += ["", "The predicted best k is the same at every concurrency level: no batch-size "
                  "schedule is needed."]
    if schedule:
        top = max(k for _, _, k in schedule)
        lines += ["", "Batch-size-dependent k (a suggestion, not applied; vLLM 0.32.0 reads it in "
                  "`vllm/v1/core/sched/scheduler.py`: ranges of running requests, the last k "
                  "carried on):",
                  "",
                  "```yaml", "speculative_config: {num_speculative_tokens: " + str(top)
                  + ", num_speculative_tokens_per_batch_size: " + json.dumps(schedule) + "}", "```"]
    for c in found:
        lines += ["", f"## {cell(c.suite)}, concurrency {c.concurrency}", "", *_table(c)]
        if c.tuning:
            s, cost = c.tuning.survival, c.tuning.cost
            lines += ["", f"Draft fraction {s.draft_fraction:.3f} of {s.steps:.0f} steps; "
                      f"geometric rate a = {s.geometric_rate:.3f}; "
                      f"step cost t0 = {1000 * cost.t0:.2f} ms, "
                      f"δ = {1000 * cost.delta:.3f} ms per drafted token ({cost.method})."]
            lines += [f"- {n}" for n in (*s.notes, *cost.notes)]
        lines += [f"- {n}" for n in c.notes]
    return "\n".join(lines) + "\n"


def document(method: str, head: str, settings: dict[str, Any],
             found: list[Case]) -> dict[str, Any]:
    """What `--apply` and other tools read: the best k per workload, and every figure of the
    table."""
    return {"format": FORMAT, "method": method, "host": head, "settings": settings,
            "best_k": next((c.tuning.best_k for c in found if c.suite == WHOLE and c.tuning),
                           None),
            "batch_schedule": batch_schedule(found),
            "cases": [{"suite": c.suite, "concurrency": c.concurrency, "k_max": c.k_max,
                       "baseline_tok_s": c.baseline.tok_s, "best_measured": c.best_measured,
                       "verdict": c.verdict, "notes": c.notes,
                       "measured": {str(k): {"tok_s": p.tok_s, "se": p.se, "requests": p.requests}
                                    for k, p in c.measured.items()},
                       "tuning": c.tuning.as_dict() if c.tuning else None} for c in found]}


def plot_png(method: str, found: list[Case]) -> bytes:
    """tok/s against k per workload: measured (dots, ± 1.96 s.e.) and predicted (line, its
    interval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, acc) = plt.subplots(1, 2, figsize=(12, 4.6), dpi=100)
    try:
        for c in found:
            label = f"{cell(c.suite)}, c={c.concurrency}"
            ks = sorted(c.measured)
            line = ax.errorbar([0, *ks], [c.baseline.tok_s, *(c.measured[k].tok_s for k in ks)],
                               yerr=[1.96 * c.baseline.se, *(1.96 * c.measured[k].se for k in ks)],
                               fmt="o", capsize=3, label=f"{label} measured")
            if c.tuning:
                pk = [p.k for p in c.tuning.predictions]
                est = [p.tok_s.estimate for p in c.tuning.predictions]
                color = line[0].get_color()
                ax.plot(pk, est, "-", color=color, label=f"{label} predicted from k={c.k_max}")
                ax.fill_between(pk, [p.tok_s.low for p in c.tuning.predictions],
                                [p.tok_s.high for p in c.tuning.predictions], color=color,
                                alpha=0.15)
                rates = c.tuning.survival.rates
                acc.errorbar(range(len(rates)), [100 * r.estimate for r in rates],
                             yerr=[[100 * (r.estimate - r.low) for r in rates],
                                   [100 * (r.high - r.estimate) for r in rates]],
                             fmt="o-", capsize=3, color=color, label=label)
        ax.set_xlabel("k (num_speculative_tokens; 0 = baseline)")
        ax.set_ylabel("tok/s per request")
        ax.set_title(f"{method}: measured and predicted")
        ax.legend(fontsize=7)
        acc.set_xlabel("position i")
        acc.set_ylabel("a_i: % of drafts whose token i was accepted")
        acc.set_ylim(0, 100)
        acc.set_title("Survival per position (k_max run, Wilson 95 %)")
        if acc.get_legend_handles_labels()[0]:
            acc.legend(fontsize=7)
        return png_bytes(fig)
    finally:
        plt.close(fig)


def write(targets: list[Output], method: str, head: str, settings: dict[str, Any],
          found: list[Case]) -> str:
    """The three files, all or none; returns the markdown."""
    text = markdown(method, head, settings, found)
    doc = json.dumps(document(method, head, settings, found), indent=2, allow_nan=False) + "\n"
    data = {"report": text.encode(), "plot": plot_png(method, found), "result": doc.encode()}
    write_outputs([(o, data[o.flag]) for o in targets])
    return text
