"""Hostile outputs, second round (issue 23): `fetch batch` / `fetch repo` / `fetch fp8-subset`
destinations, `--progress-file`, and the batch checked as a whole before anything is fetched or
created. Every refusal is exit 2, one `sparkspec: error:` line, and the tree hashed before and after
is the same (tests/badinput.py). Nothing here connects anywhere: every item reads a --local-path,
and every case is refused before it reads."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkspec.errors import UserError
from sparkspec.hub.dest import Item, check_batch
from tests.badinput import assert_refused, assert_unchanged, fingerprint, refused_untouched, run

REV = "a" * 40


def _tree(root: Path) -> dict[str, Path]:
    """int4 (a folder with an index), src (a --local-path copy of a repo), foreign (someone's
    folder)."""
    int4, src, foreign = root / "int4", root / "src", root / "foreign"
    for folder in (int4, src, foreign):
        folder.mkdir()
    (int4 / "model.safetensors.index.json").write_text('{"weight_map": {}}\n')
    (src / "config.json").write_text("{}\n")
    (foreign / "notes.txt").write_text("mine\n")
    return {"int4": int4, "src": src, "foreign": foreign}


def _repo(dest: str | Path, src: Path) -> list[str]:
    return ["repo", "org/name", "--revision", REV, "--dest", str(dest), "--local-path", str(src)]


def _subset(dest: str | Path, int4: str | Path, src: Path) -> list[str]:
    return ["fp8-subset", "org/fp8", "--revision", REV, "--int4", str(int4), "--dest", str(dest),
            "--local-path", str(src)]


# --- --dest of a single fetch ---------------------------------------------------------------------
def _link_to_empty(t: Path) -> Path:
    (t / "empty").mkdir()
    (t / "d").symlink_to(t / "empty")
    return t / "d"


def _dangling(t: Path) -> Path:
    (t / "d").symlink_to(t / "nowhere")
    return t / "d"


def _fifo(t: Path) -> Path:
    os.mkfifo(t / "d")
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
    argv = _repo(dest, t["src"]) if kind == "repo" else _subset(dest, t["int4"], t["src"])
    refused_untouched(["fetch", *argv], [tmp_path], match=match)


# --- --progress-file ------------------------------------------------------------------------------
def _foreign_file(t: Path) -> Path:
    (t / "p.json").write_text('{"what": "not sparkspec"}\n')
    return t / "p.json"


def _link_to_file(t: Path) -> Path:
    (t / "p.json").symlink_to(t / "foreign" / "notes.txt")
    return t / "p.json"


PROGRESS = {
    "foreign-json": (_foreign_file, "was not written by this command"),
    "foreign-text": (lambda t: t / "foreign" / "notes.txt", "was not written by this command"),
    "fifo": (_fifo, "not a regular file"),
    "dangling-link": (_dangling, "symbolic link"),
    "link-to-a-file": (_link_to_file, "symbolic link"),
    "folder": (lambda t: t / "foreign", "not a regular file"),
    "missing-folder": (lambda t: t / "new" / "p.json", "is not an existing folder"),
    "inside-dest": (lambda t: t / "out" / "p.json", "is inside --dest"),
    "inside-an-input": (lambda t: t / "int4" / "p.json", "is inside --int4"),
}


@pytest.mark.parametrize("case", sorted(PROGRESS))
def test_a_hostile_progress_file_is_refused_before_anything(tmp_path: Path, case: str) -> None:
    t = _tree(tmp_path)
    make, match = PROGRESS[case]
    progress = make(tmp_path)
    argv = ["fetch", *_subset(tmp_path / "out", t["int4"], t["src"]),
            "--progress-file", str(progress)]
    refused_untouched(argv, [tmp_path], match=match)


def test_a_refused_command_leaves_no_progress_file(tmp_path: Path) -> None:
    """The command's own check refuses it (a foreign --dest): the progress file was never
    created."""
    t = _tree(tmp_path)
    argv = ["fetch", *_repo(t["foreign"], t["src"]), "--progress-file", str(tmp_path / "p.json")]
    refused_untouched(argv, [tmp_path], match="did not write")


def test_a_progress_file_of_ours_is_replaced_then_removed(tmp_path: Path) -> None:
    """A document this tool wrote (a killed run's) is replaced during the run and removed at its
    end; the fetch itself completes (a local copy)."""
    t = _tree(tmp_path)
    progress = tmp_path / "p.json"
    progress.write_text(json.dumps({"format": "sparkspec progress", "done": 1}) + "\n")
    outcome = run("fetch", *_repo(tmp_path / "out", t["src"]), "--progress-file", progress)
    assert outcome.rc == 0, outcome.stderr
    assert not progress.exists() and (tmp_path / "out" / "config.json").read_text() == "{}\n"


# --- fetch batch: the items against each other ----------------------------------------------------
def _batch(t: Path, src: Path) -> dict[str, tuple[list[list[str]], str]]:
    a, b, int4 = t / "a", t / "b", t / "int4"
    return {
        "duplicate": ([_repo(a, src), _repo(a, src)], "item 2 repeats item 1"),
        "same-dest": ([_repo(a, src), _subset(a, int4, src)], "items 1 and 2 both write --dest"),
        "same-dest-spelt-apart": ([_repo(a, src), _repo(t / "x" / ".." / "a", src)],
                                  "both write --dest"),
        "nested-dests": ([_repo(a, src), _repo(a / "in", src)],
                         "item 2's --dest .* is inside item 1's"),
        "holding-dests": ([_repo(a / "in", src), _repo(a, src)],
                          "item 2's --dest .* holds item 1's"),
        "int4-fetched-after": ([_subset(b, a, src), _repo(a, src)],
                               "item 1 reads --int4 .*, which item 2 fetches only after "
                               "it; put item 2 before"),
        "dest-inside-int4": ([_subset(b, int4, src), _repo(int4 / "x", src)],
                             "item 2's --dest .* is inside item 1's --int4"),
        "int4-inside-dest": ([_repo(a, src), _subset(b, a / "int4", src)],
                             "item 1's --dest .* holds item 2's --int4"),
        "dest-is-local-path": ([_repo(a, src), _repo(b, t / "c"), _repo(t / "c", src)],
                               "item 2 reads --local-path .*, which item 3 fetches only after it"),
        "int4-missing": ([_repo(a, src), _subset(b, t / "nowhere", src)],
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
    argvs = [_repo(root / d, t["src"]) if k == "repo" else _subset(root / d, root / i, t["src"])
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


# --- the one writer -------------------------------------------------------------------------------
def test_a_swap_without_the_exchange_removes_nothing_it_did_not_make(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem lacks renameat2's exchange, the old content moves aside under a fresh
    name: a folder someone keeps as .out.old beside the output stays as it was."""
    from sparkspec import outputs

    out, tmp, kept = tmp_path / "out", tmp_path / ".out.build", tmp_path / ".out.old"
    for folder, text in ((out, "old"), (tmp, "new"), (kept, "mine")):
        folder.mkdir()
        (folder / "f").write_text(text)
    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)
    outputs.swap_folder(tmp, out)
    assert (out / "f").read_text() == "new" and (kept / "f").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old", "out"]


def test_a_stop_signal_while_a_temp_is_made_leaves_no_temp(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM right after the temp sibling is created, before its name is back in the writer's
    hands (the window of the generate flake): the signal still stops the write (KeyboardInterrupt,
    exit 130 in a command) and the temp is gone."""
    import signal

    from sparkspec import outputs, stops

    real = outputs.open_temp

    def made_then_signalled(target: str | os.PathLike[str],
                            mode: int | None = None) -> tuple[int, Path]:
        made = real(target, mode)
        os.kill(os.getpid(), signal.SIGTERM)
        return made

    monkeypatch.setattr(outputs, "open_temp", made_then_signalled)
    monkeypatch.setattr(stops, "_requested", [])  # the stop recorded here ends with this test
    with stops.handled(), pytest.raises(KeyboardInterrupt):
        outputs.write_atomic(tmp_path / "f.json", b"{}\n")
    assert list(tmp_path.iterdir()) == []
