"""`sparkspec checkpoint digest` (a cluster's gate compares the nodes' digests): the same for the
same checkpoint in another folder, different when any byte differs, also where assemble's manifest
still holds the old record of a changed file."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.unit.conftest import Tree, run_cli


def digest(folder: Path) -> dict:
    result = run_cli("checkpoint", "digest", folder, "--json")
    assert result.rc == 0, result.stderr
    return result.json


def test_an_assembled_hybrid_digests_from_its_manifest_and_a_changed_byte_shows(
        ckpt_tree: Tree, tmp_path: Path) -> None:
    out = ckpt_tree.hybrid()
    first = digest(out)
    assert first["source"] == "manifest" and first["files"] > 3
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)  # another node's copy: other inodes and times, the same bytes
    assert digest(copy)["digest"] == first["digest"]
    shard = sorted(copy.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF            # one byte of tensor data; the manifest's record is now stale
    shard.write_bytes(bytes(data))
    assert digest(copy)["digest"] != first["digest"]


def test_a_plain_folder_digests_its_bytes(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    (a / ".cache").mkdir()
    (a / ".cache" / "x").write_text("ignored")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    (b / ".cache" / "x").write_text("hidden files are not the checkpoint")
    assert digest(a)["source"] == "content" and digest(a)["digest"] == digest(b)["digest"]
    (b / "extra.txt").write_text("")
    assert digest(b)["digest"] != digest(a)["digest"]


def test_a_missing_folder_is_one_line(tmp_path: Path) -> None:
    result = run_cli("checkpoint", "digest", tmp_path / "nope")
    assert result.rc == 2 and result.stderr.count("\n") == 1 and "not a folder" in result.stderr
