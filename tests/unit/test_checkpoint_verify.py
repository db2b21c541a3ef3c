from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CkptPair, run_cli

from sparkspec.checkpoint.safetensors_io import INDEX_NAME, read_index, write_index
from sparkspec.checkpoint.selection import EXTRA_FILE


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
