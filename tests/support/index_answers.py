"""Recorded answers of the package index for the pins a Spark's vLLM needs, and their loader (tests
only).

An answer is what pip, as configured on the recording machine, says about one exact pin
``name==version`` for a DGX Spark (Linux aarch64, ``manylinux_2_28_aarch64``, CPython 3.12), read
without downloading the wheel::

    PIP_CONSTRAINT=/dev/null python -m pip install --dry-run --no-deps --ignore-installed --quiet \\
        --report R.json --platform manylinux_2_28_aarch64 --python-version 3.12 \\
        --only-binary=:all: --target T NAME==VERSION

(``PIP_CONSTRAINT=/dev/null`` sets aside a constraints file of the recording machine's pip
configuration, if any: a local cap on a version would otherwise turn "the index has no such file"
into a resolver conflict.) The report names the file pip would fetch, its sha256 and the wheel's
Requires-Dist. A pin the index does not serve is recorded too (``"served": false`` with pip's error
lines), so a test can show that it is refused; a failure pip does not explain as "no matching
distribution" (no network, a broken index) records nothing.

    python -m tests.support.index_answers record [--out DIR] vllm==0.32.0 torch==2.13.0 ...

writes ``tests/data/index-answers/<name>-<version>.json`` (atomically); :func:`answer`,
:func:`served` and :func:`requires` read them back, with no network.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # pragma: no cover - pip vendors packaging where the venv lacks it
    from pip._vendor.packaging.markers import Marker  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.specifiers import SpecifierSet  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]
    from pip._vendor.packaging.version import Version  # type: ignore[no-redef]

ANSWERS_DIR = Path(__file__).resolve().parents[1] / "data" / "index-answers"
PLATFORM = "manylinux_2_28_aarch64"
PYTHON_VERSION = "3.12"
# The machine the answers are for, as PEP 508 markers see it (a DGX Spark's Python 3.12 on Ubuntu
# 24.04).
MARKER_ENV: dict[str, str] = {
    "platform_machine": "aarch64",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_version": "",
    "extra": "",
}
# What the recorder sets in pip's environment (see the module's docstring).
PIP_ENV = {"PIP_CONSTRAINT": os.devnull}
NOT_SERVED = ("No matching distribution found for",
              "Could not find a version that satisfies the requirement")
PIP_TIMEOUT_S = 600


class IndexQueryError(RuntimeError):
    """pip failed for a reason other than "the index serves no such file": nothing is recorded."""


# ---- recording -----------------------------------------------------------------------------------


def parse_pin(pin: str) -> tuple[str, str]:
    """``name==version`` -> (canonical name, normalized version); anything else (a range, a
    wildcard, ``===``, extras, a marker) is refused: an answer is about one file."""
    try:
        req = Requirement(pin)
    except Exception as exc:
        raise ValueError(f"{pin!r}: not a requirement ({exc})") from None
    specs = list(req.specifier)
    if req.extras or req.marker or req.url or len(specs) != 1 or specs[0].operator != "==" \
            or specs[0].version.endswith(".*"):
        raise ValueError(f"{pin!r}: not an exact pin name==version")
    return canonicalize_name(req.name), str(Version(specs[0].version))


def answer_path(name: str, version: str, directory: Path | None = None) -> Path:
    return (directory or ANSWERS_DIR) / f"{canonicalize_name(name)}-{Version(version)}.json"


def pip_argv(pin: str) -> list[str]:
    """The dry-run command, relative to the temp folder it runs in (``R.json``, ``T``)."""
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
            "--quiet", "--report", "R.json", "--platform", PLATFORM,
            "--python-version", PYTHON_VERSION, "--only-binary=:all:", "--target", "T", pin]


def command_line(pin: str) -> str:
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in PIP_ENV.items()),
                     shlex.join(pip_argv(pin))])


def _error_lines(stderr: str) -> list[str]:
    return [line.strip() for line in stderr.splitlines() if line.startswith("ERROR:")]


def _versions_offered(errors: Sequence[str]) -> list[str] | None:
    """The versions pip saw for the name (its "from versions: ..." list), or None where it gave
    none."""
    for line in errors:
        m = re.search(r"\(from versions: ([^)]*)\)", line)
        if m:
            listed = m.group(1).strip()
            return [] if listed == "none" else [v.strip() for v in listed.split(",") if v.strip()]
    return None


def outcome(pin: str, returncode: int, stderr: str,
            report: dict[str, Any] | None) -> dict[str, Any]:
    """What one dry run answered for ``pin``: the served file and its metadata, or a refusal;
    anything else raises :class:`IndexQueryError`. (No date or command: :func:`record_one` adds
    them.)"""
    name, version = parse_pin(pin)
    base: dict[str, Any] = {"requested": pin, "name": name, "version": version}
    if returncode != 0:
        errors = _error_lines(stderr)
        if any(marker in line for line in errors for marker in NOT_SERVED):
            return {**base, "served": False, "error": errors[-1], "errors": errors,
                    "versions_offered": _versions_offered(errors)}
        tail = "\n".join(stderr.strip().splitlines()[-5:]) or "(no output)"
        raise IndexQueryError(f"{pin}: pip exited {returncode} without refusing the pin:\n{tail}")
    installs = (report or {}).get("install") or []
    if len(installs) != 1:
        raise IndexQueryError(f"{pin}: pip's report names {len(installs)} files, expected one")
    item = installs[0]
    meta, info = item.get("metadata") or {}, item.get("download_info") or {}
    got_name, got_version = canonicalize_name(meta.get("name", "")), meta.get("version", "")
    if got_name != name or Version(got_version) not in SpecifierSet(f"=={version}"):
        raise IndexQueryError(f"{pin}: pip's report is for {got_name}=={got_version}")
    archive = info.get("archive_info") or {}
    sha256 = (archive.get("hashes") or {}).get("sha256")
    if not sha256 and str(archive.get("hash", "")).startswith("sha256="):
        sha256 = archive["hash"].split("=", 1)[1]
    url = info.get("url", "")
    if not url or not sha256:
        raise IndexQueryError(f"{pin}: pip's report has no file URL or no sha256")
    file = unquote(urlsplit(url).path.rsplit("/", 1)[-1])
    return {**base, "version": got_version, "served": True, "file": file,
            "sha256": sha256, "url": url, "requires_python": meta.get("requires_python"),
            "requires_dist": list(meta.get("requires_dist") or [])}


def _write_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would keep the committed file from the others
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def record_one(pin: str, out_dir: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Ask the index about one pin (the dry run in a temp folder) and write its answer."""
    name, version = parse_pin(pin)
    date = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    with tempfile.TemporaryDirectory(prefix="index-answer-") as tmp:
        try:
            proc = subprocess.run(pip_argv(pin), cwd=tmp, env={**os.environ, **PIP_ENV},
                                  capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise IndexQueryError(f"{pin}: pip took more than {PIP_TIMEOUT_S} s") from None
        report_path = Path(tmp, "R.json")
        report = None
        if proc.returncode == 0 and report_path.exists():
            report = json.loads(report_path.read_text())
    data = outcome(pin, proc.returncode, proc.stderr, report)
    data.update(platform=PLATFORM, python_version=PYTHON_VERSION, date=date,
                command=command_line(pin), pip_version=importlib_metadata.version("pip"))
    path = answer_path(name, version, out_dir)
    _write_atomic(path, data)
    return path, data


def record(out_dir: Path | None, requirements: Iterable[str]) -> list[Path]:
    """Record every pin (all pins are checked first); raises :class:`IndexQueryError` after the
    others are recorded when pip failed for one without refusing it."""
    pins = list(requirements)
    for pin in pins:
        parse_pin(pin)
    paths, failures = [], []
    for pin in pins:
        try:
            path, data = record_one(pin, out_dir)
        except IndexQueryError as exc:
            failures.append(str(exc))
            print(f"{pin}: NOT RECORDED: {exc}", file=sys.stderr)
            continue
        paths.append(path)
        what = f"served {data['file']}" if data["served"] else f"refused: {data['error']}"
        print(f"{pin}: {what} -> {path}")
    if failures:
        raise IndexQueryError("\n".join(failures))
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.index_answers",
        description="record the package index's answers for exact pins")
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record",
                         help="ask the index about each pin name==version and write its answer")
    rec.add_argument("--out", type=Path, default=ANSWERS_DIR,
                     help=f"folder of the answers (default {ANSWERS_DIR})")
    rec.add_argument("pins", nargs="+", metavar="REQ", help="an exact pin name==version")
    args = parser.parse_args(argv)
    try:
        record(args.out, args.pins)
    except ValueError as exc:
        parser.error(str(exc))
    except IndexQueryError:
        return 1
    return 0


# ---- loading -------------------------------------------------------------------------------------


def answer(name: str, version: str, directory: Path | None = None) -> dict[str, Any] | None:
    """The recorded answer for ``name==version``, or None where none was recorded."""
    path = answer_path(name, version, directory)
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def answers(directory: Path | None = None) -> list[dict[str, Any]]:
    """Every recorded answer of the folder, in file-name order."""
    paths = sorted((directory or ANSWERS_DIR).glob("*.json"))
    return [json.loads(p.read_text(encoding="utf-8")) for p in paths]


def _recorded(name: str, version: str, directory: Path | None) -> dict[str, Any]:
    data = answer(name, version, directory)
    if data is None:
        raise LookupError(f"no recorded answer for {name}=={version} in "
                          f"{directory or ANSWERS_DIR}: record it with "
                          f"python -m tests.support.index_answers record {name}=={version}")
    return data


def served(name: str, version: str, directory: Path | None = None) -> bool:
    """Whether the index served a file for ``name==version`` (LookupError where the pin was never
    asked: an unrecorded pin is not evidence of a refusal)."""
    return bool(_recorded(name, version, directory).get("served"))


def applies(requirement: str, extras: Iterable[str] = ()) -> bool:
    """Whether a Requires-Dist entry applies on the Spark (:data:`MARKER_ENV`) with no extra, or
    with one of ``extras``."""
    marker: Marker | None = Requirement(requirement).marker
    if marker is None:
        return True
    return any(marker.evaluate({**MARKER_ENV, "extra": extra}) for extra in ("", *extras))


def applicable(requires_dist: Iterable[str], extras: Iterable[str] = ()) -> list[str]:
    """The entries of ``requires_dist`` whose markers do not exclude the Spark, as written (markers
    kept)."""
    wanted = tuple(extras)
    return [req for req in requires_dist if applies(req, wanted)]


def requires(name: str, version: str, extras: Iterable[str] = (),
             directory: Path | None = None) -> list[str]:
    """The recorded Requires-Dist of ``name==version`` that applies on the Spark (see
    :func:`applicable`); LookupError where the pin was not recorded or not served."""
    data = _recorded(name, version, directory)
    if not data.get("served"):
        raise LookupError(f"{name}=={version} is not served by the index ({data.get('error')})")
    return applicable(data.get("requires_dist") or [], extras)


if __name__ == "__main__":
    sys.exit(main())
