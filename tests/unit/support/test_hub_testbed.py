"""The hub's development tooling (tests/support, not shipped), to what the simulation and the fetch
tests need of it: the publisher lays out a repo with a stable revision (a re-provision stays
``changed=0``), replaces only its own repos, and hashes while it copies; the faulty hub cuts a
transfer once and logs requests."""

from __future__ import annotations

from pathlib import Path

import httpx2
import pytest

from sparkspec.checkpoint.selection import REVISION_FILE
from sparkspec.errors import UserError
from sparkspec.hub.server import HubServer
from tests.support.hubfaults import FaultyHub
from tests.support.hubpublish import publish


def test_publish_sets_revision_and_is_idempotent(tmp_path: Path, repo_dir: Path) -> None:
    root = tmp_path / "root"
    changed, rev1, files = publish(root, "org/tiny", repo_dir)
    assert changed and len(rev1) == 40
    assert (root / "org" / "tiny" / REVISION_FILE).read_text().strip() == rev1
    assert sorted(files) == ["config.json", "model.safetensors", "sub/notes.txt"]
    assert publish(root, "org/tiny", repo_dir)[:2] == (False, rev1)
    (repo_dir / "config.json").write_text('{"model_type": "tiny2"}\n')
    changed, rev2, _ = publish(root, "org/tiny", repo_dir)
    assert changed and rev2 != rev1
    assert (root / "org" / "tiny" / "config.json").read_text() == '{"model_type": "tiny2"}\n'
    # no staging or old copy left
    assert sorted(p.name for p in (root / "org").iterdir()) == ["tiny"]


def test_publish_replaces_only_its_own_repos(tmp_path: Path, repo_dir: Path) -> None:
    root = tmp_path / "root"
    hand = root / "org" / "hand"
    hand.mkdir(parents=True)
    (hand / "mine.txt").write_text("not the publisher's\n")
    (root / "org" / "linked").symlink_to(repo_dir)
    with pytest.raises(UserError, match="not published by this publisher"):
        publish(root, "org/hand", repo_dir)
    with pytest.raises(UserError, match="symbolic link"):
        publish(root, "org/linked", repo_dir)
    assert sorted(p.name for p in hand.iterdir()) == ["mine.txt"]
    assert (root / "org" / "linked").is_symlink()


def test_published_repos_are_hashed_by_publish_not_by_requests(tmp_path: Path,
                                                                repo_dir: Path) -> None:
    root = tmp_path / "root"
    _, revision, _ = publish(root, "org/tiny", repo_dir)
    with HubServer(root) as server:
        for method, path in (("GET", "/api/models/org/tiny?blobs=true"),
                             ("GET", "/api/models/org/tiny/tree/main?recursive=true"),
                             ("HEAD", "/org/tiny/resolve/main/model.safetensors"),
                             ("GET", f"/org/tiny/resolve/{revision}/config.json")):
            assert httpx2.request(method, server.url + path).status_code == 200, path
        assert server.stats.bytes_hashed == 0


def test_a_cut_interrupts_one_transfer_and_requests_are_logged(tmp_path: Path,
                                                                repo_dir: Path) -> None:
    root = tmp_path / "root"
    _, revision, _ = publish(root, "org/tiny", repo_dir)
    with FaultyHub(root) as server:
        server.cut("model.safetensors", after=4096)
        url = f"{server.url}/org/tiny/resolve/{revision}/model.safetensors"
        with pytest.raises(httpx2.RemoteProtocolError):
            httpx2.get(url)
        assert server.stats.file_bytes["org/tiny/model.safetensors"] == 4096
        # one-shot fault
        assert httpx2.get(url).content == (repo_dir / "model.safetensors").read_bytes()
        assert httpx2.get(url, headers={"Range": "bytes=0-9"}).status_code == 206
        path = f"/org/tiny/resolve/{revision}/model.safetensors"
        assert server.requests == [("GET", path, None, 200), ("GET", path, None, 200),
                                   ("GET", path, "bytes=0-9", 206)]
        server.reset()
        assert server.requests == [] and server.stats.file_bytes["org/tiny/model.safetensors"] == 0
