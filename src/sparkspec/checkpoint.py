"""Assemble the hybrid checkpoint: AutoRound INT4 shards with selected layers taken in FP8.

Plan from headers only, then stream byte ranges into fresh shards (never a whole shard in memory),
hashing what is written in the same pass. Everything is built in a temporary sibling of ``--out`` and
renamed into place at the end; a manifest records inputs and output digests so that an unchanged
re-run is a no-op (also after add-mtp has added its entries to the index). Sources are opened read-only.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkspec.ckpt_stream import (HASH_NAME, Piece, Progress, copy_file, fsync_dir, fsync_path, new_hash,
                                   write_pieces)
from sparkspec.ckpt_select import (compile_patterns, fp8_candidates, fp8_pair, fp8_selection,
                                   int4_model_shards, int4_model_tensors, module_of, weight_block_size)
from sparkspec.errors import UserError
from sparkspec.hubrepo import REVISION_FILE
from sparkspec.jsonfile import read_json
from sparkspec.safetensors_io import (INDEX_NAME, Header, TensorInfo, encode_header, read_header, read_index,
                                      write_index)

MANIFEST_NAME = "sparkspec-manifest.json"
CONFIG_KEY = "sparkspec_hybrid"  # top-level config.json key; never inside quantization_config
FORMAT_VERSION = 1

@dataclass
class Plan:
    shards: dict[str, list[Piece]]
    fp8_modules: list[str]
    side_files: list[str]
    inputs: dict[str, Any]
    config: dict[str, Any]
    expected_fp8: int | None
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(p.nbytes for pieces in self.shards.values() for p in pieces)

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.inputs, sort_keys=True).encode()).hexdigest()


def _revision(directory: Path) -> str | None:
    """The hub commit of a download: snapshot folder name, or huggingface_hub's local-dir metadata."""
    real = directory.resolve()
    if real.parent.name == "snapshots":
        return real.name
    marker = directory / REVISION_FILE  # written by sparkspec fetch
    if marker.is_file():
        return marker.read_text().strip() or None
    # huggingface_hub's local-dir download metadata: first line is the commit. Read it directly:
    # huggingface_hub's own reader creates .cache folders, and sources must never be modified.
    for name in ("config.json", INDEX_NAME):
        meta = directory / ".cache" / "huggingface" / "download" / f"{name}.metadata"
        try:
            commit = meta.read_text().split("\n", 1)[0].strip()
        except OSError:
            continue
        if commit:
            return commit
    return None


def _stat(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _load_json(path: Path) -> dict[str, Any]:
    doc = read_json(path, "not found; point at a complete checkpoint directory", "re-download it")
    if not isinstance(doc, dict):
        raise UserError(f"{path}: not a JSON object; re-download it")
    return doc


def _headers(directory: Path, files: Iterable[str]) -> dict[str, Header]:
    return {f: read_header(directory / f) for f in sorted(files)}


def _check_index(index_path: Path, weight_map: dict[str, str], headers: dict[str, Header]) -> None:
    for tensor, file in weight_map.items():
        if file in headers and tensor not in headers[file].tensors:
            raise UserError(f"{index_path}: maps {tensor} to {file}, whose header has no such tensor; "
                            "re-download the checkpoint")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def plan_assembly(int4: Path, fp8: Path, patterns: Iterable[str] = (), expect_fp8: int | None = None) -> Plan:
    int4, fp8, patterns = Path(int4), Path(fp8), list(patterns)
    compile_patterns(patterns)
    index4 = read_index(int4)["weight_map"]
    shard_files = int4_model_shards(index4)
    if not shard_files:
        raise UserError(f"{int4 / INDEX_NAME}: maps no model shard; point --int4 at the INT4 checkpoint")
    h4 = _headers(int4, shard_files)
    _check_index(int4 / INDEX_NAME, index4, h4)
    config = _load_json(int4 / "config.json")
    fp8_config = _load_json(fp8 / "config.json")
    block = weight_block_size(fp8_config)
    index8 = read_index(fp8)["weight_map"]
    int4_tensors = int4_model_tensors(h4.values())
    int4_file = {n: f for f, h in h4.items() for n in h.tensors}
    h8: dict[str, Header] = {}
    fp8_tensors: dict[str, TensorInfo] = {}
    for module in fp8_candidates(int4_tensors, index8, patterns):
        for name in fp8_pair(module):
            file = index8[name]
            if file not in h8:
                h8[file] = read_header(fp8 / file)
            if name not in h8[file].tensors:
                raise UserError(f"{fp8 / INDEX_NAME}: maps {name} to {file}, whose header has no such tensor; "
                                "re-fetch the FP8 source")
            fp8_tensors[name] = h8[file].tensors[name]

    def where(side: str, name: str) -> str:
        return str(int4 / int4_file[name]) if side == "int4" else str(fp8 / index8[name])

    modules = fp8_selection(int4_tensors, fp8_tensors, patterns, block, where)
    if not modules:
        raise UserError(f"{fp8}: no tensor of {int4} has an F8_E4M3 X.weight with X.weight_scale_inv there; "
                        "check that --fp8 is the FP8 checkpoint of the same model (or widen with --fp8-pattern)")
    replaced: dict[str, tuple[Piece, Piece]] = {}
    for module in modules:
        pair = []
        for name in fp8_pair(module):
            t, file = fp8_tensors[name], index8[name]
            pair.append(Piece(name, t.dtype, t.shape, fp8 / file, h8[file].data_start + t.begin, t.nbytes))
        replaced[module] = (pair[0], pair[1])

    shards: dict[str, list[Piece]] = {}
    for file, header in h4.items():
        pieces: list[Piece] = []
        for name, t in header.tensors.items():
            module = module_of(name)
            if name.startswith("mtp."):
                continue  # add-mtp's job
            if module in replaced:
                if name in (f"{module}.weight", f"{module}.qweight"):
                    pieces.extend(replaced[module])
                continue
            pieces.append(Piece(name, t.dtype, t.shape, int4 / file, header.data_start + t.begin, t.nbytes))
        if pieces:
            shards[file] = pieces
    side = sorted(p.name for p in int4.iterdir()
                  if p.is_file() and not p.name.startswith(".") and not p.name.endswith(".safetensors")
                  and p.name not in (INDEX_NAME, "config.json", MANIFEST_NAME))
    tc = text_config(config)
    if expect_fp8 is None and tc.get("shared_expert_intermediate_size") and tc.get("num_hidden_layers"):
        expect_fp8 = 3 * int(tc["num_hidden_layers"])
    fp8_modules = modules
    scale_dtypes = sorted({replaced[m][1].dtype for m in fp8_modules})
    out_config = dict(config)
    out_config[CONFIG_KEY] = {"fp8_layers": fp8_modules, "fp8_weight_block_size": list(block),
                              "fp8_scale_dtype": scale_dtypes, "fp8_patterns": list(patterns),
                              "int4_revision": _revision(int4), "fp8_revision": _revision(fp8)}
    used = {p.src for pieces in shards.values() for p in pieces}
    inputs = {
        "format": FORMAT_VERSION, "hash": HASH_NAME, "fp8_patterns": list(patterns),
        "int4": {"path": str(int4.resolve()), "revision": _revision(int4),
                 "files": {f: _stat(int4 / f) for f in [*shard_files, INDEX_NAME, "config.json", *side]}},
        "fp8": {"path": str(fp8.resolve()), "revision": _revision(fp8),
                "files": {p.name: _stat(p) for p in sorted(used) if p.parent == fp8}
                | {INDEX_NAME: _stat(fp8 / INDEX_NAME), "config.json": _stat(fp8 / "config.json")}},
    }
    plan = Plan(shards, fp8_modules, side, inputs, out_config, expect_fp8)
    if expect_fp8 is not None and len(fp8_modules) != expect_fp8:
        plan.warnings.append(f"{fp8}: {len(fp8_modules)} layers taken in FP8, expected {expect_fp8}; check "
                             "the sources (or --expect-fp8)")
    return plan


def _is_current(out: Path, plan: Plan) -> bool:
    """Unchanged inputs and outputs in place (index may have gained add-mtp's entries)."""
    try:
        manifest = json.loads((out / MANIFEST_NAME).read_text())
        index = read_index(out)["weight_map"]
    except (OSError, ValueError, UserError):
        return False
    if manifest.get("key") != plan.key:
        return False
    for file, rec in manifest.get("outputs", {}).items():
        if file == INDEX_NAME:
            continue
        path = out / file
        if not path.is_file() or path.stat().st_size != rec.get("size"):
            return False
    return all(index.get(t) == f for t, f in manifest.get("weight_map", {}).items())


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def _io_error(exc: OSError, where: Path, needed: int) -> UserError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return UserError(f"{where}: no space left on device while writing the hybrid (needs about "
                         f"{_human(needed)}); free space or choose another --out")
    return UserError(f"{where}: {exc.strerror or exc}; check the path and permissions")


@dataclass
class AssembleResult:
    changed: bool
    out: Path
    fp8_layers: int
    expected_fp8: int | None
    tensors: int
    total_size: int
    warnings: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "out": str(self.out), "fp8_layers": self.fp8_layers,
                "expected_fp8": self.expected_fp8, "tensors": self.tensors, "total_size": self.total_size,
                "warnings": self.warnings, "hash": HASH_NAME}


def assemble(int4: Path, fp8: Path, out: Path, patterns: Iterable[str] = (), expect_fp8: int | None = None,
             progress: Callable[[int], Progress | None] | None = None) -> AssembleResult:
    """Build (or confirm) the hybrid in ``out``. ``progress(total_bytes)`` may return a per-bytes callback."""
    int4, fp8, out = Path(int4), Path(fp8), Path(out)
    plan = plan_assembly(int4, fp8, patterns, expect_fp8)
    n_tensors = sum(len(p) for p in plan.shards.values())

    def result(changed: bool) -> AssembleResult:
        return AssembleResult(changed, out, len(plan.fp8_modules), plan.expected_fp8, n_tensors,
                              plan.total_bytes, plan.warnings)

    if out.resolve() in (int4.resolve(), fp8.resolve()):
        raise UserError(f"{out}: --out is a source directory; choose a new directory")
    if _is_current(out, plan):
        return result(False)
    if out.exists() and not (out / MANIFEST_NAME).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists and was not written by sparkspec checkpoint assemble; remove it or "
                        "choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    n_files = len(plan.shards) + len(plan.side_files) + 3
    needed = (plan.total_bytes + sum((int4 / f).stat().st_size for f in plan.side_files)
              + 300 * n_tensors + 16384 * n_files)  # + headers, index, manifest, config, block slack
    if free < needed:
        raise UserError(f"{out.parent}: {_human(free)} free, the hybrid needs {_human(needed)}; free space or "
                        "choose another --out")
    lock_fd = os.open(out.parent / f".{out.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    tmp = out.parent / f".{out.name}.assemble-tmp"
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{out}: another assemble is writing it; wait for it to finish") from None
        shutil.rmtree(tmp, ignore_errors=True)  # leftover of an interrupted run
        tmp.mkdir()
        try:
            _build(tmp, int4, plan, progress)
        except OSError as exc:
            where = out / Path(exc.filename).name if exc.filename else out
            raise _io_error(exc, where, needed) from None
        finally:
            if not (tmp / MANIFEST_NAME).exists():
                shutil.rmtree(tmp, ignore_errors=True)
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        os.close(lock_fd)
    return result(True)


def _build(tmp: Path, int4: Path, plan: Plan, progress: Callable[[int], Progress | None] | None) -> None:
    tick = progress(plan.total_bytes) if progress else None
    outputs: dict[str, Any] = {}
    weight_map: dict[str, str] = {}
    for file, pieces in plan.shards.items():
        prefix, _ = encode_header([(p.name, p.dtype, p.shape, p.nbytes) for p in pieces], {"format": "pt"})
        outputs[file] = write_pieces(tmp / file, prefix, pieces, tick)
        weight_map.update({p.name: file for p in pieces})
    for name in plan.side_files:
        outputs[name] = copy_file(int4 / name, tmp / name)
    config_bytes = (json.dumps(plan.config, indent=2) + "\n").encode()
    (tmp / "config.json").write_bytes(config_bytes)
    digest = new_hash()
    digest.update(config_bytes)
    outputs["config.json"] = {"size": len(config_bytes), HASH_NAME: digest.hexdigest()}
    write_index(tmp, weight_map, plan.total_bytes)
    outputs[INDEX_NAME] = {"size": (tmp / INDEX_NAME).stat().st_size}
    for name in outputs:  # durability before the rename makes it visible
        fsync_path(tmp / name)
    manifest = {"tool": "sparkspec checkpoint assemble", "key": plan.key, "inputs": plan.inputs,
                "hash": HASH_NAME, "fp8_layers": plan.fp8_modules, "outputs": outputs,
                "weight_map": weight_map}
    (tmp / (MANIFEST_NAME + ".tmp")).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.rename(tmp / (MANIFEST_NAME + ".tmp"), tmp / MANIFEST_NAME)
    fsync_dir(tmp)
