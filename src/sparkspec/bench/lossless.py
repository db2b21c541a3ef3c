"""Lossless check: at temperature 0 a speculative method must produce exactly what baseline does."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sparkspec.bench.client import (
    MAX_TOKENS,
    RequestOptions,
    async_client,
    preflight,
    run_requests,
    sync_client,
)
from sparkspec.bench.metrics import clean
from sparkspec.bench.suites import MAX_ID, Prompt, conversation, suites_for
from sparkspec.errors import UserError
from sparkspec.jsonfile import expect, read_json

FORMAT = "sparkspec-lossless-reference/1"
REPORT_FORMAT = "sparkspec-lossless-report/1"
CONTEXT = 24


@dataclass(frozen=True)
class Mismatch:
    id: str
    offset: int
    expected: str
    actual: str
    # where the token ids differ (both sides had ids), with the two ids
    token_index: int | None = None
    expected_token: int | None = None
    actual_token: int | None = None


def first_token_divergence(expected: Any, actual: Any) -> tuple[int, int | None, int | None] | None:
    """(index, expected id, produced id) of the first differing token id (None past an end); None
    without ids on both sides, or when they are equal."""
    if not isinstance(expected, list) or not isinstance(actual, list) or expected == actual:
        return None
    for i, (a, b) in enumerate(zip(expected, actual, strict=False)):
        if a != b:
            return i, a, b
    n = min(len(expected), len(actual))
    return n, expected[n] if n < len(expected) else None, actual[n] if n < len(actual) else None


def first_divergence(expected: str, actual: str) -> int | None:
    """Index of the first differing character (the shorter length if one is a prefix); else None."""
    if expected == actual:
        return None
    for i, (a, b) in enumerate(zip(expected, actual, strict=False)):
        if a != b:
            return i
    return min(len(expected), len(actual))


def parses_as_json(text: str) -> bool:
    body = text.strip()
    if body.startswith("```"):
        body = body.split("\n", 1)[1] if "\n" in body else ""
        body = body.rsplit("```", 1)[0]
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def generate(url: str, model: str, prompts: list[Prompt], max_tokens: int,
             api_key: str | None = None, concurrency: int = 1, enable_thinking: bool = False,
             timeout: float = 600.0) -> list[dict[str, Any]]:
    """Greedy (temperature 0) outputs for ``prompts``; a failed request ends the run (RunFailure),
    it is never counted as a mismatch."""
    with sync_client() as client:
        preflight(client, url, model, api_key)
    opts = RequestOptions(model, max_tokens, 0.0, enable_thinking, return_token_ids=True)

    async def go() -> list[Any]:
        async with async_client(concurrency, timeout) as aclient:
            results, _ = await run_requests(aclient, url, prompts, opts, concurrency, api_key,
                                            timeout)
            return results

    by_id = {r.prompt.id: r for r in asyncio.run(go())}
    return [{"id": p.id, "suite": p.suite, "prompt": p.prompt, "expect_json": p.expect_json,
             # an agent turn is its history and tools: compared, it is sent as recorded
             **({"conversation": p.conversation, "messages": list(p.messages),
                 "tools": list(p.tools)} if p.messages else {}),
             # a tool call's answer is its calls (the parser leaves no text)
             "text": by_id[p.id].text + by_id[p.id].tool_text,
             "output_tokens": by_id[p.id].output_tokens,
             "finish_reason": by_id[p.id].finish_reason, "token_ids": by_id[p.id].token_ids}
            for p in prompts]


def record(url: str, model: str, suite: str = "all", max_tokens: int = 128,
           api_key: str | None = None, method: str | None = "baseline", concurrency: int = 1,
           enable_thinking: bool = False, timeout: float = 600.0) -> dict[str, Any]:
    prompts = [p for _, ps in suites_for(suite) for p in ps]
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise UserError(f"--suite {suite}: prompt ids repeat; give every prompt a unique \"id\"")
    outputs = generate(url, model, prompts, max_tokens, api_key, concurrency, enable_thinking,
                       timeout)
    return {"format": FORMAT, "model": model, "url": url, "method": method, "suite": suite,
            "temperature": 0.0, "max_tokens": max_tokens, "enable_thinking": enable_thinking,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "outputs": outputs}


def load_reference(path: str | Path, model: str) -> dict[str, Any]:
    """A reference written by ``record`` for ``model`` at temperature 0, every field of the type
    ``compare`` relies on, else one line."""
    fix = "record it again with `sparkspec check-output record`"
    doc = read_json(path, "no such reference; record one with `sparkspec check-output record`", fix)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UserError(f"{path}: not a {FORMAT} file; {fix}")
    recorded = expect(doc, "model", str, str(path), fix)
    if recorded != model:
        raise UserError(f"{path}: recorded for model {clean(recorded)!r}, not --model {model}; a "
                        "reference for another model is no reference: record one for this model")
    temp = expect(doc, "temperature", (int, float), str(path), fix)
    if isinstance(temp, bool) or temp != 0:
        raise UserError(f"{path}: recorded at temperature {clean(str(temp))}, not 0 (greedy); only "
                        f"greedy outputs can be compared: {fix}")
    max_tokens = expect(doc, "max_tokens", int, str(path), fix)
    if not 1 <= max_tokens <= MAX_TOKENS:
        raise UserError(f"{path}: max_tokens {max_tokens} is not from 1 to {MAX_TOKENS}; {fix}")
    expect(doc, "enable_thinking", bool, str(path), fix, required=False)
    expect(doc, "method", (str, type(None)), str(path), fix, required=False)
    outputs = expect(doc, "outputs", list, str(path), fix)
    if not outputs:
        raise UserError(f"{path}: has no outputs; {fix}")
    for n, out in enumerate(outputs):
        where = f"{path}: outputs[{n}]"
        for key in ("id", "prompt", "text"):
            expect(out, key, str, where, fix)
        expect(out, "suite", str, where, fix, required=False)
        expect(out, "expect_json", bool, where, fix, required=False)
        ids = expect(out, "token_ids", (list, type(None)), where, fix, required=False)
        if ids is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UserError(f"{where}: token_ids holds something other than token ids; {fix}")
        if (not out["id"] or len(out["id"]) > MAX_ID or not out["id"].isprintable()
                or not out["prompt"].strip()):
            raise UserError(f"{where}: needs a printable id of 1 to {MAX_ID} characters and a "
                            f"prompt; {fix}")
        if "messages" in out:
            expect(out, "conversation", str, where, fix)
            conversation.history(out["messages"], out.get("tools", []), where)
    ids = [o["id"] for o in outputs]
    if len(set(ids)) != len(ids):
        raise UserError(f"{path}: output ids repeat; {fix}")
    return doc


def reference_prompts(reference: dict[str, Any]) -> list[Prompt]:
    """The reference's prompts as recorded: an agent turn with its history and tools."""
    out = []
    for o in reference["outputs"]:
        messages, tools = (conversation.history(o["messages"], o.get("tools", []), o["id"])
                           if "messages" in o else ((), ()))
        out.append(Prompt(o["id"], o.get("suite", ""), "", o["prompt"], bool(o.get("expect_json")),
                          messages, tools, o.get("conversation")))
    return out


def compare(reference: dict[str, Any], outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Identical share, mismatches with their first diverging offset, and JSON parse failures."""
    actual = {o["id"]: o for o in outputs}
    mismatches: list[Mismatch] = []
    missing: list[str] = []
    identical = 0
    json_expected, json_failures = 0, []
    for ref in reference["outputs"]:
        got = actual.get(ref["id"])
        if got is None:
            missing.append(ref["id"])
            continue
        offset = first_divergence(ref["text"], got["text"])
        if offset is None:
            identical += 1
        else:
            lo = max(0, offset - CONTEXT // 2)
            token = first_token_divergence(ref.get("token_ids"), got.get("token_ids"))
            mismatches.append(Mismatch(ref["id"], offset, ref["text"][lo:offset + CONTEXT],
                                       got["text"][lo:offset + CONTEXT], *(token or ())))
        if ref.get("expect_json"):
            json_expected += 1
            if not parses_as_json(got["text"]):
                json_failures.append(ref["id"])
    total = len(reference["outputs"])
    return {"total": total, "identical": identical, "share": identical / total if total else 0.0,
            "mismatches": [asdict(m) for m in mismatches], "missing": missing,
            "json_expected": json_expected, "json_parse_failures": len(json_failures),
            "json_failed_ids": json_failures}


def verdict(report: dict[str, Any], min_share: float, require_json: bool) -> tuple[bool, str]:
    reasons = []
    if report["share"] < min_share:
        reasons.append(f"identical share {report['share']:.3f} < {min_share:.3f}")
    if require_json and report["json_parse_failures"]:
        reasons.append(f"{report['json_parse_failures']} of {report['json_expected']} JSON outputs "
                       "do not parse")
    summary = (f"{report['identical']}/{report['total']} identical (share {report['share']:.3f}), "
               f"JSON parse failures {report['json_parse_failures']}/{report['json_expected']}")
    for m in report["mismatches"][:5]:
        token = "" if m.get("token_index") is None else (f" (token {m['token_index']}: id "
                                                          f"{m['expected_token']} expected, "
                                                          f"{m['actual_token']} produced)")
        summary += (f"; {m['id']} diverges at char {m['offset']}{token}: {m['expected']!r} vs "
                    f"{m['actual']!r}")
    return not reasons, summary if not reasons else f"FAIL ({'; '.join(reasons)}): {summary}"


def run_compare(url: str, model: str, reference: dict[str, Any], api_key: str | None = None,
                concurrency: int = 1, method: str | None = None,
                timeout: float = 600.0) -> dict[str, Any]:
    outputs = generate(url, model, reference_prompts(reference), reference["max_tokens"], api_key,
                       concurrency, bool(reference.get("enable_thinking", False)), timeout)
    return {"format": REPORT_FORMAT, "method": method, "model": model, "url": url,
            "reference_method": reference.get("method"),
            "max_tokens": reference.get("max_tokens"), **compare(reference, outputs),
            "outputs": outputs}
