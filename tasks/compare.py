"""`invoke compare`: deploy each row of the plan (tasks.compare_plan) in turn, verify it, restore what ran,
and write one table and plot of the rows (tasks.report)."""

from __future__ import annotations

import sys
from pathlib import Path

from invoke import Exit, task

from sparkspec.errors import UserError
from tasks.common import ROOT, ask_become_pass, fail, inventory_of, require_host
from tasks.compare_plan import CONTRACT, Row, check, parse, plan
from tasks.host import method_playbook, run_play
from tasks.report import write as write_report
from tasks.status import host_status


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host",
    "methods": "comma-separated rows, METHOD or METHOD@PROFILE (a profile the host stages; default the "
               "inventory's), e.g. baseline,ngram,eagle3,dflash,mtp@sim-mtp; each profile gets a baseline "
               "row (its lossless reference)",
    "inventory": "inventory folder (default from invoke.yaml)"})
def compare(c, host=None, methods="baseline,ngram", inventory=None):
    """Deploy each row (method on a profile) in turn: lossless check against baseline on the same profile,
    bench; restore what ran; write one table and plot (reports/<host>/compare.{md,png}) with the /metrics
    figures."""
    inv = require_host(c, host, inventory)
    assert host is not None
    names = tuple(f"sparkspec_{key}" for key in CONTRACT)
    try:
        values = inv.host_vars(host, names)
        rows = plan(parse(methods, values.get("sparkspec_profile", "")))
        check(sorted(rows, key=lambda r: r.added), values)   # the rows asked for first
        now = host_status(inventory_of(c, inventory), host, ask_become_pass=ask_become_pass(c))
    except UserError as exc:
        raise fail(exc) from None
    running = Row(now.method, now.profile or values.get("sparkspec_profile", "")) if now.method else None
    reports = ROOT / "reports" / "compare"
    for row in rows:  # this run's files only: a row that did not run leaves no old result behind
        for old in (reports / host / f"{row.name}.json", reports / host / "lossless" / f"{row.name}.json"):
            old.unlink(missing_ok=True)
    # what serves, healthy: its row needs no switch, only verify
    last = running if now.health == 200 else None
    try:
        for row in rows:
            playbook, extra = method_playbook(c, row.method, inventory, host)
            extra = {**extra, "sparkspec_profile": row.profile, "verify_report_name": row.name,
                     "verify_reports_dir": str(reports),
                     "verify_rerecord_reference": row.method == "baseline"}
            serving = last == Row(row.method, row.profile)
            last = Row(row.method, row.profile)
            print(f"sparkspec: compare on {host}: {row.name}"
                  + (" (the profile's lossless reference)" if row.added else "")
                  + (" (serving: verify only)" if serving else ""))
            run_play(c, "verify.yml" if serving else playbook, host, inventory, extra)
    except Exit:  # the table of the rows that ran, then the row's own error
        ran = [r for r in rows if (reports / host / f"{r.name}.json").is_file()]
        _compare_table(host, reports, ran, after_error=True)
        raise
    finally:  # a row that fails (e.g. the lossless check) must not leave the host on it
        if running and running != last:
            print(f"sparkspec: restoring {running.name} on {host}")
            playbook, extra = method_playbook(c, running.method, inventory, host)
            run_play(c, playbook, host, inventory, {**extra, "sparkspec_profile": running.profile},
                     skip_tags="verify")
    _compare_table(host, reports, rows)


def _compare_table(host: str, reports: Path, rows: list[Row], after_error: bool = False) -> None:
    """compare.md and compare.png under reports/<host>/ from the rows' bench results and lossless reports.
    After a row's error, a table that cannot be written is one line on stderr: the row's error follows."""
    if not rows:
        return
    out = ROOT / "reports" / host
    inputs = [str(reports / host / f"{row.name}.json") for row in rows]
    lossless = [reports / host / "lossless" / f"{row.name}.json" for row in rows]
    try:
        _, text = write_report(inputs, [str(p) for p in lossless if p.is_file()], str(out / "compare.md"),
                               str(out / "compare.png"))
    except UserError as exc:
        if not after_error:
            raise fail(exc) from None
        print(f"sparkspec: error: {exc}", file=sys.stderr)
        return
    print(text)
