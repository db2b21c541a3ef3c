"""A hub repo as a local directory: the files it serves, their hashes and its revision.

Shared by the server (:mod:`sparkspec.hubserver`), ``hub publish`` and the ``local_path`` source of
``sparkspec fetch`` (:mod:`sparkspec.hub_source`). The revision is the 40-hex commit id in
``.sparkspec-revision`` or, without that file, one derived from the files' content.
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REVISION_FILE = ".sparkspec-revision"
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5", ".onnx")
LFS_MIN_SIZE = 10 << 20  # the hub stores files above 10 MiB in LFS
CHUNK = 1 << 20
_HASH_CACHE: dict[tuple[str, int, int], tuple[str, str]] = {}  # (path, size, mtime_ns) -> (sha256, blob sha1)
_HASH_LOCK = threading.Lock()


def listed(rel: str) -> bool:
    """Files a repo serves: everything except this server's own bookkeeping and local download caches."""
    parts = rel.split("/")
    return parts[0] not in (".cache", ".git") and not parts[-1].startswith(".sparkspec")


def _hashes(path: Path) -> tuple[str, str]:
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _HASH_LOCK:
        if key in _HASH_CACHE:
            return _HASH_CACHE[key]
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % st.st_size)
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            sha256.update(chunk)
            sha1.update(chunk)
    value = (sha256.hexdigest(), sha1.hexdigest())
    with _HASH_LOCK:
        _HASH_CACHE[key] = value
    return value


@dataclass(frozen=True)
class RepoFile:
    path: str
    size: int
    sha256: str
    blob_id: str

    @property
    def lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES) or self.size >= LFS_MIN_SIZE

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.blob_id

    def tree_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"type": "file", "oid": self.blob_id, "size": self.size, "path": self.path}
        if self.lfs:
            entry["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": 134}
        return entry


def scan_repo(directory: Path) -> dict[str, RepoFile]:
    files: dict[str, RepoFile] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        rel = path.relative_to(directory).as_posix()
        if listed(rel):
            sha256, blob_id = _hashes(path)
            files[rel] = RepoFile(rel, path.stat().st_size, sha256, blob_id)
    return files


def content_revision(files: dict[str, RepoFile]) -> str:
    digest = hashlib.sha1()
    for rel in sorted(files):
        digest.update(f"{rel}\0{files[rel].sha256}\n".encode())
    return digest.hexdigest()


def repo_revision(directory: Path, files: dict[str, RepoFile] | None = None) -> str:
    marker = directory / REVISION_FILE
    if marker.is_file():
        value = marker.read_text().strip()
        if COMMIT_RE.fullmatch(value):
            return value
    return content_revision(files if files is not None else scan_repo(directory))
