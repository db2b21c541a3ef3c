"""``sparkspec memfit measure``: the MemAvailable low-water mark of one start, from the guard's reading before
the load through /health's first 200 and a warm-up window, written as the start key's memory record.

:class:`LowWater` is the decision (fed samples and times, no sleeping); :func:`measure` the loop around it.
It stops without writing when the vLLM unit is no longer active or activating, or at the time-out."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sparkspec.errors import UserError
from sparkspec.operate import memfit, scrape

SETTLE_S = 5.0  # seconds after generation first advanced that still count as warm-up


@dataclass
class LowWater:
    """The minimum MemAvailable seen, and when the warm-up is over: /health answered 200, then generation
    tokens advanced and SETTLE_S passed, or ``warmup_s`` passed since the first 200."""

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
        """Feed one poll's /health answer and generation counter (None: not read); True once warmed up."""
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


def measure(unit: str, url: str, unit_record: str, venv: str, record_dir: str, start_available: int,
            interval: float = 0.5, warmup_s: float = 60.0, timeout: float = 3600.0,
            systemctl: scrape.Systemctl = scrape.systemctl, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep, api_key: str | None = None) -> Measured:
    """Sample until warmed up, then read the KV cache config and write the record."""
    key = memfit.start_key(unit_record, venv)   # read first: a bad record is one line before anything runs
    water = LowWater(start_available, warmup_s)
    begin = clock()
    with scrape.client(min(5.0, max(interval, 1.0))) as http:
        while True:
            water.sample(memfit.mem_available())
            now = clock()
            state = systemctl(["is-active", unit]).strip() or "unknown"
            if state not in scrape.ACTIVE:
                return Measured(False, f"{unit} is {state} before its measurement ended (after "
                                       f"{water.samples} samples): no record written; its next start is "
                                       "measured again")
            if now - begin >= timeout:
                return Measured(False, f"{unit} was not healthy and warmed up within --timeout {timeout:g} "
                                       "s: no record written; its next start is measured again")
            health = scrape.healthy(http, url)
            generation = None
            if health:
                try:
                    generation = scrape.read_metrics(http, url, api_key)[0].generation_tokens
                except UserError:
                    generation = None
            if water.step(now, health, generation):
                break
            sleep(interval)
        water.sample(memfit.mem_available())
        try:
            kv_cache = scrape.info_labels(scrape.read_metrics(http, url, api_key)[1])
        except UserError:
            kv_cache = {}
    doc = {"key": key, "unit": unit, "start_available_bytes": start_available, "low_water_bytes": water.low,
           "needed_bytes": water.needed, "kv_cache": kv_cache, "measured_at": memfit.now_iso(),
           "samples": water.samples}
    path = memfit.write_record(record_dir, doc)
    kv = ", ".join(f"{k}={v}" for k, v in kv_cache.items() if k in ("num_gpu_blocks", "block_size",
                                                                    "cache_dtype")) or "not reported"
    figures = (f"MemAvailable {memfit.gib(start_available)} before the load, low water "
               f"{memfit.gib(water.low)} over {water.samples} samples, needs {memfit.gib(water.needed)}")
    return Measured(True, f"measured {unit} ({memfit.describe(key)}): {figures}; KV cache {kv}; recorded "
                          f"in {path}", doc)
