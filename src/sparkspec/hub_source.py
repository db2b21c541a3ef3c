"""Where ``sparkspec fetch`` reads from: a :class:`Source` (a hub repo pinned to a revision, or an air-gapped
local copy) and its :class:`Reader` (file sizes and streamed byte-range reads of one resolved commit).

The hub is huggingface.co or the mirror in ``HF_ENDPOINT`` / ``endpoint``; a local directory (``local_path``)
holds the same files. The token comes from the caller (a token file written from Ansible Vault) or from
huggingface_hub's own lookup (``HF_TOKEN``); it is never printed. :func:`hub_errors` turns hub and network
failures into one-line UserErrors.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
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

from sparkspec.errors import UserError
from sparkspec.hubrepo import COMMIT_RE, REVISION_FILE, listed

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
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise UserError(f"{path}: cannot read the HF token file ({exc.strerror}); {TOKEN_HINT}") from None
    if not token:
        raise UserError(f"{path}: the HF token file is empty; {TOKEN_HINT}")
    return token


@contextlib.contextmanager
def hub_errors(source: Source, path: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub / network failures into one-line UserErrors naming repo, revision and file."""
    where = f"{source.repo}@{source.revision}" + (f": {path}" if path else "")
    try:
        yield
    except RevisionNotFoundError:
        raise UserError(f"{source.repo}: revision {source.revision} not found (404); pin an existing "
                        "revision") from None
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
        raise UserError(f"{where}: hub answered HTTP {status}; retry later or check HF_ENDPOINT") from None
    except (httpx2.TransportError, LocalEntryNotFoundError) as exc:
        raise UserError(f"{where}: transfer failed ({exc.__class__.__name__}); check the network or "
                        "HF_ENDPOINT, then re-run to resume") from None
    except OSError as exc:  # writing the download (disk full, permissions)
        raise UserError(f"{exc.filename or where}: cannot write ({exc.strerror}); free space or fix "
                        "permissions, then re-run to resume") from None


class Reader:
    """A source resolved to one commit: its file sizes and byte-range reads (hub or local directory)."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.endpoint = source.endpoint or os.environ.get("HF_ENDPOINT") or None
        if source.local_path:
            root = Path(source.local_path)
            if not root.is_dir():
                raise UserError(f"{root}: local_path is not a directory; point it at a copy of the repo")
            rels = (p.relative_to(root).as_posix() for p in sorted(root.rglob("*")) if p.is_file())
            self.files = {rel: (root / rel).stat().st_size for rel in rels if listed(rel)}
            marker = root / REVISION_FILE
            self.commit = (marker.read_text().strip() if marker.is_file()
                           else root.name if COMMIT_RE.fullmatch(root.name) else "local")
            return
        api = HfApi(endpoint=self.endpoint, token=source.token)
        with hub_errors(source):
            info = api.repo_info(source.repo, revision=source.revision)
            if not info.sha:
                raise UserError(f"{self.endpoint or 'the hub'}: answered no commit for {source.label}; point "
                                "HF_ENDPOINT at a Hugging Face Hub-compatible server")
            self.commit = info.sha
            self.files = {f.path: f.size for f in api.list_repo_tree(source.repo, recursive=True,
                                                                       revision=self.commit)
                          if isinstance(f, RepoFile)}

    def size(self, path: str) -> int:
        if path not in self.files:
            raise UserError(f"{self.source.label}: {path} not found (404); check the repo and revision")
        return self.files[path]

    def chunks(self, path: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes [start, end) of ``path``, streamed."""
        if self.source.local_path:
            with open(Path(self.source.local_path) / path, "rb") as fh:
                fh.seek(start)
                while start < end and (chunk := fh.read(min(CHUNK, end - start))):
                    start += len(chunk)
                    yield chunk
            return
        url = hf_hub_url(self.source.repo, path, revision=self.commit, endpoint=self.endpoint)
        failures = 0
        with hub_errors(self.source, path):
            while start < end:
                headers = build_hf_headers(token=self.source.token)
                headers.update({"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
                try:
                    # status retries (429/5xx) inside; a body cut mid-way resumes below from the next byte
                    with http_stream_backoff("GET", url, headers=headers, max_retries=self.source.retries,
                                             retry_on_exceptions=()) as response:
                        hf_raise_for_status(response)
                        if response.status_code != 206 and (start, end) != (0, self.size(path)):
                            raise UserError(f"{url}: the server ignored the Range header (HTTP "
                                            f"{response.status_code}); use --mode full with this mirror")
                        for chunk in response.iter_bytes(CHUNK):
                            start += len(chunk)
                            failures = 0
                            yield chunk
                except httpx2.TransportError as exc:
                    failures += 1
                    if failures > self.source.retries:
                        raise
                    logger.warning("%s: %s; resuming at byte %d", path, exc.__class__.__name__, start)
                    time.sleep(min(2.0 ** (failures - 1), 8.0))

    def read(self, path: str, start: int, length: int) -> bytes:
        return b"".join(self.chunks(path, start, start + length))
