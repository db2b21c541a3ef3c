"""``sparkspec cluster supervise``: real supervisor processes on loopback, children that are small
Python scripts, short timeouts. Each test checks what a unit would see: exit codes, the lines, and
by pid that no process of the child's group is left."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sparkspec.cluster import supervise as sv
from sparkspec.errors import UserError

REPO = Path(__file__).resolve().parents[3]
# the command as the host CLI will run it, without editing sparkspec.cli's list of command modules
RUNNER = ("import sys\nfrom sparkspec.cli import cluster, run\n"
          "from sparkspec.cli.common import Parser\n"
          "parser = Parser(prog='sparkspec')\n"
          "cluster.register(parser.add_subparsers(dest='command'))\n"
          "sys.exit(run(parser, sys.argv[1:]))\n")
FAST = ["--interval", "0.2", "--lost-after", "1", "--join-timeout", "3", "--stop-timeout", "1"]
# a child that writes its pid and waits; a second argument makes it exit with that code instead
SLEEPER = ("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n"
           "sys.exit(int(sys.argv[2])) if len(sys.argv) > 2 else time.sleep(60)\n")
# a child that starts a grandchild, writes both pids, and ignores SIGTERM (so only SIGKILL ends it)
GROUP = ("import os, signal, subprocess, sys, time\n"
         "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
         "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
         "open(sys.argv[1] + '.tmp', 'w').write(f'{os.getpid()} {g.pid}')\n"
         "os.rename(sys.argv[1] + '.tmp', sys.argv[1])\ntime.sleep(60)\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def pids(path: Path, within: float = 10.0) -> list[int]:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"the child never wrote {path}"
        time.sleep(0.02)
    return [int(w) for w in path.read_text().split()]


def get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


class Supervisor:
    """A supervisor process; its stdout lines are read as they come."""

    def __init__(self, rank: int, port: int, peers: dict[str, int], child: list[str],
                 *flags: str) -> None:
        peer_args = [a for name, p in peers.items() for a in ("--peer", f"{name}=127.0.0.1:{p}")]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RUNNER, "cluster", "supervise", "--rank", str(rank), "--listen",
             f"127.0.0.1:{port}", *peer_args, *FAST, *flags, "--", sys.executable, "-c", *child],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def expect(self, text: str, within: float = 10.0) -> str:
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r}; saw {self.seen}")

    def finish(self, within: float = 15.0) -> tuple[int, str, str]:
        rc = self.proc.wait(timeout=within)
        self.reader.join(timeout=5)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        assert self.proc.stderr is not None
        return rc, "".join(self.seen), self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def started() -> Iterator[list[Supervisor]]:
    """Supervisors a test started; any still running at its end are killed."""
    found: list[Supervisor] = []
    yield found
    for sup in found:
        sup.kill()


class FakePeer:
    """A beacon whose answer the test sets: a peer that restarts or loses its child on cue."""

    def __init__(self, rank: int = 0) -> None:
        self.doc: dict[str, Any] = {"rank": rank, "instance": "a" * 16, "child": "running",
                                    "uptime_s": 1.0}
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = json.dumps(fake.doc).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_head() -> Iterator[FakePeer]:
    peer = FakePeer(rank=0)
    yield peer
    peer.close()


def test_beacon_answers_get_peer_with_json_and_404_elsewhere() -> None:
    port = free_port()
    beacon = sv.Beacon(sv.endpoint(f"127.0.0.1:{port}", "--listen"), 1, "0123456789abcdef")
    beacon.child = "running"
    beacon.thread.start()
    try:
        status, body = get(port, "/peer")
        doc = json.loads(body)
        assert status == 200
        assert set(doc) == {"rank", "instance", "child", "uptime_s"}
        assert (doc["rank"], doc["instance"], doc["child"]) == (1, "0123456789abcdef", "running")
        assert isinstance(doc["uptime_s"], float) and doc["uptime_s"] >= 0
        beacon.child = "exited"
        assert json.loads(get(port, "/peer")[1])["child"] == "exited"
        assert sv.ask(sv.Endpoint("127.0.0.1", port)) == sv.Answer(1, "0123456789abcdef", "exited")
        for path in ("/", "/peer/", "/peer?x=1", "/health", "/../peer"):
            assert get(port, path)[0] == 404, path
        assert get(port, "/peer", "POST")[0] == 501  # nothing but GET is served
    finally:
        beacon.close()


def test_two_supervisors_join_and_a_dead_child_loses_its_peer(tmp_path: Path,
                                                              started: list[Supervisor]) -> None:
    pa, pb = free_port(), free_port()
    head = Supervisor(0, pa, {"b": pb}, [SLEEPER, str(tmp_path / "a")])
    worker = Supervisor(1, pb, {"a": pa}, [SLEEPER, str(tmp_path / "b")])
    started += [head, worker]
    assert f"joined: worker b (127.0.0.1:{pb}) instance" in head.expect("joined")
    assert f"joined: head a (127.0.0.1:{pa}) instance" in worker.expect("joined")
    (head_child,), (worker_child,) = pids(tmp_path / "a"), pids(tmp_path / "b")
    os.kill(head_child, signal.SIGKILL)

    rc, out, err = head.finish()
    assert rc == 128 + signal.SIGKILL, (out, err)  # the child's own death passes through
    assert "the child exited with code 137" in out
    rc, out, err = worker.finish()
    assert rc == sv.EXIT_LOST, (out, err)
    assert re.search(rf"head a \(127\.0\.0\.1:{pa}\) lost: .* for \d", out), out
    assert gone(worker_child), "the worker's child outlived the lost head"


def test_a_peer_that_never_joins_exits_4_with_one_line(tmp_path: Path,
                                                       started: list[Supervisor]) -> None:
    port, missing = free_port(), free_port()
    sup = Supervisor(0, port, {"spark02": missing}, [SLEEPER, str(tmp_path / "pid")],
                     "--join-timeout", "1.5")
    started.append(sup)
    (child,) = pids(tmp_path / "pid")
    rc, out, err = sup.finish()
    assert rc == sv.EXIT_JOIN_TIMEOUT == 4, (out, err)
    assert err == (f"sparkspec: error: worker spark02 (127.0.0.1:{missing}) did not join within "
                   "1.5 s; start sparkspec's unit on spark02 or check the link\n")
    assert gone(child)


@pytest.mark.parametrize(("change", "lost_after", "seen"), [
    # a restart counts at once: with --lost-after 600 the supervisor still ends within finish()'s
    # wait
    ({"instance": "b" * 16}, "600", f"it restarted (instance {'a' * 16} is now {'b' * 16})"),
    ({"child": "exited"}, "1", "its child exited for "),
])
def test_a_restarted_or_childless_head_is_lost(tmp_path: Path, started: list[Supervisor],
                                               fake_head: FakePeer, change: dict[str, str],
                                               lost_after: str, seen: str) -> None:
    sup = Supervisor(1, free_port(), {"spark01": fake_head.port}, [SLEEPER, str(tmp_path / "pid")],
                     "--lost-after", lost_after)
    started.append(sup)
    sup.expect("joined: head spark01")
    (child,) = pids(tmp_path / "pid")
    fake_head.doc.update(change)
    rc, out, err = sup.finish()
    assert rc == sv.EXIT_LOST, (out, err)
    assert f"head spark01 (127.0.0.1:{fake_head.port}) lost: {seen}" in out
    assert gone(child)


def test_a_worker_joins_only_a_head(tmp_path: Path, started: list[Supervisor],
                                    fake_head: FakePeer) -> None:
    fake_head.doc["rank"] = 2  # another worker, given as the head by mistake
    sup = Supervisor(1, free_port(), {"spark01": fake_head.port}, [SLEEPER, str(tmp_path / "pid")],
                     "--join-timeout", "1")
    started.append(sup)
    rc, out, err = sup.finish()
    assert rc == sv.EXIT_JOIN_TIMEOUT and "head spark01" in err, (out, err)
    assert "joined" not in out


def test_sigterm_stops_the_whole_child_group(tmp_path: Path, started: list[Supervisor]) -> None:
    port = free_port()
    sup = Supervisor(0, port, {"w": free_port()}, [GROUP, str(tmp_path / "pids")],
                     "--join-timeout", "60")
    started.append(sup)
    child, grandchild = pids(tmp_path / "pids")
    instance = re.search(r"instance ([0-9a-f]+)", sup.expect("beacon at"))
    assert instance and json.loads(get(port, "/peer")[1])["instance"] == instance.group(1)
    assert alive(child) and alive(grandchild)
    sup.proc.send_signal(signal.SIGTERM)
    rc, out, err = sup.finish()
    assert rc == 0, (out, err)
    assert "SIGTERM received; forwarding it to the child's group" in out
    assert gone(child), "the child ignored SIGTERM and was not killed"
    assert gone(grandchild), "the grandchild outlived the supervisor"
    with pytest.raises(OSError):
        get(port, "/peer")  # the beacon went with it


def test_the_childs_exit_code_passes_through(tmp_path: Path, started: list[Supervisor]) -> None:
    sup = Supervisor(0, free_port(), {"w": free_port()}, [SLEEPER, str(tmp_path / "pid"), "7"],
                     "--join-timeout", "60")
    started.append(sup)
    rc, out, err = sup.finish()
    assert rc == 7, (out, err)
    assert "the child exited with code 7" in out


EXE = sys.executable
GOOD: dict[str, Any] = {"rank": 0, "listen": "127.0.0.1:29502", "peers": ["w=127.0.0.1:29503"],
                        "command": [EXE, "-c", "pass"], "interval": 0.2, "lost_after": 1.0}


@pytest.mark.parametrize(("change", "match"), [
    ({"rank": -1}, r"^--rank -1: must be an integer 0-1023"),
    ({"listen": "127.0.0.1:0"}, r"^--listen '127\.0\.0\.1:0': not ADDR:PORT with a port 1-65535"),
    ({"listen": "127.0.0.1:65536"}, r"^--listen .*port 1-65535"),
    ({"listen": "::1:29502"}, r"^--listen '::1:29502': not ADDR:PORT"),
    ({"listen": "host name:1"}, r"^--listen 'host name:1': not ADDR:PORT"),
    ({"peers": []}, r"^no --peer given"),
    ({"peers": ["w=127.0.0.1:29502"]}, r"^--peer w is this node's own --listen"),
    ({"peers": ["w=127.0.0.1:1", "w=127.0.0.1:2"]},
     r"^--peer w \(127\.0\.0\.1:2\) repeats --peer w"),
    ({"peers": ["a=127.0.0.1:1", "b=127.0.0.1:1"]}, r"^--peer b .* repeats --peer a"),
    ({"peers": ["-bad=127.0.0.1:1"]}, r"^--peer '-bad=127\.0\.0\.1:1': not NAME=ADDR:PORT"),
    ({"peers": ["w=127.0.0.1"]}, r"^--peer w '127\.0\.0\.1': not ADDR:PORT"),
    ({"rank": 1, "peers": ["a=127.0.0.1:1", "b=127.0.0.1:2"]},
     r"^--rank 1 is a worker.*give one --peer"),
    ({"join_timeout": 0}, r"^--join-timeout 0: must be a number of seconds > 0"),
    ({"stop_timeout": float("nan")}, r"^--stop-timeout nan: must be a number of seconds > 0"),
    ({"interval": 1.0, "lost_after": 1.5}, r"^--lost-after 1\.5 is less than twice --interval 1"),
    ({"command": []}, r"^the child command is missing"),
    ({"command": ["python3", "-c", "pass"]}, r"first word is not an absolute path"),
    ({"command": ["/nonexistent/vllm"]},
     r"^the child command '/nonexistent/vllm' is not an executable file"),
])
def test_bad_options_are_one_line_user_errors(change: dict[str, Any], match: str) -> None:
    with pytest.raises(UserError, match=match) as caught:
        sv.options(**{**GOOD, **change})
    assert "\n" not in str(caught.value)


def test_good_options_are_accepted() -> None:
    opts = sv.options(**{**GOOD, "listen": "[::1]:29502", "peers": ["spark02=spark02.lan:29502"]})
    assert opts.listen == sv.Endpoint("::1", 29502) and str(opts.listen) == "[::1]:29502"
    assert [str(p) for p in opts.peers] == ["worker spark02 (spark02.lan:29502)"]


@pytest.mark.parametrize("flags", [
    ["--rank", "0", "--listen", "127.0.0.1:{port}", "--peer", "w=127.0.0.1:1", "--interval", "1"],
    ["--rank", "0", "--listen", "127.0.0.1:{port}", "--peer", "w=127.0.0.1:{port}"],
    ["--rank", "0", "--listen", "127.0.0.1:{port}"],
    ["--rank", "x", "--listen", "127.0.0.1:{port}", "--peer", "w=127.0.0.1:1"],
])
def test_bad_options_start_nothing(tmp_path: Path, flags: list[str]) -> None:
    port, marker = free_port(), tmp_path / "started"
    argv = ["--interval", "0.2", "--lost-after", "1.5", *(f.format(port=port) for f in flags),
            "--", EXE, "-c", f"open({str(marker)!r}, 'w')"]
    proc = subprocess.run([EXE, "-c", RUNNER, "cluster", "supervise", *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2, proc
    assert proc.stderr.startswith("sparkspec: error: ") and proc.stderr.count("\n") == 1, \
        proc.stderr
    assert "Traceback" not in proc.stderr and not marker.exists()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing holds the port


def test_a_port_in_use_is_refused_before_the_child_starts(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        opts = sv.options(**{**GOOD, "listen": f"127.0.0.1:{port}",
                             "command": [EXE, "-c", f"open({str(marker)!r}, 'w')"]})
        where = rf"^--listen 127\.0\.0\.1:{port}: cannot listen \(.*\); stop what "
        with pytest.raises(UserError, match=where):
            sv.supervise(opts)
    time.sleep(0.3)  # room for a child that was wrongly started to write its marker
    assert not marker.exists()
