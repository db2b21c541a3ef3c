"""The hub endpoint (sparkspec.hub.server, ``sparkspec hub serve``) against a hostile client:
traversal by absolute, dot, encoded and symlinked segments, header injection, unpublished folders
and dot files, tokens kept off the command line."""

from __future__ import annotations

import json
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkspec.hub.server import HubServer
from tests.badinput import (
    assert_unchanged,
    fingerprint,
)
from tests.support.hubpublish import publish
from tests.unit.conftest import _small_repo
from tests.unit.hub.conftest import REL, REPO, q, raw

# The hub as a hostile user meets it: the endpoint's path handling (traversal by absolute, dot,
# encoded and symlinked segments; header injection), ``fetch`` refusing outputs that would destroy
# what it did not create, names and revisions from a mirror used in paths, and tokens kept off the
# command line. Repos are laid out with the simulation's publisher (tests/support/hubpublish.py,
# whose own tests are in tests/unit/support/test_hub_testbed.py).
#
# Every refusal asserts the exact outcome: the HTTP status and that no byte of the secret file comes
# back, or for a command exit 2 with one ``sparkspec: error:`` line and every input unchanged by
# content hash.


# --- the endpoint ---------------------------------------------------------------------------------
@pytest.fixture()
def hostile_root(tmp_path: Path) -> dict[str, Path]:
    """A hub root with one published repo and, beside it, a secret folder that must never be served;
    links inside the root point at the secret (a file, a folder, and a whole org)."""
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    secret = secret_dir / "secret.txt"
    secret.write_text(f"TOP-SECRET-{uuid.uuid4().hex}\n")
    root = tmp_path / "root"
    publish(root, "org/tiny", _small_repo(tmp_path / "src"))
    repo = root / "org" / "tiny"
    (repo / "leak.txt").symlink_to(secret)
    (repo / "linkdir").symlink_to(secret_dir)
    (root / "evil").symlink_to(tmp_path)
    return {"root": root, "secret": secret, "secret_dir": secret_dir, "tmp": tmp_path}


def _attacks(p: dict[str, Path]) -> list[tuple[str, str]]:
    sd, sf = str(p["secret_dir"]), str(p["secret"])
    return [
        ("GET", f"/x/{q(sd)}/resolve/main/secret.txt"),  # absolute repo segment
        ("HEAD", f"/x/{q(sd)}/resolve/main/secret.txt"),
        ("GET", f"/{q(sd)}/x/resolve/main/secret.txt"),
        ("GET", f"/api/models/x/{q(sd)}/tree/main"),  # the tree endpoint listing any folder
        ("GET", f"/api/models/x/{q(sd)}/tree/main?recursive=true"),
        ("GET", f"/api/models/x/{q(sd)}?blobs=true"),
        ("GET", f"/api/models/x/{q(sd)}/revision/main"),
        ("GET", "/org/tiny/resolve/main/leak.txt"),  # a symlinked file inside the repo
        ("GET", "/org/tiny/resolve/main/linkdir/secret.txt"),  # a symlinked folder inside the repo
        ("GET", "/api/models/org/tiny/tree/main/linkdir"),
        ("GET", "/evil/secret/resolve/main/secret.txt"),  # a symlinked org
        ("GET", "/api/models/evil/secret/tree/main"),
        ("GET", "/org/tiny/resolve/main/..%2F..%2F..%2Fsecret%2Fsecret.txt"),  # encoded traversal
        ("GET", f"/org/tiny/resolve/main/{q(sf)}"),  # encoded absolute file path
        ("GET", "/org/tiny/resolve/main/sub%5C..%5C..%5C..%5Csecret%5Csecret.txt"),  # backslashes
        ("GET", "/org/tiny/resolve/main/config.json%00.txt"),  # NUL
        ("GET", "/org/tiny/resolve/main/../../../secret/secret.txt"),  # raw dots
        ("GET", "/org/tiny/resolve/%2E%2E/x"),
        ("GET", "/org/%2E%2E/resolve/main/secret/secret.txt"),
        ("GET", "/api/models/org/tiny/tree/main/..%2F..%2F..%2Fsecret"),
        ("GET", f"/api/models/org/tiny/tree/main/{q(sd)}"),
        ("GET", "//org/tiny/resolve/main/config.json/../../../../secret/secret.txt"),
    ]


@pytest.mark.usefixtures("_quiet")
def test_endpoint_answers_hostile_paths_with_404_and_never_the_secret(
        hostile_root: dict[str, Path]) -> None:
    secret = hostile_root["secret"].read_bytes()
    with HubServer(hostile_root["root"]) as server:
        failures = []
        for method, path in _attacks(hostile_root):
            status, _, body = raw(server.url, method, path)
            # the secret's bytes, or any listing (a tree entry or a sibling) instead of an error
            leaked = secret.strip() in body or b'"size"' in body or b'"rfilename"' in body
            if status != 404 or leaked:
                failures.append(f"{method} {path}: {status} "
                                f"{'LEAKED ' if leaked else ''}{body[:80]!r}")
        # paths-info answers only the repo's own files
        status, _, body = raw(server.url, "POST", "/api/models/org/tiny/paths-info/main",
                              urllib.parse.urlencode({"paths": [
                                  "leak.txt", "linkdir", "../../secret/secret.txt",
                                  str(hostile_root["secret"])]}, doseq=True).encode(),
                              {"Content-Type": "application/x-www-form-urlencoded"})
        if status != 200 or json.loads(body) != []:
            failures.append(f"paths-info: {status} {body[:200]!r}")
        # the repo's own files are still served, and only those are listed
        status, _, body = raw(server.url, "GET", "/org/tiny/resolve/main/sub/notes.txt")
        assert (status, body) == (200, b"hello\n")
        status, _, body = raw(server.url, "GET", "/api/models/org/tiny/tree/main?recursive=true")
        listed = sorted(e["path"] for e in json.loads(body)) if status == 200 else []
        if listed != ["config.json", "model.safetensors", "sub", "sub/notes.txt"]:
            failures.append(f"tree lists {listed}")
    assert not failures, "\n".join(failures)


@pytest.mark.usefixtures("_quiet")
def test_endpoint_error_headers_cannot_be_injected(hostile_root: dict[str, Path]) -> None:
    with HubServer(hostile_root["root"]) as server:
        for path in ("/api/models/org/tiny/revision/x%0d%0aX-Injected:%201",
                     "/org/tiny/resolve/x%0d%0aX-Injected:%201/config.json",
                     "/org/tiny/resolve/main/nope%0d%0aX-Injected:%201"):
            status, headers, _ = raw(server.url, "GET", path)
            assert status == 404 and "x-injected" not in headers, (path, status, headers)


@pytest.mark.usefixtures("_quiet")
@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["resolve", "tree", "info"]), repo=REPO, rel=REL)
def test_hostile_http_requests_never_get_the_secret(maze: dict[str, Any], kind: str,
                                                    repo: tuple[str, str], rel: str) -> None:
    seg = [urllib.parse.quote(x, safe="/.") for x in (*repo, rel)]
    path = {"resolve": f"/{seg[0]}/{seg[1]}/resolve/main/{seg[2]}",
            "tree": f"/api/models/{seg[0]}/{seg[1]}/tree/main/{seg[2]}?recursive=true",
            "info": f"/api/models/{seg[0]}/{seg[1]}/revision/main?blobs=true"}[kind]
    status, _, body = raw(maze["server"].url, "GET", path)
    assert status in (200, 404), (path, status)
    assert maze["secret"] not in body
    if status == 200 and kind == "resolve":  # only a file of the repo, byte for byte
        assert body == (maze["repo"] / urllib.parse.unquote(seg[2])).read_bytes()
    if status == 200 and kind != "resolve":
        names = [e.get("path") or e.get("rfilename") for e in
                 (json.loads(body) if kind == "tree" else json.loads(body)["siblings"])]
        assert set(names) <= {"config.json", "model.safetensors", "sub", "sub/notes.txt"}, names


# --- follow-ups: what a hostile tester found after the first round --------------------------------
@pytest.mark.usefixtures("_quiet")
def test_endpoint_serves_only_published_folders_and_no_dot_files(tmp_path: Path) -> None:
    """``hub serve --root /`` must not make /home/al a repo: a folder without the serve marker is
    not found and nothing is written into it; in a repo, names starting with '.' (but
    .gitattributes) are never served nor listed."""
    root = tmp_path / "root"
    publish(root, "org/tiny", _small_repo(tmp_path / "src"))
    repo = root / "org" / "tiny"
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (repo / ".env").write_text("SECRET=1\n")
    (repo / "sub" / ".hidden").write_text("hidden\n")
    (repo / ".ssh").mkdir()
    (repo / ".ssh" / "id_rsa").write_text("REPO KEY\n")
    home = root / "home" / "al"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("PRIVATE KEY\n")
    (home / "notes.txt").write_text("mine\n")
    before = fingerprint(home)
    with HubServer(root) as server:
        for path in ("/home/al/resolve/main/.ssh/id_rsa", "/home/al/resolve/main/notes.txt",
                     "/api/models/home/al", "/api/models/home/al?blobs=true",
                     "/api/models/home/al/tree/main?recursive=true", "/org/tiny/resolve/main/.env",
                     "/org/tiny/resolve/main/sub/.hidden", "/org/tiny/resolve/main/.ssh/id_rsa",
                     "/api/models/org/tiny/tree/main/.ssh"):
            status, _, body = raw(server.url, "GET", path)
            assert status == 404 and b"KEY" not in body and b"SECRET" not in body, \
                (path, status, body[:80])
        status, _, body = raw(server.url, "GET", "/org/tiny/resolve/main/.gitattributes")
        assert (status, body) == (200, b"*.safetensors filter=lfs\n")
        status, _, body = raw(server.url, "GET", "/api/models/org/tiny/tree/main?recursive=true")
        assert sorted(e["path"] for e in json.loads(body)) == [
            ".gitattributes", "config.json", "model.safetensors", "sub", "sub/notes.txt"]
        status, _, body = raw(server.url, "GET", "/api/models/org/tiny?blobs=true")
        assert sorted(s["rfilename"] for s in json.loads(body)["siblings"]) == [
            ".gitattributes", "config.json", "model.safetensors", "sub/notes.txt"]
    assert_unchanged(before, home)
