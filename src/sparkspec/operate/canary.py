"""The watchdog's canary: a fixed prompt's temperature-0 answer, recorded per start key (the unit's
command line and vLLM build), asked again on a schedule and compared; its figures are written for
the node exporter's textfile collector."""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from sparkspec import outputs
from sparkspec.bench.metrics import clean
from sparkspec.errors import UserError
from sparkspec.jsonfile import loads_bounded
from sparkspec.operate import memfit
from sparkspec.validate import read_regular

FORMAT = "sparkspec-canary-record/1"
KEYS = frozenset({"interval_s", "streak", "restart", "prompt", "max_tokens", "dir", "unit_record",
                  "venv", "textfile_dir"})
MAX_PROMPT = 4096
MAX_TOKENS = 1024
MAX_STREAK = 1000
SHOWN = 60


@dataclass(frozen=True)
class CanaryConfig:
    interval_s: float
    streak: int
    restart: bool
    prompt: str
    max_tokens: int
    dir: str
    unit_record: str
    venv: str
    textfile_dir: str | None


def problems(doc: Any, interval_s: Any) -> list[str]:
    """One line per bad field of the watchdog config's ``canary`` object (null: no canary); its
    schedule may not be shorter than the watchdog's own ``interval_s``."""
    if doc is None:
        return []
    if not isinstance(doc, dict):
        return ["'canary': is not an object or null (no canary)"]
    out = [f"'canary.{k}': unknown key; remove it" for k in sorted(set(doc) - KEYS)]
    out += [f"'canary.{k}': missing; give it" for k in sorted(KEYS - set(doc))]
    every = doc.get("interval_s")
    if "interval_s" in doc and (isinstance(every, bool) or not isinstance(every, int | float)
                                or not math.isfinite(every) or every <= 0):
        out.append(f"'canary.interval_s': {every!r:.40} is not a number of seconds > 0")
    elif isinstance(every, int | float) and isinstance(interval_s, int | float) \
            and every < interval_s:
        out.append(f"'canary.interval_s': {every:g} s is below the watchdog's interval_s "
                   f"{interval_s:g} s, which paces every check; ask no more often than that")
    for k, top in (("streak", MAX_STREAK), ("max_tokens", MAX_TOKENS)):
        v = doc.get(k)
        if k in doc and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= top):
            out.append(f"'canary.{k}': {v!r:.40} is not a whole number from 1 to {top}")
    if "restart" in doc and not isinstance(doc["restart"], bool):
        out.append(f"'canary.restart': {doc['restart']!r:.40} is not true or false")
    prompt = doc.get("prompt")
    if "prompt" in doc and (not isinstance(prompt, str) or not prompt.strip()
                            or len(prompt) > MAX_PROMPT):
        out.append(f"'canary.prompt': is not 1 to {MAX_PROMPT} characters of text")
    for k in ("dir", "unit_record", "venv", "textfile_dir"):
        v = doc.get(k)
        if k in doc and not (k == "textfile_dir" and v is None) and (
                not isinstance(v, str) or not os.path.isabs(v) or "\0" in v or not v.isprintable()):
            out.append(f"'canary.{k}': {v!r:.80} is not an absolute path")
    return out


def config(doc: dict[str, Any] | None) -> CanaryConfig | None:
    """The checked ``canary`` object (problems() found nothing) as a config."""
    if doc is None:
        return None
    return CanaryConfig(float(doc["interval_s"]), int(doc["streak"]), bool(doc["restart"]),
                        str(doc["prompt"]), int(doc["max_tokens"]), str(doc["dir"]),
                        str(doc["unit_record"]), str(doc["venv"]), doc["textfile_dir"])


def request(model: str, cfg: CanaryConfig) -> dict[str, Any]:
    """The canary's request; a fresh cache_salt keeps it off the prefix cache, so every ask runs
    the same cold prefill as the recorded one."""
    return {"model": model, "messages": [{"role": "user", "content": cfg.prompt}],
            "max_tokens": cfg.max_tokens, "temperature": 0, "stream": False,
            "chat_template_kwargs": {"enable_thinking": False}, "cache_salt": uuid.uuid4().hex}


def answer_of(body: bytes) -> tuple[str, int]:
    """choices[0].message.content of a chat completion and its usage.completion_tokens, else
    UserError in one line."""
    try:
        doc = loads_bounded(body)
        content, tokens = doc["choices"][0]["message"]["content"], \
            doc["usage"]["completion_tokens"]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise UserError(f"the answer is not a chat completion ({clean(str(exc))[:SHOWN]})") \
            from None
    if not isinstance(content, str):
        raise UserError(f"the answer's content is {type(content).__name__}, not text")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS:
        raise UserError(f"the answer's usage.completion_tokens is {tokens!r:.40}, not a count")
    return content, tokens


def key_of(cfg: CanaryConfig) -> tuple[dict[str, Any], str]:
    """The start key (memfit's: profile, method, k, levers, command line, vLLM build) and its
    digest, which names the record."""
    key = memfit.start_key(cfg.unit_record, cfg.venv)
    return key, memfit.key_hash(key)


def load_record(cfg: CanaryConfig, digest: str) -> dict[str, Any] | None:
    """The recorded answer for this key and prompt, else None (none yet, another prompt, or an
    unreadable file: recorded again)."""
    path = Path(cfg.dir) / f"{digest}.json"
    if not os.path.lexists(path):
        return None
    try:
        doc = loads_bounded(read_regular(str(path), "canary record", 1 << 20))
    except (UserError, ValueError):
        return None
    ok = isinstance(doc, dict) and doc.get("format") == FORMAT \
        and doc.get("prompt") == cfg.prompt and doc.get("max_tokens") == cfg.max_tokens \
        and isinstance(doc.get("answer"), str)
    return doc if ok else None


def save_record(cfg: CanaryConfig, digest: str, key: dict[str, Any], answer: str) -> None:
    Path(cfg.dir).mkdir(mode=0o755, parents=True, exist_ok=True)
    doc = {"format": FORMAT, "key": key, "prompt": cfg.prompt, "max_tokens": cfg.max_tokens,
           "answer": answer, "recorded": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    outputs.write_atomic(Path(cfg.dir) / f"{digest}.json",
                         (json.dumps(doc, indent=2) + "\n").encode(), mode=0o644,
                         flag="'canary.dir' in the watchdog config")


@dataclass
class Streak:
    """Answers in a row that differ from the record; :meth:`feed` says when to act."""

    limit: int
    count: int = 0
    last: str = ""

    def feed(self, answer: str, recorded: str) -> bool:
        """Count a clean answer (asked while nothing else ran): True at the limit and after."""
        if answer == recorded:
            self.count = 0
            return False
        self.count += 1
        self.last = answer
        return self.count >= self.limit


def textfile(unit: str, streak: Streak, checked: float, recorded: bool) -> bytes:
    """The canary's gauges in the Prometheus text format (the unit name is the label)."""
    registry = CollectorRegistry()
    for name, doc, value in (
            ("sparkspec_canary_mismatch_streak",
             "Canary answers in a row that differ from the answer recorded at this start key.",
             streak.count),
            ("sparkspec_canary_streak_limit",
             "The streak at which the canary alerts (and restarts, where enabled).", streak.limit),
            ("sparkspec_canary_recorded", "1 when an answer is recorded for this start key.",
             int(recorded)),
            ("sparkspec_canary_last_check_timestamp_seconds",
             "When the canary last asked (Unix time).", checked)):
        Gauge(name, doc, ["unit"], registry=registry).labels(unit=unit).set(value)
    return generate_latest(registry)
