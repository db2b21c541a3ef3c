"""Known answers under concurrency: the known-answer prompts sent N at once (cycled to N), every
answer checked against its pattern."""

from __future__ import annotations

import re
import time
from typing import Any

from sparkspec.bench import lossless
from sparkspec.bench.metrics import clean
from sparkspec.bench.suites import Prompt
from sparkspec.errors import UserError
from sparkspec.jsonfile import read_json

FORMAT = "sparkspec-check-answers/1"
MAX_KNOWN = 256
MAX_PATTERN = 512
SHOWN = 120  # characters of a wrong answer in the one line


def load_known(path: str) -> list[tuple[str, re.Pattern[str]]]:
    """The known answers file: a JSON list of ``{"prompt": str, "expect": regex}`` (the verify
    role writes verify_known_answers there)."""
    fix = 'give a JSON list of {"prompt": "...", "expect": "regex"}'
    doc = read_json(path, f"no known-answers file; {fix}", fix)
    if not isinstance(doc, list) or not 1 <= len(doc) <= MAX_KNOWN:
        raise UserError(f"{path}: not a list of 1 to {MAX_KNOWN} known answers; {fix}")
    out = []
    for i, item in enumerate(doc):
        prompt = item.get("prompt") if isinstance(item, dict) else None
        expect = item.get("expect") if isinstance(item, dict) else None
        if not isinstance(prompt, str) or not prompt.strip() or not isinstance(expect, str) \
                or not expect or len(expect) > MAX_PATTERN or set(item) != {"prompt", "expect"}:
            raise UserError(f"{path}: item {i} is not {{\"prompt\": text, \"expect\": regex}} (a "
                            f"pattern of 1 to {MAX_PATTERN} characters); {fix}")
        try:
            out.append((prompt, re.compile(expect)))
        except re.error as exc:
            raise UserError(f"{path}: item {i}: expect {expect[:60]!r} is not a regular "
                            f"expression ({exc}); fix it") from None
    return out


def check(url: str, model: str, known: list[tuple[str, re.Pattern[str]]], concurrency: int,
          max_tokens: int = 64, api_key: str | None = None, method: str | None = None,
          timeout: float = 600.0) -> dict[str, Any]:
    """Send max(concurrency, len(known)) requests, ``concurrency`` in flight at once, greedy,
    thinking off; the report lists every answer that misses its pattern."""
    n = max(concurrency, len(known))
    prompts = [Prompt(f"known-{i % len(known) + 1}#{i // len(known) + 1}", "known", "known",
                      known[i % len(known)][0]) for i in range(n)]
    start = time.perf_counter()
    outputs = lossless.generate(url, model, prompts, max_tokens, api_key, concurrency,
                                timeout=timeout)
    duration = time.perf_counter() - start
    patterns = {p.id: known[i % len(known)][1] for i, p in enumerate(prompts)}
    wrong = [{"id": o["id"], "prompt": o["prompt"], "expect": patterns[o["id"]].pattern,
              "answer": clean(o["text"])[:4096]}
             for o in outputs if not patterns[o["id"]].search(o["text"])]
    return {"format": FORMAT, "check": "answers", "method": method, "model": model, "url": url,
            "concurrency": concurrency, "total": len(outputs), "wrong": wrong,
            "duration": duration, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def verdict(report: dict[str, Any]) -> tuple[bool, str]:
    """Passed, and one line: the first wrong answer with its request, else the count."""
    wrong, n, total = report["wrong"], report["concurrency"], report["total"]
    if not wrong:
        return True, f"{total} of {total} known answers right at concurrency {n}"
    first = wrong[0]
    answer = first["answer"][:SHOWN].replace("\n", " ")
    return False, (f"{len(wrong)} of {total} known answers wrong at concurrency {n}: request "
                   f"{first['id']} ({first['prompt'][:60]!r}) answered {answer!r} (expected "
                   f"/{first['expect']}/); the server answers wrongly under load: check the vLLM "
                   "build and the method (eugr/spark-vllm-docker PR #281)")
