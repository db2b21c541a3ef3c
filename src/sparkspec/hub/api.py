"""What the hub endpoint answers about a repo: request paths split into validated segments, the repo
found without following links, and the hub's JSON documents (model info, tree, paths-info) listing
only the repo's own files. The HTTP side is :mod:`sparkspec.hub.server`.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec import validate
from sparkspec.errors import UserError
from sparkspec.hub.repo import (
    FileStat,
    HashStore,
    RepoFile,
    content_revision,
    is_published,
    listed,
    marked_revision,
    open_in,
    scan,
    served,
)


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str,
                 commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


def not_found() -> HubError:
    return HubError(404, None, "Not Found")

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def header_text(value: str) -> str:
    """A header value that cannot break the response: printable ASCII only, at most 300
    characters."""
    return "".join(c if " " <= c <= "~" else "?" for c in value)[:300]


def segments(target: str) -> list[str]:
    """The decoded segments of a request path. A segment that decodes to '/', '\\', a control
    character, '.', '..' or nothing (but for one trailing slash), or that is not UTF-8, is a 404."""
    if not target.startswith("/"):
        raise not_found()
    raw = target[1:].split("/")
    if len(raw) > 1 and raw[-1] == "":
        raw.pop()
    out = []
    for seg in raw:
        try:
            text = urllib.parse.unquote(seg, errors="strict")
        except UnicodeDecodeError:
            raise not_found() from None
        if text in ("", ".", "..") or "/" in text or "\\" in text or _CONTROL.search(text):
            raise not_found()
        out.append(text)
    return out


@dataclass
class Snapshot:
    repo_id: str
    directory: Path
    files: dict[str, FileStat]  # the repo's served files
    store: HashStore
    commit: str
    count: Callable[[int], None]  # adds hashed bytes to the server's stats

    def entries(self, rels: Iterable[str]) -> dict[str, RepoFile]:
        return self.store.many(self.files, rels, self.count)


class Repos:
    """The repos under ``root`` (``root/<org>/<name>``) and their hash stores, one per repo."""

    def __init__(self, root: Path, count: Callable[[int], None]) -> None:
        self.root = root
        self.count = count
        self._stores: dict[tuple[str, str], HashStore] = {}
        self._lock = threading.Lock()

    def snapshot(self, org: str, name: str, revision: str) -> Snapshot:
        """The repo ``org/name`` at ``revision`` ('main' or its commit id); 404 for anything else.
        ``org`` and ``name`` must be real folders (not links) directly under the root, and the repo
        folder must be marked to be served (:func:`is_published`): any other folder (``--root /``
        holds /home/al) is not a repo, and nothing is written into it. Names with a dot-segment (but
        .gitattributes) are not the repo's files."""
        try:
            repo_id = validate.repo_id(f"{org}/{name}")
        except UserError:
            raise HubError(404, "RepoNotFound", "Repository not found") from None
        directory = self.root / org / name
        try:
            if not all(stat.S_ISDIR(os.lstat(p).st_mode) for p in (directory.parent, directory)):
                raise FileNotFoundError(directory)
            if not is_published(directory):
                raise FileNotFoundError(directory)
            files = {rel: v for rel, v in scan(directory).files.items() if served(rel)}
        except (OSError, UserError):
            raise HubError(404, "RepoNotFound", "Repository not found") from None
        with self._lock:
            store = self._stores.get((org, name))
            if store is None:
                store = HashStore(directory,
                                  lambda rel: open_in(self.root, f"{org}/{name}/{rel}"))
                self._stores[(org, name)] = store
        snap = Snapshot(repo_id, directory, files, store, "", self.count)
        snap.commit = marked_revision(store.opener) or content_revision(snap.entries(files))
        if revision not in ("main", snap.commit):
            try:
                validate.revision(revision)
                message = f"Invalid rev id: {revision}"
            except UserError:
                message = "Invalid rev id"
            raise HubError(404, "RevisionNotFound", message)
        return snap

    def names(self) -> list[str]:
        """The ids of the repos served under the root (marked folders with valid names), sorted."""
        out = []
        for org in _folders(self.root):
            for name in _folders(self.root / org):
                try:
                    repo_id = validate.repo_id(f"{org}/{name}")
                except UserError:
                    continue
                if is_published(self.root / repo_id):
                    out.append(repo_id)
        return sorted(out)

    def open(self, snap: Snapshot, rel: str) -> tuple[int, os.stat_result]:
        """The open fd and stat of the repo's own file ``rel``; 404 for any other name, or for a
        file that became a link, a folder or a FIFO since it was listed."""
        missing = HubError(404, "EntryNotFound", "Entry not found", snap.commit)
        if rel not in snap.files:
            raise missing
        try:
            return open_in(self.root, f"{snap.repo_id}/{rel}")
        except (OSError, UserError):
            raise missing from None

    @staticmethod
    def model_info(snap: Snapshot, blobs: bool) -> dict[str, Any]:
        """Siblings by name; their sizes and hashes only with ``blobs`` (the only case that
        hashes)."""
        entries = snap.entries(snap.files) if blobs else {}
        siblings: list[dict[str, Any]] = []
        for rel in snap.files:
            sibling: dict[str, Any] = {"rfilename": rel}
            if blobs:
                entry = entries[rel]
                sibling.update(size=entry.size, blobId=entry.blob_id)
                if entry.lfs:
                    sibling["lfs"] = {"sha256": entry.sha256, "size": entry.size,
                                      "pointerSize": 134}
            siblings.append(sibling)
        repo_id, commit = snap.repo_id, snap.commit
        return {"_id": commit[:24], "id": repo_id, "modelId": repo_id,
                "author": repo_id.split("/")[0], "sha": commit, "private": False, "gated": False,
                "disabled": False, "downloads": 0, "likes": 0, "tags": [], "siblings": siblings,
                "usedStorage": sum(v.size for v in snap.files.values())}

    @staticmethod
    def tree(snap: Snapshot, prefix: str, recursive: bool) -> list[dict[str, Any]]:
        """The repo's own files and folders under ``prefix`` (a validated relative path, or
        none)."""
        if prefix:
            try:
                validate.relpath(prefix)
            except UserError:
                raise HubError(404, "EntryNotFound", "Entry not found", snap.commit) from None
        base = prefix + "/" if prefix else ""
        if base and not any(rel.startswith(base) for rel in snap.files):
            raise HubError(404, "EntryNotFound", f"{prefix} does not exist", snap.commit)
        folders: dict[str, None] = {}
        wanted: list[str] = []
        for rel in snap.files:
            if not rel.startswith(base):
                continue
            rest = rel[len(base):].split("/")
            for depth in range(1, len(rest) if recursive else min(len(rest), 2)):
                folders.setdefault(base + "/".join(rest[:depth]))
            if recursive or len(rest) == 1:
                wanted.append(rel)
        entries = snap.entries(wanted)
        out = [_folder(path) for path in folders]
        return out + [entries[rel].tree_entry() for rel in wanted]

    @staticmethod
    def paths_info(snap: Snapshot, paths: list[str]) -> list[dict[str, Any]]:
        """Entries for the asked paths that are the repo's own files or folders; others are left
        out."""
        out: list[dict[str, Any]] = []
        for path in paths[:10_000]:
            path = path.strip("/")
            if not path or not listed(path):
                continue
            try:
                validate.relpath(path)
            except UserError:
                continue
            if path in snap.files:
                out.append(snap.entries([path])[path].tree_entry())
            elif any(rel.startswith(path + "/") for rel in snap.files):
                out.append(_folder(path))
        return out


def _folders(path: Path) -> list[str]:
    """The names of the real folders (not links) directly in ``path``; none when it cannot be
    listed."""
    try:
        with os.scandir(path) as entries:
            return [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def _folder(path: str) -> dict[str, Any]:
    return {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0,
            "path": path}
