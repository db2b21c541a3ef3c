"""The destination folder of ``sparkspec fetch``: whose it is, its resumable state, and how files
land in it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparkspec import figures, outputs, progress, stops, validate
from sparkspec.checkpoint.selection import REVISION_FILE
from sparkspec.errors import UserError, os_error
from sparkspec.hub.repo import FETCH_STATE_DIR
from sparkspec.jsonfile import loads_bounded
from sparkspec.validate import COMMIT_RE

STATE_DIR = FETCH_STATE_DIR
HF_DOWNLOADS = (".cache", "huggingface", "download")  # huggingface_hub's bookkeeping in local_dir


def claim(dest: Path, inputs: Mapping[str, str | os.PathLike[str] | None]) -> None:
    """Refuse a ``--dest`` that is a link or no folder, equals, holds or sits inside an input, or
    holds files no fetch wrote (no ``.sparkspec-fetch``)."""
    validate.check_not_symlink(dest, "--dest")
    validate.check_disjoint(dest, inputs, out_flag="--dest")
    if not os.path.lexists(dest):
        return
    if not dest.is_dir():
        raise UserError(f"--dest {dest}: exists and is not a folder; choose a folder for the "
                        "download")
    state = dest / STATE_DIR
    if state.is_dir() and not state.is_symlink():
        _refuse_links(dest)
        return
    try:
        with os.scandir(dest) as entries:
            empty = next(entries, None) is None
    except OSError as exc:
        raise os_error(exc, dest, "check --dest and its permissions") from None
    if not empty:
        raise UserError(f"--dest {dest}: holds files that `sparkspec fetch` did not write "
                        f"(no {STATE_DIR}); choose a new or empty folder")


def _refuse_links(dest: Path) -> None:
    """A fetch's own folder holds no symbolic link: it never makes one, and writing through one (a
    planted ``.cache`` or shard name) would land outside ``--dest``."""
    for top, dirs, files in os.walk(dest, onerror=None, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(top, name)
            if path.is_symlink():
                raise UserError(f"--dest {dest}: holds the symbolic link {path}, which a fetch "
                                "never makes; remove it (a fetch writes through no link)")


@dataclass(frozen=True)
class Item:
    """One fetch of a batch (or a fetch alone, as a batch of one): what it writes and what it
    reads."""

    number: int  # 1-based position in --items
    dest: str
    inputs: dict[str, str] = field(default_factory=dict)  # flag (--int4, --local-path) -> path
    argv: tuple[str, ...] = ()

    def label(self) -> str:
        return f"item {self.number}"


def _relation(a: str, b: str) -> str | None:
    """How ``a`` lies to ``b`` (resolved real paths): "is", "is inside", "holds" or None
    (apart)."""
    ra, rb = validate.real(a), validate.real(b)
    if ra == rb:
        return "is"
    if ra.is_relative_to(rb):
        return "is inside"
    if rb.is_relative_to(ra):
        return "holds"
    return None


def check_batch(items: Sequence[Item], progress_file: str | None = None) -> None:
    """The items of a batch checked against each other before anything is fetched or created: no
    item repeated, no two writing the same or nested folders, no folder written inside or around
    another item's input, and an input that another item fetches (an FP8 subset's ``--int4``)
    fetched before it is read; the progress file apart from every folder read or written. Then each
    item's own ``--dest`` is claimed (:func:`claim`). One line naming the items and the fix."""
    for j, b in enumerate(items):
        for a in items[:j]:
            if a.argv and a.argv == b.argv:
                raise UserError(f"--items: {b.label()} repeats {a.label()}; drop one of them")
            how = _relation(b.dest, a.dest)
            if how == "is":
                raise UserError(f"--items: items {a.number} and {b.number} both write --dest "
                                f"{b.dest}; give each item its own --dest")
            if how:
                raise UserError(f"--items: {b.label()}'s --dest {b.dest} {how} {a.label()}'s "
                                f"--dest {a.dest}; give each item a folder of its own, apart from "
                                "the others")
    fetched_before: set[tuple[int, str]] = set()
    for b in items:
        for flag, path in b.inputs.items():
            for a in items:
                how = None if a is b else _relation(a.dest, path)
                if how == "is" and a.number < b.number:
                    fetched_before.add((b.number, flag))  # read once that item completed it
                    continue
                if how is None:
                    continue
                if how == "is":
                    raise UserError(f"--items: {b.label()} reads {flag} {path}, which "
                                    f"{a.label()} fetches only after it; put {a.label()} before "
                                    f"{b.label()}")
                raise UserError(f"--items: {a.label()}'s --dest {a.dest} {how} {b.label()}'s "
                                f"{flag} {path}; keep every --dest apart from the folders other "
                                "items read")
    progress.check_apart(progress_file, [
        (f"{flag} {path}" + (f" of {item.label()}" if len(items) > 1 else ""), path)
        for item in items for flag, path in [("--dest", item.dest), *item.inputs.items()]])
    for item in items:
        claim(Path(item.dest), dict(item.inputs))
        for flag, path in item.inputs.items():
            if (item.number, flag) not in fetched_before:
                _check_input(flag, Path(path))


def _check_input(flag: str, path: Path) -> None:
    """An input no earlier item fetches is there now (``--int4``: its index read and checked), so
    that a batch does not stop half way on an input it could have named at the start."""
    from sparkspec.checkpoint.safetensors_io import read_index

    if flag == "--int4":
        read_index(path)
    elif not path.is_dir():
        raise UserError(f"{flag} {path}: not a directory; point it at a copy of the repo (or "
                        "fetch it in an earlier item)")


@contextlib.contextmanager
def writing(dest: Path) -> Iterator[None]:
    """Mark ``dest`` as this fetch's own, then run the fetch; afterwards remove huggingface_hub's
    lock files and, after a failure, its partial downloads and a folder this run created that holds
    nothing finished. An OSError becomes one line (exit 1 for a full disk or an I/O error, else
    2)."""
    created = not os.path.lexists(dest)
    try:
        (dest / STATE_DIR).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(exc, dest, "choose a writable --dest") from None
    try:
        yield
    except BaseException as exc:
        _tidy(dest, failed=True, created=created)
        if isinstance(exc, OSError):
            raise os_error(exc, dest,
                           "check --dest and its permissions, then re-run to resume") from None
        raise
    _tidy(dest, failed=False, created=created)


def _tidy(dest: Path, failed: bool, created: bool) -> None:
    downloads = dest.joinpath(*HF_DOWNLOADS)
    if downloads.is_dir() and not downloads.is_symlink():
        for lock in downloads.rglob("*.lock"):
            _unlink_unlocked(lock)
        if failed:
            for partial in downloads.rglob("*.incomplete"):
                with contextlib.suppress(OSError):
                    partial.unlink()
    # nothing finished (finished files land at the top): nothing to resume from
    if failed and created:
        with contextlib.suppress(OSError):
            if {p.name for p in dest.iterdir()} <= {STATE_DIR, ".cache"}:
                shutil.rmtree(dest)


def _unlink_unlocked(path: Path) -> None:
    """Remove a lock file unless another process holds it (then it is theirs)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink()
    except OSError:
        pass
    finally:
        os.close(fd)


def preflight(dest: Path, needed: int) -> None:
    probe = dest
    while not probe.exists():
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError as exc:
        raise os_error(exc, probe, "check --dest") from None
    if needed > free:
        raise UserError(f"{dest}: needs {figures.size(needed)} free for the download but {probe} "
                        f"has {figures.size(free)}; free space or choose another destination")


# --- resumable state -----------------------------------------------------------------------------
def state(dest: Path) -> dict[str, Any]:
    """The state an earlier fetch recorded in ``dest`` ({} when none, or when it is not a JSON
    object)."""
    try:
        doc = loads_bounded(validate.read_regular(dest / STATE_DIR / "fetch.json", "fetch state",
                                                  16 << 20))
    except (UserError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def save_state(dest: Path, doc: dict[str, Any]) -> None:
    write_file(dest, f"{STATE_DIR}/fetch.json",
               [json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"], sync=False)


def finish(dest: Path, doc: dict[str, Any]) -> None:
    """Record a completed fetch; ``.sparkspec-revision`` names the commit for assemble's manifest
    (and lets the directory serve as a ``local_path`` source or be published with that revision)."""
    save_state(dest, {**doc, "complete": True})
    marker = dest / REVISION_FILE
    try:
        current = (validate.read_regular(marker, "revision file", 4096)
                   .decode("ascii", "replace").strip())
    except UserError:
        current = None
    if COMMIT_RE.fullmatch(doc["commit"]) and current != doc["commit"]:
        write_file(dest, REVISION_FILE, [doc["commit"].encode() + b"\n"])


def begin(dest: Path, key: str, sizes: dict[str, int]) -> dict[str, int]:
    """Record a fetch as started; return the files still to transfer. Files are renamed into place
    only when complete, so one of the right size left by an earlier run of the same ``key`` is done;
    files from a run with another key (commit, mode, selection) are removed first (``dest`` is a
    fetch's own folder)."""
    before = state(dest)
    if before.get("key") != key:
        for rel in sizes:
            with contextlib.suppress(FileNotFoundError):
                validate.under(dest, rel).unlink()
    written = set(recorded_shards(before)) | set(sizes)
    save_state(dest, {"key": key, "complete": False, "shards": sorted(written)})
    return {rel: size for rel, size in sizes.items()
            if not ((dest / rel).is_file() and (dest / rel).stat().st_size == size)}


def recorded_shards(doc: dict[str, Any]) -> list[str]:
    """The shard names an earlier run recorded as written (valid names only)."""
    names = doc.get("shards")
    out = []
    for name in names if isinstance(names, list) else []:
        with contextlib.suppress(UserError):
            out.append(validate.relpath(name))
    return out


def remove_stale(dest: Path, previous: Iterable[str], keep: set[str]) -> None:
    """Remove the shards an earlier run of this fetch wrote that the current selection no longer
    has."""
    for name in previous:
        if name not in keep:
            with contextlib.suppress(FileNotFoundError):
                validate.under(dest, name).unlink()


def prune(folder: Path, keep: Path) -> None:
    """Remove every entry of ``folder`` (a folder of the fetch's state) but ``keep``; links are
    unlinked, never followed."""
    if not folder.is_dir() or folder.is_symlink():
        return
    for old in folder.iterdir():
        if old == keep:
            continue
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()


def write_file(dest: Path, rel: str, parts: Iterable[bytes], sync: bool = True) -> int:
    """Write ``rel`` from ``parts`` atomically (:func:`sparkspec.outputs.atomic`: a hidden temp
    sibling, fsynced with ``sync``, renamed when complete); return bytes written. The temp file
    never outlives a failure (a network error while ``parts`` streams included)."""
    target = validate.under(dest, rel)
    written = 0
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with outputs.atomic(target, sync=sync, flag="--dest file") as fh:
            for part in parts:
                written += fh.write(part)
            stops.check()
    except OSError as exc:
        raise os_error(exc, target,
                       "fix the permissions of --dest, then re-run to resume") from None
    return written


def copy_local(src: Path, target: Path) -> None:
    """Hard-link when on the same filesystem (no bytes duplicated), else copy; through a temp +
    rename."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        outputs.link_or_copy(src, target, mode=0o644)
    except OSError as exc:
        raise os_error(exc, target, f"check --dest and --local-path {src.parent}") from None
