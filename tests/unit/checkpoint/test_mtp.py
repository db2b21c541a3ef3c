from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from sparkspec.checkpoint.safetensors_io import (
    INDEX_NAME,
    read_header,
    read_index,
    write_index,
)
from sparkspec.checkpoint.selection import EXTRA_FILE
from sparkspec.checkpoint.stream import HASH_NAME
from tests.badinput import refused_untouched, run
from tests.unit.checkpoint.conftest import (
    SHARD,
    _assert_one_line_exit_2,
    _build,
    _built,
    _built_outputs,
    _edit_header,
    _first_shard,
    _first_tensor,
    _run_assemble,
)
from tests.unit.conftest import CkptPair, Tree, add_tensor, run_cli, tree_digest


def _assembled(p: CkptPair, int4: Path) -> None:
    res = run_cli("checkpoint", "assemble", "--int4", int4, "--fp8", p.fp8, "--out", p.out,
                  "--json")
    assert res.rc == 0, res.stderr


@pytest.mark.parametrize("source", ["int4", "int4_listed"])
def test_registers_every_mtp_tensor_from_the_file_header(ckpt_pair: CkptPair, source: str) -> None:
    """Whether or not the source index lists the MTP head, the target maps exactly the file's mtp.*
    tensors."""
    p = ckpt_pair
    src = p.int4.parent / source
    _assembled(p, src)
    # assemble never does it
    assert not any(n.startswith("mtp.") for n in read_index(p.out)["weight_map"])
    before_src = tree_digest(src)
    res = run_cli("checkpoint", "add-mtp", "--source", src, "--target", p.out, "--json")
    assert res.rc == 0, res.stderr
    header = read_header(src / EXTRA_FILE)
    assert res.json["changed"] is True and res.json["mtp_tensors"] == p.spec.expected_mtp_tensors
    index = read_index(p.out)
    mapped = {n for n, f in index["weight_map"].items() if f == EXTRA_FILE}
    assert mapped == set(header.tensors) and len(mapped) == p.spec.expected_mtp_tensors
    total = sum(t.nbytes for f in set(index["weight_map"].values())
                for t in read_header(p.out / f).tensors.values())
    assert index["metadata"]["total_size"] == total
    assert (p.out / EXTRA_FILE).read_bytes() == (src / EXTRA_FILE).read_bytes()
    assert res.json["file"] == "linked" and os.path.samefile(p.out / EXTRA_FILE, src / EXTRA_FILE)
    assert tree_digest(src) == before_src
    verify = run_cli("checkpoint", "verify", p.out, "--json")
    assert verify.rc == 0 and verify.json["mtp_tensors"] == p.spec.expected_mtp_tensors, \
        verify.stderr
    # idempotent: nothing rewritten
    state = tree_digest(p.out)
    again = run_cli("checkpoint", "add-mtp", "--source", src, "--target", p.out, "--json")
    assert again.rc == 0 and again.json["changed"] is False
    assert tree_digest(p.out) == state


def test_copies_across_filesystems_and_stays_idempotent(ckpt_pair: CkptPair,
                                                        ckpt_tmpfs: Callable[[str], Path]) -> None:
    p = ckpt_pair
    mount = ckpt_tmpfs("64m")
    p.out = mount / "hybrid"
    _assembled(p, p.int4)
    res = run_cli("checkpoint", "add-mtp", "--source", p.int4, "--target", p.out, "--json")
    assert res.rc == 0 and res.json["file"] == "copied", res.stderr
    assert (p.out / EXTRA_FILE).read_bytes() == (p.int4 / EXTRA_FILE).read_bytes()
    state = tree_digest(p.out)
    assert run_cli("checkpoint", "add-mtp", "--source", p.int4, "--target", p.out,
                   "--json").json["changed"] is False
    assert tree_digest(p.out) == state
    assert run_cli("checkpoint", "verify", p.out).rc == 0


def test_build_runs_assemble_add_mtp_and_verify_in_one_process(ckpt_pair: CkptPair) -> None:
    """`checkpoint build` (what a provision runs per hybrid profile) leaves the tree the three
    commands leave, run one by one; verify re-hashes every file after an assemble that wrote, and a
    re-run changes nothing."""
    p = ckpt_pair
    built = run_cli("checkpoint", "build", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out,
                    "--json", "--expect-mtp", str(p.spec.expected_mtp_tensors))
    assert built.rc == 0, built.stderr
    doc = built.json
    assert (doc["changed"] is True and doc["assemble"]["changed"] is True
            and doc["mtp"]["changed"] is True)
    assert doc["mtp"]["mtp_tensors"] == doc["verify"]["mtp_tensors"] == p.spec.expected_mtp_tensors
    full = run_cli("checkpoint", "verify", p.out, "--full", "--json").json["rehashed"]
    assert doc["verify"]["rehashed"] == full > 0, "after a write, verify is --full"
    by_hand = p.out.parent / "by-hand"
    assert run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8,
                   "--out", by_hand).rc == 0
    assert run_cli("checkpoint", "add-mtp", "--source", p.int4, "--target", by_hand).rc == 0
    # assemble's manifest names the folder, inodes and times: its own per tree
    own = (".", "sparkspec-manifest")
    assert {k: v[0] for k, v in tree_digest(p.out).items() if not k.startswith(own)} == \
        {k: v[0] for k, v in tree_digest(by_hand).items() if not k.startswith(own)}
    state = tree_digest(p.out)
    again = run_cli("checkpoint", "build", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out,
                    "--json")
    assert again.rc == 0, again.stderr
    assert again.json["changed"] is False and again.json["verify"]["rehashed"] == 0, again.stderr
    assert tree_digest(p.out) == state
    wrong = run_cli("checkpoint", "build", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out,
                    "--expect-mtp", "1")
    assert wrong.rc == 2 and wrong.stderr.strip().splitlines()[-1].startswith(
        "sparkspec: error: "), wrong.stderr


# Every file format ``sparkspec checkpoint assemble|add-mtp|verify`` read, fed bad content (the
# flags: in tests/unit/cli/test_checkpoint.py). Each case asserts the exact outcome through
# tests.badinput: exit 2, exactly one line ``sparkspec: error: ...`` matching the case's regex, no
# traceback, and every folder involved unchanged by content hash (inputs, outputs, and nothing left
# behind: no temp, lock or partial output).


def test_mtp_tensor_also_in_a_model_shard_is_refused_by_add_mtp(ckpt_tree: Tree) -> None:
    out = ckpt_tree.hybrid(mtp=False)
    info = read_header(ckpt_tree.int4 / EXTRA_FILE).tensors["mtp.fc.weight"]
    add_tensor(out / SHARD, "mtp.fc.weight", info.dtype, info.shape, bytes(info.nbytes))
    refused_untouched(["checkpoint", "add-mtp", "--source", ckpt_tree.int4, "--target", out],
                      [ckpt_tree.root], match=rf"mtp.fc.weight is in both ({SHARD} and "
                                              rf"{EXTRA_FILE}|{EXTRA_FILE} and {SHARD})")


def test_extra_file_with_a_non_mtp_tensor_is_refused(ckpt_tree: Tree) -> None:
    out = ckpt_tree.hybrid(mtp=False)
    extra = ckpt_tree.int4 / EXTRA_FILE
    _edit_header(extra, lambda d: {("lm_head.weight" if k == _first_tensor(d) else k): v
                                   for k, v in d.items()})
    refused_untouched(["checkpoint", "add-mtp", "--source", ckpt_tree.int4, "--target", out],
                      [ckpt_tree.root], match=r"non-MTP tensors \(e.g. lm_head.weight\)")


# Each bad input: exit 2, one stderr line naming the file, no traceback, nothing left that verify
# accepts.


def test_missing_model_extra_tensors(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    assert _run_assemble(p).rc == 0
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


def test_output_filesystem_fills_up_during_add_mtp_copy(ckpt_pair: CkptPair,
                                                        ckpt_tmpfs: Callable[[str], Path]) -> None:
    p = ckpt_pair
    size = sum(f.stat().st_size for f in p.int4.iterdir() if f.name != EXTRA_FILE)
    assert (p.int4 / EXTRA_FILE).stat().st_size > 1_000_000
    mount = ckpt_tmpfs(f"{size // 1024 + 600}k")  # room for the hybrid, not for the MTP head too
    p.out = mount / "hybrid"
    assert _run_assemble(p).rc == 0, "tmpfs sized too small for the hybrid itself"
    index_before = (p.out / INDEX_NAME).read_bytes()
    line = _assert_one_line_exit_2(run_cli("checkpoint", "add-mtp", "--source", p.int4,
                                           "--target", p.out),
                                   p.out / EXTRA_FILE, rc=1)  # a run-time failure: exit 1
    assert "no space left" in line
    assert (p.out / INDEX_NAME).read_bytes() == index_before and not (p.out / EXTRA_FILE).exists()
    assert not list(p.out.glob(".*.tmp")) and not list(p.out.glob("*.tmp"))
    assert run_cli("checkpoint", "verify", p.out).rc == 2


# The checkpoint commands against a hostile user: outputs that would overwrite inputs or other
# people's files, corrupted outputs reported up to date, add-mtp half done, duplicate tensors, non-
# regular files, read-only and full filesystems. Each refusal is one line, exit 2 (1 for a run-time
# failure), and leaves every folder involved byte for byte as it was (tests.badinput fingerprints
# them: a leftover temp, lock or link counts as a change).


# --- add-mtp: validate everything, then link and write; nothing half done -------------------------
def test_add_mtp_refused_after_validation_leaves_the_target_as_it_was(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    _built(p)
    doc = read_index(p.out)
    weight_map = dict(doc["weight_map"])
    weight_map["model.language_model.ghost.weight"] = _first_shard(p.out).name
    write_index(p.out, weight_map, doc["metadata"]["total_size"])
    refused_untouched(["checkpoint", "add-mtp", "--source", p.int4, "--target", p.out],
                      [p.int4.parent], match="ghost.weight.* no such tensor")
    assert not (p.out / EXTRA_FILE).exists()


@pytest.mark.parametrize("target", ["int4", "fp8"])
def test_add_mtp_never_writes_into_a_source_or_a_foreign_checkpoint(ckpt_pair: CkptPair,
                                                                    target: str) -> None:
    p = ckpt_pair
    match = ("is the input --source" if target == "int4"
             else "not written by sparkspec checkpoint assemble")
    refused_untouched(["checkpoint", "add-mtp", "--source", p.int4, "--target", getattr(p, target)],
                      [p.int4.parent], match=match)


@pytest.mark.parametrize("to", ["valid_head_elsewhere", "secret_file"])
def test_add_mtp_refuses_a_head_that_links_out_of_source_before_reading_it(ckpt_pair: CkptPair,
                                                                           to: str) -> None:
    p = ckpt_pair
    _built(p)
    outside = p.int4.parent / f"outside-{to}"
    head = p.int4 / EXTRA_FILE
    if to == "valid_head_elsewhere":
        head.rename(outside)
    else:
        # stands in for /etc/shadow: its first 8 bytes must not be read (nor shown as a header
        # length)
        outside.write_bytes(b"SECRET!!" + b"x" * 64)
        head.unlink()
    head.symlink_to(outside)
    out = refused_untouched(["checkpoint", "add-mtp", "--source", p.int4, "--target", p.out],
                            [p.int4.parent], match=r"links out of --source")
    assert ("SECRET" not in out.stderr
            and str(int.from_bytes(b"SECRET!!", "little")) not in out.stderr)
    assert not (p.out / EXTRA_FILE).exists()


# `checkpoint build` / `verify` / `add-mtp`, second hostile round (issue 23): build refuses, before
# it writes anything, what add-mtp or verify would refuse after it; build and verify check
# config.json with one function; the manifest records add-mtp's files (the MTP head and the index)
# and a no-op or verify checks them as it checks the shards. Each refusal: exit 2, one `sparkspec:
# error:` line, the tree unchanged (tests/badinput.py).


def test_the_manifest_records_add_mtps_files_and_a_rerun_is_a_no_op(ckpt_tree: Tree) -> None:
    outputs = _built_outputs(ckpt_tree)
    for name in (EXTRA_FILE, INDEX_NAME):
        assert isinstance(outputs[name][HASH_NAME], str), outputs[name]
        assert outputs[name]["size"] == (ckpt_tree.out / name).stat().st_size
    again = run(*_build(ckpt_tree, "--json"))
    assert again.rc == 0 and json.loads(again.stdout.splitlines()[-1])["changed"] is False, \
        again.stderr


def test_add_mtp_writes_again_an_index_changed_since_it_recorded_it(ckpt_tree: Tree) -> None:
    _built_outputs(ckpt_tree)
    index = ckpt_tree.out / INDEX_NAME
    doc = json.loads(index.read_text())
    index.write_text(json.dumps(doc))  # the same map, other bytes: not what add-mtp recorded
    refused_untouched(["checkpoint", "verify", ckpt_tree.out, "--no-load"], [ckpt_tree.root],
                      match=f"{INDEX_NAME}: differs from what add-mtp wrote")
    fixed = run("checkpoint", "add-mtp", "--source", ckpt_tree.int4, "--target", ckpt_tree.out,
                "--json")
    assert fixed.rc == 0 and json.loads(fixed.stdout.splitlines()[-1])["changed"] is True, \
        fixed.stderr
    assert run("checkpoint", "verify", ckpt_tree.out, "--no-load").rc == 0
