"""A small Hugging Face Hub-compatible endpoint that serves local directories: a site's model mirror
(an air-gapped site), a cluster head's checkpoint for its workers, the simulated Spark's hub
(docs/hub.md).
"""

from __future__ import annotations

import hmac
import http.client
import json
import os
import re
import socket
import sys
import threading
import urllib.parse
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

from sparkspec.hub import framing
from sparkspec.hub.api import HubError, Repos, header_text, not_found, segments
from sparkspec.hub.repo import CHUNK, is_lfs

MAX_FORM_BYTES = 1 << 20  # the most body bytes a request may carry (paths-info's form)
# after a refusal: how long to wait for what the client still sends, and how much to read
LINGER_S = 1.0
LINGER_BYTES = 1 << 20


@dataclass
class ServerStats:
    """What the server did, as counters (bounded however long it serves): file body bytes sent per
    ``org/name/path``, all body bytes, bytes hashed."""

    file_bytes: Counter[str] = field(default_factory=Counter)
    body_bytes: int = 0
    bytes_hashed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.file_bytes.clear()
            self.body_bytes = 0
            self.bytes_hashed = 0

    def hashed(self, n: int) -> None:
        with self.lock:
            self.bytes_hashed += n


class Handler(BaseHTTPRequestHandler):
    """One connection's requests (:attr:`HubServer.handler`)."""

    protocol_version = "HTTP/1.1"
    timeout = 30  # idle seconds: a client that stops mid-request does not hold a thread
    server: _Server
    _linger = False
    _body = b""

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.hub.verbose:
            sys.stderr.write(header_text(f"{self.address_string()} - {format % args}") + "\n")

    def handle_one_request(self) -> None:
        """One request: its head framed strictly (:mod:`sparkspec.hub.framing`), its body read
        whole, then answered; a refusal closes the connection."""
        self.close_connection, self._linger = True, False
        # never answer as HTTP/0.9
        self.command, self.requestline, self.request_version = "", "", "HTTP/1.1"
        try:
            head = framing.read_head(self.rfile)
            if head is None:
                return
            self.command, self.path, self.request_version = head.method, head.target, head.version
            self.requestline = f"{head.method} {head.target} {head.version}"
            self.headers = http.client.HTTPMessage()
            for name, value in head.fields:
                self.headers[name] = value
            self.close_connection = not head.keep_alive
            if head.method not in ("HEAD", "GET", "POST"):
                raise framing.FramingError(501, f"Method not supported: {head.method[:40]}")
            self._body = self._read_body(head)
            self._dispatch(head.method)
            self.wfile.flush()
        except framing.FramingError as err:
            self.command = err.method or self.command
            self.send_error(err.status, err.message)
        except (framing.Gone, OSError):  # cut short, timed out or reset: nothing to answer
            self.close_connection = True

    def _read_body(self, head: framing.Head) -> bytes:
        """The whole body, whatever the request (a GET's is read and dropped, never parsed as a
        request)."""
        if head.length > MAX_FORM_BYTES:
            raise framing.FramingError(413, f"Request body over {MAX_FORM_BYTES} bytes")
        if head.expect_continue:
            self.send_response_only(100)
            self.end_headers()
        body = self.rfile.read(head.length) if head.length else b""
        if len(body) < head.length:
            raise framing.Gone()
        return body

    def send_error(self, code: int, message: str | None = None,
                   explain: str | None = None) -> None:
        """A refused request: the hub's JSON error, ``Connection: close``, then the connection
        closed."""
        self.close_connection = self._linger = True
        text = message or self.responses.get(code, ("Error",))[0]
        self._send(code, json.dumps({"error": text}).encode(),
                   {"X-Error-Message": header_text(text)}, self.command)

    def finish(self) -> None:
        """After a refusal, half-close and read what the client still sends (bounded), as nginx's
        lingering close does: closing with unread input would reset the connection and lose the
        answer."""
        try:
            super().finish()
            if self._linger:
                self.connection.shutdown(socket.SHUT_WR)
                self.connection.settimeout(LINGER_S)
                left = LINGER_BYTES
                while left > 0 and (data := self.connection.recv(min(left, 65536))):
                    left -= len(data)
        except OSError:
            pass

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def send_response(self, code: int, message: str | None = None) -> None:
        self._answered = True
        super().send_response(code, message)

    def _dispatch(self, method: str) -> None:
        self._answered = False
        # the path as sent (http.server would turn a leading '//' into '/'): an empty segment is a
        # 404 here
        target, _, query = self.path.partition("?")
        try:
            self.server.hub.check_token(self.headers.get("Authorization"))
            parts = segments(target.partition("#")[0])
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(method, parts[2], parts[3], parts[4:], query)
            elif len(parts) >= 5 and parts[2] == "resolve" and method in ("HEAD", "GET") \
                    and not target.endswith("/"):  # a file name has no trailing slash
                self._resolve(method, parts[0], parts[1], parts[3], parts[4:])
            else:
                raise not_found()
        except HubError as err:
            headers = {"X-Error-Message": header_text(err.message)}
            if err.code:
                headers["X-Error-Code"] = err.code
            if err.commit:
                headers["X-Repo-Commit"] = err.commit
            self._send(err.status, json.dumps({"error": err.message}).encode(), headers, method)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001  one line logged, never a traceback; the client: 500
            print(header_text(f"sparkspec: error: hub: {method} {target[:200]}: "
                              f"{exc.__class__.__name__}: {exc}"), file=sys.stderr, flush=True)
            self.close_connection = True
            if not self._answered:
                self._send(500, b'{"error": "Internal Server Error"}', {}, method)

    def _send(self, status: int, body: bytes, headers: dict[str, str], method: str,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if method != "HEAD":
            with self.server.hub.stats.lock:
                self.server.hub.stats.body_bytes += len(body)
            self.wfile.write(body)

    def _form(self) -> dict[str, list[str]]:
        return urllib.parse.parse_qs(self._body.decode("utf-8", "replace"),
                                     max_num_fields=10_000)

    def _api(self, method: str, org: str, name: str, rest: list[str], query: str) -> None:
        hub = self.server.hub
        if not rest and method in ("GET", "HEAD"):
            rest = ["revision", "main"]
        if len(rest) < 2:
            raise not_found()
        kind, revision = rest[0], rest[1]
        repos = hub.repos
        snap = repos.snapshot(org, name, revision)
        args = urllib.parse.parse_qs(query)
        doc: Any
        if kind == "revision" and method in ("GET", "HEAD") and len(rest) == 2:
            doc = repos.model_info(snap, args.get("blobs", ["false"])[0].lower() == "true")
        elif kind == "tree" and method in ("GET", "HEAD"):
            recursive = args.get("recursive", ["false"])[0].lower() == "true"
            doc = repos.tree(snap, "/".join(rest[2:]), recursive)
        elif kind == "paths-info" and method == "POST" and len(rest) == 2:
            doc = repos.paths_info(snap, self._form().get("paths", []))
        else:
            raise not_found()
        self._send(200, json.dumps(doc).encode(), {"X-Repo-Commit": snap.commit}, method)

    def _resolve(self, method: str, org: str, name: str, revision: str, rest: list[str]) -> None:
        hub = self.server.hub
        snap = hub.repos.snapshot(org, name, revision)
        rel = "/".join(rest)
        fd, st = hub.repos.open(snap, rel)  # only the repo's own listed, validated, regular files
        try:
            digests = snap.store.of_fd(rel, fd, st, snap.count)
            size = st.st_size
            lfs = is_lfs(rel, size)
            start, end, status = 0, size, 200
            headers = {"ETag": f'"{digests.sha256 if lfs else digests.blob_id}"',
                       "X-Repo-Commit": snap.commit, "Accept-Ranges": "bytes"}
            if lfs:
                headers["X-Linked-Etag"] = f'"{digests.sha256}"'
                headers["X-Linked-Size"] = str(size)
            wanted = self.headers.get("Range")
            if wanted:
                start, end = _parse_range(wanted, size)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            for key, value in headers.items():
                self.send_header(key, value)
            self.end_headers()
            if method == "GET":
                self._stream(fd, f"{snap.repo_id}/{rel}", start, end)
        finally:
            os.close(fd)

    def _stream(self, fd: int, key: str, start: int, end: int) -> None:
        """Send bytes [start, end) of ``fd``; a file that shrank while sent drops the connection
        mid-body (the client sees a short body, never a wrong one)."""
        hub = self.server.hub
        while start < end and (chunk := os.pread(fd, min(CHUNK, end - start), start)):
            # counted before sending: a client that has the bytes sees the count
            with hub.stats.lock:
                hub.stats.file_bytes[key] += len(chunk)
                hub.stats.body_bytes += len(chunk)
            try:
                self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):  # the client went away
                self.close_connection = True
                return
            start += len(chunk)
        if start < end:
            self.drop()

    def drop(self) -> None:
        """Close the connection now, mid-body."""
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True


def _parse_range(value: str, size: int) -> tuple[int, int]:
    """A single ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range as [start, end); else 416."""
    match = re.fullmatch(r"\s*bytes=(\d{0,19})-(\d{0,19})\s*", value)
    if match and (match.group(1) or match.group(2)):
        first, last = match.group(1), match.group(2)
        if first:
            start, end = int(first), (min(int(last) + 1, size) if last else size)
        else:
            start, end = max(size - int(last), 0), size
        if start < end:
            return start, end
    raise HubError(416, None, f"Range Not Satisfiable: {value[:60]} of {size} bytes")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection's unexpected error: one line on stderr, never a traceback; a client gone:
        nothing."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, ConnectionError | TimeoutError):
            print(header_text(f"sparkspec: error: hub: {client_address[0]}: "
                              f"{exc.__class__.__name__}: {exc}"), file=sys.stderr, flush=True)


class HubServer:
    """Serve ``root`` on ``host:port`` (port 0 picks a free one); ``tokens`` turns on bearer-token
    checks."""

    handler: type[Handler] = Handler

    def __init__(self, root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0,
                 tokens: Iterable[str] | None = None, verbose: bool = False) -> None:
        self.root = Path(root).resolve()
        self.tokens = [t.encode("utf-8") for t in tokens or ()]
        self.verbose = verbose
        self.stats = ServerStats()
        self.repos = Repos(self.root, self.stats.hashed)
        self._httpd = _Server((host, port), self.handler)
        self._httpd.hub = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hubserver",
                                        daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def close(self) -> None:
        self._httpd.server_close()

    def stop(self) -> None:
        self._httpd.shutdown()
        self.close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def check_token(self, authorization: str | None) -> None:
        """Accept a ``Bearer`` token equal to one of ``tokens``: every token is compared, each in
        constant time, so the answer's timing tells nothing about how much of a guess was right."""
        if not self.tokens:
            return
        if not authorization:
            raise HubError(401, "RepoNotFound", "Invalid username or password.")
        scheme, _, token = authorization.partition(" ")
        given = token.strip().encode("latin-1", "replace")  # http.server decodes headers as latin-1
        match = False
        for accepted in self.tokens:
            match |= hmac.compare_digest(given, accepted)
        if scheme.lower() != "bearer" or not match:
            raise HubError(401, None, "Invalid credentials in Authorization header")

