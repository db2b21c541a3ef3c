"""``sparkspec watchdog``: its config checks, its decisions (fed counters and times, no sleeping),
and its rounds against a fake vLLM on loopback with a recording systemctl, real lock and state
files; the command line end to end with a fake systemctl on PATH."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from sparkspec.errors import UserError
from sparkspec.operate import memfit, scrape, watchdog
from sparkspec.operate.watchdog import (
    Config,
    Counters,
    Restarts,
    UnitState,
    Watch,
    load_config,
    parse_show,
)
from sparkspec.operate.watchrun import Runner
from tests.bench.fakevllm import FakeVllm, serve

REPO = Path(__file__).resolve().parents[3]


class OpsVllm:
    """A fake vLLM for the operate commands: /health (``health``), /metrics from its counters and
    the cache config labels, /v1/completions that answer, fail or hang (``completions``)."""

    def __init__(self) -> None:
        self.health = 200
        self.completions = "ok"   # ok | hang | 500 | 404
        self.generation = 0.0
        self.running = 0.0
        self.prompt = self.waiting = 0.0
        self.kv_usage: float | None = None
        self.metrics_mode = "ok"   # ok | trickle (a byte every 0.1 s) | huge (9 MiB)
        self.on_metrics: Any = None   # called at each /metrics request (the lock test)
        self.draft: float | None = None
        self.accepted = 0.0
        self.cache = {"num_gpu_blocks": "4096", "block_size": "16", "cache_dtype": "auto"}
        self.seen: list[tuple[str, str | None]] = []
        self.lock = threading.Lock()
        self.httpd = serve(self.handle)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def paths(self) -> list[str]:
        with self.lock:
            return [p for p, _ in self.seen]

    def metrics_text(self) -> str:
        labels = ",".join(f'{k}="{v}"' for k, v in self.cache.items())
        lines = ["# TYPE vllm:generation_tokens_total counter",
                 f'vllm:generation_tokens_total{{model_name="m"}} {self.generation}',
                 "# TYPE vllm:num_requests_running gauge",
                 f'vllm:num_requests_running{{model_name="m"}} {self.running}',
                 f'vllm:prompt_tokens_total{{model_name="m"}} {self.prompt}',
                 f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}',
                 "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{labels}}} 1.0"]
        if self.kv_usage is not None:
            lines += [f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv_usage}']
        if self.draft is not None:
            lines += ["# TYPE vllm:spec_decode_num_drafts_total counter",
                      f'vllm:spec_decode_num_drafts_total{{model_name="m"}} {self.draft / 2}',
                      "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
                      f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {self.draft}',
                      "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
                      f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} '
                      f'{self.accepted}']
        return "\n".join(lines) + "\n"

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        with self.lock:
            self.seen.append((h.path, h.headers.get("Authorization")))
        length = min(int(h.headers.get("Content-Length") or 0), 1 << 20)
        body = h.rfile.read(length) if length else b""
        if h.path == "/health":
            return self.reply(h, self.health, b"")
        if h.path == "/metrics":
            if self.on_metrics is not None:
                self.on_metrics()
            text = self.metrics_text().encode()
            if self.metrics_mode == "huge":
                text += b"# " + b"x" * (9 << 20) + b"\n"
            if self.metrics_mode != "trickle":
                return self.reply(h, 200, text, "text/plain; version=0.0.4")
            h.send_response(200)
            h.send_header("Content-Length", "60")
            h.end_headers()
            for _ in range(60):
                h.wfile.write(b"#")
                h.wfile.flush()
                time.sleep(0.1)
            return None
        if h.path == "/v1/completions":
            req = json.loads(body)
            assert req["prompt"] == "ping" and req["max_tokens"] == 1 and req["temperature"] == 0
            if self.completions == "hang":
                time.sleep(2.0)
                return None
            if self.completions in ("500", "404"):
                return self.reply(h, int(self.completions), b"{}")
            answer = {"choices": [{"text": "x"}], "model": req["model"]}
            return self.reply(h, 200, json.dumps(answer).encode())
        return self.reply(h, 404, b"{}")

    reply = staticmethod(FakeVllm.reply)


@pytest.fixture
def server() -> Iterator[OpsVllm]:
    fake = OpsVllm()
    yield fake
    fake.httpd.shutdown()


def config_doc(tmp: Path, **changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": "m", "grace_s": 100, "interval_s": 1, "stall_window_s": 30,
        "acceptance_window_s": 60, "acceptance_floor": 20, "min_draft_tokens": 100,
        "probe_interval_s": 10, "probe_timeout_s": 0.3, "probe_failures": 2, "max_restarts": 2,
        "restart_window_s": 600, "lock": str(tmp / "lock" / "sparkspec-vllm.lock"),
        "state": str(tmp / "state" / "vllm.json")}
    doc.update(changes)
    return doc


def config(tmp: Path, **changes: Any) -> Config:
    path = tmp / "watchdog.json"
    path.write_text(json.dumps(config_doc(tmp, **changes)))
    cfg, problems = load_config(str(path))
    assert cfg is not None, problems
    return cfg


class FakeSystemctl:
    """Answers ``show`` from its fields and records every call."""

    def __init__(self, active: str = "active", entered: float = 0.0,
                 invocation: str = "a1") -> None:
        self.active, self.entered, self.invocation = active, entered, invocation
        self.calls: list[list[str]] = []

    def __call__(self, args: Any) -> str:
        self.calls.append(list(args))
        if args[0] == "show":
            return (f"ActiveState={self.active}\n"
                    f"ActiveEnterTimestampMonotonic={int(self.entered * 1e6)}\n"
                    f"InvocationID={self.invocation}\n")
        return ""

    def restarts(self) -> int:
        return sum(1 for c in self.calls if c[:1] == ["restart"])


# --- the config -----------------------------------------------------------------------------------
def test_a_good_config_loads_with_its_values(tmp_path: Path) -> None:
    cfg = config(tmp_path, acceptance_floor=None)
    assert (cfg.grace_s, cfg.max_restarts, cfg.acceptance_floor, cfg.probe_timeout_s) == \
        (100.0, 2, None, 0.3)


def test_bad_config_lines_one_per_field_exit_2(tmp_path: Path) -> None:
    bad = config_doc(tmp_path, grace_s="abc", interval_s=0, max_restarts=0, acceptance_floor=150,
                     lock="relative/lock", restart_window_s=-5, extra=1)
    del bad["model"]
    path = tmp_path / "w.json"
    path.write_text(json.dumps(bad))
    proc = subprocess.run([sys.executable, "-m", "sparkspec.cli", "watchdog", "--unit", "vllm",
                           "--url", "http://127.0.0.1:9", "--config", str(path)],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == ""
    named = ["'extra'", "'model'", "'grace_s'", "'interval_s'", "'restart_window_s'",
             "'max_restarts'", "'acceptance_floor'", "'lock'"]
    assert len(lines) == len(named), lines
    for name in named:
        assert sum(name in line for line in lines) == 1, (name, lines)
    assert all(line.startswith(f"sparkspec: error: watchdog: {path}: ") for line in lines)


def test_a_cap_window_not_longer_than_grace_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    path.write_text(json.dumps(config_doc(tmp_path, grace_s=900, restart_window_s=900)))
    cfg, problems = load_config(str(path))
    assert cfg is None and len(problems) == 1
    assert "'restart_window_s': 900 must be > 'grace_s' 900" in problems[0]
    path.write_text(json.dumps(config_doc(tmp_path, grace_s=900, restart_window_s=901)))
    assert load_config(str(path))[0] is not None


# --- the decisions --------------------------------------------------------------------------------
def test_stall_needs_running_requests_and_a_full_window(tmp_path: Path) -> None:
    w = Watch(config(tmp_path, stall_window_s=30))
    assert w.feed_stall(0, Counters(500, 2, 0, 0)) is None
    assert w.feed_stall(29, Counters(500, 2, 0, 0)) is None
    reason = w.feed_stall(30, Counters(500, 2, 0, 0))
    assert reason is not None and "2 request(s) running" in reason and \
        "stuck at 500 for 30 s" in reason
    idle = Watch(w.cfg)
    for t in range(0, 100, 10):   # nothing running: unchanged tokens are no stall
        assert idle.feed_stall(t, Counters(500, 0, 0, 0)) is None
    moving = Watch(w.cfg)
    for t in range(0, 100, 10):
        assert moving.feed_stall(t, Counters(500 + t, 1, 0, 0)) is None


def test_acceptance_collapse_over_a_covered_window(tmp_path: Path) -> None:
    cfg = config(tmp_path, acceptance_floor=20, acceptance_window_s=60, min_draft_tokens=100)
    w = Watch(cfg)
    assert w.feed_acceptance(0, Counters(0, 1, 1000, 800)) is None
    assert w.feed_acceptance(30, Counters(0, 1, 1100, 805)) is None   # not a whole window yet
    reason = w.feed_acceptance(60, Counters(0, 1, 1200, 810))          # 10 of 200 over 60 s
    assert reason is not None and "5.0 % of 200 draft tokens" in reason and "floor 20 %" in reason
    healthy = Watch(cfg)
    for t, d, a in ((0, 0, 0), (30, 100, 80), (60, 200, 160), (90, 300, 240)):
        assert healthy.feed_acceptance(t, Counters(0, 1, d, a)) is None
    few = Watch(cfg)   # fewer draft tokens than min_draft_tokens: no verdict
    for t, d in ((0, 0), (60, 50), (120, 99)):
        assert few.feed_acceptance(t, Counters(0, 1, d, 0)) is None
    off = Watch(config(tmp_path, acceptance_floor=None))
    for t, d in ((0, 0), (60, 1000), (120, 2000)):
        assert off.feed_acceptance(t, Counters(0, 1, d, 0)) is None


def test_probe_failures_must_be_consecutive_with_health_green(tmp_path: Path) -> None:
    w = Watch(config(tmp_path, probe_failures=3, probe_interval_s=10))
    assert w.feed_probe(0, True, "timeout") is None and not w.probe_due(5) and w.probe_due(10)
    assert w.feed_probe(10, True, "timeout") is None
    assert w.feed_probe(20, True, None) is None            # it answered: the count starts over
    assert w.feed_probe(30, True, "timeout") is None
    assert w.feed_probe(40, False, "timeout") is None      # /health down: not this check's case
    assert w.feed_probe(50, True, "timeout") is None
    assert w.feed_probe(60, True, "timeout") is None
    reason = w.feed_probe(70, True, "no answer within 0.3 s")
    assert reason is not None and "3 probes in a row" in reason and "completions time out" in reason


def test_a_failed_probe_does_not_count_while_the_server_is_busy(tmp_path: Path) -> None:
    w = Watch(config(tmp_path, probe_failures=2, probe_interval_s=10))
    assert w.feed_probe(0, True, "timeout", Counters(100, 4, 0, 0)) is None and w.probe_fails == 1
    assert w.feed_probe(10, True, "timeout", Counters(150, 4, 0, 0)) is None and w.probe_fails == 0
    assert "generation tokens advanced 50 since the previous probe" == w.excused
    assert w.feed_probe(20, True, "timeout", Counters(150, 4, 0, 0, waiting=3)) is None
    assert w.excused == "3 request(s) waiting" and w.probe_fails == 0
    assert w.feed_probe(30, True, "timeout", Counters(150, 4, 0, 0)) is None
    assert w.feed_probe(40, True, "timeout", Counters(150, 4, 0, 0)) is not None


def test_prefill_and_kv_cache_usage_are_progress(tmp_path: Path) -> None:
    cfg = config(tmp_path, stall_window_s=30)
    prefill, filling, stuck = Watch(cfg), Watch(cfg), Watch(cfg)
    for t in range(0, 100, 10):
        assert prefill.feed_stall(t, Counters(500, 1, 0, 0, prompt=1000.0 + t)) is None
        assert filling.feed_stall(t, Counters(500, 1, 0, 0, prompt=9,
                                              kv_usage=0.1 + t / 1000)) is None
    assert stuck.feed_stall(0, Counters(500, 1, 0, 0, prompt=9, kv_usage=0.5)) is None
    assert stuck.feed_stall(30, Counters(500, 1, 0, 0, prompt=9, kv_usage=0.5)) is not None


def test_the_bounds_are_constants(tmp_path: Path) -> None:
    assert (watchdog.MAX_SECONDS, watchdog.MAX_COUNT, memfit.MAX_MARGIN_GIB) == \
        (1e7, 1 << 40, 1 << 20)
    assert watchdog.problems(config_doc(tmp_path, grace_s=1e7, restart_window_s=1e7 + 1)) == \
        ["'restart_window_s': 10000001.0 is not a finite number of seconds > 0 (at most 1e+07)"]


def test_gate_grace_inactive_and_a_new_invocation_reset(tmp_path: Path) -> None:
    w = Watch(config(tmp_path, grace_s=100))
    assert "grace" in str(w.gate(150, UnitState("active", 100, "a")))
    assert "not active (activating)" == w.gate(150, UnitState("activating", 0, "a"))
    assert w.gate(150, UnitState("active", 0, "a")) is None
    w.feed_stall(150, Counters(5, 1, 0, 0))
    assert w.last_generation == 5
    assert w.gate(160, UnitState("active", 0, "b")) is None
    # the window starts again at the new invocation
    assert w.feed_stall(1000, Counters(5, 1, 0, 0)) is None
    assert parse_show("ActiveState=active\nActiveEnterTimestampMonotonic=2500000\n"
                      "InvocationID=x\n") == UnitState("active", 2.5, "x")


def test_restart_cap_counts_the_window(tmp_path: Path) -> None:
    r = Restarts(config(tmp_path, max_restarts=2, restart_window_s=600))
    r.record(1000)
    assert not r.capped(1100)
    r.record(1100)
    assert r.capped(1200) and r.capped(1599)
    assert not r.capped(1601) and r.recent(1601) == [1100]


# --- rounds against a fake vLLM -------------------------------------------------------------------
def test_stalled_engine_is_restarted_and_recorded(tmp_path: Path, server: OpsVllm,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, stall_window_s=30, probe_interval_s=1000)
    ctl = FakeSystemctl(entered=0)
    runner = Runner(cfg, "vllm", server.url, systemctl=ctl)
    server.generation, server.running = 700, 1
    assert runner.step(200, 1e9) is None and runner.step(229, 1e9 + 29) is None
    assert ctl.restarts() == 0
    assert runner.step(230, 1e9 + 30) is None
    assert ctl.restarts() == 1
    out = capsys.readouterr().out
    assert ("restarting vllm: engine stalled: 1 request(s) running but generation tokens stuck at "
            "700 for 30 s") in out and "(restart 1 of at most 2 in 600 s)" in out
    assert json.loads(Path(cfg.state).read_text())["restarts"] == [1e9 + 30]
    assert oct(Path(cfg.state).stat().st_mode & 0o777) == "0o644"
    assert runner.step(240, 1e9 + 40) is None   # its own restart starts a grace period
    assert "within the grace period" in capsys.readouterr().out


def test_acceptance_collapse_restarts(tmp_path: Path, server: OpsVllm,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, acceptance_floor=30, acceptance_window_s=60, min_draft_tokens=100,
                 probe_interval_s=1000)
    ctl = FakeSystemctl()
    runner = Runner(cfg, "vllm", server.url, systemctl=ctl)
    server.running = 1
    for i, t in enumerate((200, 230, 260)):
        server.generation, server.draft, server.accepted = (10.0 * (i + 1), 1000.0 + 500 * i,
                                                            100.0 + 10 * i)
        assert runner.step(t, 1e9 + t) is None
    assert ctl.restarts() == 1
    assert "acceptance collapsed: 2.0 % of 1000 draft tokens accepted over the last 60 s" in \
        capsys.readouterr().out


def test_health_green_but_completions_time_out(tmp_path: Path, server: OpsVllm,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, probe_interval_s=5, probe_timeout_s=0.3, probe_failures=2)
    ctl = FakeSystemctl()
    runner = Runner(cfg, "vllm", server.url, api_key="k3y", systemctl=ctl)
    assert runner.step(200, 1e9) is None                 # answers: fine
    server.completions = "hang"
    assert runner.step(203, 1e9) is None                 # not due yet: no probe
    assert server.paths().count("/v1/completions") == 1
    assert runner.step(205, 1e9) is None and ctl.restarts() == 0
    assert runner.step(210, 1e9) is None and ctl.restarts() == 1
    out = capsys.readouterr().out
    assert ("/health answers 200 but completions time out: 2 probes in a row failed (last: no "
            "answer within 0.3 s") in out
    assert {auth for path, auth in server.seen if path == "/v1/completions"} == {"Bearer k3y"}


def test_a_busy_server_queueing_the_probe_is_not_restarted(
        tmp_path: Path, server: OpsVllm, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, probe_interval_s=5, probe_timeout_s=0.3, probe_failures=2)
    ctl = FakeSystemctl()
    runner = Runner(cfg, "vllm", server.url, systemctl=ctl)
    server.completions, server.running = "hang", 4
    for i, t in enumerate((200, 205, 210)):
        server.generation = 100.0 * i
        assert runner.step(t, 1e9) is None
    server.waiting = 2
    assert runner.step(215, 1e9) is None and runner.step(220, 1e9) is None and ctl.restarts() == 0
    assert "is busy (2 request(s) waiting): not counted" in capsys.readouterr().out
    server.waiting = 0   # nothing moves now: two failed probes in a row restart it
    assert runner.step(225, 1e9) is None and ctl.restarts() == 0
    assert runner.step(230, 1e9) is None and ctl.restarts() == 1


def test_the_lock_is_not_held_across_reads_and_the_state_is_read_again(
        tmp_path: Path, server: OpsVllm, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, stall_window_s=30, probe_interval_s=1000)
    ctl = FakeSystemctl()
    runner = Runner(cfg, "vllm", server.url, systemctl=ctl)
    free: list[bool] = []

    def try_lock() -> None:
        with open(cfg.lock) as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                free.append(True)
            except BlockingIOError:
                free.append(False)

    server.running, server.generation, server.on_metrics = 1, 700, try_lock
    assert runner.step(200, 1e9) is None and free == [True]
    server.on_metrics = lambda: setattr(ctl, "invocation", "b2")   # restarted while it was read
    assert runner.step(230, 1e9) is None and ctl.restarts() == 0
    assert "vllm changed while it was checked (now active, invocation b2): not restarting" in \
        capsys.readouterr().out


def test_reads_have_a_wall_clock_deadline_and_metrics_a_size_bound(
        tmp_path: Path, server: OpsVllm, capsys: pytest.CaptureFixture[str]) -> None:
    # each byte within any read timeout, the whole far past the deadline
    server.metrics_mode = "trickle"
    begin = time.monotonic()
    with scrape.client(5.0) as http, pytest.raises(UserError,
                                                   match="/metrics: no answer within 0.5 s"):
        scrape.read_metrics(http, server.url, deadline_s=0.5)
    assert time.monotonic() - begin < 2.0
    server.metrics_mode = "huge"
    runner = Runner(config(tmp_path, probe_interval_s=1000), "vllm", server.url,
                    systemctl=FakeSystemctl())
    assert runner.step(200, 1e9) is None
    assert "/metrics: answers more than 8388608 bytes" in capsys.readouterr().out


def test_the_api_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert scrape.read_key(str(key)) == "s3cret" and scrape.read_key(None) == "from-env"
    for body in ("s3cret\nmore\n", "", "s3 cret\n", "x" * 5000):
        key.write_text(body)
        with pytest.raises(UserError) as err:
            scrape.read_key(str(key))
        assert str(key) in str(err.value) and "s3cret" not in str(err.value) and \
            "\n" not in str(err.value)


def test_a_probe_answering_404_is_said_and_not_counted(tmp_path: Path, server: OpsVllm,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, probe_interval_s=1, probe_failures=1)
    ctl = FakeSystemctl()
    runner = Runner(cfg, "vllm", server.url, systemctl=ctl)
    server.completions = "404"
    for t in (200, 201, 202):
        assert runner.step(t, 1e9) is None
    assert ctl.restarts() == 0 and "answers HTTP 404" in capsys.readouterr().out
    server.completions = "500"
    assert runner.step(203, 1e9) is None and ctl.restarts() == 1


def test_grace_and_inactive_skip_the_checks(tmp_path: Path, server: OpsVllm) -> None:
    cfg = config(tmp_path, grace_s=100, stall_window_s=10)
    ctl = FakeSystemctl(entered=150)
    runner = Runner(cfg, "vllm", server.url, systemctl=ctl)
    server.running = 1
    for t in (160, 200, 249):
        assert runner.step(t, 1e9) is None
    ctl.active = "failed"
    assert runner.step(300, 1e9) is None
    assert ctl.restarts() == 0 and server.paths() == []


def test_a_held_lock_is_a_deploy_in_progress(tmp_path: Path, server: OpsVllm,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, stall_window_s=30, probe_interval_s=1000)
    Path(cfg.lock).parent.mkdir(parents=True)
    Path(cfg.lock).write_text("")
    Path(cfg.lock).chmod(0o644)  # as an older sparkspec made it: readable, so lockable, by everyone
    ctl = FakeSystemctl()
    runner = Runner(cfg, "vllm", server.url, systemctl=ctl)
    assert oct(Path(cfg.lock).stat().st_mode & 0o777) == "0o600"
    server.running, server.generation = 1, 9
    assert runner.step(200, 1e9) is None
    with open(cfg.lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        for t in (210, 220, 240):
            assert runner.step(t, 1e9) is None
    out = capsys.readouterr().out
    assert out.count("deploy in progress") == 1   # said once
    assert runner.step(250, 1e9) is None          # the window started again after the deploy
    assert runner.step(279, 1e9) is None and ctl.restarts() == 0
    assert runner.step(280, 1e9) is None and ctl.restarts() == 1


def test_cap_reached_leaves_the_unit_and_exits_0(tmp_path: Path, server: OpsVllm,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, stall_window_s=30, probe_interval_s=1000, max_restarts=2,
                 restart_window_s=600)
    Path(cfg.state).parent.mkdir(parents=True)
    Path(cfg.state).write_text(json.dumps({"restarts": [1e9 - 500, 1e9 - 100]}))
    ctl = FakeSystemctl()
    runner = Runner(cfg, "vllm", server.url, systemctl=ctl)
    server.running = 1
    assert runner.step(200, 1e9) is None
    assert runner.step(230, 1e9) == 0
    assert ctl.restarts() == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert "restarted 2 times in 600 s (cap 2): leaving vllm as it is and stopping" in out
    assert "`systemctl restart vllm-watchdog`" in out


# --- the command ----------------------------------------------------------------------------------
# systemctl is /usr/bin/systemctl (scrape.SYSTEMCTL): the command runs with that constant set to
# a fake
WRAP = ("import sys; from sparkspec.operate import scrape; scrape.SYSTEMCTL = sys.argv[1]; "
        "from sparkspec.cli import main; sys.exit(main(sys.argv[2:]))")


def fake_systemctl(tmp: Path, active: str) -> tuple[list[str], dict[str, str]]:
    """The command line that runs ``sparkspec`` with a recording systemctl, and its environment."""
    script = tmp / "systemctl"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp}/calls\n"
                      f"[ \"$1\" = show ] && printf 'ActiveState={active}\\n"
                      "ActiveEnterTimestampMonotonic=1\\nInvocationID=a\\n'\nexit 0\n")
    script.chmod(0o755)
    (tmp / "key").write_text("from-file\n")
    return [sys.executable, "-c", WRAP, str(script)], {**os.environ, "VLLM_API_KEY": "from-env"}


def test_command_stops_at_the_cap(tmp_path: Path, server: OpsVllm) -> None:
    doc = config_doc(tmp_path, grace_s=0.1, interval_s=0.1, stall_window_s=0.3,
                     restart_window_s=600, probe_interval_s=1000)
    Path(doc["state"]).parent.mkdir(parents=True)
    Path(doc["state"]).write_text(json.dumps({"restarts": [time.time() - 10, time.time() - 5]}))
    (tmp_path / "w.json").write_text(json.dumps(doc))
    server.running = 1
    argv, env = fake_systemctl(tmp_path, "active")
    proc = subprocess.run([*argv, "watchdog", "--unit", "vllm", "--url", server.url, "--config",
                           str(tmp_path / "w.json"), "--api-key-file", str(tmp_path / "key")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert {auth for path, auth in server.seen if path == "/metrics"} == {"Bearer from-file"}
    assert "cap 2" in proc.stdout.strip().splitlines()[-1]
    assert "restart vllm" not in (tmp_path / "calls").read_text()
    assert "from-env" not in proc.stdout


def test_command_sigterm_ends_it_with_0(tmp_path: Path, server: OpsVllm) -> None:
    (tmp_path / "w.json").write_text(json.dumps(config_doc(tmp_path, interval_s=0.1)))
    argv, env = fake_systemctl(tmp_path, "inactive")
    proc = subprocess.Popen([*argv, "watchdog", "--unit", "vllm", "--url", server.url, "--config",
                             str(tmp_path / "w.json")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "calls").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "vllm not active (inactive): not checking" in out and \
        out.strip().endswith("stopped by SIGTERM")
