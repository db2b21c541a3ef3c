"""The README stays a front page: at most 120 lines and 1,200 words, and its layout tree names every
top-level folder git tracks (dot-folders aside) and every subpackage of src/sparkspec (a folder
directly under it holding Python: an __init__.py, or the modules of a namespace package), and no
folder that is not there."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
PACKAGE = "src/sparkspec"
# a tree entry: a folder at column 0 (top level) or column 2 (a subpackage of the entry above),
# then its words
ENTRY = re.compile(r"^( {0,2})(\S+)/(?:\s|$)")


def tree() -> tuple[set[str], set[str]]:
    """(top-level entries, subpackage entries) of the fenced block under '## Layout', as paths."""
    text = README.read_text()
    section = text.split("\n## Layout\n", 1)
    assert len(section) == 2, "README.md has no '## Layout' section"
    block = re.search(r"^```[^\n]*\n(.*?)^```", section[1], re.MULTILINE | re.DOTALL)
    assert block, "the Layout section has no fenced tree"
    top: set[str] = set()
    sub: set[str] = set()
    parent = None
    for line in block.group(1).splitlines():
        match = ENTRY.match(line)
        if not match:
            continue                      # a description's continuation line, indented further
        indent, name = match.groups()
        if indent:
            assert parent, f"an indented entry with no folder above it: {line!r}"
            sub.add(f"{parent}/{name}")
        else:
            parent = name
            top.add(name)
    return top, sub


def tracked() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked folders are unknown")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [p for p in out.split("\0") if p]


def test_readme_is_short() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 120, \
        f"README.md has {len(text.splitlines())} lines (at most 120)"
    assert len(text.split()) <= 1200, f"README.md has {len(text.split())} words (at most 1,200)"


def test_layout_tree_matches_the_folders() -> None:
    files = tracked()
    folders = {p.split("/", 1)[0] for p in files if "/" in p and not p.startswith(".")}
    prefix = PACKAGE + "/"
    subpackages = {f"{PACKAGE}/{p[len(prefix):].split('/', 1)[0]}" for p in files
                   if p.startswith(prefix) and p.count("/") == 3 and p.endswith(".py")}
    assert folders and subpackages, "git ls-files found no folders: the test reads nothing"
    top, sub = tree()
    named_top = {t.split("/", 1)[0] for t in top}
    assert sorted(folders - named_top) == [], \
        "top-level folders missing from the README's layout tree"
    assert sorted(subpackages - sub) == [], \
        f"subpackages of {PACKAGE} missing from the README's layout tree"
    assert sorted(t for t in top | sub if not (ROOT / t).is_dir()) == [], \
        "the README's layout tree names folders that do not exist"
    assert sorted(t for t in top if t.split("/", 1)[0] not in folders) == [], \
        "the README's layout tree names folders git does not track"
