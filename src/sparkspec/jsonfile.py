"""JSON the tools read from files or the network: bounded parsing, shape checks and one-line errors
that name the file and the fix; and its writer (through :mod:`sparkspec.outputs`).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from sparkspec import outputs
from sparkspec.errors import UserError
from sparkspec.validate import read_regular

MAX_DEPTH = 64
MAX_DOC_BYTES = 64 << 20
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


class JsonShapeError(ValueError):
    """A JSON document that parsed but is too large, too deep, or holds non-finite numbers."""


def _reject_constant(name: str) -> Any:
    raise JsonShapeError(f"holds {name}, which is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses to infinity
        raise JsonShapeError(f"holds {text[:40]}, which is not a finite number")
    return value


def check_depth(raw: bytes, max_depth: int = MAX_DEPTH) -> None:
    """Raise JsonShapeError when arrays/objects nest deeper than ``max_depth`` (strings are
    skipped)."""
    depth = 0
    for match in _BRACKETS.finditer(_STRINGS.sub(b'""', raw)):
        if match.group() in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                raise JsonShapeError(f"nests deeper than {max_depth} levels")
        else:
            depth -= 1


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise JsonShapeError(f"has the key {key[:60]!r} twice; a reader could take either "
                                 "value")
        doc[key] = value
    return doc


def loads_bounded(raw: bytes | str, max_bytes: int = MAX_DOC_BYTES,
                  max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads`` with a size and depth bound, NaN/Infinity and duplicate keys refused. Raises
    ValueError (JSONDecodeError, UnicodeDecodeError or JsonShapeError) with a short reason."""
    data = raw.encode("utf-8") if isinstance(raw, str) else bytes(raw)
    if len(data) > max_bytes:
        raise JsonShapeError(f"is {len(data)} bytes, more than the {max_bytes} allowed")
    check_depth(data, max_depth)
    return json.loads(data.decode("utf-8"), parse_constant=_reject_constant,
                      parse_float=_finite_float, object_pairs_hook=_unique_keys)


def read_json(path: str | os.PathLike[str], missing: str, fix: str) -> Any:
    """The parsed document. A missing file raises ``PATH: {missing}``; a file that is not a regular
    file, or not bounded UTF-8 JSON, raises one line naming the file and ``fix``."""
    if not os.path.lexists(path):
        raise UserError(f"{path}: {missing}")
    raw = read_regular(path, "JSON file", MAX_DOC_BYTES)
    try:
        return loads_bounded(raw)
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError, JsonShapeError
        raise UserError(f"{path}: not valid JSON ({exc}); {fix}") from None


def expect(doc: Any, key: str, kind: type | tuple[type, ...], where: str, fix: str,
           required: bool = True) -> Any:
    """``doc[key]`` checked to be of ``kind`` (bool is not an int), else one line naming the file
    and key."""
    if not isinstance(doc, dict):
        raise UserError(f"{where}: is not a JSON object; {fix}")
    if key not in doc:
        if required:
            raise UserError(f"{where}: has no {key!r}; {fix}")
        return None
    value = doc[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds)
        raise UserError(f"{where}: {key!r} is {type(value).__name__} {value!r:.60}, "
                        f"expected {names}; {fix}")
    return value


def write_json(path: str | os.PathLike[str], doc: dict[str, Any], *, sync: bool = True) -> None:
    """Write ``doc`` atomically through :func:`sparkspec.outputs.write_atomic` (mode 0644; ``sync``:
    fsync the file and its folder, off for a file replaced every few seconds); its folder is made
    when missing."""
    try:
        body = (json.dumps(doc, indent=2, sort_keys=False, allow_nan=False) + "\n").encode()
    except ValueError as exc:  # a non-finite number: a bug upstream, never written
        raise UserError(f"{path}: not written: {exc}") from None
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        outputs.write_atomic(path, body, mode=0o644, sync=sync, flag="--output")
    except OSError as exc:
        raise UserError(f"{path}: cannot write ({exc.strerror}); choose a writable "
                        "--output") from None
