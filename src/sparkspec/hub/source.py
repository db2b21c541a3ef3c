"""Where ``sparkspec fetch`` reads from: a :class:`Source` (a hub repo pinned to a revision, or an
air-gapped local copy) and its :class:`Reader` (file sizes and streamed byte-range reads of one
resolved commit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_stream_backoff

from sparkspec import validate
from sparkspec.checkpoint.selection import REVISION_FILE
from sparkspec.errors import RunFailure, UserError, os_error
from sparkspec.hub.repo import check_private, listed, scan
from sparkspec.validate import COMMIT_RE

CHUNK = 1 << 20
TOKEN_HINT = "set HF_TOKEN or sparkspec_hf_token in the vault"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Source:
    repo: str
    revision: str = "main"
    endpoint: str | None = None  # None: HF_ENDPOINT, else huggingface.co
    token: str | None = None  # None: huggingface_hub's lookup (HF_TOKEN)
    local_path: str | None = None  # air-gapped: a directory with the repo's files
    retries: int = 5

    @property
    def label(self) -> str:
        return self.local_path or f"{self.repo}@{self.revision}"


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (a regular file: a FIFO or device is refused, never waited on)."""
    try:
        token = validate.read_regular(path, "HF token file", 1 << 16).decode("utf-8").strip()
    except UnicodeDecodeError:
        raise UserError(f"{path}: the HF token file is not UTF-8 text; {TOKEN_HINT}") from None
    if not token:
        raise UserError(f"{path}: the HF token file is empty; {TOKEN_HINT}")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise UserError(f"{path}: the HF token file holds more than one token or a control "
                        f"character; {TOKEN_HINT}")
    check_private(path, "HF token file")
    return token


def env_token() -> str | None:
    """``HF_TOKEN`` from the environment, refused (never echoed) unless it is visible ASCII:
    anything else cannot go into an HTTP header."""
    value = os.environ.get("HF_TOKEN", "").strip()
    if value and not re.fullmatch(r"[\x21-\x7e]+", value):
        raise UserError("HF_TOKEN holds a space, a control or a non-ASCII character, which no HF "
                        f"token has; set it to the token itself ({TOKEN_HINT})")
    return value or None


@contextlib.contextmanager
def hub_errors(source: Source, path: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub / network failures into one-line UserErrors naming repo, revision and
    file."""
    where = f"{source.repo}@{source.revision}" + (f": {path}" if path else "")
    try:
        yield
    except RevisionNotFoundError:
        raise UserError(f"{source.repo}: revision {source.revision} not found (404); pin an "
                        "existing revision") from None
    except RemoteEntryNotFoundError:
        raise UserError(f"{where}: file not found in the repo (404); check the file name and "
                        "revision") from None
    except (RepositoryNotFoundError, GatedRepoError, HfHubHTTPError) as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise UserError(f"{where}: HF token rejected ({status}); {TOKEN_HINT}") from None
        if status == 404:
            raise UserError(f"{source.repo}: repository not found (404); check the repo id and "
                            "HF_ENDPOINT") from None
        raise RunFailure(f"{where}: hub answered HTTP {status}; retry later or check "
                         "HF_ENDPOINT") from None
    except (httpx2.TransportError, LocalEntryNotFoundError) as exc:
        raise RunFailure(f"{where}: transfer failed ({exc.__class__.__name__}); check the network "
                         "or HF_ENDPOINT, then re-run to resume") from None
    except OSError as exc:  # writing the download (disk full, permissions)
        raise os_error(exc, where,
                       "fix the permissions of --dest, then re-run to resume") from None


class Reader:
    """A source resolved to one commit: its file sizes and byte-range reads (hub or local
    directory).

    Nothing a source says is used as a path unchecked: the commit id must be 40 hex digits (it names
    a folder of the fetch's state), and file names must be plain relative paths; other names are
    kept in ``unsafe`` and refused by :meth:`check_names` when a fetch would write them. A local
    copy's symbolic links are followed only where they stay inside it."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.endpoint = source.endpoint or os.environ.get("HF_ENDPOINT") or None
        self.unsafe: dict[str, str] = {}
        if source.local_path:
            self._local(Path(source.local_path))
            return
        api = HfApi(endpoint=self.endpoint, token=source.token)
        where = self.endpoint or "the hub"
        with hub_errors(source):
            info = api.repo_info(source.repo, revision=source.revision)
            if not isinstance(info.sha, str) or not COMMIT_RE.fullmatch(info.sha):
                raise UserError(f"{where}: answered {info.sha!r:.60} as the commit id of "
                                f"{source.label}, not 40 hex digits; point HF_ENDPOINT at a "
                                "Hugging Face Hub-compatible server")
            self.commit = info.sha
            tree = list(api.list_repo_tree(source.repo, recursive=True, revision=self.commit))
        self.files = {}
        for f in tree:
            if not isinstance(f, RepoFile) or not listed(f.path):
                continue
            if not isinstance(f.size, int) or isinstance(f.size, bool) or f.size < 0:
                raise UserError(f"{where}: lists {f.path!r:.80} with size {f.size!r:.40}; the "
                                "server is not a Hugging Face Hub-compatible mirror")
            try:
                self.files[validate.relpath(f.path)] = f.size
            except UserError:
                self.unsafe[f.path] = ("is not a plain relative path (letters, digits, "
                                       "'._+=@,-', no '..')")

    def _local(self, root: Path) -> None:
        if not root.is_dir():
            raise UserError(f"--local-path {root}: not a directory; point it at a copy of the "
                            "repo")
        try:
            listing = scan(root, follow_inside=True)
        except OSError as exc:
            raise os_error(exc, root, "check --local-path and its permissions") from None
        self.files = {rel: v.size for rel, v in listing.files.items()}
        self.unsafe = listing.unsafe
        marker = root / REVISION_FILE
        if os.path.lexists(marker):
            raw = (validate.read_regular(marker, "revision file", 4096)
                   .decode("ascii", "replace").strip())
            if not COMMIT_RE.fullmatch(raw):
                raise UserError(f"{marker}: holds {raw!r:.60}, not a 40-hex commit id; fix or "
                                "remove the file (the commit id names a folder of the fetch)")
            self.commit = raw
        else:
            self.commit = root.name if COMMIT_RE.fullmatch(root.name) else "local"

    def check_names(self, selected: Iterable[str]) -> None:
        """Refuse, before anything is written, a selection holding a name that is no plain relative
        path."""
        for name in selected:
            if name in self.unsafe:
                raise UserError(f"{self.source.label}: the repo lists {name!r:.200}, which "
                                f"{self.unsafe[name]}; sparkspec writes no such file: fix the "
                                "mirror or leave it out with --include")

    def size(self, path: str) -> int:
        if path not in self.files:
            raise UserError(f"{self.source.label}: {path} not found (404); check the repo and "
                            "revision")
        return self.files[path]

    def chunks(self, path: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of ``path``, streamed."""
        if self.source.local_path:
            fd = validate.open_regular(validate.under(self.source.local_path, path),
                                       "file of --local-path")
            try:
                while start < end and (chunk := os.pread(fd, min(CHUNK, end - start), start)):
                    start += len(chunk)
                    yield chunk
            finally:
                os.close(fd)
            return
        url = hf_hub_url(self.source.repo, path, revision=self.commit, endpoint=self.endpoint)
        failures = 0
        with hub_errors(self.source, path):
            while start < end:
                headers = build_hf_headers(token=self.source.token)
                headers.update({"Range": f"bytes={start}-{end - 1}",
                                "Accept-Encoding": "identity"})
                try:
                    # status retries (429/5xx) inside; a body cut mid-way resumes below from the
                    # next byte
                    with http_stream_backoff("GET", url, headers=headers,
                                             max_retries=self.source.retries,
                                             retry_on_exceptions=()) as response:
                        hf_raise_for_status(response)
                        if response.status_code != 206 and (start, end) != (0, self.size(path)):
                            raise UserError(f"{url}: the server ignored the Range header (HTTP "
                                            f"{response.status_code}); use --mode full with this "
                                            "mirror")
                        for chunk in response.iter_bytes(CHUNK):
                            start += len(chunk)
                            failures = 0
                            yield chunk
                except httpx2.TransportError as exc:
                    failures += 1
                    if failures > self.source.retries:
                        raise
                    logger.warning("%s: %s; resuming at byte %d", path, exc.__class__.__name__,
                                   start)
                    time.sleep(min(2.0 ** (failures - 1), 8.0))

    def read(self, path: str, start: int, length: int) -> bytes:
        return b"".join(self.chunks(path, start, start + length))
