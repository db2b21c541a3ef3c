"""sparkspec.outputs, the one writer: atomic writes leave no temp file behind, never act through a
link, honour their mode; an output that is not ours is refused, ours is replaced; and no second
writer appears in src/."""

from __future__ import annotations

import ast
import io
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sparkspec import outputs
from sparkspec.errors import RunFailure, UserError
from sparkspec.outputs import PNG, Output, check_outputs, json_format, starts_with, write_outputs

SRC = Path(__file__).resolve().parents[3] / "src" / "sparkspec"
FORMAT = "sparkspec-test/1"


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


class Boom(Exception):
    pass


def _parts_then_fail() -> Iterator[bytes]:
    yield b"half of it"
    raise Boom


def _in_block(target: Path) -> None:
    with outputs.atomic(target) as fh:
        fh.write(b"half of it")
        raise Boom


def _oserror_in_block(target: Path) -> None:
    with outputs.atomic(target) as fh:
        fh.write(b"x")
        raise OSError(28, "No space left on device")


FAILURES: list[tuple[str, Callable[[Path], object], type[BaseException]]] = [
    ("parts raise mid-stream", lambda t: outputs.write_atomic(t, _parts_then_fail()), Boom),
    ("the block raises", _in_block, Boom),
    ("an OSError in the block", _oserror_in_block, OSError),
    ("not bytes", lambda t: outputs.write_atomic(t, ["text"]),  # type: ignore[list-item]
     TypeError),
    ("stage: not bytes", lambda t: outputs.stage(t, "text"), TypeError),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("name", "write", "error"), FAILURES, ids=[f[0] for f in FAILURES])
def test_a_failed_write_leaves_the_old_file_and_no_temp(name: str, write: Callable[[Path], object],
                                                        error: type[BaseException],
                                                        tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_bytes(b"old")
    before = _entries(tmp_path)
    with pytest.raises(error):
        write(target)
    assert target.read_bytes() == b"old"
    assert _entries(tmp_path) == before


def test_a_failed_rename_leaves_no_temp(tmp_path: Path) -> None:
    """A folder appears where the file goes while it is written: the rename fails, the temp file
    goes."""
    target = tmp_path / "out"
    with pytest.raises(IsADirectoryError), outputs.atomic(target) as fh:
        fh.write(b"new")
        target.mkdir()
        (target / "inside").write_text("x")
    assert _entries(tmp_path) == ["out"] and _entries(target) == ["inside"]


def test_write_outputs_writes_none_when_one_fails(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """All or none: the disk fills while the third output is staged, so the first is not replaced,
    and the staged siblings and the folder made for the second are gone."""
    first = tmp_path / "a.md"
    first.write_text("| ours |\n")
    items = [(Output(str(first), "--markdown", starts_with("| ours |")), b"| ours | new\n"),
             (Output(str(tmp_path / "new" / "b.json"), "--output", json_format(FORMAT)), b"{}"),
             (Output(str(tmp_path / "c.json"), "--output", json_format(FORMAT)), b"{}")]
    real_stage, calls = outputs.stage, []

    def stage(target: Path, data: bytes, *, mode: int | None = 0o644) -> Path:
        calls.append(target)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_stage(target, data, mode=mode)

    monkeypatch.setattr(outputs, "stage", stage)
    with pytest.raises(RunFailure, match=r"c\.json: cannot write \(No space left on device\)"):
        write_outputs(items)
    assert len(calls) == 3
    assert first.read_text() == "| ours |\n"
    assert _entries(tmp_path) == ["a.md"]


LINKS: list[tuple[str, Callable[[Path], object]]] = [
    ("write_atomic", lambda p: outputs.write_atomic(p, b"new")),
    ("atomic", lambda p: outputs.atomic(p).__enter__()),
    ("Output.check", lambda p: Output(str(p), "--output", json_format(FORMAT)).check()),
    ("write_outputs",
     lambda p: write_outputs([(Output(str(p), "--output", json_format(FORMAT)), b"{}")])),
]


@pytest.mark.parametrize(("name", "write"), LINKS, ids=[w[0] for w in LINKS])
def test_a_link_where_the_output_goes_is_refused(name: str, write: Callable[[Path], object],
                                                 tmp_path: Path) -> None:
    victim = tmp_path / "victim.json"
    victim.write_text(f'{{"format": "{FORMAT}"}}')  # even a file that would be ours
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    with pytest.raises(UserError, match="symbolic link|not a regular file"):
        write(link)
    assert link.is_symlink() and victim.read_text() == f'{{"format": "{FORMAT}"}}'
    assert _entries(tmp_path) == ["out.json", "victim.json"]


def _png(description: str | None, title: str | None = None) -> bytes:
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(1, 1))
    out = io.BytesIO()
    metadata = {k: v for k, v in (("Description", description), ("Title", title)) if v is not None}
    fig.savefig(out, format="png", metadata=metadata)
    plt.close(fig)
    return out.getvalue()


# (marker, existing bytes, ours?)
OWNERSHIP: list[tuple[str, outputs.Marker, Callable[[], bytes], bool]] = [
    ("json ours", json_format(FORMAT), lambda: f'{{"format": "{FORMAT}", "x": 1}}'.encode(), True),
    ("empty file", json_format(FORMAT), lambda: b"", True),
    ("json other format", json_format(FORMAT), lambda: b'{"format": "sparkspec-test/2"}', False),
    ("json, format only in a string", json_format(FORMAT),
     lambda: f'{{"note": "{FORMAT}"}}'.encode(), False),
    ("json list", json_format(FORMAT), lambda: f'["{FORMAT}"]'.encode(), False),
    ("not json", json_format(FORMAT), lambda: f"format: {FORMAT}".encode(), False),
    ("deeply nested json", json_format(FORMAT), lambda: b"[" * 100_000 + FORMAT.encode(), False),
    ("json without a format (an older result)", json_format(FORMAT),
     lambda: b'{"backend": "x", "per_request_tok_s_mean": 1, "completed": 1}', False),
    ("text ours", starts_with("| Method |"), lambda: b"| Method | Model |\n|---|\n", True),
    ("text elsewhere", starts_with("| Method |"), lambda: b"notes\n| Method | Model |\n", False),
    ("png ours", PNG, lambda: _png(outputs.PNG_MARKER), True),
    ("png without a Description", PNG, lambda: _png(None), False),
    ("png with the words as its Title", PNG, lambda: _png(None, outputs.PNG_MARKER), False),
    ("not a png", PNG, lambda: b"GIF89a Description\x00" + outputs.PNG_MARKER.encode(), False),
]


@pytest.mark.parametrize(("name", "marker", "existing", "ours"), OWNERSHIP,
                         ids=[o[0] for o in OWNERSHIP])
def test_only_an_output_that_is_ours_is_replaced(name: str, marker: outputs.Marker,
                                                 existing: Callable[[], bytes],
                                                 ours: bool, tmp_path: Path) -> None:
    path = tmp_path / "out"
    old = existing()
    path.write_bytes(old)
    out = Output(str(path), "--output", marker)
    if ours:
        write_outputs([(out, b"new")])
        assert path.read_bytes() == b"new"
    else:
        with pytest.raises(UserError, match="was not written by this command"):
            check_outputs([out])
        assert path.read_bytes() == old
    assert _entries(tmp_path) == ["out"]


@pytest.mark.parametrize(("what", "make"), [
    ("a folder", lambda p: p.mkdir()),
    ("a FIFO", lambda p: os.mkfifo(p)),
])
def test_an_output_that_is_no_regular_file_is_refused(what: str, make: Callable[[Path], None],
                                                      tmp_path: Path) -> None:
    make(tmp_path / "out")
    with pytest.raises(UserError, match="not a regular file"):
        Output(str(tmp_path / "out"), "--output", json_format(FORMAT)).check()


@pytest.mark.parametrize(("output", "input_", "how"), [
    ("data.json", "data.json", "is the input"),
    ("folder/out.json", "folder", "is inside the input"),
    (".", "folder/in.json", "contains the input"),
])
def test_an_output_apart_from_its_inputs(output: str, input_: str, how: str,
                                         tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    with pytest.raises(UserError, match=how):
        Output(str(tmp_path / output), "--output", json_format(FORMAT),
               (("--in", str(tmp_path / input_)),)).check()


@pytest.mark.parametrize(("mode", "umask", "want"), [
    (0o644, 0o022, 0o644),
    (0o600, 0o022, 0o600),
    (0o640, 0o077, 0o640),  # explicit: the umask does not narrow it
    (0o664, 0o000, 0o664),
    (None, 0o027, 0o640),  # None: what open() gives under the umask
])
def test_mode_is_honoured(mode: int | None, umask: int, want: int, tmp_path: Path) -> None:
    old = os.umask(umask)
    try:
        outputs.write_atomic(tmp_path / "new", b"x", mode=mode)
        outputs.write_atomic(tmp_path / "new", b"y", mode=mode)  # replacing: the new file's mode
        staged = outputs.stage(tmp_path / "staged", b"z", mode=mode)
        write_outputs([(Output(str(tmp_path / "out"), "--output", json_format(FORMAT)), b"{}")],
                      mode=mode)
    finally:
        os.umask(old)
    for path in (tmp_path / "new", staged, tmp_path / "out"):
        assert stat.S_IMODE(path.stat().st_mode) == want, path


def test_temp_names_are_fresh_hidden_siblings(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A temp file is a new hidden sibling; a link planted at the name it draws is neither followed
    nor replaced: the next name is drawn."""
    target = tmp_path / "out.json"
    names = {outputs.temp_name(target) for _ in range(50)}
    assert len(names) == 50
    assert all(n.parent == tmp_path and n.name.startswith(".out.json.") and n.suffix == ".tmp"
               for n in names)
    victim = tmp_path / "victim"
    victim.write_text("theirs")
    (tmp_path / ".out.json.planted.tmp").symlink_to(victim)
    draws = iter(["planted", "fresh"])
    monkeypatch.setattr(outputs.secrets, "token_hex", lambda n: next(draws))
    fd, tmp = outputs.open_temp(target)
    os.write(fd, b"ours")
    os.close(fd)
    assert tmp.name == ".out.json.fresh.tmp" and tmp.read_text() == "ours"
    assert victim.read_text() == "theirs"


def test_swap_folder_replaces_the_old_content(tmp_path: Path) -> None:
    out, build = tmp_path / "out", tmp_path / ".out.build"
    build.mkdir()
    (build / "new").write_text("new")
    outputs.swap_folder(build, out)  # nothing there yet
    assert _entries(out) == ["new"] and not build.exists()
    build.mkdir()
    (build / "newer").write_text("newer")
    outputs.swap_folder(build, out)
    assert _entries(out) == ["newer"] and _entries(tmp_path) == ["out"]


def test_link_or_copy_links_on_one_filesystem(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"weights")
    via = tmp_path / "via"
    # a Hugging Face cache links its snapshot into blobs: the file is what counts
    via.symlink_to(src)
    assert outputs.link_or_copy(via, tmp_path / "dst.bin") == "linked"
    assert (tmp_path / "dst.bin").samefile(src) and not (tmp_path / "dst.bin").is_symlink()
    assert _entries(tmp_path) == ["dst.bin", "src.bin", "via"]


# --- one writer -----------------------------------------------------------------------------------

WRITERS = {"fsync", "fdatasync", "rename", "renames", "replace", "mkstemp", "mkdtemp",
           "NamedTemporaryFile"}
# the writer itself, and the checkpoint shard stream (its own O_DIRECT write path, fsynced in place)
OWNERS = {"outputs.py", "checkpoint/stream.py"}


def _second_writers(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in WRITERS:
            on_os = (isinstance(node.func.value, ast.Name)
                     and node.func.value.id in ("os", "tempfile"))
            if node.func.attr == "replace" and not on_os and len(node.args) != 1:
                continue  # str.replace(old, new), not Path.replace(target)
            found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
        elif isinstance(node, ast.Attribute) and node.attr == "O_EXCL":
            found.append(f"{node.lineno}: O_EXCL")
        elif isinstance(node, ast.Constant) and node.value == "renameat2":
            found.append(f"{node.lineno}: renameat2")
    return found


def test_no_second_atomic_writer_in_the_package() -> None:
    """fsync, rename/replace, temp files and exclusive creation belong to sparkspec.outputs: a
    module that needs an atomic write calls it instead of writing its own."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel not in OWNERS and (hits := _second_writers(path)):
            found[rel] = hits
    assert found == {}, f"write through sparkspec.outputs instead: {found}"


def test_the_scan_sees_a_writer(tmp_path: Path) -> None:
    """The scan above can fail: each way of writing one is found."""
    code = ("import os, tempfile\nos.replace(a, b)\nPath(a).replace(b)\np.rename(q)\nos.fsync(fd)\n"
            "tempfile.mkstemp()\nos.open(p, os.O_CREAT | os.O_EXCL)\nf('renameat2')\n"
            "s.replace('a', 'b')\n")
    probe = tmp_path / "probe_writer.py"
    probe.write_text(code)
    assert sorted(int(h.split(":")[0]) for h in _second_writers(probe)) == [2, 3, 4, 5, 6, 7, 8]


def test_the_writer_imports_only_the_standard_library() -> None:
    """outputs.py imports sparkspec.errors and sparkspec.stops (the signal hold) and nothing else of
    ours, and they and it no third-party package: the one writer stays small enough to reason
    about."""
    import sys

    def imports(name: str) -> set[str]:
        tree = ast.parse((SRC / name).read_text(encoding="utf-8"))
        names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        names |= {node.module for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module}
        if "sparkspec" in names:   # `from sparkspec import stops`
            names = (names - {"sparkspec"}) | {
                f"sparkspec.{alias.name}" for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "sparkspec"
                for alias in node.names}
        return names

    names = imports("outputs.py")
    ours = {n for n in names if n.startswith("sparkspec")}
    assert ours == {"sparkspec.errors", "sparkspec.stops"}
    for name in ("outputs.py", "errors.py", "stops.py"):
        names = imports(name)
        assert {n.split(".")[0] for n in names - ours} <= \
            set(sys.stdlib_module_names) | {"__future__"}, name


# Hostile outputs, second round (issue 23): `fetch batch` / `fetch repo` / `fetch fp8-subset`
# destinations, `--progress-file`, and the batch checked as a whole before anything is fetched or
# created. Every refusal is exit 2, one `sparkspec: error:` line, and the tree hashed before and
# after is the same (tests/badinput.py). Nothing here connects anywhere: every item reads a --local-
# path, and every case is refused before it reads.


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
