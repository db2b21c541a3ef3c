"""argparse types for every number a sparkspec command takes: finite, in range, one-line errors."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: type[int | float], low: float | None = None, high: float | None = None,
           low_open: bool = False) -> Callable[[str], int | float]:
    """An argparse ``type=``: parse ``kind``, refuse NaN/inf and values outside [low, high] (or
    (low, high] with ``low_open``)."""

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if low is not None and (value <= low if low_open else value < low):
            raise argparse.ArgumentTypeError(f"{text} must be {'>' if low_open else '>='} {low:g}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text} must be <= {high:g}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


positive_int = number(int, 1, 2**31 - 1)
non_negative_int = number(int, 0, 2**31 - 1)
port = number(int, 0, 65535)
positive_float = number(float, 0.0, 1e9, low_open=True)
share = number(float, 0.0, 1.0)
temperature = number(float, 0.0, 100.0)
