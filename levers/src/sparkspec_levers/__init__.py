"""sparkspec's vLLM general plugin: the levers SPARKSPEC_LEVERS names, inert when it is unset.

SPARKSPEC_LEVERS is a JSON object, lever -> options, e.g. {"int8_lm_head":{"min_vocab":100000}}.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "SPARKSPEC_LEVERS"
DEFAULT_MIN_VOCAB = 100000
# lever -> {option: default}; an option takes its default's type.
LEVERS: dict[str, dict[str, Any]] = {"int8_lm_head": {"min_vocab": DEFAULT_MIN_VOCAB}}

__all__ = ["DEFAULT_MIN_VOCAB", "ENV", "LEVERS", "parse_levers", "register"]


def register() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in every process, maybe twice."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return
    levers = parse_levers(raw)
    if not levers:
        return
    from . import plugin

    plugin.enable(levers)


def _fail(message: str) -> RuntimeError:
    return RuntimeError(f"sparkspec_levers: {message}")


def parse_levers(raw: str) -> dict[str, dict[str, Any]]:
    """A SPARKSPEC_LEVERS value's levers, options filled in; a RuntimeError of one line if bad."""
    import json

    shown = raw[:120]
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _fail(f"{ENV} is not JSON ({exc.msg} at character {exc.pos}): {shown!r}") from None
    if not isinstance(value, dict):
        raise _fail(f"{ENV} must be a JSON object of lever -> options, got {shown!r}")
    levers: dict[str, dict[str, Any]] = {}
    for name, options in value.items():
        if name not in LEVERS:
            raise _fail(f"unknown lever {name!r} in {ENV} (known: {', '.join(sorted(LEVERS))})")
        if not isinstance(options, dict):
            raise _fail(f"{ENV}: the options of {name} must be a JSON object, got {options!r}")
        defaults = LEVERS[name]
        unknown = sorted(set(options) - set(defaults))
        if unknown:
            raise _fail(f"{ENV}: unknown option {unknown[0]!r} of {name} "
                        f"(known: {', '.join(sorted(defaults))})")
        filled = {**defaults, **options}
        for key, default in defaults.items():
            got = filled[key]
            whole = isinstance(got, int) and not isinstance(got, bool) and got >= 0
            if isinstance(default, int) and not whole:
                raise _fail(f"{ENV}: {name}.{key} must be a whole number >= 0, got {got!r}")
        levers[name] = filled
    return levers
