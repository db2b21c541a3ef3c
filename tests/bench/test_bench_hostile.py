"""Hostile input against `bench`, `check-output`, `check answers|needle` and `report`, in-process:
flags, outputs, the server's answers and streams, the API key, and the stream parser under
hypothesis; each refused in one line before anything is written (docs/design.md, "Module notes")."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.badinput import refused_untouched, run

from .fakevllm import KEY, MODEL, TOKENS, FakeVllm, argv, usage

# --- every flag of every command: bad values are refused before any request and any write ---------

NUMBERS = {
    "--concurrency": ("0", "-1", "nan", "1e9", "99999999", "two", ""),
    "--requests": ("0", "-1", "inf", "99999999999", "1.5"),
    "--max-tokens": ("0", "-1", "nan", "10000000000", "x"),
    "--temperature": ("nan", "inf", "-inf", "-1", "1e308", "hot"),
    "--timeout": ("0", "-5", "nan", "inf", "1e12", "soon"),
}
SERVER_FLAGS = {
    "--url": ("ftp://127.0.0.1:8000", "http://", "127.0.0.1:8000", "http://127.0.0.1:99999",
              "http://user:pw@127.0.0.1:8000", "http://127.0.0.1:8000/?q=1",
              "http://127.0.0.1:8000\n", ""),
    "--model": ("", "a\nb", "x" * 1000),
}
LABELS = ("a\nb", "x" * 1000, "\x1b[31mred")


def cases() -> Iterator[Any]:
    def case(command: str, flag: str, value: str) -> Any:
        return pytest.param(command, flag, value,
                            id=f"{command.replace(' ', '-')}{flag}={value[:12]!r}")

    for command in ("bench", "check-output record", "check-output compare"):
        for flag, values in SERVER_FLAGS.items():
            yield from (case(command, flag, v) for v in values)
        yield from (case(command, "--timeout", v) for v in NUMBERS["--timeout"])
        yield from (case(command, "--concurrency", v) for v in NUMBERS["--concurrency"])
        yield from (case(command, "--method", v) for v in LABELS)
    for flag in ("--requests", "--max-tokens", "--temperature"):
        yield from (case("bench", flag, v) for v in NUMBERS[flag])
    yield from (case("check-output record", "--max-tokens", v) for v in NUMBERS["--max-tokens"])
    yield from (case("bench", "--unit", v) for v in LABELS)
    for command in ("bench", "check-output record"):
        yield from (case(command, "--suite", v) for v in ("nope", ""))
    yield from (case("check-output compare", "--min-share", v)
                for v in ("-0.1", "1.5", "nan", "inf", "most"))
    yield from (case("model tiny", "--seed", v)
                for v in ("-1", "nan", "1.5", "18446744073709551616", "x"))


@contextlib.contextmanager
def memory_ceiling(extra: int = 1 << 30) -> Iterator[None]:
    """Let this process map at most ``extra`` more bytes meanwhile: a huge count that a command
    takes at its word (a list of 10**11 requests) fails here with MemoryError instead of taking the
    machine down."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + extra if hard == resource.RLIM_INFINITY else min(mapped + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("command,flag,value", list(cases()))
def test_bad_flag_value_is_refused_before_anything(command: str, flag: str, value: str,
                                                   fake: FakeVllm, work: Path) -> None:
    with memory_ceiling():
        refused_untouched(argv(command, fake, work, **{flag: value}), [work], 2,
                          match=re.escape(flag))
    assert fake.seen == [], "a refused command must not reach the server"


def test_valid_command_lines_succeed(fake: FakeVllm, work: Path) -> None:
    """The control for the table above: the same command lines with nothing replaced run and
    write."""
    for command in ("bench", "check-output record", "check-output compare"):
        out = run(*argv(command, fake, work))
        assert out.rc == 0, (command, out.stderr)
        assert json.loads((work / "out.json").read_text())["model" if "check" in command
                                                           else "model_id"] == MODEL
        (work / "out.json").unlink()
    out = run(*argv("report", fake, work))
    assert out.rc == 0, out.stderr
    assert (work / "out.md").read_text().startswith("| Method |")
    assert (work / "out.png").read_bytes()[:4] == b"\x89PNG"


# --- outputs: never a symlink, a folder, an input, or a file some other tool wrote ----------------

def _outputs() -> Iterator[Any]:
    yield pytest.param("bench", "--output", "dir", id="bench-output-dir")
    yield pytest.param("bench", "--output", "link", id="bench-output-symlink")
    yield pytest.param("bench", "--output", "foreign", id="bench-output-foreign-file")
    yield pytest.param("bench", "--output", "suite", id="bench-output-is-the-suite")
    yield pytest.param("bench", "--output", "key", id="bench-output-is-the-key-file")
    yield pytest.param("check-output record", "--output", "foreign",
                       id="record-output-foreign-file")
    yield pytest.param("check-output record", "--output", "link", id="record-output-symlink")
    yield pytest.param("check-output compare", "--output", "reference",
                       id="compare-output-is-the-reference")
    yield pytest.param("check-output compare", "--output", "dir", id="compare-output-dir")
    yield pytest.param("report", "--markdown", "input", id="report-markdown-is-an-input")
    yield pytest.param("report", "--markdown", "foreign", id="report-markdown-foreign-file")
    yield pytest.param("report", "--markdown", "link", id="report-markdown-symlink")
    yield pytest.param("report", "--plot", "markdown", id="report-plot-is-the-markdown")
    yield pytest.param("report", "--plot", "foreign", id="report-plot-foreign-file")
    yield pytest.param("report", "--plot", "under-a-file", id="report-plot-under-a-file")


@pytest.mark.parametrize("command,flag,kind", list(_outputs()))
def test_output_that_is_not_ours_to_replace_is_refused(
        command: str, flag: str, kind: str, fake: FakeVllm, work: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    flags: dict[str, str] = {}
    outside = tmp_path_factory.mktemp("outside") / "victim.txt"
    outside.write_text("not yours\n")
    (work / "precious.json").write_text('{"mine": true}\n')
    (work / "dir").mkdir()
    (work / "link").symlink_to(outside)
    target = {"dir": work / "dir", "link": work / "link", "foreign": work / "precious.json",
              "suite": work / "suite.jsonl", "reference": work / "ref.json",
              "input": work / "result.json",
              "markdown": work / "out.md", "under-a-file": work / "precious.json" / "x.png",
              "key": work / "key"}[kind]
    if kind == "key":
        flags["--api-key-file"] = str(work / "key")
    if flag == "--markdown" and kind == "foreign":
        target = work / "notes.md"
        target.write_text("# my notes\n")
    if flag == "--plot" and kind == "foreign":
        target = work / "photo.png"
        target.write_bytes(b"\x89PNG\r\n\x1a\n someone's picture")
    flags[flag] = str(target)
    refused_untouched(argv(command, fake, work, **flags), [work, outside.parent], 2,
                      match=re.escape(flag))
    assert fake.chats() == 0


def test_outputs_of_our_own_are_replaced(fake: FakeVllm, work: Path) -> None:
    """Re-running over its own outputs is what the verify role does every time: allowed, and
    atomic."""
    for command in ("bench", "check-output record", "check-output compare", "report"):
        first = run(*argv(command, fake, work))
        assert first.rc == 0, (command, first.stderr)
        again = run(*argv(command, fake, work))
        assert again.rc == 0, (command, again.stderr)
        if command != "report":
            (work / "out.json").unlink()
    assert not [p.name for p in work.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("command",
                         ["bench", "check-output record", "check-output compare", "report"])
def test_disk_full_at_the_write_leaves_nothing(command: str, fake: FakeVllm, work: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The run succeeded but its output cannot be written: exit 1, one line, no temp file, no folder
    made."""
    import errno

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    flag = "--markdown" if command == "report" else "--output"
    refused_untouched(argv(command, fake, work, **{flag: str(work / "new" / "out")}), [work], 1,
                      match=r"new/out: cannot write \(No space left on device\)")


# --- the server: malformed answers before the run (exit 2), broken streams during it (exit 1) -----

@pytest.mark.parametrize("mode", ["deep", "nan", "id_int", "root_list"])
def test_model_list_of_the_wrong_shape_is_refused(mode: str, fake: FakeVllm, work: Path) -> None:
    fake.models = mode
    refused_untouched(argv("bench", fake, work), [work], 2, match=r"/v1/models")
    assert fake.chats() == 0


@pytest.mark.parametrize("mode", ["nan", "garbage"])
def test_metrics_that_are_not_counters_are_refused(mode: str, fake: FakeVllm, work: Path) -> None:
    fake.metrics = mode
    refused_untouched(argv("bench", fake, work), [work], 2, match=r"/metrics")
    assert fake.chats() == 0


STREAMS = {
    "not_json": r"not JSON",
    "array": r"shape",
    "choices_str": r"shape",
    "content_int": r"shape",
    "no_done": r"ended before \[DONE\]",
    "no_usage": r"no usage",
    "usage_nan": r"NaN",
    "usage_str": r"completion_tokens",
    "usage_huge": r"completion_tokens",
    "usage_inf": r"not a finite number",
    "usage_negative": r"completion_tokens",
    "error_event": r"server error",
    "http_500_echo": r"HTTP 500",
    "drop": r"stream broke",
    "vanish": r"stream broke",
    "huge_line": r"longer than",
}


@pytest.mark.parametrize("command", ["bench", "check-output record", "check-output compare",
                                     "check answers", "check needle"])
@pytest.mark.parametrize("mode", list(STREAMS))
def test_broken_stream_ends_the_run_in_one_line_and_writes_nothing(
        command: str, mode: str, fake: FakeVllm, work: Path) -> None:
    fake.chat = mode
    fake.key = KEY
    out = refused_untouched(argv(command, fake, work), [work], 1,
                            match=rf"^sparkspec: error: {fake.url}/v1/chat/completions: "
                                  rf".*{STREAMS[mode]}",
                            env={"SPARKSPEC_API_KEY": KEY})
    assert KEY not in out.stderr + out.stdout
    assert fake.chats() >= 1


@pytest.mark.parametrize("command", ["bench", "check-output record", "check-output compare"])
@pytest.mark.parametrize("mode", ["keepalive", "trickle"])
def test_timeout_is_the_whole_requests_deadline(command: str, mode: str, fake: FakeVllm,
                                                work: Path) -> None:
    fake.chat = mode  # the server keeps the stream alive for 8 s and never finishes it
    start = time.monotonic()
    refused_untouched(argv(command, fake, work, **{"--timeout": "1"}), [work], 1,
                      match=rf"^sparkspec: error: {fake.url}/v1/chat/completions: "
                            r".*1(\.0)? s.*--timeout")
    assert time.monotonic() - start < 5


def test_key_echoed_in_another_case_is_redacted(fake: FakeVllm, work: Path) -> None:
    fake.chat = "http_401_lower"
    out = refused_untouched(argv("bench", fake, work), [work], 1, match=r"HTTP 401",
                            env={"SPARKSPEC_API_KEY": KEY})
    assert KEY.lower() not in out.stderr.lower()


@pytest.mark.parametrize("tail", ["/?key=SECRET", "?key=SECRET", "/#SECRET", "/?", "#"])
@pytest.mark.parametrize("command", ["bench", "check-output record"])
def test_url_with_a_query_or_fragment_is_refused_without_echoing_it(
        tail: str, command: str, fake: FakeVllm, work: Path) -> None:
    out = refused_untouched(argv(command, fake, work, **{"--url": fake.url + tail}), [work], 2,
                            match=r"--url.*query string or fragment")
    assert "SECRET" not in out.stderr and fake.seen == []


# --- the API key: from a 0600 file or the environment, never argv, never written anywhere ---------

def test_key_from_file_reaches_the_server_and_nothing_else(fake: FakeVllm, work: Path) -> None:
    fake.key = KEY
    out = run(*argv("bench", fake, work, **{"--api-key-file": str(work / "key")}), "--json")
    assert out.rc == 0, out.stderr
    assert fake.seen and {auth for _, auth in fake.seen} == {f"Bearer {KEY}"}
    assert {path for path, _ in fake.seen} >= {"/v1/models", "/metrics", "/v1/chat/completions"}
    assert KEY not in out.stdout + out.stderr
    for path in work.rglob("*"):
        if path.is_file() and path.name != "key":
            assert KEY.encode() not in path.read_bytes(), path


def test_key_from_the_environment(fake: FakeVllm, work: Path) -> None:
    fake.key = KEY
    out = run(*argv("check-output record", fake, work), env={"SPARKSPEC_API_KEY": KEY})
    assert out.rc == 0, out.stderr
    assert {auth for _, auth in fake.seen} == {f"Bearer {KEY}"}
    assert KEY.encode() not in (work / "out.json").read_bytes()


def test_wrong_key_is_refused_in_one_line_naming_the_ways_to_give_it(fake: FakeVllm,
                                                                     work: Path) -> None:
    fake.key = "another-key"
    out = refused_untouched(argv("bench", fake, work, **{"--api-key-file": str(work / "key")}),
                            [work], 2, match=r"401.*--api-key-file.*SPARKSPEC_API_KEY")
    assert KEY not in out.stderr


@pytest.mark.parametrize("form",
                         [["--api-key", KEY], [f"--api-key={KEY}"], ["--api-ke", KEY],
                          ["--api", KEY]])
@pytest.mark.parametrize("command", ["bench", "check-output record", "check-output compare"])
def test_key_on_the_command_line_is_refused_without_echoing_it(
        form: list[str], command: str, fake: FakeVllm, work: Path) -> None:
    # the full flag is refused with the fix; abbreviations are unknown options (argparse
    # abbreviations are off)
    out = refused_untouched(argv(command, fake, work) + form, [work], 2,
                            match=r"--api-key-file" if form[0].startswith("--api-key")
                            else r"unrecognized.*--api")
    assert KEY not in out.stderr and fake.seen == []


@pytest.mark.parametrize("kind,words", [
    ("world-readable", r"chmod 600"), ("empty", r"empty"), ("newline-only", r"empty"),
    ("two-lines", r"one line"), ("control", r"visible ASCII"), ("fifo", r"not a regular file"),
    ("dir", r"not a regular file"), ("missing", r"not found"), ("huge", r"bytes")])
def test_bad_key_file_is_refused_without_echoing_it(kind: str, words: str, fake: FakeVllm,
                                                    work: Path) -> None:
    key = work / "bad-key"
    content = {"empty": "", "newline-only": "\n", "two-lines": f"{KEY}\nsecond\n",
               "control": f"{KEY}\x07\n", "huge": KEY * 1000, "world-readable": KEY}.get(kind)
    if kind == "fifo":
        os.mkfifo(key, 0o600)
    elif kind == "dir":
        key.mkdir()
    elif content is not None:
        key.write_text(content)
        key.chmod(0o644 if kind == "world-readable" else 0o600)
    out = refused_untouched(argv("bench", fake, work, **{"--api-key-file": str(key)}), [work], 2,
                            match=rf"bad-key.*{words}")
    assert KEY not in out.stderr and fake.seen == []


@pytest.mark.parametrize("value", ["a\nb", "key with\x01control", "ünïcode"])
def test_bad_key_in_the_environment_is_refused_without_echoing_it(value: str, fake: FakeVllm,
                                                                  work: Path) -> None:
    out = refused_untouched(argv("bench", fake, work), [work], 2,
                            match=r"SPARKSPEC_API_KEY", env={"SPARKSPEC_API_KEY": value})
    assert value not in out.stderr and fake.seen == []


def test_group_readable_key_file_is_accepted(fake: FakeVllm, work: Path) -> None:
    (work / "key").chmod(0o640)
    fake.key = KEY
    assert run(*argv("bench", fake, work, **{"--api-key-file": str(work / "key")})).rc == 0


# --- the stream parser under arbitrary input ------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40)
                    | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
COUNT = st.integers(0, TOKENS) | JSON
DELTA = st.fixed_dictionaries({"content": st.text(max_size=8) | st.none() | JSON})
CHOICE = st.fixed_dictionaries({"delta": DELTA | JSON,
                                "finish_reason": st.none() | st.text(max_size=8) | JSON}) | JSON
CHUNKISH = st.one_of(
    st.fixed_dictionaries({"choices": st.lists(CHOICE, min_size=1, max_size=2) | JSON}),
    st.fixed_dictionaries({"choices": st.just([]), "usage": st.fixed_dictionaries(
        {"completion_tokens": COUNT, "prompt_tokens": COUNT}) | JSON}),
    st.fixed_dictionaries({"error": JSON}),
    JSON)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.one_of(CHUNKISH.map(lambda d: json.dumps(d).encode()), st.binary(max_size=64),
                          st.just(b"[DONE]")), max_size=6))
def test_stream_parser_takes_any_data_lines_or_says_what_is_wrong(lines: list[bytes]) -> None:
    """Whatever a server sends, the parser folds it in or raises StreamError: never another
    exception, and what it keeps has the types and bounds the figures rely on."""
    from sparkspec.bench.client import ChunkParser, RequestResult, StreamError
    from sparkspec.bench.suites import Prompt

    parser = ChunkParser(RequestResult(Prompt("p", "s", "c", "x")), 0.0, TOKENS, KEY)
    tail = [usage(TOKENS)[len(b"data: "):].strip(), b"[DONE]"]  # so that most runs reach finish()
    # a real stream stops at the first StreamError; going on explores more states
    for line in lines + tail:
        try:
            parser.feed(line)
        except StreamError as exc:
            assert str(exc) and "\n" not in str(exc)
        kept = parser.result
        assert type(kept.output_tokens) is int and 0 <= kept.output_tokens <= TOKENS
        assert type(kept.input_tokens) is int and kept.input_tokens >= 0
    try:
        result = parser.finish()
    except StreamError:
        return
    assert isinstance(result.text, str) and result.e2e >= 0
    assert result.finish_reason is None or result.finish_reason.isprintable()
