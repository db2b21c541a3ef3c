from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from sparkspec.checkpoint.safetensors_io import (
    DTYPE_SIZES,
    INDEX_NAME,
    Header,
    encode_header,
    expected_nbytes,
    parse_header,
    read_header,
    read_index,
    write_file,
    write_index,
)
from sparkspec.errors import UserError


def _sample(tmp_path: Path) -> Path:
    path = tmp_path / "ref.safetensors"
    save_file({"b": np.arange(15, dtype=np.float16).reshape(3, 5),
               "a": np.arange(7, dtype=np.int32), "empty": np.zeros((0, 4), dtype=np.float32)},
              str(path), metadata={"format": "pt"})
    return path


def test_reads_reference_writer_offsets(tmp_path: Path) -> None:
    path = _sample(tmp_path)
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert header.file_size == path.stat().st_size
    raw = path.read_bytes()
    with safe_open(str(path), "np") as f:
        for name in f.keys():
            info = header.tensors[name]
            arr = f.get_tensor(name)
            assert info.shape == arr.shape
            assert raw[header.data_start + info.begin: header.data_start + info.end] == \
                arr.tobytes()


def test_writer_output_loads_with_reference_reader(tmp_path: Path) -> None:
    w = np.arange(12, dtype=np.int32).reshape(3, 4)
    z = np.linspace(0, 1, 6, dtype=np.float16)
    path = tmp_path / "x.safetensors"
    header = write_file(path, {"w": ("I32", (3, 4), w.tobytes()), "z": ("F16", (6,), z.tobytes())},
                        {"format": "pt"})
    loaded = load_file(str(path))
    assert np.array_equal(loaded["w"], w) and np.array_equal(loaded["z"], z)
    assert header.data_start % 8 == 0
    assert read_header(path) == header


def test_encode_header_pads_to_eight_and_lays_out_in_order() -> None:
    prefix, infos = encode_header([("x", "BF16", (3,), 6), ("y", "F8_E4M3", (2, 2), 4)], None)
    (length,) = struct.unpack("<Q", prefix[:8])
    assert len(prefix) == 8 + length and length % 8 == 0
    assert prefix[8:].rstrip(b" ").endswith(b"}")
    assert (infos["x"].begin, infos["x"].end, infos["y"].begin, infos["y"].end) == (0, 6, 6, 10)
    with pytest.raises(ValueError):
        encode_header([("x", "BF16", (3,), 5)], None)


def test_parse_header_over_range_reads_matches_local(tmp_path: Path) -> None:
    path = _sample(tmp_path)
    data = path.read_bytes()
    calls: list[tuple[int, int]] = []

    def ranged(offset: int, length: int) -> bytes:
        calls.append((offset, length))
        return data[offset: offset + length]

    assert parse_header(ranged, len(data), "https://hub/x") == read_header(path)
    assert len(calls) == 2 and sum(n for _, n in calls) < len(data)


def _rewrite(path: Path, doc: dict, data: bytes) -> None:
    body = json.dumps(doc).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


@pytest.mark.parametrize("damage, words", [
    ("truncate", "truncated"),
    ("trailing", "trailing bytes"),
    ("length_past_eof", "past the end"),
    ("garbage_json", "not valid JSON"),
    ("gap", "contiguously"),
    ("size_mismatch", "data_offsets span"),
    ("unknown_dtype", "unknown dtype"),
    ("tiny", "too short"),
])
def test_damaged_files_raise_user_error_naming_the_file(tmp_path: Path, damage: str,
                                                        words: str) -> None:
    path = tmp_path / "bad.safetensors"
    write_file(path, {"a": ("F32", (4,), bytes(16)), "b": ("I32", (2,), bytes(8))})
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    doc = json.loads(raw[8: 8 + length])
    data = raw[8 + length:]
    if damage == "truncate":
        path.write_bytes(raw[:-3])
    elif damage == "trailing":
        path.write_bytes(raw + b"xx")
    elif damage == "length_past_eof":
        path.write_bytes(struct.pack("<Q", 10 ** 9) + raw[8:])
    elif damage == "garbage_json":
        path.write_bytes(raw[:8] + b"{not json" + raw[17:])
    elif damage == "gap":
        doc["b"]["data_offsets"] = [20, 28]
        _rewrite(path, doc, data + bytes(4))
    elif damage == "size_mismatch":
        doc["a"]["shape"] = [5]
        _rewrite(path, doc, data)
    elif damage == "unknown_dtype":
        doc["a"]["dtype"] = "F12"
        _rewrite(path, doc, data)
    elif damage == "tiny":
        path.write_bytes(b"\x01\x02")
    with pytest.raises(UserError) as err:
        read_header(path)
    assert str(path) in str(err.value) and words in str(err.value)
    assert "\n" not in str(err.value)


def test_index_round_trip_and_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="index not found"):
        read_index(tmp_path)
    (tmp_path / INDEX_NAME).write_text("{oops")
    with pytest.raises(UserError, match="not valid JSON"):
        read_index(tmp_path)
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(UserError, match="weight_map"):
        read_index(tmp_path)
    write_index(tmp_path, {"b": "f2.safetensors", "a": "f1.safetensors"}, 123, {"format": "pt"})
    doc = read_index(tmp_path)
    assert doc["metadata"] == {"format": "pt", "total_size": 123}
    assert list(doc["weight_map"]) == ["a", "b"]
    assert not list(tmp_path.glob("*.tmp"))


# --- property tests: whatever the bytes, a header that tiles the file exactly, or one
# UserError ---------------
_JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                       st.floats(allow_nan=True), st.text(max_size=8))
_JSON = st.recursive(_JSON_LEAF, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
_DIMS = st.lists(st.integers(0, 6), max_size=3)
_ENTRY = st.one_of(
    # valid, offsets later
    st.fixed_dictionaries({"dtype": st.sampled_from(sorted(DTYPE_SIZES)), "shape": _DIMS}),
    st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]), _JSON,
                    max_size=4),
    _JSON,
)


def _well_typed(entry: Any) -> bool:
    """An entry with a known dtype and a shape of natural numbers, still without offsets."""
    return (isinstance(entry, dict) and set(entry) == {"dtype", "shape"}
            and isinstance(entry["dtype"], str) and entry["dtype"] in DTYPE_SIZES
            and isinstance(entry["shape"], list)
            and all(type(d) is int and d >= 0 for d in entry["shape"]))


def _assert_tiles(header: Header, size: int) -> None:
    infos = sorted(header.tensors.values(), key=lambda t: (t.begin, t.end))
    cursor = 0
    for info in infos:
        assert info.begin == cursor and info.end >= info.begin
        assert info.nbytes == expected_nbytes(info.dtype, info.shape)
        cursor = info.end
    assert header.data_start + cursor == size == header.file_size


def _parse(blob: bytes) -> Header | None:
    try:
        header = parse_header(lambda off, n: blob[off: off + n], len(blob), "prop.safetensors")
    except UserError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("prop.safetensors: ")
        return None
    _assert_tiles(header, len(blob))
    return header


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256))
def test_parse_header_on_arbitrary_bytes(blob: bytes) -> None:
    _parse(blob)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(entries=st.dictionaries(st.text(max_size=6), _ENTRY, max_size=5),
       metadata=st.one_of(st.none(), _JSON,
                          st.dictionaries(st.text(max_size=4), st.text(max_size=4))),
       lay_out=st.booleans(), slack=st.integers(-3, 3),
       length_delta=st.sampled_from([0, 0, 0, -1, 1, 2 ** 40]),
       raw_json=st.one_of(st.none(), st.text(max_size=40)))
def test_parse_header_on_generated_headers(entries: dict[str, Any], metadata: Any, lay_out: bool,
                                           slack: int, length_delta: int,
                                           raw_json: str | None) -> None:
    """Headers near the valid ones: right or wrong types in every field, offsets laid out
    contiguously or not, a data buffer of the right size or a few bytes off, a length prefix that
    lies, or raw text."""
    doc: dict[str, Any] = {}
    cursor = 0
    for name, entry in entries.items():
        if lay_out and _well_typed(entry):
            nbytes = math.prod(entry["shape"]) * DTYPE_SIZES[entry["dtype"]]
            entry = {**entry, "data_offsets": [cursor, cursor + nbytes]}
            cursor += nbytes
        doc[name] = entry
    if metadata is not None:
        doc["__metadata__"] = metadata
    body = (raw_json if raw_json is not None else json.dumps(doc)).encode()
    blob = (struct.pack("<Q", max(0, len(body) + length_delta)) + body
            + bytes(max(0, cursor + slack)))
    header = _parse(blob)
    # --hypothesis-show-statistics: both happen
    event("parsed" if header is not None else "refused")
    if header is not None and raw_json is None:
        assert set(header.tensors) == set(doc) - {"__metadata__"}
