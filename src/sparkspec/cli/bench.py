"""Subcommands of the verify side: ``bench``, ``check-output`` and ``check`` (``report`` moved to
the controller).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import sparkspec.cli.answers as answers_cli
from sparkspec.argtypes import number, share, temperature
from sparkspec.bench.client import MAX_TOKENS, RESULT_FORMAT
from sparkspec.bench.suites import file_of
from sparkspec.cli.common import emit_json
from sparkspec.errors import UserError
from sparkspec.outputs import Output, check_outputs, json_format, write_outputs
from sparkspec.validate import open_regular

KEY_ENV = "SPARKSPEC_API_KEY"
MAX_KEY_BYTES = 4096
_KEY_RE = re.compile(r"[\x21-\x7e]+")  # visible ASCII: what an HTTP header carries as is
_KEY_FIX = ("put the key alone on one line in a file (chmod 600) and pass --api-key-file FILE, or "
            f"set ${KEY_ENV}")
MAX_CONCURRENCY = 256  # requests in flight: vLLM's default max_num_seqs; each holds a socket
MAX_REQUESTS = 100_000  # per suite
MIN_TIMEOUT, MAX_TIMEOUT = 0.001, 86_400.0  # seconds per request
MAX_LABEL = 256  # characters of --model, --method, --unit


def check_url(url: str) -> str:
    """``http(s)://host[:port]`` (a trailing '/' allowed), else a UserError naming --url and the
    fix."""
    fix = "give http(s)://host[:port], e.g. http://127.0.0.1:8000"
    if not url or len(url) > 2048 or not url.isprintable() or any(c.isspace() for c in url):
        raise UserError(f"--url {url!r:.80}: not a URL; {fix}")
    parts = urlsplit(url)
    if "@" in parts.netloc:  # never echo it: it holds a password
        raise UserError(f"--url <hidden>: holds credentials (user:password@); {fix}, and the key "
                        "with --api-key-file")
    # never echo the query or fragment: they may hold a key
    if parts.query or parts.fragment or "?" in url or "#" in url:
        raise UserError(f"--url {parts.scheme}://{parts.netloc}{parts.path}: has a query string or "
                        f"fragment (not shown); {fix}, and the key with --api-key-file")
    try:
        port = parts.port
    except ValueError:
        raise UserError(f"--url {url}: the port is not a number from 1 to 65535; "
                        f"{fix}") from None
    if (parts.scheme not in ("http", "https") or not parts.hostname or port == 0
            or parts.path not in ("", "/")):
        raise UserError(f"--url {url}: not http(s)://host[:port]; {fix}")
    return url.rstrip("/")


def check_label(value: str, flag: str) -> str:
    """A name recorded in results and reports (model, method, unit): 1-256 printable
    characters."""
    if not value or len(value) > MAX_LABEL or not value.isprintable():
        raise UserError(f"{flag} {value!r:.60}: must be 1 to {MAX_LABEL} printable characters")
    return value


def _check_key(key: str, where: str) -> str:
    if not key:
        raise UserError(f"{where} is empty; {_KEY_FIX}")
    if "\n" in key:
        raise UserError(f"{where} holds more than one line; {_KEY_FIX}")
    if not _KEY_RE.fullmatch(key):  # never quote the key
        raise UserError(f"{where} holds characters other than visible ASCII; {_KEY_FIX}")
    return key


def read_api_key(path: str) -> str:
    """The key in ``path`` (one trailing newline dropped): a regular file that other users cannot
    read."""
    fd = open_regular(path, "API key file")
    try:
        st = os.fstat(fd)  # the mode of the file opened, not of whatever the path names later
        if st.st_mode & stat.S_IROTH:
            raise UserError(f"{path}: the API key file is readable by every user (mode "
                            f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 {path} (or 640 for the "
                            "service's group)")
        if st.st_size > MAX_KEY_BYTES:
            raise UserError(f"{path}: the API key file is {st.st_size} bytes, more than the "
                            f"{MAX_KEY_BYTES} a key can be; give a file holding only the key")
        raw = os.read(fd, MAX_KEY_BYTES + 1)
    finally:
        os.close(fd)
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise UserError(f"{path}: the API key file holds characters other than visible ASCII; "
                        f"{_KEY_FIX}") from None
    return _check_key(text.removesuffix("\n"), f"{path}: the API key file")


def api_key(path: str | None) -> str | None:
    """The key from ``--api-key-file``, else from the environment (empty or unset: no key)."""
    if path is not None:
        return read_api_key(path)
    value = os.environ.get(KEY_ENV)
    return _check_key(value, f"${KEY_ENV}") if value else None


class _KeyOnArgv(argparse.Action):
    """``--api-key`` is refused without quoting its value: a key on the command line shows in
    ``ps``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error("--api-key is not taken (a key on the command line shows in `ps` and in "
                     f"logs); {_KEY_FIX}")


def arg_type(check: Callable[[str, str], str], flag: str) -> Callable[[str], str]:
    """An argparse type from a ``check(value, flag)`` that raises UserError."""

    def parse(text: str) -> str:
        try:
            return check(text, flag)
        except UserError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{flag} ")) from None

    parse.__name__ = flag.lstrip("-")
    return parse


def json_bytes(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode()


# --- commands ------------------------------------------------------------------------------------

def _bench(args: argparse.Namespace) -> int:
    from sparkspec.bench import client as bench_mod

    out = Output(args.output, "--output", json_format(RESULT_FORMAT),
                 (("--suite", file_of(args.suite)), ("--api-key-file", args.api_key_file)))
    check_outputs([out])
    cfg = bench_mod.BenchConfig(
        url=args.url, model=args.model, suite=args.suite, concurrency=args.concurrency,
        requests=args.requests, max_tokens=args.max_tokens, temperature=args.temperature,
        api_key=api_key(args.api_key_file), method=args.method, unit=args.unit,
        enable_thinking=args.enable_thinking, ignore_eos=args.ignore_eos, timeout=args.timeout,
        extra={**({"profile": args.profile} if args.profile else {}),
               **({"vllm_release": args.vllm_release} if args.vllm_release else {})})
    result = bench_mod.run_bench(cfg)
    write_outputs([(out, json_bytes(result))])
    rate = result["spec_decode_acceptance_rate"]
    print(f"{result['completed']} completed, {result['output_throughput'] or 0:.1f} output tok/s, "
          f"per request {result['per_request_tok_s_mean'] or 0:.1f} avg / "
          f"{result['per_request_tok_s_max'] or 0:.1f} peak tok/s, acceptance "
          f"{'n/a' if rate is None else f'{rate:.1f}%'} -> {args.output}")
    if args.json:
        emit_json({"changed": False, "ok": True, "output": args.output, "partial": False,
                   "output_throughput": result["output_throughput"],
                   "per_request_tok_s_mean": result["per_request_tok_s_mean"],
                   "spec_decode_acceptance_rate": rate})
    return 0


def _check_record(args: argparse.Namespace) -> int:
    from sparkspec.bench import lossless

    out = Output(args.output, "--output", json_format(lossless.FORMAT),
                 (("--suite", file_of(args.suite)), ("--api-key-file", args.api_key_file)))
    check_outputs([out])
    ref = lossless.record(args.url, args.model, args.suite, args.max_tokens,
                          api_key(args.api_key_file), args.method, args.concurrency,
                          args.enable_thinking, args.timeout)
    write_outputs([(out, json_bytes(ref))])
    print(f"recorded {len(ref['outputs'])} greedy outputs (max_tokens {args.max_tokens}) "
          f"-> {args.output}")
    if args.json:
        emit_json({"changed": True, "output": args.output, "outputs": len(ref["outputs"])})
    return 0


def _check_compare(args: argparse.Namespace) -> int:
    from sparkspec.bench import lossless

    out = None if args.output is None else Output(
        args.output, "--output", json_format(lossless.REPORT_FORMAT),
        (("--reference", args.reference), ("--api-key-file", args.api_key_file)))
    check_outputs([out])
    reference = lossless.load_reference(args.reference, args.model)
    report = lossless.run_compare(args.url, args.model, reference, api_key(args.api_key_file),
                                  args.concurrency, args.method, args.timeout)
    ok, summary = lossless.verdict(report, args.min_share, args.require_json)
    report |= {"min_share": args.min_share, "require_json": args.require_json, "passed": ok}
    if out is not None:
        write_outputs([(out, json_bytes(report))])
    print(summary, file=sys.stdout if ok else sys.stderr)
    if args.json:
        emit_json({"changed": False, "passed": ok, "share": report["share"],
                   "identical": report["identical"], "total": report["total"],
                   "json_parse_failures": report["json_parse_failures"]})
    return 0 if ok else 1


def _check_run(args: argparse.Namespace) -> int:
    from sparkspec.bench import checks

    command = args.check_command
    fmt = (checks.PREFIX_FORMAT if command == "prefix-cache" else checks.TOOL_FORMAT
           if command == "tool-call" else answers_cli.report_format(command))
    reads = (("--api-key-file", args.api_key_file),) + (
        answers_cli.inputs(args) if command in answers_cli.CHECKS else ())
    out = None if args.output is None else Output(args.output, "--output", json_format(fmt), reads)
    check_outputs([out])
    key = api_key(args.api_key_file)
    if command == "prefix-cache":
        report = checks.prefix_cache(args.url, args.model, args.expect == "on", key, args.method,
                                     args.prompt_tokens, args.timeout)
        ok, summary = checks.verdict_prefix(report)
        figures = {"repeat_hits": report["repeat_hits"], "repeat_queries": report["repeat_queries"],
                   "expected": report["expected"]}
    elif command == "tool-call":
        report = checks.tool_call(args.url, args.model, key, args.method, args.parser,
                                  args.max_tokens, args.timeout)
        ok, summary = checks.verdict_tool(report)
        figures = {"parser": report["parser"]}
    else:
        report, ok, summary, figures = answers_cli.run(args, key)
    report |= {"passed": ok, "summary": summary}
    if out is not None:
        write_outputs([(out, json_bytes(report))])
    print(summary, file=sys.stdout if ok else sys.stderr)
    if args.json:
        emit_json({"changed": False, "passed": ok, "summary": summary, **figures})
    return 0 if ok else 1


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, type=arg_type(lambda v, f: check_url(v), "--url"),
                   help="server base URL, http(s)://host[:port], e.g. http://127.0.0.1:8000")
    p.add_argument("--model", required=True, type=arg_type(check_label, "--model"),
                   help="served model name")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="file holding the server's API key (chmod 600 or 640; default: "
                        f"${KEY_ENV})")
    p.add_argument("--api-key", nargs="?", action=_KeyOnArgv, help=argparse.SUPPRESS)
    p.add_argument("--enable-thinking", action="store_true",
                   help="leave thinking on (default: off)")
    p.add_argument("--timeout", type=number(float, MIN_TIMEOUT, MAX_TIMEOUT), default=600.0,
                   help="deadline of each request in seconds, first byte to last (default 600)")
    p.add_argument("--concurrency", type=number(int, 1, MAX_CONCURRENCY), default=1,
                   help=f"requests in flight, 1 to {MAX_CONCURRENCY} (default 1)")
    p.add_argument("--method", type=arg_type(check_label, "--method"),
                   help="method serving now (recorded)")
    p.add_argument("--json", action="store_true", help="print a final JSON line")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    tokens = number(int, 1, MAX_TOKENS)
    bench = sub.add_parser("bench",
                           help="benchmark a served model (streamed chat completions + /metrics)")
    _add_server_args(bench)
    bench.add_argument("--suite", default="all",
                       help="structured | open | agent | all | PATH.jsonl (default all)")
    bench.add_argument("--requests", type=number(int, 1, MAX_REQUESTS),
                       help="requests per suite (default: each prompt once)")
    bench.add_argument("--max-tokens", type=tokens, default=256,
                       help="max output tokens per request")
    bench.add_argument("--temperature", type=temperature, default=0.0,
                       help="sampling temperature, always sent (default 0)")
    bench.add_argument("--ignore-eos", action="store_true",
                       help="generate max-tokens every request")
    bench.add_argument("--unit", type=arg_type(check_label, "--unit"),
                       help="systemd unit serving it (recorded)")
    bench.add_argument("--output", required=True, help="result JSON file")
    bench.add_argument("--profile", type=arg_type(check_label, "--profile"),
                       help="profile serving now (recorded)")
    bench.add_argument("--vllm-release", type=arg_type(check_label, "--vllm-release"),
                       help="vLLM release serving now (recorded; invoke upgrade compares by it)")
    bench.set_defaults(func=_bench)

    check = sub.add_parser("check-output",
                           help="lossless check: greedy outputs of a method vs baseline's")
    check_sub = check.add_subparsers(dest="check_command", metavar="ACTION", required=True)
    rec = check_sub.add_parser("record", help="record baseline's greedy outputs as the reference")
    _add_server_args(rec)
    rec.add_argument("--suite", default="all",
                     help="structured | open | agent | all | PATH.jsonl (default all)")
    rec.add_argument("--max-tokens", type=tokens, default=128,
                     help="max output tokens per prompt (default 128)")
    rec.add_argument("--output", required=True, help="reference JSON to write")
    rec.set_defaults(func=_check_record, method="baseline")
    cmp_ = check_sub.add_parser("compare",
                                help="compare a method's greedy outputs with the reference")
    _add_server_args(cmp_)
    cmp_.add_argument("--reference", required=True,
                      help="reference JSON from `check-output record`")
    cmp_.add_argument("--min-share", type=share, default=1.0,
                      help="fail (exit 1) below this share of identical outputs, 0 to 1 "
                           "(default 1.0)")
    cmp_.add_argument("--require-json", action="store_true",
                      help="fail when a JSON-asking prompt's output does not parse (off by "
                           "default: a random tiny model never writes JSON)")
    cmp_.add_argument("--output", help="report JSON to write")
    cmp_.set_defaults(func=_check_compare)

    checks = sub.add_parser("check", help="checks of silent regressions: prefix-cache hits, a "
                            "tool-call round trip, answers under concurrency, a needle per "
                            "context tier")
    checks_sub = checks.add_subparsers(dest="check_command", metavar="CHECK", required=True)
    pc = checks_sub.add_parser("prefix-cache", help="a long prompt sent twice: the repeat must hit "
                               "the prefix cache where caching is expected on "
                               "(vllm:prefix_cache_* counters)")
    _add_server_args(pc)
    pc.add_argument("--expect", choices=("on", "off"), required=True,
                    help="on: fail unless the repeat hits; off: report the hits, check nothing")
    pc.add_argument("--prompt-tokens", type=number(int, 64, MAX_TOKENS), default=4096,
                    help="size of the prompt in tokens, at most the served context less 64 "
                         "(default 4096)")
    pc.add_argument("--output", help="report JSON to write")
    pc.set_defaults(func=_check_run)
    tc = checks_sub.add_parser("tool-call", help="a forced tool call, streaming and not: exactly "
                               "one call to the tool with arguments that parse and hold its "
                               "required keys")
    _add_server_args(tc)
    tc.add_argument("--parser", type=arg_type(check_label, "--parser"),
                    help="the unit's --tool-call-parser (recorded in the report)")
    tc.add_argument("--max-tokens", type=tokens, default=256,
                    help="max output tokens per request (default 256)")
    tc.add_argument("--output", help="report JSON to write")
    tc.set_defaults(func=_check_run)
    answers_cli.register(checks_sub, _add_server_args, _check_run)
