"""Runs inside the vLLM venv (tests/unit/project/test_vllm_kv_layout.py): vLLM 0.32.0's own KV-cache
code, scheduler included, on Qwen3.5-122B-A10B's layout with MTP or a DFlash drafter; prints one
JSON line of what it decides. Only the configs are stand-ins (SimpleNamespace): no hub, no GPU."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import logging
import sys
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import torch
import vllm
from transformers import Qwen3Config
from vllm.config import CacheConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.config.model import ModelConfig
from vllm.model_executor import models as vllm_models
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.mamba.gdn.base import GatedDeltaNetAttention
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateDtypeCalculator,
    MambaStateShapeCalculator,
)
from vllm.model_executor.models import config as model_configs
from vllm.model_executor.models import qwen3_dflash
from vllm.platforms.interface import Platform
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core import kv_cache_coordinator, kv_cache_utils
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

VLLM = Path(vllm.__path__[0])
ARCH = "Qwen3_5MoeForConditionalGeneration"
# Qwen3.5-122B-A10B's text_config (../shared/FORMATS.md): full attention every 4th of 48 layers, GDN
# otherwise, one MTP layer, BF16; mamba_ssm_dtype "float32" as the Qwen3.5 MoE configs ship it.
TEXT = NS(num_hidden_layers=48, full_attention_interval=4, num_attention_heads=32,
          num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64,
          linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
          mtp_num_hidden_layers=1, mamba_ssm_dtype="float32")
# z-lab/Qwen3.5-122B-A10B-DFlash (spark-facts.md: dflash_revisions): layers and window by revision
DRAFTERS = {"retrain": (6, 4096), "original": (4, 2048)}
DRAFT_KV_HEADS, DRAFT_HEAD_DIM = 8, 128
MAX_MODEL_LEN, NUM_BLOCKS = 32768, 1024
BUDGET = 8192  # `vllm serve`'s max_num_batched_tokens, >= 70 GiB non-A100 GPU (engine/arg_utils.py)
SMALL_UNIT = 16  # a prefix_match_unit dividing every group block size (2096, 2112, 2240, 2272, 64)
VERIFY_PROMPT = 4096  # verify's prefix-cache prompt (src/sparkspec/bench/checks.py target_tokens)


def qwen35_class() -> tuple[type, dict[str, int]]:
    """Qwen3_5ForConditionalGeneration's two state classmethods, compiled from qwen3_5.py itself."""
    path = VLLM / "model_executor/models/qwen3_5.py"
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body
               if isinstance(n, ast.ClassDef) and n.name == "Qwen3_5ForConditionalGeneration")
    wanted = {"get_mamba_state_shape_from_config", "get_mamba_state_dtype_from_config"}
    methods = [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name in wanted]
    module = ast.Module(body=[ast.ClassDef(name=cls.name, bases=[], keywords=[], body=methods,
                                           decorator_list=[], type_params=[])], type_ignores=[])
    namespace: dict[str, Any] = {"torch": torch,
                                 "MambaStateShapeCalculator": MambaStateShapeCalculator,
                                 "MambaStateDtypeCalculator": MambaStateDtypeCalculator}
    exec(compile(ast.fix_missing_locations(module), str(path), "exec"), namespace)
    return namespace[cls.name], {f.name: f.lineno for f in methods}


QWEN35, QWEN35_LINES = qwen35_class()


class FlashInferOnGB10(FlashAttentionBackend):
    """FLASHINFER's kernel block sizes on a Spark: flashinfer.py returns [16, 32, 64] off compute
    capability 10.x (GB10 is 12.1), declares no layout; its module needs flashinfer, absent here."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[Any]:
        return [16, 32, 64]

    @staticmethod
    def get_name() -> str:
        return "FLASHINFER"


BACKENDS: dict[str, type] = {"FLASH_ATTN": FlashAttentionBackend, "FLASHINFER": FlashInferOnGB10}
TARGET = FlashInferOnGB10  # the deploy's serve.attention_backend (sparkspec/registry/data.py SERVE)


class Spark(Platform):
    """The base Platform's block-size alignment, given the backends the loaded layers report."""

    backends: list[type] = []

    @classmethod
    def _find_non_ssm_backends(cls, vllm_config: Any) -> list[Any]:
        return list(cls.backends)


def spec_config(method: str, k: int) -> SpeculativeConfig:
    """A SpeculativeConfig with its defaults (its own methods decide), no draft checkpoint."""
    spec = object.__new__(SpeculativeConfig)
    for f in dataclasses.fields(SpeculativeConfig):
        value = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        object.__setattr__(spec, f.name, value)
    object.__setattr__(spec, "method", method)
    object.__setattr__(spec, "num_speculative_tokens", k)
    return spec


def engine_config(k: int, method: str | None, backends: list[type], ssm: str = "float32",
                  prefix_caching: bool = True) -> VllmConfig:
    """The config as the engine has it when the KV cache is sized: the arch hooks, then the
    backends' block size, hybrid-aligned (run after the model loads, so drafter layers count)."""
    cfg = VllmConfig()
    cfg.cache_config = CacheConfig(enable_prefix_caching=prefix_caching)
    cfg.model_config = NS(
        dtype=torch.bfloat16, use_mla=False, architecture=ARCH, is_hybrid=True,
        hf_text_config=NS(**{**vars(TEXT), "mamba_ssm_dtype": ssm}),
        hf_config=NS(model_type="qwen3_5_moe"), max_model_len=MAX_MODEL_LEN,
        original_max_model_len=MAX_MODEL_LEN, get_num_kv_heads=lambda pc: TEXT.num_key_value_heads,
        get_head_size=lambda: TEXT.head_dim, uses_mrope=False, supports_multimodal_inputs=False,
        runner_type="generate", return_sampling_mask=False, is_encoder_decoder=False,
        is_diffusion=False, multimodal_config=None)
    cfg.speculative_config = spec_config(method, k) if method else None
    cfg.scheduler_config = SchedulerConfig(max_model_len=MAX_MODEL_LEN,
                                           max_num_batched_tokens=BUDGET, max_num_seqs=4,
                                           enable_chunked_prefill=True, is_encoder_decoder=False)
    model_configs.Qwen3_5ForConditionalGenerationConfig.verify_and_update_config(cfg)
    model_configs.HybridAttentionMambaModelConfig.verify_and_update_config(cfg)
    resolve = vllm_models.ModelRegistry.resolve_model_cls
    vllm_models.ModelRegistry.resolve_model_cls = lambda *a, **kw: (QWEN35, ARCH)
    try:
        Spark.backends = backends
        Spark.update_block_size_for_backend(cfg)
    finally:
        vllm_models.ModelRegistry.resolve_model_cls = resolve
    return cfg


def attention_spec(cfg: VllmConfig, kv_heads: int, head: int, window: int | None,
                   backend: type) -> KVCacheSpec:
    layer = NS(attn_type=AttentionType.DECODER, kv_cache_dtype="auto", sliding_window=window,
               attn_backend=backend, num_kv_heads=kv_heads, head_size=head, head_size_v=head,
               kv_cache_torch_dtype=torch.bfloat16)
    spec = Attention.get_kv_cache_spec(layer, cfg)
    assert spec is not None
    return spec


def gdn_layer(cfg: VllmConfig) -> NS:
    """What QwenGatedDeltaNetAttention's state methods read from the layer (TP 1)."""
    return NS(tp_size=1, num_k_heads=TEXT.linear_num_key_heads,
              num_v_heads=TEXT.linear_num_value_heads, head_k_dim=TEXT.linear_key_head_dim,
              head_v_dim=TEXT.linear_value_head_dim, conv_kernel_size=TEXT.linear_conv_kernel_dim,
              num_spec=cfg.num_speculative_tokens, model_config=cfg.model_config,
              cache_config=cfg.cache_config)


def gdn_spec(cfg: VllmConfig) -> KVCacheSpec:
    gdn = gdn_layer(cfg)
    layer = NS(get_state_shape=lambda: QwenGatedDeltaNetAttention.get_state_shape(gdn),
               get_state_dtype=lambda: GatedDeltaNetAttention.get_state_dtype(gdn),
               mamba_type=MambaAttentionBackendEnum.GDN_ATTN, is_kv_cache_tp_replicated=False)
    spec = MambaBase.get_kv_cache_spec(layer, cfg)
    assert spec is not None
    return spec


def layer_specs(cfg: VllmConfig, method: str | None, windows: list[int | None],
                draft: type) -> dict[str, Any]:
    """The layers in registration order: the target's 48, then the drafter's (MTP's or DFlash's)."""
    specs: dict[str, Any] = {}
    for i in range(TEXT.num_hidden_layers):
        if (i + 1) % TEXT.full_attention_interval == 0:
            specs[f"language_model.model.layers.{i}.self_attn.attn"] = attention_spec(
                cfg, TEXT.num_key_value_heads, TEXT.head_dim, None, TARGET)
        else:
            specs[f"language_model.model.layers.{i}.linear_attn"] = gdn_spec(cfg)
    if method == "mtp":
        specs["mtp.layers.0.self_attn.attn"] = attention_spec(
            cfg, TEXT.num_key_value_heads, TEXT.head_dim, None, TARGET)
    for i, window in enumerate(windows):
        specs[f"draft_model.model.layers.{48 + i}.self_attn.attn"] = attention_spec(
            cfg, DRAFT_KV_HEADS, DRAFT_HEAD_DIM, window, draft)
    return specs


def build(k: int, method: str | None, windows: list[int | None], backend: str,
          unit: int | None = None) -> tuple[VllmConfig, dict[str, Any], KVCacheConfig, str, int]:
    """Engine and KV-cache configs as the engine core makes them (block_size: v1/engine/core.py)."""
    draft = BACKENDS[backend]
    backends = [TARGET] + ([draft] if method == "dflash" else [])
    cfg = engine_config(k, method, backends)
    aligned = cfg.cache_config.block_size
    specs = layer_specs(cfg, method, windows, draft)
    supported = [layout.name for layout in get_supported_kv_cache_layouts(backends)]
    layout = resolve_kv_cache_layout(cfg, [supported], specs.values()).name
    cfg.cache_config.num_gpu_blocks_override = NUM_BLOCKS
    kvc = kv_cache_utils.get_kv_cache_configs(cfg, [dict(specs)], [1 << 50])[0]
    cfg.cache_config.num_gpu_blocks = kvc.num_blocks
    cfg.cache_config.block_size = min(g.kv_cache_spec.block_size for g in kvc.kv_cache_groups
                                      if g.kv_cache_spec.prefix_cacheable)
    cfg.cache_config.prefix_match_unit = unit
    return cfg, specs, kvc, layout, aligned


def serve_repeats(cfg: VllmConfig, kvc: KVCacheConfig, prompt_len: int,
                  repeats: int = 3) -> dict[str, Any]:
    """The same prompt `repeats` times, one after another, each to its first sampled token, through
    a real Scheduler; a hit is the request's num_computed_tokens when it is first scheduled."""
    sched_bs, hash_bs = kv_cache_utils.resolve_kv_cache_block_sizes(kvc, cfg)
    align = kv_cache_utils.resolve_cache_hit_alignment_tokens(kvc, cfg, sched_bs, hash_bs)
    kv_cache_utils.init_none_hash(sha256)
    hasher = kv_cache_utils.get_request_block_hasher(hash_bs, sha256)
    outputs = NS(validate_tokens=lambda request, tokens: tokens,
                 grammar_bitmask=lambda *a, **kw: None, accept_tokens=lambda *a, **kw: True)
    scheduler = Scheduler(vllm_config=cfg, kv_cache_config=kvc, structured_output_manager=outputs,
                          block_size=sched_bs, hash_block_size=hash_bs, log_stats=True)
    prompt = [(i * 7919) % 50000 + 10 for i in range(prompt_len)]
    hits: list[int] = []
    for n in range(repeats):
        rid = f"r{n}"
        params = SamplingParams(max_tokens=1)
        scheduler.add_request(Request(rid, list(prompt), params, None, block_hasher=hasher))
        hit = None
        for _ in range(64):
            if rid not in scheduler.requests:
                break
            out = scheduler.schedule()
            if hit is None:
                hit = out.scheduled_new_reqs[0].num_computed_tokens
            ids = list(out.num_scheduled_tokens)
            done = [scheduler.requests[r].num_computed_tokens  # schedule() advanced it by the chunk
                    >= scheduler.requests[r].num_prompt_tokens for r in ids]
            scheduler.update_from_output(out, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[1] if d else [] for d in done]))
        assert rid not in scheduler.requests, f"{rid} did not finish"
        hits.append(int(hit or 0))
    coordinator = scheduler.kv_cache_manager.coordinator
    return {"sched": sched_bs, "hash": hash_bs, "align": align, "prompt": prompt_len,
            "hits": hits, "fine": bool(coordinator.enable_partial_hash_hits),
            "eagle_groups": len(coordinator.eagle_group_ids)}


def case(k: int, method: str | None, windows: list[int | None] | None = None,
         backend: str = "FLASH_ATTN") -> dict[str, Any]:
    """One serve configuration: block size, pages, groups; hits per prefix_match_unit and prompt."""
    windows = windows or []
    cfg, specs, kvc, layout, block = build(k, method, windows, backend)
    attn = specs["language_model.model.layers.3.self_attn.attn"]
    gdn = specs["language_model.model.layers.0.linear_attn"]
    pages: dict[str, Any] = {"target_attention": attn.page_size_bytes,
                             "gdn_state": gdn.real_page_size_bytes, "gdn_page": gdn.page_size_bytes}
    if method == "mtp":
        pages["mtp"] = specs["mtp.layers.0.self_attn.attn"].page_size_bytes
    if windows:
        pages["draft"] = sorted({s.page_size_bytes for n, s in specs.items()
                                 if n.startswith("draft_model.")})
    groups = [[type(g.kv_cache_spec).__name__, len(g.layer_names), g.kv_cache_spec.block_size,
               g.kv_cache_spec.page_size_bytes, g.is_eagle_group] for g in kvc.kv_cache_groups]
    out: dict[str, Any] = {"block": block, "mamba_block": cfg.cache_config.mamba_block_size,
                           "mamba_mode": cfg.cache_config.mamba_cache_mode, "layout": layout,
                           "pages": pages, "groups": groups}
    long_prompt = 3 * kv_cache_utils.resolve_kv_cache_block_sizes(kvc, cfg)[0] + 5
    for unit in (None, SMALL_UNIT):
        for name, length in (("long", long_prompt), ("verify", VERIFY_PROMPT)):
            run_cfg, _, run_kvc, _, _ = build(k, method, windows, backend, unit)
            out[f"{name}_{unit or 'default'}"] = serve_repeats(run_cfg, run_kvc, length)
    return out


def cases() -> dict[str, dict[str, Any]]:
    out = {"none": case(0, None), "mtp2": case(2, "mtp")}
    for revision, (layers, window) in DRAFTERS.items():
        for k in (12, 15):
            out[f"dflash{k}_{revision}_full"] = case(k, "dflash", [None] * layers)
            for backend in BACKENDS:
                out[f"dflash{k}_{revision}_swa_{backend}"] = case(k, "dflash", [window] * layers,
                                                                  backend)
    out["dflash12_retrain_mixed"] = case(12, "dflash", [4096] * 5 + [None])
    return out


def block_sizes() -> dict[str, Any]:
    """Aligned attention block size and GDN state per k (qwen3_5.py's shapes equal the layer's)."""
    out: dict[str, Any] = {}
    for k, method in ((0, None), (2, "mtp"), (12, "dflash"), (15, "dflash")):
        cfg = engine_config(k, method, [TARGET])
        shapes = QWEN35.get_mamba_state_shape_from_config(cfg)
        assert tuple(shapes) == tuple(QwenGatedDeltaNetAttention.get_state_shape(gdn_layer(cfg)))
        dtypes = QWEN35.get_mamba_state_dtype_from_config(cfg)
        out[str(k)] = {"block": cfg.cache_config.block_size, "shapes": [list(s) for s in shapes],
                       "dtypes": [str(d) for d in dtypes],
                       "padded": cfg.cache_config.mamba_page_size_padded,
                       "mamba_block": cfg.cache_config.mamba_block_size}
    out["2_bf16_ssm"] = engine_config(2, "mtp", [TARGET], ssm="bfloat16").cache_config.block_size
    off = engine_config(2, "mtp", [TARGET], prefix_caching=False).cache_config
    out["no_prefix_caching"] = {"mode": off.mamba_cache_mode, "mamba_block": off.mamba_block_size,
                                "block": off.block_size}
    return out


def drafter_layers() -> dict[str, Any]:
    """(window, causal) per layer as qwen3_dflash.py resolves drafter configs, V1 and V2 runners."""
    base = {"hidden_size": 3072, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "dflash_config": {"block_size": 16, "mask_token_id": 248077,
                                               "target_layer_ids": [1, 7, 14, 20, 26, 32, 39, 45]}}
    sliding = {"num_hidden_layers": 6, "use_sliding_window": True, "sliding_window": 4096}
    configs = {
        "retrain_published": sliding,  # its config.json as published (trimmed): no layer_types
        "retrain_mixed": {**sliding, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
        "retrain_all_sliding": {**sliding, "layer_types": ["sliding_attention"] * 6},
        "original_legacy": {"num_hidden_layers": 4, "sliding_window": 2048,
                            "layer_types": ["full_attention"] * 4}}  # z-lab's April schema
    out: dict[str, Any] = {}
    current = qwen3_dflash.get_current_vllm_config
    for name, extra in configs.items():
        hf = Qwen3Config(**base, **extra)
        for runner, v2 in (("v1", False), ("v2", True)):
            qwen3_dflash.get_current_vllm_config = lambda v2=v2: NS(use_v2_model_runner=v2)
            try:
                value: Any = [list(qwen3_dflash._resolve_layer_attention(hf, i))
                              for i in range(hf.num_hidden_layers)]
            except NotImplementedError as exc:
                value = f"NotImplementedError: {exc}"
            finally:
                qwen3_dflash.get_current_vllm_config = current
            out[f"{name}_{runner}"] = value
        check = NS(speculative_config=NS(method="dflash", draft_model_config=NS(hf_config=hf)))
        out[f"{name}_v1_refused"] = VllmConfig._dflash_needs_multi_kv_group(check)  # type: ignore[arg-type]
    return out


def refusals() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, k, method, windows, unit in (("mtp2_unit128", 2, "mtp", [], 128),
                                          ("mtp2_unit100", 2, "mtp", [], 100),
                                          ("dflash15_unit64", 15, "dflash", [None] * 4, 64)):
        cfg, _, kvc, _, _ = build(k, method, windows, "FLASH_ATTN", unit)
        try:
            out[name] = list(kv_cache_utils.resolve_kv_cache_block_sizes(kvc, cfg))
        except ValueError as exc:
            out[name] = f"ValueError: {exc}"
    supported = ModelConfig.is_prefix_caching_supported.fget  # type: ignore[attr-defined]
    out["hybrid_prefix_caching_supported"] = supported(NS(attn_type="hybrid", pooler_config=None))
    return out


WHERE = {"unify_kv_cache_spec_page_size": kv_cache_utils.unify_kv_cache_spec_page_size,
         "resolve_kv_cache_block_sizes": kv_cache_utils.resolve_kv_cache_block_sizes,
         "partial_hash_hits_enabled": kv_cache_utils.partial_hash_hits_enabled,
         "_annotate_eagle_groups": kv_cache_utils._annotate_eagle_groups,
         "_align_hybrid_block_size": Platform._align_hybrid_block_size,
         "_mamba_block_aligned_split": Scheduler._mamba_block_aligned_split,
         "replay_boundaries": kv_cache_coordinator.replay_boundaries,
         "_resolve_layer_attention": qwen3_dflash._resolve_layer_attention,
         "MambaModelConfig.verify_and_update_config":
             model_configs.MambaModelConfig.verify_and_update_config}


class Keep(logging.Handler):
    """vLLM's warnings, once each."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.add(record.getMessage())


def main() -> None:
    keep = Keep()
    logging.getLogger("vllm").addHandler(keep)
    flashinfer = (VLLM / "v1/attention/backends/flashinfer.py").read_text()
    facts: dict[str, Any] = {
        "version": vllm.__version__,
        "flashinfer_sizes_in_source": "return [16, 32, 64]\n" in flashinfer,
        "qwen35_lines": QWEN35_LINES,
        "where": {name: inspect.getsourcelines(fn)[1] for name, fn in WHERE.items()},
        "block_sizes": block_sizes(), "cases": cases(), "drafter_layers": drafter_layers(),
        "refusals": refusals()}
    facts["warnings"] = sorted(keep.seen)
    sys.stdout.write(json.dumps(facts) + "\n")


if __name__ == "__main__":
    main()
