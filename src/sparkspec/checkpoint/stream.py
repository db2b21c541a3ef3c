"""Streaming copy of byte ranges into new files,
hashing exactly the bytes written, in one pass over them."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import mmap
import os
import queue
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec.errors import UserError
from sparkspec.validate import open_regular

# direct I/O alignment of offsets, sizes and memory (the page size: 512 B and 4 KiB sectors)
ALIGN = 4096
CHUNK_BYTES = 8 << 20  # a multiple of ALIGN; 16 and 32 MiB measured no faster, only bigger
IN_FLIGHT = 3  # chunks being written at once, each by a writer thread of its own
# IN_FLIGHT + one being filled + one spare: reading waits only when every writer is busy
BUFFERS = IN_FLIGHT + 2
O_DIRECT = getattr(os, "O_DIRECT", 0)  # 0 where the platform has none: buffered writes only
# SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER: the range's data on the disk
_FLUSH_RANGE = 1 | 2 | 4
Progress = Callable[[int], None]

try:  # xxh3_128 runs at memory speed; blake2b is the stdlib fallback (slower, same role)
    import xxhash

    HASH_NAME = "xxh3_128"
    new_hash: Callable[[], Any] = xxhash.xxh3_128
except ModuleNotFoundError:  # pragma: no cover - depends on the environment
    HASH_NAME = "blake2b-128"

    def new_hash() -> Any:
        return hashlib.blake2b(digest_size=16)


@dataclass(frozen=True)
class Piece:
    """One output tensor: its header entry and where its bytes come from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    src: Path
    offset: int  # absolute offset in src
    nbytes: int


_POOL: list[memoryview] = []  # page-aligned chunk buffers, reused from file to file
_POOL_LOCK = threading.Lock()


def _take_buffers() -> list[memoryview]:
    with _POOL_LOCK:
        kept = [b for b in _POOL if len(b) == CHUNK_BYTES]
        _POOL.clear()
    # anonymous maps are page-aligned, as direct I/O needs
    return kept[:BUFFERS] + [memoryview(mmap.mmap(-1, CHUNK_BYTES))
                             for _ in range(BUFFERS - len(kept))]


def _give_back(buffers: Iterable[memoryview]) -> None:
    with _POOL_LOCK:
        _POOL[:] = list(buffers)[:BUFFERS]


def _with_path(exc: OSError, path: Path) -> OSError:
    return OSError(exc.errno, exc.strerror, str(path))


def _pwrite_all(fd: int, view: memoryview, at: int) -> None:
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def _open_output(path: Path) -> tuple[int, bool]:
    """Create (or truncate) ``path`` for writing, direct I/O where the filesystem allows it. Never
    follows a symbolic link and never blocks on a FIFO; anything but a regular file is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        try:
            fd, direct = os.open(path, flags | O_DIRECT, 0o644), bool(O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL or not O_DIRECT:
                raise
            fd, direct = os.open(path, flags, 0o644), False  # this filesystem has no direct I/O
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):
            raise UserError(f"{path}: is a symbolic link or a FIFO where sparkspec writes a new "
                            "file; remove it and run again") from None
        raise _with_path(exc, path) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UserError(f"{path}: is not a regular file where sparkspec writes a new file; remove "
                        "it and run again")
    os.set_blocking(fd, True)
    return fd, direct


_LIBC = ctypes.CDLL(None, use_errno=True)


def _libc_call(name: str, *argtypes: Any) -> Callable[..., int] | None:
    """A C library function Python has no binding for
    (``fallocate``, ``sync_file_range``), or None."""
    fn = getattr(_LIBC, name, None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn  # type: ignore[no-any-return]


_FALLOCATE = _libc_call("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_SYNC_FILE_RANGE = _libc_call("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_uint)
_UNSUPPORTED = (errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP, errno.EINVAL, errno.ESPIPE)


def _write_behind(fd: int, at: int, nbytes: int) -> None:
    """Push ``nbytes`` at ``at``, just written through the page cache, to the
    disk and drop them from it. A write error of that range (EIO, ENOSPC) is
    raised; without ``sync_file_range`` the final fsync does it."""
    global _SYNC_FILE_RANGE
    flush = _SYNC_FILE_RANGE
    if flush is not None and flush(fd, at, nbytes, _FLUSH_RANGE) != 0:
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            raise OSError(err, os.strerror(err))
        _SYNC_FILE_RANGE = None  # refused here (a sandbox, another kernel): not asked again
    if hasattr(os, "posix_fadvise"):
        try:
            # advice: clean pages go, dirty stay
            os.posix_fadvise(fd, at, nbytes, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def _preallocate(fd: int, size: int) -> None:
    """Reserve the file's ``size`` bytes before writing (a full disk fails here, before any
    copying), so that the chunk writes are no longer appends: ext4 runs direct writes inside the
    file side by side, appending ones one at a time. Skipped where the filesystem cannot (glibc's
    ``posix_fallocate`` would write zeros)."""
    if _FALLOCATE is not None and size and _FALLOCATE(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err not in _UNSUPPORTED:
            raise OSError(err, os.strerror(err))


class _Writer:
    """Writes filled buffers with ``IN_FLIGHT`` threads, each chunk at its own offset, and hands
    each buffer back once its chunk is on its way to the disk. After an error it writes nothing more
    but still hands buffers back, so the reading side never waits forever."""

    def __init__(self, fd: int, direct: bool, free: queue.SimpleQueue[memoryview]) -> None:
        self.fd, self.direct, self.free = fd, direct, free
        self.todo: queue.SimpleQueue[tuple[memoryview, int, int] | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, name="sparkspec-writer", daemon=True)
                        for _ in range(IN_FLIGHT)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            buf, length, at = item
            if self.error is None:
                try:
                    self._write(buf[:length], at)
                except BaseException as exc:  # noqa: BLE001 - re-raised by the reading side
                    with self.lock:
                        self.error = self.error or exc
            self.free.put(buf)

    def _write(self, view: memoryview, at: int) -> None:
        if self.direct:
            head = len(view) - len(view) % ALIGN
            try:
                _pwrite_all(self.fd, view[:head], at)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # the device wants another alignment: this chunk and the rest written buffered
                head = 0
            if head == len(view):
                return
            # a refusal, or the unaligned tail of the file
            # (its last chunk): written the ordinary way
            self._buffered_from_now()
            view, at = view[head:], at + head
        _pwrite_all(self.fd, view, at)
        _write_behind(self.fd, at, len(view))

    def _buffered_from_now(self) -> None:
        """Clear O_DIRECT on the descriptor: writes started after this are buffered (a write in
        flight in another thread finishes as it began; both land at their own offsets)."""
        with self.lock:
            if self.direct:
                fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
                self.direct = False

    def finish(self) -> None:
        """Write what is queued, stop the threads (idempotent)."""
        alive = [t for t in self.threads if t.is_alive()]
        for _ in alive:
            self.todo.put(None)
        for thread in alive:
            thread.join()


class Sink:
    """The new file ``path``, written front to back: bytes and source ranges land in a chunk buffer,
    which is hashed and queued for the writer threads when full."""

    def __init__(self, path: Path, progress: Progress | None, size: int = 0) -> None:
        self.path, self.progress = path, progress
        self.fd, direct = _open_output(path)
        try:
            _preallocate(self.fd, size)
        except OSError as exc:
            os.close(self.fd)
            raise _with_path(exc, path) from None
        self.buffers = _take_buffers()
        free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for b in self.buffers[1:]:
            free.put(b)
        self.free = free
        self.buf, self.pos, self.at = self.buffers[0], 0, 0  # at: file offset of buf[0]
        self.hash = new_hash()
        self.writer = _Writer(self.fd, direct, free)

    def _raise_if_failed(self) -> None:
        exc = self.writer.error
        if isinstance(exc, OSError):
            raise _with_path(exc, self.path) from None
        if exc is not None:
            raise exc

    def _hand_off(self) -> None:
        self.hash.update(self.buf[: self.pos])
        self.writer.todo.put((self.buf, self.pos, self.at))
        self.at += self.pos
        self.pos = 0
        self.buf = self.free.get()
        self._raise_if_failed()

    def put_bytes(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), len(self.buf) - self.pos)
            self.buf[self.pos: self.pos + take] = view[:take]
            self.pos += take
            view = view[take:]
            if self.pos == len(self.buf):
                self._hand_off()

    def put_range(self, src_fd: int, src: Path, offset: int, nbytes: int) -> None:
        """Append ``nbytes`` of ``src`` from ``offset``, read straight into the chunk buffer."""
        while nbytes:
            take = min(nbytes, len(self.buf) - self.pos)
            try:
                got = os.preadv(src_fd, [self.buf[self.pos: self.pos + take]], offset)
            except OSError as exc:
                raise _with_path(exc, src) from None
            if got <= 0:
                raise UserError(f"{src}: ended early at byte {offset}; the file changed or is "
                                "truncated, re-download it")
            self.pos += got
            offset += got
            nbytes -= got
            if self.progress:
                self.progress(got)
            if self.pos == len(self.buf):
                self._hand_off()

    def close(self) -> dict[str, Any]:
        """Write the rest, wait for the writer, close; return size and digest of the whole file."""
        if self.pos:
            self._hand_off()
        self.writer.finish()
        self._raise_if_failed()
        os.close(self.fd)
        self.fd = -1
        return {"size": self.at, HASH_NAME: self.hash.hexdigest()}

    def abort(self) -> None:
        """Stop the writer and close, keeping what was
        written (the caller removes it); no-op once done."""
        self.writer.finish()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.buffers:
            _give_back(self.buffers)
            self.buffers = []


def _runs(pieces: Iterable[Piece]) -> Iterator[tuple[Path, int, int]]:
    """(src, offset, nbytes) of ``pieces`` in order,
    adjacent ranges of one source merged into one."""
    run: tuple[Path, int, int] | None = None
    for p in pieces:
        if run and run[0] == p.src and run[1] + run[2] == p.offset:
            run = (run[0], run[1], run[2] + p.nbytes)
            continue
        if run and run[2]:
            yield run
        run = (p.src, p.offset, p.nbytes)
    if run and run[2]:
        yield run


def write_pieces(path: Path, prefix: bytes, pieces: list[Piece], progress: Progress | None = None
                 ) -> dict[str, Any]:
    """Write ``prefix`` then each piece's source range to ``path``; return size and digest."""
    fds: dict[Path, int] = {}
    runs = list(_runs(pieces))
    sink = Sink(path, progress, len(prefix) + sum(nbytes for _, _, nbytes in runs))
    try:
        sink.put_bytes(prefix)
        for src, offset, nbytes in runs:
            if src not in fds:
                fds[src] = open_regular(src, "source shard")
            sink.put_range(fds[src], src, offset, nbytes)
        return sink.close()
    finally:
        sink.abort()
        for fd in fds.values():
            os.close(fd)


def copy_file(src: Path, dst: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Copy a whole file, hashing it in the same pass."""
    fd = open_regular(src, "source file")
    try:
        size = os.fstat(fd).st_size
        sink = Sink(dst, progress, size)
        try:
            sink.put_range(fd, src, 0, size)
            return sink.close()
        finally:
            sink.abort()
    finally:
        os.close(fd)
