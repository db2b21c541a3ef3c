"""One formatter per kind of figure people read: byte sizes (binary units; a rate is a size per
second) and durations.

Every message, progress line and summary that states a size, a speed or a time left uses these, so
the same figure reads the same everywhere: ``1.2 GiB of 77.0 GiB, 90.6 MiB/s, 13 min left``.
"""

from __future__ import annotations


def size(n: float) -> str:
    """Bytes for people: 512 B, 1.5 KiB, 1.2 GiB, 77.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def duration(seconds: float) -> str:
    """42 s, 13 min, 2 h 05 min."""
    s = round(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{round(s / 60)} min"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
