"""Reading a JSON file the user points at, and writing one atomically, with one-line errors that name the file
and the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sparkspec.errors import UserError


def read_json(path: str | os.PathLike[str], missing: str, fix: str) -> Any:
    """The parsed document. A missing file raises ``PATH: {missing}``; a file that is not UTF-8 JSON raises
    ``PATH: not valid JSON (why); {fix}``. Other read errors propagate."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: {missing}") from None
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise UserError(f"{path}: not valid JSON ({exc}); {fix}") from None


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write ``doc`` atomically (a reader never sees half a file)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        raise UserError(f"{path}: cannot write ({exc.strerror}); choose a writable --output") from None
