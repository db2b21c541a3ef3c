"""`invoke upgrade` and `invoke rollback`: another vLLM release beside the serving one, switched to
through the deploy, verified, benched and kept only if it passes its gate (tasks.upgrade.gate)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from invoke import Context, Exit, task

from sparkspec.errors import UserError
from sparkspec.registry import releases
from sparkspec.registry.fields import name
from tasks.host import INVENTORY_HELP, run_play
from tasks.lib.common import ROOT, ask_become_pass, fail, inventory_of, require_host
from tasks.lib.status import HostStatus, host_status
from tasks.upgrade.gate import figures, judge, mismatch

REPORTS = ROOT / "reports"


def _served(c: Context, host: str, inventory: str | None) -> HostStatus:
    """What the host serves now (its unit's record, checked: its method and release name files on
    this machine), over SSH: one line when it serves nothing a release was recorded for."""
    try:
        status = host_status(inventory_of(c, inventory), host, ask_become_pass=ask_become_pass(c))
        if not status.method or not status.vllm_release:
            raise UserError(f"{host}'s unit record names no vLLM release (a unit from before "
                            "sparkspec recorded releases, or none); run invoke provision once")
        where = f"{host}: /etc/sparkspec/{status.unit}.json"
        name(status.method, "method", where, "run invoke provision")
        releases.release(status.vllm_release, where)
    except UserError as exc:
        raise fail(exc) from None
    return status


def _result(path: Path, release: str) -> dict[str, Any] | None:
    """A bench result of the release at path, else None."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) and result.get("vllm_release") == release else None


def _slowdown(value: Any) -> float | None:
    """--max-slowdown (or sparkspec_upgrade_max_slowdown): None for the benches' own spread."""
    if value in (None, "", "auto"):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = -1.0
    if not 0 <= number < 1:
        raise Exit(f"sparkspec: error: max slowdown {value!r} is not a fraction from 0 to below 1 "
                   "(0.05: 5 % slower is kept) or auto (from the benches' spread)", code=2)
    return number


def _switch(c: Context, host: str, inventory: str | None, release: str,
            verify_name: str | None, skip_tags: str = "",
            restore: dict[str, Any] | None = None) -> None:
    """The deploy onto ``release`` (a version or previous): fit, install beside, render check,
    swap, health; then verify under ``verify_name`` unless skipped."""
    extra: dict[str, Any] = {"sparkspec_vllm_release_switch": release,
                             "verify_reports_dir": str(REPORTS),
                             **({"sparkspec_vllm_release_restore": restore} if restore else {})}
    if verify_name:
        extra["verify_report_name"] = verify_name
    run_play(c, "deploy.yml", host, inventory, extra, skip_tags=skip_tags)


@task(positional=[], auto_shortflags=False, help={
    "host": "inventory host", "vllm": "the release to serve (one sparkspec has a record of)",
    "mode": "wheel or source: must be the inventory's vllm_install_mode (later runs use it)",
    "inventory": INVENTORY_HELP,
    "max-slowdown": "tok/s loss kept, a fraction (default: from the benches' own spread)"})
def upgrade(c, host=None, vllm=None, mode="", inventory=None, max_slowdown=""):
    """Serve another vLLM release, kept only if it passes the same checks and bench as the old one.

    X is installed (or built) into its own venv beside the serving one, the method is rendered
    through X's parser, the deploy swaps the unit onto X, then verify and bench run as last
    recorded on the old release. A failed check or a tok/s below the old figure less the tolerance
    puts the old release back by itself."""
    try:
        target = releases.release(vllm, "--vllm").version
    except UserError as exc:
        raise fail(exc) from None
    inv = require_host(c, host, inventory)
    assert host is not None
    try:
        values = inv.host_vars(host, ("sparkspec_upgrade_max_slowdown", "vllm_install_mode",
                                      "sparkspec_cluster"))
    except UserError as exc:
        raise fail(exc) from None
    slowdown = _slowdown(max_slowdown or values.get("sparkspec_upgrade_max_slowdown"))
    _check_mode(mode, str(values.get("vllm_install_mode") or "existing"))
    if values.get("sparkspec_cluster"):
        raise Exit(f"sparkspec: error: {host} is a member of a cluster (sparkspec_cluster); an "
                   "upgrade serves one Spark: set sparkspec_vllm_release for the group and run "
                   "invoke provision", code=2)
    before = _served(c, host, inventory)
    old, method = str(before.vllm_release), str(before.method)
    if old == target:
        raise Exit(f"sparkspec: error: {host} already serves vLLM {target}", code=2)
    # the old release's figures: its last verify, else one now (the same verify, recorded)
    baseline = _result(REPORTS / host / f"{method}.json", old)
    if baseline is None:
        print(f"sparkspec: no bench of {method} on vLLM {old} recorded; verifying it first")
        run_play(c, "verify.yml", host, inventory, {"verify_reports_dir": str(REPORTS)})
        baseline = _result(REPORTS / host / f"{method}.json", old)
    if baseline is None:
        raise Exit(f"sparkspec: error: verify recorded no bench of {method} on vLLM {old} "
                   f"({REPORTS / host / (method + '.json')}); run invoke verify --host {host}",
                   code=2)
    try:
        figures(baseline, str(REPORTS / host / f"{method}.json"))
    except UserError as exc:
        raise fail(exc) from None
    kept = REPORTS / host / "upgrade" / f"{method}@vllm-{old}.json"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(baseline, indent=2) + "\n", encoding="utf-8")
    label = f"{method}@vllm-{target}"
    undo = before.release_record
    try:
        _switch(c, host, inventory, target, label)
    except Exit as exc:
        if _served(c, host, inventory).vllm_release != old:
            _back(c, host, inventory, old, f"its deploy or verify failed ({_text(exc)})", undo)
        raise
    result = _result(REPORTS / host / f"{label}.json", target)
    why = ("verify recorded no bench" if result is None else mismatch(baseline, result))
    if result is None or why:
        _back(c, host, inventory, old, f"its bench cannot be compared ({why})", undo)
    assert result is not None
    try:
        verdict = judge(baseline, result, slowdown)
    except UserError as exc:
        _back(c, host, inventory, old, str(exc), undo)
        raise
    shutil.copyfile(REPORTS / host / f"{label}.json", kept.with_name(f"{label}.json"))
    if not verdict.keep:
        _back(c, host, inventory, old, f"too slow: {verdict.line}", undo)
    print(f"sparkspec: upgrade kept: {host} serves vLLM {target}; {verdict.line}")
    run_play(c, "vllm-prune.yml", host, inventory)


def _text(exc: Exit) -> str:
    message = str(exc.message or "").removeprefix("sparkspec: error: ")
    return message.splitlines()[-1] if message else f"exit {exc.code}"


def _check_mode(mode: str, inventory_mode: str) -> None:
    """--mode states the install mode the upgrade uses; later runs and rollbacks read the
    inventory's, so the two must agree, and existing mode installs nothing."""
    if mode not in ("", "wheel", "source"):
        raise Exit(f"sparkspec: error: --mode {mode!r}: give wheel or source", code=2)
    if inventory_mode == "existing" or (mode and mode != inventory_mode):
        why = (", which serves a venv you built and installs nothing"
               if inventory_mode == "existing" else "")
        raise Exit(f"sparkspec: error: the inventory's vllm_install_mode is {inventory_mode}{why}; "
                   f"set vllm_install_mode: {mode or 'wheel or source'} there, so later runs and "
                   "rollbacks install releases the same way, then run invoke upgrade again",
                   code=2)


def _back(c: Context, host: str, inventory: str | None, old: str, why: str,
          undo: dict[str, Any] | None) -> None:
    """Put the old release back (the deploy's swap, health checked; no verify) with the host's
    release record as it was, then stop with one line saying why."""
    print(f"sparkspec: putting vLLM {old} back on {host}: {why}")
    try:
        _switch(c, host, inventory, old, None, skip_tags="verify", restore=undo)
    except Exit as exc:
        raise Exit(f"sparkspec: error: the new release failed its gate ({why}), and putting vLLM "
                   f"{old} back failed too ({_text(exc)}); see invoke status --host {host}, then "
                   f"invoke rollback --host {host}", code=1) from None
    raise Exit(f"sparkspec: error: upgrade rolled back: {host} serves vLLM {old} again; the new "
               f"release failed its gate: {why}", code=1)


@task(positional=[], auto_shortflags=False,
      help={"host": "inventory host", "inventory": INVENTORY_HELP})
def rollback(c, host=None, inventory=None):
    """Serve the vLLM release served before the last switch again (its venv is kept), then verify.

    The swap is the deploy's: staged, checked with that release's parser, health-checked."""
    require_host(c, host, inventory)
    assert host is not None
    before = _served(c, host, inventory)
    if not before.previous_release:
        raise Exit(f"sparkspec: error: no earlier vLLM release is recorded on {host} (it serves "
                   f"{before.vllm_release}); nothing to roll back to", code=2)
    _switch(c, host, inventory, "previous", None)
    print(f"sparkspec: {host} serves vLLM {before.previous_release} again (was "
          f"{before.vllm_release})")
