"""The simulation's publisher: copy a generated checkpoint in as ``ROOT/<org>/<name>`` of the hub
the simulated Spark fetches from (``sparkspec hub serve``), set its revision and mark it to be
served.

Development tooling, not shipped: a site marks the folders it serves by hand (docs/hub.md). Nothing
that publish did not create is ever moved or removed: the repo id is validated (no path of its own),
``--from`` may neither equal, hold nor sit inside the root, a symbolic link is never replaced, and
an existing repo folder is replaced only when it carries publish's marker
(``.sparkspec-published``), by renaming a staging folder that this run created under a fresh name.
Files are hashed while they are copied, so the endpoint never hashes a published file again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import uuid
from pathlib import Path

from sparkspec import stops, validate
from sparkspec.checkpoint.selection import REVISION_FILE
from sparkspec.errors import UserError, os_error
from sparkspec.hub.repo import (
    CHUNK,
    PUBLISHED_FILE,
    Digests,
    FileStat,
    HashStore,
    Listing,
    RepoFile,
    content_revision,
    hash_fd,
    is_published,
    listed,
    marked_revision,
    scan,
)


def publish(root: str | os.PathLike[str], repo_id: str, source: str | os.PathLike[str],
            revision: str | None = None) -> tuple[bool, str, dict[str, RepoFile]]:
    """Copy ``source`` in as ``root/<repo_id>`` (atomic swap) and set its revision; return
    (changed, revision, files). Unchanged content and revision: a no-op. Bad input raises UserError
    before anything is written; a failure while writing removes what this run wrote."""
    repo_id = validate.repo_id(repo_id, "--repo")
    if revision is not None:
        validate.commit(revision, "--revision")
    org, name = repo_id.split("/")
    src, base = Path(source), Path(root)
    if not src.is_dir():
        raise UserError(f"--from {src}: not a directory; point --from at a checkpoint directory")
    validate.check_disjoint(base, {"--from": src}, out_flag="--root")
    folder, target = base / org, base / org / name
    for path in (folder, target):
        if path.is_symlink():
            raise UserError(f"{path} is a symbolic link; publish replaces only folders it made, "
                            "so remove the link or choose another --repo")
    for path in (base, folder, target):
        if os.path.lexists(path) and not path.is_dir():
            raise UserError(f"{path} exists and is not a folder; move it away or choose another "
                            "--root/--repo")
    try:
        wanted = scan(src)
        unsafe = {**_skipped(src), **wanted.unsafe}
    except OSError as exc:
        raise UserError(f"--from {src}: cannot list ({exc.strerror}); "
                        "check its permissions") from None
    for rel, why in sorted(unsafe.items()):
        raise UserError(f"--from {src}: {rel!r} {why}; the hub serves only regular files with "
                        "plain names, so replace it by a copy of the file, or rename or remove it")
    try:
        current = _current(target, wanted, src, revision)
        if current is not None:
            return False, *current
        return True, *_replace(folder, target, repo_id, src, wanted, revision)
    except OSError as exc:
        raise os_error(exc, target, "check the paths and their permissions") from None


def _skipped(src: Path) -> dict[str, str]:
    """What ``scan`` skips and a publish must not leave out silently: links, and entries that are
    neither a regular file nor a folder (the repo's listing rules apply first)."""
    out: dict[str, str] = {}
    for top, dirs, files in os.walk(src):   # never follows a linked folder
        for name in dirs + files:
            rel = os.path.relpath(os.path.join(top, name), src).replace(os.sep, "/")
            if not listed(rel):
                continue
            mode = os.lstat(os.path.join(top, name)).st_mode
            if stat.S_ISLNK(mode):
                out[rel] = "is a symbolic link"
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                out[rel] = "is not a regular file (a FIFO, socket or device)"
    return out


def _current(target: Path, wanted: Listing, src: Path, revision: str | None
             ) -> tuple[str, dict[str, RepoFile]] | None:
    """(revision, files) of ``target`` when it already holds ``wanted`` at the wanted revision
    (nothing to write); None when there is no target yet, or a target of publish's that differs. A
    differing target without publish's marker is refused (nothing is ever written into it, hashes
    included)."""
    if not target.exists():
        return None
    ours = is_published(target)
    have = scan(target)
    if {k: v.size for k, v in have.files.items()} == {k: v.size for k, v in wanted.files.items()}:
        store = HashStore(target, persist=ours)
        files = store.many(have.files, have.files, lambda n: None)
        source = _hash_source(src, wanted)
        current = marked_revision(store.opener)
        if all(files[rel].sha256 == source[rel].sha256 for rel in files) and current is not None \
                and current == (revision or content_revision(files)):
            return current, files
    if not ours:
        raise UserError(f"{target} exists and was not published by this publisher (no "
                        f"{PUBLISHED_FILE}); move it away or choose another --repo")
    return None


def _hash_source(src: Path, wanted: Listing) -> dict[str, RepoFile]:
    out = {}
    for rel, version in wanted.files.items():
        fd = validate.open_regular(validate.under(src, rel), "file to publish")
        try:
            digests = hash_fd(fd, version.size)
        finally:
            os.close(fd)
        out[rel] = RepoFile(rel, version.size, digests.sha256, digests.blob_id)
    return out


def _copy(src: Path, rel: str, dst: Path) -> Digests:
    """Copy ``src/rel`` into the new file ``dst``, hashing the bytes as they pass (one read of the
    source)."""
    fd = validate.open_regular(validate.under(src, rel), "file to publish")
    try:
        size = os.fstat(fd).st_size
        sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % size)
        dst.parent.mkdir(parents=True, exist_ok=True)
        with open(dst, "xb") as out:
            copied = 0
            while chunk := os.read(fd, CHUNK):
                sha256.update(chunk)
                sha1.update(chunk)
                out.write(chunk)
                copied += len(chunk)
        if copied != size:
            raise OSError(errno.EIO, f"changed size while copied ({copied} of {size} bytes)",
                          str(src / rel))
    finally:
        os.close(fd)
    return Digests(sha256.hexdigest(), sha1.hexdigest())


def _replace(folder: Path, target: Path, repo_id: str, src: Path, wanted: Listing,
             revision: str | None) -> tuple[str, dict[str, RepoFile]]:
    made: list[Path] = []  # the folders this run creates (the root, the org), outermost first
    missing = folder
    while not missing.exists():
        made.insert(0, missing)
        missing = missing.parent
    folder.mkdir(parents=True, exist_ok=True)
    try:
        staging = _fresh(folder, f".{target.name}.publishing")
    except OSError:
        _unmake(made)
        raise
    try:
        digests = {rel: _copy(src, rel, staging / rel) for rel in wanted.files}
        files = {rel: RepoFile(rel, wanted.files[rel].size, d.sha256, d.blob_id)
                 for rel, d in digests.items()}
        new_revision = revision or content_revision(files)
        (staging / REVISION_FILE).write_text(new_revision + "\n")
        (staging / PUBLISHED_FILE).write_text(
            json.dumps({"repo": repo_id, "revision": new_revision}) + "\n")
        store = HashStore(staging)
        staged = {rel: FileStat.of(os.stat(staging / rel)) for rel in wanted.files}
        for rel, version in staged.items():
            store.record(rel, version, digests[rel])
        store.save(staged)
        stops.check()
        if target.exists():
            old = _fresh(folder, f".{target.name}.old")
            # a folder onto the fresh empty one: the former repo, ours by its marker
            os.replace(target, old)
            try:
                os.replace(staging, target)
            except OSError:
                os.replace(old, target)
                raise
            # published; a leftover is hidden and marked as ours
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _unmake(made)
        raise
    return new_revision, files


def _unmake(made: list[Path]) -> None:
    """Remove the folders this run made (innermost first), where they are still empty."""
    for path in reversed(made):
        with contextlib.suppress(OSError):
            path.rmdir()


def _fresh(folder: Path, prefix: str) -> Path:
    """A new empty folder under a name nobody else has (mkdir fails rather than take an existing
    one)."""
    path = folder / f"{prefix}-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    return path
