"""add-mtp: register the MTP head of ``model_extra_tensors.safetensors`` in the target's index.

vLLM reads only the files that ``model.safetensors.index.json`` names; an MTP head that the index does
not map is never loaded and the drafter runs on uninitialised weights without any error. The tensor list
comes from the extra file's own header (source indexes in the wild do and do not list it). The file is
hard-linked when source and target share a filesystem, else copied; both land via temp + rename, and the
index is rewritten atomically only when something changed.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkspec.ckpt_select import EXTRA_FILE
from sparkspec.ckpt_stream import copy_file, fsync_dir, fsync_path
from sparkspec.errors import UserError
from sparkspec.safetensors_io import INDEX_NAME, Header, read_header, read_index, write_index


@dataclass
class MtpResult:
    changed: bool
    target: Path
    mtp_tensors: int
    file_action: str  # "kept", "linked" or "copied"
    total_size: int

    def as_dict(self) -> dict[str, Any]:
        return {"changed": self.changed, "target": str(self.target), "mtp_tensors": self.mtp_tensors,
                "file": self.file_action, "total_size": self.total_size}


def _same_file(src: Path, dst: Path, src_header: Header) -> bool:
    if not dst.is_file():
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


def _place(src: Path, dst: Path) -> str:
    """Hard-link or copy ``src`` to ``dst`` via a temp sibling; return which."""
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src.resolve(), tmp)
        action = "linked"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES, errno.ENOTSUP):
            raise
        try:
            copy_file(src, tmp)
            shutil.copystat(src, tmp)  # same mtime: a later run recognises the copy
            fsync_path(tmp)
        except OSError as copy_exc:
            tmp.unlink(missing_ok=True)
            if copy_exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise UserError(f"{dst}: no space left on device while copying the MTP head; free space "
                                "on the target's filesystem") from None
            raise UserError(f"{dst}: {copy_exc.strerror}; check the target directory") from None
        action = "copied"
    os.replace(tmp, dst)
    fsync_dir(dst.parent)
    return action


def add_mtp(source: Path, target: Path) -> MtpResult:
    source, target = Path(source), Path(target)
    src = source / EXTRA_FILE
    if not src.is_file():
        raise UserError(f"{src}: not found; the MTP head ships in this file: point --source at the INT4 "
                        "checkpoint download (or re-fetch it)")
    header = read_header(src)
    names = [n for n in header.tensors if n.startswith("mtp.")]
    if not names:
        raise UserError(f"{src}: holds no mtp.* tensor; re-fetch the INT4 checkpoint")
    others = [n for n in header.tensors if not n.startswith("mtp.")]
    if others:
        raise UserError(f"{src}: also holds {len(others)} non-MTP tensors (e.g. {others[0]}) that vLLM would "
                        "read once the index names the file; use an unmodified model_extra_tensors file")
    doc = read_index(target)
    weight_map: dict[str, str] = dict(doc["weight_map"])
    dst = target / EXTRA_FILE
    action = "kept"
    if not _same_file(src, dst, header):
        action = _place(src, dst)
    new_map = {t: f for t, f in weight_map.items() if f != EXTRA_FILE or t in header.tensors}
    new_map.update({n: EXTRA_FILE for n in names})
    headers: dict[str, Header] = {EXTRA_FILE: header}
    total = 0
    for tensor, file in new_map.items():
        if file not in headers:
            headers[file] = read_header(target / file)
        info = headers[file].tensors.get(tensor)
        if info is None:
            raise UserError(f"{target / INDEX_NAME}: maps {tensor} to {file}, which has no such tensor; "
                            "re-run checkpoint assemble")
        total += info.nbytes
    metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    index_changed = new_map != weight_map or metadata.get("total_size") != total
    if index_changed:
        extra = {k: v for k, v in metadata.items() if k != "total_size"}
        write_index(target, new_map, total, extra)
    return MtpResult(index_changed or action != "kept", target, len(names), action, total)
