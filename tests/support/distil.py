"""Distil the EAGLE3 head from the tiny Qwen3 target, in torch on CPU (tests/support/heads.py caches
the result).

``Target`` is the tiny Qwen3's forward as vLLM computes it (vllm/model_executor/models/qwen3.py:
RMSNorm, q/k per-head norms, neox RoPE, grouped-query causal attention, SiLU MLP) and returns the
aux hidden states vLLM hands to an EAGLE3 drafter: aux id i is ``hidden + residual`` at the input of
layer i (id 0: the embeddings; id L: after the last layer), as ``_maybe_add_hidden_state`` collects
them. ``eagle3_forward`` is the first draft step of vllm/model_executor/models/llama_eagle3.py: at
position t the head reads the next token x[t+1] and ``fc`` of the target's aux states at t, and must
predict the target's greedy token after x[t+1].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from sparkspec.checkpoint.safetensors_io import read_header

EPS = 1e-6


def load_bf16(path: Path) -> dict[str, Tensor]:
    """The BF16 tensors of a safetensors file as float32 torch tensors."""
    header = read_header(path)
    data = path.read_bytes()[header.data_start:]
    out = {}
    for name, info in header.tensors.items():
        if info.dtype != "BF16":
            raise ValueError(f"{path}: {name} is {info.dtype}, expected BF16")
        raw = np.frombuffer(data[info.begin:info.end], dtype="<u2").astype("<u4") << 16
        out[name] = torch.from_numpy(raw.view("<f4").reshape(info.shape).copy())
    return out


def rms(x: Tensor, weight: Tensor) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Neox-style rotary embedding of x (batch, heads, seq, head_dim)."""
    half = x.shape[-1] // 2
    inv = 1.0 / theta ** (torch.arange(0, half, dtype=torch.float32) / half)
    angles = positions[:, None].float() * inv[None, :]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(x: Tensor, w: dict[str, Tensor], p: str, cfg: dict[str, Any],
              qk_norm: bool) -> Tensor:
    b, s, _ = x.shape
    hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = (x @ w[p + "q_proj.weight"].T).view(b, s, nh, hd)
    k = (x @ w[p + "k_proj.weight"].T).view(b, s, nkv, hd)
    v = (x @ w[p + "v_proj.weight"].T).view(b, s, nkv, hd)
    if qk_norm:
        q, k = rms(q, w[p + "q_norm.weight"]), rms(k, w[p + "k_norm.weight"])
    pos = torch.arange(s)
    q = rope(q.transpose(1, 2), pos, cfg["rope_theta"])
    k = rope(k.transpose(1, 2), pos, cfg["rope_theta"]).repeat_interleave(nh // nkv, dim=1)
    v = v.transpose(1, 2).repeat_interleave(nh // nkv, dim=1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(b, s, nh * hd) @ w[p + "o_proj.weight"].T


def mlp(x: Tensor, w: dict[str, Tensor], p: str) -> Tensor:
    gate = torch.nn.functional.silu(x @ w[p + "gate_proj.weight"].T)
    return (gate * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


class Target:
    def __init__(self, folder: Path, cfg: dict[str, Any]) -> None:
        self.w = load_bf16(folder / "model.safetensors")
        self.cfg = cfg

    @torch.no_grad()
    def forward(self, ids: Tensor, aux_ids: list[int]) -> tuple[Tensor, Tensor]:
        """(logits, aux states concatenated in ``aux_ids`` order) for token ids (batch, seq)."""
        w, h = self.w, self.w["model.embed_tokens.weight"][ids]
        aux = {0: h}
        for n in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{n}."
            h = h + attention(rms(h, w[p + "input_layernorm.weight"]), w, p + "self_attn.",
                              self.cfg, True)
            h = h + mlp(rms(h, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
            aux[n + 1] = h
        logits = rms(h, w["model.norm.weight"]) @ w["lm_head.weight"].T
        return logits, torch.cat([aux[i] for i in aux_ids], dim=-1)

    def greedy(self, prompt: Tensor, new: int) -> Tensor:
        ids = prompt
        for _ in range(new):
            logits, _ = self.forward(ids, [0])
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids


def eagle3_forward(w: dict[str, Tensor], cfg: dict[str, Any], next_ids: Tensor, aux: Tensor,
                   embed: Tensor) -> Tensor:
    """Logits of the head's first draft step (llama_eagle3.py, layer 0, norm_after_residual, no fc
    norms)."""
    p = "midlayer."
    hidden = aux @ w["fc.weight"].T
    residual = hidden
    x = torch.cat([rms(embed[next_ids], w[p + "input_layernorm.weight"]),
                   rms(hidden, w[p + "hidden_norm.weight"])], dim=-1)
    residual = residual + attention(x, w, p + "self_attn.", cfg, False)
    out = mlp(rms(residual, w[p + "post_attention_layernorm.weight"]), w, p + "mlp.")
    return rms(out + residual, w["norm.weight"]) @ w["lm_head.weight"].T


def _dataset(target: Target, aux_ids: list[int],
             gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """(next tokens, aux states, labels) for random prompts continued by the target's greedy
    decoding."""
    vocab = target.cfg["vocab_size"]
    prompts = torch.randint(0, vocab, (256, 12), generator=gen)
    ids = target.greedy(prompts, 36)
    logits, aux = target.forward(ids, aux_ids)
    greedy = logits.argmax(-1)
    # position t: head input x[t+1] with aux[t]; label = the target's token after x[t+1]
    return ids[:, 1:], aux[:, :-1], greedy[:, 1:]


def train_eagle3(target_folder: Path, cfg: dict[str, Any], aux_ids: list[int], seed: int,
                 steps: int) -> tuple[dict[str, np.ndarray], float]:
    """Trained head tensors (float32, checkpoint names) and the held-out top-1 agreement with the
    target."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    target = Target(target_folder, json.loads((target_folder / "config.json").read_text()))
    next_ids, aux, labels = _dataset(target, aux_ids, gen)
    held = 32
    hid, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q_out, kv_out = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def param(*shape: int, scale: float | None = None) -> Tensor:
        t = torch.ones(shape) if scale is None else torch.randn(shape, generator=gen) * scale
        return t.requires_grad_()

    p = "midlayer."
    w = {
        "fc.weight": param(hid, hid * len(aux_ids), scale=(hid * len(aux_ids)) ** -0.5),
        p + "input_layernorm.weight": param(hid), p + "hidden_norm.weight": param(hid),
        p + "post_attention_layernorm.weight": param(hid), "norm.weight": param(hid),
        p + "self_attn.q_proj.weight": param(q_out, 2 * hid, scale=(2 * hid) ** -0.5),
        p + "self_attn.k_proj.weight": param(kv_out, 2 * hid, scale=(2 * hid) ** -0.5),
        p + "self_attn.v_proj.weight": param(kv_out, 2 * hid, scale=(2 * hid) ** -0.5),
        p + "self_attn.o_proj.weight": param(hid, q_out, scale=q_out ** -0.5 * 0.1),
        p + "mlp.gate_proj.weight": param(inter, hid, scale=hid ** -0.5),
        p + "mlp.up_proj.weight": param(inter, hid, scale=hid ** -0.5),
        p + "mlp.down_proj.weight": param(hid, inter, scale=inter ** -0.5 * 0.1),
        "lm_head.weight": target.w["lm_head.weight"].clone().requires_grad_(),
    }
    embed = target.w["model.embed_tokens.weight"]
    opt = torch.optim.Adam(w.values(), lr=3e-3)
    n_train = next_ids.shape[0] - held
    for _step in range(steps):
        batch = torch.randint(0, n_train, (32,), generator=gen)
        logits = eagle3_forward(w, cfg, next_ids[batch], aux[batch], embed)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[batch].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        pred = eagle3_forward(w, cfg, next_ids[n_train:], aux[n_train:], embed).argmax(-1)
        accuracy = float((pred == labels[n_train:]).float().mean())
    tensors = {name: t.detach().numpy().astype(np.float32) for name, t in w.items()}
    tensors["embed_tokens.weight"] = embed.numpy().copy()
    return tensors, accuracy


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.support.distil TARGET CFG_JSON AUX_IDS_JSON SEED STEPS OUT_NPZ``: train in
    a fresh interpreter (heads.write_eagle3_head runs it so): torch's compiler machinery, which Adam
    imports, fails in a process where Ansible has patched sys.intern (a pytest session that ran a
    play or read an inventory)."""
    import sys

    target, cfg, aux, seed, steps, out = (argv if argv is not None else sys.argv[1:])
    tensors, accuracy = train_eagle3(Path(target), json.loads(cfg), json.loads(aux), int(seed),
                                     int(steps))
    np.savez(out, **tensors)
    print(json.dumps({"accuracy": accuracy}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
