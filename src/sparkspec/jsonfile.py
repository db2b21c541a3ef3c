"""Reading a JSON file the user points at, with one-line errors that name the file and the fix."""

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
