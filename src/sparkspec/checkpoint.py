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
import math
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkspec.ckpt_stream import (HASH_NAME, Piece, Progress, copy_file, fsync_dir, fsync_path, new_hash,
                                   write_pieces)
from sparkspec.errors import UserError
from sparkspec.safetensors_io import (INDEX_NAME, Header, TensorInfo, encode_header, read_header, read_index,
                                      write_index)

EXTRA_FILE = "model_extra_tensors.safetensors"
MANIFEST_NAME = "sparkspec-manifest.json"
CONFIG_KEY = "sparkspec_hybrid"  # top-level config.json key; never inside quantization_config
FORMAT_VERSION = 1
QUANT_SUFFIXES = (".weight", ".qweight", ".qzeros", ".scales", ".g_idx")
FUSED_GROUPS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"in_proj_qkv", "in_proj_z"},
                {"in_proj_b", "in_proj_a"})

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


def module_of(name: str) -> str | None:
    for suffix in QUANT_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def _revision(directory: Path) -> str | None:
    """The hub commit of a download: snapshot folder name, or huggingface_hub's local-dir metadata."""
    real = directory.resolve()
    if real.parent.name == "snapshots":
        return real.name
    marker = directory / ".sparkspec-revision"  # written by sparkspec fetch
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
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"{path}: not found; point at a complete checkpoint directory") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not valid JSON ({exc}); re-download it") from None
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


def _compile(patterns: Iterable[str]) -> list[re.Pattern[str]]:
    regexes = []
    for pat in patterns:
        try:
            regexes.append(re.compile(pat))
        except re.error as exc:
            raise UserError(f"--fp8-pattern {pat!r}: not a valid regular expression ({exc}); fix it") from None
    return regexes


def fp8_candidates(int4_names: Iterable[str], fp8_names: Collection[str], patterns: Iterable[str] = ()
                   ) -> list[str]:
    """Modules X that may take FP8, from tensor names only (e.g. an index, before reading headers).

    Default rule: the INT4 model shards keep ``X.weight`` (16-bit) and the FP8 checkpoint has ``X.weight``
    and ``X.weight_scale_inv``. A ``--fp8-pattern`` (re.search on X) also admits INT4 ``X.qweight`` modules.
    ``mtp.*`` is never a candidate (add-mtp's job). Fetch ``X.weight`` + ``X.weight_scale_inv`` for each.
    """
    regexes = _compile(patterns)
    out = set()
    for name in int4_names:
        module = module_of(name)
        if module is None or name.startswith("mtp."):
            continue
        if not (name.endswith(".weight") or (name.endswith(".qweight") and any(r.search(module)
                                                                               for r in regexes))):
            continue
        if f"{module}.weight" in fp8_names and f"{module}.weight_scale_inv" in fp8_names:
            out.add(module)
    return sorted(out)


def _label(side: str, name: str) -> str:
    return f"{side} {name}"


def fp8_selection(int4_tensors: Mapping[str, TensorInfo], fp8_tensors: Mapping[str, TensorInfo],
                  patterns: Iterable[str] = (), block: Sequence[int] = (128, 128),
                  source: Callable[[str, str], str] = _label) -> list[str]:
    """The validated modules to take in FP8 (sorted): the candidates whose FP8 ``X.weight`` is F8_E4M3 of
    the INT4 module's [out, in] with a BF16/F32 scale of [ceil(out/b0), ceil(in/b1)]; fused groups whole.

    ``int4_tensors``: the INT4 model shards' tensors by name; ``fp8_tensors``: FP8 tensors by name (at least
    each candidate's weight and scale). ``source(side, name)`` names the file holding a tensor ("int4" or
    "fp8" side) in error messages. Raises UserError on a dtype or shape mismatch between the sources.
    """
    chosen = []
    for module in fp8_candidates(int4_tensors, fp8_tensors, patterns):
        t = int4_tensors.get(f"{module}.weight") or int4_tensors[f"{module}.qweight"]
        w, scale = fp8_tensors[f"{module}.weight"], fp8_tensors[f"{module}.weight_scale_inv"]
        if w.dtype != "F8_E4M3":
            raise UserError(f"{source('fp8', w.name)}: {w.name} has a weight_scale_inv but dtype {w.dtype}, "
                            "expected F8_E4M3; dtype mismatch between sources, check --fp8")
        if t.name.endswith(".weight") and t.dtype not in ("BF16", "F16", "F32"):
            raise UserError(f"{source('int4', t.name)}: {t.name} is {t.dtype}, expected a 16/32-bit float to "
                            "replace with FP8; dtype mismatch between sources, check --int4")
        want = (t.shape[1], t.shape[0] * 8) if t.name.endswith(".qweight") and len(t.shape) == 2 else t.shape
        if tuple(w.shape) != tuple(want):
            raise UserError(f"{source('fp8', w.name)}: {w.name} is {list(w.shape)} but "
                            f"{source('int4', t.name)} has {t.name} {t.dtype} {list(t.shape)} (weight "
                            f"{list(want)}); shape mismatch between sources, check --int4 and --fp8 are one model")
        want_scale = tuple(math.ceil(d / b) for d, b in zip(want, block))
        if scale.dtype not in ("BF16", "F32") or tuple(scale.shape) != want_scale:
            raise UserError(f"{source('fp8', scale.name)}: {scale.name} is {scale.dtype} {list(scale.shape)}, "
                            f"expected BF16 or F32 {list(want_scale)} for block {list(block)}; re-fetch it")
        chosen.append(module)
    int4_modules = {module_of(n) for n in int4_tensors}
    for module in chosen:
        parent, _, leaf = module.rpartition(".")
        for group in FUSED_GROUPS:
            missing = [f"{parent}.{o}" for o in sorted(group - {leaf}) if leaf in group
                       and f"{parent}.{o}" in int4_modules and f"{parent}.{o}" not in chosen]
            if missing:
                raise UserError(f"{source('fp8', module + '.weight')}: {module} would be FP8 but {missing[0]} "
                                "not; vLLM fuses them, so make --fp8-pattern cover the whole group or none")
    return chosen


def plan_assembly(int4: Path, fp8: Path, patterns: Iterable[str] = (), expect_fp8: int | None = None) -> Plan:
    int4, fp8, patterns = Path(int4), Path(fp8), list(patterns)
    _compile(patterns)
    index4 = read_index(int4)["weight_map"]
    shard_files = sorted({f for t, f in index4.items() if f != EXTRA_FILE and not t.startswith("mtp.")})
    if not shard_files:
        raise UserError(f"{int4 / INDEX_NAME}: maps no model shard; point --int4 at the INT4 checkpoint")
    h4 = _headers(int4, shard_files)
    _check_index(int4 / INDEX_NAME, index4, h4)
    config = _load_json(int4 / "config.json")
    fp8_config = _load_json(fp8 / "config.json")
    block = tuple((fp8_config.get("quantization_config") or {}).get("weight_block_size") or (128, 128))
    index8 = read_index(fp8)["weight_map"]
    int4_tensors = {n: t for h in h4.values() for n, t in h.tensors.items() if not n.startswith("mtp.")}
    int4_file = {n: f for f, h in h4.items() for n in h.tensors}
    h8: dict[str, Header] = {}
    fp8_tensors: dict[str, TensorInfo] = {}
    for module in fp8_candidates(int4_tensors, index8, patterns):
        for name in (f"{module}.weight", f"{module}.weight_scale_inv"):
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
        for name in (f"{module}.weight", f"{module}.weight_scale_inv"):
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
