"""Fabric connections to the hosts of an inventory, with the connection settings Ansible would use
(read through its inventory API, templated and vault-decrypted), and commands run as root the way
the playbooks become it."""

from __future__ import annotations

import getpass
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paramiko
from fabric import Connection
from invoke.exceptions import Failure as InvokeFailure
from invoke.runners import Result

from sparkspec.errors import RunFailure, UserError
from tasks.lib.inventory import C, load

CONNECTION_VARS = ("ansible_host", "ansible_port", "ansible_user", "ansible_ssh_private_key_file",
                   "ansible_ssh_common_args", "ansible_ssh_extra_args", "ansible_become_password",
                   "ansible_become_pass", "ansible_python_interpreter")
CONNECT_TIMEOUT_S = 10


class Unreachable(RunFailure):
    """The host did not answer over SSH (exit 1: nothing is wrong with what the user typed)."""


@dataclass
class Host:
    name: str
    conn: Connection
    become_password: str | None
    python: str
    vars: dict[str, Any]

    @property
    def is_root(self) -> bool:
        return self.conn.user == "root"

    def as_root(self, command: str, *, hide: bool = True, pty: bool = False) -> Result:
        """Run a shell command as root: directly when connected as root, else through sudo (with the
        become password where the inventory or the prompt gave one, else sudo -n, which needs
        NOPASSWD)."""
        shell = f"sh -c {shlex.quote(command)}"
        try:
            if self.is_root:
                return self.conn.run(shell, hide=hide, warn=True, pty=pty, in_stream=False)
            if self.become_password is not None:
                return self.conn.sudo(shell, password=self.become_password, hide=hide, warn=True,
                                      pty=pty)
            return self.conn.run(f"sudo -n -- {shell}", hide=hide, warn=True, pty=pty,
                                 in_stream=False)
        except (TimeoutError, OSError, paramiko.SSHException) as exc:
            raise unreachable(self.name, self.conn, exc) from None
        except InvokeFailure as exc:  # sudo refused the password
            raise UserError(f"host {self.name}: sudo failed "
                            f"({exc.reason or exc.result.stderr.strip()}); "
                            "check ansible_become_password or the sudo rights of "
                            f"{self.conn.user}") from None

    def open(self) -> Connection:
        """The connection, opened: an unreachable host is one line."""
        try:
            self.conn.open()
        except (TimeoutError, OSError, paramiko.SSHException) as exc:
            raise unreachable(self.name, self.conn, exc) from None
        return self.conn

    def close(self) -> None:
        self.conn.close()


def connect(inventory: str | Path, host: str, *, ask_become_pass: bool = False,
            extra_vars: tuple[str, ...] = ()) -> Host:
    """A Connection to a host of the inventory (opened on first use) and the host's variables named
    in extra_vars (templated; the contract's defaults underneath)."""
    inv = load(inventory)
    values = inv.host_vars(host, CONNECTION_VARS + extra_vars)
    options = _ssh_options(" ".join(str(values.get(k) or "") for k in ("ansible_ssh_common_args",
                                                                         "ansible_ssh_extra_args")))
    key = values.get("ansible_ssh_private_key_file")
    connect_kwargs: dict[str, Any] = {"key_filename": str(Path(str(key)).expanduser()),
                                      "look_for_keys": False} \
        if key else {}
    port = values.get("ansible_port")
    conn = Connection(str(values.get("ansible_host") or host),
                      user=values.get("ansible_user") or None,
                      port=int(port) if port not in (None, "") else None,
                      connect_kwargs=connect_kwargs,
                      connect_timeout=int(options.get("connecttimeout", CONNECT_TIMEOUT_S)))
    _host_key_policy(conn.client, options)
    password = values.get("ansible_become_password", values.get("ansible_become_pass"))
    if password is None and ask_become_pass and conn.user != "root":
        password = getpass.getpass(f"BECOME password for {conn.user}@{host}: ")
    return Host(host, conn, None if password is None else str(password),
                str(values.get("ansible_python_interpreter") or "python3"), values)


def unreachable(name: str, conn: Connection, exc: BaseException) -> Unreachable:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return Unreachable(f"host {name} is unreachable over SSH ({conn.host}:{conn.port}: {reason}); "
                       "check ansible_host/ansible_port/ansible_user in the inventory and that "
                       "sshd runs")


def _ssh_options(args: str) -> dict[str, str]:
    """The -o Key=Value options of ansible_ssh_common_args/extra_args, keys lower-cased as
    ssh_config's."""
    words = shlex.split(args)
    options: dict[str, str] = {}
    for i, word in enumerate(words):
        value = (words[i + 1] if word == "-o" and i + 1 < len(words)
                 else word[2:] if word.startswith("-o") else "")
        key, sep, val = value.partition("=")
        if sep:
            options[key.strip().lower()] = val.strip()
    return options


def _host_key_policy(client: paramiko.SSHClient, options: dict[str, str]) -> None:
    """Check the host's key as Ansible's ssh would: against known_hosts, refusing an unknown host
    unless host key checking is off (host_key_checking, or StrictHostKeyChecking=no in the host's
    ssh args)."""
    strict = options.get("stricthostkeychecking", "yes" if C.HOST_KEY_CHECKING else "no").lower()
    known = options.get("userknownhostsfile", "")
    if known != "/dev/null":
        if known:
            path = Path(known).expanduser()
            if path.exists():
                client.load_host_keys(str(path))
        else:
            client.load_system_host_keys()
    accept = strict in ("no", "off", "false", "accept-new")
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy() if accept
                                       else paramiko.RejectPolicy())
