"""The facts of the real Spark path (docs/spark-facts.md): every YAML block of that page, merged into one map of
``name -> {value, source}``. Tests compare the roles' defaults with these values."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

FACTS_FILE = Path(__file__).resolve().parents[2] / "docs" / "spark-facts.md"
_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.S | re.M)


def load(path: Path = FACTS_FILE) -> dict[str, dict[str, Any]]:
    """Every fact of the page; a name given twice, or a fact without a value or a source, is an error."""
    facts: dict[str, dict[str, Any]] = {}
    for block in _BLOCK.findall(path.read_text()):
        for name, fact in (yaml.safe_load(block) or {}).items():
            if name in facts:
                raise ValueError(f"{path}: fact {name} is given twice")
            if not isinstance(fact, dict) or set(fact) != {"value", "source"} or not str(fact["source"]).strip():
                raise ValueError(f"{path}: fact {name} needs exactly a value and a non-empty source")
            facts[name] = fact
    return facts


def value(name: str, path: Path = FACTS_FILE) -> Any:
    return load(path)[name]["value"]
