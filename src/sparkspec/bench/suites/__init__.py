"""Prompt suites: the built-in ones (``structured``, ``open``, ``agent``) and JSON-lines files a
user gives, checked as untrusted input. A line is one prompt, or one agent conversation
(:mod:`sparkspec.bench.suites.conversation`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from sparkspec.bench.suites import conversation
from sparkspec.errors import UserError
from sparkspec.jsonfile import expect, loads_bounded
from sparkspec.validate import read_regular

BUILTIN = ("structured", "open", "agent")
MAX_SUITE_BYTES = 16 << 20
MAX_ID = 128


@dataclass(frozen=True)
class Prompt:
    id: str
    suite: str
    category: str
    prompt: str
    expect_json: bool = False
    # an agent conversation's turn: the history sent (chat messages), the tools offered, the
    # conversation it belongs to (its turns run in order) and whether the scripted answer calls one
    messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] = ()
    conversation: str | None = None
    tool_turn: bool = False


def _text_field(row: object, key: str, where: str, default: str, limit: int) -> str:
    fix = "fix that line"
    value = expect(row, key, str, where, fix, required=False)
    if value is None:
        return default
    if not value or len(value) > limit or not value.isprintable():
        raise UserError(f"{where}: {key!r} must be 1 to {limit} printable characters; {fix}")
    return str(value)


def _conversation(row: dict[str, Any], where: str, cid: str, category: str,
                  suite: str) -> list[Prompt]:
    """One request per scripted assistant turn, over the turns before it."""
    tools = conversation.tools_of(row, where)
    turns = conversation.turns_of(row, where, tools)
    out: list[Prompt] = []
    for i, turn in enumerate(turns):
        if turn["role"] == "assistant":
            shown = str(turns[i - 1].get("content") or "")
            out.append(Prompt(f"{cid}#{len(out) + 1}", suite, category, shown or "(tool calls)",
                              conversation.is_json_answer(turn), tuple(turns[:i]),
                              tuple(tools.values()), cid, "tool_calls" in turn))
    return out


def parse(text: str, source: str, suite: str) -> list[Prompt]:
    """The prompts of a JSON-lines suite: ``{"prompt": str, "id": str, "category": str,
    "expect_json": bool}``, only ``prompt`` required, or an agent conversation ``{"id", "category",
    "tools": [...], "turns": [...]}``; blank lines are skipped."""
    prompts: list[Prompt] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{source}:{n}"
        try:
            row = loads_bounded(line)
        except ValueError as exc:
            raise UserError(f"{where}: not JSON ({exc}); fix that line") from None
        if isinstance(row, dict) and "turns" in row:
            unknown = sorted(set(row) - {"id", "category", "tools", "turns"})
            if unknown:
                raise UserError(f"{where}: unknown key {unknown[0][:40]!r} beside \"turns\"; a "
                                "conversation has id, category, tools and turns; fix that line")
            prompts += _conversation(row, where, _text_field(row, "id", where, f"{suite}-{n}",
                                                             MAX_ID - 8),
                                     _text_field(row, "category", where, suite, MAX_ID), suite)
            continue
        prompt = expect(row, "prompt", str, where, 'give each line a "prompt" string (or '
                        '"turns", a conversation)')
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


def units(prompts: list[Prompt]) -> list[list[Prompt]]:
    """The work items: a conversation's consecutive turns together (sent in order, each after the
    answer before it), every other prompt alone."""
    out: list[list[Prompt]] = []
    for p in prompts:
        last = out[-1][-1] if out else None
        # the same conversation, one turn further (a cycled suite starts it over: a new unit)
        if last is not None and p.conversation is not None \
                and last.conversation == p.conversation and len(p.messages) > len(last.messages):
            out[-1].append(p)
        else:
            out.append([p])
    return out


def cycle(prompts: list[Prompt], n: int | None) -> list[Prompt]:
    """``n`` requests from ``prompts`` in turn (each once when ``n`` is None)."""
    return prompts if n is None else [prompts[i % len(prompts)] for i in range(n)]


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
