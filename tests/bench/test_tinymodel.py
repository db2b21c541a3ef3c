"""The tiny model: same bytes for the same seed, a valid bf16 safetensors Qwen3 checkpoint, a
working tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from tests.support import tinymodel

from .conftest import Cli

FILES = ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json",
         "special_tokens_map.json", "generation_config.json")


def test_same_seed_same_bytes_other_seed_other_weights(tiny_model: Path, tmp_path: Path) -> None:
    again = tinymodel.write_tiny_model(tmp_path / "again", seed=0)
    other = tinymodel.write_tiny_model(tmp_path / "other", seed=1)
    for name in FILES:
        assert (again.path / name).read_bytes() == (tiny_model / name).read_bytes(), name
    assert ((other.path / "model.safetensors").read_bytes()
            != (tiny_model / "model.safetensors").read_bytes())
    assert ((other.path / "tokenizer.json").read_bytes()
            == (tiny_model / "tokenizer.json").read_bytes())


def test_checkpoint_matches_its_config(tiny_model: Path) -> None:
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["torch_dtype"] == "bfloat16"
    header_len = int.from_bytes((tiny_model / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((tiny_model / "model.safetensors").read_bytes()[8:8 + header_len])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    h, hd, v = config["hidden_size"], config["head_dim"], config["vocab_size"]
    shapes = {k: tuple(t["shape"]) for k, t in header.items() if k != "__metadata__"}
    assert shapes["model.embed_tokens.weight"] == (v, h)
    assert shapes["lm_head.weight"] == (v, h)
    for n in range(config["num_hidden_layers"]):
        assert shapes[f"model.layers.{n}.self_attn.q_proj.weight"] == (
            config["num_attention_heads"] * hd, h)
        assert shapes[f"model.layers.{n}.self_attn.k_proj.weight"] == (
            config["num_key_value_heads"] * hd, h)
        assert shapes[f"model.layers.{n}.self_attn.k_norm.weight"] == (hd,)
        assert shapes[f"model.layers.{n}.mlp.down_proj.weight"] == (h, config["intermediate_size"])
    assert len(shapes) == 3 + 11 * config["num_hidden_layers"]


def test_bf16_bytes_are_the_high_half_of_float32() -> None:
    values = np.array([1.0, -2.5, 3.140625, 0.0], np.float32)
    raw = tinymodel._bf16(values)
    back = (np.frombuffer(raw, "<u2").astype("<u4") << 16).view("<f4")
    assert back.tolist() == [1.0, -2.5, 3.140625, 0.0]


def test_weights_load_with_the_safetensors_library(tiny_model: Path) -> None:
    pytest.importorskip("torch")
    from safetensors.torch import load_file as load_torch

    tensors = load_torch(str(tiny_model / "model.safetensors"))
    norm = tensors["model.norm.weight"].float()
    assert str(tensors["lm_head.weight"].dtype) == "torch.bfloat16"
    assert norm.eq(1.0).all()
    # numpy has no bfloat16: the file really is bf16
    with pytest.raises(TypeError, match="bfloat16"):
        load_file(str(tiny_model / "model.safetensors"))


def test_tokenizer_and_chat_template(tiny_model: Path) -> None:
    tok = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert tok.get_vocab_size() == 512
    text = "def fibonacci(n):\n    return {\"a\": 1}  # ünïcode"
    assert tok.decode(tok.encode(text).ids) == text
    cfg = json.loads((tiny_model / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(cfg["chat_template"])
    messages = [{"role": "user", "content": "Hi"}]
    off = template.render(messages=messages, add_generation_prompt=True, enable_thinking=False)
    on = template.render(messages=messages, add_generation_prompt=True)
    assert off == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(off).ids
    assert tok.token_to_id("<|im_start|>") in ids and tok.token_to_id("</think>") in ids
    generation = json.loads((tiny_model / "generation_config.json").read_text())
    assert tok.token_to_id(cfg["eos_token"]) in generation["eos_token_id"]


def test_cli_reports_changed_only_when_bytes_change(tmp_path: Path, dev_cli: Cli) -> None:
    first = dev_cli("model", "tiny", "--out", str(tmp_path / "m"), "--json")
    second = dev_cli("model", "tiny", "--out", str(tmp_path / "m"), "--json")
    assert first.returncode == 0 and json.loads(first.stdout.splitlines()[-1])["changed"] is True
    assert second.returncode == 0 and json.loads(second.stdout.splitlines()[-1])["changed"] is False
    bad = dev_cli("model", "tiny", "--out", str(tmp_path / "m" / "config.json"))
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "not a directory" in bad.stderr
