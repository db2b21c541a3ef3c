"""Hostile input against `bench`, `check-output record|compare`, `report` and `model tiny`, in-process.

Every bad flag value and every malformed file is refused with one line ``sparkspec: error: ...`` and exit 2
before any request and before anything is written; a server whose stream is broken ends the run with one line
naming the URL and exit 1, with no output file and no temp file left. The server is a fake vLLM written here
(stdlib http.server on 127.0.0.1): it streams chat completions the way vLLM does, counts what it generated on
/metrics, records every Authorization header it sees, and misbehaves on request. Hypothesis feeds the stream
parser arbitrary data lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.badinput import fingerprint, refused_untouched, run

MODEL = "m"
KEY = "s3cr3t-KEY-4f9a1c"
TOKENS = 8  # the fake server generates at most this many tokens per request


def event(doc: object) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def text_chunk(content: object, finish: str | None = None) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]}


def usage(completion: object, prompt: int = 5) -> bytes:
    body = json.dumps({"id": "c", "object": "chat.completion.chunk", "model": MODEL, "choices": [],
                       "usage": {"prompt_tokens": prompt, "completion_tokens": "@@"}})
    return b"data: " + body.replace('"@@"', str(completion)).encode() + b"\n\n"


class QuietServer(ThreadingHTTPServer):
    """A client that hangs up early makes the handler fail; that is the test's point, not an error to print
    (it would land in the stderr the test captures)."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


class FakeVllm:
    """A fake vLLM OpenAI server; ``chat``, ``models`` and ``metrics`` pick how it (mis)behaves."""

    def __init__(self) -> None:
        self.chat = "ok"
        self.models = "ok"
        self.metrics = "ok"
        self.key: str | None = None
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization header)
        self.generated = 0
        self.prompted = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                fake.handle(self)

            def do_POST(self) -> None:
                fake.handle(self)

        self.httpd = QuietServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def reset(self) -> None:
        self.chat = self.models = self.metrics = "ok"
        self.key = None
        self.seen.clear()

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        auth = h.headers.get("Authorization")
        with self.lock:
            self.seen.append((h.path, auth))
        length = min(int(h.headers.get("Content-Length") or 0), 1 << 20)
        body = h.rfile.read(length) if length else b""
        if self.key is not None and auth != f"Bearer {self.key}":
            return self.reply(h, 401, b'{"error": "Unauthorized"}')
        if h.path == "/v1/models":
            return self.reply(h, 200, self.models_body())
        if h.path == "/metrics":
            return self.reply(h, 200, self.metrics_body(), "text/plain; version=0.0.4")
        if h.path == "/v1/chat/completions":
            return self.stream(h, json.loads(body), auth)
        return self.reply(h, 404, b"{}")

    @staticmethod
    def reply(h: BaseHTTPRequestHandler, status: int, body: bytes, ctype: str = "application/json") -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def models_body(self) -> bytes:
        entry = '{"id": "m", "root": "m", "max_model_len": 1024}'
        return {
            "ok": f'{{"object": "list", "data": [{entry}]}}',
            "deep": "[" * 50_000 + "]" * 50_000,
            "nan": '{"object": "list", "data": [{"id": "m", "max_model_len": NaN}]}',
            "id_int": '{"object": "list", "data": [{"id": 7}]}',
            "root_list": '{"object": "list", "data": [{"id": "m", "root": ["x"]}]}',
        }[self.models].encode()

    def metrics_body(self) -> bytes:
        gen = "NaN" if self.metrics == "nan" else f"{float(self.generated)}"
        if self.metrics == "garbage":
            return b"\x00\xff{{{ not prometheus\n"
        return (f'# TYPE vllm:generation_tokens_total counter\nvllm:generation_tokens_total{{model_name="m"}} {gen}\n'
                f'# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total{{model_name="m"}} '
                f"{float(self.prompted)}\n").encode()

    def stream(self, h: BaseHTTPRequestHandler, req: dict[str, Any], auth: str | None) -> None:
        mode = self.chat
        n = min(int(req.get("max_tokens", TOKENS)), TOKENS)
        if mode == "vanish":  # the server dies before it answers
            h.connection.shutdown(socket.SHUT_RDWR)
            return None
        if mode == "http_500_echo":
            return self.reply(h, 500, f"internal error; you sent Authorization: {auth}".encode())
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        if mode == "drop":
            h.send_header("Content-Length", "1000000")
        h.end_headers()
        pieces = [event(text_chunk(" tok")) for _ in range(n)]
        pieces.append(event(text_chunk("", "length")))
        tail = [usage(n), b"data: [DONE]\n\n"]
        broken = {
            "not_json": [b"data: {not json\n\n"],
            "array": [b"data: [1, 2]\n\n"],
            "choices_str": [event({"choices": "abc"})],
            "content_int": [event(text_chunk(5))],
            "error_event": [event({"error": {"message": "boom", "code": 500}})],
            "huge_line": [b"data: " + b"x" * (5 << 20)],
        }
        if mode in broken:
            pieces = pieces[:2] + broken[mode]
            tail = []
        elif mode == "no_done":
            tail = tail[:1]
        elif mode == "no_usage":
            tail = tail[1:]
        elif mode in ("usage_nan", "usage_str", "usage_huge", "usage_inf", "usage_negative"):
            value = {"usage_nan": "NaN", "usage_str": '"8"', "usage_huge": "1000000000", "usage_inf": "1e999",
                     "usage_negative": "-3"}[mode]
            tail = [usage(value), tail[1]]
        elif mode == "drop":
            pieces, tail = pieces[:2], []
        with self.lock:
            if mode == "ok":
                self.generated += n
                self.prompted += 5
        for piece in pieces + tail:
            h.wfile.write(piece)
            h.wfile.flush()
        if mode == "drop":
            h.connection.shutdown(socket.SHUT_RDWR)

    def chats(self) -> int:
        return sum(1 for path, _ in self.seen if path == "/v1/chat/completions")


@pytest.fixture(scope="module")
def server() -> Iterator[FakeVllm]:
    fake = FakeVllm()
    yield fake
    fake.httpd.shutdown()
    fake.httpd.server_close()


@pytest.fixture()
def fake(server: FakeVllm) -> FakeVllm:
    server.reset()
    return server


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    """A suite of two prompts, a 0600 key file, a reference and a bench result, all valid."""
    (tmp_path / "suite.jsonl").write_text('{"id": "a", "prompt": "Say hi."}\n{"id": "b", "prompt": "Count."}\n')
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    ref = {"format": "sparkspec-lossless-reference/1", "model": MODEL, "method": "baseline", "suite": "suite",
           "temperature": 0.0, "max_tokens": TOKENS, "enable_thinking": False,
           "outputs": [{"id": "a", "suite": "suite", "prompt": "Say hi.", "expect_json": False,
                        "text": " tok" * TOKENS}]}
    (tmp_path / "ref.json").write_text(json.dumps(ref))
    (tmp_path / "result.json").write_text(json.dumps(bench_result()))
    return tmp_path


def bench_result(**changes: Any) -> dict[str, Any]:
    doc = {"backend": "openai-chat", "method": "ngram", "served_model": {"id": "tiny", "root": "tiny",
           "max_model_len": 1024}, "model_id": "tiny", "suite": "all", "max_concurrency": 1, "temperature": 0.0,
           "completed": 3, "failed": 0, "output_throughput": 60.0, "per_request_tok_s_mean": 40.0,
           "per_request_tok_s_max": 45.0, "spec_decode_acceptance_rate": 70.0,
           "spec_decode_acceptance_length": 2.5, "partial": False, "error": None,
           "suites": {"structured": {"per_request_tok_s_mean": 41.0}, "open": {"per_request_tok_s_mean": 39.0}}}
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not DROP}


DROP = object()


def argv(command: str, fake: FakeVllm, work: Path, **flags: str | None) -> list[str]:
    """A valid command line of ``command``; ``flags`` replace (or, with None, drop) a flag's value."""
    server = {"--url": fake.url, "--model": MODEL, "--timeout": "20"}
    base: dict[str, dict[str, str]] = {
        "bench": server | {"--suite": str(work / "suite.jsonl"), "--concurrency": "1", "--requests": "2",
                           "--max-tokens": str(TOKENS), "--temperature": "0", "--method": "ngram",
                           "--unit": "sparkspec-vllm.service", "--output": str(work / "out.json")},
        "check-output record": server | {"--suite": str(work / "suite.jsonl"), "--max-tokens": str(TOKENS),
                                         "--method": "baseline", "--concurrency": "1",
                                         "--output": str(work / "out.json")},
        "check-output compare": server | {"--reference": str(work / "ref.json"), "--min-share": "1.0",
                                          "--method": "ngram", "--concurrency": "1",
                                          "--output": str(work / "out.json")},
        "report": {"--inputs": str(work / "result.json"), "--markdown": str(work / "out.md"),
                   "--plot": str(work / "out.png")},
        "model tiny": {"--out": str(work / "model"), "--seed": "0"},
    }
    args = command.split()
    for flag, value in (base[command] | flags).items():
        if value is not None:
            args += [flag, value]
    return args


# --- every flag of every command: bad values are refused before any request and any write -----------------

NUMBERS = {
    "--concurrency": ("0", "-1", "nan", "1e9", "99999999", "two", ""),
    "--requests": ("0", "-1", "inf", "99999999999", "1.5"),
    "--max-tokens": ("0", "-1", "nan", "10000000000", "x"),
    "--temperature": ("nan", "inf", "-inf", "-1", "1e308", "hot"),
    "--timeout": ("0", "-5", "nan", "inf", "1e12", "soon"),
}
SERVER_FLAGS = {
    "--url": ("ftp://127.0.0.1:8000", "http://", "127.0.0.1:8000", "http://127.0.0.1:99999",
              "http://user:pw@127.0.0.1:8000", "http://127.0.0.1:8000/?q=1", "http://127.0.0.1:8000\n", ""),
    "--model": ("", "a\nb", "x" * 1000),
}
LABELS = ("a\nb", "x" * 1000, "\x1b[31mred")


def cases() -> Iterator[Any]:
    def case(command: str, flag: str, value: str) -> Any:
        return pytest.param(command, flag, value, id=f"{command.replace(' ', '-')}{flag}={value[:12]!r}")

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
    yield from (case("check-output compare", "--min-share", v) for v in ("-0.1", "1.5", "nan", "inf", "most"))
    yield from (case("model tiny", "--seed", v) for v in ("-1", "nan", "1.5", "18446744073709551616", "x"))


@contextlib.contextmanager
def memory_ceiling(extra: int = 1 << 30) -> Iterator[None]:
    """Let this process map at most ``extra`` more bytes meanwhile: a huge count that a command takes at its
    word (a list of 10**11 requests) fails here with MemoryError instead of taking the machine down."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    mapped = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + extra if hard == resource.RLIM_INFINITY else min(mapped + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("command,flag,value", list(cases()))
def test_bad_flag_value_is_refused_before_anything(command: str, flag: str, value: str, fake: FakeVllm,
                                                   work: Path) -> None:
    with memory_ceiling():
        refused_untouched(argv(command, fake, work, **{flag: value}), [work], 2, match=re.escape(flag))
    assert fake.seen == [], "a refused command must not reach the server"


def test_valid_command_lines_succeed(fake: FakeVllm, work: Path) -> None:
    """The control for the table above: the same command lines with nothing replaced run and write."""
    for command in ("bench", "check-output record", "check-output compare"):
        out = run(*argv(command, fake, work))
        assert out.rc == 0, (command, out.stderr)
        assert json.loads((work / "out.json").read_text())["model" if "check" in command else "model_id"] == MODEL
        (work / "out.json").unlink()
    out = run(*argv("report", fake, work))
    assert out.rc == 0, out.stderr
    assert (work / "out.md").read_text().startswith("| Method |")
    assert (work / "out.png").read_bytes()[:4] == b"\x89PNG"


# --- outputs: never a symlink, a folder, an input, or a file some other tool wrote --------------------------

def _outputs() -> Iterator[Any]:
    yield pytest.param("bench", "--output", "dir", id="bench-output-dir")
    yield pytest.param("bench", "--output", "link", id="bench-output-symlink")
    yield pytest.param("bench", "--output", "foreign", id="bench-output-foreign-file")
    yield pytest.param("bench", "--output", "suite", id="bench-output-is-the-suite")
    yield pytest.param("bench", "--output", "key", id="bench-output-is-the-key-file")
    yield pytest.param("check-output record", "--output", "foreign", id="record-output-foreign-file")
    yield pytest.param("check-output record", "--output", "link", id="record-output-symlink")
    yield pytest.param("check-output compare", "--output", "reference", id="compare-output-is-the-reference")
    yield pytest.param("check-output compare", "--output", "dir", id="compare-output-dir")
    yield pytest.param("report", "--markdown", "input", id="report-markdown-is-an-input")
    yield pytest.param("report", "--markdown", "foreign", id="report-markdown-foreign-file")
    yield pytest.param("report", "--markdown", "link", id="report-markdown-symlink")
    yield pytest.param("report", "--plot", "markdown", id="report-plot-is-the-markdown")
    yield pytest.param("report", "--plot", "foreign", id="report-plot-foreign-file")
    yield pytest.param("report", "--plot", "under-a-file", id="report-plot-under-a-file")


@pytest.mark.parametrize("command,flag,kind", list(_outputs()))
def test_output_that_is_not_ours_to_replace_is_refused(command: str, flag: str, kind: str, fake: FakeVllm,
                                                       work: Path, tmp_path_factory: pytest.TempPathFactory
                                                       ) -> None:
    flags: dict[str, str] = {}
    outside = tmp_path_factory.mktemp("outside") / "victim.txt"
    outside.write_text("not yours\n")
    (work / "precious.json").write_text('{"mine": true}\n')
    (work / "dir").mkdir()
    (work / "link").symlink_to(outside)
    target = {"dir": work / "dir", "link": work / "link", "foreign": work / "precious.json",
              "suite": work / "suite.jsonl", "reference": work / "ref.json", "input": work / "result.json",
              "markdown": work / "out.md", "under-a-file": work / "precious.json" / "x.png", "key": work / "key"}[kind]
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
    """Re-running over its own outputs is what the verify role does every time: allowed, and atomic."""
    for command in ("bench", "check-output record", "check-output compare", "report"):
        first = run(*argv(command, fake, work))
        assert first.rc == 0, (command, first.stderr)
        again = run(*argv(command, fake, work))
        assert again.rc == 0, (command, again.stderr)
        if command != "report":
            (work / "out.json").unlink()
    assert not [p.name for p in work.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("command", ["bench", "check-output record", "check-output compare", "report"])
def test_disk_full_at_the_write_leaves_nothing(command: str, fake: FakeVllm, work: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The run succeeded but its output cannot be written: exit 1, one line, no temp file, no folder made."""
    import errno

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    flag = "--markdown" if command == "report" else "--output"
    refused_untouched(argv(command, fake, work, **{flag: str(work / "new" / "out")}), [work], 1,
                      match=r"new/out: cannot write \(No space left on device\)")


# --- files the commands read: wrong types, missing keys, deep nesting, truncation, non-regular files -------

SUITE_LINES = {
    "not-json": "{prompt: hi}",
    "array": '["hi"]',
    "prompt-missing": '{"id": "a"}',
    "prompt-int": '{"prompt": 5}',
    "prompt-empty": '{"prompt": ""}',
    "id-int": '{"id": 3, "prompt": "hi"}',
    "id-newline": '{"id": "a\\nb", "prompt": "hi"}',
    "expect-json-str": '{"prompt": "hi", "expect_json": "yes"}',
    "category-list": '{"prompt": "hi", "category": ["x"]}',
    "nan": '{"prompt": "hi", "weight": NaN}',
    "deep": '{"prompt": "hi", "x": ' + "[" * 5000 + "]" * 5000 + "}",
    "truncated": '{"id": "a", "prompt": "Say h',
}


@pytest.mark.parametrize("command", ["bench", "check-output record"])
@pytest.mark.parametrize("name", list(SUITE_LINES))
def test_malformed_suite_is_refused(command: str, name: str, fake: FakeVllm, work: Path) -> None:
    (work / "suite.jsonl").write_text('{"id": "ok", "prompt": "fine"}\n' + SUITE_LINES[name] + "\n")
    refused_untouched(argv(command, fake, work), [work], 2, match=r"suite\.jsonl:2")
    assert fake.seen == []


@pytest.mark.parametrize("kind", ["empty", "blank-lines", "fifo", "dir", "binary", "duplicate-ids"])
def test_suite_that_is_not_a_suite_is_refused(kind: str, fake: FakeVllm, work: Path) -> None:
    suite = work / "s.jsonl"
    if kind == "fifo":
        os.mkfifo(suite)
    elif kind == "dir":
        suite.mkdir()
    elif kind == "binary":
        suite.write_bytes(b'{"prompt": "\xff\xfe"}\n')
    elif kind == "duplicate-ids":
        suite.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    else:
        suite.write_text("" if kind == "empty" else "\n  \n")
    command = "check-output record" if kind == "duplicate-ids" else "bench"
    refused_untouched(argv(command, fake, work, **{"--suite": str(suite)}), [work], 2, match=r"s\.jsonl")
    assert fake.seen == []


RESULTS: dict[str, Any] = {
    "not-an-object": [1, 2],
    "completed-missing": bench_result(completed=DROP),
    "mean-missing": bench_result(per_request_tok_s_mean=DROP),
    "completed-str": bench_result(completed="3"),
    "completed-negative": bench_result(completed=-1),
    "mean-str": bench_result(per_request_tok_s_mean="fast"),
    "mean-bool": bench_result(per_request_tok_s_mean=True),
    "peak-list": bench_result(per_request_tok_s_max=[1]),
    "rate-str": bench_result(spec_decode_acceptance_rate="70%"),
    "length-dict": bench_result(spec_decode_acceptance_length={"x": 1}),
    "throughput-str": bench_result(output_throughput="60"),
    "method-int": bench_result(method=5),
    "served-model-str": bench_result(served_model="tiny"),
    "served-id-int": bench_result(served_model={"id": 1}),
    "suites-list": bench_result(suites=["structured"]),
    "suite-mean-str": bench_result(suites={"open": {"per_request_tok_s_mean": "x"}}),
    "failed-float": bench_result(failed=0.5),
    "partial-str": bench_result(partial="no"),
    "error-int": bench_result(error=3),
}
RAW_RESULTS = {
    "nan": json.dumps(bench_result()).replace("40.0", "NaN"),
    "infinity": json.dumps(bench_result()).replace("40.0", "Infinity"),
    "overflow": json.dumps(bench_result()).replace("40.0", "1e999"),
    "deep": '{"completed": 1, "per_request_tok_s_mean": 1.0, "x": ' + "[" * 5000 + "]" * 5000 + "}",
    "truncated": json.dumps(bench_result())[:-20],
    "binary": '{"method": "\xff"}',
    "empty": "",
}


@pytest.mark.parametrize("name", list(RESULTS) + list(RAW_RESULTS))
def test_malformed_bench_result_is_refused_by_report(name: str, fake: FakeVllm, work: Path) -> None:
    bad = work / "bad.json"
    if name in RESULTS:
        bad.write_text(json.dumps(RESULTS[name]))
    elif name == "binary":
        bad.write_bytes(b'{"method": "\xff"}')
    else:
        bad.write_text(RAW_RESULTS[name])
    # the good file first: nothing may be written for it either
    refused_untouched(argv("report", fake, work, **{"--inputs": None}) + ["--inputs", str(work / "result.json"),
                                                                       str(bad)], [work], 2, match=r"bad\.json")


@pytest.mark.parametrize("kind", ["fifo", "dir", "missing"])
def test_report_input_that_is_not_a_file_is_refused(kind: str, fake: FakeVllm, work: Path) -> None:
    bad = work / "bad.json"
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "dir":
        bad.mkdir()
    refused_untouched(argv("report", fake, work, **{"--inputs": str(bad)}), [work], 2, match=r"bad\.json")


def test_report_rows_stay_rows_whatever_the_strings(fake: FakeVllm, work: Path) -> None:
    """A method or error string with newlines, pipes or escapes cannot add rows or break the table."""
    (work / "result.json").write_text(json.dumps(bench_result(
        method="evil\n| injected | row |\n", error="line1\nline2\r|x", partial=True,
        served_model={"id": "a|b\x1b[2J"}, suites={"o\npen": {"per_request_tok_s_mean": 1.0}})))
    out = run(*argv("report", fake, work))
    assert out.rc == 0, out.stderr
    lines = (work / "out.md").read_text().splitlines()
    assert len(lines) == 3 and lines[2].startswith("| evil")
    assert "\x1b" not in lines[2] and lines[2].count(" | ") == 5


def _reference(**changes: Any) -> dict[str, Any]:
    doc = {"format": "sparkspec-lossless-reference/1", "model": MODEL, "method": "baseline", "max_tokens": TOKENS,
           "enable_thinking": False, "outputs": [{"id": "a", "suite": "s", "prompt": "p", "expect_json": False,
                                                   "text": "t"}]}
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not DROP}


def _output(**changes: Any) -> dict[str, Any]:
    return _reference(outputs=[{k: v for k, v in ({"id": "a", "suite": "s", "prompt": "p", "expect_json": False,
                                                   "text": "t"} | changes).items() if v is not DROP}])


REFERENCES: dict[str, Any] = {
    "format-missing": _reference(format=DROP),
    "format-other": _reference(format="something/2"),
    "outputs-missing": _reference(outputs=DROP),
    "outputs-empty": _reference(outputs=[]),
    "outputs-dict": _reference(outputs={"a": 1}),
    "output-str": _reference(outputs=["a"]),
    "id-int": _output(id=1),
    "id-empty": _output(id=""),
    "prompt-missing": _output(prompt=DROP),
    "prompt-int": _output(prompt=1),
    "text-missing": _output(text=DROP),
    "text-null": _output(text=None),
    "expect-json-str": _output(expect_json="yes"),
    "max-tokens-str": _reference(max_tokens="8"),
    "max-tokens-zero": _reference(max_tokens=0),
    "max-tokens-huge": _reference(max_tokens=10**12),
    "max-tokens-float": _reference(max_tokens=8.5),
    "thinking-str": _reference(enable_thinking="no"),
    "duplicate-ids": _reference(outputs=_output()["outputs"] * 2),
}
RAW_REFERENCES = {
    "nan": json.dumps(_reference()).replace(f'"max_tokens": {TOKENS}', '"max_tokens": NaN'),
    "deep": json.dumps(_reference(extra=0)).replace('"extra": 0', '"extra": ' + "[" * 5000 + "]" * 5000),
    "truncated": json.dumps(_reference())[:40],
    "not-json": "format: sparkspec",
}


@pytest.mark.parametrize("name", list(REFERENCES) + list(RAW_REFERENCES) + ["fifo", "dir"])
def test_malformed_reference_is_refused(name: str, fake: FakeVllm, work: Path) -> None:
    ref = work / "bad-ref.json"
    if name == "fifo":
        os.mkfifo(ref)
    elif name == "dir":
        ref.mkdir()
    elif name in REFERENCES:
        ref.write_text(json.dumps(REFERENCES[name]))
    else:
        ref.write_text(RAW_REFERENCES[name])
    refused_untouched(argv("check-output compare", fake, work, **{"--reference": str(ref)}), [work], 2,
                      match=r"bad-ref\.json")
    assert fake.seen == []


# --- the server: malformed answers before the run (exit 2), broken streams during it (exit 1) --------------

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
    "usage_inf": r"completion_tokens",
    "usage_negative": r"completion_tokens",
    "error_event": r"server error",
    "http_500_echo": r"HTTP 500",
    "drop": r"stream broke",
    "vanish": r"stream broke",
    "huge_line": r"longer than",
}


@pytest.mark.parametrize("command", ["bench", "check-output record", "check-output compare"])
@pytest.mark.parametrize("mode", list(STREAMS))
def test_broken_stream_ends_the_run_in_one_line_and_writes_nothing(command: str, mode: str, fake: FakeVllm,
                                                                   work: Path) -> None:
    fake.chat = mode
    fake.key = KEY
    out = refused_untouched(argv(command, fake, work), [work], 1,
                            match=rf"^sparkspec: error: {fake.url}/v1/chat/completions: .*{STREAMS[mode]}",
                            env={"SPARKSPEC_API_KEY": KEY})
    assert KEY not in out.stderr + out.stdout
    assert fake.chats() >= 1


# --- the API key: from a 0600 file or the environment, never argv, never written anywhere ------------------

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


def test_wrong_key_is_refused_in_one_line_naming_the_ways_to_give_it(fake: FakeVllm, work: Path) -> None:
    fake.key = "another-key"
    out = refused_untouched(argv("bench", fake, work, **{"--api-key-file": str(work / "key")}), [work], 2,
                            match=r"401.*--api-key-file.*SPARKSPEC_API_KEY")
    assert KEY not in out.stderr


@pytest.mark.parametrize("form", [["--api-key", KEY], [f"--api-key={KEY}"], ["--api-ke", KEY], ["--api", KEY]])
@pytest.mark.parametrize("command", ["bench", "check-output record", "check-output compare"])
def test_key_on_the_command_line_is_refused_without_echoing_it(form: list[str], command: str, fake: FakeVllm,
                                                               work: Path) -> None:
    out = refused_untouched(argv(command, fake, work) + form, [work], 2,
                            match=r"--api-key-file")
    assert KEY not in out.stderr and fake.seen == []


@pytest.mark.parametrize("kind,words", [
    ("world-readable", r"chmod 600"), ("empty", r"empty"), ("newline-only", r"empty"),
    ("two-lines", r"one line"), ("control", r"visible ASCII"), ("fifo", r"not a regular file"),
    ("dir", r"not a regular file"), ("missing", r"not found"), ("huge", r"bytes")])
def test_bad_key_file_is_refused_without_echoing_it(kind: str, words: str, fake: FakeVllm, work: Path) -> None:
    key = work / "bad-key"
    content = {"empty": "", "newline-only": "\n", "two-lines": f"{KEY}\nsecond\n", "control": f"{KEY}\x07\n",
               "huge": KEY * 1000, "world-readable": KEY}.get(kind)
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
def test_bad_key_in_the_environment_is_refused_without_echoing_it(value: str, fake: FakeVllm, work: Path) -> None:
    out = refused_untouched(argv("bench", fake, work), [work], 2,
                            match=r"SPARKSPEC_API_KEY", env={"SPARKSPEC_API_KEY": value})
    assert value not in out.stderr and fake.seen == []


def test_group_readable_key_file_is_accepted(fake: FakeVllm, work: Path) -> None:
    (work / "key").chmod(0o640)
    fake.key = KEY
    assert run(*argv("bench", fake, work, **{"--api-key-file": str(work / "key")})).rc == 0


# --- model tiny: never writes into a folder it did not create ---------------------------------------------

def test_tiny_model_refuses_a_folder_it_did_not_write(fake: FakeVllm, work: Path) -> None:
    model = work / "real-model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["SomethingPrecious"]}\n')
    (model / "model.safetensors").write_bytes(b"weights of value")
    refused_untouched(["model", "tiny", "--out", str(model)], [work], 2, match=r"--out")


def test_tiny_model_refuses_a_symlink_and_a_file(fake: FakeVllm, work: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    target = tmp_path_factory.mktemp("elsewhere")
    (work / "link").symlink_to(target)
    refused_untouched(["model", "tiny", "--out", str(work / "link")], [work, target], 2, match=r"--out.*link")
    refused_untouched(["model", "tiny", "--out", str(work / "key")], [work], 2, match=r"--out")


def test_tiny_model_rewrites_its_own_folder_and_an_empty_one(work: Path) -> None:
    model = work / "model"
    model.mkdir()
    first = run("model", "tiny", "--out", str(model), "--json")
    assert first.rc == 0 and json.loads(first.stdout.splitlines()[-1])["changed"] is True, first.stderr
    again = run("model", "tiny", "--out", str(model), "--json")
    assert again.rc == 0 and json.loads(again.stdout.splitlines()[-1])["changed"] is False, again.stderr
    other = run("model", "tiny", "--out", str(model), "--seed", "3", "--json")
    assert other.rc == 0 and json.loads(other.stdout.splitlines()[-1])["changed"] is True, other.stderr
    assert sorted(p.name for p in model.iterdir()) == sorted(
        ["model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json", "special_tokens_map.json",
         "generation_config.json"])


def test_tiny_model_failure_leaves_nothing(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full while writing: exit 1, and the folder it was creating is gone."""
    import errno

    from sparkspec import tinymodel

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tinymodel, "_dump", full)
    before = fingerprint(work)
    out = run("model", "tiny", "--out", str(work / "new" / "model"))
    assert out.rc == 1 and out.stderr.startswith("sparkspec: error: ") and out.stderr.count("\n") == 1, out.stderr
    assert "No space left" in out.stderr and fingerprint(work) == before




# --- the stream parser under arbitrary input ---------------------------------------------------------------

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                   max_size=4), max_leaves=20)
COUNT = st.integers(0, TOKENS) | JSON
CHOICE = st.fixed_dictionaries({"delta": st.fixed_dictionaries({"content": st.text(max_size=8) | st.none() | JSON})
                                | JSON, "finish_reason": st.none() | st.text(max_size=8) | JSON}) | JSON
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
    """Whatever a server sends, the parser folds it in or raises StreamError: never another exception, and what
    it keeps has the types and bounds the figures rely on."""
    from sparkspec.bench import ChunkParser, RequestResult, StreamError
    from sparkspec.suites import Prompt

    parser = ChunkParser(RequestResult(Prompt("p", "s", "c", "x")), 0.0, TOKENS, KEY)
    tail = [usage(TOKENS)[len(b"data: "):].strip(), b"[DONE]"]  # so that most runs reach finish()
    for line in lines + tail:  # a real stream stops at the first StreamError; going on explores more states
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
