"""The Results Summary table (markdown) and bar plot (PNG) of bench results, made on the controller.

Run by `invoke report`, `invoke compare` (a call) and the verify role (`python -m tasks report`).
"""

from __future__ import annotations

import argparse
import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from invoke import task

from sparkspec import cli
from sparkspec.bench import lossless as lossless_check
from sparkspec.cli.common import Parser, emit_json
from sparkspec.errors import UserError
from sparkspec.jsonfile import expect, read_json
from sparkspec.outputs import (
    PNG,
    PNG_MARKER,
    Marker,
    Output,
    check_outputs,
    starts_with,
    write_outputs,
)
from tasks.lib.common import fail

COLUMNS = ("Method", "Model", "Avg tok/s", "Peak tok/s", "Drafts", "Draft tokens", "Accepted",
           "Acceptance Rate", "Acceptance per position", "Mean acceptance length", "Lossless",
           "Notes")
HEADER = "| " + " | ".join(COLUMNS) + " |"
SUITE_COLUMNS = ("Method", "Model", "Suite", "Avg tok/s", "Acceptance", "Tool-call turns")
COUNT = (int, type(None))
MARKDOWN: Marker = starts_with(HEADER)  # a table is ours to replace when it starts with this header

NUMBER = (int, float, type(None))
TEXT = (str, type(None))
# key -> the types a bench result may hold there (a missing optional key reads as None)
FIELDS: dict[str, tuple[type, ...]] = {
    "completed": (int,), "per_request_tok_s_mean": NUMBER, "failed": (int, type(None)),
    "per_request_tok_s_max": NUMBER, "output_throughput": NUMBER,
    "spec_decode_acceptance_rate": NUMBER,
    "spec_decode_acceptance_length": NUMBER, "temperature": NUMBER,
    "max_concurrency": (int, type(None)),
    "method": TEXT, "model_id": TEXT, "suite": TEXT, "error": TEXT, "partial": (bool, type(None)),
    "served_model": (dict, type(None)), "suites": (dict, type(None)),
    "max_tokens": (int, type(None)),
    "spec_decode_num_drafts": COUNT, "spec_decode_draft_tokens": COUNT,
    "spec_decode_accepted_tokens": COUNT,
    "spec_decode_per_position_acceptance_rates": (list, type(None)), "profile": TEXT,
}
REQUIRED = ("completed", "per_request_tok_s_mean")
MAX_COUNT = 2**53  # requests, tokens, concurrency: far above any real run, exact as a float
UPPER = {"spec_decode_acceptance_rate": 100.0, "temperature": 100.0, "completed": MAX_COUNT,
         "failed": MAX_COUNT, "max_concurrency": MAX_COUNT, "max_tokens": MAX_COUNT}


@dataclass(frozen=True)
class Row:
    method: str
    model: str
    avg: float | None
    peak: float | None
    acceptance: float | None  # percent
    notes: str
    suites: dict[str, float | None]  # suite -> avg per-request tok/s
    drafts: int | None = None
    draft_tokens: int | None = None
    accepted: int | None = None
    per_position: tuple[float, ...] | None = None  # fractions of drafts, position 0 first
    length: float | None = None  # mean acceptance length, 1 + accepted / drafts
    lossless: str = "n/a"
    # per suite: (suite, avg tok/s, acceptance %, share of scripted tool-call turns)
    by_suite: tuple[tuple[str, float | None, float | None, float | None], ...] = ()


def _number(value: Any, where: str, key: str, fix: str, high: float = math.inf) -> float | None:
    # bools were refused by expect where they do not belong
    if value is None or isinstance(value, bool):
        return value
    if not math.isfinite(value) or not 0 <= value <= high:
        bound = "non-negative" if high == math.inf else f"from 0 to {high:g}"
        raise UserError(f"{where}: {key!r} is {value:.6g}, not a finite number {bound}; {fix}")
    return float(value)


def load_result(path: str | Path) -> dict[str, Any]:
    """A bench result with every field the table reads checked, else one line naming the file and
    key."""
    fix = "pass files written by `sparkspec bench` (or run the bench again)"
    where = str(path)
    doc = read_json(path, f"no such bench result; run `sparkspec bench --output {path}` first", fix)
    if not isinstance(doc, dict):
        raise UserError(f"{where}: not a `sparkspec bench` result (not a JSON object); {fix}")
    for key, kinds in FIELDS.items():
        value = expect(doc, key, kinds, where, fix, required=key in REQUIRED)
        if kinds is NUMBER or kinds[0] is int:
            _number(value, where, key, fix, UPPER.get(key, math.inf))
    for n, rate in enumerate(doc.get("spec_decode_per_position_acceptance_rates") or []):
        if isinstance(rate, bool) or not isinstance(rate, (int, float, type(None))):
            raise UserError(f"{where}: 'spec_decode_per_position_acceptance_rates'[{n}] is not a "
                            f"number; {fix}")
        _number(rate, where, f"spec_decode_per_position_acceptance_rates[{n}]", fix, 1.0)
    served = doc.get("served_model") or {}
    expect(served, "id", TEXT, f"{where}: served_model", fix, required=False)
    for name, suite in (doc.get("suites") or {}).items():
        for key, high in (("per_request_tok_s_mean", math.inf),
                          ("spec_decode_acceptance_rate", 100.0), ("tool_turn_share", 1.0)):
            value = expect(suite, key, NUMBER, f"{where}: suites.{name}", fix, required=False)
            _number(value, where, f"suites.{name}.{key}", fix, high)
    return doc


def _fmt(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def row_for(result: dict[str, Any], path: str = "", lossless: dict[str, Any] | None = None) -> Row:
    served = result.get("served_model") or {}
    model = str(served.get("id") or result.get("model_id") or "?")
    if result.get("profile"):
        model += f" (profile {result['profile']})"
    notes = [f"suite {result.get('suite')}", f"c={result.get('max_concurrency')}",
             f"T={result.get('temperature')}",
             f"{_fmt(result.get('output_throughput'))} tok/s total"]
    suites = {name: s.get("per_request_tok_s_mean")
              for name, s in (result.get("suites") or {}).items()}
    notes += [f"{name} {_fmt(v)} tok/s" for name, v in suites.items()]
    if result.get("failed"):
        notes.append(f"{result['failed']} failed")
    if result.get("partial"):
        notes.append(f"PARTIAL: {result.get('error')}")
    method = str(result.get("method") or Path(path).stem or "?")
    # baseline, or with levers
    verdict = "reference" if method.split("+", 1)[0] == "baseline" else "n/a"
    if lossless is not None:
        verdict, note = lossless_cells(lossless)
        notes[:0] = [note] if note else []
    per_pos = result.get("spec_decode_per_position_acceptance_rates")
    return Row(method, model, result.get("per_request_tok_s_mean"),
               result.get("per_request_tok_s_max"),
               result.get("spec_decode_acceptance_rate"), "; ".join(notes), suites,
               result.get("spec_decode_num_drafts"), result.get("spec_decode_draft_tokens"),
               result.get("spec_decode_accepted_tokens"),
               None if per_pos is None else tuple(per_pos),
               result.get("spec_decode_acceptance_length"), verdict,
               tuple((str(name), sub.get("per_request_tok_s_mean"),
                      sub.get("spec_decode_acceptance_rate"), sub.get("tool_turn_share"))
                     for name, sub in (result.get("suites") or {}).items()))


def lossless_cells(report: dict[str, Any]) -> tuple[str, str]:
    """The Lossless cell (identical of total, pass or FAIL against the allowed share) and, below
    100 %, a note naming the first divergence: the prompt, the token index with the expected and the
    produced token id where the server returned ids, else the character offset, with the text
    around it."""
    share = f"{report['identical']}/{report['total']}"
    verdict = f"{share} {'pass' if report.get('passed') else 'FAIL'}"
    first = next(iter(report.get("mismatches") or []), None)
    if first is None:
        return verdict, ""
    if first.get("token_index") is not None:
        where = (f"token {first['token_index']}: expected id {first.get('expected_token')} "
                 f"vs got id {first.get('actual_token')}")
    else:
        where = f"char {first['offset']}"
    return verdict, (f"first divergence in {first['id']} at {where} "
                     f"({first['expected']!r} vs {first['actual']!r})")


def cell(text: str) -> str:
    """``text`` as one table cell: control characters (newlines, escapes) become spaces, '|' is
    escaped."""
    return "".join(c if c.isprintable() else " " for c in text).replace("|", "\\|")


def markdown(rows: list[Row]) -> str:
    lines = [HEADER, "|" + "|".join(["---"] * len(COLUMNS)) + "|"]
    for r in rows:
        per_pos = ("n/a" if r.per_position is None
                   else " / ".join(_fmt(100.0 * p, suffix="%") for p in r.per_position))
        counts = ("n/a" if v is None else str(v) for v in (r.drafts, r.draft_tokens, r.accepted))
        cells = (r.method, r.model, _fmt(r.avg), _fmt(r.peak), *counts,
                 _fmt(r.acceptance, suffix="%"), per_pos, _fmt(r.length, 2), r.lossless, r.notes)
        lines.append("| " + " | ".join(map(cell, cells)) + " |")
    if any(r.by_suite for r in rows):   # which method wins on which workload (agent turns apart)
        lines += ["", "| " + " | ".join(SUITE_COLUMNS) + " |",
                  "|" + "|".join(["---"] * len(SUITE_COLUMNS)) + "|"]
        lines += ["| " + " | ".join(map(cell, (r.method, r.model, name, _fmt(avg),
                                               _fmt(rate, suffix="%"),
                                               _fmt(None if tools is None else 100 * tools,
                                                    0, "%")))) + " |"
                  for r in rows for name, avg, rate, tools in r.by_suite]
    return "\n".join(lines) + "\n"


def plot_png(rows: list[Row], title: str = "Per-request output speed") -> bytes:
    """Grouped bars per method: average and peak tok/s, and per-suite averages when the bench had
    suites."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    series: dict[str, list[float]] = {"avg": [r.avg or 0.0 for r in rows],
                                      "peak": [r.peak or 0.0 for r in rows]}
    for name in sorted({s for r in rows for s in r.suites}):
        series[f"{cell(name)} avg"] = [r.suites.get(name) or 0.0 for r in rows]
    x = np.arange(len(rows))
    width = 0.8 / len(series)
    labels = [f"{cell(r.method)}\n{_fmt(r.acceptance, suffix='%')} acc.\nlen {_fmt(r.length, 2)}"
              for r in rows]
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(2 * max(5.0, 1.6 * len(rows) + 2), 4.4),
                                  dpi=100)
    try:
        for i, (label, values) in enumerate(series.items()):
            bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width, label=label)
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(x, labels)
        ax.set_ylabel("tok/s per request")
        ax.set_title(title)
        ax.legend(fontsize=8)
        # acceptance per position (accepted at position i / drafts, from the server's counters) per
        # method
        positions = max((len(r.per_position or ()) for r in rows), default=0)
        pwidth = 0.8 / max(1, positions)
        for i in range(positions):
            has = [r.per_position is not None and i < len(r.per_position) for r in rows]
            values = [100.0 * r.per_position[i] if r.per_position and ok else 0.0
                      for r, ok in zip(rows, has, strict=True)]
            bars = acc.bar(x + (i - (positions - 1) / 2) * pwidth, values, pwidth,
                           label=f"position {i}")
            acc.bar_label(bars, labels=[f"{v:.0f}" if ok else ""
                                        for v, ok in zip(values, has, strict=True)],
                          fontsize=7)
        acc.set_xticks(x, labels)
        acc.set_ylim(0, 100)
        acc.set_ylabel("% of drafts accepted at the position")
        acc.set_title("Acceptance per position (/metrics counter deltas)")
        if positions:
            acc.legend(fontsize=8)
        return png_bytes(fig)
    finally:
        plt.close(fig)


def png_bytes(fig: Any) -> bytes:
    """A figure laid out and saved as PNG, marked as sparkspec's by its Description
    (outputs.PNG)."""
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", metadata={"Software": None, "Description": PNG_MARKER})
    return out.getvalue()


def load_lossless(path: str) -> dict[str, Any]:
    """A `sparkspec check-output compare` report with what the table reads checked, else one
    line."""
    fix = "pass files written by `sparkspec check-output compare --output`"
    doc = read_json(path, "no such lossless report; run `sparkspec check-output compare --output` "
                    "first", fix)
    if not isinstance(doc, dict) or doc.get("format") != lossless_check.REPORT_FORMAT:
        raise UserError(f"{path}: not a {lossless_check.REPORT_FORMAT} file; {fix}")
    required: tuple[tuple[str, tuple[type, ...]], ...] = (
        ("method", (str,)), ("model", (str,)), ("identical", (int,)), ("total", (int,)),
        ("passed", (bool,)), ("mismatches", (list,)))
    for key, kinds in required:
        expect(doc, key, kinds, path, fix)
    for n, m in enumerate(doc["mismatches"]):
        where = f"{path}: mismatches[{n}]"
        fields: tuple[tuple[str, tuple[type, ...]], ...] = (
            ("id", (str,)), ("offset", (int,)), ("expected", (str,)), ("actual", (str,)),
            ("token_index", COUNT), ("expected_token", COUNT), ("actual_token", COUNT))
        for key, kinds in fields:
            expect(m, key, kinds, where, fix,
                   required=key in ("id", "offset", "expected", "actual"))
    return doc


def _unique(paths: list[str], flag: str) -> None:
    seen: dict[str, str] = {}
    for p in paths:
        real = os.path.realpath(p)
        if real in seen:
            raise UserError(f"{flag} {p}: the same file as {seen[real]} given twice; "
                            "give each file once")
        seen[real] = p


def build(inputs: list[str], lossless: Sequence[str] = ()) -> list[Row]:
    """A row per bench result, with the lossless report of the same method and served model where
    one is given; every input is read and checked before any row is used."""
    if not inputs:
        raise UserError("--inputs: no bench result given; pass one or more files from "
                        "`sparkspec bench`")
    _unique(list(inputs), "--inputs")
    _unique(list(lossless), "--lossless")
    results = [load_result(p) for p in inputs]
    keys = [(str(r.get("method")), str(r.get("model_id"))) for r in results]
    reports: dict[tuple[str, str], dict[str, Any]] = {}
    for path in lossless:
        doc = load_lossless(path)
        key = (doc["method"], doc["model"])
        if keys.count(key) != 1 or key in reports:
            raise UserError(f"--lossless {path}: method {cell(key[0])} on model {cell(key[1])} is "
                            "not exactly one bench result's, or given twice; pass one lossless "
                            "report per bench row")
        reports[key] = doc
    return [row_for(r, p, reports.get(k)) for r, p, k in zip(results, inputs, keys, strict=True)]


def write(inputs: Sequence[str], lossless: Sequence[str] = (), markdown_path: str | None = None,
          plot_path: str | None = None) -> tuple[list[Row], str]:
    """The rows and the table of the bench results; the table and the plot written where asked
    (both outputs checked before any input is read, and again right before the write). One line on
    bad input."""
    named = tuple(("--inputs", p) for p in inputs) + tuple(("--lossless", p) for p in lossless)
    md = None if markdown_path is None else Output(markdown_path, "--markdown", MARKDOWN, named)
    png = None if plot_path is None else Output(plot_path, "--plot", PNG,
                                                (*named, ("--markdown", markdown_path)))
    outputs = check_outputs([md, png])
    rows = build(list(inputs), lossless)
    text = markdown(rows)
    data = {"--markdown": text.encode(), "--plot": plot_png(rows) if png is not None else b""}
    write_outputs([(o, data[o.flag]) for o in outputs])
    return rows, text


def _show(rows: list[Row], text: str, markdown_path: str | None, plot_path: str | None,
          as_json: bool) -> None:
    if markdown_path is None:
        print(text, end="")
    if as_json:
        emit_json({"changed": markdown_path is not None or plot_path is not None,
                   "rows": len(rows), "markdown": markdown_path, "plot": plot_path})


class ReportParser(Parser):
    program = "python -m tasks report"


def build_parser() -> argparse.ArgumentParser:
    """The report's own command line, for the verify role on the controller; `invoke report` takes
    the same options."""
    parser = ReportParser(prog=ReportParser.program,
                          description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--inputs", nargs="+", required=True, help="bench result JSON files")
    parser.add_argument("--lossless", nargs="+", default=[],
                        help="lossless reports (`check-output compare --output`) of the same rows: "
                             "the Lossless column and the first divergence in the notes")
    parser.add_argument("--markdown", help="markdown file to write (default: print the table)")
    parser.add_argument("--plot", help="PNG file to write")
    parser.add_argument("--json", action="store_true", help="print a final JSON line")

    def run(args: argparse.Namespace) -> int:
        rows, text = write(args.inputs, args.lossless, args.markdown, args.plot)
        _show(rows, text, args.markdown, args.plot, args.json)
        return 0

    parser.set_defaults(func=run, command="report")
    return parser


def main(argv: list[str] | None = None) -> int:
    return cli.run(build_parser(), argv)


@task(positional=[], auto_shortflags=False, iterable=["inputs", "lossless"], help={
    "inputs": "a bench result JSON file (repeat the flag for each)",
    "lossless": "a lossless report (`check-output compare --output`) of one of the rows: the "
                "Lossless column and the first divergence in the notes (repeat the flag for each)",
    "markdown": "markdown file to write (default: print the table)", "plot": "PNG file to write",
    "json": "print a final JSON line"})
def report(c, inputs=None, lossless=None, markdown=None, plot=None, json=False):
    """The Results Summary table (markdown) and plot (PNG) from bench results on this machine.

    The bench results are those fetched to reports/; the table shows speeds, drafts, acceptance per
    position, mean acceptance length and the lossless verdict."""
    try:
        rows, text = write(inputs or [], lossless or [], markdown or None, plot or None)
    except UserError as exc:
        raise fail(exc) from None
    _show(rows, text, markdown or None, plot or None, bool(json))

