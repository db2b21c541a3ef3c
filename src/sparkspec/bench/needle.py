"""Needle check: a fact placed at several depths of a long filler context, at each declared context
tier; every answer checked for the fact, with tok/s and acceptance measured per tier."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from sparkspec.bench import metrics
from sparkspec.bench.client import (
    RequestOptions,
    RequestResult,
    StreamError,
    async_client,
    chat_url,
    preflight,
    stream_chat,
    sync_client,
)
from sparkspec.bench.metrics import clean
from sparkspec.bench.suites import Prompt
from sparkspec.errors import RunFailure, UserError
from sparkspec.registry.data import NEEDLE_ANSWER_TOKENS, NEEDLE_MAX_TIERS, NEEDLE_MIN_TIER

FORMAT = "sparkspec-check-needle/1"
DEPTHS = (0.1, 0.5, 0.9)
MIN_REACHED = 0.8   # a tier's prompt must reach this share of its tokens (else it was not tested)
PROBE_LINES = 20
SHOWN = 80
QUESTION = "What is the access code for the blue door? Reply with the number only."
_WORDS = ("a quiet river runs past the old mill where farmers bring grain each autumn and the "
          "miller writes every sack into a long ledger by candle light").split()


def code(tier: int, depth: float) -> str:
    """The needle's four digits, fixed per tier and depth (so runs and methods compare)."""
    return str(1000 + (tier * 7919 + round(depth * 100) * 104729) % 9000)


def _line(n: int) -> str:
    # fixed-width numbers: every line takes the same tokens, so a probe sizes the longest tier
    return f"{n:06d}. " + " ".join(_WORDS[(n * 3 + i) % len(_WORDS)] for i in range(10)) + "."


def haystack(lines: int, depth: float, needle: str, nonce: str) -> str:
    """``lines`` filler lines, the needle sentence after ``depth`` of them, then the question."""
    at = round(lines * depth)
    body = [_line(n) for n in range(1, lines + 1)]
    body.insert(at, f"The access code for the blue door is {needle}.")
    return (f"Document {nonce}. Read it, then answer the question after it.\n" + "\n".join(body)
            + f"\n\n{QUESTION}")


def check_tiers(tiers: list[int], max_model_len: int | None, max_tokens: int) -> list[int]:
    """The tiers, checked: distinct, ascending, each at least the shortest tier and at most the
    served context less the answer's tokens."""
    limit = (max_model_len or 0) - max_tokens
    if not 1 <= len(tiers) <= NEEDLE_MAX_TIERS or sorted(set(tiers)) != tiers:
        raise UserError(f"--tiers {','.join(map(str, tiers))}: give 1 to {NEEDLE_MAX_TIERS} "
                        "distinct context lengths in tokens, ascending")
    for tier in tiers:
        if tier < NEEDLE_MIN_TIER or (max_model_len is not None and tier > limit):
            raise UserError(f"--tiers: {tier} tokens is outside {NEEDLE_MIN_TIER}..{limit} (the "
                            f"served max_model_len {max_model_len} less --max-tokens "
                            f"{max_tokens}); "
                            "lower the tier or serve a longer context")
    return tiers


async def _ask(url: str, prompt: str, opts: RequestOptions, api_key: str | None,
               timeout: float) -> RequestResult:
    async with async_client(1, timeout) as aclient:
        try:
            async with asyncio.timeout(timeout):
                return await stream_chat(aclient, url, Prompt("needle", "needle", "needle",
                                                              prompt), opts, api_key)
        except (StreamError, TimeoutError) as exc:
            raise RunFailure(f"{chat_url(url)}: {str(exc) or 'no answer within the timeout'}; "
                             "nothing written, check the server's health and log") from None


def _tier(url: str, tier: int, lines: int, opts: RequestOptions, api_key: str | None,
          timeout: float, depths: tuple[float, ...]) -> tuple[list[dict[str, Any]],
                                                             list[RequestResult]]:
    answers, results = [], []
    for depth in depths:
        needle = code(tier, depth)
        result = asyncio.run(_ask(url, haystack(lines, depth, needle, uuid.uuid4().hex[:12]),
                                  opts, api_key, timeout))
        results.append(result)
        answers.append({"depth": depth, "needle": needle, "found": needle in result.text,
                        "prompt_tokens": result.input_tokens, "answer": clean(result.text)[:512]})
    return answers, results


def check(url: str, model: str, tiers: list[int], max_tokens: int = NEEDLE_ANSWER_TOKENS,
          api_key: str | None = None, method: str | None = None, timeout: float = 600.0,
          depths: tuple[float, ...] = DEPTHS) -> dict[str, Any]:
    """Each tier's haystacks (one per depth), sized from a probe's token count; per tier the
    answers, tok/s and the spec-decode figures of the /metrics delta around it."""
    opts = RequestOptions(model, max_tokens, 0.0)
    with sync_client() as client:
        served = preflight(client, url, model, api_key)
        check_tiers(tiers, served["max_model_len"], max_tokens)
        # two probes: the tokens a filler line takes, and those of everything around the lines
        small, large = (asyncio.run(_ask(url, haystack(n, 0.5, "0000", "probe"), opts, api_key,
                                         timeout)).input_tokens
                        for n in (PROBE_LINES, 2 * PROBE_LINES))
        if large <= small:
            raise RunFailure(f"{chat_url(url)}: twice the filler counted {large} prompt tokens "
                             f"against {small}; point --url at a vLLM server")
        per_line = (large - small) / PROBE_LINES
        around = max(small - per_line * PROBE_LINES, 0)
        out = []
        for tier in tiers:
            lines = max(1, min(tier, int(0.97 * (tier - around) / per_line)))
            before = metrics.scrape(client, url, api_key)
            answers, results = _tier(url, tier, lines, opts, api_key, timeout, depths)
            after = metrics.settled(client, url, before, sum(r.output_tokens for r in results),
                                    api_key)
            figures = metrics.summarize(results, sum(r.e2e for r in results))
            out.append({"tier": tier, "lines": lines, "answers": answers,
                        "per_request_tok_s_mean": figures["per_request_tok_s_mean"],
                        "mean_ttft_ms": figures["mean_ttft_ms"],
                        **metrics.spec_decode_figures(metrics.delta(before, after))})
    return {"format": FORMAT, "check": "needle", "method": method, "model": model, "url": url,
            "max_tokens": max_tokens, "tiers": out, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def verdict(report: dict[str, Any], expect_found: bool) -> tuple[bool, str]:
    """Passed, and one line: the first tier not reached or needle not found, else each tier's
    figures."""
    for tier in report["tiers"]:
        for a in tier["answers"]:
            where = f"tier {tier['tier']} depth {a['depth']:g}"
            if a["prompt_tokens"] < MIN_REACHED * tier["tier"]:
                return False, (f"needle {where}: the prompt was {a['prompt_tokens']} tokens, under "
                               f"{MIN_REACHED:.0%} of the tier; the server cut or re-tokenized it")
            if expect_found and not a["found"]:
                answer = a["answer"][:SHOWN].replace("\n", " ")
                return False, (f"needle {where}: answered {answer!r} without the code "
                               f"{a['needle']} placed in the context; the server loses facts at "
                               "this context length (check the method and its k at long context)")
    summary = "; ".join(
        f"{t['tier']}: {_fmt(t['per_request_tok_s_mean'])} tok/s"
        + (f", acceptance {_fmt(t['spec_decode_acceptance_rate'])} %"
           if t.get("spec_decode_acceptance_rate") is not None else "")
        for t in report["tiers"])
    found = sum(a["found"] for t in report["tiers"] for a in t["answers"])
    total = sum(len(t["answers"]) for t in report["tiers"])
    checked = "checked" if expect_found else "not checked"
    return True, f"needle: {found} of {total} found ({checked}); {summary}"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
