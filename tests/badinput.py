"""The harness of the bad-input tests: run a sparkspec command in-process, then assert the promised
outcome: one line ``sparkspec: error: ...`` on stderr, the exit code, inputs unchanged by content
hash, nothing left behind. Every table-driven bad-input test uses these helpers, so "handled" means
the same everywhere."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sparkspec import cli
from tasks import report
from tests.support import cli as dev_cli


@dataclass
class Outcome:
    rc: int
    stdout: str
    stderr: str


def run(*argv: str | os.PathLike[str], env: Mapping[str, str] | None = None) -> Outcome:
    """``sparkspec ARGV`` in this process (fast: no interpreter start), with stdout/stderr captured;
    the generators' commands (``checkpoint generate``, ``model tiny``) go to their dev CLI,
    ``python -m tests.support``, and ``report`` to the controller's (``python -m tasks report``)."""
    if argv[:1] == ("report",):
        argv, main = argv[1:], report.main
    else:
        main = dev_cli.main if dev_cli.handles(argv) else cli.main
    out, err = io.StringIO(), io.StringIO()
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in argv])
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else 2
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return Outcome(int(rc), out.getvalue(), err.getvalue())


def fingerprint(*roots: str | os.PathLike[str]) -> dict[str, str]:
    """Every path under each root (the root itself included, links not followed): its kind and, for
    files, the sha256 of its content; for links, the target."""
    prints: dict[str, str] = {}
    for root in map(Path, roots):
        if not os.path.lexists(root):
            prints[str(root)] = "absent"
            continue
        paths = [root] + (sorted(root.rglob("*")) if root.is_dir() and not root.is_symlink()
                          else [])
        for path in paths:
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                prints[str(path)] = "link:" + os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                prints[str(path)] = "file:" + hashlib.sha256(path.read_bytes()).hexdigest()
            elif stat.S_ISDIR(st.st_mode):
                prints[str(path)] = "dir"
            else:
                prints[str(path)] = f"special:{stat.S_IFMT(st.st_mode)}"
    return prints


def assert_refused(outcome: Outcome, rc: int = 2, match: str | None = None) -> None:
    """Exactly one line on stderr, ``sparkspec: error: ...``, the exit code ``rc``; ``match`` is a
    regex the line must contain."""
    lines = [line for line in outcome.stderr.splitlines() if line.strip()]
    assert outcome.rc == rc, f"exit {outcome.rc}, expected {rc}; stderr: {outcome.stderr[-2000:]}"
    assert "Traceback" not in outcome.stderr, outcome.stderr
    assert len(lines) == 1, f"expected one error line, got {len(lines)}: {outcome.stderr[-2000:]}"
    assert lines[0].startswith("sparkspec: error: "), lines[0]
    if match is not None:
        assert re.search(match, lines[0]), f"{match!r} not in {lines[0]!r}"


def assert_unchanged(before: Mapping[str, str], *roots: str | os.PathLike[str]) -> None:
    after = fingerprint(*roots)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"changed by a refused command: {changed[:10]}"


def refused_untouched(argv: Iterable[str | os.PathLike[str]],
                      roots: Iterable[str | os.PathLike[str]],
                      rc: int = 2, match: str | None = None,
                      env: Mapping[str, str] | None = None) -> Outcome:
    """Run a command that must be refused; assert the one line and that nothing under ``roots``
    changed (no file written, removed or left behind)."""
    roots = list(roots)
    before = fingerprint(*roots)
    outcome = run(*argv, env=env)
    assert_refused(outcome, rc, match)
    assert_unchanged(before, *roots)
    return outcome
