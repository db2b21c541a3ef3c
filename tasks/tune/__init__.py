"""`invoke tune`: measure a method at several k, predict every k from the k_max run alone, check the
prediction against the k measured, write the report, and put back what served before. ``--apply``
writes the best k.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from invoke import Exit, task

import tasks.tune.apply as tune_apply
import tasks.tune.fit as tune_fit
import tasks.tune.plan as tune_plan
import tasks.tune.report as tune_report
from sparkspec import registry
from sparkspec.errors import UserError
from sparkspec.jsonfile import loads_bounded
from tasks.host import method_playbook, run_play
from tasks.lib.cluster_target import Target, resolve_target
from tasks.lib.common import ROOT, ask_become_pass, fail, inventory_of, require_host
from tasks.lib.remote import connect
from tasks.lib.status import host_status
from tasks.report import load_result

REPORTS = ROOT / "reports" / "tune"


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host, or a cluster's group",
    "method": "the method to tune (one that drafts: ngram, mtp, eagle3, dflash or the inventory's)",
    "profile": "a profile the host stages (default: the inventory's), e.g. the one with MTP "
               "tensors",
    "k": "-k: the k to measure, e.g. 1,2,4 or 1-6 (the largest is k_max, the run the prediction "
         "comes from)",
    "k-max": "measure baseline and this k only, and predict every k up to it (default: the "
             "method's k)",
    "suite": "structured, open, agent or all (default all)",
    "prompts": "your own prompts instead of a suite (JSON lines, the bench suites' format)",
    "requests": "requests per suite (default: each prompt once)",
    "concurrency": "comma-separated levels, e.g. 1,4 (the best k per level, and vLLM's batch-size "
                   "schedule)",
    "temperature": "sampling temperature you serve at (default 0)",
    "thinking": "leave the model's thinking on (default off)",
    "max-tokens": "max output tokens per request (default: the verify role's)",
    "apply": "write the best k into the inventory (sparkspec_num_speculative_tokens) and print the "
             "diff",
    "inventory": "inventory folder (default from invoke.yaml)"})
def tune(c, host=None, method=None, profile="", k="", k_max="", suite="all", prompts="",
         requests="", concurrency="1", temperature="0", thinking=False, max_tokens="", apply=False,
         inventory=None):
    """Choose k for a method on your workload: baseline and k_max measured, every k predicted.

    Every k up to k_max is predicted from the k_max run's per-position acceptance, each other k of
    -k measured to check the prediction. Restores what served before. Report:
    reports/<head>/tune-<method>.{md,png}, figures in reports/<head>/tune/<method>.json."""
    inv = require_host(c, host, inventory, many=True)
    assert host is not None
    if not method:
        raise Exit("sparkspec: error: --method is required; name the method to tune, e.g. "
                   "--method mtp", code=2)
    # an unknown method: one line naming the known ones
    method_playbook(c, method, inventory, host)
    names = tuple(f"sparkspec_{key}" for key in registry.CONTRACT_KEYS)
    try:
        target = resolve_target(inv, host)
        values = inv.host_vars(target.head, names)
        profile = tune_plan.staged_profile(values, profile)
        resolved = tune_plan.method_spec(values, method, profile, target.placement)
        spec = resolved["speculative_config"]
        head = _head_config(c, inventory, target.head, spec) if spec["method"] == "dflash" else None
        block = (tune_plan.block_limit(head) + 1) if head is not None else None
        ks = tune_plan.parse_ks(k, k_max, int(spec["num_speculative_tokens"]),
                                tune_plan.block_limit(head))
        levels = tune_plan.parse_levels(str(concurrency))
        load = tune_plan.workload(suite, prompts, requests, temperature, thinking, max_tokens)
        plan = tune_plan.rows(method, ks, levels)
        tune_plan.check_names(plan, target.head,
                              target.pattern if target.placement is not None else None)
        targets = tune_report.outputs(str(ROOT / "reports" / target.head), method)
        # the rows' results are deleted and written there
        for folder in (REPORTS, REPORTS / target.head):
            if folder.is_symlink():
                raise UserError(f"{folder}: a symbolic link; remove it (tune keeps each row's "
                                "results there)")
        now = host_status(inventory_of(c, inventory), target.head,
                          ask_become_pass=ask_become_pass(c))
        before = tune_plan.restore_of(values, target.head, asdict(now), target.placement)
    except UserError as exc:
        raise fail(exc) from None
    tuned = dict(values.get("sparkspec_num_speculative_tokens") or {})
    for row in plan:   # this run's files only: a row that does not run leaves no old result behind
        _result(target, row).unlink(missing_ok=True)
    print(f"sparkspec: tune {method} on {target.pattern}: k {', '.join(map(str, ks))} "
          f"(k_max {ks[-1]}), concurrency {', '.join(map(str, levels))}, {len(plan)} measurements")
    settings = {"suite": load.suite, "prompts": load.prompts or "-",
                "requests": load.requests or "each once",
                "temperature": load.temperature, "thinking": "on" if load.thinking else "off",
                "profile": profile, "levers": "+".join(resolved["levers"]) or "none",
                "k measured": ",".join(map(str, ks))}
    failure: BaseException | None = None
    try:
        # baseline that serves already, healthy, on this profile: its row needs no switch, only
        # verify
        serving = (before.method == "baseline" and before.profile == profile
                   and tuple(now.levers) == tuple(resolved["levers"]))
        _sweep(c, inventory, target, plan, profile, tuned, load, serving,
               (tuple(resolved["levers"]), values.get("sparkspec_levers")))
    except (Exit, KeyboardInterrupt) as exc:
        failure = exc
    try:   # what served before, at its own k, whatever happened (a failed row, Ctrl-C)
        _restore(c, inventory, target, before)
    except (Exit, KeyboardInterrupt):
        if isinstance(failure, Exit):   # the row's own error first: the restore's follows
            print(failure.message, file=sys.stderr)
        raise
    ran = [row for row in plan if _result(target, row).is_file()]
    if failure is not None:   # the rows that ran still predict when baseline and k_max did
        if {(0, levels[0]), (ks[-1], levels[0])} <= {(r.k, r.concurrency) for r in ran}:
            _write(targets, method, target, settings, ran, ks[-1], levels, block, after_error=True)
        raise failure
    found = _write(targets, method, target, settings, plan, ks[-1], levels, block)
    if apply:
        _apply(inv.path, target, method, found, tuned)


def _write(targets: list[Any], method: str, target: Target, settings: dict[str, Any],
           rows: list[tune_plan.Row], k_max: int, levels: list[int], block: int | None,
           after_error: bool = False) -> list[tune_fit.Case]:
    try:
        found = _analyse(target, rows, k_max, levels, block)
        text = tune_report.write(targets, method, target.head, settings, found)
    except (UserError, Exit) as exc:
        if not after_error:
            raise fail(exc) if isinstance(exc, UserError) else exc from None
        print(f"sparkspec: error: {exc}", file=sys.stderr)
        return []
    print(text)
    print(f"sparkspec: tune report{' (the rows that ran)' if after_error else ''}: "
          f"reports/{target.head}/"
          f"tune-{method}.md (plot .png; figures reports/{target.head}/tune/{method}.json)")
    return found


def _head_config(c: Any, inventory: str | None, host: str,
                 spec: dict[str, Any]) -> dict[str, Any]:
    """The DFlash head's config.json on the host (its block size bounds k), read over SSH."""
    remote = connect(inventory_of(c, inventory), host, ask_become_pass=ask_become_pass(c))
    try:
        path = f"{spec['model']}/config.json"
        result = remote.as_root(f"head -c 1048576 -- {shlex.quote(path)}")
    finally:
        remote.close()
    if result.exited != 0:
        raise UserError(f"host {host}: cannot read {path} "
                        f"({result.stderr.strip()[-200:] or 'no output'}); "
                        "provision the DFlash head first (invoke provision --tags checkpoints)")
    try:
        doc = loads_bounded(result.stdout)
    except ValueError as exc:
        raise UserError(f"host {host}: {path} is not JSON ({exc}); re-fetch the head") from None
    if not isinstance(doc, dict):
        raise UserError(f"host {host}: {path} is not a JSON object; re-fetch the head")
    return doc


def _result(target: Target, row: tune_plan.Row) -> Path:
    return REPORTS / target.head / f"{row.name}.json"


def _sweep(c: Any, inventory: str | None, target: Target, plan: list[tune_plan.Row],
           profile: str, tuned: dict[str, Any], load: tune_plan.Workload, baseline_serves: bool,
           levers: tuple[tuple[str, ...], Any]) -> None:
    for row in plan:   # levers: the tuned method's, and the host's own block (its options)
        extra = tune_plan.extra_vars(row, profile, tuned, load, str(REPORTS), *levers)
        what = "baseline" if not row.k else f"{row.method} k={row.k}"
        switch = row.deploy and not (row.k == 0 and baseline_serves)
        print(f"sparkspec: tune: {what}, concurrency {row.concurrency}"
              + ("" if switch else " (verify only: it serves already)"))
        if switch:
            playbook, more = method_playbook(c, row.method if row.k else "baseline", inventory,
                                             target.head)
            run_play(c, playbook, target.pattern, inventory, {**more, **extra})
        else:
            run_play(c, "verify.yml", target.pattern, inventory, extra)


def _restore(c: Any, inventory: str | None, target: Target, before: tune_plan.Restore) -> None:
    print(f"sparkspec: tune: restoring {before.method} ({before.profile}) on {target.pattern}")
    playbook, extra = method_playbook(c, before.method, inventory, target.head)
    run_play(c, playbook, target.pattern, inventory, {**extra, **before.extra}, skip_tags="verify")


def _analyse(target: Target, plan: list[tune_plan.Row], k_max: int, levels: list[int],
             block: int | None) -> list[tune_fit.Case]:
    results: dict[tuple[int, int], dict[str, Any]] = {}
    where: dict[tuple[int, int], str] = {}
    try:
        for row in plan:
            path = _result(target, row)
            results[(row.k, row.concurrency)] = load_result(path)
            where[(row.k, row.concurrency)] = str(path)
        return tune_fit.cases(results, where, k_max, levels, block)
    except UserError as exc:
        raise fail(exc) from None


def _apply(inventory: Path, target: Target, method: str, found: list[tune_fit.Case],
           tuned: dict[str, Any]) -> None:
    best, why = tune_fit.recommend(found)
    if best is None:
        raise Exit(f"sparkspec: error: --apply: {why}; nothing written", code=1)
    group = target.pattern if target.placement is not None else None
    try:
        path, diff = tune_apply.apply(inventory, target.head, group, method, best, tuned,
                                      target.members)
    except UserError as exc:
        raise fail(exc) from None
    print(diff or f"sparkspec: {path} already sets {method}: {best}")
    print(f"sparkspec: --apply: {tune_apply.KEY}.{method} = {best} in {path}; "
          f"the next deploy of {method} serves it ({json.dumps({method: best})})")
