"""The progress document a long command writes (sparkspec.progress.ProgressFile) and the line the
play prints from it (sparkspec.progress.line, used by the sparkspec_progress action plugin)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from sparkspec.errors import UserError
from sparkspec.progress import ProgressFile, duration, line, size
from tests.badinput import refused_untouched, run
from tests.unit.conftest import _dangling, _fifo, _fp8_subset, _repo, _tree


def doc(**kw: object) -> dict[str, object]:
    return {"what": "fetch org/big", "done": 0, "total": None, "rate": 0.0, "eta_s": None,
            "time": 0.0, **kw}


def test_line_with_total_rate_and_time_left() -> None:
    got = line("sim01", doc(done=int(1.2 * 2**30), total=77 * 2**30, rate=95e6, eta_s=780),
               "Fetch", 60)
    assert got == "sim01: fetch org/big: 1.2 GiB of 77.0 GiB, 90.6 MiB/s, 13 min left"


def test_line_without_total_says_no_time_left() -> None:
    assert line("h", doc(done=5 * 2**20, rate=2048), "Fetch", 5) == \
        "h: fetch org/big: 5.0 MiB, 2.0 KiB/s"


def test_line_with_zero_rate_says_time_left_unknown() -> None:
    got = line("h", doc(done=0, total=10 * 2**30, rate=0, eta_s=None), "Fetch", 5)
    assert got == "h: fetch org/big: 0 B of 10.0 GiB, 0 B/s, time left unknown"


def test_line_before_any_progress_says_how_long_it_runs() -> None:
    assert line("h", None, "Assemble x", 150) == "h: Assemble x: running for 2 min"


def test_line_of_a_wait_names_elapsed_time_and_note() -> None:
    got = line("h", {"what": "wait for /health", "elapsed_s": 95, "note": "unit activating"},
               "Wait", 96)
    assert got == "h: wait for /health: 95 s; unit activating"


def test_line_says_when_the_counter_stopped_moving() -> None:
    got = line("h", doc(done=1024, total=2048, rate=0, eta_s=None), "Fetch", 300, stale_s=125)
    assert got.endswith("time left unknown (no update for 2 min)")
    assert "no update" not in line("h", doc(done=1024, total=2048), "Fetch", 300, stale_s=59)


@pytest.mark.parametrize(("n", "text"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                         (3 * 2**40, "3072.0 GiB")])
def test_size(n: int, text: str) -> None:
    assert size(n) == text


@pytest.mark.parametrize(("s", "text"),
                         [(0.4, "0 s"), (119, "119 s"), (780, "13 min"), (7500, "2 h 05 min")])
def test_duration(s: float, text: str) -> None:
    assert duration(s) == text


def test_progress_file_counts_rate_and_time_left(tmp_path: Path) -> None:
    clock = [100.0]
    path = tmp_path / "p.json"
    progress = ProgressFile(str(path), "assemble", total=1000, every=2.0, clock=lambda: clock[0])
    assert not path.exists()  # nothing written before the work starts
    progress.begin()
    first = json.loads(path.read_text())
    assert (first["done"], first["total"], first["eta_s"]) == (0, 1000, None)
    clock[0] = 101.0
    progress.add(100)  # within `every` of the first write: counted, not written
    assert json.loads(path.read_text())["done"] == 0
    clock[0] = 104.0
    progress.add(300)
    got = json.loads(path.read_text())
    assert (got["done"], got["rate"], got["eta_s"]) == (400, 100.0, 6.0)
    clock[0] = 110.0
    progress.add(600)
    got = json.loads(path.read_text())
    assert (got["done"], got["eta_s"]) == (1000, 0.0)


def test_progress_file_rate_follows_the_last_half_minute(tmp_path: Path) -> None:
    clock = [0.0]
    progress = ProgressFile(str(tmp_path / "p.json"), "fetch", total=None, clock=lambda: clock[0])
    for _ in range(10):  # 10 MB/s for 100 s, then 1 MB/s
        clock[0] += 10
        progress.add(100_000_000)
    for _ in range(6):
        clock[0] += 10
        progress.add(10_000_000)
    rate = json.loads((tmp_path / "p.json").read_text())["rate"]
    assert 1_000_000 <= rate < 2_000_000  # an average since the start would say about 6.6 MB/s


def test_progress_file_that_cannot_be_written_stops_before_the_work(tmp_path: Path) -> None:
    (tmp_path / "dir.json").mkdir()
    with pytest.raises(UserError, match="dir.json"):
        ProgressFile(str(tmp_path / "dir.json"), "fetch")


WAITER = Path(__file__).resolve().parents[3] / "roles/deploy/files/wait_healthy.py"


def test_health_wait_writes_elapsed_state_and_masked_log_then_removes_it(tmp_path: Path) -> None:
    """The deploy role's waiter with --progress-file: `systemctl` and `journalctl` stand-ins on PATH
    (the first keeps a copy of the progress file each time it is asked), /health never answering."""
    import os
    import subprocess
    import sys

    progress, seen = tmp_path / "async" / "p.json", tmp_path / "seen.json"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "systemctl").write_text(
        f"#!/bin/sh\ncp {progress} {seen} 2>/dev/null\n"
        "printf 'ActiveState=activating\\nSubState=start\\nNRestarts=0\\n'\n")
    (bindir / "journalctl").write_text(
        "#!/bin/sh\necho \"Loading weights (api_key='sk-123', token=abc)\"\n")
    for stub in bindir.iterdir():
        stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")
    argv = [sys.executable, str(WAITER), "http://127.0.0.1:9", "u.service", "1.5", "0.2",
            "--progress-file", str(progress)]
    run = subprocess.run(argv, check=False, capture_output=True, text=True, env=env, timeout=60)
    assert run.returncode == 1 and \
        "did not answer 200 within 2 s" in run.stdout, run.stdout + run.stderr
    got = json.loads(seen.read_text())
    assert got["what"] == "wait for u.service /health" and got["elapsed_s"] in (0, 1, 2)
    assert got["note"] == "unit activating/start: Loading weights (api_key='***', token=***)"
    assert not progress.exists()


class Recorder(ProgressFile):
    """A progress file that also keeps every (done, total) it was told, written or not."""

    def __init__(self, path: Path) -> None:
        self.seen: list[tuple[int, int | None]] = []
        super().__init__(str(path), "test")

    def add(self, n: int) -> None:
        super().add(n)
        self.seen.append((self.done, self.total))


def test_fp8_subset_and_assemble_count_every_byte_they_move(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranged FP8 fetch, whole-shard FP8 fetch, a local copy and assemble each count into the
    progress file exactly the bytes their results report (the same counters as their bars)."""
    from sparkspec.checkpoint.assemble import assemble
    from sparkspec.hub.fetch import fetch_fp8_subset, fetch_repo
    from sparkspec.hub.server import HubServer
    from tests.support.hubpublish import publish
    from tests.support.testckpt import ModelSpec, write_fp8, write_int4_autoround

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    spec = ModelSpec(hidden=256, layers=2, experts=2, moe_intermediate=128, shared_intermediate=256,
                     heads=2, kv_heads=1, head_dim=128, linear_key_heads=2, linear_value_heads=2,
                     linear_key_dim=64, linear_value_dim=64, vocab=128)
    write_int4_autoround(tmp_path / "int4", spec)
    write_fp8(tmp_path / "fp8", spec, shards=2)
    publish(tmp_path / "root", "org/fp8", tmp_path / "fp8")
    with HubServer(tmp_path / "root") as srv:
        ranged = Recorder(tmp_path / "r.json")
        got = fetch_fp8_subset("org/fp8", "main", tmp_path / "int4", tmp_path / "sub",
                               endpoint=srv.url, progress=ranged)
        assert got.tensor_bytes_fetched > 0
        assert ranged.seen[-1] == (got.tensor_bytes_fetched, got.tensor_bytes_fetched)
        whole = Recorder(tmp_path / "w.json")
        got = fetch_fp8_subset("org/fp8", "main", tmp_path / "int4", tmp_path / "sub-full",
                               endpoint=srv.url, mode="full", progress=whole)
        assert whole.seen and whole.seen[-1] == (got.tensor_bytes_fetched, got.tensor_bytes_fetched)
    local = Recorder(tmp_path / "l.json")
    got = fetch_repo("org/fp8", "main", tmp_path / "copy",
                     local_path=str(tmp_path / "fp8"), progress=local)
    assert local.seen[-1] == (got.bytes_fetched, got.bytes_fetched)
    built = Recorder(tmp_path / "a.json")

    def start(total: int) -> Callable[[int], None]:
        built.set_total(total)
        return built.add

    out = assemble(tmp_path / "int4", tmp_path / "sub", tmp_path / "hybrid", [], None, start)
    assert built.seen and built.seen[-1][0] == built.total and built.total >= out.total_size


# Hostile outputs, second round (issue 23): `fetch batch` / `fetch repo` / `fetch fp8-subset`
# destinations, `--progress-file`, and the batch checked as a whole before anything is fetched or
# created. Every refusal is exit 2, one `sparkspec: error:` line, and the tree hashed before and
# after is the same (tests/badinput.py). Nothing here connects anywhere: every item reads a --local-
# path, and every case is refused before it reads.


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
    argv = ["fetch", *_fp8_subset(tmp_path / "out", t["int4"], t["src"]),
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
