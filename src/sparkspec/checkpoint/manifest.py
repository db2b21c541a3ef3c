"""The manifest ``checkpoint assemble`` leaves in its output: what it read, what it wrote, and how
to tell that what it wrote is still there, unchanged.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from sparkspec.checkpoint.safetensors_io import INDEX_NAME
from sparkspec.checkpoint.selection import EXTRA_FILE
from sparkspec.checkpoint.stream import HASH_NAME, new_hash
from sparkspec.errors import UserError
from sparkspec.jsonfile import expect, read_json
from sparkspec.outputs import write_atomic
from sparkspec.validate import filename, open_regular

MANIFEST_NAME = "sparkspec-manifest.json"
TOOL = "sparkspec checkpoint assemble"
FORMAT_VERSION = 2
STAT_KEYS = ("size", "mtime_ns", "ctime_ns", "ino")
_FIX = "re-run `sparkspec checkpoint assemble` into this --out"
_CHUNK = 16 << 20


def stamp(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the file's stat fields, taken now (after the last write and fsync)."""
    st = os.stat(path, follow_symlinks=False)
    if "size" in record and record["size"] != st.st_size:
        raise OSError(5, f"wrote {record['size']} bytes but the file holds {st.st_size}", str(path))
    return {**record, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino}


def header_digest(path: Path) -> str:
    """The digest of a safetensors file's header
    (8-byte length + JSON), read with a bounded length."""
    fd = open_regular(path, "safetensors file")
    try:
        prefix = os.pread(fd, 8, 0)
        if len(prefix) != 8:
            return ""
        (length,) = struct.unpack("<Q", prefix)
        if length > min(os.fstat(fd).st_size, 100_000_000):
            return ""
        digest = new_hash()
        digest.update(prefix)
        digest.update(os.pread(fd, length, 8))
        return str(digest.hexdigest())
    finally:
        os.close(fd)


def owned(directory: Path) -> bool:
    """Whether ``directory`` holds assemble's manifest (then assemble may replace it). A manifest
    that is not JSON is refused with one line: the folder is nobody's we know."""
    path = directory / MANIFEST_NAME
    if not os.path.lexists(path):
        return False
    doc = read_json(path, "manifest not found", f"move {directory} away or choose another --out")
    return isinstance(doc, dict) and doc.get("tool") == TOOL


def load(directory: Path) -> dict[str, Any]:
    """The manifest, its shape checked: a wrong type, a missing key or a file name that is not a
    plain name in the folder is one line naming the manifest."""
    path = directory / MANIFEST_NAME
    where = str(path)
    doc: dict[str, Any] = read_json(path, f"not found: {directory} was not written by `{TOOL}`",
                                    _FIX)
    if expect(doc, "tool", str, where, _FIX) != TOOL:
        raise UserError(f"{where}: was not written by `{TOOL}`; {_FIX}")
    if expect(doc, "format", int, where, _FIX) != FORMAT_VERSION:
        raise UserError(f"{where}: format {doc['format']} is not {FORMAT_VERSION} (an older "
                        f"sparkspec); {_FIX}")
    expect(doc, "key", str, where, _FIX)
    expect(doc, "hash", str, where, _FIX)
    outputs = expect(doc, "outputs", dict, where, _FIX)
    for name, rec in outputs.items():
        filename(name, f"{where}: output")
        at = f"{where}: outputs[{name!r}]"
        for key in STAT_KEYS:
            if expect(rec, key, int, at, _FIX) < 0:
                raise UserError(f"{at}: {key} is negative; {_FIX}")
        expect(rec, doc["hash"], str, at, _FIX, required=False)
        expect(rec, "header", str, at, _FIX, required=False)
        expect(rec, "linked", bool, at, _FIX, required=False)
    weight_map = expect(doc, "weight_map", dict, where, _FIX)
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or file not in outputs:
            raise UserError(f"{where}: weight_map maps {tensor!r:.80} to {file!r:.80}, which is "
                            f"not an output; {_FIX}")
    return doc


def stale_outputs(directory: Path, manifest: dict[str, Any],
                  skip: tuple[str, ...] = ()) -> list[str]:
    """Output files whose size, times or inode differ from the record (or whose header digest does),
    sorted (a file recorded as a hard link to a source, add-mtp's head, or one with another link
    now, the cluster head's hand-off root, is not judged by its change time: a link made or removed
    changes it, not a byte); ``skip``: files another command records (add-mtp's head and index, for
    assemble's own no-op). A record without a digest (an older sparkspec's index record, from before
    add-mtp recorded it) is not judged."""
    stale = []
    for name, rec in sorted(manifest["outputs"].items()):
        if name in skip or manifest["hash"] not in rec:
            continue
        path = directory / name
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            stale.append(name)
            continue
        now = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
               "ino": st.st_ino}
        linked = rec.get("linked") is True or st.st_nlink > 1
        keys = [k for k in STAT_KEYS if not (k == "ctime_ns" and linked)]
        if any(now[k] != rec[k] for k in keys) or not path.is_file() or (
                "header" in rec and header_digest(path) != rec["header"]):
            stale.append(name)
    return stale


def rehash(path: Path) -> str:
    """The digest of the whole file, as the copy computed it."""
    fd = open_regular(path, "checkpoint file")
    digest = new_hash()
    buf = memoryview(bytearray(_CHUNK))
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while got := os.readv(fd, [buf]):
            digest.update(buf[:got])
    finally:
        os.close(fd)
    return str(digest.hexdigest())


def is_current(directory: Path, manifest: dict[str, Any], name: str) -> bool:
    """``name`` has a record with a digest and its size, times and inode still match it."""
    rec = manifest["outputs"].get(name)
    return isinstance(rec, dict) and manifest["hash"] in rec and not stale_outputs(
        directory, {"hash": manifest["hash"], "outputs": {name: rec}})


def record(directory: Path, manifest: dict[str, Any], names: list[str]) -> None:
    """Add (or renew) the records of ``names``, files written into the hybrid after assemble
    (add-mtp's head and index): each re-hashed, stat taken before and after (a file that changed
    meanwhile is an error), then the manifest replaced atomically."""
    algo = _same_hash(directory, manifest)
    outputs = dict(manifest["outputs"])
    for name in names:
        path = directory / name
        before = os.stat(path, follow_symlinks=False)
        rec: dict[str, Any] = {algo: rehash(path)}
        if name.endswith(".safetensors"):
            rec["header"] = header_digest(path)
        if before.st_nlink > 1:
            rec["linked"] = True
        rec = stamp(path, rec)
        if ((before.st_size, before.st_ctime_ns, before.st_ino)
                != (rec["size"], rec["ctime_ns"], rec["ino"])):
            raise OSError(11, "changed while it was hashed; re-run", str(path))
        outputs[name] = rec
    body = json.dumps({**manifest, "outputs": outputs}, indent=2, sort_keys=True) + "\n"
    write_atomic(directory / MANIFEST_NAME, body.encode())


def _same_hash(directory: Path, manifest: dict[str, Any]) -> str:
    algo = str(manifest["hash"])
    if algo != HASH_NAME:
        raise UserError(f"{directory / MANIFEST_NAME}: digests are {algo}, this install computes "
                        f"{HASH_NAME}; install the same digest (pip install xxhash) or re-run "
                        "assemble")
    return algo


def check_digests(directory: Path, manifest: dict[str, Any], names: list[str]) -> list[str]:
    """Re-hash ``names`` (those the manifest holds a digest for);
    one problem per file that differs."""
    algo = _same_hash(directory, manifest)
    problems = []
    for name in names:
        want = manifest["outputs"][name].get(algo)
        if want is None:
            continue
        path = directory / name
        if not os.path.lexists(path):
            problems.append(f"{path}: missing, {_writer(name)} wrote it; {_fix(name)}")
            continue
        got = rehash(path)
        if got != want:
            problems.append(f"{path}: differs from what {_writer(name)} wrote ({algo} {got} != "
                            f"{want}); {_fix(name)}")
    return problems


ADD_MTP_FILES = (EXTRA_FILE, INDEX_NAME)  # add-mtp records these


def _writer(name: str) -> str:
    return "add-mtp" if name in ADD_MTP_FILES else "assemble"


def _fix(name: str) -> str:
    return ("re-run `sparkspec checkpoint add-mtp` (or build) into this hybrid"
            if name in ADD_MTP_FILES else _FIX)


def digested(manifest: dict[str, Any]) -> list[str]:
    return sorted(n for n, rec in manifest["outputs"].items() if manifest["hash"] in rec)


def fingerprint(directory: Path) -> dict[str, Any]:
    """One digest of a checkpoint folder, equal on every node that holds the same files (a cluster's
    gate before its deploy, the head's hand-off to its workers): each regular file under it (hidden
    files and folders and assemble's manifest left out) by its path and the digest of its bytes.
    Where assemble's manifest holds a current record of a file (size, times and inode unchanged
    since hashed), the recorded digest stands for a re-hash (source "manifest"); every other file is
    hashed (source "content"). So a copy of the files elsewhere, with the manifest or without it,
    gives the digest of the folder assemble wrote."""
    if not directory.is_dir():
        raise UserError(f"{directory}: not a folder; give the checkpoint's folder")
    known: dict[str, str] = {}
    source = "content"
    if owned(directory):
        doc = load(directory)
        source = "manifest"
        if doc["hash"] == HASH_NAME:
            # a file changed since its record is hashed again:
            # the digest is of its bytes, not a stale record
            stale = set(stale_outputs(directory, doc))
            known = {name: str(rec[doc["hash"]]) for name, rec in doc["outputs"].items()
                     if doc["hash"] in rec and name not in stale}
    entries = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            path = Path(root) / name
            rel = path.relative_to(directory).as_posix()
            if rel != MANIFEST_NAME and path.is_file() and not path.is_symlink():
                entries.append((rel, known.get(rel) or rehash(path)))
    digest = new_hash()
    digest.update(json.dumps(entries).encode())
    return {"digest": str(digest.hexdigest()), "source": source, "files": len(entries)}
