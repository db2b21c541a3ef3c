"""Action plugin: run a long command on the host as an Ansible async job, print its progress in the
play at least once a minute, and return the command's own result, as ``ansible.builtin.command``
would.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

from sparkspec.jsonfile import JsonShapeError, loads_bounded
from sparkspec.progress import line

display = Display()

ARGS = {
    "argv": {"type": "list", "elements": "str"},
    "interval": {"type": "int", "default": 30},
    "timeout": {"type": "int", "required": True},
    "start": {"type": "bool", "default": False},
    "job": {"type": "dict", "options": {"jid": {"type": "str", "required": True},
                                        "progress": {"type": "str", "required": True}}},
}
ASYNC_KEYS = ("ansible_job_id", "started", "finished", "results_file", "_ansible_parsed")


class ActionModule(ActionBase):
    _supports_check_mode = True

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result: dict[str, Any] = super().run(tmp, task_vars)
        del tmp
        task_vars = task_vars or {}
        _, args = self.validate_argument_spec(argument_spec=ARGS)
        if not 1 <= args["interval"] <= 60:
            raise AnsibleActionFail(f"interval {args['interval']}: give 1-60 seconds (a line at "
                                    "least once a minute)")
        if args["timeout"] < 1:
            raise AnsibleActionFail(f"timeout {args['timeout']}: give the seconds after which the "
                                    "command is stopped (>= 1)")
        if (args["argv"] is None) == (args["job"] is None) \
                or (args["start"] and args["job"] is not None):
            raise AnsibleActionFail("give argv (a command to run, optionally start: true) or job "
                                    "(the job a task started with start: true), not both")
        if self._task.check_mode:  # as command would: it skips without running anything
            if args["job"] is not None:
                return {**result, "skipped": True, "msg": "check mode: no job was started"}
            result.update(self._execute_module("ansible.legacy.command",
                                               module_args={"argv": args["argv"]},
                                               task_vars=task_vars))
            return result
        host = str(task_vars.get("inventory_hostname", "host"))
        # not expanded here (a round trip): the command, async_status and slurp expand ~ as the
        # user they run as
        async_dir = self.get_shell_option("async_dir", default="~/.ansible_async")
        if args["job"] is not None:
            jid, progress = _job(args["job"])
        else:
            progress = self._connection._shell.join_path(
                async_dir, f"sparkspec-progress-{secrets.token_hex(8)}.json")
            jid = self._start([*args["argv"], "--progress-file", progress], args["timeout"],
                              task_vars)
            if args["start"]:
                return {**result, "changed": True, "job": {"jid": jid, "progress": progress}}
        done: dict[str, Any] = {}
        try:
            done = self._follow(jid, async_dir, progress, host, args, task_vars)
        finally:
            # the wait module removed the results file of a job that ended
            if not done.get("finished"):
                self._execute_module("ansible.legacy.async_status", task_vars=task_vars,
                                     module_args={"jid": jid, "mode": "cleanup",
                                                  "_async_dir": async_dir})
        for key in ASYNC_KEYS:
            done.pop(key, None)
        result.update(done)
        return result

    def _start(self, argv: list[str], timeout: int, task_vars: dict[str, Any]) -> str:
        self._task.async_val = timeout
        try:
            started = self._execute_module("ansible.legacy.command", module_args={"argv": argv},
                                           task_vars=task_vars, wrap_async=True)
        finally:
            self._task.async_val = 0  # the task executor must not poll this task itself
        if started.get("failed") or "ansible_job_id" not in started:
            raise AnsibleActionFail(f"could not start {argv[0]}: {started.get('msg', started)}")
        return str(started["ansible_job_id"])

    def _follow(self, jid: str, async_dir: str, progress: str, host: str, args: dict[str, Any],
                task_vars: dict[str, Any]) -> dict[str, Any]:
        what = self._task.get_name()
        start = time.monotonic()
        # the document's stamp, and when it was first read (host clock unused)
        seen: list[Any] = [None, start]
        next_line = start + args["interval"]
        while True:
            status: dict[str, Any] = self._execute_module(
                "sparkspec_job_wait", task_vars=task_vars,
                module_args={"jid": jid, "async_dir": async_dir, "progress": progress,
                             "wait": round(max(0.0, next_line - time.monotonic()), 3)})
            if status.get("finished"):
                return status
            if status.get("failed"):  # the job's file is gone or unreadable
                raise AnsibleActionFail(f"lost the job of {what}: {status.get('msg', status)}")
            now = time.monotonic()
            if now - start > args["timeout"] + 60:
                raise AnsibleActionFail(f"{what}: no result {args['timeout']} s after the start "
                                        "(timeout)")
            if now >= next_line:
                doc = _progress(status.get("progress"))
                stamp = doc.get("time") if doc else None
                if stamp != seen[0]:
                    seen[:] = [stamp, now]
                display.display(line(host, doc, what, now - start, now - seen[1] if doc else 0.0))
                next_line = now + args["interval"]


def _job(job: dict[str, Any]) -> tuple[str, str]:
    """The job a start: true task returned: async_wrapper's id (j<digits>.<pid>) and a progress file
    of ours."""
    jid, progress = str(job["jid"]), str(job["progress"])
    if not re.fullmatch(r"j\d+\.\d+", jid) \
            or not re.fullmatch(r"sparkspec-progress-[0-9a-f]{16}\.json",
                                progress.rsplit("/", 1)[-1]):
        raise AnsibleActionFail(f"job {job!r} is not one that sparkspec_progress started "
                                "(start: true)")
    return jid, progress


def _progress(text: Any) -> dict[str, Any] | None:
    """The progress document the wait module read; None while the command wrote none."""
    if not isinstance(text, str) or not text:
        return None
    try:
        doc = loads_bounded(text, max_bytes=1 << 16)
    except (ValueError, JsonShapeError):
        return None
    return doc if isinstance(doc, dict) else None
