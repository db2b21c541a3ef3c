from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparkspec.checkpoint.assemble import CONFIG_KEY, MANIFEST_NAME
from sparkspec.checkpoint.safetensors_io import read_header, read_index
from sparkspec.checkpoint.selection import EXTRA_FILE, module_of
from tests.support import testckpt
from tests.unit.conftest import REPO, CkptPair, run_cli, tree_digest


def _bytes_of(directory: Path, weight_map: dict[str, str],
              name: str) -> tuple[str, tuple[int, ...], bytes]:
    path = directory / weight_map[name]
    header = read_header(path)
    info = header.tensors[name]
    with open(path, "rb") as fh:
        fh.seek(header.data_start + info.begin)
        return info.dtype, info.shape, fh.read(info.nbytes)


def _shared(spec: testckpt.ModelSpec) -> set[str]:
    return {f"model.language_model.layers.{i}.mlp.shared_expert.{p}" for i in range(spec.layers)
            for p in ("gate_proj", "up_proj", "down_proj")}


def test_hybrid_keeps_int4_bytes_and_takes_shared_experts_in_fp8(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    res = run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out,
                  "--json")
    assert res.rc == 0, res.stderr
    assert res.json["changed"] is True and res.json["fp8_layers"] == 3 * p.spec.layers
    out_map = read_index(p.out)["weight_map"]
    int4_map = read_index(p.int4)["weight_map"]
    fp8_map = read_index(p.fp8)["weight_map"]
    replaced = _shared(p.spec)
    # the FP8 replacement set, with its scales, byte-identical to the FP8 source
    fp8_in_out = {module_of(n) for n in out_map if _bytes_of(p.out, out_map, n)[0] == "F8_E4M3"}
    assert fp8_in_out == replaced
    for module in replaced:
        for name in (f"{module}.weight", f"{module}.weight_scale_inv"):
            assert _bytes_of(p.out, out_map, name) == _bytes_of(p.fp8, fp8_map, name)
    # everything else byte-identical to the INT4 source; nothing lost, nothing from MTP
    kept = [n for n in int4_map if module_of(n) not in replaced]
    assert kept and not any(n.startswith("mtp.") for n in out_map)
    for name in kept:
        assert _bytes_of(p.out, out_map, name) == _bytes_of(p.int4, int4_map, name)
    assert set(out_map) == set(kept) | {f"{m}.{s}" for m in replaced
                                        for s in ("weight", "weight_scale_inv")}
    assert not (p.out / EXTRA_FILE).exists()
    # index total_size, config with the AutoRound block untouched and the FP8 layers under our own
    # key
    total = sum(t.nbytes for f in set(out_map.values())
                for t in read_header(p.out / f).tensors.values())
    assert read_index(p.out)["metadata"]["total_size"] == total
    cfg_in, cfg_out = (json.loads((d / "config.json").read_text()) for d in (p.int4, p.out))
    assert cfg_out["quantization_config"] == cfg_in["quantization_config"]
    assert sorted(cfg_out[CONFIG_KEY]["fp8_layers"]) == sorted(replaced)
    assert {k: v for k, v in cfg_out.items() if k != CONFIG_KEY} == cfg_in
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "chat_template.jinja"):
        assert (p.out / side).read_bytes() == (p.int4 / side).read_bytes()
    manifest = json.loads((p.out / MANIFEST_NAME).read_text())
    assert set(manifest["outputs"]) >= set(out_map.values())


def test_without_fp8_the_hybrid_is_the_int4_checkpoint_and_add_mtp_registers_its_head(
        ckpt_pair: CkptPair) -> None:
    """No --fp8 (a hybrid profile without an fp8 source): every INT4 model tensor byte-identical,
    none in FP8, nothing from MTP until add-mtp registers the extra file's head; idempotent like the
    full hybrid."""
    p = ckpt_pair
    before = tree_digest(p.int4)
    args = ("checkpoint", "assemble", "--int4", p.int4, "--out", p.out, "--json")
    res = run_cli(*args)
    assert res.rc == 0, res.stderr
    assert (res.json["changed"] is True and res.json["fp8_layers"] == 0
            and res.json["warnings"] == [])
    out_map, int4_map = read_index(p.out)["weight_map"], read_index(p.int4)["weight_map"]
    model = {n for n, f in int4_map.items() if f != EXTRA_FILE and not n.startswith("mtp.")}
    assert model and set(out_map) == model
    for name in model:
        assert _bytes_of(p.out, out_map, name) == _bytes_of(p.int4, int4_map, name)
    cfg_in, cfg_out = (json.loads((d / "config.json").read_text()) for d in (p.int4, p.out))
    assert {k: v for k, v in cfg_out.items() if k != CONFIG_KEY} == cfg_in
    assert cfg_out[CONFIG_KEY]["fp8_layers"] == [] and cfg_out[CONFIG_KEY]["fp8_revision"] is None
    mtp = run_cli("checkpoint", "add-mtp", "--source", p.int4, "--target", p.out, "--json")
    assert mtp.rc == 0 and mtp.json["mtp_tensors"] == p.spec.expected_mtp_tensors, mtp.stderr
    head = {n for n, f in read_index(p.out)["weight_map"].items() if n.startswith("mtp.")}
    assert head == set(read_header(p.int4 / EXTRA_FILE).tensors)
    verify = run_cli("checkpoint", "verify", p.out, "--json")
    assert verify.rc == 0 and verify.json["fp8_weights"] == 0, verify.stderr
    state = tree_digest(p.out)
    assert run_cli(*args).json["changed"] is False and tree_digest(p.out) == state
    assert tree_digest(p.int4) == before
    # options that only mean something with FP8 layers are refused, in one line, before anything is
    # written
    for extra in (("--expect-fp8", "3"), ("--fp8-pattern", "q_proj")):
        bad = run_cli("checkpoint", "assemble", "--int4", p.int4, "--out", p.out.parent / "o3",
                      *extra)
        assert (bad.rc == 2 and "needs --fp8" in bad.stderr
                and len(bad.stderr.strip().splitlines()) == 1)
        assert not (p.out.parent / "o3").exists()


def test_f32_scales_accepted(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    res = run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8.parent / "fp8_f32",
                  "--out", p.out, "--json")
    assert res.rc == 0, res.stderr
    out_map = read_index(p.out)["weight_map"]
    scales = [n for n in out_map if n.endswith("weight_scale_inv")]
    assert len(scales) == 3 * p.spec.layers
    assert {_bytes_of(p.out, out_map, n)[0] for n in scales} == {"F32"}


def test_idempotent_and_sources_untouched_also_after_add_mtp(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    before = {d: tree_digest(d) for d in (p.int4, p.fp8)}
    args = ("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out, "--json")
    assert run_cli(*args).json["changed"] is True
    first = tree_digest(p.out)
    again = run_cli(*args)
    assert again.rc == 0 and again.json["changed"] is False
    assert tree_digest(p.out) == first  # contents and mtimes: nothing rewritten
    assert run_cli("checkpoint", "add-mtp", "--source", p.int4, "--target", p.out,
                   "--json").json["changed"]
    after_mtp = tree_digest(p.out)
    third = run_cli(*args)
    assert third.rc == 0 and third.json["changed"] is False
    assert tree_digest(p.out) == after_mtp
    assert {d: tree_digest(d) for d in (p.int4, p.fp8)} == before
    # lock removed
    assert sorted(x.name for x in p.out.parent.iterdir() if x.name.startswith(".out.")) == []


def test_changed_input_rebuilds(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    args = ("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out, "--json")
    assert run_cli(*args).json["changed"] is True
    testckpt.write_fp8(p.fp8, p.spec, seed=7)  # same names, new bytes
    res = run_cli(*args)
    assert res.rc == 0 and res.json["changed"] is True
    out_map, fp8_map = read_index(p.out)["weight_map"], read_index(p.fp8)["weight_map"]
    name = sorted(_shared(p.spec))[0] + ".weight"
    assert _bytes_of(p.out, out_map, name) == _bytes_of(p.fp8, fp8_map, name)


def test_fp8_pattern_widens_and_fused_groups_must_be_whole(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    res = run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out,
                  "--fp8-pattern", r"mlp\.experts\.", "--json")
    assert res.rc == 0, res.stderr
    expected = 3 * p.spec.layers * (1 + p.spec.experts)
    assert res.json["fp8_layers"] == expected
    assert "warning" in res.stderr and str(3 * p.spec.layers) in res.stderr
    out_map = read_index(p.out)["weight_map"]
    assert not any(".mlp.experts." in n and n.endswith((".qweight", ".qzeros", ".scales"))
                   for n in out_map)
    bad = run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8,
                  "--out", p.out.parent / "o2", "--fp8-pattern", r"self_attn\.q_proj")
    assert bad.rc == 2 and "fuses" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (p.out.parent / "o2").exists()


def test_expect_fp8_mismatch_warns(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    res = run_cli("checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out,
                  "--expect-fp8", "144")
    assert res.rc == 0
    assert "warning" in res.stderr and "expected 144" in res.stderr


def test_kill_9_during_assemble_then_rerun_is_identical(tmp_path: Path) -> None:
    spec = testckpt.spec_for_bytes(300_000_000)
    spec = testckpt.ModelSpec(**{**spec.__dict__, "mtp_layers": 0})
    int4, fp8 = tmp_path / "int4", tmp_path / "fp8"
    testckpt.write_int4_autoround(int4, spec, shards=3)
    testckpt.write_fp8(fp8, spec, 2, only=lambda n: ".shared_expert." in n)
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert run_cli("checkpoint", "assemble", "--int4", int4, "--fp8", fp8, "--out", ref).rc == 0
    tmp = tmp_path / ".out.assemble-tmp"
    proc = subprocess.Popen([sys.executable, "-m", "sparkspec.cli", "checkpoint", "assemble",
                             "--int4", str(int4), "--fp8", str(fp8), "--out", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        shards = list(tmp.glob("model-*.safetensors")) if tmp.is_dir() else []
        if shards and sum(s.stat().st_size for s in shards) > 20_000_000:
            break
        time.sleep(0.002)
    if proc.poll() is not None:
        pytest.fail("assemble finished before it could be killed; make the checkpoint bigger")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not out.exists() and tmp.exists()  # killed mid-way: a partial temp, no output
    assert run_cli("checkpoint", "verify", out).rc == 2
    res = run_cli("checkpoint", "assemble", "--int4", int4, "--fp8", fp8, "--out", out, "--json")
    assert res.rc == 0 and res.json["changed"] is True
    assert not tmp.exists()
    ref_files = {k: v[0] for k, v in tree_digest(ref).items() if k != MANIFEST_NAME}
    out_files = {k: v[0] for k, v in tree_digest(out).items() if k != MANIFEST_NAME}
    assert out_files == ref_files

    def digests(directory: Path) -> dict[str, object]:  # the manifests differ in stat records only
        doc = json.loads((directory / MANIFEST_NAME).read_text())
        return {name: {k: v for k, v in rec.items() if k not in ("mtime_ns", "ctime_ns", "ino")}
                for name, rec in doc["outputs"].items()}

    assert digests(out) == digests(ref)
