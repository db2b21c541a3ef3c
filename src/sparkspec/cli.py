"""Thin command-line front: each concern module registers its own subcommands.

A module listed in COMMAND_MODULES provides ``register(subparsers)``; each subcommand it adds sets
``func`` (taking the parsed namespace, returning an exit code). UserError becomes one line on stderr
and exit 2; nothing here prints a traceback for bad input.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
from typing import Any, NoReturn

from sparkspec import __version__
from sparkspec.errors import UserError, os_error

COMMAND_MODULES = (
    "sparkspec.checkpoint_cli",
    "sparkspec.hub_cli",
    "sparkspec.bench_cli",
    "sparkspec.methods_cli",
)


def _without_values(message: str) -> str:
    """argparse echoes what it could not place; a mistyped secret flag (``--apikey SECRET``) would land on the
    terminal and in logs. Keep option names only."""
    for lead in ("unrecognized arguments: ", "ambiguous option: "):
        if message.startswith(lead):
            rest = message[len(lead):]
            tail = ""
            if lead == "ambiguous option: " and " could match " in rest:
                rest, tail = rest.split(" could match ", 1)
                tail = " could match " + tail
            names = [w.split("=", 1)[0] for w in rest.split() if w.startswith("-")]
            dropped = len(rest.split()) - len(names)
            shown = " ".join(names) or "(values)"
            return f"{lead}{shown}{tail}" + (f" (and {dropped} value(s) not shown)" if dropped else "")
    return message


class Parser(argparse.ArgumentParser):
    """argparse with the project's error shape: one line ``sparkspec: error: ...`` and exit 2. Abbreviations
    are off: ``--token X`` must not silently become ``--token-file X``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix("sparkspec").strip()
        message = _without_values(message)
        print(f"sparkspec: error: {where + ': ' if where else ''}{message}; see `{self.prog} --help`",
              file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="sparkspec", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sparkspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # that concern is not part of this build
                continue
            raise
        module.register(sub)
    return parser


def emit_json(result: dict[str, Any]) -> None:
    """Final machine-readable line of a command run with --json."""
    print(json.dumps(result, sort_keys=True, default=str), flush=True)


def _stop(signum: int, _frame: object) -> None:
    """SIGTERM and SIGHUP unwind like Ctrl-C, so every command's cleanup (temp siblings, locks) runs."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    stops = (signal.SIGTERM, signal.SIGHUP)
    try:
        before = {sig: signal.signal(sig, _stop) for sig in stops}
    except ValueError:  # not the main thread: leave the handlers alone
        before = {}
    try:
        return _main(argv)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"sparkspec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        why = f" by {exc.args[0]}" if exc.args else ""
        print(f"sparkspec: interrupted{why}; nothing half-written was left", file=sys.stderr)
        return 130
    except OSError as exc:  # the last line of defence: one line, never a traceback
        if os.environ.get("SPARKSPEC_DEBUG"):
            raise
        error = os_error(exc, exc.filename or args.command, "check the paths given and their permissions")
        print(f"sparkspec: error: {error}", file=sys.stderr)
        return error.exit_code
    except (MemoryError, RecursionError, ValueError, TypeError, KeyError) as exc:
        if os.environ.get("SPARKSPEC_DEBUG"):
            raise
        print(f"sparkspec: error: {exc.__class__.__name__}: {str(exc)[:300]} (unexpected input; set "
              "SPARKSPEC_DEBUG=1 for the traceback and report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
