"""Benchmark of ``checkpoint assemble`` against ``cp -r`` of the same shards on the same disk.

Generates INT4-like shards (>= size_gb) plus a partial FP8 source (the shared experts, as the ranged fetch
writes it), then times, best of ``repeats``: ``cp -r`` of the INT4 directory and the real CLI's assemble in
a subprocess, each followed by ``sync`` inside the timed span; assemble's peak RSS comes from wait4's rusage
of that subprocess. Not a test: ``invoke bench.checkpoint`` runs it and the README quotes its figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


TARGET_RATIO = 0.9
TARGET_RSS_MIB = 256


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _timed(cmd: list[str]) -> tuple[float, int]:
    """Run ``cmd`` then ``sync``; return (seconds, peak RSS of cmd in KiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}")
    subprocess.run(["sync"], check=True)
    return time.perf_counter() - start, usage.ru_maxrss


def generate(workdir: Path, size_gb: float) -> tuple[Path, Path]:
    from sparkspec import testckpt

    spec = dataclasses.replace(testckpt.spec_for_bytes(int(size_gb * 1e9)), mtp_layers=0)
    int4, fp8 = workdir / "int4", workdir / "fp8"
    testckpt.write_int4_autoround(int4, spec, shards=max(2, round(size_gb)))
    testckpt.write_fp8(fp8, spec, 2, only=lambda name: ".shared_expert." in name)
    subprocess.run(["sync"], check=True)
    return int4, fp8


def run(workdir: str | os.PathLike[str], size_gb: float = 8, repeats: int = 3, keep: bool = False
        ) -> dict[str, Any]:
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # In a child: the parent must stay small, since a spawned child's ru_maxrss starts from the parent's
    int4, fp8 = work / "int4", work / "fp8"
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from sparkspec.ckpt_bench "
                    "import generate; generate(Path(sys.argv[1]), float(sys.argv[2]))", str(work), str(size_gb)],
                   check=True)
    gen_s = time.perf_counter() - t0
    cp_dst, out = work / "cp-copy", work / "hybrid"
    cp_times, asm_times, rss = [], [], []
    assemble = [sys.executable, "-m", "sparkspec.cli", "checkpoint", "assemble", "--int4", str(int4),
                "--fp8", str(fp8), "--out", str(out), "--json"]
    try:
        for i in range(repeats):
            for target in (cp_dst, out):
                shutil.rmtree(target, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            for which in (("cp", "assemble") if i % 2 == 0 else ("assemble", "cp")):  # alternate order
                if which == "cp":
                    cp_times.append(_timed(["cp", "-r", str(int4), str(cp_dst)])[0])
                else:
                    seconds, peak = _timed(assemble)
                    asm_times.append(seconds)
                    rss.append(peak)
        cp_bytes, asm_bytes = _dir_bytes(cp_dst), _dir_bytes(out)
    finally:
        if not keep:
            for target in (cp_dst, out, int4, fp8):
                shutil.rmtree(target, ignore_errors=True)
    cp_rate, asm_rate = cp_bytes / min(cp_times), asm_bytes / min(asm_times)
    result = {
        "size_gb": size_gb, "repeats": repeats, "generate_s": round(gen_s, 1),
        "cp_bytes": cp_bytes, "assemble_bytes": asm_bytes,
        "cp_s": [round(t, 2) for t in cp_times], "assemble_s": [round(t, 2) for t in asm_times],
        "cp_best_s": round(min(cp_times), 2), "assemble_best_s": round(min(asm_times), 2),
        "cp_GBps": round(cp_rate / 1e9, 3), "assemble_GBps": round(asm_rate / 1e9, 3),
        "ratio": round(asm_rate / cp_rate, 3), "peak_rss_mib": round(max(rss) / 1024, 1),
        "target_ratio": TARGET_RATIO, "target_rss_mib": TARGET_RSS_MIB,
    }
    result["ok"] = result["ratio"] >= TARGET_RATIO and result["peak_rss_mib"] <= TARGET_RSS_MIB
    _print_table(result)
    return result


def _print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoint assemble vs cp -r ({r['cp_bytes'] / 1e9:.2f} GB, best of {r['repeats']}, "
                        "timed to sync)")
    for col in ("", "best s", "all s", "GB/s", "peak RSS MiB"):
        table.add_column(col)
    table.add_row("cp -r", f"{r['cp_best_s']}", ", ".join(map(str, r["cp_s"])), f"{r['cp_GBps']}", "")
    table.add_row("assemble", f"{r['assemble_best_s']}", ", ".join(map(str, r["assemble_s"])),
                  f"{r['assemble_GBps']}", f"{r['peak_rss_mib']}")
    table.caption = (f"throughput ratio assemble/cp = {r['ratio']} (target >= {TARGET_RATIO}); "
                     f"RSS target <= {TARGET_RSS_MIB} MiB: {'OK' if r['ok'] else 'MISSED'}")
    Console(stderr=True).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--size-gb", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.workdir, args.size_gb, args.repeats, args.keep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
