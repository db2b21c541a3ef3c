"""Needle check: a fact placed at several depths of a long filler context, at each declared context
tier; every answer checked for the fact, with tok/s and acceptance measured per tier, and those
figures for the node exporter's textfile collector."""

from __future__ import annotations

import asyncio
import datetime
import re
import time
import uuid
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest

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
from sparkspec.jsonfile import expect, read_json
from sparkspec.registry.data import NAMES, NEEDLE_ANSWER_TOKENS, NEEDLE_MAX_TIERS, NEEDLE_MIN_TIER

FORMAT = "sparkspec-check-needle/1"
DATE = "%Y-%m-%dT%H:%M:%S%z"   # the report's date, as every sparkspec report writes it
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
            "max_tokens": max_tokens, "tiers": out, "date": time.strftime(DATE)}


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


# --- the figures for Prometheus ------------------------------------------------------------------
# a unit and a method label in a file name root writes: the unit as the contract names it, the
# method as verify labels it (the method, then '+lever' each); the unit holds no '+', the name
# splits at its first
_UNIT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.@-]{0,127}")
_METHOD = re.compile(rf"{NAMES['method'][0]}(?:\+{NAMES['lever'][0]}){{0,16}}")
_GAUGES = (
    ("found_ratio", "Share of the needle check's depths whose answer held the fact, per tier."),
    ("tokens_per_second", "Mean per-request output tok/s of the needle check, per tier."),
    ("ttft_seconds", "Mean time to first token of the needle check, per tier."),
    ("acceptance_ratio", "Draft acceptance (0-1) during the needle check, per tier (speculative "
                         "methods)."),
)


def textfile_name(unit: str, method: str) -> str:
    """The file a method's needle figures go to in the textfile folder (one per unit and method)."""
    if not _UNIT.fullmatch(unit):
        raise UserError(f"--unit {unit!r:.60} is not a unit name (letters, digits, '_.@-'); give "
                        "the served unit, e.g. sparkspec-vllm")
    if not _METHOD.fullmatch(method):
        raise UserError(f"--method {method!r:.60} is not a method label (ngram, mtp+int8_lm_head); "
                        "give the one the report was measured with")
    return f"sparkspec-needle.{unit}+{method}.prom"


def _number(doc: dict[str, Any], key: str, where: str, fix: str) -> float | None:
    value = expect(doc, key, (int, float, type(None)), where, fix, required=False)
    return None if value is None else float(value)


def load_report(path: str, method: str) -> dict[str, Any]:
    """A needle report written by ``--output``, checked to be one (measured with ``method``) whose
    figures are numbers: it may come from another user."""
    fix = "re-run sparkspec check needle --output"
    doc: dict[str, Any] = read_json(path, "no needle report here; " + fix, fix)
    if expect(doc, "format", str, path, fix) != FORMAT:
        raise UserError(f"{path}: is not a needle report ({FORMAT}); {fix}")
    if expect(doc, "method", (str, type(None)), path, fix) != method:
        raise UserError(f"{path}: was measured with --method {doc['method']!r:.60}, not "
                        f"{method!r}; publish it under its own method")
    expect(doc, "model", str, path, fix)
    try:
        datetime.datetime.strptime(expect(doc, "date", str, path, fix), DATE)
    except ValueError:
        raise UserError(f"{path}: 'date' is not a time ({DATE}); {fix}") from None
    tiers = expect(doc, "tiers", list, path, fix)
    if not 1 <= len(tiers) <= NEEDLE_MAX_TIERS:
        raise UserError(f"{path}: holds {len(tiers)} tiers, not 1 to {NEEDLE_MAX_TIERS}; {fix}")
    for i, tier in enumerate(tiers):
        where = f"{path}: tiers[{i}]"
        if expect(tier, "tier", int, where, fix) < NEEDLE_MIN_TIER:
            raise UserError(f"{where}: 'tier' is below {NEEDLE_MIN_TIER} tokens; {fix}")
        answers = expect(tier, "answers", list, where, fix)
        if not answers:
            raise UserError(f"{where}: has no answers; {fix}")
        for a in answers:
            expect(a, "found", bool, f"{where}.answers", fix)
        for key in ("per_request_tok_s_mean", "mean_ttft_ms", "spec_decode_acceptance_rate"):
            _number(tier, key, where, fix)
    return doc


def textfile(report: dict[str, Any], unit: str) -> bytes:
    """A checked report's per-tier figures as gauges (labels unit, method, model, tier) and when it
    ran, in the Prometheus text format; a figure the run did not have is left out."""
    registry = CollectorRegistry()
    labels = ["unit", "method", "model", "tier"]
    gauges = {name: Gauge(f"sparkspec_needle_{name}", doc, labels, registry=registry)
              for name, doc in _GAUGES}
    base = {"unit": unit, "method": report["method"], "model": report["model"]}
    for t in report["tiers"]:
        found = sum(a["found"] for a in t["answers"]) / len(t["answers"])
        tok_s, ttft_ms, rate = (t.get(k) for k in ("per_request_tok_s_mean", "mean_ttft_ms",
                                                   "spec_decode_acceptance_rate"))
        for name, value in (("found_ratio", found), ("tokens_per_second", tok_s),
                            ("ttft_seconds", None if ttft_ms is None else ttft_ms / 1000),
                            ("acceptance_ratio", None if rate is None else rate / 100)):
            if value is not None:
                gauges[name].labels(**base, tier=str(t["tier"])).set(value)
    when = datetime.datetime.strptime(report["date"], DATE).timestamp()
    Gauge("sparkspec_needle_checked_timestamp_seconds", "When the needle check ran (Unix time).",
          labels[:3], registry=registry).labels(**base).set(when)
    return generate_latest(registry)
