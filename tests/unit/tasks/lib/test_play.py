"""tasks.lib.play runs real playbooks (connection=local) through ansible-runner: the one-line
failure summary and the changed counts come from the runner's events, never from the printed
output."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tasks.lib.play import failure_summary, run_playbook
from tests.conftest import ROOT

# A line in the play's own output that looks like a failure: a scraper of the printed output would
# take it.
DECOY = "fatal: [local1]: FAILED! => {\"msg\": \"decoy from the output\"}"


@pytest.fixture()
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"all": {"hosts": {
        "local1": {"ansible_connection": "local",
                   "ansible_python_interpreter": "{{ ansible_playbook_python "
                                                 "}}"},
        "dead1": {"ansible_host": "127.0.0.1", "ansible_port": 1, "ansible_connection": "ssh"},
    }}}))
    return path


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The runner's private folders go under here, to check that none is left behind."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _playbook(tmp_path: Path, tasks: list[dict], hosts: str = "all") -> Path:
    path = tmp_path / "play.yml"
    path.write_text(yaml.safe_dump([{"name": "Test play", "hosts": hosts, "gather_facts": False,
                                     "tasks": tasks}]))
    return path


def _copy(tmp_path: Path, name: str, content: str) -> dict:
    return {"name": f"Write {name}",
            "ansible.builtin.copy": {"content": content, "dest": str(tmp_path / name),
                                                               "mode": "0600"}}


def test_failure_summary_is_the_failed_tasks_msg(tmp_path, inventory, private_tmp, capsys):
    book = _playbook(tmp_path, [
        _copy(tmp_path, "a.txt", "a\n"),
        {"name": "Print a decoy", "ansible.builtin.debug": {"msg": DECOY}},
        {"name": "Fail but "
                 "ignored", "ansible.builtin.fail": {"msg": "ignored failure"},
         "ignore_errors": True},
        {"name": "Fail", "ansible.builtin.fail": {"msg": "the  known\nmessage"}},
    ])
    result = run_playbook(book, inventory, "local1")
    assert result.rc != 0 and result.status == "failed"
    assert failure_summary(result, "local1") == "the known message"
    assert [(f.host, f.task) for f in result.failures] == [("local1", "Fail")]
    assert result.changed == {"local1": 1} and result.failed == {"local1": 1}
    out = capsys.readouterr().out
    assert "TASK [Fail]" in out and "decoy from the output" in out  # the play's output was shown
    assert list(private_tmp.iterdir()) == []                          # the runner's folder is gone


def test_changed_counts_come_from_the_stats_event(tmp_path, inventory, private_tmp):
    book = _playbook(tmp_path, [_copy(tmp_path, "a.txt", "a\n"), _copy(tmp_path, "b.txt", "b\n"),
                                {"name": "Say", "ansible.builtin.debug": {"msg": "changed=7"}}])
    first = run_playbook(book, inventory, "local1", quiet=True)
    assert (first.rc, first.status, first.changed, first.failures) == \
        (0, "successful", {"local1": 2}, [])
    (tmp_path / "b.txt").write_text("other\n")
    second = run_playbook(book, inventory, "local1", quiet=True)
    assert second.changed == {"local1": 1} and second.total_changed == 1
    # check mode: nothing to change
    check = run_playbook(book, inventory, "local1", quiet=True, check=True)
    assert check.changed == {"local1": 0} and (tmp_path / "a.txt").read_text() == "a\n"
    assert list(private_tmp.iterdir()) == []


def test_extra_vars_tags_and_argument_errors(tmp_path, inventory):
    spec = {"argument_spec": {"demo_count": {"type": "int", "required": True}}}
    book = _playbook(tmp_path, [
        {"name": "Tagged out", "ansible.builtin.fail": {"msg": "tag filter ignored"},
         "tags": ["skipme"]},
        {"name": "Check the arguments", "ansible.builtin.validate_argument_spec": spec,
         "vars": {"demo_count": "{{ demo_value }}"}},
    ])
    result = run_playbook(book, inventory, "local1", extra_vars={"demo_value": "lots"},
                          skip_tags=["skipme"], quiet=True)
    assert result.rc != 0
    summary = failure_summary(result, "local1")
    assert "demo_count" in summary and "lots" in summary and "tag filter" not in summary
    assert "\n" not in summary


def test_unreachable_host_is_named(tmp_path, inventory):
    result = run_playbook(_playbook(tmp_path, [{"name": "Ping", "ansible.builtin.ping": {}}]),
                          inventory, "dead1", quiet=True)
    assert list(result.unreachable) == ["dead1"]
    summary = failure_summary(result, "dead1")
    assert summary.startswith("host dead1 is unreachable over SSH (") and \
        "port 1" in summary, summary


def test_a_playbook_that_does_not_parse_gives_ansibles_error(tmp_path, inventory):
    book = tmp_path / "bad.yml"
    book.write_text("- hosts: all\n  tasks:\n    - name: x\n      no.such.module_xyz: {}\n")
    result = run_playbook(book, inventory, "local1", quiet=True)
    assert result.rc != 0 and result.failures == []
    summary = failure_summary(result, "local1")
    assert summary.startswith("ansible-playbook exited "
                              f"{result.rc}: ") and "no.such.module_xyz" in summary, summary


INTERRUPTED_RUN = """
import sys
from pathlib import Path
from tasks.lib.play import failure_summary, run_playbook
result = run_playbook(Path(sys.argv[1]), Path(sys.argv[2]), "local1")
print("INTERRUPTED", result.interrupted, failure_summary(result, "local1"), flush=True)
"""


def test_sigterm_stops_the_play_and_leaves_nothing(tmp_path, inventory, private_tmp):
    """SIGTERM (or Ctrl-C) reaches ansible-playbook, which runs in the runner's own session: the
    play stops, no ansible-playbook is left running, the private folder is removed."""
    marker = tmp_path / "sleeping"
    book = _playbook(tmp_path,
                     [{"name": "Sleep", "ansible.builtin.shell": f"echo $PPID > {marker}; sleep 60",
                       "changed_when": False}])
    env = {**os.environ, "TMPDIR": str(private_tmp)}
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_RUN, str(book), str(inventory)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "the play never reached its sleeping task"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert "INTERRUPTED True interrupted" in out, out[-2000:]
    # the module running the sleeping shell
    task = Path(f"/proc/{int(marker.read_text().split()[0])}/cmdline")
    deadline = time.monotonic() + 20
    while task.exists() and "ansible" in task.read_text(errors="replace") and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    outlived = task.exists() and "ansible" in task.read_text(errors="replace")
    assert not outlived, "the task outlived the play"
    assert list(private_tmp.iterdir()) == []


BECOME_RUN = """
import sys
from pathlib import Path
from tasks.lib.play import run_playbook
result = run_playbook(Path(sys.argv[1]), Path(sys.argv[2]), "local1", become_password="s3cret-pw")
print("RC", result.rc, result.changed, flush=True)
"""


def test_become_password_answers_the_prompt_and_is_not_shown(tmp_path, inventory, private_tmp):
    """--ask-become-pass: ansible-playbook asks on the runner's terminal and the runner answers from
    memory (a wrong prompt pattern would leave the play waiting for ever); the password is neither
    printed nor on disk."""
    book = _playbook(tmp_path, [{"name": "Ping", "ansible.builtin.ping": {}}])
    proc = subprocess.run([sys.executable, "-c", BECOME_RUN, str(book), str(inventory)],
                          check=False, cwd=ROOT, timeout=60, capture_output=True, text=True,
                          env={**os.environ, "TMPDIR": str(private_tmp)})
    assert "RC 0 {'local1': 0}" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "BECOME password" in proc.stdout and "s3cret-pw" not in proc.stdout + proc.stderr
    assert list(private_tmp.iterdir()) == []


def test_a_tasks_lines_reach_a_pipe_as_they_are_printed() -> None:
    """`invoke tune ... | tee log` (and a test reading the pipe) sees each step when it starts: the
    tasks' streams are line-buffered, not flushed in 8 KiB blocks at exit."""
    code = ("import sys, time, tasks; print('step one'); print('warn', file=sys.stderr); "
            "time.sleep(60)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        for stream, line in ((proc.stdout, "step one\n"), (proc.stderr, "warn\n")):
            assert stream is not None
            ready, _, _ = select.select([stream], [], [], 30)
            assert ready, f"{line.strip()!r} was printed but did not reach the pipe within 30 s"
            assert stream.readline() == line
    finally:
        proc.kill()
        proc.communicate()


def test_a_play_that_outlives_its_interrupt_is_cancelled(monkeypatch):
    """One signal (systemd's SIGTERM, a CI time-out) gets no second one: a play still running
    INTERRUPT_GRACE_S after the SIGINT was passed on is cancelled (the runner kills it), so the
    caller's restore runs; before that, Ansible is left to stop on its own."""
    from tasks.lib import play

    monkeypatch.setattr(play, "INTERRUPT_GRACE_S", 0.5)
    state = play._Interrupt()
    assert not state.cancelled()
    state.signal, state.since = True, time.monotonic()
    assert not state.cancelled()
    time.sleep(0.6)
    assert state.cancelled()
    assert play._Interrupt(signal=True, cancel=True, since=time.monotonic()).cancelled()
