"""What a generated Qwen3.5-MoE checkpoint contains, before any byte is written: the model's
dimensions (:class:`ModelSpec`), its module list with the tensor names of Qwen3.5-122B-A10B (text
layers with linear and full attention, routed and shared experts, the vision tower's stub, the MTP
head), and the config.json of each layout. :mod:`tests.support.testckpt` turns these into files.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

BLOCK = 128  # AutoRound group size and FP8 weight block
LM = "model.language_model"
MARKER = "sparkspec_generated"  # top-level config.json key: the spec it was generated from


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a Qwen3.5-MoE text model. Quantized in/out dims must be multiples of 128."""

    hidden: int = 256
    layers: int = 4  # layer_types: 3 linear_attention then 1 full_attention, repeating
    experts: int = 4
    experts_per_tok: int = 2
    moe_intermediate: int = 128
    shared_intermediate: int = 128
    heads: int = 2
    kv_heads: int = 1
    head_dim: int = 128
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_key_dim: int = 64
    linear_value_dim: int = 64
    conv_kernel: int = 4
    vocab: int = 512
    mtp_layers: int = 1

    def __post_init__(self) -> None:
        for name, value in (("hidden", self.hidden), ("moe_intermediate", self.moe_intermediate),
                            ("shared_intermediate", self.shared_intermediate),
                            ("kv_heads*head_dim", self.kv_heads * self.head_dim),
                            ("linear value heads*dim",
                             self.linear_value_heads * self.linear_value_dim)):
            if value <= 0 or value % BLOCK:
                raise ValueError(f"ModelSpec.{name}={value} must be a positive multiple of {BLOCK}")

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(self.layers)]

    @property
    def expected_mtp_tensors(self) -> int:
        return 4 + self.mtp_layers * (3 * self.experts + 13) if self.mtp_layers else 0

    @property
    def shared_expert_projections(self) -> int:
        return 3 * self.layers


# --- the model's module list ----------------------------------------------------------------------
# ("linear", name, role, out, in) for Linear modules; ("plain", name, dtype, shape) for everything
# else.
Item = tuple[Any, ...]


def _attention(prefix: str, s: ModelSpec, role: str) -> Iterator[Item]:
    qd, kvd = s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield ("linear", f"{prefix}.self_attn.q_proj", role, 2 * qd, s.hidden)  # query + output gate
    yield ("linear", f"{prefix}.self_attn.k_proj", role, kvd, s.hidden)
    yield ("linear", f"{prefix}.self_attn.v_proj", role, kvd, s.hidden)
    yield ("linear", f"{prefix}.self_attn.o_proj", role, s.hidden, qd)
    yield ("plain", f"{prefix}.self_attn.q_norm.weight", "BF16", (s.head_dim,))
    yield ("plain", f"{prefix}.self_attn.k_norm.weight", "BF16", (s.head_dim,))


def _linear_attention(prefix: str, s: ModelSpec) -> Iterator[Item]:
    p = f"{prefix}.linear_attn"
    key, value = s.linear_key_heads * s.linear_key_dim, s.linear_value_heads * s.linear_value_dim
    conv_dim = 2 * key + value
    yield ("linear", f"{p}.in_proj_qkv", "proj", conv_dim, s.hidden)
    yield ("linear", f"{p}.in_proj_z", "proj", value, s.hidden)
    yield ("plain", f"{p}.in_proj_b.weight", "BF16", (s.linear_value_heads, s.hidden))
    yield ("plain", f"{p}.in_proj_a.weight", "BF16", (s.linear_value_heads, s.hidden))
    yield ("plain", f"{p}.conv1d.weight", "BF16", (conv_dim, 1, s.conv_kernel))
    yield ("plain", f"{p}.A_log", "F32", (s.linear_value_heads,))
    yield ("plain", f"{p}.dt_bias", "BF16", (s.linear_value_heads,))
    yield ("plain", f"{p}.norm.weight", "BF16", (s.linear_value_dim,))
    yield ("linear", f"{p}.out_proj", "proj", s.hidden, value)


def _moe(prefix: str, s: ModelSpec, mtp: bool) -> Iterator[Item]:
    p = f"{prefix}.mlp"
    expert_role, shared_role = ("mtp", "mtp") if mtp else ("expert", "shared")
    yield ("plain", f"{p}.gate.weight", "BF16", (s.experts, s.hidden))
    for e in range(s.experts):
        yield ("linear", f"{p}.experts.{e}.gate_proj", expert_role, s.moe_intermediate, s.hidden)
        yield ("linear", f"{p}.experts.{e}.up_proj", expert_role, s.moe_intermediate, s.hidden)
        yield ("linear", f"{p}.experts.{e}.down_proj", expert_role, s.hidden, s.moe_intermediate)
    yield ("linear", f"{p}.shared_expert.gate_proj", shared_role, s.shared_intermediate, s.hidden)
    yield ("linear", f"{p}.shared_expert.up_proj", shared_role, s.shared_intermediate, s.hidden)
    yield ("linear", f"{p}.shared_expert.down_proj", shared_role, s.hidden, s.shared_intermediate)
    yield ("plain", f"{p}.shared_expert_gate.weight", "BF16", (1, s.hidden))


def _visual(s: ModelSpec) -> Iterator[Item]:
    v = "model.visual"
    yield ("plain", f"{v}.patch_embed.proj.weight", "BF16", (s.hidden, 3, 2, 16, 16))
    yield ("plain", f"{v}.pos_embed.weight", "BF16", (64, s.hidden))
    yield ("plain", f"{v}.blocks.0.norm1.weight", "BF16", (s.hidden,))
    yield ("plain", f"{v}.blocks.0.attn.qkv.weight", "BF16", (3 * s.hidden, s.hidden))
    yield ("plain", f"{v}.blocks.0.attn.proj.weight", "BF16", (s.hidden, s.hidden))
    yield ("plain", f"{v}.merger.linear_fc1.weight", "BF16", (s.hidden, s.hidden))


def text_items(s: ModelSpec) -> Iterator[Item]:
    yield ("plain", f"{LM}.embed_tokens.weight", "BF16", (s.vocab, s.hidden))
    for i, kind in enumerate(s.layer_types):
        p = f"{LM}.layers.{i}"
        yield ("plain", f"{p}.input_layernorm.weight", "BF16", (s.hidden,))
        yield from (_attention(p, s, "proj") if kind == "full_attention"
                    else _linear_attention(p, s))
        yield ("plain", f"{p}.post_attention_layernorm.weight", "BF16", (s.hidden,))
        yield from _moe(p, s, mtp=False)
    yield ("plain", f"{LM}.norm.weight", "BF16", (s.hidden,))
    yield ("plain", "lm_head.weight", "BF16", (s.vocab, s.hidden))
    yield from _visual(s)


def mtp_items(s: ModelSpec) -> Iterator[Item]:
    if not s.mtp_layers:
        return
    yield ("plain", "mtp.fc.weight", "BF16", (s.hidden, 2 * s.hidden))
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        yield ("plain", f"mtp.{norm}.weight", "BF16", (s.hidden,))
    for i in range(s.mtp_layers):
        p = f"mtp.layers.{i}"
        yield ("plain", f"{p}.input_layernorm.weight", "BF16", (s.hidden,))
        yield ("plain", f"{p}.post_attention_layernorm.weight", "BF16", (s.hidden,))
        yield from _attention(p, s, "mtp")
        yield from _moe(p, s, mtp=True)


# --- config.json ----------------------------------------------------------------------------------
def text_config(s: ModelSpec) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_moe_text", "hidden_size": s.hidden, "num_hidden_layers": s.layers,
        "layer_types": s.layer_types, "full_attention_interval": 4,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
        "linear_num_key_heads": s.linear_key_heads, "linear_num_value_heads": s.linear_value_heads,
        "linear_key_head_dim": s.linear_key_dim, "linear_value_head_dim": s.linear_value_dim,
        "linear_conv_kernel_dim": s.conv_kernel, "num_experts": s.experts,
        "num_experts_per_tok": s.experts_per_tok, "moe_intermediate_size": s.moe_intermediate,
        "shared_expert_intermediate_size": s.shared_intermediate,
        "mtp_num_hidden_layers": s.mtp_layers,
        "vocab_size": s.vocab, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "rope_theta": 10000000, "hidden_act": "silu",
        "attn_output_gate": True, "torch_dtype": "bfloat16",
    }


def config_json(s: ModelSpec, quantization_config: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": text_config(s),
        "vision_config": {"model_type": "qwen3_5_moe", "hidden_size": s.hidden, "depth": 1},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": quantization_config,
        MARKER: asdict(s),
    }


def fp8_quantization(spec: ModelSpec) -> dict[str, Any]:
    not_converted = ["lm_head", "model.visual", "mtp.fc"] + [
        f"{LM}.layers.{i}.{m}" for i, kind in enumerate(spec.layer_types)
        for m in (["linear_attn.in_proj_a", "linear_attn.in_proj_b"]
                  if kind == "linear_attention" else [])
        + ["mlp.gate", "mlp.shared_expert_gate"]]
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": not_converted}


def spec_for_bytes(target_bytes: int) -> ModelSpec:
    """A spec whose INT4 shards total at least ``target_bytes`` (for benchmarks): grows experts and
    layers."""
    base = dict(hidden=2048, moe_intermediate=1024, shared_intermediate=1024, heads=8, kv_heads=2,
                head_dim=128, linear_key_heads=8, linear_value_heads=16, linear_key_dim=128,
                linear_value_dim=128, vocab=8192)
    per_expert = 3 * 2048 * 1024 // 2  # INT4 bytes of one expert's three projections
    layers = 8
    experts = max(8, math.ceil(target_bytes / (layers * per_expert)))
    return ModelSpec(layers=layers, experts=experts, experts_per_tok=8, **base)
