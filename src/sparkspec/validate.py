"""The one validator of untrusted names and paths: every path sparkspec builds from a string it did
not write goes through here, and files that must be regular are opened so that a FIFO or a device
cannot hang a command.
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
import unicodedata
from pathlib import Path

from sparkspec.errors import UserError
from sparkspec.outputs import check_disjoint as check_disjoint
from sparkspec.outputs import check_not_symlink as check_not_symlink

# Hugging Face's own rule for each half of a repo id: letters, digits, '-', '_', '.'; neither '--'
# nor '..'; '-' and '.' neither first nor last; at most 96 characters. '--' is also our folder
# separator (org/name -> org--name), so forbidding it keeps that mapping one-to-one.
_REPO_PART = re.compile(r"(?!.*(?:--|\.\.))[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
COMMIT_RE = re.compile(r"[0-9a-f]{40}")
# A branch or tag name as the hub takes it in a URL (refs/pr/N included), never a path of its own.
_REVISION_RE = re.compile(r"(?:refs/pr/[0-9]{1,9}|(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,127})")
# One segment of a repo-relative file path: no separators, no control characters, not '.' or '..'.
_SEGMENT_RE = re.compile(r"(?!\.{1,2}$)[A-Za-z0-9._+=@,-]{1,255}")
MAX_RELPATH = 1024


def repo_id(value: object, what: str = "repo id") -> str:
    """``org/name`` by the hub's rules, else a one-line UserError naming the value."""
    if isinstance(value, str):
        org, sep, name = value.partition("/")
        if sep and _REPO_PART.fullmatch(org) and _REPO_PART.fullmatch(name):
            return value
    raise UserError(f"{what} {value!r} is not org/name (letters, digits, '-', '_', '.'; no '..' or "
                    "'--'); give the hub's repo id, e.g. Qwen/Qwen3.5-122B-A10B-FP8")


def repo_folder(value: str) -> str:
    """A repo id's folder name: ``org/name`` -> ``org--name`` (one-to-one: ids hold no '--')."""
    return repo_id(value).replace("/", "--")


def revision(value: object, what: str = "revision") -> str:
    """A commit id, branch, tag or ``refs/pr/N``; refused when it could act as a path."""
    if isinstance(value, str) and _REVISION_RE.fullmatch(value):
        return value
    raise UserError(f"{what} {value!r} is not a commit id, branch or tag name; pin a 40-hex commit "
                    "id")


def commit(value: object, what: str = "revision") -> str:
    if isinstance(value, str) and COMMIT_RE.fullmatch(value):
        return value
    raise UserError(f"{what} {value!r} is not a 40-hex commit id; give the full commit id")


def relpath(value: object, what: str = "file name") -> str:
    """A relative POSIX path inside a repo or checkpoint: segments of letters, digits and
    ``._+=@,-``, no '.' or '..' segment, no leading '/', no backslash or control character, at most
    1024 characters."""
    if isinstance(value, str) and 0 < len(value) <= MAX_RELPATH:
        parts = value.split("/")
        if all(_SEGMENT_RE.fullmatch(p) for p in parts):
            return value
    raise UserError(f"{what} {value!r} is not a plain relative path (letters, digits, '._+=@,-', "
                    "no '..', no leading '/'); fix the file or the request")


def filename(value: object, what: str = "file name") -> str:
    """One path segment (an index's shard name): a relpath without '/'."""
    if isinstance(value, str) and _SEGMENT_RE.fullmatch(value):
        return value
    raise UserError(f"{what} {value!r} is not a plain file name in the checkpoint folder; fix the "
                    "index")


def has_control(text: str) -> bool:
    """True when ``text`` holds a control character (C0, DEL, C1: a line break, NUL, ESC, NEL), a
    Unicode line or paragraph separator (Python's splitlines breaks there) or a lone surrogate (no
    file can encode it)."""
    return any(unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp") for c in text)


def absolute_path(value: object, what: str = "path") -> str:
    """An absolute, normalised POSIX path below '/': no '.' or '..' segment, no '//', no trailing
    '/', no control character, at most 4095 characters (PATH_MAX), each segment at most 255
    (NAME_MAX)."""
    if (isinstance(value, str) and value.startswith("/") and value != "/"
            and not value.startswith("//") and posixpath.normpath(value) == value
            and len(value) < 4096 and not has_control(value)
            and all(len(part.encode("utf-8", "replace")) <= 255 for part in value.split("/"))):
        return value
    raise UserError(f"{what} {value!r} is not an absolute normalised path ('/' first, no '.' or "
                    "'..' segment, no '//' or trailing '/', no control character); give the full "
                    "path")


def under(root: str | os.PathLike[str], rel: str, *, what: str = "file name",
          no_symlinks: bool = False) -> Path:
    """``root/rel`` after validating ``rel``; the resolved result must stay under the resolved root.
    With ``no_symlinks`` no component below the root may be a symbolic link (what a server
    exposes)."""
    rel = relpath(rel, what)
    base = Path(root).resolve()
    path = base.joinpath(*rel.split("/"))
    if no_symlinks:
        cursor = base
        for part in rel.split("/"):
            cursor = cursor / part
            if cursor.is_symlink():
                raise UserError(f"{what} {rel!r} is a symbolic link under {base}; links are not "
                                "followed")
    if not path.resolve().is_relative_to(base):
        raise UserError(f"{what} {rel!r} leaves {base}; fix the file or the request")
    return path


def source_file(root: Path, path: Path, flag: str) -> Path:
    """``path`` (under ``root``) resolved; refused when a link takes it out of the source folder (a
    Hugging Face cache snapshot may link into its repo's blobs folder)."""
    real, base = path.resolve(), root.resolve()
    allowed = [base] + ([base.parent.parent / "blobs"] if base.parent.name == "snapshots" else [])
    if not any(real.is_relative_to(a) for a in allowed):
        raise UserError(f"{path}: links out of {flag} {root} (to {real}); a checkpoint folder "
                        "holds its own files: copy the file in or fix the link")
    return path


def real(path: str | os.PathLike[str]) -> Path:
    """The resolved real path (symlinks followed; a missing tail is kept as written)."""
    return Path(os.path.realpath(path))


def require_regular(path: str | os.PathLike[str], what: str = "file") -> os.stat_result:
    """stat ``path`` (following links) and refuse anything but a regular file, with one line."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found; check the path") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read the {what} ({exc.strerror}); check the path") \
            from None
    if not stat.S_ISREG(st.st_mode):
        raise UserError(f"{path}: is not a regular file (a folder, FIFO or device); give the "
                        f"{what} itself")
    return st


def open_regular(path: str | os.PathLike[str], what: str = "file") -> int:
    """Open ``path`` read-only without blocking on a FIFO and return the fd of a regular file;
    anything else is refused with one line. The caller closes the fd."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found; check the path") from None
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO or socket with nobody on the other side
            raise UserError(f"{path}: is not a regular file (a FIFO or socket); give the {what} "
                            "itself") from None
        raise UserError(f"{path}: cannot open the {what} ({exc.strerror}); check the path and its "
                        "permissions") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UserError(f"{path}: is not a regular file (a folder, FIFO or device); give the "
                        f"{what} itself")
    os.set_blocking(fd, True)
    return fd


def read_regular(path: str | os.PathLike[str], what: str = "file", limit: int = 64 << 20) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes, else one line."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UserError(f"{path}: the {what} is {size} bytes, more than the {limit} a {what} "
                            "can be; check the path")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            if sum(map(len, chunks)) > limit:
                raise UserError(f"{path}: the {what} grew past {limit} bytes while read; check the "
                                "path")
        return b"".join(chunks)
    finally:
        os.close(fd)
