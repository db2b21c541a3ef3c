"""Benchmark of ``checkpoint assemble`` against ``cp -r`` of the same shards on the same disk.

Generates INT4-like shards (>= size_gb) plus a partial FP8 source (the shared experts, as the ranged
fetch writes it), then runs ``cp -r`` of the INT4 folder and the real CLI's assemble in
subprocesses, ``repeats`` times each, alternating which goes first. Each run starts after a ``sync``
(nobody pays for the previous run's writeback) and is timed until its output is on disk: the
command, then an fsync of every file it wrote and of its folders (the part of ``sync`` that concerns
it; other writers on a shared machine do not count). Peak RSS of each command comes from wait4's
rusage. The ratio compares throughputs (bytes written per second, best run of each; assemble writes
fewer bytes than cp copies, as the FP8 layers replace INT4 ones), and its spread over the pairs (run
i of each). ``--keep`` leaves the shards; ``--one cp|assemble`` then makes one run of one command on
them (the previous output removed first), for a harness that pairs whole processes. Not a test:
``invoke bench.checkpoint`` runs it and docs/measurements.md quotes its figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sparkspec.argtypes import positive_float, positive_int

REPO = Path(__file__).resolve().parents[2]  # where `tests.support` imports from

TARGET_RATIO = 1.0  # assemble's throughput against cp -r, best of N each: never slower than cp
TARGET_RSS_MIB = 128
FICLONE = 0x40049409  # linux/fs.h: share extents (a reflink)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder (deepest first), then root's parent."""
    folders = [root]
    for path in sorted(root.rglob("*")):
        if path.is_dir():
            folders.append(path)
        elif path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for folder in [*reversed(folders), root.parent]:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _timed(cmd: list[str], out: Path) -> tuple[float, int]:
    """Run ``cmd``, then fsync what it wrote under ``out``; return (seconds, peak RSS of cmd in
    KiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}")
    _fsync_tree(out)
    return time.perf_counter() - start, usage.ru_maxrss


def reflinks(folder: Path) -> bool:
    """Whether the filesystem of ``folder`` shares extents on copy (btrfs, XFS, ...), as ``cp`` then
    does."""
    a, b = folder / ".reflink-probe-a", folder / ".reflink-probe-b"
    a.write_bytes(b"\0" * 4096)
    try:
        with open(a, "rb") as src, open(b, "wb") as dst:
            fcntl.ioctl(dst.fileno(), FICLONE, src.fileno())
        return True
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOTTY, errno.EINVAL, errno.EXDEV, errno.ENOSYS):
            return False
        raise
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


def _fs_type(folder: Path) -> str:
    """The type of the filesystem holding ``folder`` (longest mount point that contains it)."""
    real, best, kind = str(folder.resolve()), "", "?"
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1].replace("\\040", " ")
            if (real == point or real.startswith(point.rstrip("/") + "/")) \
                    and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def generate(workdir: Path, size_gb: float) -> tuple[Path, Path]:
    from tests.support import testckpt

    spec = dataclasses.replace(testckpt.spec_for_bytes(int(size_gb * 1e9)), mtp_layers=0)
    int4, fp8 = workdir / "int4", workdir / "fp8"
    testckpt.write_int4_autoround(int4, spec, shards=max(2, round(size_gb)))
    testckpt.write_fp8(fp8, spec, 2, only=lambda name: ".shared_expert." in name)
    subprocess.run(["sync"], check=True)
    return int4, fp8


def _stats(times: list[float], nbytes: int) -> dict[str, Any]:
    return {"s": [round(t, 2) for t in times], "best_s": round(min(times), 2),
            "median_s": round(statistics.median(times), 2), "worst_s": round(max(times), 2),
            "GBps": round(nbytes / min(times) / 1e9, 3)}


def _commands(work: Path, clones: bool) -> dict[str, tuple[Path, list[str]]]:
    """What each contender runs on the shards in ``work``: its output folder and its command
    line."""
    int4, fp8, cp_dst, out = work / "int4", work / "fp8", work / "cp-copy", work / "hybrid"
    # where the filesystem shares extents, plain cp -r copies nothing: compare with a real copy
    cp = ["cp", "-r", *(["--reflink=never"] if clones else []), str(int4), str(cp_dst)]
    assemble = [sys.executable, "-m", "sparkspec.cli", "checkpoint", "assemble",
                "--int4", str(int4), "--fp8", str(fp8), "--out", str(out), "--json"]
    return {"cp": (cp_dst, cp), "assemble": (out, assemble)}


def run_one(workdir: str | os.PathLike[str], which: str) -> float:
    """One run of ``which`` on kept shards, from a removed output to its files on disk; returns
    seconds."""
    work = Path(workdir)
    target, cmd = _commands(work, reflinks(work))[which]
    shutil.rmtree(target, ignore_errors=True)
    return _timed(cmd, target)[0]


def run(workdir: str | os.PathLike[str], size_gb: float = 8, repeats: int = 3, keep: bool = False
        ) -> dict[str, Any]:
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    clones = reflinks(work)
    t0 = time.perf_counter()
    # In a child: the parent must stay small, since a spawned child's ru_maxrss starts from the
    # parent's.
    int4, fp8 = work / "int4", work / "fp8"
    script = ("import sys; from pathlib import Path; "
              "from tests.support.ckpt_bench import generate; "
              "generate(Path(sys.argv[1]), float(sys.argv[2]))")
    subprocess.run([sys.executable, "-c", script, str(work), str(size_gb)], check=True, cwd=REPO)
    gen_s = time.perf_counter() - t0
    commands = _commands(work, clones)
    (cp_dst, cp), (out, _) = commands["cp"], commands["assemble"]
    times: dict[str, list[float]] = {"cp": [], "assemble": []}
    rss: dict[str, list[int]] = {"cp": [], "assemble": []}
    load = [os.getloadavg()[0]]
    try:
        for i in range(repeats):
            # alternate order
            for which in (("cp", "assemble") if i % 2 == 0 else ("assemble", "cp")):
                target, cmd = commands[which]
                shutil.rmtree(target, ignore_errors=True)
                subprocess.run(["sync"], check=True)
                seconds, peak = _timed(cmd, target)
                times[which].append(seconds)
                rss[which].append(peak)
            load.append(os.getloadavg()[0])
        cp_bytes, asm_bytes = _dir_bytes(cp_dst), _dir_bytes(out)
    finally:
        if not keep:
            for target in (cp_dst, out, int4, fp8):
                shutil.rmtree(target, ignore_errors=True)
    cp_s, asm_s = _stats(times["cp"], cp_bytes), _stats(times["assemble"], asm_bytes)
    pairs = sorted(asm_bytes / a / (cp_bytes / c)
                   for a, c in zip(times["assemble"], times["cp"], strict=True))
    result = {
        "size_gb": size_gb, "repeats": repeats, "generate_s": round(gen_s, 1),
        "filesystem": _fs_type(work), "reflinks": clones, "cp_command": " ".join(cp[:-2]),
        "cpus": os.cpu_count(), "load_1min": [round(x, 2) for x in load],
        "cp_bytes": cp_bytes, "assemble_bytes": asm_bytes, "cp": cp_s, "assemble": asm_s,
        "ratio": round(asm_s["GBps"] / cp_s["GBps"], 3),
        "ratio_median": round(asm_bytes / asm_s["median_s"] / (cp_bytes / cp_s["median_s"]), 3),
        "ratio_pairs": [round(x, 3) for x in pairs],
        "peak_rss_mib": round(max(rss["assemble"]) / 1024, 1),
        "cp_peak_rss_mib": round(max(rss["cp"]) / 1024, 1),
        "target_ratio": TARGET_RATIO, "target_rss_mib": TARGET_RSS_MIB,
    }
    result["ok"] = result["ratio"] >= TARGET_RATIO and result["peak_rss_mib"] <= TARGET_RSS_MIB
    _print_table(result)
    return result


def _print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"checkpoint assemble vs {r['cp_command']} "
                        f"({r['cp_bytes'] / 1e9:.2f} GB, {r['filesystem']}, "
                        f"best of {r['repeats']}, each timed until its output is on disk)")
    for col in ("", "best s", "median s", "worst s", "all s (in order)", "GB/s (best)",
                "peak RSS MiB"):
        table.add_column(col)
    for name, key, rss in (("cp -r", "cp", "cp_peak_rss_mib"),
                           ("assemble", "assemble", "peak_rss_mib")):
        s = r[key]
        table.add_row(name, f"{s['best_s']}", f"{s['median_s']}", f"{s['worst_s']}",
                      ", ".join(map(str, s["s"])), f"{s['GBps']}", f"{r[rss]}")
    verdict = "PASS" if r["ok"] else "MISSED"
    table.caption = (f"{verdict}: throughput assemble/cp = {r['ratio']} best of {r['repeats']} "
                     f"(median {r['ratio_median']}; run by run "
                     f"{r['ratio_pairs'][0]}-{r['ratio_pairs'][-1]}; target >= {TARGET_RATIO}), "
                     f"assemble peak RSS {r['peak_rss_mib']} MiB "
                     f"(target <= {TARGET_RSS_MIB}); {r['cpus']} CPUs, 1-min load {r['load_1min']}")
    Console(stderr=True, width=132).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--size-gb", type=positive_float, default=8.0,
                        help="shard bytes to generate, in GB")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="runs of each command (best of N)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the generated shards and the outputs")
    parser.add_argument("--one", choices=("cp", "assemble"),
                        help="one run of one command on shards kept by a --keep run; "
                             "prints its seconds")
    args = parser.parse_args(argv)
    if args.one:
        print(f"{args.one} {run_one(args.workdir, args.one):.2f} s")
        return 0
    print(json.dumps(run(args.workdir, args.size_gb, args.repeats, args.keep)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
