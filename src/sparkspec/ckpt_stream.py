"""Streaming copy of byte ranges into new files, hashing exactly the bytes written, in one pass.

Each chunk of a source range is read into one reusable buffer (``preadv``) and hashed, then the same
range is copied in-kernel with ``copy_file_range`` (page cache to page cache, as ``cp`` does), falling back
to writing the buffer where the kernel cannot; memory stays flat whatever the file sizes. xxh3_128 (the ``xxhash`` package) hashes at memory speed; without it the stdlib
blake2b is used and the manifest records which.
"""

from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec.errors import UserError

BUFFER_BYTES = 16 << 20
Progress = Callable[[int], None]

try:  # xxh3_128 runs at memory speed; blake2b is the stdlib fallback (slower, same role)
    import xxhash

    HASH_NAME = "xxh3_128"
    new_hash: Callable[[], Any] = xxhash.xxh3_128
except ModuleNotFoundError:  # pragma: no cover - depends on the environment
    HASH_NAME = "blake2b-128"
    new_hash = lambda: hashlib.blake2b(digest_size=16)  # noqa: E731


@dataclass(frozen=True)
class Piece:
    """One output tensor: its header entry and where its bytes come from."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    src: Path
    offset: int  # absolute offset in src
    nbytes: int


class Sink:
    """Buffered writer that hashes exactly the bytes it writes; reads land directly in its buffer."""

    def __init__(self, path: Path, buf: memoryview, progress: Progress | None) -> None:
        self.path, self.buf, self.progress = path, buf, progress
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.pos = 0
        self.size = 0
        self.hash = new_hash()
        self.kernel_copy = True

    def put_bytes(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), len(self.buf) - self.pos)
            self.buf[self.pos: self.pos + take] = view[:take]
            self.pos += take
            view = view[take:]
            if self.pos == len(self.buf):
                self.flush()

    def put_range(self, src_fd: int, src: Path, offset: int, nbytes: int) -> None:
        """Append ``nbytes`` of ``src`` from ``offset``: each chunk is read and hashed, then copied in-kernel
        (copy_file_range, page cache to page cache) from the same source range; plain write as fallback."""
        self.flush()
        while nbytes:
            take = min(nbytes, len(self.buf))
            got = os.preadv(src_fd, [self.buf[:take]], offset)
            if got <= 0:
                raise UserError(f"{src}: ended early at byte {offset}; the file changed or is truncated, "
                                "re-download it")
            chunk = self.buf[:got]
            self.hash.update(chunk)
            self._copy(src_fd, offset, chunk)
            self.size += got
            offset += got
            nbytes -= got
            if self.progress:
                self.progress(got)

    def _copy(self, src_fd: int, offset: int, chunk: memoryview) -> None:
        done = 0
        try:
            while done < len(chunk) and self.kernel_copy:
                n = os.copy_file_range(src_fd, self.fd, len(chunk) - done, offset + done, self.size + done)
                if n <= 0:
                    break
                done += n
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF):
                raise OSError(exc.errno, exc.strerror, str(self.path)) from None
            self.kernel_copy = False
        self._write_at(chunk[done:], self.size + done)

    def _write_at(self, view: memoryview, at: int) -> None:
        try:
            while view:
                n = os.pwrite(self.fd, view, at)
                view, at = view[n:], at + n
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def flush(self) -> None:
        view = self.buf[: self.pos]
        self.hash.update(view)
        self._write_at(view, self.size)
        self.size += self.pos
        self.pos = 0

    def close(self) -> dict[str, Any]:
        self.flush()
        os.close(self.fd)
        self.fd = -1
        return {"size": self.size, HASH_NAME: self.hash.hexdigest()}

    def abort(self) -> None:
        """Close without flushing (after an error); no-op once closed."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.pos = 0


_BUFFER: memoryview | None = None


def _buffer() -> memoryview:
    global _BUFFER
    if _BUFFER is None:
        _BUFFER = memoryview(bytearray(BUFFER_BYTES))
    return _BUFFER


def write_pieces(path: Path, prefix: bytes, pieces: list[Piece], progress: Progress | None = None) -> dict[str, Any]:
    """Write ``prefix`` then each piece's source range to ``path``; return size and digest."""
    fds: dict[Path, int] = {}
    sink = Sink(path, _buffer(), progress)
    try:
        sink.put_bytes(prefix)
        for p in pieces:
            if p.src not in fds:
                fds[p.src] = os.open(p.src, os.O_RDONLY)
            sink.put_range(fds[p.src], p.src, p.offset, p.nbytes)
        return sink.close()
    finally:
        sink.abort()
        for fd in fds.values():
            os.close(fd)


def copy_file(src: Path, dst: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Copy a whole file, hashing it in the same pass."""
    fd = os.open(src, os.O_RDONLY)
    try:
        sink = Sink(dst, _buffer(), progress)
        try:
            sink.put_range(fd, src, 0, os.fstat(fd).st_size)
            return sink.close()
        finally:
            sink.abort()
    finally:
        os.close(fd)


def fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)
