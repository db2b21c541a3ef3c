#!/usr/bin/python
"""sparkspec_link: read what a cluster's node needs of its link and of the host, changing nothing
(the preflight role's cluster checks compare the answers of every node)."""

from __future__ import annotations

import ipaddress
import os
import pwd
import re
import socket

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: sparkspec_link
short_description: Read a cluster node's link interface, its peers' reachability and logind's IPC
  setting
description:
  - Reads the interface's state, MTU and addresses from /sys/class/net and the kernel's address
    table.
  - Tries a TCP connection to each target; a refusal counts as reached (the host answered), a
    timeout or no route as unreachable.
  - Reads logind's RemoveIPC and whether the service user is a system user (UID below 1000, which
    logind spares) or lingers.
options:
  interface:
    description: The link's interface name.
    type: str
    required: true
  address:
    description: This node's address on the link, expected on the interface.
    type: str
    required: true
  targets:
    description: host:port pairs to reach over the link.
    type: list
    elements: str
    default: []
  user:
    description: The service's user.
    type: str
    required: true
  timeout:
    description: Seconds per connection attempt.
    type: float
    default: 3
author: sparkspec
"""

RETURN = r"""
interface: {description: exists, up (operstate up or unknown), mtu, addresses, type: dict,
            returned: always}
reach: {description: each target to reached or unreachable (with the reason), type: dict,
        returned: always}
remove_ipc: {description: logind's RemoveIPC (yes unless a logind.conf says no), type: bool,
             returned: always}
user: {description: uid (-1 when absent), system (uid below 1000), linger, type: dict,
       returned: always}
"""


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _interface(name: str) -> dict[str, object]:
    base = f"/sys/class/net/{name}"
    exists = "/" not in name and os.path.isdir(base)
    mtu = _read(f"{base}/mtu") if exists else ""
    state = _read(f"{base}/operstate") if exists else ""
    addresses = []
    for line in _read("/proc/net/if_inet6").splitlines():   # IPv6: hex address ... name
        parts = line.split()
        if len(parts) == 6 and parts[5] == name:
            addresses.append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    try:
        import fcntl
        import struct
        # SIOCGIFADDR: the IPv4 address
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            addresses.append(socket.inet_ntoa(raw[20:24]))
    except OSError:
        pass
    return {"exists": exists, "up": state in ("up", "unknown"), "operstate": state,
            "mtu": int(mtu) if mtu.isdigit() else 0, "addresses": addresses}


def _reach(target: str, timeout: float) -> str:
    host, _, port = target.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return "reached"
    except ConnectionRefusedError:
        return "reached"          # the host answered: nothing listens there yet
    except (OSError, ValueError) as exc:
        return f"unreachable ({exc.__class__.__name__}: {exc})"


def _logind_remove_ipc() -> bool:
    value = "yes"                 # logind's default
    paths = ["/etc/systemd/logind.conf"]
    for folder in ("/usr/lib/systemd/logind.conf.d", "/etc/systemd/logind.conf.d",
                   "/run/systemd/logind.conf.d"):
        try:
            paths += sorted(os.path.join(folder, f) for f in os.listdir(folder)
                            if f.endswith(".conf"))
        except OSError:
            pass
    for path in paths:
        for match in re.finditer(r"(?m)^\s*RemoveIPC\s*=\s*(\S+)", _read(path)):
            value = match.group(1).lower()
    return value not in ("no", "false", "0", "off")


def main() -> None:
    module = AnsibleModule(argument_spec={
        "interface": {"type": "str", "required": True},
        "address": {"type": "str", "required": True},
        "targets": {"type": "list", "elements": "str", "default": []},
        "user": {"type": "str", "required": True},
        "timeout": {"type": "float", "default": 3.0},
    }, supports_check_mode=True)
    p = module.params
    try:
        entry = pwd.getpwnam(p["user"])
        uid = entry.pw_uid
        linger = os.path.exists(f"/var/lib/systemd/linger/{p['user']}")
    except KeyError:
        uid, linger = -1, False
    module.exit_json(changed=False, interface=_interface(p["interface"]),
                     reach={t: _reach(t, p["timeout"]) for t in p["targets"]},
                     remove_ipc=_logind_remove_ipc(),
                     user={"uid": uid, "system": 0 <= uid < 1000, "linger": linger})


if __name__ == "__main__":
    main()
