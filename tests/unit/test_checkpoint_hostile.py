"""The checkpoint commands against a hostile user: outputs that would overwrite inputs or other
people's files, corrupted outputs reported up to date, add-mtp half done, duplicate tensors,
non-regular files, read-only and full filesystems. Each refusal is one line, exit 2 (1 for a
run-time failure), and leaves every folder involved byte for byte as it was (tests.badinput
fingerprints them: a leftover temp, lock or link counts as a change)."""

from __future__ import annotations

import errno
import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import CkptPair, add_tensor

from sparkspec.checkpoint.assemble import MANIFEST_NAME
from sparkspec.checkpoint.safetensors_io import read_header, read_index, write_index
from sparkspec.checkpoint.selection import EXTRA_FILE
from tests.badinput import assert_refused, fingerprint, refused_untouched, run


class Hang(BaseException):
    """A command still running after its deadline (not an OSError: the CLI must not turn it into a
    line)."""


@contextmanager
def deadline(seconds: int = 10) -> Iterator[None]:
    def expire(signum: int, frame: object) -> None:
        raise Hang(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _assemble(p: CkptPair, out: Path | None = None, fp8: Path | None = None) -> list[str | Path]:
    return ["checkpoint", "assemble", "--int4", p.int4, "--fp8", fp8 or p.fp8,
            "--out", out or p.out, "--json"]


def _built(p: CkptPair, out: Path | None = None, fp8: Path | None = None) -> dict:
    res = run(*_assemble(p, out, fp8))
    assert res.rc == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _first_shard(directory: Path) -> Path:
    return directory / "model-00001-of-00002.safetensors"


def _flip_inside(path: Path) -> None:
    """Overwrite bytes in the middle of the data without changing the size, then put the old mtime
    back (what a careless tool or an attacker does; only the change time keeps the trace)."""
    st = path.stat()
    header = read_header(path)
    at = header.data_start + header.data_size // 2
    with open(path, "r+b") as fh:
        fh.seek(at)
        old = fh.read(64)
        fh.seek(at)
        fh.write(bytes(b ^ 0xFF for b in old))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


# --- generate: never deletes what it did not write ------------------------------------------------
def test_generate_refuses_a_folder_it_did_not_write(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    refused_untouched(["checkpoint", "generate", "--kind", "int4", "--out", mine], [tmp_path],
                      match=r"--out .*mine.* was not written by "
                            r"python -m tests.support checkpoint generate")


def test_generate_refuses_a_file_and_a_symlink_as_out(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("data")
    refused_untouched(["checkpoint", "generate", "--kind", "fp8", "--out", plain], [tmp_path],
                      match=r"--out .*plain.* not a folder")
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    refused_untouched(["checkpoint", "generate", "--kind", "fp8", "--out", tmp_path / "link"],
                      [tmp_path], match="symbolic link")


def test_generate_replaces_its_own_output_by_a_swap_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    first = run("checkpoint", "generate", "--kind", "int4", "--out", out, "--layers", "4")
    assert first.rc == 0, first.stderr
    second = run("checkpoint", "generate", "--kind", "int4", "--out", out, "--layers", "8")
    assert second.rc == 0, second.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["text_config"]["num_hidden_layers"] == 8
    # no temp, old copy or lock beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gen"]


# --- assemble: outputs apart from inputs, never via a link, replaced only if assemble wrote them --
@pytest.mark.parametrize("where, how", [
    ("inside_int4", "is inside the input --int4"),
    ("equals_fp8", "is the input --fp8"),
    ("contains_both", "contains the input --int4"),
    ("link_into_int4", "is inside the input --int4"),
])
def test_assemble_out_overlapping_an_input_is_refused_before_anything(ckpt_pair: CkptPair,
                                                                      where: str,
                                                                      how: str) -> None:
    p = ckpt_pair
    root = p.int4.parent
    out = {"inside_int4": p.int4 / "hybrid", "equals_fp8": p.fp8, "contains_both": root,
           "link_into_int4": root / "sneaky" / "hybrid"}[where]
    if where == "link_into_int4":
        (root / "sneaky").symlink_to(p.int4)
    refused_untouched(_assemble(p, out), [root], match=rf"--out .* {how} ")


def test_assemble_out_symlink_is_not_replaced(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    real = p.int4.parent / "real-hybrid"
    _built(p, real, p.fp8.parent / "fp8_f32")  # an earlier hybrid of other inputs: not current
    p.out.symlink_to(real)
    refused_untouched(_assemble(p), [p.int4.parent], match="symbolic link")


def test_assemble_out_a_regular_file_is_refused(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    p.out.write_text("notes")
    refused_untouched(_assemble(p), [p.int4.parent], match=r"not a folder")


def test_assemble_replaces_its_own_output_and_leaves_no_lock(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    _built(p, fp8=p.fp8.parent / "fp8_f32")
    assert _built(p)["changed"] is True  # other inputs: rebuilt over the old hybrid, by a swap
    assert sorted(x.name for x in p.out.parent.iterdir() if x.name.startswith(".out")) == []


# --- an honest no-op and verify --full ------------------------------------------------------------
def test_bytes_overwritten_inside_a_shard_are_not_up_to_date(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    _built(p)
    shard = _first_shard(p.out)
    _flip_inside(shard)
    plain = run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load")
    assert_refused(plain, 2, match=rf"{shard.name}.* differs from what assemble wrote")
    full = run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full")
    assert_refused(full, 2, match=rf"{shard.name}.* differs from what assemble wrote")
    again = _built(p)
    assert again["changed"] is True, "a corrupted output was reported up to date"
    assert run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full").rc == 0


def test_verify_full_rehashes_everything_and_names_the_first_bad_file(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    _built(p)
    ok = run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full", "--json")
    assert ok.rc == 0, ok.stderr
    doc = json.loads(ok.stdout.strip().splitlines()[-1])
    manifest = json.loads((p.out / MANIFEST_NAME).read_text())
    hashed = [f for f, rec in manifest["outputs"].items() if manifest["hash"] in rec]
    assert doc["rehashed"] == len(hashed) and len(hashed) >= 3
    # the manifest's stat record matches, so only --full can find this: data rewritten, stat record
    # faked
    second = p.out / "model-00002-of-00002.safetensors"
    _flip_inside(second)
    _flip_inside(_first_shard(p.out))
    for name in (second.name, _first_shard(p.out).name):
        st = (p.out / name).stat()
        manifest["outputs"][name].update(ctime_ns=st.st_ctime_ns, mtime_ns=st.st_mtime_ns,
                                         ino=st.st_ino)
    (p.out / MANIFEST_NAME).write_text(json.dumps(manifest))
    # stat agrees
    assert run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load").rc == 0
    full = run("checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full")
    assert_refused(full, 2, match=rf"{_first_shard(p.out).name}: differs from what assemble wrote "
                                  r".*\(\+1 more")


def test_verify_full_needs_assembles_manifest(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    refused_untouched(["checkpoint", "verify", p.fp8, "--no-load", "--full", "--expect-mtp", "0"],
                      [p.fp8], match=rf"{MANIFEST_NAME}.*--full")


# --- add-mtp: validate everything, then link and write; nothing half done -------------------------
def test_add_mtp_refused_after_validation_leaves_the_target_as_it_was(ckpt_pair: CkptPair) -> None:
    p = ckpt_pair
    _built(p)
    doc = read_index(p.out)
    weight_map = dict(doc["weight_map"])
    weight_map["model.language_model.ghost.weight"] = _first_shard(p.out).name
    write_index(p.out, weight_map, doc["metadata"]["total_size"])
    refused_untouched(["checkpoint", "add-mtp", "--source", p.int4, "--target", p.out],
                      [p.int4.parent], match="ghost.weight.* no such tensor")
    assert not (p.out / EXTRA_FILE).exists()


@pytest.mark.parametrize("target", ["int4", "fp8"])
def test_add_mtp_never_writes_into_a_source_or_a_foreign_checkpoint(ckpt_pair: CkptPair,
                                                                    target: str) -> None:
    p = ckpt_pair
    match = ("is the input --source" if target == "int4"
             else "not written by sparkspec checkpoint assemble")
    refused_untouched(["checkpoint", "add-mtp", "--source", p.int4, "--target", getattr(p, target)],
                      [p.int4.parent], match=match)


# --- duplicate tensors, non-regular files ---------------------------------------------------------
@pytest.mark.parametrize("side", ["int4", "fp8"])
def test_duplicate_tensor_across_shards_is_refused_naming_both(ckpt_pair: CkptPair,
                                                               side: str) -> None:
    p = ckpt_pair
    directory = getattr(p, side)
    weight_map = read_index(directory)["weight_map"]
    name = ("model.language_model.layers.3.mlp.shared_expert.up_proj.weight_scale_inv"
            if side == "fp8" else "lm_head.weight")
    home = weight_map[name]
    other = next(f for f in sorted(set(weight_map.values())) if f != home)
    info = read_header(directory / home).tensors[name]
    add_tensor(directory / other, name, info.dtype, info.shape, bytes(info.nbytes))
    refused_untouched(_assemble(p), [p.int4.parent],
                      match=rf"{name}.*({home}.*{other}|{other}.*{home})")


@pytest.mark.parametrize("command", ["assemble", "verify"])
def test_a_fifo_as_a_shard_is_refused_without_hanging(ckpt_pair: CkptPair, command: str) -> None:
    p = ckpt_pair
    if command == "verify":
        _built(p)
    directory = p.int4 if command == "assemble" else p.out
    shard = _first_shard(directory)
    shard.unlink()
    os.mkfifo(shard)
    argv = _assemble(p) if command == "assemble" else ["checkpoint", "verify", p.out, "--no-load"]
    with deadline():
        refused_untouched(argv, [p.int4.parent], match=rf"{shard.name}.* not a regular file")


# --- read-only and full filesystems ---------------------------------------------------------------
def test_read_only_output_folder_is_one_line(ckpt_pair: CkptPair,
                                             ckpt_tmpfs: Callable[..., Path]) -> None:
    p = ckpt_pair
    mount = ckpt_tmpfs("64m", readonly=True)
    refused_untouched(_assemble(p, mount / "hybrid"), [p.int4.parent, mount],
                      match=r"(?i)read-only file system.*--out")


def test_disk_full_while_writing_is_a_run_time_failure_with_nothing_left(
        ckpt_pair: CkptPair, monkeypatch: pytest.MonkeyPatch) -> None:
    p = ckpt_pair
    from sparkspec.checkpoint import assemble as checkpoint

    real = checkpoint.write_pieces
    calls = []

    def fill_up(path, prefix, pieces, progress=None):  # type: ignore[no-untyped-def]
        calls.append(path)
        if len(calls) == 2:  # the second shard finds the disk full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, prefix, pieces, progress)

    monkeypatch.setattr(checkpoint, "write_pieces", fill_up)
    refused_untouched(_assemble(p), [p.int4.parent], rc=1, match="no space left on device")
    assert len(calls) == 2


def test_disk_full_while_rebuilding_keeps_the_old_hybrid(ckpt_pair: CkptPair,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    p = ckpt_pair
    _built(p, fp8=p.fp8.parent / "fp8_f32")
    from sparkspec.checkpoint import assemble as checkpoint

    def full(path, prefix, pieces, progress=None):  # type: ignore[no-untyped-def]
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(checkpoint, "write_pieces", full)
    before = fingerprint(p.int4.parent)
    res = run(*_assemble(p))
    assert_refused(res, 1, match="no space left on device")
    assert fingerprint(p.int4.parent) == before


def test_io_error_reading_a_source_is_exit_1_naming_it(ckpt_pair: CkptPair,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    p = ckpt_pair
    from sparkspec.checkpoint import assemble as checkpoint

    def bad_sector(path, prefix, pieces, progress=None):  # type: ignore[no-untyped-def]
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(pieces[0].src))

    monkeypatch.setattr(checkpoint, "write_pieces", bad_sector)
    refused_untouched(_assemble(p), [p.int4.parent], rc=1,
                      match=rf"{_first_shard(p.int4)}: Input/output error \(a run-time failure\)")


def test_io_error_while_verify_rehashes_is_exit_1(ckpt_pair: CkptPair,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    p = ckpt_pair
    _built(p)
    from sparkspec.checkpoint import manifest as ckpt_manifest

    def bad_sector(path: Path) -> str:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(ckpt_manifest, "rehash", bad_sector)
    refused_untouched(["checkpoint", "verify", p.out, "--expect-mtp", "0", "--no-load", "--full"],
                      [p.int4.parent], rc=1,
                      match=r"Input/output error \(a run-time failure\); check the")


@pytest.mark.parametrize("to", ["valid_head_elsewhere", "secret_file"])
def test_add_mtp_refuses_a_head_that_links_out_of_source_before_reading_it(ckpt_pair: CkptPair,
                                                                           to: str) -> None:
    p = ckpt_pair
    _built(p)
    outside = p.int4.parent / f"outside-{to}"
    head = p.int4 / EXTRA_FILE
    if to == "valid_head_elsewhere":
        head.rename(outside)
    else:
        # stands in for /etc/shadow: its first 8 bytes must not be read (nor shown as a header
        # length)
        outside.write_bytes(b"SECRET!!" + b"x" * 64)
        head.unlink()
    head.symlink_to(outside)
    out = refused_untouched(["checkpoint", "add-mtp", "--source", p.int4, "--target", p.out],
                            [p.int4.parent], match=r"links out of --source")
    assert ("SECRET" not in out.stderr
            and str(int.from_bytes(b"SECRET!!", "little")) not in out.stderr)
    assert not (p.out / EXTRA_FILE).exists()


@pytest.mark.parametrize("name", ["config.json", "first-shard"])
def test_verify_never_reads_through_a_link_out_of_the_checkpoint(ckpt_pair: CkptPair,
                                                                 tmp_path: Path,
                                                                 name: str) -> None:
    """A file of the checkpoint swapped for a link to a file elsewhere (a secret, say) is refused by
    name before verify reads or hashes it: nothing of the other file reaches the output."""
    p = ckpt_pair
    _built(p)
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t-do-not-print\n")
    target = p.out / "config.json" if name == "config.json" else _first_shard(p.out)
    target.unlink()
    target.symlink_to(secret)
    for full in ([], ["--full"]):
        out = refused_untouched(["checkpoint", "verify", "--no-load", *full, p.out],
                                [p.out, secret], 2,
                                match=rf"{target.name}: links out of the checkpoint")
        assert "s3cr3t" not in out.stderr + out.stdout
