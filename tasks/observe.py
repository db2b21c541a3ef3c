"""Looking at hosts without a playbook, over SSH (Fabric): status (tasks.lib.status) and the unit's
journal."""

from __future__ import annotations

import shlex
import sys

from invoke import Exit, task

from sparkspec.errors import UserError
from tasks.lib.common import ask_become_pass, fail, inventory_of, require_host
from tasks.lib.inventory import load
from tasks.lib.remote import connect
from tasks.lib.status import as_json, host_status, table

MAX_LOG_LINES = 100_000


@task(positional=[], auto_shortflags=False,
      help={"host": "inventory host (default: every host)",
            "inventory": "inventory folder",
            "json": "print JSON for scripts instead of the table"})
def status(c, host="all", inventory=None, json=False):
    """A quick look over SSH, no playbook: unit state, method, profile, model, /health, memory.

    The profile is shown running, desired and in the inventory; memory is the memory in use. An
    unreachable host is one line and exit 1."""
    try:
        names = load(inventory_of(c, inventory)).select(host)
    except UserError as exc:
        raise fail(exc) from None
    found, errors = [], []
    for name in names:
        try:
            found.append(host_status(inventory_of(c, inventory), name,
                                     ask_become_pass=ask_become_pass(c)))
        except UserError as exc:
            errors.append(exc)
    if json:
        print(as_json(found))
    elif found:
        from rich.console import Console

        Console().print(table(found))
    for error in errors[:-1]:
        print(f"sparkspec: error: {error}", file=sys.stderr)
    if errors:
        raise fail(errors[-1])


@task(positional=[], auto_shortflags=False,
      help={"host": "inventory host", "inventory": "inventory folder",
            "lines": f"journal lines to show (1-{MAX_LOG_LINES})",
            "follow": "keep printing new lines (Ctrl-C stops)"})
def logs(c, host=None, inventory=None, lines="50", follow=False):
    """The vLLM unit's journal on a host, over SSH (journalctl -u <unit>.service)."""
    count = str(lines).strip()
    if not count.isdigit() or not 1 <= int(count) <= MAX_LOG_LINES:
        raise Exit(f"sparkspec: error: --lines {lines!r} is not a whole number from 1 to "
                   f"{MAX_LOG_LINES}; pass e.g. --lines 50", code=2)
    inv = require_host(c, host, inventory)
    assert host is not None
    try:
        target = connect(inv.path, host, ask_become_pass=ask_become_pass(c),
                                extra_vars=("sparkspec_unit_name",))
        unit = f"{target.vars['sparkspec_unit_name']}.service"
        try:
            result = target.as_root(f"journalctl -u {shlex.quote(unit)} -n {int(count)} --no-pager"
                                    + (" -f" if follow else ""), hide=False, pty=follow)
        finally:
            target.close()
    except UserError as exc:
        raise fail(exc) from None
    if result.exited != 0 and not follow:
        raise Exit(f"sparkspec: error: host {host}: journalctl exited {result.exited}; "
                   f"check the unit {unit}", code=1)
