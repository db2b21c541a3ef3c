from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CkptPair, run_cli, tree_digest

from sparkspec.checkpoint.safetensors_io import read_header, read_index
from sparkspec.checkpoint.selection import EXTRA_FILE


def _assembled(p: CkptPair, int4: Path) -> None:
    res = run_cli("checkpoint", "assemble", "--int4", int4, "--fp8", p.fp8, "--out", p.out, "--json")
    assert res.rc == 0, res.stderr


@pytest.mark.parametrize("source", ["int4", "int4_listed"])
def test_registers_every_mtp_tensor_from_the_file_header(ckpt_pair: CkptPair, source: str) -> None:
    """Whether or not the source index lists the MTP head, the target maps exactly the file's mtp.* tensors."""
    p = ckpt_pair
    src = p.int4.parent / source
    _assembled(p, src)
    assert not any(n.startswith("mtp.") for n in read_index(p.out)["weight_map"])  # assemble never does it
    before_src = tree_digest(src)
    res = run_cli("checkpoint", "add-mtp", "--source", src, "--target", p.out, "--json")
    assert res.rc == 0, res.stderr
    header = read_header(src / EXTRA_FILE)
    assert res.json["changed"] is True and res.json["mtp_tensors"] == p.spec.expected_mtp_tensors
    index = read_index(p.out)
    mapped = {n for n, f in index["weight_map"].items() if f == EXTRA_FILE}
    assert mapped == set(header.tensors) and len(mapped) == p.spec.expected_mtp_tensors
    total = sum(t.nbytes for f in set(index["weight_map"].values()) for t in read_header(p.out / f).tensors.values())
    assert index["metadata"]["total_size"] == total
    assert (p.out / EXTRA_FILE).read_bytes() == (src / EXTRA_FILE).read_bytes()
    assert res.json["file"] == "linked" and os.path.samefile(p.out / EXTRA_FILE, src / EXTRA_FILE)
    assert tree_digest(src) == before_src
    verify = run_cli("checkpoint", "verify", p.out, "--json")
    assert verify.rc == 0 and verify.json["mtp_tensors"] == p.spec.expected_mtp_tensors, verify.stderr
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
    assert run_cli("checkpoint", "add-mtp", "--source", p.int4, "--target", p.out, "--json").json["changed"] is False
    assert tree_digest(p.out) == state
    assert run_cli("checkpoint", "verify", p.out).rc == 0
