"""The facts of the real Spark path (docs/spark-facts.md): every YAML block of that page, merged
into one map of ``name -> {value, source}``. A fact whose home is the registry names the
registry's key (``registry: SERVE_DEFAULTS.max_model_len``) and takes its value from there
(:func:`registry_value`)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

FACTS_FILE = Path(__file__).resolve().parents[2] / "docs" / "spark-facts.md"
_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)


def load(path: Path = FACTS_FILE) -> dict[str, dict[str, Any]]:
    """Every fact of the page; a name given twice, or a fact without a value or a source, is an
    error."""
    facts: dict[str, dict[str, Any]] = {}
    for block in _BLOCK.findall(path.read_text()):
        for name, fact in (yaml.safe_load(block) or {}).items():
            if name in facts:
                raise ValueError(f"{path}: fact {name} is given twice")
            if not isinstance(fact, dict) \
                    or set(fact) not in ({"value", "source"}, {"registry", "source"}) \
                    or not str(fact["source"]).strip():
                raise ValueError(f"{path}: fact {name} needs exactly a value (or a registry key) "
                                 "and a non-empty source")
            if "registry" in fact:
                fact = {**fact, "value": registry_value(fact["registry"])}
            facts[name] = fact
    return facts


def registry_value(key: str) -> Any:
    """The registry data at a dotted key (TABLE.name.field...; a name with dots in brackets:
    RELEASES[0.32.0].torch), in sparkspec.registry.data or .releases; ``*`` maps every entry that
    has the rest (a missing key is a KeyError: a citation of nothing)."""
    from sparkspec.registry import data, releases

    head, *rest = [a or b for a, b in re.findall(r"\[([^\]]+)\]|([^.\[\]]+)", key)]
    return _walk(getattr(data, head) if hasattr(data, head) else getattr(releases, head), rest,
                 key)


def _walk(node: Any, parts: list[str], key: str) -> Any:
    if not parts:
        return node
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        node = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    part, *rest = parts
    if part == "*":
        out = {}
        for name, child in node.items():
            try:
                out[name] = _walk(child, rest, key)
            except KeyError:
                continue
        if not out:
            raise KeyError(f"{key}: no entry has {'.'.join(rest)}")
        return out
    if not isinstance(node, Mapping) or part not in node:
        raise KeyError(f"{key}: no {part}")
    return _walk(node[part], rest, key)


def value(name: str, path: Path = FACTS_FILE) -> Any:
    return load(path)[name]["value"]
