"""A TCP proxy on 127.0.0.1 that forwards to a server and limits the bytes it sends back to ``rate``
bytes/s (all connections together), so a fetch from the local hub takes seconds instead of
milliseconds (tests only).

    with ThrottleProxy(("127.0.0.1", hub_port), rate=1 << 20) as proxy:
        ... fetch from proxy.url ...
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Self

CHUNK = 16 << 10


class ThrottleProxy:
    def __init__(self, target: tuple[str, int], rate: int) -> None:
        self.target, self.rate = target, rate
        self._lock = threading.Lock()
        # when the next byte may leave (a shared pace for every connection)
        self._next = time.monotonic()
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listen.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        self._listen.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _wait_for(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(self._next, now)
            self._next = start + n / self.rate
        time.sleep(max(0.0, start - now))

    def _pump(self, src: socket.socket, dst: socket.socket, throttled: bool) -> None:
        try:
            while data := src.recv(CHUNK):
                if throttled:
                    self._wait_for(len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
