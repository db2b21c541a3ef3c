"""The benchmark client's parse ceiling: how many streamed tokens per second it can take in.

A fast local server (asyncio raw sockets on 127.0.0.1, in its own process) answers every chat
completion with one token per SSE event, in HTTP/1.1 chunked encoding as uvicorn sends them; the
real client (`run_bench`) runs against it. The client's output throughput there is the ceiling above
which its figures would measure itself. Run with ``python -m tests.support.bench_ceiling`` (or
``invoke bench.client``); it prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
from typing import Any

MODEL = "ceiling"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def sse_body(tokens: int, prompt_tokens: int = 8) -> bytes:
    """A whole streamed response body, chunk-encoded: ``tokens`` one-token events, usage, [DONE]."""
    event = {"id": "chatcmpl-ceiling", "object": "chat.completion.chunk", "model": MODEL,
             "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}
    one = _chunk(b"data: " + json.dumps(event).encode() + b"\n\n")
    usage = {"id": "chatcmpl-ceiling", "object": "chat.completion.chunk", "model": MODEL,
             "choices": [],
             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                       "total_tokens": prompt_tokens + tokens}}
    tail = (_chunk(b"data: " + json.dumps(usage).encode() + b"\n\n") + _chunk(b"data: [DONE]\n\n")
            + b"0\r\n\r\n")
    return one * tokens + tail


def _response(status: str, body: bytes, content_type: str) -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode() + body)


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  cache: dict[int, bytes]) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            method, path, _ = request_line.split(" ", 2)
            length = 0
            for line in header_lines:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            if path == "/v1/models":
                data = {"object": "list",
                        "data": [{"id": MODEL, "root": MODEL, "max_model_len": 1 << 20}]}
                writer.write(_response("200 OK", json.dumps(data).encode(), "application/json"))
            elif path == "/metrics":
                writer.write(_response("200 OK", b"", "text/plain; version=0.0.4"))
            elif method == "POST" and path == "/v1/chat/completions":
                tokens = int(json.loads(body).get("max_tokens", 16))
                if tokens not in cache:
                    cache[tokens] = sse_body(tokens)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n" + cache[tokens])
            else:
                writer.write(_response("404 Not Found", b"{}", "application/json"))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _serve(port_out: Any) -> None:
    async def main() -> None:
        cache: dict[int, bytes] = {}
        server = await asyncio.start_server(lambda r, w: _handle(r, w, cache), "127.0.0.1", 0)
        port_out.send(server.sockets[0].getsockname()[1])
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def run(tokens: int = 4096, requests: int = 16, concurrency: int = 4) -> dict[str, Any]:
    """Serve, bench against it with the real client, and return the figures (tok/s)."""
    from sparkspec.bench.client import BenchConfig, run_bench

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child,), daemon=True)
    server.start()
    try:
        if not parent.poll(30):
            raise RuntimeError("ceiling server did not start")
        port = parent.recv()
        # no counters here: the client alone is measured
        result = run_bench(BenchConfig(url=f"http://127.0.0.1:{port}", model=MODEL,
                                       suite="structured", concurrency=concurrency,
                                       requests=requests, max_tokens=tokens, metrics=False))
    finally:
        server.terminate()
        server.join(5)
    return {"client_ceiling_tok_s": result["output_throughput"],
            "per_request_tok_s_mean": result["per_request_tok_s_mean"],
            "total_output_tokens": result["total_output_tokens"], "duration": result["duration"],
            "completed": result["completed"], "failed": result["failed"],
            "tokens_per_request": tokens,
            "concurrency": concurrency, "events_per_token": 1}


if __name__ == "__main__":
    json.dump(run(), sys.stdout, indent=2)
    print()
