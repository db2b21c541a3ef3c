"""The hub endpoint with what tests of a fetch need on top of it: cut transfers (a connection
dropped mid-body, as a network fault does) and a log of every request answered.

Development tooling, not shipped: the product server (:mod:`sparkspec.hub.server`) has neither; this
subclasses its request handler.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from sparkspec.hub.server import Handler, HubServer


@dataclass
class Cut:
    """The next ``times`` responses for a path ending in ``path_suffix`` that reach ``after`` body
    bytes are cut there."""

    path_suffix: str
    after: int
    times: int


@dataclass
class Faults:
    cuts: list[Cut] = field(default_factory=list)
    # method, path, Range, status of every response
    requests: list[tuple[str, str, str | None, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, key: str, start: int, end: int) -> int:
        """Where a response for ``key`` carrying [start, end) stops: ``end``, or a cut's point
        (spent)."""
        with self.lock:
            for cut in self.cuts:
                if cut.times > 0 and key.endswith(cut.path_suffix) and start + cut.after < end:
                    cut.times -= 1
                    return start + cut.after
        return end


class _FaultyHandler(Handler):
    def send_response(self, code: int, message: str | None = None) -> None:
        # recorded before anything is sent, so a client that has its answer sees the record
        faults = self._faults()
        with faults.lock:
            faults.requests.append((self.command, self.path.partition("?")[0],
                                    self.headers.get("Range"), code))
        super().send_response(code, message)

    def _stream(self, fd: int, key: str, start: int, end: int) -> None:
        stop = self._faults().take(key, start, end)
        super()._stream(fd, key, start, stop)
        if stop < end and not self.close_connection:  # cut, unless the client went away first
            self.drop()

    def _faults(self) -> Faults:
        hub = self.server.hub
        assert isinstance(hub, FaultyHub)
        return hub.faults


class FaultyHub(HubServer):
    """:class:`HubServer` whose responses can be cut (:meth:`cut`) and whose requests are logged
    (:attr:`requests`)."""

    handler = _FaultyHandler

    def __init__(self, root: str | os.PathLike[str], **kwargs: Any) -> None:
        self.faults = Faults()
        super().__init__(root, **kwargs)

    def cut(self, path_suffix: str, after: int, times: int = 1) -> None:
        with self.faults.lock:
            self.faults.cuts.append(Cut(path_suffix, after, times))

    def heal(self) -> None:
        """Drop every cut not yet spent."""
        with self.faults.lock:
            self.faults.cuts.clear()

    @property
    def requests(self) -> list[tuple[str, str, str | None, int]]:
        with self.faults.lock:
            return list(self.faults.requests)

    def reset(self) -> None:
        """Clear the server's counters and the request log."""
        self.stats.reset()
        with self.faults.lock:
            self.faults.requests.clear()
