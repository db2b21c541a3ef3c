"""INT8 weight-only LM head: symmetric per-row quantization and the logits product.

Pure torch; on CUDA the Triton kernel of gemv.py does the product when Triton can be imported.
"""

from __future__ import annotations

from types import ModuleType

import torch

QMAX = 127
# Rows quantized at a time: bounds the float32 temporary (16384 x 3072 x 4 bytes = 200 MB).
CHUNK_ROWS = 16384

_gemv: ModuleType | None = None
_gemv_tried = False


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row: scale = absmax / 127 (1.0 for an all-zero row), q = round(w / scale).

    Returns (qweight int8 [N, K] in [-127, 127], scale float32 [N]) on the weight's device.
    """
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize_rows: expected a 2-D float weight, got {weight.dtype} "
                         f"{list(weight.shape)}")
    n, k = weight.shape
    qweight = torch.empty((n, k), dtype=torch.int8, device=weight.device)
    scale = torch.empty((n,), dtype=torch.float32, device=weight.device)
    for start in range(0, n, CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, n)
        rows = weight[start:stop].float()
        absmax = rows.abs().amax(dim=1) if k else rows.new_zeros(stop - start)
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError(f"quantize_rows: rows {start}..{stop - 1} hold inf or NaN")
        row_scale = absmax / QMAX
        row_scale = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
        q = torch.round(rows / row_scale[:, None]).clamp_(-QMAX, QMAX)
        qweight[start:stop] = q.to(torch.int8)
        scale[start:stop] = row_scale
    return qweight, scale


def _triton_gemv() -> ModuleType | None:
    """gemv.py, imported once, or None when Triton is not installed."""
    global _gemv, _gemv_tried
    if not _gemv_tried:
        _gemv_tried = True
        try:
            from . import gemv

            _gemv = gemv
        except ImportError:
            _gemv = None
    return _gemv


def _cpu_logits(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [M, N]: torch's int8 weight-only matmul where it takes the inputs, else plain."""
    xf = x.float().contiguous()
    sf = scale.float().contiguous()
    mm = getattr(torch, "_weight_int8pack_mm", None)
    if mm is not None:
        try:
            out: torch.Tensor = mm(xf, qweight.contiguous(), sf)
            return out
        except (RuntimeError, NotImplementedError):
            pass
    return _torch_logits(xf, qweight, sf)


def _torch_logits(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() @ qweight.float().T) * scale.float()


def int8_logits(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16, fp16 or fp32) @ (qweight * scale[:, None]).T (+ bias), in x.dtype.

    CUDA with Triton: the Triton kernel (float32 accumulation). CPU: torch's _weight_int8pack_mm
    in float32 where it takes the inputs, else (x.float() @ qweight.float().T) * scale.
    """
    n, k = qweight.shape
    if x.shape[-1] != k or scale.shape != (n,):
        raise ValueError(f"int8_logits: x {list(x.shape)}, qweight {list(qweight.shape)} and "
                         f"scale {list(scale.shape)} do not fit")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] == 0:
        return x.new_empty((*lead, n))
    if x2.is_cuda and (gemv := _triton_gemv()) is not None:
        logits: torch.Tensor = gemv.wo_logits(x2, qweight, scale, bias)
        return logits.reshape(*lead, n)
    if x2.device.type == "cpu":
        out = _cpu_logits(x2, qweight, scale)
    else:
        out = _torch_logits(x2, qweight, scale)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, n)
