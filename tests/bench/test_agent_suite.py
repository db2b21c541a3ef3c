"""The agent suite: multi-turn conversations with tools, their checks as untrusted input (one line
naming the line, nothing sent), and how the bench sends them (history growing turn by turn, in
order, tools offered) against the fake vLLM."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparkspec.bench import suites
from sparkspec.bench.suites import load
from tests.badinput import refused_untouched, run

from .fakevllm import FakeVllm, argv

TOOL = {"type": "function", "function": {
    "name": "read_file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function",
     "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]}
GOOD: dict[str, Any] = {"id": "conv", "tools": [TOOL], "turns": [
    {"role": "user", "content": "Read a.py."}, CALL,
    {"role": "tool", "tool_call_id": "c1", "content": "print(1)"},
    {"role": "assistant", "content": '{"lines": 1}'}]}


def _with(**changes: Any) -> str:
    return json.dumps(GOOD | changes)


def _turn(i: int, turn: Any) -> str:
    turns = list(GOOD["turns"])
    turns[i] = turn
    return _with(turns=turns)


def _tool(**function: Any) -> str:
    return _with(tools=[{"type": "function", "function": TOOL["function"] | function}])


def _call(**function: Any) -> str:
    call = {"id": "c1", "type": "function",
            "function": CALL["tool_calls"][0]["function"] | function}
    return _turn(1, CALL | {"tool_calls": [call]})


BAD = {
    "turn-a-string": (_turn(2, "the tool said print(1)"), "turns[2] is str"),
    "turn-a-list": (_turn(0, ["user", "hi"]), "turns[0] is list"),
    "turns-an-object": (_with(turns={"role": "user"}), "'turns' is dict"),
    "schema-bad-type": (_tool(parameters={"type": "objekt"}),
                        "tools[0].function.parameters is not valid JSON Schema"),
    "schema-bad-property": (_tool(parameters={"type": "object", "properties": {"p": {"type": 5}}}),
                            "is not valid JSON Schema: at['properties']['p']['type']"),
    "schema-not-object": (_tool(parameters={"type": "string"}), 'a tool takes an object'),
    "schema-a-list": (_tool(parameters=[]), "'parameters' is list"),
    "tool-not-function": (_with(tools=[{"type": "retrieval"}]), "is not a tool definition"),
    "tool-name-space": (_tool(name="read file"), "is not a new function name"),
    "tools-twice": (_with(tools=[TOOL, TOOL]), "is not a new function name"),
    "call-unknown-tool": (_call(name="rm_rf"), "calls 'rm_rf', which is not one of"),
    "call-args-not-json": (_call(arguments="{path: a.py}"), "arguments are not JSON"),
    "call-args-wrong": (_call(arguments='{"file": "a.py"}'), "arguments do not fit read_file's"),
    "tool-answers-nothing": (_turn(2, {"role": "tool", "tool_call_id": "zz", "content": "x"}),
                             "answers no earlier unanswered tool call"),
    "first-turn-assistant": (_turn(0, {"role": "assistant", "content": "hi"}),
                             "(the first turn is system or user)"),
    "role-unknown": (_turn(0, {"role": "developer", "content": "hi"}), "role 'developer'"),
    "content-int": (_turn(0, {"role": "user", "content": 5}), 'needs a "content" string'),
    "turn-unknown-key": (_turn(0, {"role": "user", "content": "hi", "weight": 2}),
                         "unknown key 'weight'"),
    "no-assistant-turn": (_with(turns=[{"role": "user", "content": "hi"}] * 2),
                          "no assistant turn"),
    "conversation-unknown-key": (_with(prompt="hi"), "unknown key 'prompt' beside \"turns\""),
    # a $ref is never fetched (a URL, a file), and one that resolves nowhere is one line
    "ref-a-url": (_tool(parameters={"type": "object", "properties": {
        "path": {"$ref": "http://127.0.0.1:9/evil.json"}}}),
        "$ref 'http://127.0.0.1:9/evil.json' points outside the schema"),
    "ref-a-file": (_tool(parameters={"type": "object", "$ref": "file:///dev/zero"}),
                   "$ref 'file:///dev/zero' points outside the schema"),
    "ref-nowhere": (_tool(parameters={"type": "object", "properties": {
        "path": {"$ref": "#/$defs/nope"}}}), "read_file's parameters hold a $ref that resolves"),
}


@pytest.mark.parametrize("command", ["bench", "check-output record"])
@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_conversation_is_refused_before_any_request(command: str, name: str,
                                                          fake: FakeVllm, work: Path) -> None:
    line, expected = BAD[name]
    (work / "suite.jsonl").write_text(json.dumps(GOOD) + "\n" + line + "\n")
    out = refused_untouched(argv(command, fake, work), [work], 2, match=r"suite\.jsonl:2")
    assert expected in out.stderr
    assert fake.seen == []


def test_the_builtin_agent_suite_is_agent_work() -> None:
    """Conversations whose history grows turn by turn, mostly tool calls, some JSON answers."""
    prompts = load("agent")
    conversations = {p.conversation for p in prompts}
    assert len(conversations) >= 4 and None not in conversations
    assert sum(p.tool_turn for p in prompts) / len(prompts) >= 0.6
    assert sum(p.expect_json for p in prompts) >= 3
    for before, after in zip(prompts, prompts[1:], strict=False):
        if before.conversation == after.conversation:
            assert after.messages[:len(before.messages)] == before.messages
            assert len(after.messages) > len(before.messages)
    assert all(p.tools for p in prompts)


def test_the_bench_sends_each_conversation_in_order_with_its_tools(fake: FakeVllm,
                                                                  work: Path) -> None:
    """At concurrency 4, each conversation's turns still go one after another, each request the
    history before the scripted answer, with the tools offered (tool_choice auto)."""
    out = run(*argv("bench", fake, work, **{"--suite": "agent", "--concurrency": "4",
                                            "--requests": None}))
    assert out.rc == 0, out.stderr
    bodies = [json.loads(b) for b in fake.bodies]
    prompts = load("agent")
    assert len(bodies) == len(prompts)
    by_conversation: dict[str, list[int]] = {}
    for body in bodies:
        assert body["tool_choice"] == "auto" and body["tools"]
        match = [p for p in prompts if list(p.messages) == body["messages"]]
        assert len(match) == 1
        by_conversation.setdefault(str(match[0].conversation), []).append(len(body["messages"]))
    assert all(sizes == sorted(sizes) for sizes in by_conversation.values())
    result = json.loads((work / "out.json").read_text())
    assert result["agent_turns"] == len(prompts)
    assert result["tool_turn_share"] == pytest.approx(
        sum(p.tool_turn for p in prompts) / len(prompts))


def test_the_lossless_reference_replays_each_turn_as_recorded(fake: FakeVllm, work: Path) -> None:
    """An agent turn is its history and tools: the compare sends exactly what the record sent
    (a reference holding only the last message would compare other requests)."""
    ref = work / "ref-agent.json"
    out = run(*argv("check-output record", fake, work,
                    **{"--suite": "agent", "--output": str(ref)}))
    assert out.rc == 0, out.stderr
    recorded = sorted(fake.bodies)
    fake.bodies.clear()
    out = run(*argv("check-output compare", fake, work, **{"--reference": str(ref),
                                                            "--concurrency": "4"}))
    assert out.rc == 0, out.stderr
    assert sorted(fake.bodies) == recorded and len(recorded) == len(load("agent"))
    doc = json.loads(ref.read_text())
    doc["outputs"][1]["messages"][1] = "a string, not a turn"
    ref.write_text(json.dumps(doc))
    refused_untouched(argv("check-output compare", fake, work, **{"--reference": str(ref)}),
                      [work], 2, match=r"ref-agent\.json: outputs\[1\]: turns\[1\] is str")


def test_a_cycled_conversation_starts_a_new_unit_at_its_first_turn() -> None:
    """--requests beyond a suite repeats its conversations: each repeat is its own unit (turns in
    order within it), so repeats of one conversation can run side by side."""
    prompts = load("agent")
    first = [p for p in prompts if p.conversation == prompts[0].conversation]
    units = suites.units(suites.cycle(first, 3 * len(first)))
    assert [len(u) for u in units] == [len(first)] * 3
    assert all([p.id for p in u] == [p.id for p in first] for u in units)


def test_the_lossless_check_compares_tool_calls_not_their_empty_text(fake: FakeVllm,
                                                                     work: Path) -> None:
    """A parsed tool call leaves no text: its calls are compared, however the stream cut them."""
    ref = work / "ref.json"
    fake.auto_call = ('{"path": "a.py"}', 3)
    assert run(*argv("check-output record", fake, work,
                     **{"--suite": "agent", "--output": str(ref)})).rc == 0
    fake.auto_call = ('{"path": "a.py"}', 7)   # the same call in other pieces
    assert run(*argv("check-output compare", fake, work, **{"--reference": str(ref)})).rc == 0
    fake.auto_call = ('{"path": "b.py"}', 3)   # another call: every turn differs
    out = run(*argv("check-output compare", fake, work, **{"--reference": str(ref)}))
    assert out.rc == 1 and "FAIL (identical share 0.000 < 1.000)" in out.stderr, out.stderr
