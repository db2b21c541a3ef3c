"""vLLM 0.32.0's own KV-cache code on Qwen3.5-122B-A10B's layout (one vLLM venv subprocess,
tests/support/kv_layout_probe.py): block and page sizes with MTP and DFlash drafters, and whether a
repeated prompt hits the prefix cache (a real Scheduler), by prefix_match_unit."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.bench.conftest import VLLM_PYTHON as VLLM_VENV_PYTHON
from tests.bench.conftest import vllm_available

REPO = Path(__file__).resolve().parents[3]
PROBE = REPO / "tests/support/kv_layout_probe.py"
# K and V, 2 KV heads of 256, BF16: the target's bytes per token and layer
ATTN_TOKEN = 2 * 2 * 256 * 2
DRAFT_TOKEN = 2 * 8 * 128 * 2       # the DFlash drafter's: 8 KV heads of 128
RECURRENT = 64 * 128 * 128 * 4      # a GDN layer's FP32 recurrent state (64 value heads, 128 x 128)
CONV_ROW = (2 * 16 * 128 + 64 * 128) * 2   # one BF16 row of its conv state; 3 + k rows (qwen3_5.py)
BLOCK = {0: 2096, 2: 2112, 12: 2240, 15: 2272}   # the aligned attention block size by k
# Where vLLM 0.32.0 decides (the report cites these lines): function start lines in the
# installed package.
WHERE = {"unify_kv_cache_spec_page_size": 1292, "resolve_kv_cache_block_sizes": 804,
         "partial_hash_hits_enabled": 750, "_annotate_eagle_groups": 2029,
         "_align_hybrid_block_size": 938, "_mamba_block_aligned_split": 443,
         "replay_boundaries": 65, "_resolve_layer_attention": 120,
         "MambaModelConfig.verify_and_update_config": 673}
DFLASH = [f"dflash{k}_{rev}_{kind}" for rev in ("retrain", "original") for k in (12, 15)
          for kind in ("full", "swa_FLASH_ATTN", "swa_FLASHINFER")] + ["dflash12_retrain_mixed"]
NO_DRAFT_GROUP = ("Speculative decoding (method=dflash) is enabled but no KV cache group could "
                  "be identified as the draft model's.")
SWA_NOT_FINE = ("Disabling fine-grained prefix-cache hits because these KV cache managers require "
                "block-aligned lookups: SlidingWindowManager.")

# Hits of three sends of one prompt, one after another: (hash unit, hit alignment,
# [hits of sends 1, 2, 3]). "long": 3 scheduler blocks + 5 tokens; "verify": sparkspec verify's
# 4096 tokens; "16": a prefix_match_unit of 16 (--prefix-match-unit 16); "default": none given.
Runs = dict[str, tuple[int, int, list[int]]]
PLAIN: Runs = {"long_default": (2096, 2096, [0, 6288, 6288]), "long_16": (16, 16, [0, 6288, 6288]),
               "verify_default": (2096, 2096, [0, 2096, 2096]),
               "verify_16": (16, 16, [0, 4080, 4080])}
MTP: Runs = {"long_default": (2112, 2112, [0, 4224, 4224]), "long_16": (16, 16, [0, 6320, 6320]),
             "verify_default": (2112, 2112, [0, 0, 0]), "verify_16": (16, 16, [0, 4080, 4080])}
DFLASH_HITS: dict[tuple[int, str], Runs] = {
    (12, "full"): {"long_default": (2240, 4480, [0, 0, 8960]),
                   "long_16": (16, 16, [0, 13424, 13424]),
                   "verify_default": (2240, 4480, [0, 0, 0]),
                   "verify_16": (16, 16, [0, 4080, 4080])},
    (12, "swa_FLASH_ATTN"): {"long_default": (2240, 4480, [0, 0, 8960]),
                             "long_16": (16, 4480, [0, 0, 8960]),
                             "verify_default": (2240, 4480, [0, 0, 0]),
                             "verify_16": (16, 4480, [0, 0, 0])},
    (12, "swa_FLASHINFER"): {"long_default": (64, 64, [0, 0, 6656]),
                             "long_16": (16, 2240, [0, 0, 4480]),
                             "verify_default": (64, 64, [0, 0, 4032]),
                             "verify_16": (16, 2240, [0, 0, 0])},
    (15, "full"): {"long_default": (2272, 4544, [0, 0, 9088]),
                   "long_16": (16, 16, [0, 13616, 13616]),
                   "verify_default": (2272, 4544, [0, 0, 0]),
                   "verify_16": (16, 16, [0, 4080, 4080])},
    (15, "swa_FLASH_ATTN"): {"long_default": (2272, 4544, [0, 0, 9088]),
                             "long_16": (16, 4544, [0, 0, 9088]),
                             "verify_default": (2272, 4544, [0, 0, 0]),
                             "verify_16": (16, 4544, [0, 0, 0])},
    (15, "swa_FLASHINFER"): {"long_default": (32, 4544, [0, 9088, 9088]),
                             "long_16": (16, 4544, [0, 9088, 9088]),
                             "verify_default": (32, 4544, [0, 0, 0]),
                             "verify_16": (16, 4544, [0, 0, 0])},
}
# Scheduler block (the lcm of the group block sizes) and the "long" prompt by case.
SCHED = {"none": 2096, "mtp2": 2112, 12: 4480, 15: 4544, "12_swa_FLASHINFER": 2240,
         "15_swa_FLASHINFER": 4544}


def _dflash_key(name: str) -> tuple[int, str]:
    """(k, drafter kind) of a DFlash case name; the mixed drafter hits like the sliding FLASH_ATTN
    one."""
    k = int(name.removeprefix("dflash")[:2])
    kind = name.split("_", 2)[2]
    return k, "swa_FLASH_ATTN" if kind == "mixed" else kind


def _expected_runs(name: str) -> Runs:
    if name == "none":
        return PLAIN
    if name == "mtp2":
        return MTP
    return DFLASH_HITS[_dflash_key(name)]


def _sched(name: str) -> int:
    if name in SCHED:
        return SCHED[name]
    k, kind = _dflash_key(name)
    return SCHED.get(f"{k}_{kind}", SCHED[k])


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    reason = vllm_available()
    if reason is not None:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}   # vLLM's defaults
    proc = subprocess.run([VLLM_VENV_PYTHON, str(PROBE)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_the_probe_reads_vllm_0_32_0(probe: dict[str, Any]) -> None:
    assert probe["version"] == "0.32.0"
    assert probe["where"] == WHERE
    assert probe["qwen35_lines"] == {"get_mamba_state_dtype_from_config": 609,
                                     "get_mamba_state_shape_from_config": 620}
    # the FLASHINFER stand-in's kernel block sizes are vLLM's
    assert probe["flashinfer_sizes_in_source"]


@pytest.mark.parametrize("k", sorted(BLOCK))
def test_the_gdn_state_sets_the_attention_block_size(probe: dict[str, Any], k: int) -> None:
    """The GDN conv state grows by one row per speculative token; the attention block is the
    smallest multiple of 16 (the kernels' block) whose page holds the state, and the state page is
    padded up to it."""
    facts = probe["block_sizes"][str(k)]
    assert facts["shapes"] == [[3 + k, 12288], [64, 128, 128]]
    assert facts["dtypes"] == ["torch.bfloat16", "torch.float32"]
    state = (3 + k) * CONV_ROW + RECURRENT
    assert facts["block"] == BLOCK[k] == 16 * math.ceil(state / (16 * ATTN_TOKEN))
    assert facts["padded"] == BLOCK[k] * ATTN_TOKEN
    assert facts["mamba_block"] == BLOCK[k]   # align mode: one state per attention block


def test_state_dtype_and_prefix_caching_off(probe: dict[str, Any]) -> None:
    """A BF16 recurrent state would halve the block; without prefix caching the mode is none and the
    Mamba block spans max_model_len, while the attention block keeps its alignment."""
    assert probe["block_sizes"]["2_bf16_ssm"] == 1088
    assert probe["block_sizes"]["no_prefix_caching"] == \
        {"mode": "none", "mamba_block": 32768, "block": 2112}


def test_mtp_shares_the_targets_groups_and_page(probe: dict[str, Any]) -> None:
    case = probe["cases"]["mtp2"]
    page = BLOCK[2] * ATTN_TOKEN
    assert case["pages"] == {"target_attention": page, "gdn_state": 5 * CONV_ROW + RECURRENT,
                             "gdn_page": page, "mtp": page}
    # MTP's layer joins the target's 12 full-attention layers; the group holding it is the
    # EAGLE group.
    assert case["groups"] == ([["MambaSpec", 12, 2112, page, False]] * 3
                              + [["FullAttentionSpec", 13, 2112, page, True]])
    assert case["long_default"]["eagle_groups"] == 1


@pytest.mark.parametrize("name", DFLASH)
def test_dflash_pages_are_unified(probe: dict[str, Any], name: str) -> None:
    """One page size for every group. An 8 x 128 drafter page is twice the target's: the target's
    attention block doubles and the GDN page is padded to it. A FLASHINFER sliding-window layer
    takes 64-token blocks, padded up to the target's page."""
    k, kind = _dflash_key(name)
    case = probe["cases"][name]
    block, layers = BLOCK[k], (4 if "original" in name else 6)
    assert case["block"] == case["mamba_block"] == block and case["mamba_mode"] == "align"
    pages = {g[3] for g in case["groups"]}
    assert len(pages) == 1
    if kind == "swa_FLASHINFER":
        assert case["pages"]["draft"] == [64 * DRAFT_TOKEN]
        assert pages == {block * ATTN_TOKEN}
        draft, attention = [("SlidingWindowSpec", layers, 64)], block
    else:
        assert case["pages"]["draft"] == [block * DRAFT_TOKEN] == [2 * block * ATTN_TOKEN]
        assert pages == {2 * block * ATTN_TOKEN}
        draft_kind = "FullAttentionSpec" if kind == "full" else "SlidingWindowSpec"
        draft, attention = [(draft_kind, layers, block)], 2 * block
    shape = [(g[0], g[1], g[2]) for g in case["groups"]]
    # the drafter's one full layer: a bucket of 1, so 54 groups of one layer
    if name.endswith("mixed"):
        assert len(shape) == 54 and {g[1] for g in shape} == {1}
        assert shape[-6:] == \
            [("SlidingWindowSpec", 1, block)] * 5 + [("FullAttentionSpec", 1, block)]
        return
    assert shape == ([("MambaSpec", layers, block)] * (36 // layers)
                     + [("FullAttentionSpec", layers, attention)] * (12 // layers) + draft)


def test_the_layout_is_layer_outer(probe: dict[str, Any]) -> None:
    """No backend here declares a layout, so vLLM's default LBNHC: not block-outermost, so the pages
    are unified (unify_kv_cache_spec_page_size) rather than packed side by side."""
    assert {case["layout"] for case in probe["cases"].values()} == {"LBNHC"}


@pytest.mark.parametrize("name", ["none", "mtp2", *DFLASH])
@pytest.mark.parametrize("run", ["long_default", "long_16", "verify_default", "verify_16"])
def test_repeated_prompt_hits(probe: dict[str, Any], name: str, run: str) -> None:
    got = probe["cases"][name][run]
    unit, align, hits = _expected_runs(name)[run]
    assert (got["sched"], got["hash"], got["align"], got["hits"]) == \
        (_sched(name), unit, align, hits)
    assert got["prompt"] == (4096 if run.startswith("verify") else 3 * _sched(name) + 5)
    assert got["fine"] == (align < got["sched"])  # sub-block hits only where the alignment is finer


def test_every_dflash_group_gets_the_eagle_drop(probe: dict[str, Any]) -> None:
    """No group is recognised as DFlash's (the positional rule is MTP's): the coordinator flags them
    all."""
    for name in DFLASH:
        case = probe["cases"][name]
        assert not any(g[4] for g in case["groups"])
        assert case["long_default"]["eagle_groups"] == len(case["groups"])
    assert NO_DRAFT_GROUP in probe["warnings"]
    assert SWA_NOT_FINE in probe["warnings"]


def test_how_the_drafter_configs_resolve(probe: dict[str, Any]) -> None:
    """qwen3_dflash.py on the configs as transformers' Qwen3Config loads them: no layer_types (the
    published retrain) or all-full (z-lab's April schema) means full, non-causal attention, the
    window unused; mixed sliding/full needs the V2 model runner (0.32.0's default where Triton is;
    refused on V1)."""
    layers = probe["drafter_layers"]
    full = [None, False]
    assert layers["retrain_published_v1"] == layers["retrain_published_v2"] == [full] * 6
    assert layers["original_legacy_v1"] == layers["original_legacy_v2"] == [full] * 4
    assert layers["retrain_all_sliding_v1"] == [[4096, True]] * 6
    assert layers["retrain_mixed_v1"] == (
        "NotImplementedError: DFlash drafters with mixed sliding/full attention require the V2 "
        "model runner; relaunch with VLLM_USE_V2_MODEL_RUNNER=1.")
    assert layers["retrain_mixed_v2"] == [[4096, True]] * 5 + [full]
    refused = [name for name in layers if name.endswith("_v1_refused") and layers[name]]
    assert refused == ["retrain_mixed_v1_refused"]   # VllmConfig refuses it on V1 too


def test_what_is_refused(probe: dict[str, Any]) -> None:
    refused = probe["refusals"]
    for unit in (128, 100):
        assert refused[f"mtp2_unit{unit}"].startswith(
            f"ValueError: Invalid prefix_match_unit={unit}; prefix-cacheable KV cache "
            "group block sizes must be divisible by prefix_match_unit. Got group block "
            "sizes=[2112, 2112, 2112, 2112]")
    assert refused["dflash15_unit64"].startswith("ValueError: Invalid prefix_match_unit=64;")
    # config/model.py: hybrids default to it
    assert refused["hybrid_prefix_caching_supported"] is True
