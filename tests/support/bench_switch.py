"""`invoke bench.switch`: what a method switch costs beyond vLLM's own stop and start,
and what a no-op provision costs, measured on a host of an inventory (the simulated Spark by
default), several times, with the spread.

A switch is `invoke deploy --method M --skip-tags verify`, timed from the command's start to its
end. The unit's journal (systemd's own structured messages, by MESSAGE_ID) gives vLLM's share of it:
stop = "Stopping" to "Stopped" of the unit, start = "Starting" to vLLM's "Application startup
complete" (the moment /health can answer). Overhead = wall - stop - start: what Ansible and
sparkspec add. A no-op provision is `invoke provision --skip-tags verify` on a host that already
serves the inventory's method; it must report changed=0, else its time means nothing and the bench
says so.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparkspec.argtypes import positive_int
from sparkspec.cli.common import Parser
from sparkspec.errors import RunFailure, UserError

ROOT = Path(__file__).resolve().parents[2]
INVOKE = str(Path(sys.executable).with_name("invoke"))
# systemd's catalog ids (systemd/sd-messages.h): job start/stop of a unit and their completion
STARTING, STOPPING, STOPPED = ("7d4958e842da4a758f6c1cdc7b36dcc5",
                               "de5b426a63be47a7b6ac3eaac82e2f6f",
                               "9d1aaa27d60140bd96365438aad20286")
READY = "Application startup complete"   # uvicorn's line once vLLM's API server serves /health


@dataclass
class Switch:
    method: str
    wall_s: float
    stop_s: float
    start_s: float
    # vLLM's parser checked the command line (first switch to it with this vLLM), not the cache
    parsed: bool

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.stop_s - self.start_s


def _invoke(*args: str) -> tuple[float, str]:
    start = time.monotonic()
    proc = subprocess.run([INVOKE, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    took = time.monotonic() - start
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:] or ["no output"]
        raise RunFailure(f"invoke {' '.join(args)} failed: {tail[0]}")
    return took, proc.stdout


def _changed(stdout: str) -> int:
    """sparkspec's own summary line (`sparkspec: <playbook> on <host>: changed=N`), the last of the
    output."""
    last = [line for line in stdout.splitlines() if line.startswith("sparkspec: ")][-1]
    return int(last.rpartition("changed=")[2])


def _journal(host, unit: str, since_us: int) -> list[dict]:
    out = host.as_root(f"journalctl -u {shlex.quote(unit + '.service')} -o json --no-pager "
                       f"--since @{since_us / 1e6:.6f}").stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _vllm_share(entries: list[dict]) -> tuple[float, float]:
    """(stop, start) in seconds from the unit's journal entries of one switch."""
    def first(pred, after: int = 0) -> int:
        for e in entries:
            t = int(e["__REALTIME_TIMESTAMP"])
            if t >= after and pred(e):
                return t
        raise RunFailure("the unit's journal lacks a stop/start of the switch; "
                         "is the unit's journal kept?")

    stopping = first(lambda e: e.get("MESSAGE_ID") == STOPPING)
    stopped = first(lambda e: e.get("MESSAGE_ID") == STOPPED, stopping)
    starting = first(lambda e: e.get("MESSAGE_ID") == STARTING, stopped)
    ready = first(lambda e: READY in str(e.get("MESSAGE", "")), starting)
    return (stopped - stopping) / 1e6, (ready - starting) / 1e6


def _host_now_us(host) -> int:
    return int(host.as_root("date +%s%6N").stdout.strip())


def _accepted(host) -> int:
    """How many command lines the host's vLLM accepted so far (the deploy role's cache of its parser
    check)."""
    folder = f"{host.vars.get('sparkspec_home') or '/opt/sparkspec'}/state/vllm-args-accepted"
    out = host.as_root(f"ls -1 {shlex.quote(folder)} 2>/dev/null || true").stdout
    return len(out.split())


def measure(inventory: str, name: str, to: str, back: str, repeats: int) -> dict:
    from tasks.lib.remote import connect

    host = connect(inventory, name, extra_vars=("sparkspec_unit_name", "sparkspec_home"))
    unit = host.vars.get("sparkspec_unit_name") or "sparkspec-vllm"
    common = ["--host", name, "--inventory", inventory]
    # start from `back`, serving
    _invoke("deploy", *common, "--method", back, "--skip-tags", "verify")
    switches: list[Switch] = []
    for _ in range(repeats):
        for method in (to, back):
            since, accepted = _host_now_us(host), _accepted(host)
            wall, _out = _invoke("deploy", *common, "--method", method, "--skip-tags", "verify")
            stop, start = _vllm_share(_journal(host, unit, since))
            switches.append(Switch(method, wall, stop, start, parsed=_accepted(host) > accepted))
    # settles what the switches left (their record)
    _invoke("provision", *common, "--skip-tags", "verify")
    provisions = []
    for _ in range(repeats):
        wall, out = _invoke("provision", *common, "--skip-tags", "verify")
        provisions.append({"wall_s": wall, "changed": _changed(out)})
    return {"host": name, "switches": [s.__dict__ | {"overhead_s": s.overhead_s} for s in switches],
            "noop_provisions": provisions}


def _spread(values: list[float]) -> str:
    return (f"median {statistics.median(values):.1f} s "
            f"(min {min(values):.1f}, max {max(values):.1f}, n={len(values)})")


def summary(result: dict) -> list[str]:
    sw = result["switches"]
    lines = [f"bench.switch on {result['host']}:",
             f"  switch wall           {_spread([s['wall_s'] for s in sw])}",
             f"  vLLM stop             {_spread([s['stop_s'] for s in sw])}",
             f"  vLLM start to ready   {_spread([s['start_s'] for s in sw])}",
             f"  switch overhead       {_spread([s['overhead_s'] for s in sw])}   (goal <= 10 s)"]
    parsed = [s["overhead_s"] for s in sw if s["parsed"]]
    if parsed:
        lines.append("    of which the first switch to a command line "
                     f"(vLLM's parser ran, then cached): {_spread(parsed)}")
    prov = result["noop_provisions"]
    changed = [p["changed"] for p in prov]
    lines.append(f"  no-op provision       {_spread([p['wall_s'] for p in prov])}   (goal <= 30 s; "
                 f"changed={changed})")
    if any(changed):
        lines.append("  warning: a provision changed something, so it was not a no-op; "
                     "its time is not the no-op's")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="sparkspec-bench-switch", description=__doc__.splitlines()[0])
    parser.add_argument("--inventory", default="inventories/sim")
    parser.add_argument("--host", default="sim01")
    parser.add_argument("--to", default="ngram", help="the method switched to (and back from)")
    parser.add_argument("--back", default="baseline",
                        help="the method switched back to (served at the end)")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--output", type=Path, default=None, help="write the raw figures as JSON")
    args: argparse.Namespace = parser.parse_args(argv)
    return run(lambda: measure(args.inventory, args.host, args.to, args.back, args.repeats),
               summary, args.output)


def run(bench: Callable[[], dict], summary: Callable[[dict], list[str]],
        output: Path | None) -> int:
    """Runs a bench, prints its summary and writes its raw figures (a UserError: one line, exit
    code)."""
    try:
        result = bench()
    except UserError as exc:
        print(f"sparkspec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print("\n".join(summary(result)))
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
