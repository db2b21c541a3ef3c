"""Benchmark client: streamed chat completions against an OpenAI-compatible vLLM server.

Result keys and units follow ``vllm bench serve`` where they mean the same (``completed``, ``duration`` in s,
``*_ms`` latencies, ``output_throughput`` in tok/s, ``spec_decode_*`` from the server's own counters), plus the
article's per-request speed: a request's tok/s is its output tokens over its end-to-end time. Output tokens come
from the server's streamed usage (``stream_options.include_usage``); TPOT = (e2e - TTFT) / (output tokens - 1),
never inter-chunk gaps, since one chunk carries several tokens under speculative decoding.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx2 as httpx
import numpy as np

from sparkspec import metrics
from sparkspec.errors import UserError

SUITES = ("structured", "open")


@dataclass(frozen=True)
class Prompt:
    id: str
    suite: str
    category: str
    prompt: str
    expect_json: bool = False


@dataclass(frozen=True)
class RequestOptions:
    model: str
    max_tokens: int
    temperature: float
    enable_thinking: bool = False
    ignore_eos: bool = False


@dataclass
class RequestResult:
    prompt: Prompt
    ok: bool = False
    error: str | None = None
    fatal: bool = False  # the transport failed: the server is gone or the stream broke
    ttft: float = 0.0
    e2e: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None


def _parse_suite(text: str, source: str, suite: str) -> list[Prompt]:
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(Prompt(str(row.get("id", f"{suite}-{n}")), suite, str(row.get("category", suite)),
                                  str(row["prompt"]), bool(row.get("expect_json", False))))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise UserError(f"{source}:{n}: not a JSON object with a \"prompt\"; fix that line") from None
    if not prompts:
        raise UserError(f"{source}: suite has no prompts; add JSON lines with a \"prompt\" or pick "
                        f"--suite {'|'.join(SUITES)}|all")
    return prompts


def load_suite(name: str) -> list[Prompt]:
    """A built-in suite (structured, open) or a JSON-lines file of ``{"id", "prompt", "expect_json"}``."""
    if name in SUITES:
        text = resources.files("sparkspec").joinpath("suites", f"{name}.jsonl").read_text(encoding="utf-8")
        return _parse_suite(text, f"suite {name}", name)
    path = Path(name)
    if not path.is_file():
        raise UserError(f"--suite {name}: no such suite or file; use {'|'.join(SUITES)}|all or a .jsonl path")
    return _parse_suite(path.read_text(encoding="utf-8"), str(path), path.stem)


def suites_for(spec: str) -> list[tuple[str, list[Prompt]]]:
    names = SUITES if spec == "all" else (spec,)
    return [(Path(n).stem if n not in SUITES else n, load_suite(n)) for n in names]


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_body(prompt: Prompt, opts: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": opts.model,
        "messages": [{"role": "user", "content": prompt.prompt}],
        "max_tokens": opts.max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": opts.enable_thinking},
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return body


async def stream_chat(client: httpx.AsyncClient, base_url: str, prompt: Prompt, opts: RequestOptions,
                      api_key: str | None = None) -> RequestResult:
    """One streamed chat completion, timed the way ``vllm bench serve`` times its openai-chat backend.

    TTFT is the first chunk with choices; the end-to-end time ends at the last chunk with choices.
    """
    result = RequestResult(prompt)
    parts: list[str] = []
    done = False
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", base_url.rstrip("/") + "/v1/chat/completions",
                                 json=request_body(prompt, opts), headers=headers(api_key)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {body[:200]}"
                return result
            pending = b""
            async for piece in response.aiter_bytes():
                *lines, pending = (pending + piece).split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if choices := chunk.get("choices"):
                        last = time.perf_counter()
                        if not result.ttft:
                            result.ttft = last - start
                        choice = choices[0]
                        parts.append((choice.get("delta") or {}).get("content") or "")
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
                    elif usage := chunk.get("usage"):
                        result.output_tokens = int(usage.get("completion_tokens") or 0)
                        result.input_tokens = int(usage.get("prompt_tokens") or 0)
                    elif "error" in chunk:
                        result.error = f"server error: {json.dumps(chunk['error'])[:200]}"
                        return result
                if done:
                    break
    except httpx.TransportError as exc:
        result.error, result.fatal = f"{exc.__class__.__name__}: {exc}", True
        return result
    result.e2e = last - start  # as vllm bench serve: the end is the last chunk that carried choices
    result.text = "".join(parts)
    if not done:
        result.error, result.fatal = "stream ended before [DONE]", True
    elif not result.output_tokens and result.text:
        result.error = "no usage in the stream; the server ignored stream_options.include_usage"
    else:
        result.ok = True
    return result


async def run_requests(client: httpx.AsyncClient, base_url: str, prompts: list[Prompt], opts: RequestOptions,
                       concurrency: int, api_key: str | None = None) -> tuple[list[RequestResult], float]:
    """Send ``prompts`` with at most ``concurrency`` in flight; stop issuing new ones once the server is gone."""
    queue = list(reversed(prompts))
    results: list[RequestResult] = []
    gone = asyncio.Event()

    async def worker() -> None:
        while queue and not gone.is_set():
            res = await stream_chat(client, base_url, queue.pop(), opts, api_key)
            results.append(res)
            if res.fatal:
                gone.set()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(prompts))))))
    return results, time.perf_counter() - start


def async_client(concurrency: int, timeout: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=10.0), trust_env=False,
                             limits=httpx.Limits(max_connections=concurrency + 2,
                                                 max_keepalive_connections=concurrency + 2))


def sync_client(timeout: float = 30.0) -> httpx.Client:
    return httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), trust_env=False)


def preflight(client: httpx.Client, base_url: str, model: str, api_key: str | None) -> dict[str, Any]:
    """Check the server answers, accepts the key and serves ``model``; returns its /v1/models entry."""
    url = base_url.rstrip("/") + "/v1/models"
    try:
        response = client.get(url, headers=headers(api_key))
    except httpx.TransportError as exc:
        raise UserError(f"{url}: unreachable ({exc.__class__.__name__}: {exc}); check --url and that the "
                        "server is up") from None
    if response.status_code == 401:
        raise UserError(f"{url}: 401 Unauthorized; pass the server's API key with --api-key")
    if response.status_code != 200:
        raise UserError(f"{url}: HTTP {response.status_code}; --url must point at an OpenAI-compatible server")
    try:
        models = {m["id"]: m for m in response.json()["data"]}
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{url}: not an OpenAI model list; --url must point at a vLLM server") from None
    if model not in models:
        raise UserError(f"--model {model}: not served at {base_url} (serves {', '.join(sorted(models))}); "
                        "pass the served model name")
    return dict(models[model])


def _stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"std_{name}_ms": None, f"p99_{name}_ms": None}
    ms = np.asarray(values_s) * 1000.0
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """``vllm bench serve``'s figures (and the article's per-request tok/s) over completed requests."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_tokens for r in done)
    speeds = [r.output_tokens / r.e2e for r in done if r.e2e > 0]
    figures: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration > 0 else None,
        "output_throughput": out_tokens / duration if duration > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else None,
    }
    figures |= _stats("ttft", [r.ttft for r in done])
    figures |= _stats("tpot", [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1])
    figures |= _stats("e2el", [r.e2e for r in done])
    figures["per_request_tok_s_mean"] = float(np.mean(speeds)) if speeds else None
    figures["per_request_tok_s_max"] = float(np.max(speeds)) if speeds else None
    return figures


@dataclass
class BenchConfig:
    url: str
    model: str
    suite: str = "all"
    concurrency: int = 1
    requests: int | None = None  # per suite; default: each prompt once
    max_tokens: int = 256
    temperature: float = 0.0
    api_key: str | None = None
    method: str | None = None
    unit: str | None = None
    enable_thinking: bool = False
    ignore_eos: bool = False
    timeout: float = 600.0
    metrics: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def check(self) -> None:
        if self.concurrency < 1:
            raise UserError(f"--concurrency {self.concurrency}: must be >= 1")
        if self.requests is not None and self.requests < 1:
            raise UserError(f"--requests {self.requests}: must be >= 1 (or omit it: each prompt once)")
        if self.max_tokens < 1:
            raise UserError(f"--max-tokens {self.max_tokens}: must be >= 1")
        if self.temperature < 0:
            raise UserError(f"--temperature {self.temperature}: must be >= 0")
        if not self.url.startswith(("http://", "https://")):
            raise UserError(f"--url {self.url}: not an http(s) URL; e.g. http://127.0.0.1:8000")


def _cycle(prompts: list[Prompt], n: int | None) -> list[Prompt]:
    return prompts if n is None else [prompts[i % len(prompts)] for i in range(n)]


def _run_suite(cfg: BenchConfig, client: httpx.Client, prompts: list[Prompt], opts: RequestOptions
               ) -> tuple[list[RequestResult], float, dict[str, Any]]:
    before = metrics.scrape(client, cfg.url, cfg.api_key) if cfg.metrics else None

    async def go() -> tuple[list[RequestResult], float]:
        async with async_client(cfg.concurrency, cfg.timeout) as aclient:
            return await run_requests(aclient, cfg.url, prompts, opts, cfg.concurrency, cfg.api_key)

    results, duration = asyncio.run(go())
    server: dict[str, Any] = {"before": before, "after": None, "error": None}
    if before is not None:
        min_gen = sum(r.output_tokens for r in results if r.ok)
        try:
            server["after"] = metrics.settled(client, cfg.url, before, min_gen, cfg.api_key)
        except UserError as exc:
            server["error"] = str(exc)
    return results, duration, server


def _figures(results: list[RequestResult], duration: float, before: metrics.Snapshot | None,
             after: metrics.Snapshot | None) -> dict[str, Any]:
    figures = summarize(results, duration)
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
    """Preflight, run each suite in turn (counters snapshotted around each), and build the result."""
    cfg.check()
    suites = suites_for(cfg.suite)
    opts = RequestOptions(cfg.model, cfg.max_tokens, cfg.temperature, cfg.enable_thinking, cfg.ignore_eos)
    with sync_client() as client:
        served = preflight(client, cfg.url, cfg.model, cfg.api_key)
        result: dict[str, Any] = {
            "backend": "openai-chat", "url": cfg.url, "model_id": cfg.model,
            "served_model": {k: served.get(k) for k in ("id", "root", "max_model_len")},
            "method": cfg.method, "unit": cfg.unit, "suite": cfg.suite, "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens, "max_concurrency": cfg.concurrency, "enable_thinking":
            cfg.enable_thinking, "ignore_eos": cfg.ignore_eos,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **cfg.extra,
        }
        all_results: list[RequestResult] = []
        total_duration = 0.0
        first_before = last_after = None
        per_suite: dict[str, Any] = {}
        error = None
        planned = {name: _cycle(prompts, cfg.requests) for name, prompts in suites}
        for name, todo in planned.items():
            results, duration, server = _run_suite(cfg, client, todo, opts)
            all_results += results
            total_duration += duration
            first_before = first_before or server["before"]
            last_after = server["after"]
            per_suite[name] = {"num_prompts": len(todo)} | _figures(results, duration, server["before"],
                                                                    server["after"])
            fatal = next((r.error for r in results if r.fatal), None)
            if fatal or server["error"]:
                error = fatal or server["error"]
                break
    result["num_prompts"] = sum(len(todo) for todo in planned.values())  # planned; unsent ones count nowhere
    result |= _figures(all_results, total_duration, first_before, last_after)
    if len(suites) > 1:
        result["suites"] = per_suite
    result["errors"] = sorted({r.error for r in all_results if r.error})[:10]
    result["partial"] = error is not None
    result["error"] = error
    return result
