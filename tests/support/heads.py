"""Draft heads for the tiny Qwen3 target (tests/support/tinymodel.py) in the layouts vLLM 0.32
loads.

* EAGLE3 (``LlamaForCausalLMEagle3``, one Llama layer whose attention reads ``[embed, hidden]``,
  ``fc`` over the target's aux hidden states named by
  ``eagle_config.eagle_aux_hidden_state_layer_ids``), DISTILLED from its target: the target's
  forward is reproduced below in torch (it matches vLLM's Qwen3), training data is the target's own
  greedy outputs and aux states, and the head's forward follows vllm/model_executor/models/
  llama_eagle3.py step for step (the first draft position, which is all that
  ``num_speculative_tokens: 1`` uses).
* DFlash (``DFlashDraftModel``, ``model_type: qwen3``, ``dflash_config``), random weights: it
  drafts, it accepts next to nothing; the lossless check and the drafts counter are what it
  exercises.

Distilling costs CPU time, so the head is cached by content: its ``model.safetensors`` records the
key (target weights and config digest, generator version, seed) in its metadata, and a folder whose
file carries the current key is left as it is. The same key gives the same bytes on one machine
(torch on CPU, one thread).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparkspec.checkpoint.safetensors_io import read_header, write_file
from sparkspec.errors import UserError
from sparkspec.validate import repo_folder
from tests.support import tinymodel

# bump when this module or distil.py changes what it writes: the caches then rebuild
GENERATOR_VERSION = 1
TARGET_REPO = "sparkspec/sim-tiny"
EAGLE3_AUX_IDS = [0, 1]         # aux state i = the input of target layer i (0: the embeddings)
# z-lab's block: the built-in dflash k (12) and the most a block holds (15)
DFLASH_BLOCK = 16
DFLASH_TARGET_LAYERS = [0, 1]   # zero-based target layers (vLLM adds 1 to reach the aux ids)
KEY = "sparkspec.generator_key"
EPS = 1e-6


@dataclass(frozen=True)
class Head:
    path: Path
    key: str
    trained: bool                 # False when the cached folder was reused
    # share of held-out positions where the head predicts the target's token
    train_accuracy: float | None


def target_dir(out: Path) -> Path:
    """The target's generated folder beside ``out`` (the one the simulated hub publishes), written
    if missing."""
    path = Path(out).parent / repo_folder(TARGET_REPO)
    tinymodel.write_tiny_model(path, seed=0)
    return path


def _digest(target: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((target / name).read_bytes())
    return h.hexdigest()


def _key(kind: str, target: Path, seed: int) -> str:
    return f"{kind}:v{GENERATOR_VERSION}:seed{seed}:{_digest(target)}"


def _cached(out: Path, key: str, cfg: dict[str, Any]) -> bool:
    try:
        meta = read_header(out / "model.safetensors").metadata or {}
        return meta.get(KEY) == key and json.loads((out / "config.json").read_text()) == cfg
    except (OSError, ValueError, UserError):
        return False


def _write(out: Path, cfg: dict[str, Any], tensors: dict[str, np.ndarray], key: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".model.safetensors.tmp"
    write_file(tmp, {n: ("BF16", tuple(a.shape), tinymodel._bf16(a)) for n, a in tensors.items()},
               metadata={"format": "pt", KEY: key})
    os.replace(tmp, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")


def _target_config(target: Path) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((target / "config.json").read_text())
    return cfg


def _common(t: dict[str, Any]) -> dict[str, Any]:
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
            "hidden_act")
    return {k: t[k] for k in keys} | {"num_hidden_layers": 1, "tie_word_embeddings": False,
                                      "torch_dtype": "bfloat16", "attention_bias": False}


def eagle3_config(target: dict[str, Any]) -> dict[str, Any]:
    return _common(target) | {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "draft_vocab_size": target["vocab_size"], "target_hidden_size": target["hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": EAGLE3_AUX_IDS,
                         "use_aux_hidden_state": True},
    }


def dflash_config(target: dict[str, Any], mask_token_id: int) -> dict[str, Any]:
    return _common(target) | {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "target_hidden_size": target["hidden_size"],
        "dflash_config": {"block_size": DFLASH_BLOCK, "mask_token_id": mask_token_id,
                          "target_layer_ids": DFLASH_TARGET_LAYERS},
    }


def _random_layer(rng: np.random.Generator, cfg: dict[str, Any], prefix: str, attn_in: int,
                  qk_norm: bool) -> dict[str, np.ndarray]:
    hid, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def w(rows: int, cols: int) -> np.ndarray:
        return rng.standard_normal((rows, cols), np.float32) * cols ** -0.5

    out = {
        prefix + "self_attn.q_proj.weight": w(q_out, attn_in),
        prefix + "self_attn.k_proj.weight": w(kv_out, attn_in),
        prefix + "self_attn.v_proj.weight": w(kv_out, attn_in),
        prefix + "self_attn.o_proj.weight": w(hid, q_out),
        prefix + "mlp.gate_proj.weight": w(inter, hid),
        prefix + "mlp.up_proj.weight": w(inter, hid),
        prefix + "mlp.down_proj.weight": w(hid, inter),
        prefix + "input_layernorm.weight": np.ones(hid, np.float32),
        prefix + "post_attention_layernorm.weight": np.ones(hid, np.float32),
    }
    if qk_norm:
        out[prefix + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        out[prefix + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
    return out


def write_dflash_head(out: str | Path, seed: int = 0) -> Head:
    """A random DFlash head for the tiny target (tensor names of VLLM.md's measured layout)."""
    out = Path(out)
    target = target_dir(out)
    tcfg = _target_config(target)
    cfg = dflash_config(tcfg, mask_token_id=int(tcfg["bos_token_id"]))
    key = _key("dflash", target, seed)
    if _cached(out, key, cfg):
        return Head(out, key, False, None)
    rng = np.random.default_rng(seed)
    hid, vocab = tcfg["hidden_size"], tcfg["vocab_size"]
    tensors = _random_layer(rng, cfg, "layers.0.", hid, qk_norm=True)
    tensors |= {
        "fc.weight": (rng.standard_normal((hid, len(DFLASH_TARGET_LAYERS) * hid), np.float32)
                      * hid ** -0.5),
        "hidden_norm.weight": np.ones(hid, np.float32),
        "norm.weight": np.ones(hid, np.float32),
        "lm_head.weight": rng.standard_normal((vocab, hid), np.float32) * 0.5,
    }
    _write(out, cfg, tensors, key)
    return Head(out, key, True, None)


def _train_eagle3(target: Path, cfg: dict[str, Any], seed: int,
                  steps: int) -> tuple[dict[str, np.ndarray], float]:
    """tests.support.distil in a fresh interpreter (see its main): the trained tensors and the
    held-out agreement with the target."""
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="sparkspec-distil-") as tmp:
        npz = Path(tmp) / "head.npz"
        proc = subprocess.run([sys.executable, "-m", "tests.support.distil", str(target),
                               json.dumps(cfg), json.dumps(EAGLE3_AUX_IDS), str(seed), str(steps),
                               str(npz)],
                              cwd=root, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"distilling the EAGLE3 head failed: {proc.stderr.strip()[-2000:]}")
        with np.load(npz) as data:
            tensors = {name: data[name] for name in data.files}
    return tensors, float(json.loads(proc.stdout.strip().splitlines()[-1])["accuracy"])


def write_eagle3_head(out: str | Path, seed: int = 0, steps: int = 400) -> Head:
    """The EAGLE3 head distilled from the tiny target in ``steps`` Adam steps (cached: see the
    module's docstring); ``steps=0`` writes random weights in the same layout, without torch (for
    the unit tests)."""
    out = Path(out)
    target = target_dir(out)
    tcfg = _target_config(target)
    cfg = eagle3_config(tcfg)
    key = _key(f"eagle3-steps{steps}", target, seed)
    if _cached(out, key, cfg):
        return Head(out, key, False, None)
    accuracy = None
    if steps:
        tensors, accuracy = _train_eagle3(target, cfg, seed, steps)
    else:
        rng = np.random.default_rng(seed)
        hid = tcfg["hidden_size"]
        tensors = _random_layer(rng, cfg, "midlayer.", 2 * hid, qk_norm=False) | {
            "midlayer.hidden_norm.weight": np.ones(hid, np.float32),
            "fc.weight": (rng.standard_normal((hid, len(EAGLE3_AUX_IDS) * hid), np.float32)
                          * hid ** -0.5),
            "norm.weight": np.ones(hid, np.float32),
            "lm_head.weight": rng.standard_normal((tcfg["vocab_size"], hid), np.float32) * 0.5,
        }
    _write(out, cfg, tensors, key)
    return Head(out, key, True, accuracy)
