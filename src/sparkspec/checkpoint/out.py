"""Output folders of the checkpoint commands (assemble, generate):
claimed, locked, built aside, swapped in.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from sparkspec import stops
from sparkspec.errors import UserError, os_error
from sparkspec.figures import size
from sparkspec.outputs import check_disjoint, check_not_symlink, swap_folder

STAGE_MARKER = ".sparkspec-staging"  # inside a build folder while it is being written
STAGE_TEXT = "build folder of a sparkspec checkpoint command; safe to remove\n"


def claim(out: Path, flag: str, tool: str, owned: Callable[[Path], bool],
          inputs: Mapping[str, str | os.PathLike[str] | None] | None = None) -> None:
    """Refuse ``out`` unless it is absent, an empty folder,
    or a folder that ``owned`` recognises."""
    check_not_symlink(out, flag)
    check_disjoint(out, inputs or {}, flag)
    if not os.path.lexists(out):
        above = existing_ancestor(out.parent)
        if not above.is_dir():
            raise UserError(f"{flag} {out}: {above} is not a folder; choose a path inside a folder")
        return
    if not out.is_dir():
        raise UserError(f"{flag} {out} exists and is not a folder; choose a new folder path")
    try:
        empty = not any(out.iterdir())
    except OSError as exc:
        raise os_error(exc, out, f"choose another {flag}") from None
    if not empty and not owned(out):
        raise UserError(f"{flag} {out} exists and was not written by {tool}; move it away or "
                        f"choose another {flag}")


def existing_ancestor(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    return path


def check_room(out: Path, needed: int, flag: str, what: str) -> None:
    """Refuse before writing when the filesystem that will
    hold ``out`` has less than ``needed`` bytes free."""
    where = existing_ancestor(out.parent)
    free = shutil.disk_usage(where).free
    if free < needed:
        raise UserError(f"{where}: {size(free)} free, {what} needs {size(needed)}; free space or "
                        f"choose another {flag}")


@contextmanager
def _locked(out: Path, flag: str) -> Iterator[None]:
    """An exclusive flock on ``.NAME.lock`` beside ``out``, removed on
    the way out. A lock file unlinked by the previous holder between our
    open and our flock is detected (inode check) and opened again."""
    path = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UserError(f"{out}: another run is writing it ({path} is locked); wait for it to "
                            "finish") from None
        st = os.fstat(fd)
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            break
        os.close(fd)
    try:
        yield
    finally:
        try:
            os.unlink(path)
        finally:
            os.close(fd)


def _clear_stage(tmp: Path) -> None:
    """Make way for the build folder ``tmp``: a leftover of an interrupted run (it holds the staging
    marker, or nothing) is removed, anything else there is refused."""
    if os.path.lexists(tmp):
        if tmp.is_symlink() or not tmp.is_dir() or not (
                (tmp / STAGE_MARKER).is_file() or not any(tmp.iterdir())):
            raise UserError(f"{tmp}: is in the way of the build folder and was not left by this "
                            "command; move it away")
        shutil.rmtree(tmp)


@contextmanager
def replacing(out: Path, *, flag: str, tool: str, owned: Callable[[Path], bool], stage: str,
              inputs: Mapping[str, str | os.PathLike[str] | None] | None = None) -> Iterator[Path]:
    """Claim ``out``, lock it, yield an empty build folder; on success swap it in, on any failure
    remove it. OSErrors of the block become one line (exit 1 at run time, 2 for a path to fix).

    The build folder's name is known before it is made and it is removed in the ``finally`` whenever
    this run cleared its place: a stop signal that lands between its ``mkdir`` and anything after
    (the window a loaded machine hits) still takes it away. Writer threads of the block have stopped
    by then (every sink joins its writers before the block's exception leaves it)."""
    claim(out, flag, tool, owned, inputs)
    tmp = out.parent / f".{out.name}.{stage}"
    # ours: this run cleared the build folder's place: whatever is there from now on is its own
    ours = False
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _locked(out, flag):
            claim(out, flag, tool, owned, inputs)  # again, under the lock
            _clear_stage(tmp)
            ours = True
            tmp.mkdir(mode=0o755)
            (tmp / STAGE_MARKER).write_text(STAGE_TEXT)
            yield tmp
            stops.check()  # a stop swallowed by third-party code still stops here, before the swap
            (tmp / STAGE_MARKER).unlink()
            # afterwards ``tmp`` is gone or holds the old content, which is ours
            swap_folder(tmp, out)
    except OSError as exc:
        where, fix = exc.filename or out, f"choose a writable {flag} with room"
        if exc.filename and Path(exc.filename).parent == tmp:
            # the file it was writing, by the name it would have had
            where = out / Path(exc.filename).name
        elif exc.filename and not Path(exc.filename).is_relative_to(out.parent):
            fix = "check that input file and its permissions"  # reading a source failed
        raise os_error(exc, where, fix) from None
    finally:
        if ours:
            shutil.rmtree(tmp, ignore_errors=True)
