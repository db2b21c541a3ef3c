"""What every command module shares: the argument parser with the project's error shape and the
final ``--json`` line. Kept apart from :mod:`sparkspec.cli` so the command modules never import the
package that imports them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn


def _without_values(message: str) -> str:
    """argparse echoes what it could not place; a mistyped secret flag (``--apikey SECRET``) would
    land on the terminal and in logs. Keep option names only."""
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
            return f"{lead}{shown}{tail}" + (f" (and {dropped} value(s) not shown)"
                                             if dropped else "")
    return message


class Parser(argparse.ArgumentParser):
    """argparse with the project's error shape: one line ``sparkspec: error: ...`` and exit 2.
    Abbreviations are off: ``--token X`` must not silently become ``--token-file X``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    program = "sparkspec"  # how the top parser's prog begins; what follows it names the subcommand

    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix(self.program).strip()
        message = _without_values(message)
        print(f"sparkspec: error: {where + ': ' if where else ''}{message}; "
              f"see `{self.prog} --help`", file=sys.stderr)
        raise SystemExit(2)


def emit_json(result: dict[str, Any]) -> None:
    """Final machine-readable line of a command run with --json."""
    print(json.dumps(result, sort_keys=True, default=str), flush=True)
