"""Run the project's playbooks from Python (invoke tasks, tests) with one-line failure summaries."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path

import yaml

from sparkspec.errors import UserError

PROJECT_ROOT = Path(__file__).resolve().parents[2]
_FAILED = re.compile(r"^(fatal|failed): \[(?P<host>[^\]]+)\]")
_MSG = re.compile(r"^\s*msg: (?P<msg>.+)$|\"msg\": \"(?P<jmsg>(?:[^\"\\]|\\.)*)\"")
_RECAP = re.compile(r"^(?P<host>\S+)\s+: ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+unreachable=(?P<unreachable>\d+)"
                    r"\s+failed=(?P<failed>\d+)")


def tool(name: str) -> str:
    """Path of an Ansible executable of the environment sparkspec runs in."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else name


def ansible_env() -> dict[str, str]:
    env = {**os.environ, "ANSIBLE_CONFIG": str(PROJECT_ROOT / "ansible.cfg"), "ANSIBLE_FORCE_COLOR": "0",
           "PYTHONUNBUFFERED": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def inventory_path(inventory: str | os.PathLike[str]) -> Path:
    path = Path(inventory)
    if not path.is_absolute():
        path = (PROJECT_ROOT / path) if not path.exists() else path.resolve()
    if not path.exists():
        raise UserError(f"{inventory}: inventory not found; pass --inventory inventories/<site>")
    return path


def inventory_hosts(inventory: str | os.PathLike[str]) -> set[str]:
    inv = inventory_path(inventory)
    proc = subprocess.run([tool("ansible-inventory"), "-i", str(inv), "--list", "--export"], env=ansible_env(),
                          capture_output=True, text=True, check=False, cwd=PROJECT_ROOT)
    if proc.returncode != 0:
        raise UserError(f"{inv}: ansible-inventory failed: {_last_line(proc.stderr)}")
    data = json.loads(proc.stdout)
    hosts = set(data.get("_meta", {}).get("hostvars", {}))
    for group in data.values():
        if isinstance(group, dict):
            hosts.update(group.get("hosts", []))
    return hosts


def require_host(inventory: str | os.PathLike[str], host: str) -> None:
    hosts = inventory_hosts(inventory)
    if host not in hosts:
        known = ", ".join(sorted(hosts)) or "none"
        raise UserError(f"host {host!r} is not in inventory {inventory} (hosts: {known}); "
                        f"add it there or pass --inventory")


@dataclass
class PlayResult:
    rc: int
    changed: dict[str, int]
    output: str

    @property
    def total_changed(self) -> int:
        return sum(self.changed.values())


def run_playbook(playbook: str, inventory: str | os.PathLike[str], host: str, *,
                 extra_vars: Mapping[str, object] | None = None, tags: Iterable[str] = (),
                 skip_tags: Iterable[str] = (), check: bool = False, echo: bool = True,
                 extra_args: Iterable[str] = ()) -> PlayResult:
    """Run a playbook limited to one host; stream its output; summarise a failure in one line."""
    require_host(inventory, host)
    book = PROJECT_ROOT / "playbooks" / playbook
    if not book.exists():
        raise UserError(f"{book}: playbook not found")
    argv = [tool("ansible-playbook"), "-i", str(inventory_path(inventory)), "--limit", host, str(book)]
    if extra_vars:
        argv += ["--extra-vars", json.dumps(dict(extra_vars))]
    if tags:
        argv += ["--tags", ",".join(tags)]
    if skip_tags:
        argv += ["--skip-tags", ",".join(skip_tags)]
    if check:
        argv += ["--check", "--diff"]
    argv += list(extra_args)
    proc = subprocess.Popen(argv, env=ansible_env(), cwd=PROJECT_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()
    rc = proc.wait()
    output = "".join(lines)
    changed = {m["host"]: int(m["changed"]) for m in map(_RECAP.match, lines) if m}
    return PlayResult(rc=rc, changed=changed, output=output)


def failure_summary(result: PlayResult, host: str) -> str:
    """One line naming what failed, from a failed run's output."""
    if result.rc == 4 or "UNREACHABLE!" in result.output:
        return (f"host {host} is unreachable over SSH ({_first_msg(result.output, 'UNREACHABLE') or 'no answer'}); "
                f"check ansible_host/ansible_port/ansible_user in the inventory and that sshd runs")
    failure = _first_failure(result.output)
    errors = failure.get("argument_errors")
    if errors:
        return "; ".join(" ".join(str(e).split()) for e in errors)
    if failure.get("msg"):
        return " ".join(str(failure["msg"]).split())
    return f"ansible-playbook exited {result.rc}: {_last_line(result.output)}"


def _first_failure(output: str) -> dict:
    """The result dict of the first failed task, from the default callback's YAML (or JSON) output."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        head, sep, rest = line.partition("=> ")
        if not sep or not _FAILED.match(line):
            continue
        text = rest if rest.strip() else "\n".join(
            takewhile(lambda ln: ln.startswith((" ", "\t")) or not ln.strip(), lines[i + 1:]))
        try:
            data = yaml.safe_load(textwrap.dedent(text))
        except yaml.YAMLError:
            return {}
        return data if isinstance(data, dict) else {}
    return {}


def _first_msg(output: str, marker: str) -> str:
    for line in output.splitlines():
        if marker in line:
            m = _MSG.search(line)
            if m:
                return (m.group("msg") or m.group("jmsg") or "").strip()
    return ""


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "no output"


def status_lines(inventory: str | os.PathLike[str], pattern: str = "all") -> list[str]:
    """One line per host from playbooks/status.yml: unit state, method, profile, model, /health."""
    if pattern != "all":
        require_host(inventory, pattern)
    proc = subprocess.run([tool("ansible-playbook"), "-i", str(inventory_path(inventory)), "--limit", pattern,
                           str(PROJECT_ROOT / "playbooks/status.yml")],
                          env={**ansible_env(), "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}, cwd=PROJECT_ROOT,
                          capture_output=True, text=True, check=False)
    lines = [m.group(1) for m in re.finditer(r'"msg": "sparkspec-status ([^"]*)"', proc.stdout)]
    unreachable = re.findall(r"^fatal: \[([^\]]+)\]: UNREACHABLE", proc.stdout, re.M)
    return [" ".join(line.split()) for line in lines] + [f"{h} unreachable" for h in unreachable]


def served_method(inventory: str | os.PathLike[str], host: str) -> str | None:
    """The method a host serves now (from its unit record), or None when nothing is deployed."""
    for line in status_lines(inventory, host):
        m = re.search(r"\bmethod=(\S+)", line)
        if line.startswith(f"{host} ") and m:
            return None if m.group(1) == "none" else m.group(1)
    return None
