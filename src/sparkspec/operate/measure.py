"""``sparkspec memfit measure``: the MemAvailable low-water mark of one start, from the guard's
reading before the load through /health's first 200 and a warm-up window, written as the start key's
memory record.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparkspec.errors import UserError
from sparkspec.operate import memfit, scrape
from sparkspec.operate.watchdog import UnitState, parse_show

SETTLE_S = 5.0  # seconds after generation first advanced that still count as warm-up
SHOW = "ActiveState,InvocationID"
AGAIN = "no record written; its next start is measured again"


@dataclass
class LowWater:
    """The minimum MemAvailable seen, and when the warm-up is over: /health answered 200, then
    generation tokens advanced and SETTLE_S passed, or ``warmup_s`` passed since the first 200."""

    start_available: int
    warmup_s: float = 60.0
    low: int = field(init=False)
    samples: int = 0
    healthy_at: float | None = None
    base_generation: float | None = None
    advanced_at: float | None = None

    def __post_init__(self) -> None:
        self.low = self.start_available

    def sample(self, available: int) -> None:
        self.low = min(self.low, available)
        self.samples += 1

    def step(self, now: float, healthy: bool, generation: float | None) -> bool:
        """Feed one poll's /health answer and generation counter (None: unread); True once warm."""
        if self.healthy_at is None:
            if not healthy:
                return False
            self.healthy_at = now
        if generation is not None:
            if self.base_generation is None or generation < self.base_generation:
                self.base_generation = generation
            elif generation > self.base_generation and self.advanced_at is None:
                self.advanced_at = now
        if self.advanced_at is not None and now - self.advanced_at >= SETTLE_S:
            return True
        return now - self.healthy_at >= self.warmup_s

    @property
    def needed(self) -> int:
        return max(0, self.start_available - self.low)


@dataclass(frozen=True)
class Measured:
    written: bool
    line: str
    record: dict[str, Any] | None = None


def _state(systemctl: scrape.Systemctl, unit: str) -> UnitState:
    return parse_show(systemctl(["show", unit, "-p", SHOW]))


def _gone(unit: str, invocation: str, systemctl: scrape.Systemctl, samples: int) -> str | None:
    """Why the measured start is over (unit not active/activating, or a new invocation), or None."""
    now = _state(systemctl, unit)
    if now.active not in scrape.ACTIVE:
        return (f"{unit} is {now.active} before its measurement ended (after {samples} samples): "
                f"{AGAIN}")
    if now.invocation != invocation:
        return (f"{unit} was started again (invocation {now.invocation[:12] or '-'}, not "
                f"{invocation[:12]}) before its measurement ended (after {samples} samples): "
                f"{AGAIN}")
    return None


def measure(unit: str, url: str, unit_record: str, venv: str, record_dir: str,
            start_available: int, interval: float = 0.5, warmup_s: float = 60.0,
            timeout: float = 3600.0, systemctl: scrape.Systemctl = scrape.systemctl,
            clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep, api_key: str | None = None) -> Measured:
    """Sample until warmed up, then read the KV cache config and write the record."""
    # read first: a bad record is one line before anything runs
    key = memfit.start_key(unit_record, venv)
    invocation = _state(systemctl, unit).invocation
    if not invocation:
        return Measured(False, f"{unit} has no InvocationID (not started, or systemd < 232): "
                               f"{AGAIN}")
    water = LowWater(start_available, warmup_s)
    begin = clock()
    deadline = min(5.0, max(interval, 1.0))
    with scrape.client(deadline) as http:
        while True:
            water.sample(memfit.mem_available())
            now = clock()
            gone = _gone(unit, invocation, systemctl, water.samples)
            if gone is not None:
                return Measured(False, gone)
            if now - begin >= timeout:
                return Measured(False, f"{unit} was not healthy and warmed up within --timeout "
                                       f"{timeout:g} s: {AGAIN}")
            health = scrape.healthy(http, url, deadline)
            generation = None
            if health:
                try:
                    sample = scrape.read_metrics(http, url, api_key, deadline_s=deadline)[0]
                    generation = sample.generation_tokens
                except UserError:
                    generation = None
            if water.step(now, health, generation):
                break
            sleep(interval)
        water.sample(memfit.mem_available())
        try:
            kv_cache = memfit.kv_labels(scrape.info_labels(scrape.read_metrics(http, url, api_key,
                                                                               deadline_s=deadline)[1]))
        except UserError:
            kv_cache = {}
    gone = _gone(unit, invocation, systemctl, water.samples)
    if gone is not None:
        return Measured(False, gone)
    try:
        same = memfit.start_key(unit_record, venv) == key
    except UserError:
        same = False
    if not same:
        return Measured(False, f"the start key of {unit} changed during its measurement "
                               f"({unit_record} or the vLLM build in {venv} was rewritten): "
                               f"{AGAIN}")
    doc = {"key": key, "unit": unit, "start_available_bytes": start_available,
           "low_water_bytes": water.low, "needed_bytes": water.needed, "kv_cache": kv_cache,
           "measured_at": memfit.now_iso(), "samples": water.samples}
    path = memfit.write_record(record_dir, doc)
    kv = ", ".join(f"{k}={v}" for k, v in kv_cache.items()
                   if k in ("num_gpu_blocks", "block_size", "cache_dtype")) or "not reported"
    figures = (f"MemAvailable {memfit.gib(start_available)} before the load, low water "
               f"{memfit.gib(water.low)} over {water.samples} samples, needs "
               f"{memfit.gib(water.needed)}")
    return Measured(True, f"measured {unit} ({memfit.describe(key)}): {figures}; KV cache {kv}; "
                          f"recorded in {path}", doc)
