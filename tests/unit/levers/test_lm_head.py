"""The INT8 LM head's torch side (levers/src/sparkspec_levers/lm_head.py): per-row quantization and
the CPU logits against float32 and bf16 references, in this venv's torch (no vLLM, no Triton)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the INT8 LM head tests need torch (requirements.txt)")

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "levers/src"))

from sparkspec_levers import lm_head  # noqa: E402

N, K = 4099, 256  # a vocabulary that is no multiple of any block size
PADDING = 61  # zero rows at the end, as vLLM pads the vocabulary to a multiple of 64 (4099 -> 4160)
TOP1_MIN = 0.90  # top-1 agreement with bf16 on 64 random (flat-logit) states; 61/64 with this seed


def _head(seed: int = 0) -> torch.Tensor:
    """A bf16 head like a real one: std 0.02, a few outlier rows, vLLM's zero padding rows."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N + PADDING, K, generator=gen) * 0.02
    w[:3] *= 10
    w[N:] = 0
    return w.to(torch.bfloat16)


def _states(m: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_quantize_rows_bounds_and_zero_rows() -> None:
    w = _head()
    q, scale = lm_head.quantize_rows(w)
    assert q.dtype == torch.int8 and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    assert (q[N:] == 0).all() and (scale[N:] == 1.0).all()  # padding rows: no division by zero
    assert (q[:N].abs().amax(dim=1) == 127).all()  # each row's absmax maps to +-127
    err = (w.float() - q.float() * scale[:, None]).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()  # round-to-nearest: half a step at most


def test_quantize_rows_chunks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    w = _head()
    whole = lm_head.quantize_rows(w)
    monkeypatch.setattr(lm_head, "CHUNK_ROWS", 1000)
    chunked = lm_head.quantize_rows(w)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(2, 3, dtype=torch.int8)])
def test_quantize_rows_refuses_non_2d_float(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="^quantize_rows: expected a 2-D float weight"):
        lm_head.quantize_rows(bad)


def test_quantize_rows_refuses_nan() -> None:
    w = _head()
    w[5, 7] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        lm_head.quantize_rows(w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 3, 4])
def test_cpu_logits_match_the_dequantized_reference(m: int, dtype: torch.dtype) -> None:
    """Exact up to float32 summation order and the final rounding to x.dtype."""
    q, scale = lm_head.quantize_rows(_head())
    x = _states(m, dtype)
    out = lm_head.int8_logits(x, q, scale)
    assert out.dtype == dtype and out.shape == (m, N + PADDING)
    ref = x.float() @ (q.float() * scale[:, None]).T
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(out.float(), ref, rtol=eps, atol=1e-5)


@pytest.mark.parametrize("m", [1, 3, 4])
def test_cpu_logits_within_the_quantization_bound_of_bf16(m: int) -> None:
    """|x . (w - q * s)| <= sum(|x|) * s / 2 per logit (each weight is off by half a step at
    most), plus the bf16 rounding of both results (one bf16 epsilon of the logit)."""
    w = _head()
    q, scale = lm_head.quantize_rows(w)
    x = _states(m, torch.bfloat16)
    out = lm_head.int8_logits(x, q, scale).float()
    ref = (x @ w.T).float()
    bound = x.float().abs().sum(dim=1, keepdim=True) * scale[None, :] / 2
    bound = bound + torch.finfo(torch.bfloat16).eps * ref.abs() + 1e-6
    assert ((out - ref).abs() <= bound).all()
    # the bound is loose: the typical error is far smaller (random signs)
    assert float((out - ref)[:, :N].abs().mean()) < float(bound[:, :N].mean()) / 10


def test_top1_agrees_with_bf16() -> None:
    w = _head()
    q, scale = lm_head.quantize_rows(w)
    x = _states(64, torch.bfloat16, seed=2)
    top_int8 = lm_head.int8_logits(x, q, scale)[:, :N].argmax(dim=1)
    top_bf16 = (x @ w.T)[:, :N].argmax(dim=1)
    agree = float((top_int8 == top_bf16).float().mean())
    assert agree >= TOP1_MIN, f"top-1 agreement {agree:.3f} < {TOP1_MIN}"


def test_plain_torch_fallback_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch's _weight_int8pack_mm is missing or refuses the inputs, plain torch is used."""
    q, scale = lm_head.quantize_rows(_head())
    x = _states(3, torch.bfloat16)
    packed = lm_head.int8_logits(x, q, scale)

    def refuse(*args: object) -> None:
        raise RuntimeError("no kernel for these inputs")

    monkeypatch.setattr(torch, "_weight_int8pack_mm", refuse, raising=False)
    refused = lm_head.int8_logits(x, q, scale)
    monkeypatch.delattr(torch, "_weight_int8pack_mm", raising=False)
    missing = lm_head.int8_logits(x, q, scale)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(refused.float(), packed.float(), rtol=eps, atol=1e-5)
    assert torch.equal(refused, missing)


def test_zero_rows_leading_dims_and_bias() -> None:
    q, scale = lm_head.quantize_rows(_head())
    empty = lm_head.int8_logits(torch.zeros(0, K, dtype=torch.bfloat16), q, scale)
    assert empty.shape == (0, N + PADDING) and empty.dtype == torch.bfloat16
    x = _states(6, torch.float32)
    flat = lm_head.int8_logits(x, q, scale)
    assert torch.equal(lm_head.int8_logits(x.reshape(2, 3, K), q, scale), flat.reshape(2, 3, -1))
    bias = torch.randn(N + PADDING)
    torch.testing.assert_close(lm_head.int8_logits(x, q, scale, bias), flat + bias)


def test_mismatched_shapes_are_refused() -> None:
    q, scale = lm_head.quantize_rows(_head())
    with pytest.raises(ValueError, match="^int8_logits: .* do not fit"):
        lm_head.int8_logits(torch.zeros(1, K + 1), q, scale)
    with pytest.raises(ValueError, match="^int8_logits: .* do not fit"):
        lm_head.int8_logits(torch.zeros(1, K), q, scale[:-1])


def test_importing_the_package_imports_nothing_heavy() -> None:
    """lm_head imports torch only; gemv (Triton) is imported on the first CUDA call alone."""
    assert "sparkspec_levers.gemv" not in sys.modules
    assert "vllm" not in sys.modules
