"""Thin command-line front: each concern's command module registers its own subcommands.

Each module in COMMAND_MODULES provides ``register(subparsers)``; each subcommand it adds sets
``func`` (taking the parsed namespace, returning an exit code). UserError becomes one line on stderr
and exit 2; nothing here prints a traceback for bad input.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType

from sparkspec import __version__, stops
from sparkspec.cli import bench, checkpoint, cluster, hub, operate
from sparkspec.cli.common import Parser
from sparkspec.errors import UserError, os_error

COMMAND_MODULES: tuple[ModuleType, ...] = (checkpoint, hub, bench, cluster, operate)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="sparkspec", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sparkspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), argv)


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse ``argv`` with ``parser`` and run the chosen subcommand with the project's error
    handling."""
    with stops.handled():
        code = _main(parser, argv)
        sig = stops.requested()
        # the interrupt was swallowed where it was raised; the output was not
        if sig is not None and code != 130:
            print(f"sparkspec: interrupted by {sig.name}; nothing half-written was left",
                  file=sys.stderr)
            return 130
        return code


def _main(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
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
        error = os_error(exc, exc.filename or args.command,
                         "check the paths given and their permissions")
        print(f"sparkspec: error: {error}", file=sys.stderr)
        return error.exit_code
    except (MemoryError, RecursionError, ValueError, TypeError, KeyError) as exc:
        if os.environ.get("SPARKSPEC_DEBUG"):
            raise
        print(f"sparkspec: error: {exc.__class__.__name__}: {str(exc)[:300]} (unexpected input; "
              "set SPARKSPEC_DEBUG=1 for the traceback and report it)", file=sys.stderr)
        return 1

