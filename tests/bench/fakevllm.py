"""A fake vLLM OpenAI server for the hostile-input tests (stdlib http.server on 127.0.0.1), and the
valid command lines those tests start from.

It streams chat completions the way vLLM does (chat.completion.chunk events, usage, [DONE]), counts
what it generated on /metrics, records every Authorization header it sees, and misbehaves on
request: ``chat``, ``models`` and ``metrics`` pick how.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

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
    """A client that hangs up early makes the handler fail; that is the test's point, not an error
    to print (it would land in the stderr the test captures)."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


def serve(handle: Any) -> QuietServer:
    """A QuietServer on a free loopback port whose GET and POST go to ``handle(request_handler)``,
    serving in a daemon thread (the fakes' one server)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            handle(self)

        def do_POST(self) -> None:
            handle(self)

    httpd = QuietServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


class FakeVllm:
    """A fake vLLM OpenAI server; ``chat``, ``models`` and ``metrics`` pick how it (mis)behaves."""

    def __init__(self) -> None:
        self.chat = "ok"
        self.models = "ok"
        self.metrics = "ok"
        self.key: str | None = None
        # tool calls: ok, none, wrong_name, bad_args, no_city, refuse; deep_args (arguments nested
        # 100000 deep); streamed only: delta_str ({"delta": "x"}), choices_int ({"choices": 5}),
        # pieces_str ({"tool_calls": "x"}), piece_int ({"tool_calls": [5]})
        self.tool = "ok"
        # /metrics answers with the prefix-cache counters, then none
        self.prefix_scrapes: int | None = None
        # prefix cache: grow (a repeated prompt hits), flat (never hits), off (caching off)
        self.prefix = "grow"
        self.queried = self.hit = 0.0
        self.prompts_seen: set[str] = set()
        self.bodies: list[bytes] = []  # every chat request's body
        self.seen: list[tuple[str, str | None]] = []  # (path, Authorization header)
        self.generated = 0
        self.prompted = 0
        # answers by content: answer(request, requests in flight) -> the text; its prompt tokens
        # are the messages' characters / 4
        self.answer: Any = None
        # with tools offered (tool_choice auto): a read_file call with these arguments, streamed in
        # pieces of this many characters
        self.auto_call: tuple[str, int] | None = None
        self.inflight = 0
        self.lock = threading.Lock()
        self.httpd = serve(self.handle)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def reset(self) -> None:
        self.chat = self.models = self.metrics = self.tool = "ok"
        self.answer = self.auto_call = None
        self.prefix = "grow"
        self.prefix_scrapes = None
        self.key = None
        self.seen.clear()
        self.bodies.clear()

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
            with self.lock:
                self.bodies.append(body)
            req = json.loads(body)
            if "tools" in req and req.get("tool_choice") != "auto":   # verify's forced call
                return self.tool_call(h, req)
            if not req.get("stream"):
                return self.complete(h, req)
            return self.stream(h, req, auth)
        return self.reply(h, 404, b"{}")

    @staticmethod
    def reply(h: BaseHTTPRequestHandler, status: int, body: bytes,
              ctype: str = "application/json") -> None:
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
        with self.lock:
            counted = self.prefix_scrapes is None or self.prefix_scrapes > 0
            if self.prefix_scrapes:
                self.prefix_scrapes -= 1
        prefix = (f"# TYPE vllm:prefix_cache_queries_total counter\n"
                  f'vllm:prefix_cache_queries_total{{model_name="m"}} {self.queried}\n'
                  f"# TYPE vllm:prefix_cache_hits_total counter\n"
                  f'vllm:prefix_cache_hits_total{{model_name="m"}} '
                  f'{self.hit}\n') if counted else ""
        return ('# TYPE vllm:generation_tokens_total '
                f'counter\nvllm:generation_tokens_total{{model_name="m"}} {gen}\n'
                f'# TYPE vllm:prompt_tokens_total counter\n'
                f'vllm:prompt_tokens_total{{model_name="m"}} '
                f"{float(self.prompted)}\n{prefix}"
                f"# TYPE vllm:cache_config_info gauge\n"
                f'vllm:cache_config_info{{enable_prefix_caching="{self.prefix != "off"}"}} '
                '1.0\n').encode()

    def complete(self, h: BaseHTTPRequestHandler, req: dict[str, Any]) -> None:
        """A non-streamed answer of one token; the prompt counted as vLLM's prefix cache would: one
        token per character, every whole block of 16 of a prompt seen before a hit (mode grow)."""
        prompt = str(req["messages"][-1]["content"])
        tokens = len(prompt)
        with self.lock:
            if self.prefix != "off":
                self.queried += tokens
                if self.prefix == "grow" and prompt in self.prompts_seen:
                    self.hit += tokens // 16 * 16
            self.prompts_seen.add(prompt)
        doc = {"id": "c", "object": "chat.completion", "model": MODEL,
               "choices": [{"index": 0, "message": {"role": "assistant", "content": "OK"},
                            "finish_reason": "length"}],
               "usage": {"prompt_tokens": tokens, "completion_tokens": 1,
                         "total_tokens": tokens + 1}}
        return self.reply(h, 200, json.dumps(doc).encode())

    def tool_call(self, h: BaseHTTPRequestHandler, req: dict[str, Any]) -> None:
        """A forced tool call as vLLM answers it (mode ``tool`` picks what is wrong); streamed, the
        arguments come in fragments of 3 characters."""
        if self.tool == "refuse":
            return self.reply(h, 400, b'{"error": {"message": "tool_choice=function '
                                      b'\\"get_weather\\" requires --tool-call-parser to be set", '
                                      b'"code": 400}}')
        name = ("get_time" if self.tool == "wrong_name"
                else req["tool_choice"]["function"]["name"])
        args = {"bad_args": '{"city": "Par', "no_city": '{"town": "Paris"}',
                "deep_args": "[" * 100_000 + "]" * 100_000}.get(self.tool, '{"city": "Paris"}')
        calls = [] if self.tool == "none" else [{"id": "t", "type": "function",
                                                 "function": {"name": name, "arguments": args}}]
        if not req.get("stream"):
            doc = {"id": "c", "object": "chat.completion", "model": MODEL,
                   "choices": [{"index": 0,
                                "message": {"role": "assistant", "content": "" if calls else "hi",
                                            "tool_calls": calls},
                                "finish_reason": "stop"}]}
            return self.reply(h, 200, json.dumps(doc).encode())
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
        if calls:
            deltas.append({"tool_calls": [{"index": 0, "id": "t", "type": "function",
                                           "function": {"name": name}}]})
            step = 3 if len(args) < 100 else 4096
            deltas += [{"tool_calls": [{"index": 0,
                                        "function": {"arguments": args[i:i + step]}}]}
                       for i in range(0, len(args), step)]
        else:
            deltas.append({"content": "hi"})
        chunks: list[dict[str, Any]] = [{"id": "c", "object": "chat.completion.chunk",
                                         "model": MODEL,
                                         "choices": [{"index": 0, "delta": delta,
                                                      "finish_reason": None}]}
                                        for delta in deltas]
        hostile = {"delta_str": {"choices": [{"index": 0, "delta": "x"}]},
                   "choices_int": {"choices": 5},
                   "pieces_str": {"choices": [{"index": 0, "delta": {"tool_calls": "x"}}]},
                   "piece_int": {"choices": [{"index": 0, "delta": {"tool_calls": [5]}}]}}
        if self.tool in hostile:
            chunks.insert(1, hostile[self.tool])
        for chunk in chunks:
            h.wfile.write(event(chunk))
        h.wfile.write(b"data: [DONE]\n\n")
        h.wfile.flush()
        return None

    def stream(self, h: BaseHTTPRequestHandler, req: dict[str, Any], auth: str | None) -> None:
        mode = self.chat
        n = min(int(req.get("max_tokens", TOKENS)), TOKENS)
        if mode == "vanish":  # the server dies before it answers
            h.connection.shutdown(socket.SHUT_RDWR)
            return None
        if mode == "http_500_echo":
            return self.reply(h, 500, f"internal error; you sent Authorization: {auth}".encode())
        if mode == "http_401_lower":  # echoes the header lowercased
            return self.reply(h, 401, f"denied: auth={str(auth).lower()}".encode())
        # alive, never done: a comment or one token every 0.2 s for 8 s
        if mode in ("keepalive", "trickle"):
            h.send_response(200)
            h.send_header("Content-Type", "text/event-stream")
            h.end_headers()
            piece = b": keepalive\n\n" if mode == "keepalive" else event(text_chunk(" tok"))
            for _ in range(40):
                h.wfile.write(piece)
                h.wfile.flush()
                time.sleep(0.2)
            return None
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        if mode == "drop":
            h.send_header("Content-Length", "1000000")
        h.end_headers()
        pieces = [event(text_chunk(" tok")) for _ in range(n)]
        prompt = 5
        if self.answer is not None:
            with self.lock:
                self.inflight += 1
            time.sleep(0.05)   # concurrent requests overlap
            with self.lock:
                words = self.answer(req, self.inflight).split(" ")
                self.inflight -= 1
            pieces = [event(text_chunk(w if i == 0 else " " + w)) for i, w in enumerate(words)]
            n = len(pieces)
            prompt = sum(len(str(m.get("content") or "")) for m in req["messages"]) // 4
        if self.auto_call is not None and req.get("tools"):
            args, step = self.auto_call
            deltas = [{"tool_calls": [{"index": 0, "id": "t", "type": "function",
                                       "function": {"name": "read_file"}}]}]
            deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": args[i:i + step]}}]}
                       for i in range(0, len(args), step)]
            pieces = [event({"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                             "choices": [{"index": 0, "delta": d, "finish_reason": None}]})
                      for d in deltas]
            n = len(pieces)
        pieces.append(event(text_chunk("", "length")))
        tail = [usage(n, prompt), b"data: [DONE]\n\n"]
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
            value = {"usage_nan": "NaN", "usage_str": '"8"', "usage_huge": "1000000000",
                     "usage_inf": "1e999", "usage_negative": "-3"}[mode]
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


def bench_result(**changes: Any) -> dict[str, Any]:
    doc = {"backend": "openai-chat", "method": "ngram",
           "served_model": {"id": "tiny", "root": "tiny", "max_model_len": 1024},
           "model_id": "tiny", "suite": "all", "max_concurrency": 1,
           "temperature": 0.0,
           "completed": 3, "failed": 0, "output_throughput": 60.0, "per_request_tok_s_mean": 40.0,
           "per_request_tok_s_max": 45.0, "spec_decode_acceptance_rate": 70.0,
           "spec_decode_acceptance_length": 2.5, "partial": False, "error": None,
           "suites": {"structured": {"per_request_tok_s_mean": 41.0},
                      "open": {"per_request_tok_s_mean": 39.0}}}
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not DROP}


DROP = object()


def argv(command: str, fake: FakeVllm, work: Path, **flags: str | None) -> list[str]:
    """A valid command line of ``command``; ``flags`` replace (or, with None, drop) a flag's
    value."""
    server = {"--url": fake.url, "--model": MODEL, "--timeout": "20"}
    base: dict[str, dict[str, str]] = {
        "bench": server | {"--suite": str(work / "suite.jsonl"), "--concurrency": "1",
                           "--requests": "2",
                           "--max-tokens": str(TOKENS), "--temperature": "0", "--method": "ngram",
                           "--unit": "sparkspec-vllm.service",
                           "--output": str(work / "out.json")},
        "check-output record": server | {"--suite": str(work / "suite.jsonl"),
                                         "--max-tokens": str(TOKENS),
                                         "--method": "baseline", "--concurrency": "1",
                                         "--output": str(work / "out.json")},
        "check-output compare": server | {"--reference": str(work / "ref.json"),
                                          "--min-share": "1.0",
                                          "--method": "ngram", "--concurrency": "1",
                                          "--output": str(work / "out.json")},
        "check answers": server | {"--known": str(work / "known.json"), "--concurrency": "2",
                                   "--output": str(work / "out.json")},
        "check needle": server | {"--tiers": "256", "--output": str(work / "out.json")},
        "report": {"--inputs": str(work / "result.json"), "--markdown": str(work / "out.md"),
                   "--plot": str(work / "out.png")},
        "model tiny": {"--out": str(work / "model"), "--seed": "0"},
    }
    args = command.split()
    for flag, value in (base[command] | flags).items():
        if value is not None:
            args += [flag, value]
    return args


def write_work(folder: Path) -> Path:
    """A suite of two prompts, a 0600 key file, a reference and a bench result, all valid, in
    ``folder``."""
    (folder / "suite.jsonl").write_text('{"id": "a", "prompt": "Say hi."}\n'
                                        '{"id": "b", "prompt": "Count."}\n')
    (folder / "known.json").write_text('[{"prompt": "Say tok.", "expect": "tok"}]\n')
    key = folder / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    ref = {"format": "sparkspec-lossless-reference/1", "model": MODEL, "method": "baseline",
           "suite": "suite",
           "temperature": 0.0, "max_tokens": TOKENS, "enable_thinking": False,
           "outputs": [{"id": "a", "suite": "suite", "prompt": "Say hi.", "expect_json": False,
                        "text": " tok" * TOKENS}]}
    (folder / "ref.json").write_text(json.dumps(ref))
    (folder / "result.json").write_text(json.dumps(bench_result()))
    return folder
