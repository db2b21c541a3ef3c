"""`sparkspec checkpoint assemble` and `build` refusing what they must not read or write:
bad sources, outputs that would overwrite inputs or other people's files, full and read-only
filesystems, I/O errors. Each refusal is one line, exit 2 (1 for a run-time failure), and leaves
every folder involved as it was."""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sparkspec.checkpoint.safetensors_io import (
    INDEX_NAME,
    encode_header,
    read_header,
    read_index,
)
from sparkspec.checkpoint.selection import EXTRA_FILE, REVISION_FILE
from tests.badinput import assert_refused, fingerprint, refused_untouched, run
from tests.support import testckpt
from tests.unit.checkpoint.conftest import (
    SHARD,
    _assemble,
    _assert_one_line_exit_2,
    _build,
    _built,
    _first_shard,
    _run_assemble,
    _set_config,
)
from tests.unit.conftest import CkptPair, Tree, add_tensor, run_cli

# Every file format ``sparkspec checkpoint assemble|add-mtp|verify`` read, fed bad content (the
# flags: in tests/unit/cli/test_checkpoint.py). Each case asserts the exact outcome through
# tests.badinput: exit 2, exactly one line ``sparkspec: error: ...`` matching the case's regex, no
# traceback, and every folder involved unchanged by content hash (inputs, outputs, and nothing left
# behind: no temp, lock or partial output).


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


# --- other files the commands read ----------------------------------------------------------------
@pytest.mark.parametrize("damage, match", [
    ("garbage", r"revision 'not a revision!' is not a commit id"),
    ("fifo", r"not a regular file"),
    ("huge", r"more than the 4096"),
])
def test_bad_revision_marker(ckpt_tree: Tree, damage: str, match: str) -> None:
    marker = ckpt_tree.int4 / REVISION_FILE
    if damage == "fifo":
        _fifo(marker)
    else:
        marker.write_text("not a revision!\n" if damage == "garbage" else "a" * 5000)
    refused_untouched(ckpt_tree.assemble(), [ckpt_tree.root],
                      match=rf"{REVISION_FILE}.*{match}|{match}.*{REVISION_FILE}")


@pytest.mark.parametrize("kind", ["fifo", "broken_link", "link_out"])
def test_side_file_that_is_not_a_file_of_the_source(ckpt_tree: Tree, kind: str) -> None:
    side = ckpt_tree.int4 / "tokenizer.json"
    side.unlink()
    if kind == "fifo":
        _fifo(side)
    elif kind == "broken_link":
        side.symlink_to(ckpt_tree.root / "nowhere")
    else:
        (ckpt_tree.root / "secret").write_text("ssh key")
        side.symlink_to(ckpt_tree.root / "secret")
    match = r"links out of --int4" if kind == "link_out" else r"tokenizer.json.* not a regular file"
    refused_untouched(ckpt_tree.assemble(), [ckpt_tree.root], match=match)


def test_shard_linked_out_of_the_source_is_refused(ckpt_tree: Tree) -> None:
    shard = ckpt_tree.int4 / SHARD
    elsewhere = ckpt_tree.root / "elsewhere.safetensors"
    shard.rename(elsewhere)
    shard.symlink_to(elsewhere)
    refused_untouched(ckpt_tree.assemble(), [ckpt_tree.root],
                      match=rf"{SHARD}: links out of --int4")


# Each bad input: exit 2, one stderr line naming the file, no traceback, nothing left that verify
# accepts.


def _assert_nothing_verifiable(out: Path) -> None:
    assert run_cli("checkpoint", "verify", out).rc == 2
    assert not (out.parent / f".{out.name}.assemble-tmp").exists()


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
    line = _assert_one_line_exit_2(_run_assemble(ckpt_pair), shard)
    assert words in line
    _assert_nothing_verifiable(ckpt_pair.out)


def test_shape_mismatch_between_sources(ckpt_pair: CkptPair) -> None:
    other = ckpt_pair.fp8.parent / "fp8_other"
    testckpt.write_fp8(other, testckpt.ModelSpec(shared_intermediate=256))
    line = _assert_one_line_exit_2(_run_assemble(ckpt_pair, other), other)
    assert "shape mismatch" in line
    _assert_nothing_verifiable(ckpt_pair.out)


def test_dtype_mismatch_between_sources(ckpt_pair: CkptPair) -> None:
    name = "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight"
    shard = ckpt_pair.fp8 / read_index(ckpt_pair.fp8)["weight_map"][name]
    _retype(shard, name, "I8")
    line = _assert_one_line_exit_2(_run_assemble(ckpt_pair), shard)
    assert "dtype mismatch" in line
    _assert_nothing_verifiable(ckpt_pair.out)


def test_nothing_to_replace_refuses(ckpt_pair: CkptPair) -> None:
    line = _assert_one_line_exit_2(_run_assemble(ckpt_pair, ckpt_pair.int4.parent / "int4_listed"),
                                   ckpt_pair.int4.parent / "int4_listed")
    assert "F8_E4M3" in line
    _assert_nothing_verifiable(ckpt_pair.out)


@pytest.mark.parametrize("which", ["int4", "fp8"])
def test_missing_index(ckpt_pair: CkptPair, which: str) -> None:
    directory = getattr(ckpt_pair, which)
    (directory / INDEX_NAME).unlink()
    _assert_one_line_exit_2(_run_assemble(ckpt_pair), directory / INDEX_NAME)
    _assert_nothing_verifiable(ckpt_pair.out)


def test_output_filesystem_too_small(ckpt_pair: CkptPair,
                                     ckpt_tmpfs: Callable[[str], Path]) -> None:
    mount = ckpt_tmpfs("1m")
    ckpt_pair.out = mount / "hybrid"
    line = _assert_one_line_exit_2(_run_assemble(ckpt_pair), mount)
    assert " free, the hybrid needs " in line
    assert not ckpt_pair.out.exists()
    _assert_nothing_verifiable(ckpt_pair.out)
    assert [x.name for x in mount.iterdir() if not x.name.endswith(".lock")] == []


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


# The checkpoint commands against a hostile user: outputs that would overwrite inputs or other
# people's files, corrupted outputs reported up to date, add-mtp half done, duplicate tensors, non-
# regular files, read-only and full filesystems. Each refusal is one line, exit 2 (1 for a run-time
# failure), and leaves every folder involved byte for byte as it was (tests.badinput fingerprints
# them: a leftover temp, lock or link counts as a change).


class Hang(BaseException):
    """A command still running after its deadline (not an OSError: the CLI must not turn it into a
    line)."""


@contextmanager
def deadline(seconds: int = 10) -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# --- assemble: outputs apart from inputs, never via a link, replaced only if assemble wrote them --
@pytest.mark.parametrize("where, how", [
    ("inside_int4", "is inside the input --int4"),
    ("equals_fp8", "is the input --fp8"),
    ("contains_both", "contains the input --int4"),
    ("link_into_int4", "is inside the input --int4"),
])
def test_assemble_out_overlapping_an_input_is_refused_before_anything(ckpt_pair: CkptPair,
                                                                      where: str,
                                                                      how: str) -> None:
    p = ckpt_pair
    root = p.int4.parent
    out = {"inside_int4": p.int4 / "hybrid", "equals_fp8": p.fp8, "contains_both": root,
           "link_into_int4": root / "sneaky" / "hybrid"}[where]
    if where == "link_into_int4":
        (root / "sneaky").symlink_to(p.int4)
    refused_untouched(_assemble(p, out), [root], match=rf"--out .* {how} ")


def test_assemble_out_symlink_is_not_replaced(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    real = p.int4.parent / "real-hybrid"
    _built(p, real, p.fp8.parent / "fp8_f32")  # an earlier hybrid of other inputs: not current
    p.out.symlink_to(real)
    refused_untouched(_assemble(p), [p.int4.parent], match="symbolic link")


def test_assemble_out_a_regular_file_is_refused(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    p.out.write_text("notes")
    refused_untouched(_assemble(p), [p.int4.parent], match=r"not a folder")


def test_assemble_replaces_its_own_output_and_leaves_no_lock(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    _built(p, fp8=p.fp8.parent / "fp8_f32")
    assert _built(p)["changed"] is True  # other inputs: rebuilt over the old hybrid, by a swap
    assert sorted(x.name for x in p.out.parent.iterdir() if x.name.startswith(".out")) == []


# --- duplicate tensors, non-regular files ---------------------------------------------------------
@pytest.mark.parametrize("side", ["int4", "fp8"])
def test_duplicate_tensor_across_shards_is_refused_naming_both(ckpt_pair: CkptPair,
                                                               side: str) -> None:
    p = ckpt_pair
    directory = getattr(p, side)
    weight_map = read_index(directory)["weight_map"]
    name = ("model.language_model.layers.3.mlp.shared_expert.up_proj.weight_scale_inv"
            if side == "fp8" else "lm_head.weight")
    home = weight_map[name]
    other = next(f for f in sorted(set(weight_map.values())) if f != home)
    info = read_header(directory / home).tensors[name]
    add_tensor(directory / other, name, info.dtype, info.shape, bytes(info.nbytes))
    refused_untouched(_assemble(p), [p.int4.parent],
                      match=rf"{name}.*({home}.*{other}|{other}.*{home})")


@pytest.mark.parametrize("command", ["assemble", "verify"])
def test_a_fifo_as_a_shard_is_refused_without_hanging(ckpt_pair: CkptPair, command: str) -> None:
    p = ckpt_pair
    if command == "verify":
        _built(p)
    directory = p.int4 if command == "assemble" else p.out
    shard = _first_shard(directory)
    shard.unlink()
    os.mkfifo(shard)
    argv = _assemble(p) if command == "assemble" else ["checkpoint", "verify", p.out, "--no-load"]
    with deadline():
        refused_untouched(argv, [p.int4.parent], match=rf"{shard.name}.* not a regular file")


# --- read-only and full filesystems ---------------------------------------------------------------
def test_read_only_output_folder_is_one_line(ckpt_pair: CkptPair,
                                             ckpt_tmpfs: Callable[..., Path]) -> None:
    p = ckpt_pair
    mount = ckpt_tmpfs("64m", readonly=True)
    refused_untouched(_assemble(p, mount / "hybrid"), [p.int4.parent, mount],
                      match=r"(?i)read-only file system.*--out")


def test_disk_full_while_writing_is_a_run_time_failure_with_nothing_left(
        ckpt_pair: CkptPair, monkeypatch: pytest.MonkeyPatch) -> None:
    p = ckpt_pair
    from sparkspec.checkpoint import assemble as checkpoint

    real = checkpoint.write_pieces
    calls = []

    def fill_up(path, prefix, pieces, progress=None):  # type: ignore[no-untyped-def]
        calls.append(path)
        if len(calls) == 2:  # the second shard finds the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, prefix, pieces, progress)

    monkeypatch.setattr(checkpoint, "write_pieces", fill_up)
    refused_untouched(_assemble(p), [p.int4.parent], rc=1, match="no space left on device")
    assert len(calls) == 2


def test_disk_full_while_rebuilding_keeps_the_old_hybrid(ckpt_pair: CkptPair,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    p = ckpt_pair
    _built(p, fp8=p.fp8.parent / "fp8_f32")
    from sparkspec.checkpoint import assemble as checkpoint

    def full(path, prefix, pieces, progress=None):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpoint, "write_pieces", full)
    before = fingerprint(p.int4.parent)
    res = run(*_assemble(p))
    assert_refused(res, 1, match="no space left on device")
    assert fingerprint(p.int4.parent) == before


def test_io_error_reading_a_source_is_exit_1_naming_it(ckpt_pair: CkptPair,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    p = ckpt_pair
    from sparkspec.checkpoint import assemble as checkpoint

    def bad_sector(path, prefix, pieces, progress=None):  # type: ignore[no-untyped-def]
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(pieces[0].src))

    monkeypatch.setattr(checkpoint, "write_pieces", bad_sector)
    refused_untouched(_assemble(p), [p.int4.parent], rc=1,
                      match=rf"{_first_shard(p.int4)}: Input/output error \(a run-time failure\)")


# `checkpoint build` / `verify` / `add-mtp`, second hostile round (issue 23): build refuses, before
# it writes anything, what add-mtp or verify would refuse after it; build and verify check
# config.json with one function; the manifest records add-mtp's files (the MTP head and the index)
# and a no-op or verify checks them as it checks the shards. Each refusal: exit 2, one `sparkspec:
# error:` line, the tree unchanged (tests/badinput.py).


def _link_out(tree: Tree) -> list[str | Path]:
    (tree.root / "elsewhere").mkdir()
    (tree.root / "out").symlink_to(tree.root / "elsewhere")
    return _build(tree)


def _foreign_out(tree: Tree) -> list[str | Path]:
    tree.out.mkdir()
    (tree.out / "notes.txt").write_text("mine\n")
    return _build(tree)


def _foreign_progress(tree: Tree) -> list[str | Path]:
    (tree.root / "p.json").write_text("someone's\n")
    return _build(tree, "--progress-file", tree.root / "p.json")


def _no_head(tree: Tree) -> list[str | Path]:
    (tree.int4 / EXTRA_FILE).unlink()
    return _build(tree)


def _config(key: str, value: object) -> Callable[[Tree], list[str | Path]]:
    def damage(tree: Tree) -> list[str | Path]:
        _set_config(tree.int4, key, value)
        return _build(tree)
    return damage


BUILDS: dict[str, tuple[Callable[[Tree], list[str | Path]], str]] = {
    "out-is-a-link": (_link_out, "is a symbolic link"),
    "out-is-int4": (lambda t: ["checkpoint", "build", "--int4", t.int4, "--out", t.int4],
                    "is the input --int4"),
    "out-inside-fp8": (lambda t: ["checkpoint", "build", "--int4", t.int4, "--fp8", t.fp8, "--out",
                                  t.fp8 / "hybrid"], "is inside the input --fp8"),
    "out-foreign": (_foreign_out, "was not written by"),
    "progress-foreign": (_foreign_progress, "p.json: exists and was not written by this command"),
    "progress-inside-int4": (lambda t: _build(t, "--progress-file", t.int4 / "p.json"),
                             "is inside --int4"),
    "progress-inside-out": (lambda t: _build(t, "--progress-file", t.out / "p.json"),
                            "is inside --out"),
    "no-mtp-head": (_no_head, f"{EXTRA_FILE}: not found"),
    "expect-mtp-wrong": (lambda t: _build(t, "--expect-mtp", "1"),
                         r"MTP tensors but --expect-mtp expects 1"),
    # verify's keys: before, assemble took them, wrote the hybrid, and verify refused it afterwards
    "experts-string": (_config("num_experts", "4"), "num_experts is '4'"),
    "mtp-layers-huge": (_config("mtp_num_hidden_layers", 1 << 30),
                        "mtp_num_hidden_layers is 1073741824"),
    "layers-zero": (_config("num_hidden_layers", 0), "num_hidden_layers is 0"),
}


@pytest.mark.parametrize("case", sorted(BUILDS))
def test_build_refuses_before_it_writes(ckpt_tree: Tree, case: str) -> None:
    make, match = BUILDS[case]
    argv = make(ckpt_tree)
    refused_untouched(argv, [ckpt_tree.root], match=match)
