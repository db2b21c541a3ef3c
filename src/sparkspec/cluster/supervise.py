"""``sparkspec cluster supervise``: a node unit's main process in two-node serving, vLLM its child.
It stops vLLM when a peer is lost or restarted: vLLM's own state cannot be trusted across nodes."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sparkspec.cluster.options import Endpoint, Options, Peer
from sparkspec.cluster.options import endpoint as endpoint  # the CLI's and tests' names
from sparkspec.cluster.options import options as options
from sparkspec.errors import UserError

EXIT_LOST = 3
"""A peer was lost (no answer, its child exited, or it restarted). The unit restarts on it
(Restart=on-failure): the supervisor comes back and rejoins when the peer is back."""

EXIT_JOIN_TIMEOUT = 4
"""A peer did not join within --join-timeout. The unit does not restart on it
(RestartPreventExitStatus=4): a person must start the peer's unit or fix the link."""

PREFIX = "sparkspec-supervise:"
POLL_TIMEOUT_S = 3.0
NOTE_EVERY_S = 30.0
MAX_ANSWER = 4096
STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_INSTANCE = re.compile(r"[0-9a-f]{8,64}\Z")


class JoinTimeout(UserError):
    """A peer did not join in time: one line on stderr, exit :data:`EXIT_JOIN_TIMEOUT`."""

    exit_code = EXIT_JOIN_TIMEOUT


def say(text: str) -> None:  # one line to stdout (the journal), flushed at once
    print(f"{PREFIX} {text}", flush=True)


@dataclass(frozen=True)
class Answer:  # what a peer's beacon said
    rank: int
    instance: str
    child: str


class Beacon:
    """``GET /peer`` on the --listen address (200 JSON), every other path 404; no body is read."""

    def __init__(self, listen: Endpoint, rank: int, instance: str) -> None:
        self.rank, self.instance, self.child = rank, instance, "exited"
        self.started = time.monotonic()
        family = socket.AF_INET6 if ":" in listen.host else socket.AF_INET
        server_class = type("BeaconServer", (http.server.ThreadingHTTPServer,),
                            {"address_family": family})
        try:
            self.server = server_class((listen.host, listen.port), _handler(self))
        except OSError as exc:  # in use, not an address of this host, a name that does not resolve
            raise UserError(f"--listen {listen}: cannot listen ({exc.strerror or exc}); stop what "
                            "holds the port (another supervisor?) or give an address and port of "
                            "this host") from None
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.2,), daemon=True)

    def answer(self) -> dict[str, Any]:
        return {"rank": self.rank, "instance": self.instance, "child": self.child,
                "uptime_s": round(time.monotonic() - self.started, 3)}

    def close(self) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
        self.server.server_close()


def _handler(beacon: Beacon) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = 5  # a client that sends nothing does not hold a thread for long

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path != "/peer":
                self.send_error(404)
                return
            body = json.dumps(beacon.answer()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
            pass  # the journal gets the supervisor's own lines only

    return Handler


def ask(at: Endpoint, timeout: float = POLL_TIMEOUT_S) -> Answer | str:
    """The peer's beacon answer, or a few words on what was seen instead."""
    conn = http.client.HTTPConnection(at.host, at.port, timeout=timeout)
    try:
        conn.request("GET", "/peer", headers={"Accept": "application/json"})
        response = conn.getresponse()
        body = response.read(MAX_ANSWER + 1)
    except (OSError, http.client.HTTPException) as exc:
        why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return f"no answer ({why[:80]})"
    finally:
        conn.close()
    if response.status != 200:
        return f"an answer with HTTP {response.status}, not a sparkspec beacon"
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("rank"), int) \
            or isinstance(doc["rank"], bool) or not isinstance(doc.get("instance"), str) \
            or not _INSTANCE.match(doc["instance"]) \
            or doc.get("child") not in ("running", "exited"):
        return "an answer that is not a sparkspec beacon's"
    return Answer(doc["rank"], doc["instance"], doc["child"])


class Child:
    """The child command in its own process group (its id is the child's pid)."""

    def __init__(self, command: Sequence[str], wake: threading.Event) -> None:
        try:
            self.proc = subprocess.Popen(list(command), stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        except OSError as exc:
            raise UserError(f"the child command {command[0][:200]!r}: cannot start "
                            f"({exc.strerror or exc}); fix the command after --") from None
        self.wake = wake
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.proc.wait()
        self.wake.set()  # the main loop sees the exit at once

    def exit_code(self) -> int | None:
        """None while running; else its code, a signal death as 128 + the signal number."""
        code = self.proc.poll()
        return None if code is None else (128 - code if code < 0 else code)

    def _signal(self, sig: int) -> bool:  # False when no process of the group is left
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:  # a member changed its user: it still counts as alive
            pass
        return True

    def stop(self, first: int, timeout: float) -> None:
        """``first`` to the group, up to ``timeout`` s for all of it to end, then SIGKILL to it."""
        self._signal(first)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not self._signal(0):
                return
            time.sleep(0.05)
        self._signal(signal.SIGKILL)
        self.proc.wait()


@dataclass
class Watch:
    """The join and watch phases; :meth:`run` returns the supervisor's exit code."""

    opts: Options
    child: Child
    beacon: Beacon
    wake: threading.Event
    got: list[int] = field(default_factory=list)
    stop_signal: int = signal.SIGTERM
    instances: dict[str, str] = field(default_factory=dict)
    bad_since: dict[str, float] = field(default_factory=dict)

    def run(self, pool: ThreadPoolExecutor) -> int:
        start = time.monotonic()
        next_poll, next_note, joined = start, start + NOTE_EVERY_S, False
        while True:
            if self.got:
                self.stop_signal = self.got[0]
                say(f"{signal.Signals(self.got[0]).name} received; forwarding it to the child's "
                    "group")
                return 0
            code = self.child.exit_code()
            if code is not None:
                say(f"the child exited with code {code}; stopping the rest of its process group")
                return code
            now = time.monotonic()
            if now >= next_poll:
                next_poll = now + self.opts.interval
                seen = dict(zip(self.opts.peers, pool.map(ask, (p.at for p in self.opts.peers)),
                                strict=True))
                if joined:
                    lost = self._watch(seen, time.monotonic())
                    if lost:
                        say(f"{lost}; stopping the child (exit {EXIT_LOST}: the unit restarts and "
                            "rejoins)")
                        return EXIT_LOST
                else:
                    note = time.monotonic() >= next_note
                    next_note += NOTE_EVERY_S if note else 0.0
                    joined = self._join(seen, time.monotonic() - start, note)
            self.wake.wait(max(0.0, next_poll - time.monotonic()))
            self.wake.clear()

    def _wrong(self, answer: Answer | str) -> str | None:
        """Why ``answer`` is not a running peer of the expected role, or None."""
        if isinstance(answer, str):
            return answer
        if (answer.rank == 0) != (self.opts.rank > 0):
            return (f"an answer from rank {answer.rank}, not a "
                    f"{'head' if self.opts.rank else 'worker'}'s")
        return None if answer.child == "running" else f"its child {answer.child}"

    def _join(self, seen: dict[Peer, Answer | str], waited: float, note: bool) -> bool:
        missing = {peer: why for peer, answer in seen.items() if (why := self._wrong(answer))}
        if not missing:
            self.instances = {p.name: a.instance for p, a in seen.items() if isinstance(a, Answer)}
            say("joined: " + ", ".join(f"{p} instance {self.instances[p.name]}"
                                       for p in self.opts.peers))
            return True
        if waited >= self.opts.join_timeout:
            names = ", ".join(p.name for p in missing)
            say(f"join timed out after {self.opts.join_timeout:g} s; stopping the child")
            raise JoinTimeout(f"{' and '.join(map(str, missing))} did not join within "
                              f"{self.opts.join_timeout:g} s; start sparkspec's unit on {names} "
                              "or check the link")
        if note:
            say(f"waiting for {'; '.join(f'{p}: {why}' for p, why in missing.items())} "
                f"({waited:.0f} s of {self.opts.join_timeout:g} s)")
        return False

    def _watch(self, seen: dict[Peer, Answer | str], now: float) -> str | None:
        """A lost peer's line, or None while all are there (or gone for less than --lost-after)."""
        for peer, answer in seen.items():
            was = self.instances[peer.name]
            if isinstance(answer, Answer) and answer.instance != was:
                return (f"{peer} lost: it restarted (instance {was} is now {answer.instance}); "
                        "vLLM's process group cannot survive that")
            why = self._wrong(answer)
            if why is None:
                if self.bad_since.pop(peer.name, None) is not None:
                    say(f"{peer} is back")
                continue
            if peer.name not in self.bad_since:
                self.bad_since[peer.name] = now
                say(f"{peer}: {why}; lost unless it is back within {self.opts.lost_after:g} s")
            elif now - self.bad_since[peer.name] >= self.opts.lost_after:
                return f"{peer} lost: {why} for {now - self.bad_since[peer.name]:.1f} s"
        return None


def supervise(opts: Options) -> int:
    """Bind the beacon, start the child, join, watch; stop the child's group before any return."""
    instance = secrets.token_hex(8)
    beacon = Beacon(opts.listen, opts.rank, instance)  # a bind failure ends here: no child yet
    wake = threading.Event()
    got: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)
        wake.set()

    before: dict[int, Any] = {}
    watch: Watch | None = None
    pool = ThreadPoolExecutor(max_workers=len(opts.peers), thread_name_prefix="peer")
    try:
        try:
            before = {sig: signal.signal(sig, on_signal) for sig in STOPS}
        except ValueError:  # not the main thread (a test): signals stay with the caller
            pass
        watch = Watch(opts, Child(opts.command, wake), beacon, wake, got)
        beacon.child = "running"
        beacon.thread.start()
        say(f"rank {opts.rank}, instance {instance}: beacon at http://{opts.listen}/peer, child "
            f"pid {watch.child.proc.pid}; waiting {opts.join_timeout:g} s for "
            + ", ".join(map(str, opts.peers)))
        return watch.run(pool)
    finally:
        beacon.child = "exited"  # a peer polling now sees this node as gone, not as joined
        if watch is not None:
            watch.child.stop(watch.stop_signal, opts.stop_timeout)
            say(f"the child's process group is stopped (pid {watch.child.proc.pid})")
        pool.shutdown(wait=False, cancel_futures=True)
        beacon.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)
