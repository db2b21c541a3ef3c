"""Assemble the hybrid checkpoint: AutoRound INT4 shards with selected
layers taken in FP8 (without ``--fp8``, the INT4 checkpoint alone, so that
``add-mtp`` can register its MTP head), planned from headers, streamed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkspec.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    TOOL,
    load,
    owned,
    rehash,
    stale_outputs,
    stamp,
)
from sparkspec.checkpoint.out import check_room, claim, replacing
from sparkspec.checkpoint.safetensors_io import (
    INDEX_NAME,
    Header,
    TensorInfo,
    check_unique,
    encode_header,
    read_header,
    read_index,
    write_index,
)
from sparkspec.checkpoint.selection import (
    EXTRA_FILE,
    REVISION_FILE,
    ModelConfig,
    compile_patterns,
    fp8_candidates,
    fp8_pair,
    fp8_selection,
    int4_model_shards,
    int4_model_tensors,
    module_of,
    read_config,
    weight_block_size,
)
from sparkspec.checkpoint.stream import (
    HASH_NAME,
    Piece,
    Progress,
    copy_file,
    new_hash,
    write_pieces,
)
from sparkspec.errors import UserError
from sparkspec.outputs import fsync_path, write_atomic
from sparkspec.validate import COMMIT_RE, read_regular, revision, source_file

__all__ = ["CONFIG_KEY", "MANIFEST_NAME", "AssembleResult", "Plan", "assemble", "plan_assembly"]

CONFIG_KEY = "sparkspec_hybrid"  # top-level config.json key; never inside quantization_config


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
    """The hub commit of a download: snapshot folder name, sparkspec fetch's marker,
    or huggingface_hub's local-dir metadata. Read directly (huggingface_hub's reader
    creates .cache folders; sources are never modified), as regular files only, and
    checked: a marker that is not a revision is refused."""
    real = directory.resolve()
    if real.parent.name == "snapshots":
        return real.name if COMMIT_RE.fullmatch(real.name) else None
    marker = directory / REVISION_FILE  # written by sparkspec fetch
    if os.path.lexists(marker):
        value = read_regular(marker, "revision file", 4096).decode("utf-8", "replace").strip()
        return revision(value, f"{marker}: revision") if value else None
    for name in ("config.json", INDEX_NAME):
        meta = directory / ".cache" / "huggingface" / "download" / f"{name}.metadata"
        if not meta.is_file():
            continue
        try:
            commit = read_regular(meta, "download metadata", 1 << 16).decode("utf-8", "replace")
        except UserError:
            continue
        commit = commit.split("\n", 1)[0].strip()
        if COMMIT_RE.fullmatch(commit):
            return commit
    return None


def _stat(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}


def _headers(root: Path, files: Iterable[str], flag: str) -> dict[str, Header]:
    return {f: read_header(source_file(root, root / f, flag)) for f in sorted(files)}


def _side_files(int4: Path) -> list[str]:
    """The INT4 folder's other files (tokenizer, generation config, ...), copied into the hybrid:
    each a regular file of the folder itself; sub-folders and hidden entries are left out."""
    side = []
    for path in sorted(int4.iterdir()):
        name = path.name
        if (name.startswith(".") or name.endswith(".safetensors")
                or name in (INDEX_NAME, "config.json", MANIFEST_NAME)):
            continue
        if path.is_dir():
            continue
        if not path.is_file():
            raise UserError(f"{path}: not a regular file (a FIFO, socket, device or broken link); "
                            "remove it from --int4 or put the real file there")
        side.append(str(source_file(int4, path, "--int4").name))
    return side


def _check_index(index_path: Path, weight_map: dict[str, str], headers: dict[str, Header]) -> None:
    for tensor, file in weight_map.items():
        if file in headers and tensor not in headers[file].tensors:
            raise UserError(f"{index_path}: maps {tensor} to {file}, whose header has no such "
                            "tensor; re-download the checkpoint")


def plan_assembly(int4: Path, fp8: Path | None, patterns: Iterable[str] = (),
                  expect_fp8: int | None = None) -> Plan:
    int4, fp8, patterns = Path(int4), None if fp8 is None else Path(fp8), list(patterns)
    compile_patterns(patterns)
    if fp8 is None and (patterns or expect_fp8):
        raise UserError(f"{'--fp8-pattern' if patterns else '--expect-fp8 ' + str(expect_fp8)} "
                        "needs --fp8: without it no layer is taken in FP8; give the FP8 checkpoint "
                        "or drop the option")
    for flag, source in (("--int4", int4), ("--fp8", fp8)):
        if source is None:
            continue
        if not source.is_dir():
            raise UserError(f"{flag} {source}: not a folder; point it at the checkpoint download")
        source_file(source, source / INDEX_NAME, flag)
    index4 = read_index(int4)["weight_map"]
    shard_files = int4_model_shards(index4)
    if not shard_files:
        raise UserError(f"{int4 / INDEX_NAME}: maps no model shard; point --int4 at the INT4 "
                        "checkpoint")
    h4 = _headers(int4, shard_files, "--int4")
    check_unique(int4, h4, "re-download the checkpoint")
    _check_index(int4 / INDEX_NAME, index4, h4)
    config = read_config(int4, "--int4")
    int4_tensors = int4_model_tensors(h4.values())
    if fp8 is None:
        return _finish(int4, None, shard_files, h4, config, {}, [], patterns, None, 0)
    block = weight_block_size(read_config(fp8, "--fp8").doc, str(fp8 / "config.json"))
    index8 = read_index(fp8)["weight_map"]
    int4_file = {n: f for f, h in h4.items() for n in h.tensors}
    h8: dict[str, Header] = {}
    fp8_tensors: dict[str, TensorInfo] = {}
    for module in fp8_candidates(int4_tensors, index8, patterns):
        for name in fp8_pair(module):
            file = index8[name]
            if file not in h8:
                h8[file] = read_header(source_file(fp8, fp8 / file, "--fp8"))
            if name not in h8[file].tensors:
                raise UserError(f"{fp8 / INDEX_NAME}: maps {name} to {file}, whose header has no "
                                "such tensor; re-fetch the FP8 source")
            fp8_tensors[name] = h8[file].tensors[name]
    check_unique(fp8, h8, "re-download the checkpoint")

    def where(side: str, name: str) -> str:
        return str(int4 / int4_file[name]) if side == "int4" else str(fp8 / index8[name])

    modules = fp8_selection(int4_tensors, fp8_tensors, patterns, block, where)
    if not modules:
        raise UserError(f"{fp8}: no tensor of {int4} has an F8_E4M3 X.weight with "
                        "X.weight_scale_inv there; check that --fp8 is the FP8 checkpoint of the "
                        "same model (or widen with --fp8-pattern)")
    replaced: dict[str, tuple[Piece, Piece]] = {}
    for module in modules:
        pair = []
        for name in fp8_pair(module):
            t, file = fp8_tensors[name], index8[name]
            pair.append(Piece(name, t.dtype, t.shape, fp8 / file, h8[file].data_start + t.begin,
                              t.nbytes))
        replaced[module] = (pair[0], pair[1])
    return _finish(int4, fp8, shard_files, h4, config, replaced, modules, patterns, block,
                   expect_fp8)


def _finish(int4: Path, fp8: Path | None, shard_files: list[str], h4: dict[str, Header],
            config: ModelConfig, replaced: dict[str, tuple[Piece, Piece]], modules: list[str],
            patterns: list[str], block: tuple[int, ...] | None, expect_fp8: int | None) -> Plan:
    """The plan from the INT4 headers and the FP8 pieces chosen (none without ``--fp8``)."""
    shards: dict[str, list[Piece]] = {}
    for file, header in h4.items():
        pieces: list[Piece] = []
        for name, t in header.tensors.items():
            owner = module_of(name)
            if name.startswith("mtp."):
                continue  # add-mtp's job
            if owner is not None and owner in replaced:
                if name in (f"{owner}.weight", f"{owner}.qweight"):
                    pieces.extend(replaced[owner])
                continue
            pieces.append(Piece(name, t.dtype, t.shape, int4 / file, header.data_start + t.begin,
                                t.nbytes))
        if pieces:
            shards[file] = pieces
    side = _side_files(int4)
    if expect_fp8 is None and fp8 is not None and config.layers and config.shared_expert:
        expect_fp8 = 3 * config.layers
    fp8_modules = modules
    scale_dtypes = sorted({replaced[m][1].dtype for m in fp8_modules})
    out_config = dict(config.doc)
    out_config[CONFIG_KEY] = {"fp8_layers": fp8_modules,
                              "fp8_weight_block_size": None if block is None else list(block),
                              "fp8_scale_dtype": scale_dtypes, "fp8_patterns": list(patterns),
                              "int4_revision": _revision(int4),
                              "fp8_revision": None if fp8 is None else _revision(fp8)}
    used = {p.src for pieces in shards.values() for p in pieces}
    inputs = {
        "format": FORMAT_VERSION, "hash": HASH_NAME, "fp8_patterns": list(patterns),
        "int4": {"path": str(int4.resolve()), "revision": _revision(int4),
                 "files": {f: _stat(int4 / f)
                           for f in [*shard_files, INDEX_NAME, "config.json", *side]}},
        "fp8": None if fp8 is None else {
            "path": str(fp8.resolve()), "revision": _revision(fp8),
            "files": {p.name: _stat(p) for p in sorted(used) if p.parent == fp8}
            | {INDEX_NAME: _stat(fp8 / INDEX_NAME), "config.json": _stat(fp8 / "config.json")}},
    }
    plan = Plan(shards, fp8_modules, side, inputs, out_config, expect_fp8)
    if expect_fp8 is not None and len(fp8_modules) != expect_fp8:
        plan.warnings.append(f"{fp8}: {len(fp8_modules)} layers taken in FP8, expected "
                             f"{expect_fp8}; check the sources (or --expect-fp8)")
    return plan


def _is_current(out: Path, plan: Plan) -> bool:
    """The manifest's inputs are this plan's, every output file is as
    assemble wrote it (size, times, inode, header digest) and the index
    still maps what assemble mapped (add-mtp may have added entries)."""
    if not (out / MANIFEST_NAME).is_file():
        return False
    try:
        manifest = load(out)
        # the index and the MTP head are add-mtp's to
        # record (it extends the index): judged by add-mtp
        if (manifest["key"] != plan.key
                or stale_outputs(out, manifest, skip=(INDEX_NAME, EXTRA_FILE))):
            return False
        index = read_index(out)["weight_map"]
    except UserError:
        return False
    return all(index.get(t) == f for t, f in manifest["weight_map"].items())


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
                "expected_fp8": self.expected_fp8, "tensors": self.tensors,
                "total_size": self.total_size, "warnings": self.warnings, "hash": HASH_NAME}


def check_output(int4: Path, fp8: Path | None, out: Path) -> dict[str, Path]:
    """``--out`` claimed (before reading anything:
    refused outputs cost nothing); the inputs by flag."""
    inputs = {"--int4": int4} | ({} if fp8 is None else {"--fp8": fp8})
    claim(out, "--out", TOOL, owned, inputs)
    return inputs


def assemble(int4: Path, fp8: Path | None, out: Path, patterns: Iterable[str] = (),
             expect_fp8: int | None = None,
             progress: Callable[[int], Progress | None] | None = None) -> AssembleResult:
    """Build (or confirm) the hybrid in ``out``.
    ``progress(total_bytes)`` may return a per-bytes callback."""
    int4, fp8, out = Path(int4), None if fp8 is None else Path(fp8), Path(out)
    inputs = check_output(int4, fp8, out)
    plan = plan_assembly(int4, fp8, patterns, expect_fp8)
    n_tensors = sum(len(p) for p in plan.shards.values())

    def result(changed: bool) -> AssembleResult:
        return AssembleResult(changed, out, len(plan.fp8_modules), plan.expected_fp8, n_tensors,
                              plan.total_bytes, plan.warnings)

    if _is_current(out, plan):
        return result(False)
    n_files = len(plan.shards) + len(plan.side_files) + 3
    # + headers, index, manifest, config, block slack
    needed = (plan.total_bytes + sum((int4 / f).stat().st_size for f in plan.side_files)
              + 300 * n_tensors + 16384 * n_files)
    check_room(out, needed, "--out", "the hybrid")
    with replacing(out, flag="--out", tool=TOOL, owned=owned, stage="assemble-tmp",
                   inputs=inputs) as tmp:
        _build(tmp, int4, plan, progress)
    return result(True)


def _build(tmp: Path, int4: Path, plan: Plan,
           progress: Callable[[int], Progress | None] | None) -> None:
    tick = progress(plan.total_bytes) if progress else None
    outputs: dict[str, Any] = {}
    weight_map: dict[str, str] = {}
    for file, pieces in plan.shards.items():
        prefix, _ = encode_header([(p.name, p.dtype, p.shape, p.nbytes) for p in pieces],
                                  {"format": "pt"})
        header = new_hash()
        header.update(prefix)
        outputs[file] = {**write_pieces(tmp / file, prefix, pieces, tick),
                         "header": header.hexdigest()}
        weight_map.update({p.name: file for p in pieces})
    for name in plan.side_files:
        outputs[name] = copy_file(int4 / name, tmp / name)
    config_bytes = (json.dumps(plan.config, indent=2) + "\n").encode()
    (tmp / "config.json").write_bytes(config_bytes)
    digest = new_hash()
    digest.update(config_bytes)
    outputs["config.json"] = {"size": len(config_bytes), HASH_NAME: digest.hexdigest()}
    write_index(tmp, weight_map, plan.total_bytes)
    outputs[INDEX_NAME] = {HASH_NAME: rehash(tmp / INDEX_NAME)}
    for name in outputs:  # durability before the swap makes it visible
        fsync_path(tmp / name)
    # after the last write
    outputs = {name: stamp(tmp / name, rec) for name, rec in outputs.items()}
    manifest = {"tool": TOOL, "format": FORMAT_VERSION, "key": plan.key, "inputs": plan.inputs,
                "hash": HASH_NAME, "fp8_layers": plan.fp8_modules, "outputs": outputs,
                "weight_map": weight_map}
    # last, and fsynced with the build folder: every entry above is durable before the swap
    write_atomic(tmp / MANIFEST_NAME,
                 (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
