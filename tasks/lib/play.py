"""Run a playbook through ansible-runner: the play's normal output streams live, and the outcome
(changed and failed per host, the failing task's message, unreachable hosts) comes from the runner's
structured events."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ansible_runner

from tasks.lib.inventory import ROOT, C

# ansible-playbook's prompt for --ask-become-pass, answered by the runner from memory
BECOME_PROMPT = r"^BECOME password.*:\s*?$"
# ssh asking to trust an unknown host key on the runner's terminal, where no one can answer: refuse,
# so the play stops with "Host key verification failed" instead of waiting for ever (add the key to
# known_hosts first)
HOST_KEY_PROMPT = r"Are you sure you want to continue connecting \(yes/no[^)]*\)\?"
# Ansible stops within seconds of a Ctrl-C passed on; a play still running this long after it is
# killed, as a second Ctrl-C would kill it, so that the caller's cleanup (tune's and compare's
# restore) runs.
INTERRUPT_GRACE_S = 60.0
# One per command, passed to every play it runs: the deploy role marks its lock with it, so a lock
# this command's interrupted play left held is released by its next play (tune's and compare's
# restore), never anyone else's.
LOCK_OWNER = secrets.token_hex(16)


@dataclass
class Failure:
    host: str
    task: str
    msg: str
    argument_errors: list[str] = field(default_factory=list)


@dataclass
class PlayResult:
    rc: int
    # the runner's: successful, failed, canceled, timeout
    status: str
    changed: dict[str, int] = field(default_factory=dict)
    failed: dict[str, int] = field(default_factory=dict)
    unreachable: dict[str, str] = field(default_factory=dict)     # host -> the connection's message
    # failed tasks not ignored, in order
    failures: list[Failure] = field(default_factory=list)
    error_line: str = ""                          # Ansible's first error printed outside a task
    last_line: str = ""                           # the last line it printed outside a task
    interrupted: bool = False

    @property
    def total_changed(self) -> int:
        return sum(self.changed.values())


class _Events:
    """Collects what a PlayResult needs from the runner's events as they come."""

    def __init__(self, artifact_dir: Path) -> None:
        self.result = PlayResult(rc=-1, status="")
        self.pid: int | None = None
        self._artifact_dir = artifact_dir

    def __call__(self, event: Mapping[str, Any]) -> bool:
        if self.pid is None:
            self.pid = event.get("pid")
            # the runner wrote the whole environment there before the play started: keep it off the
            # disk
            (self._artifact_dir / "command").unlink(missing_ok=True)
        data = event.get("event_data") or {}
        kind = event.get("event")
        res = data.get("res") or {}
        if kind == "runner_on_failed" and not data.get("ignore_errors"):
            self.result.failures.append(Failure(str(data.get("host")), str(data.get("task", "")),
                                                " ".join(str(res.get("msg", "")).split()),
                                                [" ".join(str(e).split())
                                                 for e in res.get("argument_errors", [])]))
        elif kind == "runner_on_unreachable":
            self.result.unreachable[str(data.get("host"))] = " ".join(
                str(res.get("msg", "")).split())
        elif kind == "playbook_on_stats":
            # every host the play ran on; the counts name only non-zero ones
            hosts = data.get("processed") or {}
            self.result.changed = {h: int((data.get("changed") or {}).get(h, 0)) for h in hosts}
            self.result.failed = {h: int((data.get("failures") or {}).get(h, 0)) for h in hosts}
        # Ansible's own words where no task ran (the playbook does not parse)
        elif kind in ("verbose", "error"):
            lines = [ln.strip() for ln in str(event.get("stdout", "")).splitlines() if ln.strip()]
            first_error = next((ln for ln in lines if ln.startswith(("[ERROR]", "ERROR!"))), "")
            if first_error and not self.result.error_line:
                self.result.error_line = first_error
            self.result.last_line = lines[-1] if lines else self.result.last_line
        return False  # nothing of an event goes to disk


def run_playbook(playbook: Path, inventory: Path, limit: str, *,
                 extra_vars: Mapping[str, object] | None = None, tags: Iterable[str] = (),
                 skip_tags: Iterable[str] = (), check: bool = False,
                 become_password: str | None = None, quiet: bool = False) -> PlayResult:
    """Run a playbook on the hosts `limit` names, its output live on stdout (unless quiet). The
    runner's private folder is a 0700 temp folder, removed afterwards; extra vars go on the command
    line, a become password only through the runner's answer to ansible-playbook's prompt (never a
    file)."""
    private = Path(tempfile.mkdtemp(prefix="sparkspec-play-"))
    events = _Events(private / "artifacts" / "play")
    cmdline = (["--check", "--diff"] if check else []) + (
        ["--ask-become-pass"] if become_password is not None else [])
    try:
        with _interruptible(lambda: events.pid) as interrupted:
            runner = ansible_runner.run(
                private_data_dir=str(private), ident="play", project_dir=str(ROOT),
                playbook=str(playbook),
                inventory=str(inventory), limit=limit,
                extravars={"deploy_lock_owner": LOCK_OWNER, **(extra_vars or {})},
                tags=",".join(tags) or None, skip_tags=",".join(skip_tags) or None,
                cmdline=" ".join(cmdline) or None, envvars=_env(),
                passwords={HOST_KEY_PROMPT: "no",
                           **({BECOME_PROMPT: become_password}
                              if become_password is not None else {})},
                event_handler=events, cancel_callback=interrupted.cancelled,
                suppress_env_files=True, suppress_output_file=True, fact_cache_type="none",
                quiet=quiet)
        result = events.result
        result.rc, result.status = int(runner.rc), str(runner.status)
        result.interrupted = interrupted.signal
        return result
    finally:
        shutil.rmtree(private, ignore_errors=True)


def failure_summary(result: PlayResult, host: str) -> str:
    """One line naming what failed, from the run's events."""
    if result.interrupted:
        return "interrupted; the play stopped where it was (run it again to converge)"
    if host in result.unreachable:
        return (f"host {host} is unreachable over SSH ({result.unreachable[host] or 'no answer'}); "
                f"check ansible_host/ansible_port/ansible_user in the inventory and that sshd runs")
    mine = [f for f in result.failures if f.host == host] or result.failures
    if mine:  # the last one: after a rescue (a rollback) it is the message that says what happened
        failure = mine[-1]
        return "; ".join(failure.argument_errors) if failure.argument_errors else failure.msg or \
            f"task {failure.task!r} failed on {failure.host}"
    return (f"ansible-playbook exited {result.rc}: "
            f"{result.error_line or result.last_line or 'no output'}")


def _env() -> dict[str, str]:
    """The play's environment: this venv's Ansible, the project's ansible.cfg, and the settings the
    runner would otherwise change (it turns host key checking off unless told)."""
    env = {"ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "ANSIBLE_HOST_KEY_CHECKING": str(C.HOST_KEY_CHECKING), "PYTHONUNBUFFERED": "1"}
    if not sys.stdout.isatty() and "ANSIBLE_FORCE_COLOR" not in os.environ:
        env["ANSIBLE_NOCOLOR"] = "1"  # the runner's pty would make Ansible colour a log or a pipe
    return env


@dataclass
class _Interrupt:
    """What the signals asked: `signal` once one came, `cancel` once the play must be killed."""
    signal: bool = False
    cancel: bool = False
    since: float = 0.0

    def cancelled(self) -> bool:
        """The runner's cancel callback: a second signal, or a play still running INTERRUPT_GRACE_S
        after the first was passed on (a single SIGTERM from systemd or a CI time-out gets no second
        one)."""
        return self.cancel or (self.signal and time.monotonic() - self.since > INTERRUPT_GRACE_S)


@contextmanager
def _interruptible(pid: Callable[[], int | None]) -> Iterator[_Interrupt]:
    """Ctrl-C, SIGTERM or SIGHUP: pass SIGINT on to ansible-playbook (in the runner's own session,
    so the terminal's does not reach it) and let it stop as it does on Ctrl-C; a second signal, or
    INTERRUPT_GRACE_S without an end, cancels the run (the runner kills its process group)."""
    state = _Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield state
        return

    def handler(_signum: int, _frame: object) -> None:
        state.cancel = state.signal
        if not state.signal:
            state.signal, state.since = True, time.monotonic()
        child = pid()
        if child:
            try:
                os.killpg(os.getpgid(child), signal.SIGINT)
            except OSError:
                state.cancel = True
        else:
            state.cancel = True

    signums = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield state
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
