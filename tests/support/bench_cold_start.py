"""`invoke bench.cold-start`: cold starts (compile-cache folder emptied) against warm restarts of
a host's served command line, timed as the deploy times them, with the spread
(docs/operate.md#cold-start)."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from sparkspec.argtypes import positive_int
from sparkspec.cli.common import Parser
from sparkspec.errors import RunFailure, UserError
from sparkspec.operate import startup
from tests.support.bench_switch import run

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
FOLDER = re.compile(r"/[\w./-]+/[0-9a-f]{16}\Z")


def _deploy(inventory: str, name: str, method: str, serve: dict | None) -> None:
    argv = ([str(BIN / "ansible-playbook"), "-i", inventory, "--limit", name,
             f"playbooks/deploy-{method}.yml", "--skip-tags", "verify"]
            + (["-e", json.dumps({"sparkspec_serve": serve})] if serve else []))
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = [ln for ln in proc.stdout.splitlines() if "msg" in ln][-1:] or ["no message"]
        raise RunFailure(f"the deploy of {method} on {name} failed: {tail[0].strip()}")


def _start(host, unit: str, record: dict, cold: bool) -> dict:
    folder = record["compile_cache"]["folder"]
    if cold:
        host.as_root(f"systemctl stop {shlex.quote(unit)} && rm -rf -- {shlex.quote(folder)}")
    host.as_root(f"systemctl restart {shlex.quote(unit)}")
    home = host.vars.get("sparkspec_home") or "/opt/sparkspec"
    argv = [f"{record['venv']}/bin/python", f"{home}/libexec/wait_healthy.py", record["url"], unit,
            "1800", "2"]
    for pattern in startup.patterns():
        argv += ["--startup", pattern]
    out = host.as_root(" ".join(shlex.quote(a) for a in argv)).stdout
    found = [ln.removeprefix("startup: ") for ln in out.splitlines() if ln.startswith("startup: ")]
    if not found:
        raise RunFailure(f"{unit} did not become healthy: {out.strip()[-300:]}")
    doc = json.loads(found[-1])
    return startup.report(doc["start_us"], doc["lines"], doc["healthy_us"])


def measure(inventory: str, name: str, repeats: int, compile_: bool) -> dict:
    from tasks.lib.remote import connect

    host = connect(inventory, name,
                   extra_vars=("sparkspec_unit_name", "sparkspec_home", "sparkspec_serve"))
    unit = str(host.vars.get("sparkspec_unit_name") or "sparkspec-vllm")

    def record() -> dict:
        doc = json.loads(host.as_root(f"cat /etc/sparkspec/{shlex.quote(unit)}.json").stdout
                         or "{}")
        if not FOLDER.match(str((doc.get("compile_cache") or {}).get("folder", ""))):
            raise UserError(f"{name}: {unit} keeps no compile cache of its own "
                            "(deploy_compile_cache_dir is \"\" or the unit predates it); "
                            "deploy with the default deploy_compile_cache_dir")
        return doc

    method = str(json.loads(host.as_root(f"cat /etc/sparkspec/{shlex.quote(unit)}.json").stdout
                            or "{}").get("method") or "baseline")
    if compile_:
        _deploy(inventory, name, method,
                {**(host.vars.get("sparkspec_serve") or {}), "enforce_eager": False})
    try:
        rec = record()
        pairs = [{"cold": _start(host, unit, rec, cold=True),
                  "warm": _start(host, unit, rec, cold=False)} for _ in range(repeats)]
    finally:
        if compile_:
            _deploy(inventory, name, method, None)
    return {"host": name, "method": method, "key": rec["compile_cache"]["key"], "pairs": pairs}


def _spread(values: list[float], unit: str = " s") -> str:
    return (f"median {statistics.median(values):.2f}{unit} "
            f"(min {min(values):.2f}, max {max(values):.2f}, n={len(values)})")


def summary(result: dict) -> list[str]:
    pairs = result["pairs"]
    lines = [f"bench.cold-start on {result['host']} "
             f"({result['method']}, cache folder {result['key']}):"]
    for phase in ("ready", "compile"):
        for kind in ("cold", "warm"):
            values = [p[kind][f"{phase}_s"] for p in pairs if p[kind][f"{phase}_s"] is not None]
            if values:
                lines.append(f"  {kind} {phase:<8} {_spread(values)}")
    ratios = [p["warm"]["ready_s"] / p["cold"]["ready_s"] for p in pairs
              if p["warm"]["ready_s"] and p["cold"]["ready_s"]]
    if ratios:
        lines.append(f"  warm/cold READY {_spread(ratios, '')}   "
                     "(each warm start over the cold one before)")
    states = {kind: sorted({str(p[kind]["compile_cache"]) for p in pairs
                            if p[kind]["compile_cache"]}) for kind in ("cold", "warm")}
    lines.append("  compile cache: " + (f"cold {', '.join(states['cold'])}; warm "
                                        f"{', '.join(states['warm'])}"
                                        if states["cold"] or states["warm"] else
                                        "none reported (the command line compiles nothing: "
                                        "enforce_eager)"))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="sparkspec-bench-cold-start", description=__doc__.splitlines()[0])
    parser.add_argument("--inventory", default="inventories/sim")
    parser.add_argument("--host", default="sim01")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="serve without --enforce-eager for the bench "
                             "(the simulated Spark serves eager)")
    parser.add_argument("--output", type=Path, default=None, help="write the raw figures as JSON")
    args: argparse.Namespace = parser.parse_args(argv)
    return run(lambda: measure(args.inventory, args.host, args.repeats, args.compile), summary,
               args.output)


if __name__ == "__main__":
    raise SystemExit(main())
