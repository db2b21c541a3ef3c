"""Ansible filter for the monitoring role's port preflight: which of its listen ports another
process holds (from ``ss -Hltnpe`` and ``ps -o pid=,unit= -e``).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Mapping
from typing import Any

_PID = re.compile(r'\("([^"]*)",pid=(\d+)')
_PORT = re.compile(r":(\d+)$")
_UNSEEN = "a process outside this host's view (another container or namespace)"
_CGROUP = re.compile(r"\bcgroup:(\S+)")
# A system service's cgroup: /system.slice/<unit>.service exactly, below no .service and no
# user.slice (a container's cgroup may come first: /libpod_parent/libpod-17d1/system.slice/... on
# the simulated Spark). A user's `systemd-run --user --unit=prometheus` is
# .../user@1000.service/app.slice/prometheus.service: not it.
_SYSTEM_UNIT = re.compile(r"((?:/[^/]+)*?)/system\.slice/([^/]+\.service)")
_UNIT = re.compile(r"[^/]+\.(?:service|scope)")


def cgroup_unit(line: str) -> str | None:
    """The system unit of an ``ss -e`` line's cgroup (``prometheus.service``); for any other unit's
    cgroup a name that no system unit has (``prometheus.service (cgroup /user.slice/...)``); None
    without a unit."""
    match = _CGROUP.search(line)
    if match is None:
        return None
    path = match.group(1)
    system = _SYSTEM_UNIT.fullmatch(path)
    if system and not any(part.endswith(".service") or part == "user.slice"
                          for part in system.group(1).split("/")):
        return system.group(2)
    last = path.rsplit("/", 1)[-1]
    return f"{last} (cgroup {path})" if _UNIT.fullmatch(last) else None


def listeners(ss_lines: Iterable[str]) -> dict[int, list[tuple[list[tuple[str, int]], str | None]]]:
    """Port -> one ([(process name, pid)], unit from the socket's cgroup or None) per listening
    socket in ``ss -Hltnpe``'s lines."""
    out: dict[int, list[tuple[list[tuple[str, int]], str | None]]] = {}
    for line in ss_lines:
        cols = line.split()
        match = _PORT.search(cols[3]) if len(cols) >= 4 else None
        if match is None:
            continue
        procs = [(name, int(pid)) for name, pid in _PID.findall(line)]
        out.setdefault(int(match.group(1)), []).append((procs, cgroup_unit(line)))
    return out


def units(ps_lines: Iterable[str]) -> dict[int, str]:
    """Pid -> systemd unit from ``ps -o pid=,unit= -e``'s lines."""
    out: dict[int, str] = {}
    for line in ps_lines:
        cols = line.split()
        if len(cols) >= 2 and cols[0].isdigit():
            out[int(cols[0])] = cols[1]
    return out


def port_conflicts(ss_lines: Iterable[str], ps_lines: Iterable[str],
                              ports: Iterable[Mapping[str, Any]]) -> list[str]:
    """One line per port of ``ports`` ({port, var, unit}) that a process but ``unit`` listens on."""
    held, unit_of = listeners(ss_lines), units(ps_lines)
    problems: list[str] = []
    for want in ports:
        port = int(want["port"])
        others: list[str] = []
        for procs, unit in held.get(port, []):
            units_seen = {unit} if unit else {unit_of.get(pid) for _, pid in procs}
            if units_seen == {want["unit"]}:
                continue
            named = [f"{name} (pid {pid}, unit {unit or unit_of.get(pid, 'none')})"
                     for name, pid in procs]
            others += named or [f"unit {unit}" if unit else _UNSEEN]
        if others:
            problems.append(f"port {port} ({want['var']}) is already in use by "
                            f"{', '.join(others)}, not {want['unit']}; stop that process or set "
                            f"{want['var']} to a free port")
    return problems


_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def listen_address_problems(value: Any, var: str) -> list[str]:
    """[] when ``value`` is an IP address (v4 or v6, no port, no zone) or a host name (RFC 1123
    labels, the last not all digits), else one line: the services get
    ``--web.listen-address=VALUE:PORT``."""
    text = value if isinstance(value, str) and "%" not in value else ""   # no IPv6 zone
    try:
        ipaddress.ip_address(text)
        return []
    except ValueError:
        labels = text.split(".")
        if 0 < len(text) <= 253 and all(_LABEL.fullmatch(lb) for lb in labels) \
                and not labels[-1].isdigit():
            return []
    return [f"{var} {value!r:.80} is not an address or a host name without a port; give one of the "
            "host's, e.g. 127.0.0.1 (the default), ::1, or 0.0.0.0 for every interface"]


class FilterModule:
    """The monitoring preflight's filters."""

    def filters(self) -> dict[str, Any]:
        return {"sparkspec_port_conflicts": port_conflicts, "sparkspec_listen_address_problems":
                listen_address_problems}
