"""A small Hugging Face Hub-compatible endpoint that serves local directories (tests, the simulated Spark,
air-gapped mirrors).

Layout: ``ROOT/<org>/<name>/<files>``; a repo's revision is the 40-hex commit id in
``ROOT/<org>/<name>/.sparkspec-revision`` or, without that file, one derived from the files' content.
``main`` and that commit id are the only revisions. Endpoints are exactly those huggingface_hub 2.4 calls for
``model_info``/``repo_info``, ``list_repo_tree``, ``get_paths_info``, ``hf_hub_download``,
``snapshot_download`` and ``HfFileSystem``: ``GET /api/models/{repo}[/revision/{rev}]``,
``GET /api/models/{repo}/tree/{rev}[/{path}]``, ``POST /api/models/{repo}/paths-info/{rev}`` and
``HEAD|GET /{repo}/resolve/{rev}/{path}`` (ETag, X-Repo-Commit, Content-Length, single ``Range`` -> 206).
Errors carry the hub's ``X-Error-Code``/``X-Error-Message`` headers so huggingface_hub raises its own
exception types. olah 0.5.4 was checked first: its local-mirror path answers a ranged GET with the whole file
(200) and reads whole files into memory, so it cannot carry the ranged FP8 fetch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import threading
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

from sparkspec.hubrepo import (CHUNK, COMMIT_RE, REVISION_FILE, RepoFile, content_revision, repo_revision,
                               scan_repo)

@dataclass
class ServerStats:
    """What the server sent: file body bytes per ``org/name/path`` and every request line (for tests)."""

    file_bytes: Counter[str] = field(default_factory=Counter)
    body_bytes: int = 0
    requests: list[tuple[str, str, str | None, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.file_bytes.clear()
            self.body_bytes = 0
            self.requests.clear()


@dataclass
class Cut:
    """Fault for tests of interrupted transfers: the next ``times`` responses for a path that reach ``after``
    body bytes are cut there (connection closed mid-body)."""

    path_suffix: str
    after: int
    times: int


class HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.hub.verbose:
            super().log_message(format, *args)

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def send_response(self, code: int, message: str | None = None) -> None:
        # recorded before anything is sent, so a client that has its answer sees the record
        with self.server.hub.stats.lock:
            self.server.hub.stats.requests.append((self.command, urllib.parse.urlsplit(self.path).path,
                                                   self.headers.get("Range"), code))
        super().send_response(code, message)

    def _dispatch(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        try:
            self.server.hub.check_token(self.headers.get("Authorization"))
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                self._api(method, parts[2] + "/" + parts[3], parts[4:], url.query)
            elif len(parts) >= 5 and parts[2] == "resolve" and method in ("HEAD", "GET"):
                self._resolve(method, parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]))
            else:
                raise HubError(404, None, "Not Found")
        except HubError as err:
            headers = {"X-Error-Message": err.message}
            if err.code:
                headers["X-Error-Code"] = err.code
            if err.commit:
                headers["X-Repo-Commit"] = err.commit
            self._send(err.status, json.dumps({"error": err.message}).encode(), headers, method)

    def _send(self, status: int, body: bytes, headers: dict[str, str], method: str,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if method != "HEAD":
            with self.server.hub.stats.lock:
                self.server.hub.stats.body_bytes += len(body)
            self.wfile.write(body)

    def _api(self, method: str, repo_id: str, rest: list[str], query: str) -> None:
        hub = self.server.hub
        if not rest and method == "GET":
            rest = ["revision", "main"]
        if len(rest) < 2:
            raise HubError(404, None, "Not Found")
        kind, revision = rest[0], rest[1]
        directory, files, commit = hub.snapshot(repo_id, revision)
        doc: Any
        if kind == "revision" and method == "GET":
            blobs = urllib.parse.parse_qs(query).get("blobs", ["false"])[0].lower() == "true"
            doc = hub.model_info(repo_id, directory, files, commit, blobs)
        elif kind == "tree" and method == "GET":
            recursive = urllib.parse.parse_qs(query).get("recursive", ["false"])[0].lower() == "true"
            doc = hub.tree(files, "/".join(rest[2:]), recursive, commit)
        elif kind == "paths-info" and method == "POST":
            length = int(self.headers.get("Content-Length") or 0)
            form = urllib.parse.parse_qs(self.rfile.read(length).decode())
            doc = hub.paths_info(files, form.get("paths", []))
        else:
            raise HubError(404, None, "Not Found")
        self._send(200, json.dumps(doc).encode(), {"X-Repo-Commit": commit}, method)

    def _resolve(self, method: str, repo_id: str, revision: str, rel: str) -> None:
        hub = self.server.hub
        directory, files, commit = hub.snapshot(repo_id, revision)
        entry = files.get(rel)
        if entry is None:
            raise HubError(404, "EntryNotFound", f"{rel} does not exist on \"{revision}\"", commit)
        start, end, status = 0, entry.size, 200
        headers = {"ETag": f'"{entry.etag}"', "X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if entry.lfs:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(entry.size)
        wanted = self.headers.get("Range")
        if wanted:
            start, end = _parse_range(wanted, entry.size)
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{entry.size}"
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()
        if method == "GET":
            self._stream(directory / rel, f"{repo_id}/{rel}", start, end)

    def _stream(self, path: Path, key: str, start: int, end: int) -> None:
        hub = self.server.hub
        cut = hub.find_cut(key)
        stop = min(end, start + cut.after) if cut is not None else end
        with open(path, "rb") as fh:
            fh.seek(start)
            while start < stop and (chunk := fh.read(min(CHUNK, stop - start))):
                with hub.stats.lock:  # counted before sending: a client that has the bytes sees the count
                    hub.stats.file_bytes[key] += len(chunk)
                    hub.stats.body_bytes += len(chunk)
                try:
                    self.wfile.write(chunk)
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    self.close_connection = True
                    return
                start += len(chunk)
        if cut is not None and stop < end:  # the fault: drop the connection mid-body
            hub.spend_cut(cut)
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True


def _parse_range(value: str, size: int) -> tuple[int, int]:
    """A single ``bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` range as [start, end); else 416."""
    match = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", value)
    if match and (match.group(1) or match.group(2)):
        first, last = match.group(1), match.group(2)
        if first:
            start, end = int(first), (min(int(last) + 1, size) if last else size)
        else:
            start, end = max(size - int(last), 0), size
        if start < end:
            return start, end
    raise HubError(416, None, f"Range Not Satisfiable: {value} of {size} bytes")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer


class HubServer:
    """Serve ``root`` on ``host:port`` (port 0 picks a free one); ``tokens`` turns on bearer-token checks."""

    def __init__(self, root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 0,
                 tokens: list[str] | None = None, verbose: bool = False) -> None:
        self.root = Path(root)
        self.tokens = set(tokens or [])
        self.verbose = verbose
        self.stats = ServerStats()
        self.cuts: list[Cut] = []
        self._httpd = _Server((host, port), _Handler)
        self._httpd.hub = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.socket.getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hubserver", daemon=True)
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

    def cut(self, path_suffix: str, after: int, times: int = 1) -> None:
        with self.stats.lock:
            self.cuts.append(Cut(path_suffix, after, times))

    def find_cut(self, key: str) -> Cut | None:
        with self.stats.lock:
            return next((c for c in self.cuts if c.times > 0 and key.endswith(c.path_suffix)), None)

    def spend_cut(self, cut: Cut) -> None:
        with self.stats.lock:
            cut.times -= 1

    def check_token(self, authorization: str | None) -> None:
        if not self.tokens:
            return
        if not authorization:
            raise HubError(401, "RepoNotFound", "Invalid username or password.")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or token.strip() not in self.tokens:
            raise HubError(401, None, "Invalid credentials in Authorization header")

    def snapshot(self, repo_id: str, revision: str) -> tuple[Path, dict[str, RepoFile], str]:
        org, _, name = repo_id.partition("/")
        directory = self.root / org / name
        if not org or not name or ".." in (org, name) or not directory.is_dir():
            raise HubError(404, "RepoNotFound", "Repository not found")
        files = scan_repo(directory)
        commit = repo_revision(directory, files)
        if revision not in ("main", commit):
            raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return directory, files, commit

    @staticmethod
    def model_info(repo_id: str, directory: Path, files: dict[str, RepoFile], commit: str,
                   blobs: bool) -> dict[str, Any]:
        siblings: list[dict[str, Any]] = []
        for entry in files.values():
            sibling: dict[str, Any] = {"rfilename": entry.path}
            if blobs:
                sibling.update(size=entry.size, blobId=entry.blob_id)
                if entry.lfs:
                    sibling["lfs"] = {"sha256": entry.sha256, "size": entry.size, "pointerSize": 134}
            siblings.append(sibling)
        return {"_id": commit[:24], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
                "sha": commit, "private": False, "gated": False, "disabled": False, "downloads": 0,
                "likes": 0, "tags": [], "siblings": siblings,
                "usedStorage": sum(f.size for f in files.values())}

    @staticmethod
    def tree(files: dict[str, RepoFile], prefix: str, recursive: bool, commit: str) -> list[dict[str, Any]]:
        base = prefix.strip("/") + "/" if prefix.strip("/") else ""
        if base and not any(rel.startswith(base) for rel in files):
            raise HubError(404, "EntryNotFound", f"{prefix} does not exist", commit)
        out: list[dict[str, Any]] = []
        folders: set[str] = set()
        for rel, entry in files.items():
            if not rel.startswith(base):
                continue
            rest = rel[len(base):].split("/")
            for depth in range(1, len(rest)):
                folder = base + "/".join(rest[:depth])
                if folder not in folders and (recursive or depth == 1):
                    folders.add(folder)
                    out.append({"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                "size": 0, "path": folder})
            if recursive or len(rest) == 1:
                out.append(entry.tree_entry())
        return out

    @staticmethod
    def paths_info(files: dict[str, RepoFile], paths: list[str]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for path in paths:
            path = path.strip("/")
            if path in files:
                out.append(files[path].tree_entry())
            elif any(rel.startswith(path + "/") for rel in files):
                out.append({"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0,
                            "path": path})
        return out


def publish(root: str | os.PathLike[str], repo_id: str, source: str | os.PathLike[str],
            revision: str | None = None) -> tuple[bool, str, dict[str, RepoFile]]:
    """Copy ``source`` in as ``root/<repo_id>`` (atomic swap) and set its revision; return
    (changed, revision, files). Unchanged content and revision: a no-op."""
    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name or ".." in (org, name):
        raise ValueError(f"repo id {repo_id!r} is not org/name")
    if revision is not None and not COMMIT_RE.fullmatch(revision):
        raise ValueError(f"revision {revision!r} is not a 40-hex commit id")
    src = Path(source)
    wanted = scan_repo(src)
    new_revision = revision or content_revision(wanted)
    target = Path(root) / org / name
    if target.is_dir():
        current = scan_repo(target)
        same = {k: (v.size, v.sha256) for k, v in current.items()} == {
            k: (v.size, v.sha256) for k, v in wanted.items()}
        if same and repo_revision(target, current) == new_revision:
            return False, new_revision, current
    staging = target.with_name(f".{name}.publishing")
    if staging.exists():
        shutil.rmtree(staging)
    for rel in wanted:
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / rel, staging / rel)
    (staging / REVISION_FILE).write_text(new_revision + "\n")
    old = target.with_name(f".{name}.old")
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    if old.exists():
        shutil.rmtree(old)
    return True, new_revision, scan_repo(target)
