"""Every file format ``sparkspec checkpoint assemble|add-mtp|verify`` reads (safetensors headers,
the index, config.json, the manifest), fed bad content: exit 2, one line, nothing changed."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sparkspec.checkpoint.assemble import MANIFEST_NAME
from sparkspec.checkpoint.safetensors_io import INDEX_NAME
from sparkspec.checkpoint.selection import EXTRA_FILE
from tests.badinput import refused_untouched
from tests.unit.checkpoint.conftest import SHARD, _edit_header, _first_tensor, _set_header
from tests.unit.conftest import Tree

# Every file format ``sparkspec checkpoint assemble|add-mtp|verify`` read, fed bad content (the
# flags: in tests/unit/cli/test_checkpoint.py). Each case asserts the exact outcome through
# tests.badinput: exit 2, exactly one line ``sparkspec: error: ...`` matching the case's regex, no
# traceback, and every folder involved unchanged by content hash (inputs, outputs, and nothing left
# behind: no temp, lock or partial output).


Damage = Callable[[Path], object]  # does something to the file at that path


DEEP = "[" * 5000 + "]" * 5000


def _as_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _as_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _entry(field: str, value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(doc: dict[str, Any]) -> Any:
        entry = doc[_first_tensor(doc)]
        if value is _DROP:
            del entry[field]
        else:
            entry[field] = value
        return doc
    return edit


_DROP = object()


HEADER_DAMAGE: dict[str, tuple[Damage, str]] = {
    "dtype_number": (lambda p: _edit_header(p, _entry("dtype", 5)), r"unknown dtype 5"),
    "dtype_missing": (lambda p: _edit_header(p, _entry("dtype", _DROP)), r"unknown dtype None"),
    "shape_string": (lambda p: _edit_header(p, _entry("shape", "3x4")), r"bad shape"),
    "shape_negative": (lambda p: _edit_header(p, _entry("shape", [-1, 4])), r"bad shape"),
    "shape_bool": (lambda p: _edit_header(p, _entry("shape", [True])), r"bad shape"),
    "offsets_short": (lambda p: _edit_header(p, _entry("data_offsets", [0])), r"bad data_offsets"),
    "offsets_missing": (lambda p: _edit_header(p, _entry("data_offsets", _DROP)),
                        r"bad data_offsets"),
    "entry_not_object": (lambda p: _edit_header(p, lambda d: {**d, _first_tensor(d): 3}),
                         r"is not an object"),
    "metadata_nested": (lambda p: _edit_header(p, lambda d: {**d,
                                                             "__metadata__": {"a": {"b": "c"}}}),
                        r"__metadata__ is not a string-to-string map"),
    "not_object": (lambda p: _set_header(p, "[1, 2]"), r"header JSON is not an object"),
    "deep_nesting": (lambda p: _set_header(p, '{"x": ' + DEEP + "}"),
                     r"not valid JSON .*nests deeper"),
    "nan": (lambda p: _edit_header(p, _entry("shape", float("nan"))), r"not valid JSON .*NaN"),
    "huge_integer": (lambda p: _set_header(p, '{"x": {"dtype": "U8", "shape": ['
                                              + "9" * 5000 + "]}}"),
                     r"not valid JSON"),
    "not_utf8": (lambda p: p.write_bytes(struct.pack("<Q", 2) + b"\xff\xfe" + p.read_bytes()[8:]),
                 r"not valid JSON \(UnicodeDecodeError"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-1000]), r"truncated"),
    "length_past_eof": (lambda p: p.write_bytes(struct.pack("<Q", 1 << 40) + p.read_bytes()[8:]),
                        r"past the end"),
    "tiny": (lambda p: p.write_bytes(b"\x01"), r"too short"),
    "fifo": (_as_fifo, r"not a regular file"),
    "folder": (_as_folder, r"not a regular file"),
}


def _json_damage(key_path: tuple[str, ...], value: Any) -> Damage:
    def damage(path: Path) -> None:
        doc = json.loads(path.read_text())
        node = doc
        for key in key_path[:-1]:
            node = node[key]
        if value is _DROP:
            del node[key_path[-1]]
        else:
            node[key_path[-1]] = value
        path.write_text(json.dumps(doc))
    return damage


def _raw(text: str) -> Damage:
    def damage(path: Path) -> None:
        path.write_text(text)
    return damage


def _first_mapped(value: Any) -> Damage:
    def damage(path: Path) -> None:
        doc = json.loads(path.read_text())
        doc["weight_map"][next(iter(doc["weight_map"]))] = value
        path.write_text(json.dumps(doc))
    return damage


# damage common to every JSON file the commands read
JSON_DAMAGE: dict[str, tuple[Damage, str]] = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]),
                  r"not valid JSON"),
    "deep_nesting": (_raw(DEEP), r"not valid JSON .*nests deeper"),
    "nan": (_raw('{"a": NaN}'), r"not valid JSON .*NaN"),
    "not_object": (_raw("[1, 2, 3]"), r"not a JSON object"),
    "fifo": (_as_fifo, r"not a regular file"),
    "folder": (_as_folder, r"not a regular file"),
}


INDEX_DAMAGE: dict[str, tuple[Damage, str]] = {
    **JSON_DAMAGE,
    "weight_map_list": (_json_damage(("weight_map",), []), r"no weight_map"),
    "weight_map_missing": (_json_damage(("weight_map",), _DROP), r"no weight_map"),
    "file_number": (_first_mapped(7), r"no weight_map"),
    "file_parent": (_first_mapped("../int4/x.safetensors"), r"not a plain file name"),
    "file_absolute": (_first_mapped("/etc/passwd"), r"not a plain file name"),
    "file_in_folder": (_first_mapped("sub/x.safetensors"), r"not a plain file name"),
    "file_dotdot": (_first_mapped(".."), r"not a plain file name"),
    "total_size_string": (_json_damage(("metadata", "total_size"), "1 GB"), r"'total_size' is str"),
    "total_size_negative": (_json_damage(("metadata", "total_size"), -5),
                            r"total_size is negative"),
    "metadata_list": (_json_damage(("metadata",), []), r"'metadata' is list"),
}


INT4_CONFIG_DAMAGE: dict[str, tuple[Damage, str]] = {
    **JSON_DAMAGE,
    "text_config_list": (_json_damage(("text_config",), []), r"text_config is list"),
    "layers_string": (_json_damage(("text_config", "num_hidden_layers"), "4"),
                      r"num_hidden_layers is '4'"),
    "layers_zero": (_json_damage(("text_config", "num_hidden_layers"), 0),
                    r"num_hidden_layers is 0"),
    "layers_float": (_json_damage(("text_config", "num_hidden_layers"), 4.5),
                     r"num_hidden_layers is 4.5"),
    "shared_negative": (_json_damage(("text_config", "shared_expert_intermediate_size"), -128),
                        r"shared_expert_intermediate_size is -128"),
}


FP8_CONFIG_DAMAGE: dict[str, tuple[Damage, str]] = {
    **JSON_DAMAGE,
    "block_zero": (_json_damage(("quantization_config", "weight_block_size"), [0, 128]),
                   r"weight_block_size"),
    "block_string": (_json_damage(("quantization_config", "weight_block_size"), "128"),
                     r"weight_block_size"),
    "block_one": (_json_damage(("quantization_config", "weight_block_size"), [128]),
                  r"weight_block_size"),
    "block_bool": (_json_damage(("quantization_config", "weight_block_size"), [True, 128]),
                   r"weight_block_size"),
    "quantization_string": (_json_damage(("quantization_config",), "fp8"),
                            r"quantization_config is str"),
}


HYBRID_CONFIG_DAMAGE: dict[str, tuple[Damage, str]] = {
    **JSON_DAMAGE,
    "mtp_negative": (_json_damage(("text_config", "mtp_num_hidden_layers"), -1),
                     r"mtp_num_hidden_layers is -1"),
    "mtp_string": (_json_damage(("text_config", "mtp_num_hidden_layers"), "1"),
                   r"mtp_num_hidden_layers is '1'"),
    "experts_string": (_json_damage(("text_config", "num_experts"), "4"), r"num_experts is '4'"),
    "experts_zero": (_json_damage(("text_config", "num_experts"), 0), r"num_experts is 0"),
}


MANIFEST_DAMAGE: dict[str, tuple[Damage, str]] = {
    **JSON_DAMAGE,
    "outputs_list": (_json_damage(("outputs",), []), r"'outputs' is list"),
    "outputs_missing": (_json_damage(("outputs",), _DROP), r"has no 'outputs'"),
    "size_string": (_json_damage(("outputs", SHARD, "size"), "big"), r"'size' is str"),
    "inode_missing": (_json_damage(("outputs", SHARD, "ino"), _DROP), r"has no 'ino'"),
    "digest_number": (_json_damage(("outputs", SHARD, "xxh3_128"), 5), r"'xxh3_128' is int"),
    "output_escapes": (lambda p: _json_damage(("outputs", "../../../etc/passwd"), {})(p),
                       r"'\.\./\.\./\.\./etc/passwd' is not a plain file name"),
    "tool_other": (_json_damage(("tool",), "someone else"), r"was not written by"),
    "format_old": (_json_damage(("format",), 1), r"format 1 is not 2"),
}


def _cases() -> list[Any]:
    cases = []

    def add(table: dict[str, tuple[Damage, str]], target: str, command: str) -> None:
        for name, (damage, match) in table.items():
            cases.append(pytest.param(target, command, damage, match,
                                      id=f"{target}-{name}-{command}"))

    add(HEADER_DAMAGE, "int4-shard", "assemble")
    add({k: HEADER_DAMAGE[k] for k in ("truncated", "deep_nesting", "fifo", "shape_string")},
        "fp8-shard", "assemble")
    add({k: HEADER_DAMAGE[k] for k in ("truncated", "deep_nesting", "fifo", "folder", "nan")},
        "extra", "add-mtp")
    add({k: HEADER_DAMAGE[k] for k in ("truncated", "deep_nesting", "fifo", "offsets_short")},
        "hybrid-shard", "add-mtp")
    add(INDEX_DAMAGE, "int4-index", "assemble")
    add({k: INDEX_DAMAGE[k] for k in ("file_parent", "weight_map_list", "fifo", "deep_nesting")},
        "fp8-index", "assemble")
    add(INDEX_DAMAGE, "hybrid-index", "verify")
    add({k: INDEX_DAMAGE[k] for k in ("file_absolute", "total_size_string", "fifo", "truncated")},
        "hybrid-index", "add-mtp")
    add(INT4_CONFIG_DAMAGE, "int4-config", "assemble")
    add(FP8_CONFIG_DAMAGE, "fp8-config", "assemble")
    add(HYBRID_CONFIG_DAMAGE, "hybrid-config", "verify")
    add(MANIFEST_DAMAGE, "manifest", "verify")
    add({k: MANIFEST_DAMAGE[k] for k in ("truncated", "fifo", "folder", "deep_nesting")},
        "manifest", "assemble")
    add({k: JSON_DAMAGE[k] for k in ("truncated", "fifo", "deep_nesting")}, "manifest", "add-mtp")
    return cases


def _target(ckpt_tree: Tree, target: str, command: str) -> Path:
    if command == "add-mtp" or target.startswith("hybrid") or target == "manifest":
        # verify: a complete hybrid, so that only the damage fails it
        ckpt_tree.hybrid(mtp=command == "verify")
    fp8_shard = json.loads((ckpt_tree.fp8 / INDEX_NAME).read_text())["weight_map"][
        "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight"]
    return {"int4-shard": ckpt_tree.int4 / SHARD, "fp8-shard": ckpt_tree.fp8 / fp8_shard,
            "extra": ckpt_tree.int4 / EXTRA_FILE,
            "hybrid-shard": ckpt_tree.out / SHARD, "int4-index": ckpt_tree.int4 / INDEX_NAME,
            "fp8-index": ckpt_tree.fp8 / INDEX_NAME, "hybrid-index": ckpt_tree.out / INDEX_NAME,
            "int4-config": ckpt_tree.int4 / "config.json",
            "fp8-config": ckpt_tree.fp8 / "config.json",
            "hybrid-config": ckpt_tree.out / "config.json",
            "manifest": ckpt_tree.out / MANIFEST_NAME}[target]


@pytest.mark.parametrize("target, command, damage, match", _cases())
def test_bad_file(ckpt_tree: Tree, target: str, command: str, damage: Damage, match: str) -> None:
    path = _target(ckpt_tree, target, command)
    damage(path)
    argv: list[str | Path] = {
        "assemble": ckpt_tree.assemble(),
        "add-mtp": ["checkpoint", "add-mtp", "--source", ckpt_tree.int4, "--target", ckpt_tree.out],
        "verify": ["checkpoint", "verify", ckpt_tree.out, "--no-load", "--full"],
    }[command]
    line = refused_untouched(argv, [ckpt_tree.root], match=match).stderr
    assert path.name in line or str(path.parent) in line, f"the line does not name {path}: {line}"
