"""`invoke compare`: deploy each row of the plan (tasks.compare.plan) in turn, verify it, restore
what ran, and write one table and plot of the rows (tasks.report). On a cluster
(tasks.lib.cluster_target) every play runs on the whole group and the head answers: its status, its
results, reports under its name."""

from __future__ import annotations

import sys
from pathlib import Path

from invoke import Exit, task

from sparkspec.bench import suites
from sparkspec.errors import UserError
from tasks.compare.plan import CONTRACT, Row, check, parse, plays, results
from tasks.compare.plan import plan as plan_rows  # the package's `plan` stays the submodule
from tasks.host import method_playbook, run_play
from tasks.lib.cluster_target import Target, resolve_target
from tasks.lib.common import ROOT, ask_become_pass, fail, inventory_of, require_host
from tasks.lib.status import host_status
from tasks.report import write as write_report


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host, or a cluster's group (or all its members, comma-separated)",
    "methods": "comma-separated rows, METHOD[+LEVER...][@PROFILE]: a method with exactly the "
               "levers named, on a profile the host stages (default the inventory's), e.g. "
               "baseline,mtp,mtp+int8_lm_head,mtp@sim-mtp; each profile and lever set gets a "
               "baseline row (its lossless reference)",
    "suite": "the workload of every row: structured, open, agent or all (default: the "
             "inventory's verify_suite, all); the report has a row per suite",
    "inventory": "inventory folder (default from invoke.yaml)"})
def compare(c, host=None, methods="baseline,ngram", suite="", inventory=None):
    """Deploy each row (a method with its levers, on a profile) in turn: lossless check, bench.

    The lossless check is against baseline on the same profile with the same levers. Then restore
    what ran and write one table and plot (reports/<host>/compare.{md,png}) with the /metrics
    figures. A cluster runs each play on every node and is measured through its head
    (reports/<head>/)."""
    if suite and suite not in (*suites.BUILTIN, "all"):
        raise Exit(f"sparkspec: error: --suite {suite[:40]!r} is not one of "
                   f"{', '.join((*suites.BUILTIN, 'all'))}", code=2)
    inv = require_host(c, host, inventory, many=True)
    assert host is not None
    names = tuple(f"sparkspec_{key}" for key in CONTRACT)
    try:
        target = resolve_target(inv, host)
        values = inv.host_vars(target.head, names)
        rows = plan_rows(parse(methods, values.get("sparkspec_profile", "")))
        # the rows asked for first
        check(sorted(rows, key=lambda r: r.added), values, target.placement)
        now = host_status(inventory_of(c, inventory), target.head,
                          ask_become_pass=ask_become_pass(c))
    except UserError as exc:
        raise fail(exc) from None
    where = (target.head if target.placement is None
             else f"{target.pattern} (head {target.head})")
    running = Row(now.method, now.profile or values.get("sparkspec_profile", ""),
                  tuple(now.levers)) if now.method else None
    # the host's record is not trusted: what the restore deploys again must be the inventory's
    if running and (not isinstance(running.profile, str)
                    or running.profile not in (values.get("sparkspec_profiles") or {})):
        raise fail(UserError(f"{target.head}'s record says it serves profile "
                             f"{str(running.profile)[:64]!r}, which the inventory does not define; "
                             "deploy a method first (invoke deploy "
                             f"--host {target.head} --method baseline)"))
    reports = ROOT / "reports" / "compare"
    for row in rows:  # this run's files only: a row that did not run leaves no old result behind
        for old in results(target, reports, row):
            old.unlink(missing_ok=True)
    # what serves, healthy: its row needs no switch, only verify
    last = running if now.health == 200 else None
    try:
        for play in plays(target, rows, last, reports, values.get("sparkspec_levers")):
            row = play.row
            playbook, extra = method_playbook(c, row.method, inventory, target.head)
            last = row
            print(f"sparkspec: compare on {where}: {row.name}"
                  + (" (the profile's lossless reference)" if row.added else "")
                  + (" (serving: verify only)" if play.verify_only else ""))
            run_play(c, "verify.yml" if play.verify_only else playbook, play.hosts, inventory,
                     {**extra, **play.extra, **({"verify_suite": suite} if suite else {})})
    except Exit:  # the table of the rows that ran, then the row's own error
        ran = [r for r in rows if results(target, reports, r)[0].is_file()]
        _compare_table(target, reports, ran, after_error=True)
        raise
    finally:  # a row that fails (e.g. the lossless check) must not leave the target on it
        if running and not running.serves(last):
            print(f"sparkspec: restoring {running.name} on {where}")
            playbook, extra = method_playbook(c, running.method, inventory, target.head)
            run_play(c, playbook, target.pattern, inventory,
                     {**extra, "sparkspec_profile": running.profile}, skip_tags="verify")
    _compare_table(target, reports, rows)


def _compare_table(target: Target, reports: Path, rows: list[Row],
                   after_error: bool = False) -> None:
    """compare.md and compare.png under reports/<head>/ from the rows' bench results and lossless
    reports. After a row's error, a table that cannot be written is one line on stderr: the row's
    error follows."""
    if not rows:
        return
    out = ROOT / "reports" / target.head
    inputs = [str(results(target, reports, row)[0]) for row in rows]
    lossless = [results(target, reports, row)[1] for row in rows]
    try:
        _, text = write_report(inputs, [str(p) for p in lossless if p.is_file()],
                               str(out / "compare.md"), str(out / "compare.png"))
    except UserError as exc:
        if not after_error:
            raise fail(exc) from None
        print(f"sparkspec: error: {exc}", file=sys.stderr)
        return
    print(text)
