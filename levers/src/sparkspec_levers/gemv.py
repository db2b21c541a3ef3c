"""Triton kernel of the weight-only LM head: INT8 or FP8 e4m3 weights, float32 per-row scales.

A program loads its weight tile once per K chunk and multiplies it against all rows (tl.dot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per program: tl.dot's smallest M; a decode step has 1 to ~9 rows
PLAIN_BLOCKS = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}  # untuned launch

WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn)
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _config(block_n: int, block_k: int, warps: int, stages: int) -> triton.Config:
    blocks = {"BLOCK_N": block_n, "BLOCK_K": block_k}
    return triton.Config(blocks, num_warps=warps, num_stages=stages)


# Autotuned over these. One BLOCK_K for every config: each logit then sums its K chunks in one
# order whichever config the autotuner picks in a process (bitwise equal on an H100), so two starts
# of the same model give the same greedy output (the lossless check compares two starts). 256 won
# on an H100 (docs/measurements.md); a config a card's shared memory cannot hold is skipped.
BLOCK_K_FIXED = 256
CONFIGS = [
    _config(32, BLOCK_K_FIXED, 4, 3),
    _config(64, BLOCK_K_FIXED, 4, 2),
    _config(64, BLOCK_K_FIXED, 4, 3),
    _config(64, BLOCK_K_FIXED, 8, 3),
    _config(128, BLOCK_K_FIXED, 4, 2),
    _config(128, BLOCK_K_FIXED, 8, 2),
    _config(128, BLOCK_K_FIXED, 8, 3),
    _config(256, BLOCK_K_FIXED, 8, 2),
]


@triton.jit(do_not_specialize=["M"])  # one compile for every row count
def _wo_logits_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K,  # type: ignore[no-untyped-def]
                      stride_xm, stride_wn, stride_om,
                      HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr, EVEN_K: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Axis 0 walks the row blocks (one below 17 rows): the programs that share a weight tile
    # run side by side and re-read it from L2. Axis 1 walks the vocabulary.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    # the weight tile as [BLOCK_K, BLOCK_N]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[None, :])  # columns past N are never stored
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :])
            w = tl.where(k_ok[:, None], w, tl.zeros_like(w))  # FP8 bits past K may be NaN
        if DOT_F32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w.to(x.dtype), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_even_k = triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
_plain_kernel = _even_k(_wo_logits_kernel)
_tuned_kernel = triton.autotune(configs=CONFIGS, key=["N", "K"])(_even_k(_wo_logits_kernel))


def wo_logits(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None = None, *, autotune: bool = True) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] * scale[:, None]).T (+ bias) -> [M, N] in x.dtype.

    weight: int8 or float8_e4m3fn; scale: float32 [N]; float32 accumulation. autotune=False
    launches PLAIN_BLOCKS (the TRITON_INTERPRET=1 tests: autotuning there is slow).
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"wo_logits: x {list(x.shape)} and weight {list(weight.shape)} do not fit")
    if x.dtype not in ACT_DTYPES or weight.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"wo_logits: unsupported dtypes x {x.dtype}, weight {weight.dtype}")
    m, k = x.shape
    n = weight.shape[0]
    if scale.shape != (n,):
        raise ValueError(f"wo_logits: scale {list(scale.shape)} does not fit weight "
                         f"{list(weight.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    scale = scale.to(torch.float32).contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if bias is not None:
        bias = bias.contiguous()
    args = (x, weight, scale, bias if bias is not None else scale, out, m, n, k,
            x.stride(0), weight.stride(0), out.stride(0))
    # A float32 dot (IEEE) for float32 rows, and for CPU tensors, i.e. under TRITON_INTERPRET=1:
    # its numpy emulation keeps bf16 as raw uint16 (a bf16 dot or int8 -> bf16 cast is garbage).
    dot_f32 = x.dtype == torch.float32 or not x.is_cuda
    flags = {"HAS_BIAS": bias is not None, "DOT_F32": dot_f32, "BLOCK_M": BLOCK_M}

    def grid(meta: dict[str, int]) -> tuple[int, int]:
        return triton.cdiv(m, BLOCK_M), triton.cdiv(n, meta["BLOCK_N"])

    if autotune:
        _tuned_kernel[grid](*args, **flags)
    else:
        _plain_kernel[grid](*args, **flags, **PLAIN_BLOCKS)
    return out


def quantize_rows_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 e4m3 weights for wo_logits: scale = absmax / 448 (1.0 for a zero row)."""
    fmax = torch.finfo(torch.float8_e4m3fn).max
    qweight = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
    scale = torch.empty((weight.shape[0],), dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], 16384):  # bounds the float32 temporary
        rows = weight[start:start + 16384].float()
        row_scale = rows.abs().amax(dim=1) / fmax
        row_scale = torch.where(row_scale > 0, row_scale, torch.ones_like(row_scale))
        qweight[start:start + 16384] = (rows / row_scale[:, None]).clamp_(-fmax, fmax).to(
            torch.float8_e4m3fn)
        scale[start:start + 16384] = row_scale
    return qweight, scale
