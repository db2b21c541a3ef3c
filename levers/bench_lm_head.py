"""Time the LM head at Qwen3.5-122B's shape [248320, 3072]: bf16, INT8 and FP8 Triton, _scaled_mm.
Each figure: the median, min and max of do_bench's timed calls (L2 flushed between them).

python levers/bench_lm_head.py --out results.json (torch, Triton, CUDA; no vLLM, no network);
--dry-run checks the script on CPU at a tiny shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))

import torch  # noqa: E402

from sparkspec_levers import lm_head  # noqa: E402

VOCAB, HIDDEN = 248320, 3072  # Qwen3.5-122B-A10B's head
DRY_VOCAB, DRY_HIDDEN = 1000, 256
WEIGHT_STD = 0.02  # like a trained head; hidden states std 1
FP8_MAX = 448.0
CHECK_ROWS = 8192  # vocabulary rows checked against each kernel's own dequantized weights


def fail(message: str, code: int = 2) -> None:
    print(f"bench_lm_head: {message}", file=sys.stderr)
    raise SystemExit(code)


def rows_arg(text: str) -> list[int]:
    try:
        rows = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of row counts: {text!r}") \
            from None
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be >= 1: {text!r}")
    return rows


def timer(device: torch.device) -> Callable[[Callable[[], Any]], list[float]]:
    """Milliseconds of each timed call: triton's do_bench on CUDA (it flushes L2 between runs)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: [float(t) for t in do_bench(fn, warmup=50, rep=300, return_mode="all")]

    def cpu(fn: Callable[[], Any]) -> list[float]:
        for _ in range(3):
            fn()
        runs = []
        for _ in range(20):
            start = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - start) * 1e3)
        return runs

    return cpu


def fp8_rows(x: torch.Tensor, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 activations and float32 scales [M, 1], rows padded with zeros to pad_to."""
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    xq = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    extra = -x.shape[0] % pad_to
    if extra:
        xq = torch.cat([xq, xq.new_zeros((extra, x.shape[1]))])
        scale = torch.cat([scale, scale.new_ones((extra, 1))])
    return xq, scale


class Methods:
    """The head in each format, and each method's logits for rows x (skipped ones: .skipped)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w
        self.skipped: dict[str, str] = {}
        self.q, self.s = lm_head.quantize_rows(w)
        self.gemv = lm_head._triton_gemv() if w.is_cuda else None
        if w.is_cuda and self.gemv is None:
            fail("Triton cannot be imported; the INT8 kernel needs it")
        self.fq: torch.Tensor | None = None
        self.fs: torch.Tensor | None = None
        self.mm_pad = 1
        if not w.is_cuda:
            for name in ("fp8_triton", "fp8_scaled_mm", "fp8_scaled_mm_gemm_only"):
                self.skipped[name] = "needs CUDA (dry run on CPU)"
        elif torch.cuda.get_device_capability(w.device) < (8, 9):
            for name in ("fp8_triton", "fp8_scaled_mm", "fp8_scaled_mm_gemm_only"):
                self.skipped[name] = "the card has no FP8 (compute capability below 8.9)"
        else:
            assert self.gemv is not None
            self.fq, self.fs = self.gemv.quantize_rows_fp8(w)
            self._probe_scaled_mm()

    def _probe_scaled_mm(self) -> None:
        x = torch.randn(3, self.w.shape[1], device=self.w.device, dtype=self.w.dtype)
        for pad in (1, 16):
            try:
                self.mm_pad = pad
                self.scaled_mm(*fp8_rows(x, pad))
                return
            except RuntimeError as exc:
                reason = str(exc).strip().splitlines()[0][:200]
        for name in ("fp8_scaled_mm", "fp8_scaled_mm_gemm_only"):
            self.skipped[name] = f"torch._scaled_mm refused rowwise FP8: {reason}"

    def scaled_mm(self, xq: torch.Tensor, sa: torch.Tensor) -> torch.Tensor:
        assert self.fq is not None and self.fs is not None
        return torch._scaled_mm(xq, self.fq.t(), scale_a=sa, scale_b=self.fs.view(1, -1),
                                out_dtype=torch.bfloat16)

    def calls(self, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
        """name -> a no-argument call computing logits for x."""
        w, q, s = self.w, self.q, self.s
        out: dict[str, Callable[[], Any]] = {"bf16": lambda: x @ w.T}
        if self.gemv is not None:
            gemv = self.gemv
            out["int8_triton"] = lambda: gemv.wo_logits(x, q, s)
        else:
            out["int8_cpu"] = lambda: lm_head.int8_logits(x, q, s)
        if "fp8_triton" not in self.skipped:
            assert self.gemv is not None and self.fq is not None and self.fs is not None
            gemv, fq, fs = self.gemv, self.fq, self.fs
            out["fp8_triton"] = lambda: gemv.wo_logits(x, fq, fs)
        if "fp8_scaled_mm" not in self.skipped:
            m, pad = x.shape[0], self.mm_pad
            out["fp8_scaled_mm"] = lambda: self.scaled_mm(*fp8_rows(x, pad))[:m]
            xq, sa = fp8_rows(x, pad)
            out["fp8_scaled_mm_gemm_only"] = lambda: self.scaled_mm(xq, sa)
        return out

    def weight_bytes(self, name: str) -> int:
        n, k = self.w.shape
        return n * k * 2 if name == "bf16" else n * k + n * 4  # one-byte weights + float32 scales


def copy_bandwidth(device: torch.device, measure: Callable[[Callable[[], Any]], float],
                   nbytes: int) -> float:
    """GB/s of a device-to-device copy, counting the bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = statistics.median(measure(lambda: dst.copy_(src)))
    return 2 * nbytes / ms / 1e6


def dequantized(methods: Methods, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The weights and scales a weight-only kernel multiplies by; None for bf16, _scaled_mm."""
    if name.startswith("int8"):
        return methods.q, methods.s
    if name == "fp8_triton" and methods.fq is not None and methods.fs is not None:
        return methods.fq, methods.fs
    return None


def top1(methods: Methods, states: int, seed: int) -> dict[str, dict[str, float]]:
    """Each method's argmax agreement with bf16 and its logit error; for the weight-only kernels
    also the error against their own dequantized weights (over the first CHECK_ROWS rows)."""
    gen = torch.Generator(device=methods.w.device).manual_seed(seed)
    x = torch.randn(states, methods.w.shape[1], generator=gen, device=methods.w.device)
    x = x.to(methods.w.dtype)
    calls = methods.calls(x)
    ref = calls.pop("bf16")().float()
    calls.pop("fp8_scaled_mm_gemm_only", None)
    found = {}
    for name, call in calls.items():
        got = call().float()
        err = (got - ref).abs()
        found[name] = {"agreement": float((got.argmax(1) == ref.argmax(1)).float().mean()),
                       "max_abs_err": float(err.max()), "mean_abs_err": float(err.mean())}
        weights = dequantized(methods, name)
        if weights is not None:
            q, s = weights[0][:CHECK_ROWS], weights[1][:CHECK_ROWS]
            own = x.float() @ (q.float() * s[:, None]).T
            # one rounding to bf16 at the end: at most one bf16 epsilon of the logit
            bound = torch.finfo(torch.bfloat16).eps * own.abs() + 1e-4
            found[name]["kernel_err_vs_bound"] = float(((got[:, :CHECK_ROWS] - own).abs()
                                                        / bound).max())
    return found


def autotuned(methods: Methods) -> dict[str, str]:
    """The config the autotuner chose per key (N, K and the argument dtypes)."""
    cache = getattr(methods.gemv._tuned_kernel, "cache", {}) if methods.gemv is not None else {}
    return {", ".join(map(str, key)): str(config) for key, config in cache.items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    dry = bool(args.dry_run)
    if not dry and not torch.cuda.is_available():
        fail("no CUDA device (use --dry-run to check the script on CPU)")
    device = torch.device("cpu" if dry else "cuda")
    n, k = (DRY_VOCAB, DRY_HIDDEN) if dry else (VOCAB, HIDDEN)
    torch.manual_seed(0)
    w = (torch.randn(n, k, device=device, dtype=torch.bfloat16) * WEIGHT_STD).contiguous()
    methods = Methods(w)
    measure = timer(device)
    copy_gbs = copy_bandwidth(device, measure, (64 << 20) if dry else (2 << 30))
    results: list[dict[str, Any]] = []
    for m in args.rows:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        calls = methods.calls(x)
        for call in calls.values():
            call()  # warm up: the Triton kernels autotune on their first call
        base = None
        for name, call in calls.items():
            runs = measure(call)
            ms = statistics.median(runs)
            base = ms if name == "bf16" else base
            gbs = methods.weight_bytes(name) / ms / 1e6
            results.append({"method": name, "m": m, "ms": ms, "ms_min": min(runs),
                            "ms_max": max(runs), "runs": len(runs), "gbs": gbs,
                            "ratio_to_bf16": ms / base if base else None,
                            "fraction_of_copy": gbs / copy_gbs})
    import importlib.util

    triton_version = None
    if importlib.util.find_spec("triton") is not None:
        import triton

        triton_version = triton.__version__
    return {
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device)))
        if device.type == "cuda" else None,
        "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
        "dry_run": dry, "shape": [n, k], "rows": args.rows, "weight_std": WEIGHT_STD,
        "bandwidth_counts": "weight + scale bytes read per call (activations and logits left out)",
        "copy_gbs": copy_gbs, "results": results, "skipped": methods.skipped,
        "autotuned": autotuned(methods),
        "top1_states": args.states, "top1": top1(methods, args.states, seed=1),
    }


def table(report: dict[str, Any]) -> str:
    lines = [f"{report['card']}  torch {report['torch']}  triton {report['triton']}  "
             f"head {report['shape']}  copy {report['copy_gbs']:.0f} GB/s (read + write)",
             f"{'method':<25}{'rows':>5}{'ms (median)':>12}{'min-max':>16}{'GB/s':>7}{'x bf16':>8}"
             f"{'of copy':>9}"]
    for r in report["results"]:
        ratio = f"{r['ratio_to_bf16']:.3f}" if r["ratio_to_bf16"] is not None else "-"
        spread = f"{r['ms_min']:.4f}-{r['ms_max']:.4f}"
        lines.append(f"{r['method']:<25}{r['m']:>5}{r['ms']:>12.4f}{spread:>16}{r['gbs']:>7.0f}{ratio:>8}"
                     f"{r['fraction_of_copy']:>9.2f}")
    for name, reason in report["skipped"].items():
        lines.append(f"skipped {name}: {reason}")
    for name, t in report["top1"].items():
        own = t.get("kernel_err_vs_bound")
        lines.append(f"top-1 vs bf16, {name}: {t['agreement']:.3f} of {report['top1_states']} "
                     f"states (max |err| {t['max_abs_err']:.4f}, mean {t['mean_abs_err']:.5f})"
                     + (f"; vs its own dequantized weights {own:.2f} of the bound" if own else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--rows", type=rows_arg, default=[1, 3, 4, 8],
                        help="row counts (hidden states per call), comma-separated")
    parser.add_argument("--states", type=int, default=256, help="random states for top-1")
    parser.add_argument("--dry-run", action="store_true",
                        help=f"CPU, head [{DRY_VOCAB}, {DRY_HIDDEN}]: checks the script only")
    args = parser.parse_args(argv)
    if args.states < 1:
        parser.error("--states must be >= 1")
    if args.out is not None and not args.out.parent.is_dir():
        fail(f"--out: no folder {args.out.parent}")
    report = run(args)
    print(table(report))
    if args.out is not None:
        try:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        except OSError as exc:
            fail(f"cannot write {args.out}: {exc.strerror}", 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
