"""The endpoint's path resolution (sparkspec.hub.api): request segments refused or plain, and no
resolution leaves the root or opens a non-regular file."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkspec.hub.api import HubError, Repos, segments
from tests.unit.hub.conftest import REL, REPO, SEGMENT, q

# The hub as a hostile user meets it: the endpoint's path handling (traversal by absolute, dot,
# encoded and symlinked segments; header injection), ``fetch`` refusing outputs that would destroy
# what it did not create, names and revisions from a mirror used in paths, and tokens kept off the
# command line. Repos are laid out with the simulation's publisher (tests/support/hubpublish.py,
# whose own tests are in tests/unit/support/test_hub_testbed.py).
#
# Every refusal asserts the exact outcome: the HTTP status and that no byte of the secret file comes
# back, or for a command exit 2 with one ``sparkspec: error:`` line and every input unchanged by
# content hash.


@pytest.mark.usefixtures("_quiet")
@settings(max_examples=400, deadline=None)
@given(repo=REPO, rel=REL)
def test_resolution_never_leaves_the_root_nor_opens_a_non_regular_file(
        maze: dict[str, Any], repo: tuple[str, str], rel: str) -> None:
    org, name = repo
    repos = Repos(maze["root"], lambda n: None)
    try:
        fd, st_ = repos.open(repos.snapshot(org, name, "main"), rel)
    except HubError as err:
        assert err.status == 404
        return
    try:
        assert stat.S_ISREG(st_.st_mode)
        assert Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(maze["root"])
        assert maze["secret"] not in os.pread(fd, 1 << 16, 0)
    finally:
        os.close(fd)


@pytest.mark.usefixtures("_quiet")
@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(SEGMENT, st.text()), max_size=8))
def test_request_segments_are_refused_or_plain(parts: list[str]) -> None:
    for target in ("/" + "/".join(q(p) for p in parts), "/" + "/".join(parts)):
        try:
            got = segments(target)
        except HubError as err:
            assert err.status == 404
            continue
        for p in got:
            assert (p not in ("", ".", "..") and not set(p) & {"/", "\\", "\x7f"}
                    and min(p) >= " "), p
