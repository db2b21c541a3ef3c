"""Benchmark client: streamed chat completions against an OpenAI-compatible vLLM server, with result
keys and units as ``vllm bench serve`` gives them, plus the article's per-request speed."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2 as httpx

from sparkspec.bench import metrics, suites
from sparkspec.bench.metrics import clean
from sparkspec.bench.suites import Prompt, suites_for
from sparkspec.errors import RunFailure, UserError
from sparkspec.jsonfile import loads_bounded

RESULT_FORMAT = "sparkspec-bench-result/1"
MAX_TOKENS = 262_144  # Qwen3.5's context length
MAX_LINE = 1 << 20  # bytes of one SSE line; vLLM's are a few hundred


class StreamError(Exception):
    """What was wrong with one streamed response (the caller names the URL)."""


@dataclass(frozen=True)
class RequestOptions:
    model: str
    max_tokens: int
    temperature: float
    enable_thinking: bool = False
    ignore_eos: bool = False
    return_token_ids: bool = False  # ask vLLM for the generated tokens' ids (the lossless check's)


@dataclass
class RequestResult:
    prompt: Prompt
    ttft: float = 0.0
    e2e: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids, where the server sent them
    tool_calls: int = 0  # the answer's tool calls, and their names and arguments (for lossless)
    tool_text: str = ""


def chat_url(base_url: str) -> str:
    return base_url.rstrip("/") + "/v1/chat/completions"


def request_body(prompt: Prompt, opts: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": opts.model,
        "messages": list(prompt.messages) or [{"role": "user", "content": prompt.prompt}],
        "max_tokens": opts.max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": opts.enable_thinking},
    }
    if prompt.tools:
        body["tools"], body["tool_choice"] = list(prompt.tools), "auto"
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.return_token_ids:
        body["return_token_ids"] = True
    return body


def _count(usage: dict[str, Any], key: str, limit: int) -> int:
    value = usage.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise StreamError(f"usage.{key} is {value!r:.40}, not a token count from 0 to {limit}")
    return value


def _shape(what: str, value: object) -> StreamError:
    return StreamError(f"a chunk has the wrong shape ({what} is {type(value).__name__} "
                       f"{value!r:.40}); expected an OpenAI chat.completion.chunk")


def chunk_object(data: bytes, secret: str | None = None) -> dict[str, Any]:
    """One streamed ``data:`` payload as a chunk object: JSON, bounded, an object, not an ``error``;
    else a StreamError in one line (the server's text cleaned of the key)."""
    try:
        chunk = loads_bounded(data, max_bytes=MAX_LINE)
    except ValueError as exc:
        raise StreamError(f"a data line is not JSON ({clean(str(exc), secret)})") from None
    if not isinstance(chunk, dict):
        raise _shape("the chunk", chunk)
    if "error" in chunk:
        raise StreamError(f"server error: {clean(json.dumps(chunk['error']), secret)}")
    return chunk


class ChunkParser:
    """The state of one streamed response: each ``data:`` payload is checked and folded in."""

    def __init__(self, result: RequestResult, start: float, max_tokens: int,
                 secret: str | None) -> None:
        self.result, self.start, self.last = result, start, start
        self.max_tokens, self.secret = max_tokens, secret
        self.parts: list[str] = []
        self.calls: dict[int, list[str]] = {}
        self.done = self.has_usage = False

    def feed(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        chunk = chunk_object(data, self.secret)
        choices = chunk.get("choices")
        if not isinstance(choices, (list, type(None))):
            raise _shape("choices", choices)
        if choices:
            self._choice(choices[0])
        usage = chunk.get("usage")
        if usage is not None:
            if not isinstance(usage, dict):
                raise _shape("usage", usage)
            self.result.output_tokens = _count(usage, "completion_tokens", self.max_tokens)
            self.result.input_tokens = _count(usage, "prompt_tokens", 2**31 - 1)
            self.has_usage = True

    def _choice(self, choice: object) -> None:
        if not isinstance(choice, dict):
            raise _shape("choices[0]", choice)
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise _shape("delta", delta)
        content, finish = delta.get("content"), choice.get("finish_reason")
        if not isinstance(content, (str, type(None))):
            raise _shape("delta.content", content)
        if not isinstance(finish, (str, type(None))):
            raise _shape("finish_reason", finish)
        self.last = time.perf_counter()
        if not self.result.ttft:
            self.result.ttft = self.last - self.start
        self.parts.append(content or "")
        ids = choice.get("token_ids")
        if ids is not None:
            if not isinstance(ids, list) \
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise _shape("token_ids", ids)
            self.result.token_ids = (self.result.token_ids or []) + ids
        calls = delta.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("index", 0), int) for c in calls):
                raise _shape("delta.tool_calls", calls)
            top = max((int(c.get("index", 0)) + 1 for c in calls), default=0)
            self.result.tool_calls = max(self.result.tool_calls, min(top, 1 << 16))
            for c in calls:   # name and argument pieces per call, however the stream cut them
                fn = c.get("function") if isinstance(c.get("function"), dict) else {}
                self.calls.setdefault(int(c.get("index", 0)), []).extend(
                    v for v in (fn.get("name"), fn.get("arguments")) if isinstance(v, str))
        if finish:
            self.result.finish_reason = clean(finish)

    def finish(self) -> RequestResult:
        if not self.done:
            raise StreamError("the stream ended before [DONE]")
        if not self.has_usage:
            raise StreamError("no usage in the stream; the server ignored "
                              "stream_options.include_usage")
        # as vllm bench serve: the end is the last chunk with choices
        self.result.e2e = self.last - self.start
        self.result.text = "".join(self.parts)
        self.result.tool_text = "".join(f"\n<call {i}>" + "".join(self.calls[i])
                                        for i in sorted(self.calls))
        return self.result


async def stream_chat(client: httpx.AsyncClient, base_url: str, prompt: Prompt,
                      opts: RequestOptions, api_key: str | None = None) -> RequestResult:
    """One streamed chat completion, timed as ``vllm bench serve`` times its openai-chat backend.

    TTFT is the first chunk with choices; the end-to-end time ends at the last chunk with choices.
    Raises StreamError on any failure.
    """
    start = time.perf_counter()
    chunks = ChunkParser(RequestResult(prompt), start, opts.max_tokens, api_key)
    limit = (16 << 20) + 1024 * opts.max_tokens  # bytes a whole response may take
    received = 0
    try:
        async with client.stream("POST", chat_url(base_url), json=request_body(prompt, opts),
                                 headers=metrics.auth(api_key)) as response:
            if response.status_code != 200:
                body = b""
                async for piece in response.aiter_bytes():
                    body += piece
                    if len(body) >= 4096:
                        break
                raise StreamError(f"HTTP {response.status_code}: "
                                  f"{clean(body.decode('utf-8', 'replace'), api_key)}")
            pending = b""
            async for piece in response.aiter_bytes():
                received += len(piece)
                if received > limit:
                    raise StreamError(f"the response grew past {limit} bytes")
                *lines, pending = (pending + piece).split(b"\n")
                if len(pending) > MAX_LINE:
                    raise StreamError(f"a line longer than {MAX_LINE} bytes")
                for line in lines:
                    if line.startswith(b"data:") and not chunks.done:
                        chunks.feed(line[5:].strip())
                if chunks.done:
                    break
    except httpx.HTTPError as exc:
        raise StreamError(f"the stream broke ({exc.__class__.__name__}: "
                          f"{clean(str(exc), api_key)})") from None
    return chunks.finish()


async def _bounded(client: httpx.AsyncClient, base_url: str, prompt: Prompt, opts: RequestOptions,
                   api_key: str | None, timeout: float | None) -> RequestResult:
    """One request within ``timeout`` seconds from its start to its last byte (a server that keeps
    the stream alive with comments or a token now and then cannot hold the run)."""
    try:
        async with asyncio.timeout(timeout):
            return await stream_chat(client, base_url, prompt, opts, api_key)
    except TimeoutError:
        raise StreamError(f"no complete answer within {timeout:g} s; raise --timeout or check the "
                          "server") from None


async def run_requests(client: httpx.AsyncClient, base_url: str, prompts: list[Prompt],
                       opts: RequestOptions, concurrency: int, api_key: str | None = None,
                       timeout: float | None = None) -> tuple[list[RequestResult], float]:
    """Send ``prompts`` with at most ``concurrency`` in flight (a conversation's turns one after
    another), each within ``timeout`` seconds (first byte to last). The first failed request
    cancels the others and raises RunFailure naming the URL."""
    queue = list(reversed(suites.units(prompts)))
    results: list[RequestResult] = []

    async def worker() -> None:
        while queue:
            for prompt in queue.pop():
                results.append(await _bounded(client, base_url, prompt, opts, api_key, timeout))

    start = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(concurrency, len(queue))))]
    try:
        await asyncio.gather(*tasks)
    except StreamError as exc:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        hint = ("; serve with a tool-call parser (serve knob tool_call_parser) for agent suites"
                if "tool-call-parser" in str(exc) else "")
        raise RunFailure(f"{chat_url(base_url)}: {exc}{hint}; nothing written, check the server's "
                         "health and log") from None
    return results, time.perf_counter() - start


def async_client(concurrency: int, timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), trust_env=False,
                             limits=httpx.Limits(max_connections=concurrency + 2,
                                                 max_keepalive_connections=concurrency + 2))


def sync_client(timeout: float = 30.0) -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), trust_env=False)


def _model_entry(entry: object) -> dict[str, Any] | None:
    """A /v1/models entry with the types the result records, else None."""
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
        return None
    root, length = entry.get("root"), entry.get("max_model_len")
    if not isinstance(root, (str, type(None))) or isinstance(length, bool) \
            or not isinstance(length, (int, type(None))) or (length is not None and length < 0):
        return None
    return {"id": clean(entry["id"]), "root": None if root is None else clean(root),
            "max_model_len": length}


def preflight(client: httpx.Client, base_url: str, model: str,
              api_key: str | None) -> dict[str, Any]:
    """Check the server answers, accepts the key and serves ``model``: its /v1/models entry."""
    url = base_url.rstrip("/") + "/v1/models"
    status, body = metrics.get_bounded(client, url, api_key)
    if status == 401:
        raise UserError(f"{url}: 401 Unauthorized; give the server's API key in a file (chmod 600) "
                        "with --api-key-file FILE, or in $SPARKSPEC_API_KEY")
    if status != 200:
        raise UserError(f"{url}: HTTP {status}; --url must point at an OpenAI-compatible server")
    try:
        doc = loads_bounded(body)
    except ValueError as exc:
        raise UserError(f"{url}: not an OpenAI model list ({clean(str(exc))}); --url must point at "
                        "a vLLM server") from None
    data = doc.get("data") if isinstance(doc, dict) else None
    entries = [_model_entry(m) for m in data] if isinstance(data, list) else [None]
    if None in entries:
        raise UserError(f"{url}: the model list has the wrong shape (each entry needs a string id, "
                        "string root, integer max_model_len); --url must point at a vLLM server")
    models = {m["id"]: m for m in entries if m is not None}
    if model not in models:
        raise UserError(f"--model {model}: not served at {base_url} (serves "
                        f"{clean(', '.join(sorted(models)))}); pass the served model name")
    return models[model]


@dataclass
class BenchConfig:
    url: str
    model: str
    suite: str = "all"
    concurrency: int = 1
    requests: int | None = None  # per suite; default: each prompt once
    max_tokens: int = 256
    temperature: float = 0.0
    api_key: str | None = field(default=None, repr=False)
    method: str | None = None
    unit: str | None = None
    enable_thinking: bool = False
    ignore_eos: bool = False
    timeout: float = 600.0
    metrics: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def _figures(results: list[RequestResult], duration: float, before: metrics.Snapshot | None,
             after: metrics.Snapshot | None) -> dict[str, Any]:
    figures = metrics.summarize(results, duration)
    turns = [r for r in results if r.prompt.conversation is not None]
    if turns:   # an agent suite: how much of it is tool calls, scripted and answered
        figures["agent_turns"] = len(turns)
        figures["tool_turn_share"] = sum(r.prompt.tool_turn for r in turns) / len(turns)
        figures["tool_call_answers"] = sum(1 for r in turns if r.tool_calls)
    if before is not None and after is not None:
        d = metrics.delta(before, after)
        figures |= metrics.spec_decode_figures(d)
        figures["server_generation_tokens"] = int(d.generation_tokens)
        figures["server_prompt_tokens"] = int(d.prompt_tokens)
    else:
        figures |= metrics.spec_decode_figures(metrics.Snapshot())
        figures["server_generation_tokens"] = figures["server_prompt_tokens"] = None
    return figures


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Preflight, run each suite in turn (counters read around each), and build the result.

    The flags are checked by the CLI's types (sparkspec.cli.bench). Bad input (a suite, a server
    that is not a vLLM one) raises UserError before any request; a failure after the first request
    raises RunFailure. Either way there is no result.
    """
    planned = {name: suites.cycle(prompts, cfg.requests) for name, prompts in suites_for(cfg.suite)}
    opts = RequestOptions(cfg.model, cfg.max_tokens, cfg.temperature, cfg.enable_thinking,
                          cfg.ignore_eos)
    with sync_client() as client:
        served = preflight(client, cfg.url, cfg.model, cfg.api_key)
        first = snapshot = metrics.scrape(client, cfg.url, cfg.api_key) if cfg.metrics else None
        result: dict[str, Any] = {
            "format": RESULT_FORMAT, "backend": "openai-chat", "url": cfg.url,
            "model_id": cfg.model, "served_model": served, "method": cfg.method, "unit": cfg.unit,
            "suite": cfg.suite, "temperature": cfg.temperature, "max_tokens": cfg.max_tokens,
            "max_concurrency": cfg.concurrency, "enable_thinking": cfg.enable_thinking,
            "ignore_eos": cfg.ignore_eos,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **cfg.extra,
        }
        all_results: list[RequestResult] = []
        total_duration = 0.0
        per_suite: dict[str, Any] = {}
        for name, todo in planned.items():
            async def go(todo: list[Prompt] = todo) -> tuple[list[RequestResult], float]:
                async with async_client(cfg.concurrency, cfg.timeout) as aclient:
                    return await run_requests(aclient, cfg.url, todo, opts, cfg.concurrency,
                                              cfg.api_key, cfg.timeout)

            results, duration = asyncio.run(go())
            before = snapshot
            if before is not None:
                try:
                    snapshot = metrics.settled(client, cfg.url, before,
                                               sum(r.output_tokens for r in results), cfg.api_key)
                except UserError as exc:
                    raise RunFailure(f"{exc}; nothing written") from None
            all_results += results
            total_duration += duration
            per_suite[name] = {"num_prompts": len(todo)} | _figures(results, duration, before,
                                                                    snapshot)
    result["num_prompts"] = sum(len(todo) for todo in planned.values())
    result |= _figures(all_results, total_duration, first, snapshot)
    if len(planned) > 1:
        result["suites"] = per_suite
    # kept for readers of older results: a failed run writes none
    result["partial"], result["error"] = False, None
    return result
