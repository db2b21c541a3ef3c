"""The hashed copy of ckpt_stream: byte identity and digests against a plain reference (xxh3_128 /
blake2b over the same bytes), chunk and alignment boundaries, the buffered write-behind where direct
I/O is refused, several writes in flight, preallocation, and clear errors when a source shrinks
mid-copy or the disk fails. No timing here: ``invoke bench.checkpoint`` measures."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkspec.checkpoint import stream as ckpt_stream
from sparkspec.checkpoint.stream import HASH_NAME, Piece, copy_file, new_hash, write_pieces
from sparkspec.errors import UserError
from tests.badinput import refused_untouched
from tests.unit.conftest import CkptPair

SMALL_CHUNK = 64 << 10  # 16 aligned blocks: every boundary case in a few hundred KiB


def _digest(data: bytes) -> str:
    """The reference: one hash object fed the whole expected file at once."""
    h = new_hash()
    h.update(data)
    return str(h.hexdigest())


def _data(n: int, seed: int = 0) -> bytes:
    """Bytes without a period, so that a chunk written at the wrong offset cannot go unnoticed."""
    return random.Random(seed).randbytes(n)


@pytest.fixture(params=["direct", "buffered"])
def small_chunks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Chunks of 64 KiB (so tests cross many boundaries cheaply), with direct I/O and without it."""
    monkeypatch.setattr(ckpt_stream, "CHUNK_BYTES", SMALL_CHUNK)
    if request.param == "buffered":
        monkeypatch.setattr(ckpt_stream, "O_DIRECT", 0)
    yield request.param


@pytest.fixture(autouse=True)
def _no_leaks_no_hangs() -> Iterator[None]:
    """Every call leaves no writer thread and no open descriptor behind, and a hang (a FIFO, a lost
    buffer, a loop on a shrunk source) fails the test instead of stalling the run."""
    fds, threads = set(os.listdir("/proc/self/fd")), threading.active_count()

    def hung(*_: object) -> None:
        raise TimeoutError("hung for 20 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert threading.active_count() == threads
    assert set(os.listdir("/proc/self/fd")) <= fds


SIZES = [0, 1, 4095, 4096, 4097, SMALL_CHUNK - 1, SMALL_CHUNK, SMALL_CHUNK + 1,
         3 * SMALL_CHUNK + 4097]


@pytest.mark.parametrize("size", SIZES)
def test_copy_file_is_byte_identical_with_the_digest_of_its_bytes(tmp_path: Path, small_chunks: str,
                                                                   size: int) -> None:
    data = _data(size, size)
    (tmp_path / "src").write_bytes(data)
    seen: list[int] = []
    got = copy_file(tmp_path / "src", tmp_path / "dst", seen.append)
    assert (tmp_path / "dst").read_bytes() == data
    assert got == {"size": size, HASH_NAME: _digest(data)}
    assert sum(seen) == size


def test_copy_file_with_the_real_chunk_size(tmp_path: Path) -> None:
    data = _data(2 * ckpt_stream.CHUNK_BYTES + 12345)
    (tmp_path / "src").write_bytes(data)
    got = copy_file(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == data
    assert got == {"size": len(data), HASH_NAME: _digest(data)}


def _pieces(tmp_path: Path) -> tuple[list[Piece], bytes]:
    """Ranges of two sources, in an order that mixes adjacent (merged) and scattered ranges, a range
    of b that starts where the last range of a ended (not merged), empty ones, odd sizes and ranges
    longer than a chunk; returns them and the bytes they stand for."""
    a, b = _data(5 * SMALL_CHUNK + 333, 1), _data(2 * SMALL_CHUNK + 77, 2)
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    spans = [("a", 0, 0), ("a", 10, 1), ("a", 11, 4095), ("a", 4106, SMALL_CHUNK + 3),
             ("b", 4106 + SMALL_CHUNK + 3, 100), ("b", 0, 7),
             ("a", 3 * SMALL_CHUNK, 2 * SMALL_CHUNK + 333), ("b", 7, 0),
             ("b", 9, 2 * SMALL_CHUNK + 68),
             ("a", 5, 5), ("b", 2 * SMALL_CHUNK + 76, 1)]
    source = {"a": a, "b": b}
    pieces = [Piece(f"t{i}", "U8", (n,), tmp_path / s, off, n)
              for i, (s, off, n) in enumerate(spans)]
    return pieces, b"".join(source[s][off: off + n] for s, off, n in spans)


@pytest.mark.parametrize("prefix_len", [0, 8, 4096, SMALL_CHUNK + 5])
def test_write_pieces_is_prefix_then_ranges_with_their_digest(tmp_path: Path, small_chunks: str,
                                                              prefix_len: int) -> None:
    pieces, body = _pieces(tmp_path)
    prefix = _data(prefix_len, 9)
    seen: list[int] = []
    got = write_pieces(tmp_path / "out", prefix, pieces, seen.append)
    expected = prefix + body
    assert (tmp_path / "out").read_bytes() == expected
    assert got == {"size": len(expected), HASH_NAME: _digest(expected)}
    assert sum(seen) == len(body)


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[int, list[int], bytes, list[tuple[int, int, int]]]:
    """A chunk size, source sizes, a prefix and spans (source, offset, length) inside those
    sources."""
    chunk = draw(st.sampled_from([4096, 8192, 3 * 4096]))
    sizes = draw(st.lists(st.integers(0, 5 * chunk), min_size=1, max_size=3))
    prefix = draw(st.binary(max_size=2 * chunk))
    spans: list[tuple[int, int, int]] = []
    for _ in range(draw(st.integers(0, 8))):
        src = draw(st.integers(0, len(sizes) - 1))
        # often where the last span ended, in any source
        end = spans[-1][1] + spans[-1][2] if spans else 0
        offset = draw(st.integers(0, sizes[src]) | st.just(min(end, sizes[src])))
        spans.append((src, offset, draw(st.integers(0, sizes[src] - offset))))
    return chunk, sizes, prefix, spans


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=_layouts(), direct=st.booleans())
def test_any_layout_is_copied_and_hashed_exactly(
        layout: tuple[int, list[int], bytes, list[tuple[int, int, int]]], direct: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    chunk, sizes, prefix, spans = layout
    monkeypatch.setattr(ckpt_stream, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(ckpt_stream, "O_DIRECT", os.O_DIRECT if direct else 0)
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        data = [_data(n, i) for i, n in enumerate(sizes)]
        for i, blob in enumerate(data):
            (root / f"s{i}").write_bytes(blob)
        pieces = [Piece(f"t{k}", "U8", (n,), root / f"s{i}", off, n)
                  for k, (i, off, n) in enumerate(spans)]
        expected = prefix + b"".join(data[i][off: off + n] for i, off, n in spans)
        got = write_pieces(root / "out", prefix, pieces)
        assert (root / "out").read_bytes() == expected
        assert got == {"size": len(expected), HASH_NAME: _digest(expected)}


def test_only_empty_pieces_give_the_prefix_alone(tmp_path: Path, small_chunks: str) -> None:
    (tmp_path / "a").write_bytes(b"xyz")
    got = write_pieces(tmp_path / "out", b"head", [Piece("e", "U8", (0,), tmp_path / "a", 1, 0)])
    assert (tmp_path / "out").read_bytes() == b"head"
    assert got == {"size": 4, HASH_NAME: _digest(b"head")}


def test_existing_output_file_is_replaced_whole(tmp_path: Path, small_chunks: str) -> None:
    (tmp_path / "src").write_bytes(b"new")
    (tmp_path / "dst").write_bytes(b"older and longer")
    copy_file(tmp_path / "src", tmp_path / "dst")
    assert (tmp_path / "dst").read_bytes() == b"new"


def test_direct_io_refused_by_the_filesystem_falls_back(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem without O_DIRECT (EINVAL at open, as tmpfs before Linux 6.6) and a device that
    wants another alignment (EINVAL at write) both get the same bytes the ordinary way."""
    monkeypatch.setattr(ckpt_stream, "CHUNK_BYTES", SMALL_CHUNK)
    data = _data(4 * ckpt_stream.IN_FLIGHT * SMALL_CHUNK + 999)
    (tmp_path / "src").write_bytes(data)
    real_open, real_pwrite = os.open, os.pwrite
    calls = {"open": 0, "pwrite": 0}

    def no_direct_open(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & ckpt_stream.O_DIRECT:
            calls["open"] += 1
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    def no_direct_write(fd, data, at):  # type: ignore[no-untyped-def]
        if fcntl.fcntl(fd, fcntl.F_GETFL) & ckpt_stream.O_DIRECT:
            calls["pwrite"] += 1
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pwrite(fd, data, at)

    with monkeypatch.context() as m:
        m.setattr(os, "open", no_direct_open)
        assert copy_file(tmp_path / "src", tmp_path / "d1") == {
            "size": len(data), HASH_NAME: _digest(data)}
    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", no_direct_write)
        assert copy_file(tmp_path / "src", tmp_path / "d2") == {
            "size": len(data), HASH_NAME: _digest(data)}
    assert (tmp_path / "d1").read_bytes() == data == (tmp_path / "d2").read_bytes()
    # refused once at open; at write, once by each writer thread that began a direct write before
    # the first refusal cleared O_DIRECT (IN_FLIGHT threads: a race, seen as 2 in a CI run), then
    # never asked again
    assert calls["open"] == 1 and 1 <= calls["pwrite"] <= ckpt_stream.IN_FLIGHT, calls


def test_source_truncated_mid_copy_is_a_clear_error(tmp_path: Path, small_chunks: str) -> None:
    src = tmp_path / "shard.safetensors"
    src.write_bytes(_data(4 * SMALL_CHUNK))

    def shrink(_: int) -> None:  # another process truncates the source while it is being copied
        os.truncate(src, SMALL_CHUNK + 100)

    pieces = [Piece("t", "U8", (4 * SMALL_CHUNK,), src, 0, 4 * SMALL_CHUNK)]
    with pytest.raises(UserError,
                       match=rf"^{src}: ended early at byte {SMALL_CHUNK + 100}; .*re-download"):
        write_pieces(tmp_path / "out", b"", pieces, shrink)


def test_range_past_the_end_of_the_source_is_a_clear_error(tmp_path: Path,
                                                           small_chunks: str) -> None:
    (tmp_path / "a").write_bytes(b"0123456789")
    with pytest.raises(UserError, match=r"a: ended early at byte 10;"):
        write_pieces(tmp_path / "out", b"h", [Piece("t", "U8", (8,), tmp_path / "a", 4, 8)])


def test_write_failure_mid_copy_names_the_output(tmp_path: Path, small_chunks: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up after the first chunk, slowly enough that the reading side has filled every
    buffer and waits for one: the writer thread's error reaches the caller as an OSError naming the
    output file (the caller turns it into one line and removes its temp folder). One writer thread,
    so that "after the failure" is well defined (with several, the chunks already taken by the
    others are written too)."""
    monkeypatch.setattr(ckpt_stream, "IN_FLIGHT", 1)
    (tmp_path / "src").write_bytes(_data(6 * SMALL_CHUNK))
    real_pwrite, writes = os.pwrite, []

    def fill_up(fd, data, at):  # type: ignore[no-untyped-def]
        writes.append(at)
        if len(writes) > 1:
            time.sleep(0.3)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(os, "pwrite", fill_up)
    with pytest.raises(OSError) as err:
        copy_file(tmp_path / "src", tmp_path / "dst")
    assert (err.value.errno, err.value.filename) == (errno.ENOSPC, str(tmp_path / "dst"))
    assert len(writes) == 2  # nothing written after the failure


def test_fifo_source_is_refused_without_hanging(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UserError, match=r"fifo: is not a regular file"):
        copy_file(tmp_path / "fifo", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_output_that_is_a_link_or_fifo_is_refused_untouched(tmp_path: Path, kind: str) -> None:
    (tmp_path / "src").write_bytes(b"data")
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    if kind == "symlink":
        (tmp_path / "dst").symlink_to(victim)
    else:
        os.mkfifo(tmp_path / "dst")
    with pytest.raises(UserError, match=r"dst: is a symbolic link or a FIFO"):
        copy_file(tmp_path / "src", tmp_path / "dst")
    assert victim.read_bytes() == b"keep me"


# --- write-behind, preallocation, and failures of each --------------------------------------------
def _fake_libc(result: int, err: int = 0,
               calls: list[tuple[int, ...]] | None = None) -> Callable[..., int]:
    """A stand-in for a C library call: records its arguments but the descriptor, sets errno,
    returns ``result``."""

    def call(*args: int) -> int:
        if calls is not None:
            calls.append(args[1:])
        ctypes.set_errno(err)
        return result
    return call


def test_buffered_chunks_are_flushed_and_dropped_and_the_digest_is_the_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without direct I/O every byte written goes through sync_file_range once (the real one, spied
    on), and the digest returned is that of the file as a separate read finds it on disk."""
    monkeypatch.setattr(ckpt_stream, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(ckpt_stream, "O_DIRECT", 0)
    real, ranges = ckpt_stream._SYNC_FILE_RANGE, []
    assert real is not None

    def spy(fd: int, at: int, nbytes: int, flags: int) -> int:
        ranges.append((at, nbytes, flags))
        return int(real(fd, at, nbytes, flags))

    monkeypatch.setattr(ckpt_stream, "_SYNC_FILE_RANGE", spy)
    pieces, body = _pieces(tmp_path)
    got = write_pieces(tmp_path / "out", b"prefix", pieces)
    on_disk = (tmp_path / "out").read_bytes()
    assert on_disk == b"prefix" + body
    assert got == {"size": len(on_disk), HASH_NAME: _digest(on_disk)}
    ranges.sort()
    assert [(at, n) for at, n, _ in ranges] == [(at, min(SMALL_CHUNK, len(on_disk) - at))
                                                for at in range(0, len(on_disk), SMALL_CHUNK)]
    # wait, write, wait: on the disk when it returns
    assert {flags for *_, flags in ranges} == {1 | 2 | 4}


def test_sync_file_range_refused_falls_back_to_the_final_fsync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt_stream, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(ckpt_stream, "O_DIRECT", 0)
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(ckpt_stream, "_SYNC_FILE_RANGE", _fake_libc(-1, errno.ENOSYS, calls))
    data = _data(5 * SMALL_CHUNK + 1)
    (tmp_path / "src").write_bytes(data)
    assert copy_file(tmp_path / "src", tmp_path / "dst") == {
        "size": len(data), HASH_NAME: _digest(data)}
    assert (tmp_path / "dst").read_bytes() == data
    # refused once, then not asked again
    assert len(calls) == 1 and ckpt_stream._SYNC_FILE_RANGE is None


@pytest.mark.parametrize("err", [errno.EIO, errno.ENOSPC])
def test_writeback_error_names_the_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          err: int) -> None:
    """A chunk that the disk fails to take (reported by sync_file_range, as a full thin disk or a
    bad sector does) fails the copy with an OSError naming the output, as a failed write does."""
    monkeypatch.setattr(ckpt_stream, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(ckpt_stream, "O_DIRECT", 0)
    monkeypatch.setattr(ckpt_stream, "_SYNC_FILE_RANGE", _fake_libc(-1, err))
    (tmp_path / "src").write_bytes(_data(4 * SMALL_CHUNK))
    with pytest.raises(OSError) as caught:
        copy_file(tmp_path / "src", tmp_path / "dst")
    assert (caught.value.errno, caught.value.filename) == (err, str(tmp_path / "dst"))


def test_disk_full_at_preallocation_fails_before_any_write(
        tmp_path: Path, small_chunks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(ckpt_stream, "_FALLOCATE", _fake_libc(-1, errno.ENOSPC, calls))
    pwrites: list[int] = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite",
                        lambda fd, data, at: pwrites.append(at) or real_pwrite(fd, data, at))
    (tmp_path / "src").write_bytes(_data(3 * SMALL_CHUNK + 5))
    with pytest.raises(OSError) as caught:
        copy_file(tmp_path / "src", tmp_path / "dst")
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(tmp_path / "dst"))
    assert calls == [(0, 0, 3 * SMALL_CHUNK + 5)] and pwrites == []


def test_preallocation_refused_by_the_filesystem_is_skipped(
        tmp_path: Path, small_chunks: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt_stream, "_FALLOCATE", _fake_libc(-1, errno.EOPNOTSUPP))
    data = _data(2 * SMALL_CHUNK + 7)
    (tmp_path / "src").write_bytes(data)
    assert copy_file(tmp_path / "src", tmp_path / "dst") == {
        "size": len(data), HASH_NAME: _digest(data)}
    assert (tmp_path / "dst").read_bytes() == data


def test_several_writes_are_in_flight_at_once(tmp_path: Path, small_chunks: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The writers overlap: a write that waits for a second one to start is released by it (with one
    write at a time it would wait forever, and the alarm fails the test)."""
    monkeypatch.setattr(ckpt_stream, "IN_FLIGHT", 2)
    two = threading.Barrier(2)
    real_pwrite, seen = os.pwrite, []

    def overlapping(fd, data, at):  # type: ignore[no-untyped-def]
        if at < 2 * SMALL_CHUNK and at % SMALL_CHUNK == 0 and at not in seen:
            seen.append(at)
            two.wait(timeout=10)  # the first two chunks' writes meet here
        return real_pwrite(fd, data, at)

    monkeypatch.setattr(os, "pwrite", overlapping)
    data = _data(4 * SMALL_CHUNK + 3)
    (tmp_path / "src").write_bytes(data)
    assert copy_file(tmp_path / "src", tmp_path / "dst") == {
        "size": len(data), HASH_NAME: _digest(data)}
    assert (tmp_path / "dst").read_bytes() == data
    assert sorted(seen) == [0, SMALL_CHUNK]


def test_short_write_then_disk_full_leaves_no_output(ckpt_pair: CkptPair,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the real command: the disk takes half of a chunk, then is full. One line, exit 1, and
    nothing of the hybrid left beside the sources (the temp folder is removed)."""
    real_pwrite, writes = os.pwrite, []

    def short_then_full(fd, data, at):  # type: ignore[no-untyped-def]
        writes.append(at)
        if len(writes) == 1:
            return real_pwrite(fd, memoryview(data)[: len(data) // 2 or 1], at)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", short_then_full)
    p = ckpt_pair
    refused_untouched(["checkpoint", "assemble", "--int4", p.int4, "--fp8", p.fp8, "--out", p.out,
                       "--json"], [p.int4.parent], rc=1, match=r"(?i)no space left on device")
    assert len(writes) >= 2
