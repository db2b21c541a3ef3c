"""Generator of small Qwen3.5-MoE checkpoints in the real on-disk formats.

Two layouts, with the tensor names of Qwen3.5-122B-A10B (module list:
:mod:`tests.support.ckptlayout`):

* Intel AutoRound INT4 (``auto_round:auto_gptq``): routed experts and attention / linear-attention
  projections as ``qweight`` I32 / ``qzeros`` I32 (0x77777777) / ``scales`` F16 with group size 128;
  shared experts kept 16-bit as BF16 ``.weight``; the MTP head (BF16) in
  ``model_extra_tensors.safetensors``.
* Qwen FP8: those projections (shared experts and the MTP layer's included) as F8_E4M3 ``.weight``
  plus ``.weight_scale_inv`` over 128x128 blocks (BF16 by default, F32 optional).

The simulated Spark is provisioned from these, and tests and the benchmark use them. Bytes come from
seeded pools of sane values (no NaN), sliced per tensor, so generating gigabytes is memcpy-bound. A
checkpoint is written in a hidden sibling and swapped in (sparkspec.checkpoint.out); an existing
output folder is replaced only when it carries generate's marker (the ``sparkspec_generated`` key of
its config.json), never when it holds anything else.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from sparkspec.checkpoint.manifest import MANIFEST_NAME
from sparkspec.checkpoint.out import check_room, claim, replacing
from sparkspec.checkpoint.safetensors_io import DTYPE_SIZES, encode_header, write_index
from sparkspec.checkpoint.selection import EXTRA_FILE
from sparkspec.errors import UserError
from sparkspec.jsonfile import read_json
from tests.support.ckptlayout import (
    BLOCK,
    LM,
    MARKER,
    Item,
    ModelSpec,
    config_json,
    fp8_quantization,
    mtp_items,
    spec_for_bytes,
    text_items,
)

POOL_BYTES = 32 << 20
TOOL = "python -m tests.support checkpoint generate"

# ModelSpec and spec_for_bytes are ckptlayout's, re-exported: callers need one import for a
# checkpoint
__all__ = ["ModelSpec", "spec_for_bytes", "write_fp8", "write_int4_autoround"]


# --- bytes ----------------------------------------------------------------------------------------
class _Pools:
    """Seeded pools of valid values per dtype; a tensor's bytes are a name-keyed slice
    (wrapping)."""

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

    def chunks(self, name: str, dtype: str, nbytes: int,
               fill: str = "") -> Iterator[bytes | memoryview]:
        if fill == "zeros77":
            block = b"\x77" * min(nbytes, 1 << 20)
            for off in range(0, nbytes, len(block)):
                yield block[: min(len(block), nbytes - off)]
            return
        if fill == "scale":  # positive scales around 1e-3
            size = DTYPE_SIZES[dtype]
            vals = (np.full(nbytes // size, 1e-3, dtype=np.float32)
                    * (1 + (zlib.crc32(name.encode()) % 7)))
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
            (f"{name}.weight_scale_inv", scale_dtype,
             (math.ceil(out / BLOCK), math.ceil(inp / BLOCK)), "scale")]


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
    prefix, _ = encode_header([(n, d, s, _nbytes((n, d, s, f))) for n, d, s, f in tensors],
                              {"format": "pt"})
    with open(path, "wb") as fh:
        fh.write(prefix)
        for name, dtype, shape, fill in tensors:
            fh.writelines(pools.chunks(name, dtype, _nbytes((name, dtype, shape, fill)), fill))


def _write_shards(directory: Path, tensors: list[Tensor], shards: int, pools: _Pools,
                  indexed_extra: list[Tensor] | None = None) -> dict[str, str]:
    """Split tensors in order into ``shards`` files of similar size; write them and the index
    (which also maps ``indexed_extra``, the tensors of model_extra_tensors.safetensors, when
    given)."""
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


def _write_side_files(directory: Path, config: dict[str, Any]) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    # tokenizers serialises a WordLevel vocab in hash order: sort it so the same spec gives the same
    # bytes.
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
    """A folder generate wrote: its config.json carries generate's marker, and no other command's
    manifest is there (a hybrid assembled from generated sources copies the config)."""
    if os.path.lexists(directory / MANIFEST_NAME):
        return False
    try:
        config = read_json(directory / "config.json", "not found", "not generate's")
    except UserError:
        return False
    return isinstance(config, dict) and MARKER in config


@contextmanager
def _output(directory: str | os.PathLike[str], nbytes: int) -> Iterator[Path]:
    """The build folder of a checkpoint of about ``nbytes``, swapped into ``directory`` when
    complete."""
    out = Path(directory)
    claim(out, "--out", TOOL, _generated)
    check_room(out, nbytes + (1 << 20), "--out", "the checkpoint")
    with replacing(out, flag="--out", tool=TOOL, owned=_generated, stage="generate-tmp") as tmp:
        yield tmp


def write_int4_autoround(directory: str | os.PathLike[str], spec: ModelSpec, *,
                         index_lists_mtp: bool = False, shards: int = 2,
                         seed: int = 0) -> dict[str, str]:
    """Write an AutoRound INT4 checkpoint (plus model_extra_tensors.safetensors); return its
    weight_map."""

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
        qc = {"quant_method": "auto-round", "bits": 4, "group_size": BLOCK, "sym": True,
              "data_type": "int", "packing_format": "auto_round:auto_gptq",
              "block_name_to_quantize": f"{LM}.layers",
              "autoround_version": "0.9.0", "extra_config": shared16}
        _write_side_files(out, config_json(spec, qc))
    return weight_map


def write_fp8(directory: str | os.PathLike[str], spec: ModelSpec, shards: int = 2, *,
              scale_dtype: str = "BF16", seed: int = 1,
              only: Callable[[str], bool] | None = None) -> dict[str, str]:
    """Write a Qwen block-FP8 checkpoint (MTP head included, in FP8 as upstream); return its
    weight_map.

    ``only`` keeps just the tensors whose name it accepts: a partial source like the ranged fetch
    writes.
    """
    if scale_dtype not in ("BF16", "F32"):
        raise ValueError("scale_dtype must be BF16 or F32")
    items = [*text_items(spec), *mtp_items(spec)]
    tensors = _materialize(iter(items), lambda n, role, o, i: _fp8(n, o, i, scale_dtype))
    if only is not None:
        tensors = [t for t in tensors if only(t[0])]
    with _output(directory, sum(map(_nbytes, tensors))) as out:
        weight_map = _write_shards(out, tensors, shards, _pools_for(seed, tensors))
        _write_side_files(out, config_json(spec, fp8_quantization(spec)))
    return weight_map


