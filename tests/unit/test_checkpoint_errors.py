"""Each bad input: exit 2, one stderr line naming the file, no traceback, nothing left that verify
accepts."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CkptPair, run_cli

from sparkspec.checkpoint.safetensors_io import INDEX_NAME, encode_header, read_header, read_index
from sparkspec.checkpoint.selection import EXTRA_FILE
from tests.support import testckpt


def _assert_one_line_exit_2(res, names: Path | str,  # type: ignore[no-untyped-def]
                            rc: int = 2) -> str:
    assert res.rc == rc, (res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert str(names) in lines[0], lines[0]
    return lines[0]


def _assert_nothing_verifiable(out: Path) -> None:
    assert run_cli("checkpoint", "verify", out).rc == 2
    assert not (out.parent / f".{out.name}.assemble-tmp").exists()


def _assemble(p: CkptPair, fp8: Path | None = None):  # type: ignore[no-untyped-def]
    return run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", fp8 or p.fp8,
                   "--out", p.out)


def _first_shard(directory: Path) -> Path:
    return directory / "model-00001-of-00002.safetensors"


def _retype(path: Path, name: str, dtype: str) -> None:
    """Rewrite a file so that ``name`` has another dtype of the same size (a valid file, wrong
    content)."""
    header = read_header(path)
    raw = path.read_bytes()
    specs = [(t.name, dtype if t.name == name else t.dtype, t.shape,
              t.nbytes) for t in header.tensors.values()]
    prefix, _ = encode_header(specs, header.metadata)
    path.write_bytes(prefix + raw[header.data_start:])


@pytest.mark.parametrize("damage, words", [
    ("truncated", "truncated"),
    ("length_past_eof", "past the end"),
    ("garbage_json", "not valid JSON"),
])
def test_damaged_int4_shard(ckpt_pair: CkptPair, damage: str, words: str) -> None:
    shard = _first_shard(ckpt_pair.int4)
    raw = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(raw[: len(raw) - 1000])
    elif damage == "length_past_eof":
        shard.write_bytes(struct.pack("<Q", len(raw) * 2) + raw[8:])
    else:
        shard.write_bytes(raw[:8] + b"\x00garbage{" + raw[17:])
    line = _assert_one_line_exit_2(_assemble(ckpt_pair), shard)
    assert words in line
    _assert_nothing_verifiable(ckpt_pair.out)


def test_shape_mismatch_between_sources(ckpt_pair: CkptPair) -> None:
    other = ckpt_pair.fp8.parent / "fp8_other"
    testckpt.write_fp8(other, testckpt.ModelSpec(shared_intermediate=256))
    line = _assert_one_line_exit_2(_assemble(ckpt_pair, other), other)
    assert "shape mismatch" in line
    _assert_nothing_verifiable(ckpt_pair.out)


def test_dtype_mismatch_between_sources(ckpt_pair: CkptPair) -> None:
    name = "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight"
    shard = ckpt_pair.fp8 / read_index(ckpt_pair.fp8)["weight_map"][name]
    _retype(shard, name, "I8")
    line = _assert_one_line_exit_2(_assemble(ckpt_pair), shard)
    assert "dtype mismatch" in line
    _assert_nothing_verifiable(ckpt_pair.out)


def test_nothing_to_replace_refuses(ckpt_pair: CkptPair) -> None:
    line = _assert_one_line_exit_2(_assemble(ckpt_pair, ckpt_pair.int4.parent / "int4_listed"),
                                   ckpt_pair.int4.parent / "int4_listed")
    assert "F8_E4M3" in line
    _assert_nothing_verifiable(ckpt_pair.out)


@pytest.mark.parametrize("which", ["int4", "fp8"])
def test_missing_index(ckpt_pair: CkptPair, which: str) -> None:
    directory = getattr(ckpt_pair, which)
    (directory / INDEX_NAME).unlink()
    _assert_one_line_exit_2(_assemble(ckpt_pair), directory / INDEX_NAME)
    _assert_nothing_verifiable(ckpt_pair.out)


def test_missing_model_extra_tensors(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    assert _assemble(p).rc == 0
    (p.int4 / EXTRA_FILE).unlink()
    res = run_cli("checkpoint", "add-mtp", "--source", p.int4, "--target", p.out)
    _assert_one_line_exit_2(res, p.int4 / EXTRA_FILE)
    # the hybrid without its MTP head is refused
    assert run_cli("checkpoint", "verify", p.out).rc == 2


def test_add_mtp_without_target_index(ckpt_pair: CkptPair, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _assert_one_line_exit_2(run_cli("checkpoint", "add-mtp", "--source", ckpt_pair.int4,
                                           "--target", empty), empty)
    assert "was not written by sparkspec checkpoint assemble" in line
    assert list(empty.iterdir()) == []


def test_output_filesystem_too_small(ckpt_pair: CkptPair,
                                     ckpt_tmpfs: Callable[[str], Path]) -> None:
    mount = ckpt_tmpfs("1m")
    ckpt_pair.out = mount / "hybrid"
    line = _assert_one_line_exit_2(_assemble(ckpt_pair), mount)
    assert " free, the hybrid needs " in line
    assert not ckpt_pair.out.exists()
    _assert_nothing_verifiable(ckpt_pair.out)
    assert [x.name for x in mount.iterdir() if not x.name.endswith(".lock")] == []


def test_output_filesystem_fills_up_during_add_mtp_copy(ckpt_pair: CkptPair,
                                                        ckpt_tmpfs: Callable[[str], Path]) -> None:
    p = ckpt_pair
    size = sum(f.stat().st_size for f in p.int4.iterdir() if f.name != EXTRA_FILE)
    assert (p.int4 / EXTRA_FILE).stat().st_size > 1_000_000
    mount = ckpt_tmpfs(f"{size // 1024 + 600}k")  # room for the hybrid, not for the MTP head too
    p.out = mount / "hybrid"
    assert _assemble(p).rc == 0, "tmpfs sized too small for the hybrid itself"
    index_before = (p.out / INDEX_NAME).read_bytes()
    line = _assert_one_line_exit_2(run_cli("checkpoint", "add-mtp", "--source", p.int4,
                                           "--target", p.out),
                                   p.out / EXTRA_FILE, rc=1)  # a run-time failure: exit 1
    assert "no space left" in line
    assert (p.out / INDEX_NAME).read_bytes() == index_before and not (p.out / EXTRA_FILE).exists()
    assert not list(p.out.glob(".*.tmp")) and not list(p.out.glob("*.tmp"))
    assert run_cli("checkpoint", "verify", p.out).rc == 2


def test_bad_pattern_and_out_collisions(ckpt_pair: CkptPair, tmp_path: Path) -> None:
    p = ckpt_pair
    res = run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out,
                  "--fp8-pattern", "(")
    assert "--fp8-pattern" in _assert_one_line_exit_2(res, "(")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    res = run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8, "--out", foreign)
    _assert_one_line_exit_2(res, foreign)
    assert (foreign / "keep.txt").read_text() == "mine"
    res = run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8, "--out", p.int4)
    _assert_one_line_exit_2(res, p.int4)
    assert json.loads((p.int4 / "config.json").read_text()).get("sparkspec_hybrid") is None
