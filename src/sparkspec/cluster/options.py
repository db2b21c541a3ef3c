"""The options of ``sparkspec cluster supervise``: this node's beacon, its peers and the child
command, each checked before anything starts."""

from __future__ import annotations

import ipaddress
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from sparkspec.errors import UserError

MAX_SECONDS = 1e6
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}\Z")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"{_LABEL}(\.{_LABEL})*\Z")


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Peer:
    name: str
    at: Endpoint
    role: str  # "head" or "worker": what the peer is to this node

    def __str__(self) -> str:
        return f"{self.role} {self.name} ({self.at})"


@dataclass(frozen=True)
class Options:
    rank: int
    listen: Endpoint
    peers: tuple[Peer, ...]
    command: tuple[str, ...]
    join_timeout: float = 600.0
    lost_after: float = 30.0
    interval: float = 5.0
    stop_timeout: float = 20.0


def endpoint(text: str, what: str) -> Endpoint:
    """ADDR:PORT (IPv4, [IPv6] or a host name; port 1-65535), else a UserError naming ``what``."""
    host, _, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    host = host[1:-1] if bracketed else host
    try:
        address = ipaddress.ip_address(host)
        ok = bracketed == (address.version == 6)
    except ValueError:
        ok = not bracketed and bool(_HOST.match(host)) and not host.replace(".", "").isdigit()
    if not ok or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(f"{what} {text[:80]!r}: not ADDR:PORT with a port 1-65535; give e.g. "
                        "10.0.0.2:29502 or [fd00::2]:29502")
    return Endpoint(host, int(port))


def _seconds(value: float, flag: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_SECONDS:
        raise UserError(f"{flag} {value!r}: must be a number of seconds > 0 and <= "
                        f"{MAX_SECONDS:g}; fix {flag}")
    return float(value)


def options(rank: int, listen: str, peers: Sequence[str], command: Sequence[str],
            join_timeout: float = 600.0, lost_after: float = 30.0, interval: float = 5.0,
            stop_timeout: float = 20.0) -> Options:
    """Every option checked before anything starts; the first bad one is a UserError naming it."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank <= 1023:
        raise UserError(f"--rank {rank!r}: must be an integer 0-1023 (0 is the head); fix --rank")
    here = endpoint(listen, "--listen")
    numbers = {"--join-timeout": join_timeout, "--lost-after": lost_after, "--interval": interval,
               "--stop-timeout": stop_timeout}
    join_timeout, lost_after, interval, stop_timeout = (_seconds(v, k) for k, v in numbers.items())
    if lost_after < 2 * interval:
        raise UserError(f"--lost-after {lost_after:g} is less than twice --interval {interval:g}; "
                        "one missed poll must not lose a peer: raise --lost-after or lower "
                        "--interval")
    if not peers:
        raise UserError("no --peer given; give the head (on a worker) or every worker (on the "
                        "head) as --peer NAME=ADDR:PORT")
    if rank > 0 and len(peers) != 1:
        raise UserError(f"--rank {rank} is a worker, which watches the head only; give one --peer "
                        f"(the head), not {len(peers)}")
    found: list[Peer] = []
    for text in peers:
        name, sep, at = text.partition("=")
        if not sep or not _NAME.match(name):
            raise UserError(f"--peer {text[:80]!r}: not NAME=ADDR:PORT with a host name of "
                            "letters, digits, '.', '_' or '-'; give e.g. spark01=10.0.0.1:29502")
        peer = Peer(name, endpoint(at, f"--peer {name}"), "worker" if rank == 0 else "head")
        if peer.at == here:
            raise UserError(f"--peer {name} is this node's own --listen {here}; give the other "
                            "node's beacon")
        twin = next((p for p in found if p.name == name or p.at == peer.at), None)
        if twin is not None:
            raise UserError(f"--peer {name} ({peer.at}) repeats --peer {twin.name} ({twin.at}); "
                            "give each peer once, with its own address")
        found.append(peer)
    if not command or not os.path.isabs(command[0]):
        raise UserError("the child command is missing or its first word is not an absolute path; "
                        "give it after --, e.g. -- /opt/sparkspec/venvs/vllm/bin/vllm serve ...")
    if not os.path.isfile(command[0]) or not os.access(command[0], os.X_OK):
        raise UserError(f"the child command {command[0][:200]!r} is not an executable file; fix "
                        "the path after --")
    return Options(rank, here, tuple(found), tuple(command), join_timeout, lost_after, interval,
                   stop_timeout)
