"""Hold the deploy's lock on a host as long as this process lives: the lock the watchdog takes too.

Usage: deploy_lock.py LOCK WAIT_SECONDS (the deploy role runs it under systemd-run -p Type=notify)
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import sys
import time


def notify_ready() -> None:
    """sd_notify(READY=1) over $NOTIFY_SOCKET (an abstract socket when it starts with '@')."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(b"READY=1")


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: deploy_lock.py LOCK WAIT_SECONDS", file=sys.stderr)
        return 2
    path, wait = argv[1], float(argv[2])
    # /run/sparkspec: root's, on a tmpfs
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    # root's alone: flock works on a read-only descriptor, so a file others can open is a lock
    # they can hold
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                print(f"deploy lock: {path} is still held after {wait:g} s (a watchdog restart or "
                      "another deploy)", flush=True)
                return 1
            time.sleep(0.5)
    os.ftruncate(fd, 0)
    os.write(fd, f"deploy {os.getpid()}\n".encode())
    print(f"deploy lock: holding {path}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    notify_ready()
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
