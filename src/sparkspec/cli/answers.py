"""``sparkspec check answers`` (known answers under concurrency), ``sparkspec check needle`` (a
fact at several depths of each context tier) and ``check needle-metrics`` (its figures for
Prometheus)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from sparkspec.argtypes import number
from sparkspec.bench.client import MAX_TOKENS
from sparkspec.cli.common import emit_json
from sparkspec.errors import UserError
from sparkspec.registry.data import NEEDLE_ANSWER_TOKENS


def _tiers(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:60]!r} is not comma-separated token counts, "
                                         "e.g. 1024,4096") from None


CHECKS = ("answers", "needle")


def report_format(command: str) -> str:
    from sparkspec.bench import answers, needle

    return answers.FORMAT if command == "answers" else needle.FORMAT


def inputs(args: argparse.Namespace) -> tuple[tuple[str, str | None], ...]:
    """The files this check reads, which its --output may not overwrite."""
    return (("--known", args.known),) if args.check_command == "answers" else ()


def run(args: argparse.Namespace, key: str | None) -> tuple[dict[str, Any], bool, str,
                                                           dict[str, Any]]:
    """The check's report, verdict, one line and the figures of its --json line."""
    from sparkspec.bench import answers, needle

    if args.check_command == "answers":
        known = answers.load_known(args.known)
        report = answers.check(args.url, args.model, known, args.concurrency, args.max_tokens,
                               key, args.method, args.timeout)
        ok, summary = answers.verdict(report)
        return report, ok, summary, {"wrong": len(report["wrong"]), "total": report["total"]}
    if args.concurrency != 1:
        raise UserError("--concurrency: the needle check sends one request at a time (its "
                        "figures are per tier at one request); drop --concurrency")
    report = needle.check(args.url, args.model, args.tiers, args.max_tokens, key, args.method,
                          args.timeout)
    ok, summary = needle.verdict(report, args.expect == "found")
    return report, ok, summary, {"tiers": [t["tier"] for t in report["tiers"]]}


def _metrics(args: argparse.Namespace) -> int:
    """Write a needle report's figures into the textfile folder (run as root by verify)."""
    from sparkspec import outputs
    from sparkspec.bench import needle

    name = needle.textfile_name(args.unit, args.method)
    if not os.path.isabs(args.dir) or os.path.islink(args.dir) or not os.path.isdir(args.dir):
        raise UserError(f"--dir {args.dir!r:.80} is not an absolute path to a folder (a link is "
                        "refused); give the node exporter's textfile folder")
    target = os.path.join(args.dir, name)
    # root reads a file another user wrote: not through a link they planted, never the output itself
    if os.path.islink(args.report):
        raise UserError(f"--report {args.report!r:.80} is a symbolic link; give the report itself")
    outputs.check_disjoint(target, {"--report": args.report}, "--dir")
    body = needle.textfile(needle.load_report(args.report, args.method), args.unit)
    try:
        outputs.write_atomic(target, body, mode=0o644, flag="--dir")
    except OSError as exc:
        raise UserError(f"{target}: cannot write ({exc.strerror}); check --dir") from None
    print(f"needle figures for {args.unit} ({args.method}): {target}")
    if args.json:
        emit_json({"changed": True, "path": target})
    return 0


def register(checks_sub: argparse._SubParsersAction,  # type: ignore[type-arg]
             add_server_args: Callable[[argparse.ArgumentParser], None],
             handler: Callable[[argparse.Namespace], int]) -> None:
    tokens = number(int, 1, MAX_TOKENS)
    ans = checks_sub.add_parser("answers", help="the known-answer prompts sent --concurrency at "
                                "once: every answer must match its pattern")
    add_server_args(ans)
    ans.add_argument("--known", required=True,
                     help='JSON list of {"prompt": ..., "expect": regex} (verify_known_answers)')
    ans.add_argument("--max-tokens", type=tokens, default=64,
                     help="max output tokens per answer (default 64)")
    ans.add_argument("--output", help="report JSON to write")
    ans.set_defaults(func=handler)
    nd = checks_sub.add_parser("needle", help="a fact at several depths of a long context, per "
                               "tier: each answer must hold it; tok/s and acceptance per tier")
    add_server_args(nd)
    nd.add_argument("--tiers", type=_tiers, required=True,
                    help="context lengths in tokens, ascending, comma-separated (at most the "
                         "served max_model_len less --max-tokens)")
    nd.add_argument("--expect", choices=("found", "any"), default="found",
                    help="found: fail when an answer lacks the fact; any: measure only (a model "
                         "that cannot read, such as the simulation's random one)")
    nd.add_argument("--max-tokens", type=tokens, default=NEEDLE_ANSWER_TOKENS,
                    help=f"max output tokens per answer (default {NEEDLE_ANSWER_TOKENS})")
    nd.add_argument("--output", help="report JSON to write")
    nd.set_defaults(func=handler)
    nm = checks_sub.add_parser("needle-metrics", help="a needle report's figures per tier as "
                               "gauges in the node exporter's textfile folder")
    nm.add_argument("--report", required=True, help="the needle check's --output")
    nm.add_argument("--unit", required=True, help="the served unit (a label and the file name)")
    nm.add_argument("--method", required=True,
                    help="the method label the report was measured with (ngram+int8_lm_head)")
    nm.add_argument("--dir", required=True,
                    help="the textfile folder (writes sparkspec-needle.UNIT+METHOD.prom)")
    nm.add_argument("--json", action="store_true", help="print a final JSON line")
    nm.set_defaults(func=_metrics)
