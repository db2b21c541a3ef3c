"""The one writer of sparkspec's outputs: atomic writes, the "is this output ours" marker and the
safe-replace rule. Checkpoint, hub, bench and report code write files and folders only through this
module.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sparkspec import stops
from sparkspec.errors import RunFailure, UserError

PNG_MARKER = "sparkspec report"  # every plot's Description: marks a PNG as sparkspec's
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_MARKER_READ = 64 << 20  # bytes of an existing output read to look for its marker
_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

StrPath = str | os.PathLike[str]


# --- durability -----------------------------------------------------------------------------------

def fsync_path(path: StrPath, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: StrPath) -> None:
    fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


# --- atomic writes --------------------------------------------------------------------------------

def temp_name(target: StrPath) -> Path:
    """A fresh hidden sibling name of ``target`` (``.NAME.<random>.tmp``); create it exclusively."""
    target = Path(target)
    return target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")


def open_temp(target: StrPath, mode: int | None = None) -> tuple[int, Path]:
    """A new temp sibling of ``target``, opened for writing with ``O_EXCL|O_NOFOLLOW`` and set to
    ``mode`` (None: what ``open`` gives under the umask); the fd and its path."""
    want = _umask_mode() if mode is None else mode
    for _ in range(16):
        tmp = temp_name(target)
        try:
            fd = os.open(tmp, _TEMP_FLAGS, 0o600)
        except FileExistsError:
            continue
        try:
            os.fchmod(fd, want)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        return fd, tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name beside the output", str(target))


@contextlib.contextmanager
def _temp(target: StrPath, mode: int | None) -> Iterator[tuple[int, Path]]:
    """:func:`open_temp`, the temp removed when the block raises. Stop signals are held while it is
    created and named: one that comes in between (a loaded machine's scheduler likes that moment) is
    raised only once the name is known, so the temp cannot outlive it."""
    tmp: Path | None = None
    given = False  # the block owns the descriptor (it closes it)
    try:
        with stops.held():
            fd, tmp = open_temp(target, mode)
        given = True
        yield fd, tmp
    except BaseException:
        if tmp is not None:
            if not given:
                os.close(fd)
            tmp.unlink(missing_ok=True)
        raise


def refuse_link(target: StrPath, flag: str = "output") -> None:
    """What an atomic write replaces must not be a symbolic link or anything but a regular file."""
    if os.path.islink(target) or (os.path.lexists(target) and not os.path.isfile(target)):
        raise UserError(f"{flag} {target}: exists and is not a regular file (a link, folder, FIFO "
                        "or device); give a file path")


@contextlib.contextmanager
def atomic(target: StrPath, *, mode: int | None = 0o644, sync: bool = True,
           flag: str = "output") -> Iterator[BinaryIO]:
    """A binary file to write ``target``'s new bytes into; when the block ends they replace
    ``target`` (fsynced first with ``sync``), when it raises the temp file is removed and ``target``
    stays as it was. A link or a non-regular file at ``target`` is refused (UserError naming
    ``flag``); OSErrors pass to the caller."""
    refuse_link(target, flag)
    with _temp(target, mode) as (fd, tmp):
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        commit(tmp, target, sync=sync)


def write_atomic(target: StrPath, data: bytes | Iterable[bytes], *, mode: int | None = 0o644,
                 sync: bool = True, flag: str = "output") -> int:
    """Write ``data`` (bytes, or parts as they come) to ``target`` atomically; the bytes written."""
    written = 0
    with atomic(target, mode=mode, sync=sync, flag=flag) as fh:
        for part in [data] if isinstance(data, bytes | bytearray | memoryview) else data:
            written += fh.write(part)
    return written


def stage(target: StrPath, data: bytes, *, mode: int | None = 0o644) -> Path:
    """Write ``data`` to a fresh fsynced temp sibling of ``target`` and return it, for
    :func:`commit` (or the caller removes it). Nothing is left behind when writing fails."""
    with _temp(target, mode) as (fd, tmp):
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    return tmp


def commit(tmp: StrPath, target: StrPath, *, sync: bool = True) -> None:
    """Rename the staged ``tmp`` over ``target`` (same folder) and fsync the folder."""
    os.replace(tmp, target)
    if sync:
        fsync_dir(Path(target).parent)


def link_or_copy(src: StrPath, target: StrPath, *, mode: int | None = None) -> str:
    """Make ``target`` a hard link to the file ``src`` names (a link at ``src`` followed; no bytes
    duplicated) or, across filesystems, a copy, through a temp sibling and a rename; "linked" or
    "copied"."""
    tmp = temp_name(target)
    try:
        # link() itself would link a symbolic link, not its file
        os.link(os.path.realpath(src), tmp)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise
    else:
        try:
            commit(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return "linked"
    with open(src, "rb") as source, atomic(target, mode=mode) as fh:
        shutil.copyfileobj(source, fh, 8 << 20)
    return "copied"


# --- folders --------------------------------------------------------------------------------------

_LIBC = ctypes.CDLL(None, use_errno=True)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where the kernel or filesystem
    lacks it."""
    fn = getattr(_LIBC, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def swap_folder(tmp: Path, out: Path) -> None:
    """Make the build folder ``tmp`` (a sibling) the content of ``out``; the old content, which the
    caller checked is ours, is removed after. Two renames where the filesystem lacks the exchange: a
    crash between them leaves the old content beside, as ``.NAME.<random>.old`` (a fresh name:
    whatever else lies beside ``out`` is never removed)."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
    elif _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        old = out.parent / f".{out.name}.{secrets.token_hex(6)}.old"
        # over nothing but, at most, an empty folder: a file or full folder fails it
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(out.parent)


# --- ours, and the safe-replace rule --------------------------------------------------------------

@dataclass(frozen=True)
class Marker:
    """How an output of one kind shows that sparkspec wrote it: ``json`` (an object whose ``format``
    is ``value``), ``text`` (starts with ``value``) or ``png`` (a PNG whose Description is
    ``value``)."""

    kind: str
    value: str

    def ours(self, data: bytes) -> bool:
        if not data:
            return True
        want = self.value.encode()
        if self.kind == "text":
            return data.startswith(want)
        if self.kind == "png":
            return data.startswith(PNG_SIGNATURE) and b"Description\x00" + want in data[:1 << 16]
        if want not in data:  # cheap: a foreign JSON file is not parsed
            return False
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return False
        return isinstance(doc, dict) and doc.get("format") == self.value


def json_format(value: str) -> Marker:
    return Marker("json", value)


def starts_with(value: str) -> Marker:
    return Marker("text", value)


PNG = Marker("png", PNG_MARKER)


def check_not_symlink(path: StrPath, flag: str) -> None:
    """An output path must not be a symbolic link: replacing it would act on what it points at."""
    if os.path.islink(path):
        raise UserError(f"{flag} {path} is a symbolic link; give the real folder path")


def check_disjoint(output: StrPath, inputs: Mapping[str, StrPath | None],
                   out_flag: str = "--out") -> None:
    """Refuse an output that equals, contains or sits inside an input (resolved real paths), before
    anything is touched. ``inputs`` maps each input's flag (e.g. ``--int4``) to its path."""
    out = Path(os.path.realpath(output))
    for flag, value in inputs.items():
        if value is None:
            continue
        src = Path(os.path.realpath(value))
        if out == src:
            how = "is"
        elif out.is_relative_to(src):
            how = "is inside"
        elif src.is_relative_to(out):
            how = "contains"
        else:
            continue
        raise UserError(f"{out_flag} {output} {how} the input {flag} {value}; choose an output "
                        "folder apart from every input")


def _read_existing(path: str, limit: int) -> bytes | None:
    """The first ``limit`` bytes of regular file ``path`` (no link followed, no FIFO waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        while (got := sum(map(len, chunks))) < limit \
                and (chunk := os.read(fd, min(1 << 20, limit - got))):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Output:
    """An output file of a command: checked before the run and again right before it is written."""

    path: str
    flag: str
    marker: Marker
    # (flag, path) of every input it must stay apart from
    inputs: Sequence[tuple[str, str | None]] = ()

    def check(self) -> None:
        flag, path = self.flag, self.path
        if not path or "\x00" in path:
            raise UserError(f"{flag} {path!r}: not a file path; give one")
        for name, value in self.inputs:
            check_disjoint(path, {name: value}, flag)
        check_not_symlink(path, flag)
        if os.path.lexists(path):
            try:
                st = os.stat(path)
            except OSError as exc:
                raise UserError(f"{flag} {path}: cannot look at it ({exc.strerror}); choose "
                                f"another {flag}") from None
            if not stat.S_ISREG(st.st_mode):
                raise UserError(f"{flag} {path}: exists and is not a regular file (a folder, FIFO "
                                "or device); give a file path")
            data = _read_existing(path, MAX_MARKER_READ)
            if st.st_size and (data is None or not self.marker.ours(data)):
                raise UserError(f"{flag} {path}: exists and was not written by this command; move "
                                f"it away or choose another {flag}")
        ancestor = Path(path).absolute().parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
            raise UserError(f"{flag} {path}: {ancestor} is not a folder this user can write; "
                            f"choose another {flag}")


def check_outputs(outputs: Sequence[Output | None]) -> list[Output]:
    """The outputs given (None: a flag left out), each checked."""
    present = [o for o in outputs if o is not None]
    for o in present:
        o.check()
    return present


def write_outputs(items: Sequence[tuple[Output, bytes]], mode: int | None = None) -> None:
    """Write every output, or none: each checked again, staged as a fresh fsynced sibling, then all
    renamed over their targets. A failure removes every sibling and every folder made for them
    (RunFailure)."""
    for output, _ in items:
        output.check()  # again: the run may have taken hours
    staged: list[tuple[Path, str]] = []
    made: list[Path] = []
    current = ""
    try:
        for output, data in items:
            current = output.path
            target = Path(output.path)
            missing = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
            for folder in reversed(missing):
                folder.mkdir()
                made.append(folder)
            staged.append((stage(target, data, mode=mode), output.path))
        for tmp, path in staged:
            current = path
            commit(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            for tmp, _ in staged:
                tmp.unlink(missing_ok=True)
            for folder in reversed(made):
                folder.rmdir()
        raise RunFailure(f"{current}: cannot write ({exc.strerror}); free space or choose another "
                         "output") from None
