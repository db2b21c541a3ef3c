"""add-mtp: register the MTP head of ``model_extra_tensors.safetensors``
in the target's index, so that vLLM loads it; the target is a hybrid
that ``checkpoint assemble`` wrote, and a failure leaves it as it was.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec import stops
from sparkspec.checkpoint.manifest import TOOL, is_current, load, owned, record
from sparkspec.checkpoint.safetensors_io import (
    INDEX_NAME,
    Header,
    check_unique,
    read_header,
    read_index,
    stage_index,
)
from sparkspec.checkpoint.selection import EXTRA_FILE
from sparkspec.checkpoint.stream import HASH_NAME, copy_file
from sparkspec.errors import UserError, os_error
from sparkspec.outputs import (
    check_disjoint,
    check_not_symlink,
    commit,
    fsync_dir,
    fsync_path,
    temp_name,
)
from sparkspec.validate import source_file


@dataclass
class MtpResult:
    changed: bool
    target: Path
    mtp_tensors: int
    file_action: str  # "kept", "linked", "copied" or "recorded" (an older hybrid's files, once)
    total_size: int

    def as_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "target": str(self.target),
                "mtp_tensors": self.mtp_tensors, "file": self.file_action,
                "total_size": self.total_size}


def _same_file(src: Path, dst: Path, src_header: Header) -> bool:
    if not dst.is_file() or dst.is_symlink():
        return False
    if os.path.samefile(src, dst):
        return True
    s, d = src.stat(), dst.stat()
    if s.st_size != d.st_size or s.st_mtime_ns != d.st_mtime_ns:
        return False
    try:
        return read_header(dst).tensors == src_header.tensors
    except UserError:
        return False


def _stage_file(src: Path, tmp: Path) -> str:
    """Hard-link or copy ``src`` to the fresh temp name ``tmp``; return which."""
    try:
        os.link(src.resolve(), tmp)
        return "linked"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.ENOTSUP):
            raise
    copy_file(src, tmp)
    shutil.copystat(src, tmp)  # same mtime: a later run recognises the copy
    fsync_path(tmp)
    return "copied"


def check_source(source: Path) -> tuple[Path, Header, list[str]]:
    """add-mtp's checks of ``--source``: its model_extra_tensors.safetensors
    holds mtp.* tensors only; the file, its header and the MTP tensor names.
    ``build`` runs them before it writes anything."""
    if not source.is_dir():
        raise UserError(f"--source {source}: not a folder; point it at the INT4 checkpoint "
                        "download")
    src = source / EXTRA_FILE
    if not os.path.lexists(src):
        raise UserError(f"{src}: not found; the MTP head ships in this file: point --source at the "
                        "INT4 checkpoint download (or re-fetch it)")
    # before reading it: a link out of --source is refused unread
    source_file(source, src, "--source")
    header = read_header(src)
    names = [n for n in header.tensors if n.startswith("mtp.")]
    if not names:
        raise UserError(f"{src}: holds no mtp.* tensor; re-fetch the INT4 checkpoint")
    others = [n for n in header.tensors if not n.startswith("mtp.")]
    if others:
        raise UserError(f"{src}: also holds {len(others)} non-MTP tensors (e.g. {others[0]}) that "
                        "vLLM would read once the index names the file; use an unmodified "
                        "model_extra_tensors file")
    return src, header, names


def _validated(source: Path, target: Path
               ) -> tuple[Path, Header, list[str], dict[str, Any], dict[str, Any]]:
    check_disjoint(target, {"--source": source}, "--target")
    check_not_symlink(target, "--target")
    if not target.is_dir():
        raise UserError(f"--target {target}: not a folder; point it at the hybrid `checkpoint "
                        "assemble` wrote")
    if not owned(target):
        raise UserError(f"--target {target} was not written by {TOOL}; add-mtp registers the head "
                        "in an assembled hybrid only: assemble first, then point --target at its "
                        "--out")
    manifest = load(target)
    src, header, names = check_source(source)
    return src, header, names, read_index(target), manifest


def add_mtp(source: Path, target: Path) -> MtpResult:
    """Register the head; afterwards the manifest records the head file and the index as they are on
    disk (a no-op checks those records as assemble's no-op checks the shards; a file whose record no
    longer matches is placed, or the index written, again)."""
    source, target = Path(source), Path(target)
    src, header, names, doc, manifest = _validated(source, target)
    weight_map: dict[str, str] = dict(doc["weight_map"])
    new_map = {t: f for t, f in weight_map.items() if f != EXTRA_FILE or t in header.tensors}
    new_map.update({n: EXTRA_FILE for n in names})
    headers: dict[str, Header] = {EXTRA_FILE: header}
    for file in sorted(set(new_map.values()) - {EXTRA_FILE}):
        headers[file] = read_header(target / file)
    check_unique(target, headers, "re-run checkpoint assemble (or re-fetch the INT4 source)")
    total = 0
    for tensor, file in new_map.items():
        info = headers[file].tensors.get(tensor)
        if info is None:
            raise UserError(f"{target / INDEX_NAME}: maps {tensor} to {file}, which has no such "
                            "tensor; re-run checkpoint assemble")
        total += info.nbytes
    metadata = doc.get("metadata") or {}
    recorded = manifest["outputs"]
    dst = target / EXTRA_FILE
    # a recorded file that changed since is not trusted,
    # whatever it looks like: placed or written again
    index_changed = (new_map != weight_map or metadata.get("total_size") != total
                     or (INDEX_NAME in recorded and HASH_NAME in recorded[INDEX_NAME]
                         and not is_current(target, manifest, INDEX_NAME)))
    place = not _same_file(src, dst, header) or (EXTRA_FILE in recorded
                                                 and not is_current(target, manifest, EXTRA_FILE))
    covered = all(is_current(target, manifest, n) for n in (EXTRA_FILE, INDEX_NAME))
    if not (index_changed or place or covered):
        # an older hybrid: its files recorded once
        record(target, manifest, [EXTRA_FILE, INDEX_NAME])
        return MtpResult(True, target, len(names), "recorded", total)
    if not (index_changed or place):
        return MtpResult(False, target, len(names), "kept", total)
    action = _commit(src, dst, target, new_map, total, metadata, place, index_changed)
    record(target, manifest, [EXTRA_FILE, INDEX_NAME])
    return MtpResult(True, target, len(names), action, total)


def _commit(src: Path, dst: Path, target: Path, new_map: dict[str, str], total: int,
            metadata: dict[str, Any], place: bool, index_changed: bool) -> str:
    """Stage the file and the index as hidden temps, then rename both into place, the index last; on
    any failure remove what was staged (and a file placed for an index that could not follow)."""
    tmp_file = temp_name(dst)
    tmp_index: Path | None = None
    existed = os.path.lexists(dst)
    placed = False
    action = "kept"
    try:
        if place:
            action = _stage_file(src, tmp_file)
        if index_changed:
            tmp_index = stage_index(target, new_map, total, {k: v for k, v in metadata.items()
                                                             if k != "total_size"})
        stops.check()
        if place:
            commit(tmp_file, dst, sync=False)
            placed = True
        if tmp_index is not None:
            commit(tmp_index, target / INDEX_NAME, sync=False)
            tmp_index = None
        fsync_dir(target)
    except OSError as exc:
        if placed and not existed:
            dst.unlink(missing_ok=True)
        raise os_error(exc, dst, "re-run add-mtp") from None
    finally:
        tmp_file.unlink(missing_ok=True)
        if tmp_index is not None:
            tmp_index.unlink(missing_ok=True)
    return action
