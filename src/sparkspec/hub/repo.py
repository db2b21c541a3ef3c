"""A hub repo as a local directory: the files it serves, their hashes and its revision. Shared by
the hub server (:mod:`sparkspec.hub.server`) and the ``local_path`` source of ``sparkspec fetch``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkspec import outputs, validate
from sparkspec.checkpoint.selection import REVISION_FILE
from sparkspec.errors import UserError
from sparkspec.jsonfile import loads_bounded
from sparkspec.validate import COMMIT_RE

PUBLISHED_FILE = ".sparkspec-published"  # marks a repo folder ``hub publish`` made (is_published)
FETCH_STATE_DIR = ".sparkspec-fetch"  # marks a folder as ``sparkspec fetch``'s own (see hub_dest)
HASHES_FILE = ".sparkspec-hashes.json"
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx")
LFS_MIN_SIZE = 10 << 20  # the hub stores files above 10 MiB in LFS
CHUNK = 1 << 20
MAX_FILES = 100_000
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

Opener = Callable[[str], tuple[int, os.stat_result]]


def listed(rel: str) -> bool:
    """Files a repo serves: everything except this tool's own bookkeeping and local download
    caches."""
    parts = rel.split("/")
    return parts[0] not in (".cache", ".git") and not parts[-1].startswith(".sparkspec")


def served(rel: str) -> bool:
    """Files the endpoint serves: no path segment starts with '.' but ``.gitattributes`` (what hub
    repos carry), so a dot-file or dot-folder (.env, .ssh/) put into a repo is never listed nor
    sent."""
    return all(not part.startswith(".") or part == ".gitattributes" for part in rel.split("/"))


def is_published(path: Path) -> bool:
    """Whether ``path`` is a repo folder publish made: it holds publish's marker, or (made by a
    sparkspec before the marker existed) a revision file and no fetch state."""
    def regular(name: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(path / name).st_mode)
        except OSError:
            return False

    return regular(PUBLISHED_FILE) or (regular(REVISION_FILE)
                                       and not os.path.lexists(path / FETCH_STATE_DIR))


@dataclass(frozen=True)
class FileStat:
    """One version of a file: any write changes its change time, a replacement its inode."""

    size: int
    mtime_ns: int
    ctime_ns: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileStat:
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@dataclass
class Listing:
    files: dict[str, FileStat]  # repo-relative POSIX path -> stat, sorted
    unsafe: dict[str, str] = field(default_factory=dict)  # names never served or written -> why


def scan(directory: Path, follow_inside: bool = False) -> Listing:
    """The regular files under ``directory``. Symbolic links are skipped or, with
    ``follow_inside``, followed when they resolve to a regular file under ``directory``; FIFOs,
    sockets and devices are skipped; names that are not plain relative paths, and links leaving the
    folder, are set apart in ``unsafe``."""
    base = directory.resolve()
    files: dict[str, FileStat] = {}
    unsafe: dict[str, str] = {}
    stack = [("", str(directory))]
    while stack:
        prefix, folder = stack.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if not listed(rel):
                    continue
                try:
                    if entry.is_symlink():
                        if not follow_inside:
                            continue
                        if not Path(os.path.realpath(entry.path)).is_relative_to(base):
                            unsafe[rel] = "is a symbolic link leaving the folder"
                            continue
                        st = os.stat(entry.path)
                    elif entry.is_dir(follow_symlinks=False):
                        stack.append((rel + "/", entry.path))
                        continue
                    else:
                        st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed while listed
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                try:
                    validate.relpath(rel)
                except UserError:
                    unsafe[rel] = ("is not a plain relative path (letters, digits, '._+=@,-', "
                                   "no '..')")
                    continue
                files[rel] = FileStat.of(st)
                if len(files) > MAX_FILES:
                    raise UserError(f"{directory}: holds more than {MAX_FILES} files; is it "
                                    "really a repo?")
    return Listing(dict(sorted(files.items())), dict(sorted(unsafe.items())))


def open_in(directory: str | os.PathLike[str], rel: str) -> tuple[int, os.stat_result]:
    """Open the regular file ``directory/rel`` read-only, one component at a time without following
    a symbolic link below ``directory`` (no check-then-open race), never blocking on a FIFO. Returns
    the fd (the caller closes it) and its stat; raises OSError (ELOOP for a link, EINVAL for a
    non-regular file)."""
    parts = validate.relpath(rel).split("/")
    fd = os.open(directory, _DIR)
    try:
        for part in parts[:-1]:
            inner = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        leaf = os.open(parts[-1], _FILE, dir_fd=fd)
    finally:
        os.close(fd)
    st = os.fstat(leaf)
    if not stat.S_ISREG(st.st_mode):
        os.close(leaf)
        raise OSError(errno.EINVAL, "not a regular file", rel)
    os.set_blocking(leaf, True)
    return leaf, st


def check_private(path: str | os.PathLike[str], what: str) -> None:
    """Refuse a secret file that every user of the machine can read (mode o+r)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise UserError(f"{path}: cannot stat the {what} ({exc.strerror}); check the "
                        "path") from None
    if mode & 0o004:
        raise UserError(f"{path}: the {what} is readable by every user of this machine; "
                        "chmod 600 it")


def read_small(opener: Opener, rel: str, limit: int = 4096) -> bytes | None:
    """The bytes of a small bookkeeping file, or None when it is absent, not regular or too
    large."""
    try:
        fd, st = opener(rel)
    except OSError:
        return None
    try:
        return os.pread(fd, limit, 0) if st.st_size <= limit else None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Digests:
    sha256: str
    blob_id: str  # git's blob id: sha1 of "blob <size>\0" + content


def hash_fd(fd: int, size: int) -> Digests:
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
    offset = 0
    while offset < size and (chunk := os.pread(fd, min(CHUNK, size - offset), offset)):
        sha256.update(chunk)
        sha1.update(chunk)
        offset += len(chunk)
    if offset != size:
        raise OSError(errno.EIO, f"file shrank while hashed ({offset} of {size} bytes)")
    return Digests(sha256.hexdigest(), sha1.hexdigest())


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    sha256: str
    blob_id: str

    @property
    def lfs(self) -> bool:
        return is_lfs(self.path, self.size)

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": self.blob_id, "size": self.size,
                                 "path": self.path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": 134}
        return entry


def is_lfs(path: str, size: int) -> bool:
    return path.endswith(LFS_SUFFIXES) or size >= LFS_MIN_SIZE


class HashStore:
    """The digests of one repo folder's files, each computed once per :class:`FileStat` and
    persisted in ``HASHES_FILE`` (atomic replace; kept in memory only where the folder is
    read-only)."""

    def __init__(self, directory: Path, opener: Opener | None = None,
                 persist: bool = True) -> None:
        self.directory = directory
        self.persist = persist
        self.opener: Opener = opener or (lambda rel: open_in(directory, rel))
        self.lock = threading.Lock()
        self._known: dict[str, tuple[FileStat, Digests]] = {}
        self._loaded: FileStat | None = None
        self._dirty = False

    def _load(self) -> None:
        """Merge the persisted digests (another process, e.g. ``hub publish``, may have written
        them)."""
        try:
            fd, st = self.opener(HASHES_FILE)
        except OSError:
            return
        try:
            if FileStat.of(st) == self._loaded:
                return
            self._loaded = FileStat.of(st)
            doc = loads_bounded(os.pread(fd, st.st_size, 0))
        except (OSError, ValueError):
            return
        finally:
            os.close(fd)
        entries = doc.get("files") if isinstance(doc, dict) else None
        for rel, e in (entries if isinstance(entries, dict) else {}).items():
            try:
                version = FileStat(*(int(e[k]) for k in ("size", "mtime_ns", "ctime_ns", "ino")))
                digests = Digests(str(e["sha256"]), str(e["blob_id"]))
            except (KeyError, TypeError, ValueError):
                continue
            if rel not in self._known:
                self._known[rel] = (version, digests)

    def cached(self, rel: str, version: FileStat) -> Digests | None:
        with self.lock:
            hit = self._known.get(rel)
            if hit is None or hit[0] != version:
                self._load()
                hit = self._known.get(rel)
            return hit[1] if hit is not None and hit[0] == version else None

    def record(self, rel: str, version: FileStat, digests: Digests) -> None:
        with self.lock:
            self._known[rel] = (version, digests)
            self._dirty = True

    def of_fd(self, rel: str, fd: int, st: os.stat_result,
              count: Callable[[int], None]) -> Digests:
        """The digests of the open file ``rel`` (hashed from this fd only when no version
        matches)."""
        version = FileStat.of(st)
        found = self.cached(rel, version)
        if found is None:
            found = hash_fd(fd, version.size)
            count(version.size)
            self.record(rel, version, found)
        return found

    def many(self, files: Mapping[str, FileStat], rels: Iterable[str],
             count: Callable[[int], None]) -> dict[str, RepoFile]:
        """:class:`RepoFile` of each of ``rels``, hashing only the versions not seen before;
        persisted."""
        out: dict[str, RepoFile] = {}
        for rel in rels:
            digests = self.cached(rel, files[rel])
            if digests is None:
                fd, st = self.opener(rel)
                try:
                    digests = self.of_fd(rel, fd, st, count)
                finally:
                    os.close(fd)
            out[rel] = RepoFile(rel, files[rel].size, digests.sha256, digests.blob_id)
        self.save(files)
        return out

    def save(self, files: Mapping[str, FileStat]) -> None:
        """Persist the digests of ``files`` (the whole current listing: vanished files are
        dropped)."""
        with self.lock:
            if not self._dirty or not self.persist:
                return
            doc = {"files": {rel: {"size": v.size, "mtime_ns": v.mtime_ns, "ctime_ns": v.ctime_ns,
                                   "ino": v.ino, "sha256": d.sha256, "blob_id": d.blob_id}
                             for rel, (v, d) in sorted(self._known.items())
                             if files.get(rel) == v}}
            try:  # a cache: not fsynced
                outputs.write_atomic(self.directory / HASHES_FILE, json.dumps(doc).encode(),
                                     sync=False)
                self._dirty = False
            except (OSError, UserError):  # a read-only mirror or a link in the way: kept in memory
                pass


def content_revision(files: Mapping[str, RepoFile]) -> str:
    digest = hashlib.sha1()
    for rel in sorted(files):
        digest.update(f"{rel}\0{files[rel].sha256}\n".encode())
    return digest.hexdigest()


def marked_revision(opener: Opener) -> str | None:
    """The commit id in ``REVISION_FILE``, or None when it is absent or not a 40-hex commit id."""
    raw = read_small(opener, REVISION_FILE)
    value = raw.decode("ascii", "replace").strip() if raw is not None else ""
    return value if COMMIT_RE.fullmatch(value) else None
