from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from sparkspec.checkpoint.manifest import MANIFEST_NAME
from sparkspec.checkpoint.safetensors_io import INDEX_NAME, read_header, read_index, write_index
from sparkspec.checkpoint.selection import EXTRA_FILE
from tests.badinput import assert_refused, refused_untouched, run
from tests.unit.checkpoint.conftest import _built, _built_outputs, _first_shard, _set_config
from tests.unit.conftest import CkptPair, Tree, run_cli


@pytest.fixture
def ckpt_hybrid(ckpt_pair: CkptPair) -> CkptPair:
    p = ckpt_pair
    assert run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8,
                   "--out", p.out).rc == 0
    assert run_cli("checkpoint", "add-mtp", "--source", p.int4, "--target", p.out).rc == 0
    return p


def test_complete_hybrid_passes_and_loads_with_fastsafetensors(ckpt_hybrid: CkptPair) -> None:
    res = run_cli("checkpoint", "verify", ckpt_hybrid.out, "--json")
    assert res.rc == 0, res.stderr
    doc = res.json
    assert doc["ok"] is True and doc["changed"] is False
    assert doc["mtp_tensors"] == doc["expected_mtp"] == ckpt_hybrid.spec.expected_mtp_tensors
    assert doc["fp8_weights"] == 3 * ckpt_hybrid.spec.layers
    assert doc["loader"].startswith("fastsafetensors loaded") and " 0 sample" not in doc["loader"]


def test_hybrid_without_mtp_entries_fails(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    assert run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8,
                   "--out", p.out).rc == 0
    res = run_cli("checkpoint", "verify", p.out)
    assert res.rc == 2
    last = res.stderr.strip().splitlines()[-1]
    assert "mtp" in last and str(p.out) in last and "add-mtp" in last
    assert run_cli("checkpoint", "verify", p.out, "--expect-mtp", "0").rc == 0


def _edit_index(directory: Path, fn) -> None:  # type: ignore[no-untyped-def]
    doc = read_index(directory)
    weight_map, total = fn(dict(doc["weight_map"]), doc["metadata"]["total_size"])
    write_index(directory, weight_map, total)


@pytest.mark.parametrize("damage, words", [
    ("unlisted_tensor", "does not list it"),
    ("phantom_entry", "no such tensor"),
    ("wrong_total", "total_size"),
    ("scale_missing", "weight_scale_inv"),
    ("extra_file_missing", "file not found"),
])
def test_inconsistent_index_fails(ckpt_hybrid: CkptPair, damage: str, words: str) -> None:
    out = ckpt_hybrid.out
    if damage == "unlisted_tensor":
        _edit_index(out, lambda m, t: (
            {k: v for k, v in m.items() if not k.endswith("input_layernorm.weight")}, t))
    elif damage == "phantom_entry":
        _edit_index(out, lambda m, t: (
            {**m, "model.language_model.ghost.weight": m["lm_head.weight"]}, t))
    elif damage == "wrong_total":
        _edit_index(out, lambda m, t: (m, t + 2))
    elif damage == "scale_missing":
        _edit_index(out, lambda m, t: (
            {k: v for k, v in m.items() if not k.endswith("weight_scale_inv")}, t))
    elif damage == "extra_file_missing":
        (out / EXTRA_FILE).unlink()
    res = run_cli("checkpoint", "verify", out, "--json")
    assert res.rc == 2
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["ok"] is False and any(words in p for p in doc["problems"]), doc["problems"]
    assert "Traceback" not in res.stderr and str(out) in res.stderr.strip().splitlines()[-1]


def test_says_plainly_when_loader_check_is_skipped(ckpt_hybrid: CkptPair, tmp_path: Path) -> None:
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "fastsafetensors.py").write_text(
        "raise ImportError('fastsafetensors not installed here')\n")
    res = run_cli("checkpoint", "verify", ckpt_hybrid.out, env={"PYTHONPATH": str(blocker)})
    assert res.rc == 0, res.stderr
    assert "loader check skipped: fastsafetensors/torch not importable" in res.stdout


def test_missing_index_exits_2(tmp_path: Path) -> None:
    res = run_cli("checkpoint", "verify", tmp_path)
    assert res.rc == 2 and str(tmp_path / INDEX_NAME) in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


# The checkpoint commands against a hostile user: outputs that would overwrite inputs or other
# people's files, corrupted outputs reported up to date, add-mtp half done, duplicate tensors, non-
# regular files, read-only and full filesystems. Each refusal is one line, exit 2 (1 for a run-time
# failure), and leaves every folder involved byte for byte as it was (tests.badinput fingerprints
# them: a leftover temp, lock or link counts as a change).


def _flip_inside(path: Path) -> None:
    """Overwrite bytes in the middle of the data without changing the size, then put the old mtime
    back (what a careless tool or an attacker does; only the change time keeps the trace)."""
    st = path.stat()
    header = read_header(path)
    at = header.data_start + header.data_size // 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        old = fh.read(64)
        fh.seek(at)
        fh.write(bytes(b ^ 0xFF for b in old))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


# --- an honest no-op and verify --full ------------------------------------------------------------
def test_bytes_overwritten_inside_a_shard_are_not_up_to_date(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    _built(p)
    shard = _first_shard(p.out)
    _flip_inside(shard)
    plain = run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load")
    assert_refused(plain, 2, match=rf"{shard.name}.* differs from what assemble wrote")
    full = run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full")
    assert_refused(full, 2, match=rf"{shard.name}.* differs from what assemble wrote")
    again = _built(p)
    assert again["changed"] is True, "a corrupted output was reported up to date"
    assert run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full").rc == 0


def test_verify_full_rehashes_everything_and_names_the_first_bad_file(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    _built(p)
    ok = run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full", "--json")
    assert ok.rc == 0, ok.stderr
    doc = json.loads(ok.stdout.strip().splitlines()[-1])
    manifest = json.loads((p.out / MANIFEST_NAME).read_text())
    hashed = [f for f, rec in manifest["outputs"].items() if manifest["hash"] in rec]
    assert doc["rehashed"] == len(hashed) and len(hashed) >= 3
    # the manifest's stat record matches, so only --full can find this: data rewritten, stat record
    # faked
    second = p.out / "model-00002-of-00002.safetensors"
    _flip_inside(second)
    _flip_inside(_first_shard(p.out))
    for name in (second.name, _first_shard(p.out).name):
        st = (p.out / name).stat()
        manifest["outputs"][name].update(ctime_ns=st.st_ctime_ns, mtime_ns=st.st_mtime_ns,
                                         ino=st.st_ino)
    (p.out / MANIFEST_NAME).write_text(json.dumps(manifest))
    # stat agrees
    assert run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load").rc == 0
    full = run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full")
    assert_refused(full, 2, match=rf"{_first_shard(p.out).name}: differs from what assemble wrote "
                                  r".*\(\+1 more")


def test_verify_full_needs_assembles_manifest(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    refused_untouched(["checkpoint", "verify", p.fp8, "--no-load", "--full", "--expect-mtp", "0"],
                      [p.fp8], match=rf"{MANIFEST_NAME}.*--full")


def test_io_error_while_verify_rehashes_is_exit_1(ckpt_pair: CkptPair,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    p = ckpt_pair
    _built(p)
    from sparkspec.checkpoint import manifest as ckpt_manifest

    def bad_sector(path: Path) -> str:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(ckpt_manifest, "rehash", bad_sector)
    refused_untouched(["checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full"],
                      [p.int4.parent], rc=1,
                      match=r"Input/output error \(a run-time failure\); check the")


@pytest.mark.parametrize("name", ["config.json", "first-shard"])
def test_verify_never_reads_through_a_link_out_of_the_checkpoint(ckpt_pair: CkptPair,
                                                                 tmp_path: Path,
                                                                 name: str) -> None:
    """A file of the checkpoint swapped for a link to a file elsewhere (a secret, say) is refused by
    name before verify reads or hashes it: nothing of the other file reaches the output."""
    p = ckpt_pair
    _built(p)
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t-do-not-print\n")
    target = p.out / "config.json" if name == "config.json" else _first_shard(p.out)
    target.unlink()
    target.symlink_to(secret)
    for full in ([], ["--full"]):
        out = refused_untouched(["checkpoint", "verify", "--no-load", *full, p.out],
                                [p.out, secret], 2,
                                match=rf"{target.name}: links out of the checkpoint")
        assert "s3cr3t" not in out.stderr + out.stdout


# `checkpoint build` / `verify` / `add-mtp`, second hostile round (issue 23): build refuses, before
# it writes anything, what add-mtp or verify would refuse after it; build and verify check
# config.json with one function; the manifest records add-mtp's files (the MTP head and the index)
# and a no-op or verify checks them as it checks the shards. Each refusal: exit 2, one `sparkspec:
# error:` line, the tree unchanged (tests/badinput.py).


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
    _built_outputs(ckpt_tree)
    head = ckpt_tree.out / EXTRA_FILE
    os.unlink(head)  # its own inode (a copy), so the source stays as it was
    shutil.copy2(ckpt_tree.int4 / EXTRA_FILE, head)
    assert run("checkpoint", "add-mtp", "--source", ckpt_tree.int4,
               "--target", ckpt_tree.out).rc == 0
    _flip_data_byte(head, keep_mtime)
    refused_untouched(["checkpoint", "verify", ckpt_tree.out, "--no-load", *flags],
                      [ckpt_tree.root], match=rf"{EXTRA_FILE}: differs from what add-mtp wrote")
