"""``sparkspec memfit guard|measure|show|forget``, ``sparkspec watchdog``, ``sparkspec startup``:
operating a deployed unit.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from sparkspec import argtypes
from sparkspec.cli.bench import check_url
from sparkspec.errors import UserError

# the high bound is memfit.MAX_MARGIN_GIB (not imported at registration)
gib = argtypes.number(float, 0.0, float(1 << 20))
seconds = argtypes.positive_float
start_bytes = argtypes.number(int, 0, 1 << 62)
_UNIT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9:_.@\\-]{0,200}")


def unit_name(text: str) -> str:
    """A systemd unit name without its ``.service`` suffix (``vllm``, ``vllm@a``)."""
    name = text.removesuffix(".service")
    if not _UNIT.fullmatch(name):
        raise argparse.ArgumentTypeError(f"{text!r:.60} is not a unit name "
                                         "(letters, digits, ':_.@-')")
    return name


def _key(args: argparse.Namespace) -> str | None:
    from sparkspec.operate import scrape

    return scrape.read_key(args.api_key_file)


def _key_file(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-file", metavar="PATH",
                   help="a file holding the server's API key on one line (else $VLLM_API_KEY)")


def _paths(p: argparse.ArgumentParser) -> None:
    p.add_argument("--unit", required=True, type=unit_name, help="the vLLM unit (e.g. vllm)")
    p.add_argument("--unit-record", required=True, metavar="FILE",
                   help="the unit's record, /etc/sparkspec/UNIT.json (profile, method, k)")
    p.add_argument("--venv", required=True,
                   help="the vLLM venv (its vllm dist-info is part of the key)")
    p.add_argument("--record-dir", required=True, metavar="DIR",
                   help="where the memory records are")


def register(sub: Any) -> None:
    memfit = sub.add_parser("memfit", help="the measured memory fit of vLLM starts")
    msub = memfit.add_subparsers(dest="memfit_command", metavar="SUBCOMMAND", required=True)
    g = msub.add_parser("guard",
                        help="ExecStartPre: refuse a start that MemAvailable cannot hold (exit 1)",
                        description="Exit 0: start. Exit 1: refused, one line naming the numbers. "
                                    "Exit 2: bad input (also refuses the start).")
    _paths(g)
    g.add_argument("--margin-gib", type=gib, default=4.0,
                   help="GiB added to a record's need (default 4)")
    g.add_argument("--floor-gib", type=gib, help="GiB needed, whatever a record says")
    g.add_argument("--measure", metavar="URL",
                   help="without a record: measure this start, URL the server")
    g.add_argument("--api-key-file", metavar="PATH",
                   help="passed on to the measurement as --api-key-file PATH (the path, never the "
                        "key)")
    g.set_defaults(func=_guard)
    m = msub.add_parser("measure", help="record a start's MemAvailable low water (run by the guard "
                                        "in a transient unit)")
    _paths(m)
    m.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    m.add_argument("--start-available", required=True, type=start_bytes, metavar="BYTES",
                   help="MemAvailable before the load, as the guard read it")
    m.add_argument("--interval", type=seconds, default=0.5,
                   help="seconds between samples (default 0.5)")
    m.add_argument("--warmup-s", type=seconds, default=60.0,
                   help="warm-up after /health (default 60)")
    m.add_argument("--timeout", type=seconds, default=3600.0, help="give up after (default 3600 s)")
    _key_file(m)
    m.set_defaults(func=_measure)
    s = msub.add_parser("show", help="every memory record")
    s.add_argument("--record-dir", required=True, metavar="DIR")
    s.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    s.set_defaults(func=_show)
    f = msub.add_parser("forget", help="remove one memory record (the next start measures again)")
    f.add_argument("--record-dir", required=True, metavar="DIR")
    f.add_argument("--key-hash", required=True, metavar="H",
                   help="the record's 32 hex (memfit show)")
    f.set_defaults(func=_forget)

    w = sub.add_parser("watchdog",
                       help="restart a vLLM unit whose engine is stuck (a long-running service)",
                       description="Exit 0 when stopped or when its restart cap is reached; exit 2 "
                                   "for a bad config (one line per bad field).")
    w.add_argument("--unit", required=True, type=unit_name, help="the vLLM unit")
    w.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    w.add_argument("--config", required=True, metavar="FILE", help="the watchdog's JSON config")
    _key_file(w)
    w.set_defaults(func=_watchdog)

    st = sub.add_parser("startup",
                        help="the unit's current start: READY and where the time went (journal)")
    st.add_argument("--unit", default="sparkspec-vllm", type=unit_name, help="the vLLM unit")
    st.add_argument("--json", action="store_true", help="the report as JSON")
    st.set_defaults(func=_startup)


def _guard(args: argparse.Namespace) -> int:
    from sparkspec.operate import memfit

    try:
        url = None if args.measure is None else check_url(args.measure)
    except UserError as exc:   # its message names --url
        raise UserError(str(exc).replace("--url", "--measure", 1)) from None
    return memfit.guard(args.unit, args.unit_record, args.venv, args.record_dir,
                        margin_gib=args.margin_gib, floor_gib=args.floor_gib, measure_url=url,
                        api_key_file=args.api_key_file)


def _measure(args: argparse.Namespace) -> int:
    from sparkspec.operate import memfit
    from sparkspec.operate.measure import measure

    result = measure(args.unit, check_url(args.url), args.unit_record, args.venv, args.record_dir,
                     args.start_available, interval=args.interval, warmup_s=args.warmup_s,
                     timeout=args.timeout, api_key=_key(args))
    memfit.say(result.line)
    return 0 if result.written else 1


def _show(args: argparse.Namespace) -> int:
    from sparkspec.operate import memfit

    found = memfit.records(args.record_dir)
    if args.json:
        print(json.dumps({"record_dir": args.record_dir, "records": found}, sort_keys=True),
              flush=True)
        return 0
    if not found:
        print(f"no memory records in {args.record_dir}")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"memory records in {args.record_dir}")
    table.add_column("key hash", no_wrap=True)
    for column in ("profile/method k, vLLM", "needed", "low water", "KV cache", "measured"):
        table.add_column(column, overflow="fold")
    for rec in found:
        if "error" in rec:
            table.add_row(rec["key_hash"], rec["error"], "", "", "", "")
            continue
        kv = rec.get("kv_cache") or {}
        table.add_row(rec["key_hash"], memfit.describe(rec["key"]),
                      memfit.gib(rec["needed_bytes"]), memfit.gib(rec["low_water_bytes"]),
                      " ".join(f"{k}={v}" for k, v in kv.items() if k != "model_name") or "-",
                      str(rec.get("measured_at", "?")))
    Console(markup=False, highlight=False, width=max(160, Console().width)).print(table)
    return 0


def _forget(args: argparse.Namespace) -> int:
    from sparkspec.operate import memfit

    memfit.say(memfit.forget(args.record_dir, args.key_hash))
    return 0


def _watchdog(args: argparse.Namespace) -> int:
    from sparkspec.operate.watchdog import load_config
    from sparkspec.operate.watchrun import Runner

    url = check_url(args.url)
    cfg, problems = load_config(args.config)
    if cfg is None:
        for line in problems:
            print(f"sparkspec: error: watchdog: {line}", file=sys.stderr)
        return 2
    return Runner(cfg, args.unit, url, _key(args)).run()


def _startup(args: argparse.Namespace) -> int:
    from sparkspec.operate import startup

    doc = startup.current_start(args.unit)
    print(json.dumps(doc, indent=1) if args.json else startup.summary(args.unit, doc))
    return 0
