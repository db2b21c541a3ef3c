"""The watchdog's canary: its config lines, the record per start key, the streak, the textfile
figures, and its rounds against a fake vLLM whose answer changes behind the unit's back (alert,
restart where enabled, the cap), never counting an answer asked beside other requests."""

from __future__ import annotations

import json
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparkspec.operate import canary
from sparkspec.operate.watchdog import load_config
from sparkspec.operate.watchrun import Runner

from .test_watchdog import FakeSystemctl, OpsVllm, config_doc


class ChatVllm(OpsVllm):
    """OpsVllm with /v1/chat/completions answering ``answer`` (or raw ``chat_body``), its tokens
    counted as generated."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = "blue blue blue"
        self.chat_body: bytes | None = None
        self.chats: list[dict[str, Any]] = []
        self.others = 0   # tokens other requests generate while the canary's runs

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        if h.path != "/v1/chat/completions":
            return super().handle(h)
        req = json.loads(h.rfile.read(int(h.headers.get("Content-Length") or 0)))
        self.chats.append(req)
        tokens = len(self.answer.split())
        self.generation += tokens + self.others
        body = self.chat_body if self.chat_body is not None else json.dumps(
            {"choices": [{"message": {"role": "assistant", "content": self.answer}}],
             "usage": {"prompt_tokens": 9, "completion_tokens": tokens}}).encode()
        return self.reply(h, 200, body)


@pytest.fixture
def chat() -> Any:
    fake = ChatVllm()
    yield fake
    fake.httpd.shutdown()


def _files(tmp: Path) -> dict[str, str]:
    record = tmp / "unit.json"
    record.write_text(json.dumps({"profile": "p", "method": "mtp", "num_speculative_tokens": 2,
                                  "args": ["--model", "/m"]}))
    site = tmp / "venv" / "lib" / "python3.12" / "site-packages" / "vllm-0.32.0.dist-info"
    site.mkdir(parents=True)
    (site / "RECORD").write_text("vllm/__init__.py,sha256=a,1\n")
    return {"unit_record": str(record), "venv": str(tmp / "venv")}


def canary_doc(tmp: Path, **changes: Any) -> dict[str, Any]:
    return {"interval_s": 30, "streak": 2, "restart": True, "prompt": "Name a colour.",
            "max_tokens": 8, "dir": str(tmp / "canary"), "textfile_dir": str(tmp / "textfile"),
            **_files(tmp), **changes}


def _runner(tmp: Path, server: ChatVllm, ctl: FakeSystemctl, **changes: Any) -> Runner:
    path = tmp / "watchdog.json"
    path.write_text(json.dumps(config_doc(tmp, probe_interval_s=1000, max_restarts=1,
                                          canary=canary_doc(tmp, **changes))))
    (tmp / "textfile").mkdir(exist_ok=True)
    cfg, problems = load_config(str(path))
    assert cfg is not None, problems
    return Runner(cfg, "vllm", server.url, systemctl=ctl)


def _gauge(tmp: Path, name: str) -> float:
    text = (tmp / "textfile" / "sparkspec-canary-vllm.prom").read_text()
    return next(float(line.split()[-1]) for line in text.splitlines()
                if line.startswith(name + "{"))


@pytest.mark.parametrize(("changes", "expected"), [
    ({"interval_s": 5}, "'canary.interval_s': 5 s is below the watchdog's interval_s 10 s"),
    ({"interval_s": 0}, "'canary.interval_s': 0 is not a number of seconds > 0"),
    ({"streak": 0}, "'canary.streak': 0 is not a whole number from 1 to 1000"),
    ({"restart": "yes"}, "'canary.restart': 'yes' is not true or false"),
    ({"prompt": ""}, "'canary.prompt': is not 1 to 4096 characters"),
    ({"dir": "state/canary"}, "'canary.dir': 'state/canary' is not an absolute path"),
    ({"colour": 1}, "'canary.colour': unknown key"),
], ids=["below-the-watchdog-interval", "zero", "streak-zero", "restart-a-string", "empty-prompt",
        "relative-dir", "unknown-key"])
def test_a_bad_canary_config_is_one_line(tmp_path: Path, changes: dict[str, Any],
                                         expected: str) -> None:
    path = tmp_path / "watchdog.json"
    path.write_text(json.dumps(config_doc(tmp_path, interval_s=10,
                                          canary=canary_doc(tmp_path, **changes))))
    cfg, problems = load_config(str(path))
    assert cfg is None and [p for p in problems if expected in p] == problems[:1], problems


def test_a_config_without_a_canary_is_one_from_before_it(tmp_path: Path) -> None:
    path = tmp_path / "watchdog.json"
    path.write_text(json.dumps(config_doc(tmp_path)))
    cfg, problems = load_config(str(path))
    assert cfg is not None and cfg.canary is None, problems


def test_the_first_clean_answer_is_recorded_then_a_changed_one_alerts_and_restarts(
        tmp_path: Path, chat: ChatVllm, capsys: pytest.CaptureFixture[str]) -> None:
    ctl = FakeSystemctl(entered=0)
    runner = _runner(tmp_path, chat, ctl)
    # its series exist from the start (a dashboard panel and the alert have them at once)
    assert _gauge(tmp_path, "sparkspec_canary_mismatch_streak") == 0
    assert _gauge(tmp_path, "sparkspec_canary_recorded") == 0
    assert runner.step(200, 1e9) is None
    records = list((tmp_path / "canary").glob("*.json"))
    assert len(records) == 1 and json.loads(records[0].read_text())["answer"] == "blue blue blue"
    assert chat.chats[0]["temperature"] == 0 and chat.chats[0]["max_tokens"] == 8
    assert _gauge(tmp_path, "sparkspec_canary_recorded") == 1
    assert runner.step(210, 1e9 + 10) is None and len(chat.chats) == 1   # not due yet
    chat.answer = "garbage garbage"   # weights or generation settings changed behind the unit
    assert runner.step(230, 1e9 + 30) is None
    assert ctl.restarts() == 0 and _gauge(tmp_path, "sparkspec_canary_mismatch_streak") == 1
    assert runner.step(260, 1e9 + 60) is None
    assert ctl.restarts() == 1
    # the restarted engine starts a fresh streak (the alert resolves until it builds again)
    assert _gauge(tmp_path, "sparkspec_canary_mismatch_streak") == 0
    assert _gauge(tmp_path, "sparkspec_canary_streak_limit") == 2
    assert chat.chats[-1]["cache_salt"] != chat.chats[0]["cache_salt"]   # never a cached prefill
    out = capsys.readouterr().out
    assert ("restarting vllm: canary answer changed: 2 answers in a row differ from the one "
            "recorded") in out and "'garbage garbage'" in out
    # past the restart's grace, still changed: the cap (1) stops the watchdog, the alert stays
    assert runner.step(400, 1e9 + 200) is None
    assert runner.step(430, 1e9 + 230) == 0
    assert ctl.restarts() == 1 and _gauge(tmp_path, "sparkspec_canary_mismatch_streak") == 2
    assert len(records) == 1 and json.loads(records[0].read_text())["answer"] == "blue blue blue"


def test_with_restart_off_it_only_alerts(tmp_path: Path, chat: ChatVllm,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    ctl = FakeSystemctl(entered=0)
    runner = _runner(tmp_path, chat, ctl, restart=False)
    runner.step(200, 1e9)
    chat.answer = "other"
    for t in (230, 260, 290):
        assert runner.step(t, 1e9 + t) is None
    assert ctl.restarts() == 0 and _gauge(tmp_path, "sparkspec_canary_mismatch_streak") == 3
    assert "alerting only (restart off)" in capsys.readouterr().out
    chat.answer = "blue blue blue"   # right again: the streak ends
    runner.step(320, 1e9 + 320)
    assert _gauge(tmp_path, "sparkspec_canary_mismatch_streak") == 0


def test_a_busy_server_is_not_asked_and_a_crowded_answer_not_counted(tmp_path: Path,
                                                                     chat: ChatVllm) -> None:
    ctl = FakeSystemctl(entered=0)
    runner = _runner(tmp_path, chat, ctl)
    chat.running = 1
    runner.step(200, 1e9)
    assert chat.chats == [] and not (tmp_path / "canary").exists()
    chat.running = 0
    chat.others = 5   # another request generated beside the canary's answer
    runner.step(201, 1e9 + 1)
    assert len(chat.chats) == 1 and not (tmp_path / "canary").exists()
    chat.others = 0
    runner.step(232, 1e9 + 32)   # due again, alone: recorded
    assert len(list((tmp_path / "canary").glob("*.json"))) == 1


@pytest.mark.parametrize("body", [b"not json", b'{"choices": []}', b'{"choices": [{"message": '
                                  b'{"content": 5}}], "usage": {"completion_tokens": 1}}',
                                  b'{"choices": [{"message": {"content": "x"}}], "usage": '
                                  b'{"completion_tokens": -1}}',
                                  b"[" * 100_000 + b"]" * 100_000],
                         ids=["not-json", "no-choice", "content-a-number", "usage-negative",
                              "deep"])
def test_a_hostile_answer_is_one_line_and_no_record(tmp_path: Path, chat: ChatVllm,
                                                    capsys: pytest.CaptureFixture[str],
                                                    body: bytes) -> None:
    chat.chat_body = body
    runner = _runner(tmp_path, chat, FakeSystemctl(entered=0))
    assert runner.step(200, 1e9) is None
    assert not (tmp_path / "canary").exists()
    out = capsys.readouterr().out
    assert "canary: not asked or not answered (" in out and "Traceback" not in out


def test_the_record_follows_the_command_line(tmp_path: Path, chat: ChatVllm) -> None:
    """A new command line (a deploy changed the unit) is a new start key: recorded afresh."""
    runner = _runner(tmp_path, chat, FakeSystemctl(entered=0))
    runner.step(200, 1e9)
    unit = tmp_path / "unit.json"
    unit.write_text(unit.read_text().replace('"/m"', '"/m2"'))
    chat.answer = "red"
    runner.step(230, 1e9 + 30)
    answers = sorted(json.loads(p.read_text())["answer"]
                     for p in (tmp_path / "canary").glob("*.json"))
    assert answers == ["blue blue blue", "red"]
    assert _gauge(tmp_path, "sparkspec_canary_mismatch_streak") == 0


def test_the_textfile_escapes_the_unit_label() -> None:
    text = canary.textfile('u"x\\\n', canary.Streak(3, 1), 1.5e9, True).decode()
    assert 'sparkspec_canary_mismatch_streak{unit="u\\"x\\\\\\n"} 1.0\n' in text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["sparkspec_canary_last_check_timestamp_seconds"].value == 1.5e9
    assert samples["sparkspec_canary_streak_limit"].labels == {"unit": 'u"x\\\n'}
