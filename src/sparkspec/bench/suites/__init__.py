"""Prompt suites: the built-in ones (``structured``, ``open``) and JSON-lines files a user gives,
checked as untrusted input.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from sparkspec.errors import UserError
from sparkspec.jsonfile import expect, loads_bounded
from sparkspec.validate import read_regular

BUILTIN = ("structured", "open")
MAX_SUITE_BYTES = 16 << 20
MAX_ID = 128


@dataclass(frozen=True)
class Prompt:
    id: str
    suite: str
    category: str
    prompt: str
    expect_json: bool = False


def _text_field(row: object, key: str, where: str, default: str, limit: int) -> str:
    fix = "fix that line"
    value = expect(row, key, str, where, fix, required=False)
    if value is None:
        return default
    if not value or len(value) > limit or not value.isprintable():
        raise UserError(f"{where}: {key!r} must be 1 to {limit} printable characters; {fix}")
    return str(value)


def parse(text: str, source: str, suite: str) -> list[Prompt]:
    """The prompts of a JSON-lines suite: ``{"prompt": str, "id": str, "category": str,
    "expect_json": bool}``, only ``prompt`` required; blank lines are skipped."""
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{n}"
        try:
            row = loads_bounded(line)
        except ValueError as exc:
            raise UserError(f"{where}: not JSON ({exc}); fix that line") from None
        prompt = expect(row, "prompt", str, where, 'give each line a "prompt" string')
        if not prompt.strip():
            raise UserError(f'{where}: "prompt" is empty; give each line a prompt to send')
        expect_json = expect(row, "expect_json", bool, where, "use true or false", required=False)
        prompts.append(Prompt(_text_field(row, "id", where, f"{suite}-{n}", MAX_ID), suite,
                              _text_field(row, "category", where, suite, MAX_ID), prompt,
                              bool(expect_json)))
    if not prompts:
        raise UserError(f'{source}: suite has no prompts; add JSON lines with a "prompt" or pick '
                        f"--suite {'|'.join(BUILTIN)}|all")
    return prompts


def load(name: str) -> list[Prompt]:
    """A built-in suite or a JSON-lines file."""
    if name in BUILTIN:
        text = resources.files(__name__).joinpath(f"{name}.jsonl").read_text(encoding="utf-8")
        return parse(text, f"suite {name}", name)
    if not name or not os.path.lexists(name):
        raise UserError(f"--suite {name!r}: no such suite or file; use {'|'.join(BUILTIN)}|all or "
                        "a .jsonl path")
    raw = read_regular(name, "suite file", MAX_SUITE_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{name}: not UTF-8 text (byte {exc.start}); save the suite as UTF-8") \
            from None
    return parse(text, name, Path(name).stem)


def suites_for(spec: str) -> list[tuple[str, list[Prompt]]]:
    """``all`` (every built-in suite), a built-in suite's name or a file: (suite, prompts) pairs."""
    names = BUILTIN if spec == "all" else (spec,)
    return [(n if n in BUILTIN else Path(n).stem, load(n)) for n in names]


def file_of(spec: str) -> str | None:
    """The suite file a ``--suite`` value names (an input no output may overwrite), else None."""
    return None if spec == "all" or spec in BUILTIN else spec
