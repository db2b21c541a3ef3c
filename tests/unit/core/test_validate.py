"""The one validator of untrusted names and paths (sparkspec.validate): its patterns by example, and
by property over arbitrary text that no accepted name or joined path ever leaves its root."""

from __future__ import annotations

import os
import posixpath
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkspec import validate
from sparkspec.errors import UserError

GOOD_REPOS = ["Qwen/Qwen3.5-122B-A10B-FP8", "org/x", "a/b",
              "Intel/Qwen3.5-122B-A10B-int4-AutoRound", "o1/n.a_m-e", "A" * 96 + "/" + "b" * 96]
BAD_REPOS = ["", "org", "org/", "/x", "x/", "org/.", "./.", "org/..", "../x", "org/a/b", "org//x",
             "org\\x/y", "org/na me", "org/-x", "org/x-", "org/.x", "org/x.", "a--b/c", "a/b--c",
             "a/b..c", "A" * 97 + "/b", "org/x\n", "org/x\0", "org/é", None, 3, ["org/x"]]


@pytest.mark.parametrize("value", GOOD_REPOS)
def test_repo_id_accepts_the_hubs_ids(value: str) -> None:
    assert validate.repo_id(value) == value
    assert validate.repo_folder(value) == value.replace("/", "--")


@pytest.mark.parametrize("value", BAD_REPOS)
def test_repo_id_refuses_paths_and_oddities(value: object) -> None:
    with pytest.raises(UserError, match="is not org/name"):
        validate.repo_id(value, "--repo")


@pytest.mark.parametrize("value, ok", [
    ("main", True), ("v1.0", True), ("refs/pr/12", True), ("a" * 40, True), ("release_2-x", True),
    ("", False), ("../x", False), ("main/../x", False), ("a..b", False), ("refs/pr/x", False),
    ("refs/heads/x", False),
    ("-x", False), (".x", False), ("a b", False), ("main\n", False), ("x" * 129, False),
    ("/main", False), (None, False),
])
def test_revision(value: object, ok: bool) -> None:
    if ok:
        assert validate.revision(value) == value
    else:
        with pytest.raises(UserError, match="not a commit id, branch or tag"):
            validate.revision(value)


@pytest.mark.parametrize("value, ok", [
    ("0123456789abcdef0123456789abcdef01234567", True), ("A" * 40, False), ("a" * 39, False),
    ("a" * 41, False), ("g" * 40, False), ("main", False), ("a" * 40 + "\n", False), (None, False),
])
def test_commit(value: object, ok: bool) -> None:
    if ok:
        assert validate.commit(value) == value
    else:
        with pytest.raises(UserError, match="not a 40-hex commit id"):
            validate.commit(value)


@pytest.mark.parametrize("value, ok", [
    ("config.json", True), ("sub/notes.txt", True), (".gitattributes", True),
    ("a/b/c/d.safetensors", True), ("...", True), ("x+y=z@w,v", True),
    ("", False), ("/etc/passwd", False), ("../x", False), ("a/../b", False), ("./x", False),
    ("a/./b", False), ("a//b", False), ("a/", False), ("a\\b", False), ("a b", False),
    ("a\0b", False), ("a\nb", False), ("é.txt", False), ("x" * 256, False),
    ("a/" * 512 + "b", False), (None, False), (b"x", False),
])
def test_relpath_and_filename(value: object, ok: bool) -> None:
    if ok:
        assert validate.relpath(value) == value
        if "/" not in value:  # type: ignore[operator]
            assert validate.filename(value) == value
    else:
        with pytest.raises(UserError, match="not a plain relative path"):
            validate.relpath(value)
        with pytest.raises(UserError, match="not a plain file name"):
            validate.filename(value)


def test_under_refuses_links_out_and_with_no_symlinks_any_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    (root / "sub" / "f").write_text("x")
    (root / "out").symlink_to(outside)
    (root / "in").symlink_to(root / "sub")
    assert validate.under(root, "sub/f") == root.resolve() / "sub" / "f"
    assert validate.under(root, "in/f") == root.resolve() / "in" / "f"  # a link that stays inside
    with pytest.raises(UserError, match="leaves"):
        validate.under(root, "out/x")
    for rel in ("in/f", "out/x"):
        with pytest.raises(UserError, match="symbolic link"):
            validate.under(root, rel, no_symlinks=True)
    assert validate.under(root, "sub/f", no_symlinks=True) == root.resolve() / "sub" / "f"


def test_check_disjoint_by_real_paths(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "inner").mkdir(parents=True)
    (tmp_path / "alias").symlink_to(src)
    for out, how in ((src, "is"), (tmp_path / "alias", "is"), (src / "inner", "is inside"),
                     (tmp_path / "alias" / "new", "is inside"), (tmp_path, "contains")):
        with pytest.raises(UserError, match=f"--out {out} {how} the input --int4"):
            validate.check_disjoint(out, {"--int4": src, "--fp8": None})
    validate.check_disjoint(tmp_path / "elsewhere", {"--int4": src, "--fp8": None})
    validate.check_not_symlink(src, "--out")
    with pytest.raises(UserError, match="symbolic link"):
        validate.check_not_symlink(tmp_path / "alias", "--out")


def test_regular_files_only_and_never_a_hang(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # nobody writes: opening it for reading in blocking mode would wait forever
    (tmp_path / "file").write_bytes(b"12345")
    for path in (fifo, tmp_path, Path("/dev/null")):
        with pytest.raises(UserError, match="not a regular file"):
            validate.read_regular(path)
        with pytest.raises(UserError, match="not a regular file"):
            validate.require_regular(path)
    with pytest.raises(UserError, match="not found"):
        validate.read_regular(tmp_path / "missing")
    assert validate.read_regular(tmp_path / "file") == b"12345"
    with pytest.raises(UserError, match="5 bytes, more than the 4"):
        validate.read_regular(tmp_path / "file", limit=4)


# --- properties -----------------------------------------------------------------------------------
PIECES = st.sampled_from(["", ".", "..", "...", "/", "//", "\\", "\0", "\n", "a", "b.json", "..a",
                          "a..", "%2F", "~", "-", "é", " "])
TEXT = st.lists(st.one_of(PIECES, st.text(max_size=8)), max_size=8).map("".join)


@settings(max_examples=500, deadline=None)
@given(TEXT)
def test_an_accepted_relpath_never_leaves_its_root(value: str) -> None:
    try:
        rel = validate.relpath(value)
    except UserError:
        return
    assert not rel.startswith("/") and "\\" not in rel and "\0" not in rel
    assert all(part not in ("", ".", "..") for part in rel.split("/"))
    joined = posixpath.normpath(posixpath.join("/root", rel))
    assert joined.startswith("/root/") and joined == "/root/" + rel


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=TEXT)
def test_under_never_returns_a_path_outside_the_root(tmp_path: Path, value: str) -> None:
    root = tmp_path / "root"
    if not root.exists():
        (root / "a").mkdir(parents=True)
        (root / "up").symlink_to(tmp_path)
    try:
        path = validate.under(root, value)
    except UserError:
        return
    assert path.resolve().is_relative_to(root.resolve())


@settings(max_examples=300, deadline=None)
@given(org=TEXT, name=TEXT)
def test_an_accepted_repo_id_is_one_plain_folder_name(org: str, name: str) -> None:
    try:
        repo = validate.repo_id(f"{org}/{name}")
    except UserError:
        return
    folder = validate.repo_folder(repo)
    assert validate.filename(folder) == folder and folder.count("--") == 1
    assert folder.split("--") == repo.split("/")
