"""Helpers shared by the checkpoint commands' refusal tests (assemble, add-mtp, verify)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparkspec.checkpoint.manifest import MANIFEST_NAME
from tests.badinput import run
from tests.unit.conftest import CkptPair, Tree, run_cli

SHARD = "model-00001-of-00002.safetensors"


def _header_doc(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8: 8 + length]), raw[8 + length:]


def _set_header(path: Path, header: Any) -> None:
    """Replace the header (a document, or raw JSON text), keeping the data."""
    _, data = _header_doc(path)
    body = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


def _edit_header(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    doc, _ = _header_doc(path)
    _set_header(path, edit(doc))


def _first_tensor(doc: dict[str, Any]) -> str:
    return next(k for k in doc if k != "__metadata__")


def _assert_one_line_exit_2(res, names: Path | str,  # type: ignore[no-untyped-def]
                            rc: int = 2) -> str:
    assert res.rc == rc, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert str(names) in lines[0], lines[0]
    return lines[0]


def _run_assemble(p: CkptPair, fp8: Path | None = None):  # type: ignore[no-untyped-def]
    return run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", fp8 or p.fp8,
                   "--out", p.out)


def _assemble(p: CkptPair, out: Path | None = None, fp8: Path | None = None) -> list[str | Path]:
    return ["checkpoint", "assemble", "--int4", p.int4, "--fp8", fp8 or p.fp8,
            "--out", out or p.out, "--json"]


def _built(p: CkptPair, out: Path | None = None, fp8: Path | None = None) -> dict:
    res = run(*_assemble(p, out, fp8))
    assert res.rc == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _first_shard(directory: Path) -> Path:
    return directory / "model-00001-of-00002.safetensors"


def _build(tree: Tree, *extra: str | Path) -> list[str | Path]:
    return ["checkpoint", "build", "--int4", tree.int4, "--fp8", tree.fp8, "--out", tree.out,
            "--no-load", *extra]


def _set_config(folder: Path, key: str, value: object) -> None:
    path = folder / "config.json"
    doc = json.loads(path.read_text())
    doc["text_config"][key] = value
    path.write_text(json.dumps(doc))


def _built_outputs(tree: Tree) -> dict[str, dict[str, object]]:
    done = run(*_build(tree, "--json"))
    assert done.rc == 0, done.stderr
    return dict(json.loads((tree.out / MANIFEST_NAME).read_text())["outputs"])
