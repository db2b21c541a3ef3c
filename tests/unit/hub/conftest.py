"""Fixtures and helpers shared by the hub's refusal tests: small repos laid out by the
simulation's publisher, raw requests, private copies of a checkpoint pair."""

from __future__ import annotations

import http.client
import http.server
import os
import shutil
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st

from sparkspec.hub.server import HubServer
from tests.support.hubpublish import publish
from tests.unit.conftest import _small_repo


def q(text: str) -> str:
    """Percent-encode every separator, as an attacker writes a segment."""
    return urllib.parse.quote(text, safe="")


def raw(url: str, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with ``path`` sent byte for byte (no client-side normalization of dots or
    escapes)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


@pytest.fixture()
def work(pair: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """Private copies (a refused command must leave them as they were, byte for byte)."""
    for name in ("int4", "fp8"):
        shutil.copytree(pair[name], tmp_path / name)
    return {"int4": tmp_path / "int4", "fp8": tmp_path / "fp8", "tmp": tmp_path}


def _subset(w: dict[str, Path], dest: Path, *extra: str | Path) -> list[str | Path]:
    return ["fetch", "fp8-subset", "Qwen/tiny-FP8", "--revision", "main", "--int4", w["int4"],
            "--dest", dest, "--local-path", w["fp8"], *extra]


# --- properties: whatever the segments, the endpoint resolves nothing outside its root ------------
SEGMENT = st.one_of(st.sampled_from(["org", "tiny", "evil", "secret", "secret.txt", "leak.txt",
                                     "linkdir", "fifo", "config.json", "sub", "notes.txt", "..",
                                     ".", "", "/", "\\", "\0", "\n", "%2F", "%2e%2e", "%00", "%5C",
                                     "/etc/passwd", ".sparkspec-hashes.json", ".sparkspec-revision",
                                     "resolve", "main"]),
                    st.text(max_size=10))


# names that exist in the maze, drawn often enough that most examples get past the repo lookup
KNOWN_REPOS = [("org", "tiny")] * 5 + [("evil", "secret"), ("org", ".."), ("org", "%2E%2E")]


KNOWN_FILES = ["config.json", "model.safetensors", "sub/notes.txt", "sub", "leak.txt",
               "linkdir/secret.txt", "fifo", ".sparkspec-hashes.json", ".sparkspec-revision",
               "sub/../config.json", "../tiny/config.json"]


REPO = st.integers(0, 2).flatmap(lambda i: st.sampled_from(KNOWN_REPOS) if i < 2 else
                                 st.tuples(SEGMENT, SEGMENT))


REL = st.integers(0, 2).flatmap(lambda i: st.sampled_from(KNOWN_FILES) if i < 2 else
                                st.lists(SEGMENT, min_size=1, max_size=4).map("/".join))


@pytest.fixture(scope="module")
def maze(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A root with a published repo holding a link to a secret outside, a link to the secret's
    folder and a FIFO; an org that is a link out of the root; the server on it."""
    base = tmp_path_factory.mktemp("maze")
    (base / "secret").mkdir()
    (base / "secret" / "secret.txt").write_text(f"TOP-SECRET-{uuid.uuid4().hex}\n")
    root = base / "root"
    publish(root, "org/tiny", _small_repo(base / "src"))
    repo = root / "org" / "tiny"
    (repo / "leak.txt").symlink_to(base / "secret" / "secret.txt")
    (repo / "linkdir").symlink_to(base / "secret")
    os.mkfifo(repo / "fifo")
    (root / "evil").symlink_to(base)
    with HubServer(root) as server:
        yield {"root": root.resolve(),
               "secret": (base / "secret" / "secret.txt").read_bytes().strip(),
               "server": server, "repo": repo}
