"""safetensors headers and the sharded index: parse, validate, encode; small-file writer."""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec import outputs
from sparkspec.errors import RunFailure, UserError
from sparkspec.jsonfile import expect, loads_bounded, read_json
from sparkspec.validate import filename, open_regular

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's limit
HEADER_ALIGN = 8

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data buffer
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]  # in data-buffer order
    metadata: dict[str, str] | None
    data_start: int  # 8 + header length

    @property
    def data_size(self) -> int:
        return max((t.end for t in self.tensors.values()), default=0)

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


def expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPE_SIZES[dtype]


def _fail(source: str, what: str, fix: str = "re-download or regenerate the file") -> UserError:
    return UserError(f"{source}: {what}; {fix}")


def _parse_entry(source: str, name: str, raw: Any) -> TensorInfo:
    if not isinstance(raw, dict):
        raise _fail(source, f"header entry {name!r} is not an object")
    dtype = raw.get("dtype")
    shape = raw.get("shape")
    offsets = raw.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:
        raise _fail(source, f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _fail(source, f"tensor {name!r} has a bad shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _fail(source, f"tensor {name!r} has bad data_offsets {offsets!r}")
    info = TensorInfo(name, dtype, tuple(shape), offsets[0], offsets[1])
    want = expected_nbytes(dtype, info.shape)
    if want != info.nbytes:
        raise _fail(source, f"tensor {name!r} is {dtype} {list(shape)} = {want} bytes but its "
                            f"data_offsets span {info.nbytes}")
    return info


def parse_header(read: Callable[[int, int], bytes], size: int, source: str) -> Header:
    """Read and validate a safetensors header; ``size`` is the whole file's size in bytes."""
    if size < 8:
        raise _fail(source, f"file is {size} bytes, too short for a safetensors header")
    prefix = read(0, 8)
    if len(prefix) != 8:
        raise _fail(source, "could not read the 8-byte header length")
    (length,) = struct.unpack("<Q", prefix)
    if 8 + length > size:
        raise _fail(source, f"header length {length} runs past the end of the file ({size} bytes); "
                            "the file is truncated or not safetensors")
    if length > MAX_HEADER_BYTES:
        raise _fail(source, f"header length {length} exceeds {MAX_HEADER_BYTES} bytes")
    raw = read(8, length)
    if len(raw) != length:
        raise _fail(source, f"short read of the header ({len(raw)} of {length} bytes)")
    try:
        doc = loads_bounded(raw, max_bytes=MAX_HEADER_BYTES)
    # JSONDecodeError, UnicodeDecodeError, JsonShapeError, ...
    except (ValueError, RecursionError) as exc:
        raise _fail(source, f"header is not valid JSON ({exc.__class__.__name__}: "
                            f"{str(exc)[:200]})") from None
    if not isinstance(doc, dict):
        raise _fail(source, "header JSON is not an object")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in metadata.items())):
        raise _fail(source, "__metadata__ is not a string-to-string map")
    infos = sorted((_parse_entry(source, name, raw_entry) for name, raw_entry in doc.items()),
                   key=lambda t: (t.begin, t.end))
    cursor = 0
    for info in infos:
        if info.begin != cursor:
            raise _fail(source, f"tensor {info.name!r} starts at {info.begin} but the previous "
                                f"data ends at {cursor}; offsets must tile the data buffer "
                                "contiguously from 0")
        cursor = info.end
    data_start = 8 + length
    if data_start + cursor != size:
        what = "truncated" if data_start + cursor > size else "has trailing bytes"
        raise _fail(source, f"file is {size} bytes but its header says the data ends at "
                            f"{data_start + cursor} (file {what})")
    return Header({t.name: t for t in infos}, metadata, data_start)


def read_header(path: str | os.PathLike[str]) -> Header:
    """The validated header of a local file; a missing, unreadable or non-regular file (a folder, a
    FIFO: never waited on) is one line naming it."""
    source = str(path)
    fd = open_regular(path, "safetensors file")
    try:
        size = os.fstat(fd).st_size
        return parse_header(lambda off, n: os.pread(fd, n, off), size, source)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EISDIR, errno.EINVAL):
            raise UserError(f"{source}: cannot read it ({exc.strerror}); check the file") from None
        raise RunFailure(f"{source}: read failed ({exc.strerror}); check the disk, then "
                         "re-run") from None
    finally:
        os.close(fd)


def encode_header(tensors: list[tuple[str, str, tuple[int, ...], int]],
                  metadata: Mapping[str, str] | None = None) -> tuple[bytes, dict[str, TensorInfo]]:
    """Lay out tensors (name, dtype, shape, nbytes) in
    the given order; return prefix+JSON and the infos."""
    doc: dict[str, Any] = {}
    if metadata is not None:
        doc["__metadata__"] = dict(metadata)
    infos: dict[str, TensorInfo] = {}
    cursor = 0
    for name, dtype, shape, nbytes in tensors:
        if name in infos or name == "__metadata__":
            raise ValueError(f"duplicate or reserved tensor name {name!r}")
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {dtype!r} for {name!r}")
        if expected_nbytes(dtype, tuple(shape)) != nbytes:
            raise ValueError(f"{name!r}: {dtype} {list(shape)} is not {nbytes} bytes")
        info = TensorInfo(name, dtype, tuple(shape), cursor, cursor + nbytes)
        infos[name] = info
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [info.begin, info.end]}
        cursor = info.end
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % HEADER_ALIGN)
    return struct.pack("<Q", len(body)) + body, infos


def write_file(path: str | os.PathLike[str],
               tensors: Mapping[str, tuple[str, tuple[int, ...], bytes | bytearray | memoryview]],
               metadata: Mapping[str, str] | None = None) -> Header:
    """Write a whole (small) safetensors file in the mapping's order; for generators and tests."""
    specs = []
    for name, (dtype, shape, data) in tensors.items():
        specs.append((name, dtype, tuple(shape), memoryview(data).nbytes))
    prefix, infos = encode_header(specs, metadata)
    with open(path, "wb") as fh:
        fh.write(prefix)
        for _dtype, _shape, data in tensors.values():
            fh.write(data)
    return Header(infos, dict(metadata) if metadata is not None else None, len(prefix))


def read_index(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """Load and check ``model.safetensors.index.json``:
    a ``weight_map`` of tensor name -> file name."""
    path = Path(directory) / INDEX_NAME
    fix = "re-download the index"
    doc = read_json(path, "index not found; point at a sharded safetensors checkpoint directory",
                    fix)
    if not isinstance(doc, dict):
        raise UserError(f"{path}: is not a JSON object; {fix}")
    weight_map = doc.get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise UserError(f"{path}: has no weight_map of tensor name to file name; {fix}")
    for file_name in set(weight_map.values()):
        filename(file_name, f"{path}: weight_map file")
    metadata = expect(doc, "metadata", dict, str(path), fix, required=False)
    if metadata is not None:
        total = expect(metadata, "total_size", int, f"{path}: metadata", fix, required=False)
        if total is not None and total < 0:
            raise UserError(f"{path}: metadata.total_size is negative ({total}); {fix}")
    checked: dict[str, Any] = doc
    return checked


def stage_index(directory: str | os.PathLike[str], weight_map: Mapping[str, str], total_size: int,
                extra_metadata: Mapping[str, Any] | None = None) -> Path:
    """Write the index to a fresh fsynced temp sibling (:func:`sparkspec.outputs.stage`);
    the caller commits it (:func:`sparkspec.outputs.commit`) or removes it. Nothing is
    left behind when writing fails."""
    metadata: dict[str, Any] = dict(extra_metadata or {})
    metadata["total_size"] = int(total_size)
    doc = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    body = (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode()
    return outputs.stage(Path(directory) / INDEX_NAME, body, mode=0o644)


def write_index(directory: str | os.PathLike[str], weight_map: Mapping[str, str], total_size: int,
                extra_metadata: Mapping[str, Any] | None = None) -> Path:
    """Write the index atomically (staged, then renamed into place),
    weight_map sorted by tensor name."""
    tmp = stage_index(directory, weight_map, total_size, extra_metadata)
    path = Path(directory) / INDEX_NAME
    try:
        outputs.commit(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def check_unique(root: str | os.PathLike[str], headers: Mapping[str, Header], fix: str) -> None:
    """One tensor, one file: a name in two files would be copied twice or loaded from either.
    ``headers`` maps file name to header; the error names both files and ``fix``."""
    seen: dict[str, str] = {}
    for file, header in headers.items():
        for name in header.tensors:
            if name in seen:
                raise UserError(f"{root}: tensor {name} is in both {seen[name]} and {file}; a "
                                f"tensor lives in one file: {fix}")
            seen[name] = file
