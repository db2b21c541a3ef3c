"""The article's Results Summary table (markdown) and a bar plot (PNG) from bench result JSON files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec.errors import UserError
from sparkspec.jsonfile import read_json

COLUMNS = ("Method", "Model", "Avg tok/s", "Peak tok/s", "Acceptance Rate", "Notes")


@dataclass(frozen=True)
class Row:
    method: str
    model: str
    avg: float | None
    peak: float | None
    acceptance: float | None  # percent
    notes: str
    suites: dict[str, float | None]  # suite -> avg per-request tok/s


def load_result(path: str | Path) -> dict[str, Any]:
    doc = read_json(path, f"no such bench result; run `sparkspec bench --output {path}` first",
                    "run the bench again")
    if not isinstance(doc, dict) or "per_request_tok_s_mean" not in doc or "completed" not in doc:
        raise UserError(f"{path}: not a `sparkspec bench` result; pass files written by `sparkspec bench`")
    return doc


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def row_for(result: dict[str, Any], path: str = "") -> Row:
    served = result.get("served_model") or {}
    model = str(served.get("id") or result.get("model_id") or "?")
    notes = [f"suite {result.get('suite')}", f"c={result.get('max_concurrency')}",
             f"T={result.get('temperature')}", f"{_fmt(result.get('output_throughput'))} tok/s total"]
    if result.get("spec_decode_acceptance_length") is not None:
        notes.append(f"acceptance length {result['spec_decode_acceptance_length']:.2f}")
    suites = {name: s.get("per_request_tok_s_mean") for name, s in (result.get("suites") or {}).items()}
    notes += [f"{name} {_fmt(v)} tok/s" for name, v in suites.items()]
    if result.get("failed"):
        notes.append(f"{result['failed']} failed")
    if result.get("partial"):
        notes.append(f"PARTIAL: {result.get('error')}")
    method = str(result.get("method") or Path(path).stem or "?")
    return Row(method, model, result.get("per_request_tok_s_mean"), result.get("per_request_tok_s_max"),
               result.get("spec_decode_acceptance_rate"), "; ".join(notes), suites)


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] * len(COLUMNS)) + "|"]
    for r in rows:
        cells = (r.method, r.model, _fmt(r.avg), _fmt(r.peak), _fmt(r.acceptance, suffix="%"), r.notes)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: str | Path, title: str = "Per-request output speed") -> None:
    """Grouped bars per method: average and peak tok/s, and per-suite averages when the bench had suites."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    series: dict[str, list[float]] = {"avg": [r.avg or 0.0 for r in rows], "peak": [r.peak or 0.0 for r in rows]}
    for name in sorted({s for r in rows for s in r.suites}):
        series[f"{name} avg"] = [r.suites.get(name) or 0.0 for r in rows]
    x = np.arange(len(rows))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(rows) + 2), 4), dpi=100)
    for i, (label, values) in enumerate(series.items()):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(x, [f"{r.method}\n{_fmt(r.acceptance, suffix='%')} acc." for r in rows])
    ax.set_ylabel("tok/s per request")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", metadata={"Software": None})
    except OSError as exc:
        raise UserError(f"{path}: cannot write the plot ({exc.strerror}); choose a writable --plot") from None
    finally:
        plt.close(fig)


def build(inputs: list[str], markdown_path: str | None, plot_path: str | None) -> list[Row]:
    if not inputs:
        raise UserError("--inputs: no bench result given; pass one or more files from `sparkspec bench`")
    rows = [row_for(load_result(p), p) for p in inputs]
    if markdown_path:
        try:
            Path(markdown_path).write_text(markdown(rows), encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{markdown_path}: cannot write ({exc.strerror}); choose a writable --markdown") \
                from None
    if plot_path:
        plot(rows, plot_path)
    return rows
