"""The local HF-compatible endpoint (``sparkspec hub serve``: a site's mirror, a cluster head's
checkpoint for its workers), exercised through huggingface_hub 2.4 and raw HTTP on 127.0.0.1. Repos
are laid out as a site does (docs/hub.md: a folder, fetched or made, marked by hand) or, for
brevity, by the simulation's publisher (tests/support/hubpublish.py)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import HfApi, HfFileSystem, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from sparkspec.checkpoint.selection import REVISION_FILE
from sparkspec.cli import main
from sparkspec.hub.repo import PUBLISHED_FILE
from sparkspec.hub.server import HubServer
from tests.support.hubpublish import publish


@pytest.fixture()
def served(tmp_path: Path, repo_dir: Path):
    root = tmp_path / "root"
    changed, revision, _ = publish(root, "org/tiny", repo_dir)
    assert changed
    with HubServer(root) as server:
        yield server, revision


def test_snapshot_pinned_revision_and_api(served, repo_dir: Path, tmp_path: Path) -> None:
    server, revision = served
    api = HfApi(endpoint=server.url)
    info = api.model_info("org/tiny", files_metadata=True)
    assert info.sha == revision
    sizes = {s.rfilename: s.size for s in info.siblings}
    assert sizes == {"config.json": 23, "model.safetensors": 300_000, "sub/notes.txt": 6}
    tree = {f.path for f in api.list_repo_tree("org/tiny", revision=revision)}
    assert tree == {"config.json", "model.safetensors", "sub"}
    assert [p.path for p in api.get_paths_info("org/tiny", ["sub/notes.txt", "missing"],
                                               revision=revision)] == ["sub/notes.txt"]

    dest = tmp_path / "dest"
    snapshot_download("org/tiny", revision=revision, local_dir=dest, endpoint=server.url)
    for rel in ("config.json", "model.safetensors", "sub/notes.txt"):
        assert (dest / rel).read_bytes() == (repo_dir / rel).read_bytes()
    served_bytes = server.stats.file_bytes["org/tiny/model.safetensors"]
    assert served_bytes == 300_000
    server.stats.reset()
    snapshot_download("org/tiny", revision=revision, local_dir=dest, endpoint=server.url)
    # complete files are not fetched again
    assert server.stats.file_bytes["org/tiny/model.safetensors"] == 0


def test_range_reads_count_only_the_range(served, repo_dir: Path) -> None:
    server, revision = served
    url = f"{server.url}/org/tiny/resolve/{revision}/model.safetensors"
    r = httpx2.get(url, headers={"Range": "bytes=1000-1999"})
    assert r.status_code == 206
    assert r.headers["Content-Range"] == "bytes 1000-1999/300000"
    assert r.content == (repo_dir / "model.safetensors").read_bytes()[1000:2000]
    assert r.headers["X-Repo-Commit"] == revision
    assert server.stats.file_bytes["org/tiny/model.safetensors"] == 1000
    assert httpx2.get(url, headers={"Range": "bytes=300000-"}).status_code == 416
    head = httpx2.head(url)
    assert (head.status_code == 200 and head.headers["Content-Length"] == "300000"
            and head.headers["ETag"])

    fs = HfFileSystem(endpoint=server.url)
    with fs.open("org/tiny/model.safetensors", "rb", revision=revision, cache_type="none") as fh:
        fh.seek(5000)
        assert fh.read(10) == (repo_dir / "model.safetensors").read_bytes()[5000:5010]


def test_not_found_errors_carry_hub_error_codes(served, tmp_path: Path) -> None:
    server, revision = served
    cache = tmp_path / "cache"
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/nope", "config.json", endpoint=server.url, cache_dir=cache)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/tiny", "config.json", revision="0" * 40, endpoint=server.url,
                        cache_dir=cache)
    with pytest.raises(RemoteEntryNotFoundError):
        hf_hub_download("org/tiny", "nope.json", revision=revision, endpoint=server.url,
                        cache_dir=cache)
    r = httpx2.get(f"{server.url}/org/tiny/resolve/main/nope.json")
    assert (r.status_code, r.headers["X-Error-Code"], r.headers["X-Repo-Commit"]) == \
        (404, "EntryNotFound", revision)


def test_token_check(tmp_path: Path, repo_dir: Path) -> None:
    root = tmp_path / "root"
    publish(root, "org/tiny", repo_dir)
    with HubServer(root, tokens=["hf_good"]) as server:
        url = f"{server.url}/api/models/org/tiny"
        missing = httpx2.get(url)
        wrong = httpx2.get(url, headers={"Authorization": "Bearer hf_bad"})
        good = httpx2.get(url, headers={"Authorization": "Bearer hf_good"})
        assert (missing.status_code, missing.headers["X-Error-Code"]) == (401, "RepoNotFound")
        assert (wrong.status_code, wrong.headers["X-Error-Message"]) == \
            (401, "Invalid credentials in Authorization header")
        assert good.status_code == 200 and good.json()["id"] == "org/tiny"
        assert HfApi(endpoint=server.url,
                     token="hf_good").model_info("org/tiny").sha == good.json()["sha"]


def test_cli_serve_answers_and_stops_on_sigterm(tmp_path: Path, repo_dir: Path) -> None:
    root = tmp_path / "root"
    _, revision, _ = publish(root, "org/tiny", repo_dir)
    (tmp_path / "tokens").write_text("hf_one\nhf_two\n")
    (tmp_path / "tokens").chmod(0o600)
    proc, lines = _serve(root, "--port", "0", "--token-file", str(tmp_path / "tokens"))
    try:
        assert lines[:-1] == [f"hub: org/tiny@{revision} (3 files)"], lines
        url = re.search(r"at (http://127\.0\.0\.1:\d+) \(tokens: on\)", lines[-1])
        assert url, lines
        info = HfApi(endpoint=url.group(1), token="hf_two").model_info("org/tiny")
        assert info.sha == revision
        assert httpx2.get(f"{url.group(1)}/api/models/org/tiny").status_code == 401
    finally:
        _stop(proc)


def _hashed(server: HubServer, method: str, path: str,
            headers: dict[str, str] | None = None) -> int:
    """Bytes the server hashed to answer one request (which must succeed)."""
    server.stats.reset()
    r = httpx2.request(method, server.url + path, headers=headers or {})
    assert r.status_code in (200, 206), (path, r.status_code, r.text[:200])
    return server.stats.bytes_hashed


def test_requests_hash_only_what_they_answer_once(tmp_path: Path, repo_dir: Path) -> None:
    """A repo put in the root by hand (nothing hashed yet): model info without blobs and a small
    file's resolve hash nothing large; each file is hashed once, persisted across servers, and again
    only when written (the same size and mtime, but a new change time)."""
    root = tmp_path / "root"
    repo = root / "org" / "hand"
    shutil.copytree(repo_dir, repo)
    (repo / REVISION_FILE).write_text("a" * 40 + "\n")
    size = {rel: (repo / rel).stat().st_size
            for rel in ("config.json", "model.safetensors", "sub/notes.txt")}
    with HubServer(root) as server:
        assert _hashed(server, "GET", "/api/models/org/hand") == 0
        assert _hashed(server, "HEAD", "/org/hand/resolve/main/config.json") == size["config.json"]
        assert _hashed(server, "GET", "/org/hand/resolve/main/config.json") == 0
        assert _hashed(server, "GET", "/api/models/org/hand?blobs=true") == \
            size["model.safetensors"] + size["sub/notes.txt"]
        assert _hashed(server, "GET", "/api/models/org/hand/tree/main?recursive=true") == 0
        assert _hashed(server, "GET", "/org/hand/resolve/main/model.safetensors",
                       {"Range": "bytes=0-9"}) == 0
    with HubServer(root) as server:  # a new server: the hashes come from .sparkspec-hashes.json
        info = HfApi(endpoint=server.url).model_info("org/hand", files_metadata=True)
        assert server.stats.bytes_hashed == 0
        lfs = {s.rfilename: s.lfs.sha256 for s in info.siblings if s.lfs}
        model = repo / "model.safetensors"
        assert lfs == {"model.safetensors": hashlib.sha256(model.read_bytes()).hexdigest()}
        st = (repo / "model.safetensors").stat()
        with open(repo / "model.safetensors", "r+b") as fh:  # in place: same size, mtime put back
            fh.write(b"\xff" * 16)
        os.utime(repo / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))
        head = httpx2.head(f"{server.url}/org/hand/resolve/main/model.safetensors")
        assert server.stats.bytes_hashed == size["model.safetensors"]
        assert head.headers["X-Linked-Etag"].strip('"') == \
            hashlib.sha256((repo / "model.safetensors").read_bytes()).hexdigest()
    assert ".sparkspec-hashes.json" not in {s.rfilename for s in info.siblings}


def test_a_repo_without_revision_file_is_hashed_once(tmp_path: Path, repo_dir: Path) -> None:
    """A folder marked by hand without a revision file (a cluster head's assembled checkpoint): its
    content revision, hashed once (an unmarked folder is no repo at all:
    test_server_refusals.py)."""
    root = tmp_path / "root"
    shutil.copytree(repo_dir, root / "org" / "bare")
    (root / "org" / "bare" / PUBLISHED_FILE).write_text("{}\n")
    total = sum(p.stat().st_size for p in repo_dir.rglob("*") if p.is_file())
    with HubServer(root) as server:
        assert _hashed(server, "GET", "/api/models/org/bare") == total  # the content revision, once
        assert _hashed(server, "GET", "/api/models/org/bare") == 0


def test_tokens_any_of_several_and_never_partial(tmp_path: Path, repo_dir: Path) -> None:
    root = tmp_path / "root"
    publish(root, "org/tiny", repo_dir)
    with HubServer(root, tokens=["hf_first", "hf_second"]) as server:
        url = f"{server.url}/api/models/org/tiny"
        codes = {token: httpx2.get(url, headers=[(b"Authorization",
                                                  f"Bearer {token}".encode())]).status_code
                 for token in ("hf_first", "hf_second", "hf_firs", "hf_first0",
                               "hf_second hf_first", "hf_f\u00edrst")}
        assert codes == {"hf_first": 200, "hf_second": 200, "hf_firs": 401, "hf_first0": 401,
                         "hf_second hf_first": 401, "hf_f\u00edrst": 401}
        assert httpx2.get(url, headers={"Authorization": "Basic hf_first"}).status_code == 401


def _serve(root: Path, *args: str, env: dict[str, str] | None = None
           ) -> tuple[subprocess.Popen[str], list[str]]:
    """``hub serve`` started apart; its stderr lines up to the one that says where it serves (the
    last)."""
    proc = subprocess.Popen([sys.executable, "-m", "sparkspec.cli", "hub", "serve",
                             "--root", str(root), *args],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert proc.stderr is not None
    lines: list[str] = []
    while (line := proc.stderr.readline()) and not line.startswith("hub: serving "):
        lines.append(line.rstrip("\n"))
    return proc, [*lines, line.rstrip("\n")]


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_serve_takes_tokens_from_the_environment_and_warns_off_loopback(
        tmp_path: Path, repo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    publish(root, "org/tiny", repo_dir)
    tokens = {"SPARKSPEC_HUB_TOKENS": "hf_env_one, hf_env_two\nhf_env_3"}
    proc, lines = _serve(root, "--port", "0", env=tokens)
    try:
        url = re.search(r"at (http://127\.0\.0\.1:\d+) \(tokens: on\)", lines[-1])
        assert url, lines
        for token, code in (("hf_env_two", 200), ("hf_env_3", 200),
                            ("hf_env_one, hf_env_two", 401)):
            got = httpx2.get(f"{url.group(1)}/api/models/org/tiny",
                             headers={"Authorization": f"Bearer {token}"})
            assert got.status_code == code, token
        assert "hf_env" not in " ".join(Path(f"/proc/{proc.pid}/cmdline").read_text().split("\0"))
    finally:
        _stop(proc)
    # unset: no token (set but empty is refused)
    monkeypatch.delenv("SPARKSPEC_HUB_TOKENS", raising=False)
    proc, lines = _serve(root, "--host", "0.0.0.0", "--port", "0")
    try:
        assert "(tokens: off)" in lines[-1]
        assert lines[0].startswith("sparkspec: warning: hub serve binds 0.0.0.0 "
                                   "without a token"), lines
    finally:
        _stop(proc)


def test_a_site_mirror_serves_fetched_folders_at_their_upstream_commit(
        tmp_path: Path, repo_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The air-gapped mirror of docs/hub.md: ``sparkspec fetch repo`` into MIRROR/<org>/<name>, then
    the marker; the mirror answers the upstream's commit id, so hosts keep their pins. Before the
    marker the folder is no repo."""
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    upstream_root, mirror = tmp_path / "upstream", tmp_path / "mirror"
    _, revision, _ = publish(upstream_root, "org/tiny", repo_dir)
    with HubServer(upstream_root) as upstream:
        assert main(["fetch", "repo", "org/tiny", "--revision", revision,
                     "--endpoint", upstream.url, "--dest", str(mirror / "org" / "tiny")]) == 0
    with HubServer(mirror) as server:
        with pytest.raises(RepositoryNotFoundError):
            HfApi(endpoint=server.url).model_info("org/tiny")
        assert server.repos.names() == []
        (mirror / "org" / "tiny" / PUBLISHED_FILE).touch()
        assert server.repos.names() == ["org/tiny"]
        info = HfApi(endpoint=server.url).model_info("org/tiny")
        assert info.sha == revision
        assert sorted(s.rfilename for s in info.siblings) == \
            ["config.json", "model.safetensors", "sub/notes.txt"]
        host = tmp_path / "host"
        snapshot_download("org/tiny", revision=revision, local_dir=host, endpoint=server.url)
        for rel in ("config.json", "model.safetensors", "sub/notes.txt"):
            assert (host / rel).read_bytes() == (repo_dir / rel).read_bytes()


def test_serve_names_each_repo_and_warns_when_none_is_marked(tmp_path: Path,
                                                             repo_dir: Path) -> None:
    """A folder made by hand (a cluster head's assembled checkpoint) is hashed before serving starts
    and announced with its content commit, which the endpoint then answers; an unmarked root gets
    one warning."""
    root = tmp_path / "root"
    shutil.copytree(repo_dir, root / "local" / "hybrid")
    proc, lines = _serve(root, "--port", "0")
    try:
        assert lines[0].startswith("sparkspec: warning: no repo to serve under "
                                   f"{root.resolve()}"), lines
    finally:
        _stop(proc)
    (root / "local" / "hybrid" / PUBLISHED_FILE).touch()
    proc, lines = _serve(root, "--port", "0")
    try:
        announced = re.fullmatch(r"hub: local/hybrid@([0-9a-f]{40}) \(3 files\)", lines[0])
        assert announced and len(lines) == 2, lines
        url = re.search(r"at (http://127\.0\.0\.1:\d+)", lines[-1])
        assert url, lines
        assert HfApi(endpoint=url.group(1)).model_info("local/hybrid").sha == announced.group(1)
    finally:
        _stop(proc)
