"""`sparkspec check prefix-cache` and `sparkspec check tool-call` against the fake vLLM
(fakevllm.py), as a user runs them (the CLI in a subprocess): the verdict line, the exit status and
the JSON report. The prefix-cache check passes where a repeated prompt hits, fails where it does not
(naming the numbers, and vLLM's issues for MTP and DFlash) and only reports where caching is
expected off; the tool-call check passes on one well-formed forced call, streamed in fragments or
not, and fails in one line on no call, another name, arguments that do not parse or lack the
required key, and a server that refuses the forced choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import Cli
from .fakevllm import MODEL, FakeVllm


def _run(cli: Cli, fake: FakeVllm, work: Path, check: str, *extra: str):
    out = work / f"{check}.json"
    result = cli("check", check, "--url", fake.url, "--model", MODEL,
                 "--api-key-file", str(work / "key"),
                 "--output", str(out), "--json", *extra, timeout=60)
    report = json.loads(out.read_text()) if out.is_file() else None
    return result, report


@pytest.fixture()
def keyed(fake: FakeVllm) -> FakeVllm:
    from .fakevllm import KEY
    fake.key = KEY
    return fake


def test_prefix_cache_passes_when_the_repeat_hits(cli, keyed, work):
    result, report = _run(cli, keyed, work, "prefix-cache", "--expect", "on", "--method",
                          "baseline")
    assert result.returncode == 0, result.stderr
    assert report["passed"] is True and report["first_hits"] == 0
    # the fake hits every whole block of 16 of the repeated prompt (one token a character)
    assert report["repeat_hits"] == report["prompt_tokens"] // 16 * 16 > 0
    assert report["repeat_queries"] == report["prompt_tokens"]
    assert (report["counters_after"]["hits"] - report["counters_before"]["hits"]
            == report["repeat_hits"])
    assert result.stdout.startswith(f"prefix cache hits grow: {int(report['repeat_hits'])} of "
                                    f"{report['prompt_tokens']} queried tokens hit")
    assert json.loads(result.stdout.splitlines()[-1])["passed"] is True


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_prefix_cache_fails_when_the_repeat_does_not_hit(cli, keyed, work, method):
    keyed.prefix = "flat"
    result, report = _run(cli, keyed, work, "prefix-cache", "--expect", "on", "--method", method)
    assert result.returncode == 1 and report["passed"] is False and report["repeat_hits"] == 0
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("FAIL (prefix caching expected on, no hits: the cache was queried and "
                           f"nothing hit): 0 of {report['prompt_tokens']} queried tokens hit")
    assert ("#54360/#51250" in line) == (method == "mtp")


def test_prefix_cache_fails_where_the_unit_serves_it_off(cli, keyed, work):
    keyed.prefix = "off"
    result, report = _run(cli, keyed, work, "prefix-cache", "--expect", "on", "--method",
                          "dflash")
    assert result.returncode == 1 and report["server_prefix_caching"] is False
    assert ("the unit serves with prefix caching off" in result.stderr
            and "#54360/#51250" in result.stderr)


def test_prefix_cache_expected_off_reports_without_checking(cli, keyed, work):
    keyed.prefix = "off"
    result, report = _run(cli, keyed, work, "prefix-cache", "--expect", "off")
    assert result.returncode == 0 and report["passed"] is True and report["expected"] is False
    assert result.stdout.startswith("prefix caching off: not checked; 0 of 0 queried tokens hit")


def test_tool_call_passes_streaming_and_not(cli, keyed, work):
    result, report = _run(cli, keyed, work, "tool-call", "--parser", "qwen3_coder")
    assert result.returncode == 0, result.stderr
    assert report["parser"] == "qwen3_coder" and report["passed"] is True
    # the stream sent the arguments in fragments of 3 characters: joined back whole
    for mode in ("non-streaming", "streaming"):
        assert report["modes"][mode] == {"calls": [{"name": "get_weather",
                                                    "arguments": '{"city": "Paris"}'}],
                                         "problem": None}
    sent = [json.loads(b) for b in keyed.bodies if "tools" in json.loads(b)]
    assert [b.get("stream", False) for b in sent] == [False, True]
    assert all(b["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
               for b in sent)


@pytest.mark.parametrize(("mode", "problem"), [
    ("none", "the answer carries no tool call"),
    ("wrong_name", "the call is to 'get_time', not 'get_weather'"),
    ("bad_args", "its arguments do not parse as JSON"),
    ("no_city", "its arguments lack the required key 'city'"),
    ("refuse", "the server refused the forced tool call (HTTP 400"),
])
def test_tool_call_fails_in_one_line(cli, keyed, work, mode, problem):
    keyed.tool = mode
    result, report = _run(cli, keyed, work, "tool-call")
    assert result.returncode == 1 and report["passed"] is False
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("FAIL (forced get_weather call, parser none): ")
    for name in ("non-streaming", "streaming"):
        assert f"{name}: {problem}" in lines[0]
        assert report["modes"][name]["problem"].startswith(problem)


def test_bad_flags_are_refused_before_any_request(cli, keyed, work):
    for extra in (("--expect", "maybe"), ("--expect", "on", "--prompt-tokens", "10")):
        result, report = _run(cli, keyed, work, "prefix-cache", *extra)
        assert result.returncode == 2 and report is None and keyed.chats() == 0
        assert (result.stderr.startswith("sparkspec: error: ")
                and len(result.stderr.strip().splitlines()) == 1)


@pytest.mark.parametrize("value", ["yes", 1, 0.5, [], {}])
def test_the_registry_takes_prefix_cache_as_a_bool_or_null_only(value):
    from sparkspec.errors import UserError
    from sparkspec.registry.schema import check_verify

    assert check_verify({"prefix_cache": True}, "sparkspec_verify") == {"prefix_cache": True}
    assert check_verify({"prefix_cache": None, "min_tok_s": 3}, "v") == {"prefix_cache": None,
                                                                         "min_tok_s": 3}
    with pytest.raises(UserError, match=r"^sparkspec_verify.prefix_cache: .* is not true, false or "
                                        r"null \(null: expect hits where the unit serves with "
                                        r"prefix caching\); fix it$"):
        check_verify({"prefix_cache": value}, "sparkspec_verify")


def _one_error_line(result) -> str:
    """The CLI's single stderr line of a failure named by the check itself (no traceback, not the
    CLI's catch-all for unexpected input)."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "unexpected input" not in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("mode", "problem"), [
    ("delta_str", "a chunk's choices[] entry has the wrong shape"),
    ("choices_int", "a chunk's choices is a int, not a list"),
    ("pieces_str", "a delta.tool_calls is not a list"),
    ("piece_int", "a delta.tool_calls piece has the wrong shape"),
])
def test_tool_call_hostile_stream_fails_in_one_line(cli, keyed, work, mode, problem):
    keyed.tool = mode
    result, _ = _run(cli, keyed, work, "tool-call")
    assert result.returncode == 1
    assert _one_error_line(result) == f"sparkspec: error: {problem}" + {
        "delta_str": "; expected {delta: {...}} of an OpenAI chat.completion.chunk",
        "choices_int": "; expected an OpenAI chat.completion.chunk",
        "pieces_str": "; expected [{index, function}]",
        "piece_int": "; expected {index, function}"}[mode]


def test_tool_call_deeply_nested_arguments_fail_in_one_line(cli, keyed, work):
    keyed.tool = "deep_args"
    result, report = _run(cli, keyed, work, "tool-call")
    assert result.returncode == 1 and report["passed"] is False
    line = _one_error_line(result)
    assert line.startswith("FAIL (forced get_weather call, parser none): ")
    for name in ("non-streaming", "streaming"):
        assert report["modes"][name]["problem"].startswith(
            "its arguments do not parse as JSON (nests deeper than 64 levels)")


def test_judge_call_refuses_deep_arguments_without_recursing():
    from sparkspec.bench.checks import judge_call

    deep = "[" * 100_000 + "]" * 100_000
    assert judge_call([{"name": "get_weather", "arguments": deep}]).startswith(
        "its arguments do not parse as JSON (nests deeper than 64 levels): '[[[")
    assert judge_call([{"name": "get_weather", "arguments": '{"city": "Paris"}'}]) is None


@pytest.mark.parametrize("scrapes", [1, 2, 3])
def test_prefix_cache_counters_vanishing_later_fail_in_one_line(cli, keyed, work, scrapes):
    """The counters are there at the first scrape (else the check refuses up front) and gone at a
    later one (a server restarted or replaced mid-check): one line naming them, not a TypeError."""
    keyed.prefix_scrapes = scrapes
    result, report = _run(cli, keyed, work, "prefix-cache", "--expect", "on")
    assert result.returncode == 1 and report is None
    assert _one_error_line(result) == (
        f"sparkspec: error: {keyed.url}/metrics: has no vllm:prefix_cache_queries_total or "
        "vllm:prefix_cache_hits_total; a vLLM that does not count its prefix cache cannot be "
        "checked (vLLM >= 0.10 does)")
