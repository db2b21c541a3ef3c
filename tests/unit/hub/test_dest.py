"""A fetch's destinations (sparkspec.hub.dest): outputs that would destroy what the fetch did not
create, a batch checked whole before anything is fetched, full or read-only disks and failed
downloads that leave nothing behind."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkspec.errors import UserError
from sparkspec.hub.dest import Item, check_batch
from tests.badinput import (
    assert_refused,
    assert_unchanged,
    fingerprint,
    refused_untouched,
    run,
)
from tests.support.hubfaults import FaultyHub
from tests.support.hubpublish import publish
from tests.unit.conftest import _dangling, _fifo, _fp8_subset, _repo, _small_repo, _tree
from tests.unit.hub.conftest import _subset

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
def test_fetch_refuses_a_dest_that_overlaps_an_input(work: dict[str, Path]) -> None:
    int4, fp8, tmp = work["int4"], work["fp8"], work["tmp"]
    roots = [int4, fp8]
    # the same folder for --dest and --int4 overwrote the INT4 shards and removed its extra tensors
    refused_untouched(_subset(work, int4), roots, match="--dest .* the input --int4")
    refused_untouched(_subset(work, int4 / "fp8"), roots, match="--dest .* the input --int4")
    refused_untouched(_subset(work, tmp), roots, match="--dest .* the input --int4")
    refused_untouched(_subset(work, fp8), roots, match="--dest .* the input --local-path")
    repo: list[str | Path] = ["fetch", "repo", "Qwen/tiny-FP8", "--revision", "main",
                              "--local-path", fp8, "--dest"]
    refused_untouched([*repo, fp8], roots, match="--dest .* the input --local-path")
    refused_untouched([*repo, fp8 / "copy"], roots, match="--dest .* the input --local-path")


@pytest.mark.usefixtures("_quiet")
def test_fetch_refuses_a_dest_it_did_not_create(work: dict[str, Path]) -> None:
    foreign = work["tmp"] / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"mine": true}\n')
    (foreign / "old.safetensors").write_bytes(b"not the fetch's")
    roots = [work["int4"], work["fp8"], foreign]
    refused_untouched(_subset(work, foreign), roots, match="sparkspec fetch")
    refused_untouched(["fetch", "repo", "Qwen/tiny-FP8", "--revision", "main",
                       "--local-path", work["fp8"], "--dest", foreign], roots,
                      match="sparkspec fetch")
    link = work["tmp"] / "link"
    link.symlink_to(work["tmp"] / "elsewhere")
    refused_untouched(_subset(work, link), [*roots, link], match="symbolic link")


# --- failures of machine and server: one line, exit 1 (2 for a read-only output), nothing left ----
@pytest.mark.usefixtures("_quiet")
def test_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(
        tmp_path: Path, ckpt_tmpfs: Callable[..., Path]) -> None:
    src = _small_repo(tmp_path / "src")
    (src / "model.safetensors").write_bytes(os.urandom(3 << 20))
    full, read_only = ckpt_tmpfs("1m"), ckpt_tmpfs("16m", readonly=True)
    # a read-only output: the user's to fix (exit 2)
    refused_untouched(["fetch", "repo", "org/x", "--revision", "main", "--local-path", src,
                       "--dest", read_only / "dest"], [read_only, src], 2, "Read-only file system")
    refused_untouched(["fetch", "repo", "org/x", "--revision", "main", "--local-path", src,
                       "--dest", full / "dest"], [full, src], 2, "needs 3\\.0+ ?MiB free")


@pytest.mark.usefixtures("_quiet")
def test_a_failed_download_leaves_no_temp_or_lock_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    publish(root, "org/tiny", _small_repo(tmp_path / "src"))
    (root / "org" / "tiny" / "model.safetensors").unlink()
    (tmp_path / "src" / "model.safetensors").write_bytes(os.urandom(1 << 20))
    publish(root, "org/tiny", tmp_path / "src")
    dest = tmp_path / "dest"
    with FaultyHub(root) as server:
        server.cut("model.safetensors", after=4096, times=100)  # every attempt is cut
        fetch: list[str | Path] = ["fetch", "repo", "org/tiny", "--revision", "main", "--endpoint",
                                   server.url, "--dest", dest]
        # huggingface_hub reports its retries on the way; the outcome is one last line
        failed = run(*fetch)
        lines = failed.stderr.strip().splitlines()
        assert failed.rc == 1 and "Traceback" not in failed.stderr, failed.stderr
        assert [line for line in lines
                if line.startswith("sparkspec: error: ")] == lines[-1:], lines
        assert "transfer failed" in lines[-1]
        left = ([str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()]
                if dest.exists() else [])
        assert not [p for p in left if p.endswith((".lock", ".incomplete", ".part", ".tmp"))], left
        assert "model.safetensors" not in left
        server.heal()
        outcome = run(*fetch)  # the re-run completes it
        assert outcome.rc == 0, outcome.stderr
    assert ((dest / "model.safetensors").read_bytes()
            == (tmp_path / "src" / "model.safetensors").read_bytes())
    assert not [p for p in dest.rglob("*") if p.suffix in (".lock", ".incomplete", ".part", ".tmp")]


# Hostile outputs, second round (issue 23): `fetch batch` / `fetch repo` / `fetch fp8-subset`
# destinations, `--progress-file`, and the batch checked as a whole before anything is fetched or
# created. Every refusal is exit 2, one `sparkspec: error:` line, and the tree hashed before and
# after is the same (tests/badinput.py). Nothing here connects anywhere: every item reads a --local-
# path, and every case is refused before it reads.


# --- --dest of a single fetch ---------------------------------------------------------------------
def _link_to_empty(t: Path) -> Path:
    (t / "empty").mkdir()
    (t / "d").symlink_to(t / "empty")
    return t / "d"


def _planted_cache_link(t: Path) -> Path:
    """A fetch's own folder (its state folder there) in which someone planted .cache ->
    elsewhere."""
    (t / "d" / ".sparkspec-fetch").mkdir(parents=True)
    (t / "d" / ".cache").symlink_to(t / "foreign")
    return t / "d"


DESTS = {
    "link": (_link_to_empty, "is a symbolic link"),
    "dangling-link": (_dangling, "is a symbolic link"),
    "fifo": (_fifo, "not a folder"),
    "foreign-folder": (lambda t: t / "foreign", "did not write"),
    "equals-int4": (lambda t: t / "int4", "the input --int4"),
    "inside-int4": (lambda t: t / "int4" / "sub", "is inside the input --int4"),
    "holds-int4": (lambda t: t, "contains the input --int4"),
    "inside-local-path": (lambda t: t / "src" / "x", "is inside the input --local-path"),
    "link-inside-own-folder": (_planted_cache_link, r"holds the symbolic link .*\.cache"),
}


@pytest.mark.parametrize(("kind", "case"),
                         [(k, c) for k in ("repo", "fp8-subset") for c in sorted(DESTS)
                          if k == "fp8-subset" or "int4" not in c])  # repo reads no --int4
def test_a_hostile_dest_is_refused_before_anything(tmp_path: Path, case: str, kind: str) -> None:
    t = _tree(tmp_path)
    make, match = DESTS[case]
    dest = make(tmp_path)
    argv = _repo(dest, t["src"]) if kind == "repo" else _fp8_subset(dest, t["int4"], t["src"])
    refused_untouched(["fetch", *argv], [tmp_path], match=match)


# --- fetch batch: the items against each other ----------------------------------------------------
def _batch(t: Path, src: Path) -> dict[str, tuple[list[list[str]], str]]:
    a, b, int4 = t / "a", t / "b", t / "int4"
    return {
        "duplicate": ([_repo(a, src), _repo(a, src)], "item 2 repeats item 1"),
        "same-dest": ([_repo(a, src), _fp8_subset(a, int4, src)],
                      "items 1 and 2 both write --dest"),
        "same-dest-spelt-apart": ([_repo(a, src), _repo(t / "x" / ".." / "a", src)],
                                  "both write --dest"),
        "nested-dests": ([_repo(a, src), _repo(a / "in", src)],
                         "item 2's --dest .* is inside item 1's"),
        "holding-dests": ([_repo(a / "in", src), _repo(a, src)],
                          "item 2's --dest .* holds item 1's"),
        "int4-fetched-after": ([_fp8_subset(b, a, src), _repo(a, src)],
                               "item 1 reads --int4 .*, which item 2 fetches only after "
                               "it; put item 2 before"),
        "dest-inside-int4": ([_fp8_subset(b, int4, src), _repo(int4 / "x", src)],
                             "item 2's --dest .* is inside item 1's --int4"),
        "int4-inside-dest": ([_repo(a, src), _fp8_subset(b, a / "int4", src)],
                             "item 1's --dest .* holds item 2's --int4"),
        "dest-is-local-path": ([_repo(a, src), _repo(b, t / "c"), _repo(t / "c", src)],
                               "item 2 reads --local-path .*, which item 3 fetches only after it"),
        "int4-missing": ([_repo(a, src), _fp8_subset(b, t / "nowhere", src)],
                         "nowhere/model.safetensors.index.json: index not found"),
        "foreign-dest-last": ([_repo(a, src), _repo(t / "foreign", src)], "did not write"),
    }


@pytest.mark.parametrize("case", sorted(_batch(Path("/t"), Path("/s"))))
def test_a_batch_is_refused_whole_before_any_item_runs(tmp_path: Path, case: str) -> None:
    t = _tree(tmp_path)
    items, match = _batch(tmp_path, t["src"])[case]
    refused_untouched(["fetch", "batch", "--items", json.dumps(items)], [tmp_path], match=match)


def test_a_batch_progress_file_inside_an_items_dest_is_refused(tmp_path: Path) -> None:
    t = _tree(tmp_path)
    items = [_repo(tmp_path / "a", t["src"]), _repo(tmp_path / "b", t["src"])]
    refused_untouched(["fetch", "batch", "--items", json.dumps(items), "--progress-file",
                       tmp_path / "b" / "p.json"], [tmp_path], match="inside --dest .* of item 2")


def test_a_batch_whose_subset_reads_an_earlier_items_dest_is_accepted(tmp_path: Path) -> None:
    """The FP8 subset reads the INT4 folder that the item before it fetches: checked, nothing
    created."""
    t = _tree(tmp_path)
    before = fingerprint(tmp_path)
    src, int4 = str(t["src"]), str(tmp_path / "new-int4")
    check_batch([Item(1, int4, {"--local-path": src}),
                 Item(2, str(tmp_path / "sub"), {"--int4": int4, "--local-path": src})])
    assert_unchanged(before, tmp_path)


# --- the property: accepted, and then apart; or refused in one line with nothing created ----------
NAMES = ["a", "a/in", "b", "c", "int4"]


@st.composite
def batches(draw: st.DrawFn) -> list[tuple[str, str, str]]:
    n = draw(st.integers(1, 4))
    return [(draw(st.sampled_from(["repo", "fp8-subset"])), draw(st.sampled_from(NAMES)),
             draw(st.sampled_from(NAMES))) for _ in range(n)]


def _overlap(x: Path, y: Path) -> bool:
    return x == y or x.is_relative_to(y) or y.is_relative_to(x)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches())
def test_batch_property_apart_or_refused_untouched(tmp_path_factory: pytest.TempPathFactory,
                                                   batch: list[tuple[str, str, str]]) -> None:
    root = tmp_path_factory.mktemp("batch")
    t = _tree(root)
    argvs = [_repo(root / d, t["src"]) if k == "repo" else _fp8_subset(root / d, root / i, t["src"])
             for k, d, i in batch]
    items = [Item(n, str(root / d), {"--local-path": str(t["src"])}
                  | ({"--int4": str(root / i)} if k == "fp8-subset" else {}), tuple(argv))
             for n, ((k, d, i), argv) in enumerate(zip(batch, argvs, strict=True), 1)]
    before = fingerprint(root)
    try:
        check_batch(items)
    except UserError as exc:
        assert "\n" not in str(exc)
        assert_unchanged(before, root)
        outcome = run("fetch", "batch", "--items", json.dumps(argvs))
        assert_refused(outcome, 2)
        assert_unchanged(before, root)
        return
    assert_unchanged(before, root)
    dests = [Path(it.dest) for it in items]
    assert not any(_overlap(x, y) for n, x in enumerate(dests) for y in dests[:n])
    for n, it in enumerate(items):
        for path in it.inputs.values():
            for m, d in enumerate(dests):
                if m != n and _overlap(d, Path(path)):
                    # only an earlier item's complete folder is read
                    assert d == Path(path) and m < n
