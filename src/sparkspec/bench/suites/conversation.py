"""Agent conversations in a suite: tool definitions and scripted turns, checked as untrusted input;
each assistant turn is one measured request over the history before it."""

from __future__ import annotations

import json
import re
from typing import Any

from jsonschema import Draft202012Validator, SchemaError, ValidationError
from referencing import Registry
from referencing.exceptions import Unresolvable

from sparkspec.errors import UserError
from sparkspec.jsonfile import expect, loads_bounded

ROLES = ("system", "user", "assistant", "tool")
TURN_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id"})
MAX_TURNS = 512
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's rule for a function name
FIX = "fix that line (docs/methods.md, \"Agent suites\")"
NO_FETCH: Registry[Any] = Registry()   # a $ref resolves inside its schema or not at all


def _remote_ref(node: Any) -> str | None:
    """The first $ref / $dynamicRef that points outside its schema (a URL, a file), else None."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key in ("$ref", "$dynamicRef") and not (isinstance(value, str)
                                                           and value.startswith("#")):
                    return str(value)
                stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
    return None


def tools_of(row: dict[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """The conversation's tools by name, each an OpenAI function tool whose parameters are valid
    JSON Schema (an object schema)."""
    tools = expect(row, "tools", list, where, FIX, required=False) or []
    if len(tools) > MAX_TOOLS:
        raise UserError(f"{where}: {len(tools)} tools, more than {MAX_TOOLS}; {FIX}")
    named: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        here = f"{where}: tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or set(tool) != {"type", "function"}:
            raise UserError(f'{here} is not a tool definition ({{"type": "function", "function": '
                            f"{{...}}}}); {FIX}")
        fn = tool["function"]
        name = expect(fn, "name", str, f"{here}.function", FIX)
        if not TOOL_NAME.fullmatch(name) or name in named:
            raise UserError(f"{here}.function: name {name[:80]!r} is not a new function name "
                            f"(1 to 64 of A-Z a-z 0-9 _ -); {FIX}")
        expect(fn, "description", str, f"{here}.function", FIX, required=False)
        params = expect(fn, "parameters", dict, f"{here}.function", FIX)
        try:
            Draft202012Validator.check_schema(params)
        except SchemaError as exc:
            at = "".join(f"[{p!r}]" for p in exc.absolute_path) or " (the top)"
            raise UserError(f"{here}.function.parameters is not valid JSON Schema: at{at} "
                            f"{exc.message[:160]}; {FIX}") from None
        remote = _remote_ref(params)
        if remote is not None:
            raise UserError(f"{here}.function.parameters: $ref {remote[:80]!r} points outside the "
                            f"schema; sparkspec fetches nothing: inline it under $defs; {FIX}")
        if params.get("type") != "object":
            raise UserError(f'{here}.function.parameters: a tool takes an object ("type": '
                            f'"object"); {FIX}')
        named[name] = tool
    return named


def _calls(turn: dict[str, Any], here: str, tools: dict[str, dict[str, Any]]) -> list[str]:
    """The ids of an assistant turn's tool calls, each naming a tool with arguments its schema
    accepts."""
    calls = expect(turn, "tool_calls", list, here, FIX)
    if not calls:
        raise UserError(f"{here}: tool_calls is empty; drop it or give a call; {FIX}")
    ids = []
    for j, call in enumerate(calls):
        at = f"{here}.tool_calls[{j}]"
        call_id = expect(call, "id", str, at, FIX)
        fn = expect(call, "function", dict, at, FIX)
        if call.get("type") != "function" or not call_id or not call_id.isprintable():
            raise UserError(f'{at} is not a function call ({{"id": ..., "type": "function", '
                            f'"function": {{"name": ..., "arguments": "..."}}}}); {FIX}')
        name = expect(fn, "name", str, at, FIX)
        if name not in tools:
            raise UserError(f"{at}: calls {name[:80]!r}, which is not one of the conversation's "
                            f"tools ({', '.join(tools) or 'none'}); {FIX}")
        raw = expect(fn, "arguments", str, at, FIX)
        try:
            arguments = loads_bounded(raw)
            Draft202012Validator(tools[name]["function"]["parameters"],
                                 registry=NO_FETCH).validate(arguments)
        except Unresolvable as exc:
            raise UserError(f"{at}: {name}'s parameters hold a $ref that resolves nowhere "
                            f"({str(exc)[:120]}); {FIX}") from None
        except ValueError as exc:
            raise UserError(f"{at}: arguments are not JSON ({exc}); {FIX}") from None
        except ValidationError as exc:
            raise UserError(f"{at}: arguments do not fit {name}'s parameters "
                            f"({exc.message[:160]}); {FIX}") from None
        ids.append(call_id)
    return ids


def check_turns(turns: list[Any], where: str, tools: dict[str, dict[str, Any]]) -> None:
    """Each turn a chat message: system or user first, an assistant's tool calls naming the tools,
    each tool turn answering an earlier call by id."""
    open_calls: set[str] = set()
    for i, turn in enumerate(turns):
        here = f"{where}: turns[{i}]"
        if not isinstance(turn, dict):
            raise UserError(f'{here} is {type(turn).__name__} {json.dumps(turn)[:60]}, not a JSON '
                            f'object (a chat message: {{"role": ..., "content": ...}}); {FIX}')
        unknown = sorted(set(turn) - TURN_KEYS)
        if unknown:
            raise UserError(f"{here}: unknown key {unknown[0][:40]!r}; a turn has "
                            f"{', '.join(sorted(TURN_KEYS))}; {FIX}")
        role = turn.get("role")
        if role not in ROLES or (i == 0 and role not in ("system", "user")):
            raise UserError(f"{here}: role {str(role)[:40]!r} is not one of "
                            f"{', '.join(ROLES)} (the first turn is system or user); {FIX}")
        content = turn.get("content")
        calls = role == "assistant" and "tool_calls" in turn
        if not (isinstance(content, str) or (calls and content is None)) \
                or (not calls and "tool_calls" in turn):
            raise UserError(f"{here}: a {role} turn needs a \"content\" string (null only beside "
                            f"an assistant's tool_calls); {FIX}")
        if calls:
            open_calls |= set(_calls(turn, here, tools))
        if role == "tool":
            call_id = expect(turn, "tool_call_id", str, here, FIX)
            if call_id not in open_calls:
                raise UserError(f"{here}: tool_call_id {call_id[:60]!r} answers no earlier "
                                f"unanswered tool call; {FIX}")
            open_calls.discard(call_id)
        elif "tool_call_id" in turn:
            raise UserError(f"{here}: tool_call_id belongs to a tool turn; {FIX}")


def turns_of(row: dict[str, Any], where: str,
             tools: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The scripted turns (:func:`check_turns`), at least one of them the assistant's."""
    turns: list[dict[str, Any]] = expect(row, "turns", list, where, FIX)
    if not 2 <= len(turns) <= MAX_TURNS:
        raise UserError(f"{where}: {len(turns)} turns; a conversation has 2 to {MAX_TURNS}; {FIX}")
    check_turns(turns, where, tools)
    if not any(t["role"] == "assistant" for t in turns):
        raise UserError(f"{where}: no assistant turn, so nothing is measured; end each exchange "
                        f"with the assistant's scripted answer; {FIX}")
    return turns


def history(messages: Any, tools: Any, where: str) -> tuple[tuple[dict[str, Any], ...],
                                                           tuple[dict[str, Any], ...]]:
    """A turn's history and tools as a result or reference stores them, checked as a suite's."""
    named = tools_of({"tools": tools}, where)
    if not isinstance(messages, list) or not 1 <= len(messages) <= MAX_TURNS:
        raise UserError(f"{where}: 'messages' is not a list of 1 to {MAX_TURNS} turns; {FIX}")
    check_turns(messages, where, named)
    return tuple(messages), tuple(named.values())


def is_json_answer(turn: dict[str, Any]) -> bool:
    """An assistant turn whose scripted answer is a JSON object or array (a JSON-answer turn)."""
    content = turn.get("content")
    if not isinstance(content, str) or content.lstrip()[:1] not in ("{", "["):
        return False
    try:
        json.loads(content)
    except ValueError:
        return False
    return True
