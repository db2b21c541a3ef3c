"""The watchdog's configuration and decisions, as pure code fed snapshots and times (no sleeping, no
I/O); :mod:`sparkspec.operate.watchrun` is the loop that feeds them.
"""

from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sparkspec.jsonfile import read_json
from sparkspec.operate import canary
from sparkspec.operate.canary import CanaryConfig

# The bounds of the config (the role mirrors them): seconds in (0, MAX_SECONDS], counts in
# [1, MAX_COUNT], the acceptance floor in [0, MAX_FLOOR_PCT] or null.
MAX_SECONDS = 1e7
MAX_COUNT = 1 << 40
MAX_FLOOR_PCT = 100.0
SECONDS = ("grace_s", "interval_s", "stall_window_s", "acceptance_window_s", "probe_interval_s",
           "probe_timeout_s", "restart_window_s")
COUNTS = ("min_draft_tokens", "probe_failures", "max_restarts")
PATHS = ("lock", "state")
KEYS = frozenset({"model", "acceptance_floor", *SECONDS, *COUNTS, *PATHS})
OPTIONAL = frozenset({"canary"})   # absent: as null (a config from before the canary)


@dataclass(frozen=True)
class Config:
    model: str
    grace_s: float
    interval_s: float
    stall_window_s: float
    acceptance_window_s: float
    acceptance_floor: float | None
    min_draft_tokens: int
    probe_interval_s: float
    probe_timeout_s: float
    probe_failures: int
    max_restarts: int
    restart_window_s: float
    lock: str
    state: str
    canary: CanaryConfig | None = None


def problems(doc: Any) -> list[str]:
    """One line per bad or missing field of a watchdog config (empty when it is fine)."""
    if not isinstance(doc, dict):
        return ["is not a JSON object; the role writes {\"model\": ..., \"grace_s\": ..., ...}"]
    out = [f"{k!r}: unknown key (a typo?); remove it"
           for k in sorted(set(doc) - KEYS - OPTIONAL)]
    out += [f"{k!r}: missing; give it" for k in sorted(KEYS - set(doc))]

    def number(k: str) -> bool:
        v = doc.get(k)
        return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)

    model = doc.get("model")
    if "model" in doc and (not isinstance(model, str) or not model or not model.isprintable()):
        out.append(f"'model': {model!r:.60} is not a served model name; give the name vLLM serves")
    for k in SECONDS:
        if k in doc and not (number(k) and 0 < doc[k] <= MAX_SECONDS):
            out.append(f"{k!r}: {doc[k]!r:.40} is not a finite number of seconds > 0 (at most "
                       f"{MAX_SECONDS:g})")
    for k in COUNTS:
        v = doc.get(k)
        if k in doc and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_COUNT):
            out.append(f"{k!r}: {v!r:.40} is not a whole number from 1 to {MAX_COUNT}")
    floor = doc.get("acceptance_floor")
    if floor is not None and not (number("acceptance_floor") and 0 <= floor <= MAX_FLOOR_PCT):
        out.append(f"'acceptance_floor': {floor!r:.40} is not a percentage from 0 to 100, or null "
                   "(no floor)")
    for k in PATHS:
        v = doc.get(k)
        if k in doc and (not isinstance(v, str) or not os.path.isabs(v) or "\0" in v
                         or not v.isprintable()):
            out.append(f"{k!r}: {v!r:.80} is not an absolute path")
    out += canary.problems(doc.get("canary"), doc.get("interval_s") if number("interval_s")
                           else None)
    if number("grace_s") and number("restart_window_s") \
            and doc["restart_window_s"] <= doc["grace_s"]:
        out.append(f"'restart_window_s': {doc['restart_window_s']:g} must be > 'grace_s' "
                   f"{doc['grace_s']:g} (a cap window no longer than the grace period never counts "
                   "two restarts)")
    return out


def load_config(path: str) -> tuple[Config | None, list[str]]:
    """The config, or None and one line per problem (each naming the file)."""
    doc = read_json(path, "no watchdog config; deploy the watchdog (its role writes it)",
                    "the role writes it; redeploy the watchdog")
    found = problems(doc)
    if found:
        return None, [f"{path}: {line}" for line in found]
    floor = doc["acceptance_floor"]
    seconds = {k: float(doc[k]) for k in SECONDS}
    return Config(model=doc["model"], acceptance_floor=None if floor is None else float(floor),
                  lock=doc["lock"], state=doc["state"],
                  min_draft_tokens=int(doc["min_draft_tokens"]),
                  probe_failures=int(doc["probe_failures"]),
                  max_restarts=int(doc["max_restarts"]),
                  canary=canary.config(doc.get("canary")), **seconds), []


@dataclass(frozen=True)
class UnitState:
    """What ``systemctl show U -p ActiveState,ActiveEnterTimestampMonotonic,InvocationID`` says."""

    active: str
    entered: float  # CLOCK_MONOTONIC seconds (time.monotonic()'s) of the last entry into active
    invocation: str


def parse_show(text: str) -> UnitState:
    fields = dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)
    raw = fields.get("ActiveEnterTimestampMonotonic", "0").strip()
    return UnitState(fields.get("ActiveState", "unknown").strip() or "unknown",
                     int(raw) / 1e6 if raw.isdigit() else 0.0,
                     fields.get("InvocationID", "").strip())


@dataclass(frozen=True)
class Counters:
    """One /metrics read, as the watchdog needs it."""

    generation: float
    running: float
    draft: float
    accepted: float
    prompt: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None   # the KV cache usage gauge, None when the build has none


def busy(c: Counters | None, before: float | None) -> str | None:
    """Why a failed probe does not count: generation advanced since ``before`` (the previous probe's
    reading) or requests wait in the queue (a busy server queues the probe too); None when
    neither."""
    if c is None:
        return None
    if before is not None and c.generation > before:
        return f"generation tokens advanced {c.generation - before:.0f} since the previous probe"
    if c.waiting > 0:
        return f"{c.waiting:g} request(s) waiting"
    return None


@dataclass
class Watch:
    """The windows over successive reads. Each ``feed_*`` returns the reason to restart, or None."""

    cfg: Config
    invocation: str = ""
    last_generation: float | None = None
    # generation, prompt, KV cache usage
    last_progress: tuple[float, float, float | None] | None = None
    still_since: float = 0.0
    acceptance: deque[tuple[float, float, float]] = field(default_factory=deque)
    probe_fails: int = 0
    probe_generation: float | None = None   # generation tokens at the previous probe
    excused: str | None = None   # why the last failed probe was not counted
    next_probe: float = 0.0
    # the watchdog's own last restart (monotonic): a grace starts there
    restarted_at: float = -math.inf

    def reset(self) -> None:
        self.last_generation = self.last_progress = self.probe_generation = None
        self.acceptance.clear()
        self.probe_fails = 0
        self.next_probe = 0.0

    def gate(self, now: float, unit: UnitState) -> str | None:
        """Why the checks skip this round (not active, within grace), else None. A new invocation or
        a state other than active resets the windows."""
        if unit.invocation != self.invocation:
            self.invocation = unit.invocation
            self.reset()
        if unit.active != "active":
            self.reset()
            return f"not active ({unit.active})"
        since = now - max(unit.entered, self.restarted_at)
        if since < self.cfg.grace_s:
            self.reset()
            return (f"within the grace period ({since:.0f} of {self.cfg.grace_s:g} s since the "
                    "start)")
        return None

    def feed_stall(self, now: float, c: Counters) -> str | None:
        """Progress is any change of generation tokens, prompt tokens (a long chunked prefill
        generates none for a while) or the KV cache usage gauge; a stall is none of them while
        requests run."""
        progress = (c.generation, c.prompt, c.kv_usage)
        if self.last_progress is None or progress != self.last_progress or c.running <= 0:
            self.last_progress, self.last_generation, self.still_since = progress, c.generation, now
            return None
        still = now - self.still_since
        if still >= self.cfg.stall_window_s:
            return (f"engine stalled: {c.running:g} request(s) running but generation tokens stuck "
                    f"at {c.generation:.0f} for {still:.0f} s (window "
                    f"{self.cfg.stall_window_s:g} s)")
        return None

    def feed_acceptance(self, now: float, c: Counters) -> str | None:
        floor = self.cfg.acceptance_floor
        if floor is None:
            return None
        window = self.acceptance
        if window and (c.draft < window[-1][1] or c.accepted < window[-1][2]):
            window.clear()   # the counters went back: a new engine
        window.append((now, c.draft, c.accepted))
        start = now - self.cfg.acceptance_window_s
        while len(window) >= 2 and window[1][0] <= start:
            window.popleft()
        t0, d0, a0 = window[0]
        if t0 > start:
            return None   # the reads do not cover a whole window yet
        drafts, accepted = c.draft - d0, c.accepted - a0
        if drafts < self.cfg.min_draft_tokens:
            return None
        rate = 100.0 * accepted / drafts
        if rate < floor:
            return (f"acceptance collapsed: {rate:.1f} % of {drafts:.0f} draft tokens accepted "
                    f"over the last {now - t0:.0f} s, below the floor {floor:g} %")
        return None

    def probe_due(self, now: float) -> bool:
        return now >= self.next_probe

    def feed_probe(self, now: float, health_ok: bool, error: str | None,
                   c: Counters | None = None) -> str | None:
        """A probe's outcome: /health's answer, the completion's error (None: it answered), and the
        counters read after it (None: not read). A failure does not count while the server is
        :func:`busy`."""
        self.next_probe = now + self.cfg.probe_interval_s
        self.excused = busy(c, self.probe_generation)
        if c is not None:
            self.probe_generation = c.generation
        if not health_ok or error is None or self.excused is not None:
            self.probe_fails = 0
            return None
        self.probe_fails += 1
        if self.probe_fails >= self.cfg.probe_failures:
            return (f"/health answers 200 but completions time out: {self.probe_fails} probes in a "
                    f"row failed (last: {error}; timeout {self.cfg.probe_timeout_s:g} s)")
        return None


@dataclass
class Restarts:
    """Restart times (wall clock) and the cap: at most ``max_restarts`` in ``restart_window_s``."""

    cfg: Config
    times: list[float] = field(default_factory=list)

    def recent(self, now: float) -> list[float]:
        return [t for t in self.times if now - self.cfg.restart_window_s < t <= now + 60]

    def capped(self, now: float) -> bool:
        return len(self.recent(now)) >= self.cfg.max_restarts

    def record(self, now: float) -> None:
        self.times = [*self.recent(now), now]
