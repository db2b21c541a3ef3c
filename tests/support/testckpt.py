"""Generator of small Qwen3.5-MoE checkpoints in the real on-disk formats.

Two layouts, with the tensor names of Qwen3.5-122B-A10B (see shared/FORMATS.md):

* Intel AutoRound INT4 (``auto_round:auto_gptq``): routed experts and attention / linear-attention
  projections as ``qweight`` I32 / ``qzeros`` I32 (0x77777777) / ``scales`` F16 with group size 128; shared
  experts kept 16-bit as BF16 ``.weight``; the MTP head (BF16) in ``model_extra_tensors.safetensors``.
* Qwen FP8: those projections (shared experts and the MTP layer's included) as F8_E4M3 ``.weight`` plus
  ``.weight_scale_inv`` over 128x128 blocks (BF16 by default, F32 optional).

The simulated Spark is provisioned from these, and tests and the benchmark use them. Bytes come from
seeded pools of sane values (no NaN), sliced per tensor, so generating gigabytes is memcpy-bound. A checkpoint
is written in a hidden sibling and swapped in (ckpt_out); an existing output folder is replaced only when it
carries generate's marker (the ``sparkspec_generated`` key of its config.json), never when it holds anything
else.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparkspec.checkpoint.manifest import MANIFEST_NAME
from sparkspec.checkpoint.out import check_room, claim, replacing
from sparkspec.checkpoint.safetensors_io import DTYPE_SIZES, encode_header, write_index
from sparkspec.checkpoint.selection import EXTRA_FILE
from sparkspec.errors import UserError
from sparkspec.jsonfile import read_json

BLOCK = 128  # AutoRound group size and FP8 weight block
LM = "model.language_model"
POOL_BYTES = 32 << 20
MARKER = "sparkspec_generated"  # top-level config.json key: the spec it was generated from
TOOL = "sparkspec checkpoint generate"


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
                            ("linear value heads*dim", self.linear_value_heads * self.linear_value_dim)):
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


# --- the model's module list --------------------------------------------------------------------------
# ("linear", name, role, out, in) for Linear modules; ("plain", name, dtype, shape) for everything else.
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
        yield from (_attention(p, s, "proj") if kind == "full_attention" else _linear_attention(p, s))
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


# --- bytes --------------------------------------------------------------------------------------------
class _Pools:
    """Seeded pools of valid values per dtype; a tensor's bytes are a name-keyed slice (wrapping)."""

    def __init__(self, seed: int, size: int = POOL_BYTES) -> None:
        self._seed, self._size = seed, max(1 << 16, min(POOL_BYTES, size)) // 8 * 8
        self._pool: dict[str, bytes] = {}

    def _get(self, dtype: str) -> bytes:
        kind = dtype if dtype in ("BF16", "F16", "F32", "F8_E4M3") else "raw"
        if kind not in self._pool:
            rng = np.random.default_rng([self._seed, zlib.crc32(kind.encode())])
            n = self._size
            if kind == "F8_E4M3":  # no NaN (0x7f / 0xff): magnitude below 0x7f, random sign
                data = (rng.integers(0, 0x7F, n, dtype=np.uint8)
                        | (rng.integers(0, 2, n, dtype=np.uint8) << 7)).tobytes()
            elif kind == "raw":
                data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
            else:
                normal = rng.standard_normal(n // 2, dtype=np.float32) * np.float32(0.02)
                data = _encode_floats(normal, kind)[:n]
            self._pool[kind] = data
        return self._pool[kind]

    def chunks(self, name: str, dtype: str, nbytes: int, fill: str = "") -> Iterator[bytes | memoryview]:
        if fill == "zeros77":
            block = b"\x77" * min(nbytes, 1 << 20)
            for off in range(0, nbytes, len(block)):
                yield block[: min(len(block), nbytes - off)]
            return
        if fill == "scale":  # positive scales around 1e-3
            size = DTYPE_SIZES[dtype]
            vals = np.full(nbytes // size, 1e-3, dtype=np.float32) * (1 + (zlib.crc32(name.encode()) % 7))
            yield _encode_floats(vals, dtype)
            return
        pool = memoryview(self._get(dtype))
        size = DTYPE_SIZES.get(dtype, 1)
        pos = (zlib.crc32(name.encode()) * 4099) % (len(pool) // 2) // size * size
        remaining = nbytes
        while remaining:
            take = min(remaining, len(pool) - pos)
            yield pool[pos: pos + take]
            remaining -= take
            pos = 0


def _encode_floats(values: np.ndarray, dtype: str) -> bytes:
    f32 = values.astype(np.float32)
    if dtype == "BF16":
        return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    return f32.astype({"F16": np.float16, "F32": np.float32}[dtype]).tobytes()


Tensor = tuple[str, str, tuple[int, ...], str]  # name, dtype, shape, fill


def _int4(name: str, out: int, inp: int) -> list[Tensor]:
    return [(f"{name}.qweight", "I32", (inp * 4 // 32, out), ""),
            (f"{name}.qzeros", "I32", (math.ceil(inp / BLOCK), out * 4 // 32), "zeros77"),
            (f"{name}.scales", "F16", (math.ceil(inp / BLOCK), out), "scale")]


def _fp8(name: str, out: int, inp: int, scale_dtype: str) -> list[Tensor]:
    return [(f"{name}.weight", "F8_E4M3", (out, inp), ""),
            (f"{name}.weight_scale_inv", scale_dtype, (math.ceil(out / BLOCK), math.ceil(inp / BLOCK)),
             "scale")]


def _materialize(items: Iterator[Item], linear: Any) -> list[Tensor]:
    out: list[Tensor] = []
    for item in items:
        if item[0] == "plain":
            out.append((item[1], item[2], item[3], ""))
        else:
            out.extend(linear(*item[1:]))
    return out


def _nbytes(t: Tensor) -> int:
    return math.prod(t[2]) * DTYPE_SIZES[t[1]]


def _pools_for(seed: int, tensors: list[Tensor]) -> _Pools:
    return _Pools(seed, sum(_nbytes(t) for t in tensors))


def _write_stream(path: Path, tensors: list[Tensor], pools: _Pools) -> None:
    prefix, _ = encode_header([(n, d, s, _nbytes((n, d, s, f))) for n, d, s, f in tensors], {"format": "pt"})
    with open(path, "wb") as fh:
        fh.write(prefix)
        for name, dtype, shape, fill in tensors:
            fh.writelines(pools.chunks(name, dtype, _nbytes((name, dtype, shape, fill)), fill))


def _write_shards(directory: Path, tensors: list[Tensor], shards: int, pools: _Pools,
                  indexed_extra: list[Tensor] | None = None) -> dict[str, str]:
    """Split tensors in order into ``shards`` files of similar size; write them and the index
    (which also maps ``indexed_extra``, the tensors of model_extra_tensors.safetensors, when given)."""
    total = sum(_nbytes(t) for t in tensors)
    groups: list[list[Tensor]] = [[] for _ in range(shards)]
    acc = 0
    for t in tensors:
        groups[min(shards - 1, acc * shards // max(total, 1))].append(t)
        acc += _nbytes(t)
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        _write_stream(directory / name, group, pools)
        weight_map.update({t[0]: name for t in group})
    for t in indexed_extra or []:
        weight_map[t[0]] = EXTRA_FILE
        total += _nbytes(t)
    write_index(directory, weight_map, total)
    return weight_map


def _text_config(s: ModelSpec) -> dict[str, Any]:
    return {
        "model_type": "qwen3_5_moe_text", "hidden_size": s.hidden, "num_hidden_layers": s.layers,
        "layer_types": s.layer_types, "full_attention_interval": 4,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim,
        "linear_num_key_heads": s.linear_key_heads, "linear_num_value_heads": s.linear_value_heads,
        "linear_key_head_dim": s.linear_key_dim, "linear_value_head_dim": s.linear_value_dim,
        "linear_conv_kernel_dim": s.conv_kernel, "num_experts": s.experts,
        "num_experts_per_tok": s.experts_per_tok, "moe_intermediate_size": s.moe_intermediate,
        "shared_expert_intermediate_size": s.shared_intermediate, "mtp_num_hidden_layers": s.mtp_layers,
        "vocab_size": s.vocab, "tie_word_embeddings": False, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "rope_theta": 10000000, "hidden_act": "silu",
        "attn_output_gate": True, "torch_dtype": "bfloat16",
    }


def _config(s: ModelSpec, quantization_config: dict[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": _text_config(s),
        "vision_config": {"model_type": "qwen3_5_moe", "hidden_size": s.hidden, "depth": 1},
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "quantization_config": quantization_config,
        MARKER: asdict(s),
    }


def _write_side_files(directory: Path, config: dict[str, Any]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    # tokenizers serialises a WordLevel vocab in hash order: sort it so the same spec gives the same bytes.
    doc = json.loads(tok.to_str())
    doc["model"]["vocab"] = dict(sorted(doc["model"]["vocab"].items(), key=lambda kv: kv[1]))
    (directory / "tokenizer.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
         "pad_token": "<|endoftext|>", "model_max_length": 4096}, indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 0], "temperature": 0.6, "top_p": 0.95, "top_k": 20}, indent=2) + "\n")
    (directory / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _generated(directory: Path) -> bool:
    """A folder generate wrote: its config.json carries generate's marker, and no other command's manifest
    is there (a hybrid assembled from generated sources copies the config)."""
    if os.path.lexists(directory / MANIFEST_NAME):
        return False
    try:
        config = read_json(directory / "config.json", "not found", "not generate's")
    except UserError:
        return False
    return isinstance(config, dict) and MARKER in config


@contextmanager
def _output(directory: str | os.PathLike[str], nbytes: int) -> Iterator[Path]:
    """The build folder of a checkpoint of about ``nbytes``, swapped into ``directory`` when complete."""
    out = Path(directory)
    claim(out, "--out", TOOL, _generated)
    check_room(out, nbytes + (1 << 20), "--out", "the checkpoint")
    with replacing(out, flag="--out", tool=TOOL, owned=_generated, stage="generate-tmp") as tmp:
        yield tmp


def write_int4_autoround(directory: str | os.PathLike[str], spec: ModelSpec, *, index_lists_mtp: bool = False,
                         shards: int = 2, seed: int = 0) -> dict[str, str]:
    """Write an AutoRound INT4 checkpoint (plus model_extra_tensors.safetensors); return its weight_map."""

    def linear(name: str, role: str, o: int, i: int) -> list[Tensor]:
        if role in ("expert", "proj"):
            return _int4(name, o, i)
        return [(f"{name}.weight", "BF16", (o, i), "")]  # shared experts and MTP stay 16-bit

    text = _materialize(text_items(spec), linear)
    mtp = _materialize(mtp_items(spec), linear)
    with _output(directory, sum(map(_nbytes, text + mtp))) as out:
        pools = _pools_for(seed, text + mtp)
        if mtp:
            _write_stream(out / EXTRA_FILE, mtp, pools)
        weight_map = _write_shards(out, text, shards, pools, mtp if index_lists_mtp else None)
        shared16 = {f"{LM}.layers.{i}.mlp.shared_expert.{p}": {"bits": 16, "data_type": "float"}
                    for i in range(spec.layers) for p in ("gate_proj", "up_proj", "down_proj")}
        qc = {"quant_method": "auto-round", "bits": 4, "group_size": BLOCK, "sym": True, "data_type": "int",
              "packing_format": "auto_round:auto_gptq", "block_name_to_quantize": f"{LM}.layers",
              "autoround_version": "0.9.0", "extra_config": shared16}
        _write_side_files(out, _config(spec, qc))
    return weight_map


def write_fp8(directory: str | os.PathLike[str], spec: ModelSpec, shards: int = 2, *,
              scale_dtype: str = "BF16", seed: int = 1,
              only: Callable[[str], bool] | None = None) -> dict[str, str]:
    """Write a Qwen block-FP8 checkpoint (MTP head included, in FP8 as upstream); return its weight_map.

    ``only`` keeps just the tensors whose name it accepts: a partial source like the ranged fetch writes.
    """
    if scale_dtype not in ("BF16", "F32"):
        raise ValueError("scale_dtype must be BF16 or F32")
    items = [*text_items(spec), *mtp_items(spec)]
    tensors = _materialize(iter(items), lambda n, role, o, i: _fp8(n, o, i, scale_dtype))
    if only is not None:
        tensors = [t for t in tensors if only(t[0])]
    with _output(directory, sum(map(_nbytes, tensors))) as out:
        weight_map = _write_shards(out, tensors, shards, _pools_for(seed, tensors))
        _write_side_files(out, _config(spec, _fp8_quantization(spec)))
    return weight_map


def _fp8_quantization(spec: ModelSpec) -> dict[str, Any]:
    not_converted = ["lm_head", "model.visual", "mtp.fc"] + [
        f"{LM}.layers.{i}.{m}" for i, kind in enumerate(spec.layer_types)
        for m in (["linear_attn.in_proj_a", "linear_attn.in_proj_b"] if kind == "linear_attention" else [])
        + ["mlp.gate", "mlp.shared_expert_gate"]]
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": not_converted}


def spec_for_bytes(target_bytes: int) -> ModelSpec:
    """A spec whose INT4 shards total at least ``target_bytes`` (for benchmarks): grows experts and layers."""
    base = dict(hidden=2048, moe_intermediate=1024, shared_intermediate=1024, heads=8, kv_heads=2,
                head_dim=128, linear_key_heads=8, linear_value_heads=16, linear_key_dim=128,
                linear_value_dim=128, vocab=8192)
    per_expert = 3 * 2048 * 1024 // 2  # INT4 bytes of one expert's three projections
    layers = 8
    experts = max(8, math.ceil(target_bytes / (layers * per_expert)))
    return ModelSpec(layers=layers, experts=experts, experts_per_tok=8, **base)
