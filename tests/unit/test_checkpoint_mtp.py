from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CkptPair, run_cli, tree_digest

from sparkspec.checkpoint.safetensors_io import read_header, read_index
from sparkspec.checkpoint.selection import EXTRA_FILE


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
