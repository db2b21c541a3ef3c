"""`checkpoint build` / `verify` / `add-mtp`, second hostile round (issue 23): build refuses, before
it writes anything, what add-mtp or verify would refuse after it; build and verify check config.json
with one function; the manifest records add-mtp's files (the MTP head and the index) and a no-op or
verify checks them as it checks the shards. Each refusal: exit 2, one `sparkspec: error:` line, the
tree unchanged (tests/badinput.py)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from sparkspec.checkpoint.manifest import MANIFEST_NAME
from sparkspec.checkpoint.safetensors_io import INDEX_NAME, read_header
from sparkspec.checkpoint.selection import EXTRA_FILE
from sparkspec.checkpoint.stream import HASH_NAME
from tests.badinput import refused_untouched, run
from tests.unit.conftest import Tree


def _build(tree: Tree, *extra: str | Path) -> list[str | Path]:
    return ["checkpoint", "build", "--int4", tree.int4, "--fp8", tree.fp8, "--out", tree.out,
            "--no-load", *extra]


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


def _set_config(folder: Path, key: str, value: object) -> None:
    path = folder / "config.json"
    doc = json.loads(path.read_text())
    doc["text_config"][key] = value
    path.write_text(json.dumps(doc))


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


@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_experts", "4", "num_experts is '4'"),
    ("num_hidden_layers", 0, "num_hidden_layers is 0"),
    ("shared_expert_intermediate_size", -1, "shared_expert_intermediate_size is -1"),
])
def test_verify_and_build_refuse_the_same_config(ckpt_tree: Tree, key: str, value: object,
                                                 match: str) -> None:
    """One config check: a hybrid whose config.json build would refuse is refused by verify, same
    line."""
    out = ckpt_tree.hybrid()
    _set_config(out, key, value)
    refused_untouched(["checkpoint", "verify", out, "--no-load"], [ckpt_tree.root], match=match)


def _built(tree: Tree) -> dict[str, dict[str, object]]:
    done = run(*_build(tree, "--json"))
    assert done.rc == 0, done.stderr
    return dict(json.loads((tree.out / MANIFEST_NAME).read_text())["outputs"])


def test_the_manifest_records_add_mtps_files_and_a_rerun_is_a_no_op(ckpt_tree: Tree) -> None:
    outputs = _built(ckpt_tree)
    for name in (EXTRA_FILE, INDEX_NAME):
        assert isinstance(outputs[name][HASH_NAME], str), outputs[name]
        assert outputs[name]["size"] == (ckpt_tree.out / name).stat().st_size
    again = run(*_build(ckpt_tree, "--json"))
    assert again.rc == 0 and json.loads(again.stdout.splitlines()[-1])["changed"] is False, \
        again.stderr


def _flip_data_byte(path: Path, keep_mtime: bool) -> None:
    st = path.stat()
    at = read_header(path).data_start
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x01]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize(("keep_mtime", "flags"), [(False, []), (True, ["--full"])],
                         ids=["changed-file", "mtime-set-back-full"])
def test_verify_checks_the_mtp_head_against_the_manifest(ckpt_tree: Tree, keep_mtime: bool,
                                                         flags: list[str]) -> None:
    """A head changed after add-mtp recorded it: verify re-hashes it (its record changed), --full
    always."""
    _built(ckpt_tree)
    head = ckpt_tree.out / EXTRA_FILE
    os.unlink(head)  # its own inode (a copy), so the source stays as it was
    shutil.copy2(ckpt_tree.int4 / EXTRA_FILE, head)
    assert run("checkpoint", "add-mtp", "--source", ckpt_tree.int4,
               "--target", ckpt_tree.out).rc == 0
    _flip_data_byte(head, keep_mtime)
    refused_untouched(["checkpoint", "verify", ckpt_tree.out, "--no-load", *flags],
                      [ckpt_tree.root], match=rf"{EXTRA_FILE}: differs from what add-mtp wrote")


def test_add_mtp_writes_again_an_index_changed_since_it_recorded_it(ckpt_tree: Tree) -> None:
    _built(ckpt_tree)
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
