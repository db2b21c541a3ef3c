"""SIGTERM and SIGHUP (a closed SSH session, `systemctl stop`, a CI time-out) unwind like Ctrl-C; a
stop that third-party code swallowed still stops at :func:`check`, before an output is made visible.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

STOPS = (signal.SIGTERM, signal.SIGHUP)

_requested: list[signal.Signals] = []


def _stop(signum: int, _frame: object) -> None:
    sig = signal.Signals(signum)
    _requested.append(sig)
    raise KeyboardInterrupt(sig.name)


def requested() -> signal.Signals | None:
    """The first stop signal received while :func:`handled` was active, or None."""
    return _requested[0] if _requested else None


def check() -> None:
    """Raise KeyboardInterrupt again when a stop signal came in, even if its first exception was
    swallowed. Call it right before an output becomes visible (a rename, an exchange)."""
    if _requested:
        raise KeyboardInterrupt(_requested[0].name)


@contextmanager
def handled() -> Iterator[None]:
    """SIGTERM and SIGHUP raise KeyboardInterrupt inside the block (main thread only; elsewhere the
    handlers are left alone); the previous handlers come back after it."""
    _requested.clear()
    try:
        before = {sig: signal.signal(sig, _stop) for sig in STOPS}
    except ValueError:  # not the main thread
        before = {}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


_HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def held() -> Iterator[None]:
    """Stop signals that come in during the block are handled when it ends, by the handlers set
    before it (so a KeyboardInterrupt is raised at its end, not inside it). Only the main thread
    sets handlers: in another the block runs unheld (signals are handled in the main thread
    anyway)."""
    got: list[tuple[int, object]] = []
    try:
        before = {sig: signal.signal(sig, lambda n, f: got.append((n, f))) for sig in _HELD}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        for signum, frame in got:
            handler = before[signal.Signals(signum)]
            if callable(handler):
                handler(signum, frame)  # type: ignore[arg-type]
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), signum)
