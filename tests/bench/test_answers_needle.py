"""`sparkspec check answers` and `sparkspec check needle` against the fake vLLM: they pass on
right answers and fail, in one line naming the request and what came back, on a server that answers
wrongly under load or loses the fact at a tier; bad input is refused before any completion."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from sparkspec.bench import needle
from tests.badinput import refused_untouched, run

from .fakevllm import MODEL, FakeVllm

KNOWN = [{"prompt": "What is 17 + 25? Reply with the number only.", "expect": "\\b42\\b"},
         {"prompt": "What is the capital of France? Reply with one word.", "expect": "(?i)paris"}]


def _right(req: dict[str, Any], _inflight: int) -> str:
    text = req["messages"][-1]["content"]
    return "42" if "17 + 25" in text else "Paris"


def _argv(command: str, fake: FakeVllm, work: Path, *extra: str) -> list[str]:
    return ["check", command, "--url", fake.url, "--model", MODEL, "--timeout", "20",
            "--output", str(work / "out.json"), "--json", *extra]


@pytest.fixture()
def known(work: Path) -> Path:
    path = work / "known.json"
    path.write_text(json.dumps(KNOWN))
    return path


def test_known_answers_right_under_concurrency_pass(fake: FakeVllm, work: Path,
                                                    known: Path) -> None:
    seen: list[int] = []

    def right(req: dict[str, Any], inflight: int) -> str:
        seen.append(inflight)
        return _right(req, inflight)

    fake.answer = right
    out = run(*_argv("answers", fake, work, "--known", str(known), "--concurrency", "8"))
    assert out.rc == 0, out.stderr
    assert "8 of 8 known answers right at concurrency 8" in out.stdout
    assert len(seen) == 8 and max(seen) > 1   # sent together, not one by one
    assert json.loads((work / "out.json").read_text())["wrong"] == []


def test_known_answers_wrong_under_concurrency_fail_naming_the_request(
        fake: FakeVllm, work: Path, known: Path) -> None:
    """Right alone, wrong when another request is in flight (eugr/spark-vllm-docker PR #281)."""
    fake.answer = lambda req, inflight: _right(req, inflight) if inflight == 1 else "43 <|im_end|"
    out = run(*_argv("answers", fake, work, "--known", str(known), "--concurrency", "4"))
    assert out.rc == 1
    line = out.stderr.strip().splitlines()[-1]
    assert re.search(r"of 4 known answers wrong at concurrency 4: request known-\d#\d \('What is",
                     line), line
    assert "answered '43 <|im_end|' (expected /" in line
    report = json.loads((work / "out.json").read_text())
    assert report["passed"] is False and report["wrong"]


@pytest.mark.parametrize(("doc", "expected"), [
    ({"prompt": "x", "expect": "y"}, "not a list of 1 to"),
    ([], "not a list of 1 to"),
    ([{"prompt": "x", "expect": "(unclosed"}], "is not a regular expression"),
    ([{"prompt": "", "expect": "y"}], "item 0 is not"),
    ([{"prompt": "x", "expect": "y", "extra": 1}], "item 0 is not"),
], ids=["an-object", "empty", "bad-regex", "empty-prompt", "extra-key"])
def test_a_bad_known_answers_file_is_refused(fake: FakeVllm, work: Path, doc: Any,
                                             expected: str) -> None:
    (work / "known.json").write_text(json.dumps(doc))
    out = refused_untouched(_argv("answers", fake, work, "--known", str(work / "known.json")),
                            [work], 2, match=r"known\.json")
    assert expected in out.stderr
    assert fake.chats() == 0


def _reader(drop_above: int | None = None) -> Any:
    """Answers with the code in the context, or loses it past ``drop_above`` prompt tokens."""
    def answer(req: dict[str, Any], _inflight: int) -> str:
        text = req["messages"][-1]["content"]
        if drop_above is not None and len(text) // 4 > drop_above:
            return "I could not find it"
        found = re.search(r"blue door is (\d+)\.", text)
        return found.group(1) if found else "none"
    return answer


def test_needle_found_at_every_tier_passes_with_figures_per_tier(fake: FakeVllm,
                                                                 work: Path) -> None:
    fake.answer = _reader()
    out = run(*_argv("needle", fake, work, "--tiers", "256,512,900"))
    assert out.rc == 0, out.stderr
    assert "needle: 9 of 9 found (checked); 256: " in out.stdout
    report = json.loads((work / "out.json").read_text())
    assert [t["tier"] for t in report["tiers"]] == [256, 512, 900]
    for tier in report["tiers"]:
        assert [a["depth"] for a in tier["answers"]] == list(needle.DEPTHS)
        assert all(needle.MIN_REACHED * tier["tier"] <= a["prompt_tokens"] <= tier["tier"]
                   for a in tier["answers"])
        assert tier["per_request_tok_s_mean"] > 0
    codes = {a["needle"] for t in report["tiers"] for a in t["answers"]}
    assert len(codes) == 9


def test_needle_lost_at_a_tier_fails_naming_the_tier(fake: FakeVllm, work: Path) -> None:
    fake.answer = _reader(drop_above=400)
    out = run(*_argv("needle", fake, work, "--tiers", "256,512"))
    assert out.rc == 1
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("needle tier 512 depth 0.1: answered 'I could not find it' without "
                           "the code "), line
    # measured only: a model that cannot read passes while every tier is reached
    assert run(*_argv("needle", fake, work, "--tiers", "256,512", "--expect", "any")).rc == 0


@pytest.mark.parametrize(("tiers", "expected"), [
    ("256,2048", "2048 tokens is outside 128..992 (the served max_model_len 1024"),
    ("512,256", "give 1 to 16 distinct context lengths in tokens, ascending"),
    ("64", "64 tokens is outside 128..992"),
    ("1k", "is not comma-separated token counts"),
], ids=["above-max-model-len", "descending", "below-minimum", "not-a-number"])
def test_a_bad_needle_tier_is_refused_before_any_completion(fake: FakeVllm, work: Path,
                                                            tiers: str, expected: str) -> None:
    fake.answer = _reader()
    out = refused_untouched(_argv("needle", fake, work, "--tiers", tiers), [work], 2)
    assert expected in out.stderr
    assert fake.chats() == 0
