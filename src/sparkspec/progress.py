"""Progress of a long step as a small JSON file (``--progress-file``), and the one line a play
prints from it.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from sparkspec import outputs
from sparkspec.errors import UserError
from sparkspec.figures import duration, size

HELP = ("while running, replace PATH every few seconds with the bytes done, total, rate and time "
        "left as JSON (read by the sparkspec_progress Ansible action); removed at the end")
WINDOW_S = 30.0  # the rate is measured over this much recent time
EVERY_S = 2.0  # the file is replaced at most this often
FORMAT = "sparkspec progress"  # the "format" of every progress document: marks a file as ours
MARKER = outputs.json_format(FORMAT)


class ProgressFile:
    """Counts bytes done (thread-safe) and replaces ``path`` with the progress document at most
    every ``every`` seconds. The path is checked at once (not a link, FIFO or folder, not a file
    some other program wrote, in an existing writable folder), so a bad path ends the command before
    any work, but nothing is written until the work starts (:meth:`begin`, or the first
    :meth:`set_total` / :meth:`add`): a command refused by its own checks leaves no progress file. A
    later failed write (a full disk) leaves the last good document and the work goes on; the file is
    removed at the end only while it is still one this tool wrote."""

    def __init__(self, path: str, what: str, total: int | None = None, every: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # ~ as the user the command runs as: the action plugin names a file in that user's
        # async folder
        path = os.path.expanduser(path)
        self.path, self.what, self.total, self.every, self.clock = path, what, total, every, clock
        self.done = 0
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, int]] = collections.deque([(clock(), 0)])
        self._written = clock()
        self._started = False
        self._output = outputs.Output(path, "--progress-file", MARKER)
        self._output.check()
        parent = Path(path).absolute().parent
        if not parent.is_dir():
            raise UserError(f"--progress-file {path}: {parent} is not an existing folder; give a "
                            "file in a writable folder (or leave the flag out)")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        """The step ended (or failed): the file goes, so nothing reads a finished step as running; a
        file that is no longer ours (replaced meanwhile by another program) stays."""
        if self._started and self._ours():
            Path(self.path).unlink(missing_ok=True)

    def _ours(self) -> bool:
        try:
            self._output.check()
        except UserError:
            return False
        return True

    def begin(self) -> None:
        """The work starts: the first document is written now (an unwritable path is one line)."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._written = self.clock()
            doc = self.doc(self._written)
        try:
            self._put(doc)
        except (UserError, OSError):
            raise UserError(f"--progress-file {self.path}: cannot be written; give a file in a "
                            "writable folder (or leave the flag out)") from None

    def _put(self, doc: dict[str, Any]) -> None:
        """Replace the file by ``doc`` (checked again first: a file put there since is not ours)."""
        self._output.check()
        outputs.write_atomic(self.path, (json.dumps(doc, indent=2) + "\n").encode(), mode=0o644,
                             sync=False, flag="--progress-file")

    def set_total(self, total: int | None) -> None:
        """The total became known (or grew): written at once."""
        if not self._started:
            self.total = total
            self.begin()
            return
        with self._lock:
            if total == self.total:
                return
            self.total = total
        self._write(force=True)

    def add(self, n: int) -> None:
        """``n`` more bytes done; rewrites the file when ``every`` seconds passed since the last."""
        self.begin()
        with self._lock:
            self.done += n
        self._write()

    def _write(self, force: bool = False) -> None:
        with self._lock:
            now = self.clock()
            if not force and now - self._written < self.every:
                return
            self._written = now
            doc = self.doc(now)
        try:
            self._put(doc)
        except (UserError, OSError):
            pass

    def doc(self, now: float | None = None) -> dict[str, Any]:
        now = self.clock() if now is None else now
        self._samples.append((now, self.done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= WINDOW_S:
            self._samples.popleft()
        t0, d0 = self._samples[0]
        rate = (self.done - d0) / (now - t0) if now > t0 else 0.0
        left = None if self.total is None else max(self.total - self.done, 0)
        eta = None if left is None or (rate <= 0 and left) else \
            round(left / rate, 1) if left else 0.0
        return {"format": FORMAT, "what": self.what, "done": self.done, "total": self.total,
                "rate": round(rate, 1), "eta_s": eta, "time": time.time()}


def line(host: str, doc: dict[str, Any] | None, task: str, running_s: float,
         stale_s: float = 0.0) -> str:
    """The play's progress line for ``host`` from a progress document (None: the command wrote none
    yet).

    ``sim01: fetch org/name: 1.2 GiB of 77.0 GiB, 95.0 MiB/s, 13 min left``; without a total
    ``..: 1.2 GiB, 95.0 MiB/s``; no bytes moving ``.., 0 B/s, time left unknown``; a wait
    ``sim01: wait for /health: 42 s; unit: loading weights``. ``stale_s``: how long ago the document
    was written, said when it is old (the command is alive but its counter has not moved)."""
    if not isinstance(doc, dict):
        return f"{host}: {task}: running for {duration(running_s)}"
    what = str(doc.get("what") or task)
    if "elapsed_s" in doc:
        note = doc.get("note")
        text = f"{host}: {what}: {duration(float(doc['elapsed_s']))}" + \
            (f"; {note}" if note else "")
    else:
        done, total, rate = (float(doc.get("done") or 0), doc.get("total"),
                             float(doc.get("rate") or 0))
        amount = size(done) if total is None else f"{size(done)} of {size(float(total))}"
        speed = f"{size(rate)}/s"
        eta = doc.get("eta_s")
        if total is None:
            left = ""
        elif eta is None:
            left = ", time left unknown"
        else:
            left = f", {duration(float(eta))} left"
        text = f"{host}: {what}: {amount}, {speed}{left}"
    if stale_s >= 60:
        text += f" (no update for {duration(stale_s)})"
    return text


def check_apart(path: str | None,
                folders: Iterable[tuple[str, str | os.PathLike[str] | None]]) -> None:
    """Refuse a progress file at or inside a folder the command reads or writes (resolved real
    paths): ``folders`` holds (label, path), the label naming it in the one line (e.g. ``--int4
    /x``)."""
    if path is None:
        return
    real = Path(os.path.realpath(os.path.expanduser(path)))
    for label, folder in folders:
        if folder is not None and real.is_relative_to(os.path.realpath(folder)):
            raise UserError(f"--progress-file {path} is inside {label}; put it outside the folders "
                            "the command reads or writes")


@contextmanager
def optional(path: str | None, what: str, total: int | None = None,
             apart: Mapping[str, str | os.PathLike[str] | None] | None = None
             ) -> Iterator[ProgressFile | None]:
    """A :class:`ProgressFile` at ``path`` for the block (removed after it), or None when no path is
    given; ``apart`` maps each folder flag of the command to its path (:func:`check_apart`)."""
    if path is None:
        yield None
        return
    check_apart(path, [(f"{flag} {folder}", folder) for flag, folder in (apart or {}).items()])
    with ProgressFile(path, what, total) as progress:
        yield progress
