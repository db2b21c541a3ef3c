"""Thin command-line front: each concern module registers its own subcommands.

A module listed in COMMAND_MODULES provides ``register(subparsers)``; each subcommand it adds sets
``func`` (taking the parsed namespace, returning an exit code). UserError becomes one line on stderr
and exit 2; nothing here prints a traceback for bad input.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from sparkspec import __version__
from sparkspec.errors import UserError

COMMAND_MODULES = (
    "sparkspec.checkpoint_cli",
    "sparkspec.hub_cli",
    "sparkspec.bench_cli",
    "sparkspec.methods_cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparkspec", description=__doc__.splitlines()[0])
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


def main(argv: list[str] | None = None) -> int:
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
    except KeyboardInterrupt:
        print("sparkspec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
