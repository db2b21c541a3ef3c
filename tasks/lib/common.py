"""What every task module shares: the checkout's root, the inventory a task uses, the one-line exit
of a UserError, and the check that a host is in the inventory."""

from __future__ import annotations

from pathlib import Path

from invoke import Context, Exit

from sparkspec.errors import UserError
from tasks.lib.inventory import Inventory, load

ROOT = Path(__file__).resolve().parents[2]


def inventory_of(c: Context, inventory: str | None) -> str:
    """--inventory, else the default of invoke.yaml (sparkspec.inventory)."""
    return inventory or c.config.sparkspec.inventory


def ask_become_pass(c: Context) -> bool:
    return bool(c.config.sparkspec.get("ask_become_pass"))


def fail(exc: UserError) -> Exit:
    """The error as invoke's exit: one `sparkspec: error: ...` line and the error's exit code."""
    return Exit(f"sparkspec: error: {exc}", code=exc.exit_code)


def require_host(c: Context, host: str | None, inventory: str | None, *,
                 many: bool = False) -> Inventory:
    """The inventory, checked to hold the host (``many``: every host --host names, a host, a
    cluster's group or a comma-separated list): one line naming the fix otherwise."""
    if not host:
        raise Exit("sparkspec: error: --host is required; name a host"
                   f"{' (or a cluster group)' if many else ''} of the inventory", code=2)
    try:
        inv = load(inventory_of(c, inventory))
        if many:
            inv.hosts_of(host)
        else:
            inv.require_host(host)
    except UserError as exc:
        raise fail(exc) from None
    return inv
