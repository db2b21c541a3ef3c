"""A cluster head's hand-off to its workers (issue 24; roles/checkpoint_fetch/tasks/handoff.yml):
the folders the head serves and the fetch items a worker runs, from a resolved host; the digest a
worker's copy must match (the same files give the same digest with assemble's manifest or without
it); and a real `sparkspec hub serve` of a hard-linked hand-off root, pulled by `sparkspec fetch
repo` over loopback with a token file, ending in equal digests."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkspec import registry
from sparkspec.errors import UserError
from sparkspec.registry.resolve import handoff_folder, handoff_items, handoffs
from tests.support.systemd_rules import small_contract
from tests.unit.conftest import Tree, run_cli

MEMBERS = {
    "spark01": {"role": "head", "interface": "enp1s0f0np0", "address": "192.168.100.10"},
    "spark02": {"role": "worker", "interface": "enp1s0f0np0", "address": "192.168.100.11"},
}
SPEC = {"group": "spark_cluster", "nnodes": 2, "tensor_parallel_size": 2}


def contract() -> dict[str, Any]:
    """Two staged profiles: a hybrid with two heads and a plain model sharing one of them."""
    out = small_contract()
    head = {"repo": "org/eagle-head", "revision": "b" * 40}
    out["profiles"]["p"]["heads"] = {"eagle3": head}
    out["profiles"]["h"] = {"kind": "hybrid", "served_model_name": "h", "dir": "h-hybrid",
                            "int4": {"repo": "org/h-int4", "revision": "c" * 40},
                            "fp8": {"repo": "org/h-fp8", "revision": "d" * 40},
                            "heads": {"eagle3": head,
                                      "dflash": {"repo": "org/dflash", "revision": "e" * 40}}}
    out["stage_profiles"] = ["h", "p"]
    out["cluster"] = SPEC
    return out


def resolved(me: str, spec: Any = SPEC, **changes: Any) -> dict[str, Any]:
    doc = contract() | changes
    doc["cluster"] = spec
    where = {"me": me, "members": MEMBERS if spec else {}, "accelerator": "gb10"}
    return registry.resolve(doc, cluster=where)


def test_the_head_hands_over_every_served_folder_and_head_once() -> None:
    items = handoffs(resolved("spark01"))
    assert [(i["profile"], i["folder"], i["repo"]) for i in items] == [
        ("h", "/opt/models/h-hybrid", "local/h-hybrid"),  # the assembled hybrid, not its sources
        ("h", "/opt/models/h/org--eagle-head", "local/org.eagle-head"),
        ("h", "/opt/models/h/org--dflash", "local/org.dflash"),
        ("p", "/opt/models/m", "local/m"),  # the shared head only once
    ]
    # a worker resolves the same list (the role fetches the head's; the paths are the same on every
    # node)
    assert handoffs(resolved("spark02")) == items
    # only the method's head where the fetch took only that one; nothing outside a cluster
    assert [i["repo"] for i in handoffs(resolved("spark01"), heads="method")] == ["local/h-hybrid",
                                                                                  "local/m"]
    assert handoffs(resolved("spark01", spec=None)) == []


@pytest.mark.parametrize("root", ["/opt/models/h", "/opt/models/h/org--dflash/", "/opt/models",
                                  "/opt"])
def test_a_folder_at_in_or_around_the_hand_off_root_is_refused(root: str) -> None:
    """The head removes its hand-off root each run: a checkpoint's folder there would go with it."""
    assert handoffs(resolved("spark01"), root="/opt/models/handoff")   # beside the folders: fine
    with pytest.raises(UserError, match="is at, in or around the hand-off root") as info:
        handoffs(resolved("spark01"), root=root)
    assert "\n" not in str(info.value)


def test_two_folders_served_under_one_name_are_refused_in_one_line() -> None:
    profiles = contract()["profiles"]
    # the plain model's folder org.dflash and the head's folder org--dflash: one repo name,
    # local/org.dflash
    clash = resolved("spark01", profiles={**profiles, "p": {**profiles["p"], "dir": "org.dflash"}})
    with pytest.raises(UserError) as err:
        handoffs(clash)
    assert "\n" not in str(err.value)
    assert "/opt/models/org.dflash" in str(err.value) and "local/org.dflash" in str(err.value)


def test_a_worker_fetches_each_folder_from_the_head_into_the_same_path() -> None:
    items = handoff_items(handoffs(resolved("spark02")), "http://192.168.100.10:8089",
                          "/opt/sparkspec/tok")
    assert items[0] == ["repo", "local/h-hybrid", "--revision", "main",
                        "--dest", "/opt/models/h-hybrid",
                        "--endpoint", "http://192.168.100.10:8089",
                        "--token-file", "/opt/sparkspec/tok"]
    assert [(i[1], i[5]) for i in items] == [(h["repo"], h["folder"])
                                             for h in handoffs(resolved("spark01"))]


def test_a_source_build_s_wheelhouse_folder_lands_in_the_worker_s_staging_folder() -> None:
    """vllm_build hands its stamp's wheelhouse folder over (roles/vllm_build/tasks/cluster.yml):
    served from the head's path, fetched into a staging folder the worker's root copies from."""
    item = handoff_folder("/opt/sparkspec/wheelhouse/vllm-0123456789ab", "/opt/sparkspec/handoff",
                          "vllm_build_wheelhouse", "vllm_build_wheelhouse",
                          "/opt/sparkspec/handoff-in/vllm-0123456789ab")
    assert item == {"folder": "/opt/sparkspec/wheelhouse/vllm-0123456789ab",
                    "dest": "/opt/sparkspec/handoff-in/vllm-0123456789ab",
                    "repo": "local/vllm-0123456789ab", "name": "vllm-0123456789ab",
                    "setting": "vllm_build_wheelhouse"}
    fetch = handoff_items([item], "http://192.168.100.10:8089", "/opt/sparkspec/tok")
    assert fetch == [["repo", "local/vllm-0123456789ab", "--revision", "main", "--dest",
                      "/opt/sparkspec/handoff-in/vllm-0123456789ab",
                      "--endpoint", "http://192.168.100.10:8089",
                      "--token-file", "/opt/sparkspec/tok"]]
    # a checkpoint's folder lands where it is on the head (its dest is its folder)
    assert all(i["dest"] == i["folder"] and i["setting"] == "sparkspec_models_dir"
               for i in handoffs(resolved("spark01")))


@pytest.mark.parametrize(("folder", "expect"), [
    ("/opt/sparkspec/handoff/wheels/vllm-0123456789ab", "is at, in or around the hand-off root"),
    ("/opt/sparkspec", "is at, in or around the hand-off root"),
    ("/opt/sparkspec/wheelhouse/vllm 01", "cannot be served to the workers"),
])
def test_a_wheelhouse_folder_the_hand_off_would_remove_or_cannot_serve_is_refused(
        folder: str, expect: str) -> None:
    with pytest.raises(UserError, match=expect) as info:
        handoff_folder(folder, "/opt/sparkspec/handoff", "vllm_build_wheelhouse",
                       "vllm_build_wheelhouse")
    assert str(info.value).startswith("vllm_build_wheelhouse: ") and "\n" not in str(info.value)


def digest(folder: Path) -> dict[str, Any]:
    result = run_cli("checkpoint", "digest", folder, "--json")
    assert result.rc == 0, result.stderr
    return result.json


def visible_copy(src: Path, dst: Path, manifest: bool) -> Path:
    """A plain copy of the folder's visible files (what a worker's fetch gets): new inodes and
    times."""
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if any(part.startswith(".") for part in rel.parts) or path.is_dir():
            continue
        if not manifest and rel.as_posix() == "sparkspec-manifest.json":
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dst / rel)
    return dst


def test_an_assembled_folder_digests_as_a_plain_copy_of_its_visible_files(ckpt_tree: Tree,
                                                                          tmp_path: Path) -> None:
    out = ckpt_tree.hybrid()
    # a visible file the manifest lacks
    (out / "README.md").write_text("a file assemble did not write\n")
    first = digest(out)
    assert first["source"] == "manifest"
    bare = digest(visible_copy(out, tmp_path / "bare", manifest=False))
    full = digest(visible_copy(out, tmp_path / "full", manifest=True))
    assert bare["source"] == "content" and full["source"] == "manifest"
    assert bare["digest"] == full["digest"] == first["digest"]
    assert bare["files"] == first["files"]
    (tmp_path / "bare" / "README.md").write_text("changed\n")
    assert digest(tmp_path / "bare")["digest"] != first["digest"]


def test_a_hard_link_to_a_hybrid_keeps_assemble_s_records(ckpt_tree: Tree, tmp_path: Path) -> None:
    """The hand-off root links the hybrid's files: a link changes a file's change time, not a byte,
    so the next `checkpoint build` must still find the hybrid current (no rebuild) and the digest
    the same."""
    out = ckpt_tree.hybrid()
    before = digest(out)
    subprocess.run(["cp", "-al", "--", str(out), str(tmp_path / "root")], check=True)
    rerun = run_cli(*ckpt_tree.assemble(), "--json")
    assert rerun.rc == 0 and rerun.json["changed"] is False, rerun.stdout
    assert digest(out) == before


def _serve(root: Path, token_file: Path) -> tuple[subprocess.Popen[str], str]:
    argv = [sys.executable, "-m", "sparkspec.cli", "hub", "serve", "--root", str(root),
            "--port", "0", "--token-file", str(token_file)]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    while (line := proc.stderr.readline()) and not line.startswith("hub: serving "):
        lines.append(line)
    found = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
    assert found, [*lines, line]
    return proc, found.group(1)


def test_a_worker_pulls_the_hard_linked_root_and_ends_with_the_head_s_digest(ckpt_tree: Tree,
                                                                            tmp_path: Path) -> None:
    out = ckpt_tree.hybrid()
    head = digest(out)
    root = tmp_path / "handoff"
    (root / "local").mkdir(parents=True)
    subprocess.run(["cp", "-al", "--", str(out), str(root / "local" / "h-hybrid")], check=True)
    assert (os.stat(root / "local" / "h-hybrid" / "config.json").st_ino
            == os.stat(out / "config.json").st_ino)
    (root / "local" / "h-hybrid" / ".sparkspec-published").touch()
    tokens = tmp_path / "tokens"
    tokens.write_text("hf_handoff_token\n")
    tokens.chmod(0o600)
    proc, url = _serve(root, tokens)
    try:
        mine = tmp_path / "worker-token"
        mine.write_text("hf_handoff_token\n")
        mine.chmod(0o600)
        dest = tmp_path / "worker" / "h-hybrid"
        dest.parent.mkdir()
        # the worker's one `fetch batch`, its items as the role builds them
        item = {"repo": "local/h-hybrid", "folder": str(dest), "dest": str(dest)}
        items = handoff_items([item], url, str(mine))
        pulled = run_cli("fetch", "batch", "--json", "--items", json.dumps(items))
        assert pulled.rc == 0, pulled.stderr
        assert not (dest / ".sparkspec-published").exists()
        mine.write_text("hf_wrong\n")
        refused = run_cli("fetch", "repo", "local/h-hybrid", "--revision", "main", "--dest",
                          tmp_path / "other", "--endpoint", url, "--token-file", mine)
        assert refused.rc != 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    worker = digest(dest)
    assert worker["digest"] == head["digest"] and worker["files"] == head["files"]
    assert digest(out) == head     # the head's folder kept its records (no re-hash source change)
