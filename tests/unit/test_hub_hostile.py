"""The hub as a hostile user meets it: the endpoint's path handling (traversal by absolute, dot,
encoded and symlinked segments; header injection), ``fetch`` refusing outputs that would destroy
what it did not create, names and revisions from a mirror used in paths, and tokens kept off the
command line. Repos are laid out with the simulation's publisher (tests/support/hubpublish.py, whose
own tests are in test_hub_testbed.py).

Every refusal asserts the exact outcome: the HTTP status and that no byte of the secret file comes
back, or for a command exit 2 with one ``sparkspec: error:`` line and every input unchanged by
content hash."""

from __future__ import annotations

import http.client
import http.server
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkspec.hub.api import HubError, Repos, segments
from sparkspec.hub.server import Handler, HubServer
from tests.badinput import (
    Outcome,
    assert_refused,
    assert_unchanged,
    fingerprint,
    refused_untouched,
    run,
)
from tests.support.hubfaults import FaultyHub
from tests.support.hubpublish import publish
from tests.support.testckpt import ModelSpec, write_fp8, write_int4_autoround


def q(text: str) -> str:
    """Percent-encode every separator, as an attacker writes a segment."""
    return urllib.parse.quote(text, safe="")


def raw(url: str, method: str, path: str, body: bytes | None = None,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One request with ``path`` sent byte for byte (no client-side normalization of dots or
    escapes)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.delenv("SPARKSPEC_HUB_TOKENS", raising=False)


def _small_repo(path: Path, text: str = "tiny") -> Path:
    (path / "sub").mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": text}) + "\n")
    (path / "model.safetensors").write_bytes(b"\0" * 4096)
    (path / "sub" / "notes.txt").write_text("hello\n")
    return path


# --- the endpoint ---------------------------------------------------------------------------------
@pytest.fixture()
def hostile_root(tmp_path: Path) -> dict[str, Path]:
    """A hub root with one published repo and, beside it, a secret folder that must never be served;
    links inside the root point at the secret (a file, a folder, and a whole org)."""
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    secret = secret_dir / "secret.txt"
    secret.write_text(f"TOP-SECRET-{uuid.uuid4().hex}\n")
    root = tmp_path / "root"
    publish(root, "org/tiny", _small_repo(tmp_path / "src"))
    repo = root / "org" / "tiny"
    (repo / "leak.txt").symlink_to(secret)
    (repo / "linkdir").symlink_to(secret_dir)
    (root / "evil").symlink_to(tmp_path)
    return {"root": root, "secret": secret, "secret_dir": secret_dir, "tmp": tmp_path}


def _attacks(p: dict[str, Path]) -> list[tuple[str, str]]:
    sd, sf = str(p["secret_dir"]), str(p["secret"])
    return [
        ("GET", f"/x/{q(sd)}/resolve/main/secret.txt"),  # absolute repo segment
        ("HEAD", f"/x/{q(sd)}/resolve/main/secret.txt"),
        ("GET", f"/{q(sd)}/x/resolve/main/secret.txt"),
        ("GET", f"/api/models/x/{q(sd)}/tree/main"),  # the tree endpoint listing any folder
        ("GET", f"/api/models/x/{q(sd)}/tree/main?recursive=true"),
        ("GET", f"/api/models/x/{q(sd)}?blobs=true"),
        ("GET", f"/api/models/x/{q(sd)}/revision/main"),
        ("GET", "/org/tiny/resolve/main/leak.txt"),  # a symlinked file inside the repo
        ("GET", "/org/tiny/resolve/main/linkdir/secret.txt"),  # a symlinked folder inside the repo
        ("GET", "/api/models/org/tiny/tree/main/linkdir"),
        ("GET", "/evil/secret/resolve/main/secret.txt"),  # a symlinked org
        ("GET", "/api/models/evil/secret/tree/main"),
        ("GET", "/org/tiny/resolve/main/..%2F..%2F..%2Fsecret%2Fsecret.txt"),  # encoded traversal
        ("GET", f"/org/tiny/resolve/main/{q(sf)}"),  # encoded absolute file path
        ("GET", "/org/tiny/resolve/main/sub%5C..%5C..%5C..%5Csecret%5Csecret.txt"),  # backslashes
        ("GET", "/org/tiny/resolve/main/config.json%00.txt"),  # NUL
        ("GET", "/org/tiny/resolve/main/../../../secret/secret.txt"),  # raw dots
        ("GET", "/org/tiny/resolve/%2E%2E/x"),
        ("GET", "/org/%2E%2E/resolve/main/secret/secret.txt"),
        ("GET", "/api/models/org/tiny/tree/main/..%2F..%2F..%2Fsecret"),
        ("GET", f"/api/models/org/tiny/tree/main/{q(sd)}"),
        ("GET", "//org/tiny/resolve/main/config.json/../../../../secret/secret.txt"),
    ]


def test_endpoint_answers_hostile_paths_with_404_and_never_the_secret(
        hostile_root: dict[str, Path]) -> None:
    secret = hostile_root["secret"].read_bytes()
    with HubServer(hostile_root["root"]) as server:
        failures = []
        for method, path in _attacks(hostile_root):
            status, _, body = raw(server.url, method, path)
            # the secret's bytes, or any listing (a tree entry or a sibling) instead of an error
            leaked = secret.strip() in body or b'"size"' in body or b'"rfilename"' in body
            if status != 404 or leaked:
                failures.append(f"{method} {path}: {status} "
                                f"{'LEAKED ' if leaked else ''}{body[:80]!r}")
        # paths-info answers only the repo's own files
        status, _, body = raw(server.url, "POST", "/api/models/org/tiny/paths-info/main",
                              urllib.parse.urlencode({"paths": [
                                  "leak.txt", "linkdir", "../../secret/secret.txt",
                                  str(hostile_root["secret"])]}, doseq=True).encode(),
                              {"Content-Type": "application/x-www-form-urlencoded"})
        if status != 200 or json.loads(body) != []:
            failures.append(f"paths-info: {status} {body[:200]!r}")
        # the repo's own files are still served, and only those are listed
        status, _, body = raw(server.url, "GET", "/org/tiny/resolve/main/sub/notes.txt")
        assert (status, body) == (200, b"hello\n")
        status, _, body = raw(server.url, "GET", "/api/models/org/tiny/tree/main?recursive=true")
        listed = sorted(e["path"] for e in json.loads(body)) if status == 200 else []
        if listed != ["config.json", "model.safetensors", "sub", "sub/notes.txt"]:
            failures.append(f"tree lists {listed}")
    assert not failures, "\n".join(failures)


def test_endpoint_error_headers_cannot_be_injected(hostile_root: dict[str, Path]) -> None:
    with HubServer(hostile_root["root"]) as server:
        for path in ("/api/models/org/tiny/revision/x%0d%0aX-Injected:%201",
                     "/org/tiny/resolve/x%0d%0aX-Injected:%201/config.json",
                     "/org/tiny/resolve/main/nope%0d%0aX-Injected:%201"):
            status, headers, _ = raw(server.url, "GET", path)
            assert status == 404 and "x-injected" not in headers, (path, status, headers)


def test_hub_serve_takes_no_token_on_the_command_line(tmp_path: Path) -> None:
    """A token in argv is in every process list; the option is gone (run apart: a server that starts
    would never return)."""
    (tmp_path / "root").mkdir()
    try:
        proc = subprocess.run([sys.executable, "-m", "sparkspec.cli", "hub", "serve", "--root",
                               str(tmp_path / "root"), "--port", "0", "--token", "hf_in_argv"],
                              capture_output=True, text=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("hub serve accepted --token on the command line and started serving")
    assert_refused(Outcome(proc.returncode, proc.stdout, proc.stderr), 2,
                   "unrecognized arguments: --token")


# --- fetch ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("pair")
    write_int4_autoround(base / "int4", ModelSpec(), shards=2)
    write_fp8(base / "fp8", ModelSpec(), shards=2)
    return {"int4": base / "int4", "fp8": base / "fp8"}


@pytest.fixture()
def work(pair: dict[str, Path], tmp_path: Path) -> dict[str, Path]:
    """Private copies (a refused command must leave them as they were, byte for byte)."""
    for name in ("int4", "fp8"):
        shutil.copytree(pair[name], tmp_path / name)
    return {"int4": tmp_path / "int4", "fp8": tmp_path / "fp8", "tmp": tmp_path}


def _subset(w: dict[str, Path], dest: Path, *extra: str | Path) -> list[str | Path]:
    return ["fetch", "fp8-subset", "Qwen/tiny-FP8", "--revision", "main", "--int4", w["int4"],
            "--dest", dest, "--local-path", w["fp8"], *extra]


def test_fetch_refuses_a_dest_that_overlaps_an_input(work: dict[str, Path]) -> None:
    int4, fp8, tmp = work["int4"], work["fp8"], work["tmp"]
    roots = [int4, fp8]
    # the same folder for --dest and --int4 overwrote the INT4 shards and removed its extra tensors
    refused_untouched(_subset(work, int4), roots, match="--dest .* the input --int4")
    refused_untouched(_subset(work, int4 / "fp8"), roots, match="--dest .* the input --int4")
    refused_untouched(_subset(work, tmp), roots, match="--dest .* the input --int4")
    refused_untouched(_subset(work, fp8), roots, match="--dest .* the input --local-path")
    repo: list[str | Path] = ["fetch", "repo", "Qwen/tiny-FP8", "--revision", "main",
                              "--local-path", fp8, "--dest"]
    refused_untouched([*repo, fp8], roots, match="--dest .* the input --local-path")
    refused_untouched([*repo, fp8 / "copy"], roots, match="--dest .* the input --local-path")


def test_fetch_refuses_a_dest_it_did_not_create(work: dict[str, Path]) -> None:
    foreign = work["tmp"] / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text('{"mine": true}\n')
    (foreign / "old.safetensors").write_bytes(b"not the fetch's")
    roots = [work["int4"], work["fp8"], foreign]
    refused_untouched(_subset(work, foreign), roots, match="sparkspec fetch")
    refused_untouched(["fetch", "repo", "Qwen/tiny-FP8", "--revision", "main",
                       "--local-path", work["fp8"], "--dest", foreign], roots,
                      match="sparkspec fetch")
    link = work["tmp"] / "link"
    link.symlink_to(work["tmp"] / "elsewhere")
    refused_untouched(_subset(work, link), [*roots, link], match="symbolic link")


def test_fetch_never_uses_a_mirrors_revision_as_a_path(work: dict[str, Path]) -> None:
    (work["fp8"] / ".sparkspec-revision").write_text("../../../escaped\n")
    dest = work["tmp"] / "a" / "b" / "dest"
    refused_untouched(_subset(work, dest), [work["int4"], work["fp8"], work["tmp"] / "a"],
                      match="\\.sparkspec-revision")
    assert not list(work["tmp"].rglob("escaped"))


class _Rewriter(http.server.BaseHTTPRequestHandler):
    """A hostile mirror: relays a real endpoint but answers another commit id and adds file
    names."""

    protocol_version = "HTTP/1.1"
    upstream: str
    real: str
    fake: str
    extra: list[str]

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._relay()

    def do_HEAD(self) -> None:
        self._relay()

    def do_POST(self) -> None:
        self._relay()

    def _relay(self) -> None:
        path = self.path.replace(q(self.fake), self.real).replace(self.fake, self.real)
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if self.command == "POST" else None
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("range", "authorization",
                                                                           "content-type")}
        status, got, data = raw(self.upstream, self.command, path, body, headers)
        if got.get("content-type") == "application/json" and data:
            doc = json.loads(data.decode().replace(self.real, self.fake))
            if "/tree/" in path and isinstance(doc, list):
                doc += [{"type": "file", "oid": "0" * 40, "size": 10, "path": name}
                        for name in self.extra]
            data = json.dumps(doc).encode()
        self.send_response(status)
        for key, value in got.items():
            if key not in ("content-length", "connection", "date", "server", "transfer-encoding"):
                self.send_header(key, value.replace(self.real, self.fake))
        self.send_header("Content-Length", str(len(data)) if self.command != "HEAD"
                         else got.get("content-length", "0"))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


@pytest.fixture()
def mirror(work: dict[str, Path]) -> Iterator[type[_Rewriter]]:
    root = work["tmp"] / "hubroot"
    _, real, _ = publish(root, "Qwen/tiny-FP8", work["fp8"])
    with HubServer(root) as upstream:
        handler = type("Rewriter", (_Rewriter,), {"upstream": upstream.url, "real": real,
                                                  "fake": real, "extra": []})
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        handler.url = f"http://127.0.0.1:{httpd.server_address[1]}"  # type: ignore[attr-defined]
        try:
            yield handler
        finally:
            httpd.shutdown()
            httpd.server_close()


@pytest.mark.parametrize("fake, extra, match", [
    ("../../../escaped", [], "commit"),  # the mirror's commit id is used in the header cache's path
    (None, ["../../escaped.json"], "escaped.json"),  # a file name from the listing used as a path
    (None, ["/tmp/escaped.json"], "escaped.json"),
    (None, ["sub/../../escaped.json"], "escaped.json"),
])
def test_fetch_refuses_a_mirrors_names_that_are_paths(work: dict[str, Path],
                                                      mirror: type[_Rewriter], fake: str | None,
                                                      extra: list[str], match: str) -> None:
    mirror.fake = fake or mirror.real
    mirror.extra = extra
    dest = work["tmp"] / "a" / "b" / "dest"
    url = mirror.url  # type: ignore[attr-defined]
    for argv in (["fetch", "fp8-subset", "Qwen/tiny-FP8", "--revision", "main",
                  "--int4", work["int4"], "--dest", dest, "--endpoint", url],
                 ["fetch", "repo", "Qwen/tiny-FP8", "--revision", "main", "--dest", dest,
                  "--endpoint", url]):
        refused_untouched(argv, [work["int4"], work["fp8"], work["tmp"] / "a"], match=match)
    assert not list(work["tmp"].rglob("escaped*"))


# --- every flag of fetch repo|fp8-subset|plan and hub serve, with bad values ----------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, pair: dict[str, Path]) -> dict[str, Path]:
    """Inputs for the bad-value table; every row must leave all of them (and the absent ``out``) as
    they were, byte for byte."""
    base = tmp_path_factory.mktemp("world")
    root = base / "root"
    publish(root, "org/tiny", _small_repo(base / "src"))
    os.mkfifo(base / "fifo")
    (base / "empty").write_text("")
    (base / "two-tokens").write_text("hf_a hf_b\n")
    (base / "binary").write_bytes(b"\xff\xfe\x00hf")
    (base / "afile").write_text("a file\n")
    (base / "emptydir").mkdir()
    (base / "foreign").mkdir()
    (base / "foreign" / "mine.txt").write_text("not the fetch's\n")
    (base / "link").symlink_to(base / "emptydir")
    (root / "tokens").write_text("hf_in_root\n")
    (base / "token").write_text("hf_good\n")
    (base / "token").chmod(0o600)
    return {"base": base, "root": root, "src": base / "src", "repo": root / "org" / "tiny", **pair}


NUMBERS = ["nan", "inf", "-inf", "-1", "1e3", "1.5", "x", "99999999999999999999", ""]
REPO_IDS = ["org", "org/", "/etc/passwd", "org/..", "../x", "org/a/b", "org\\x/y", "org/na me",
            "o" * 97 + "/x", "org/x\n", "org/-x", "org/x.", "a--b/c"]
REVISIONS = ["", "../x", "main/../x", "a b", "x" * 200, "refs/pr/x", "main\n", "-"]
ENDPOINTS = ["ftp://h", "http://", "not a url", "http://user:pw@h", "http://h/\n", ""]


def _set(argv: list[str | Path], flag: str, value: str | Path) -> list[str | Path]:
    """``argv`` with ``flag`` given ``value`` (replaced, or added); flag "repo" is the
    positional."""
    out = list(argv)
    if flag == "repo":
        out[2] = value
    elif flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out


def _rows() -> list[Any]:
    """(command, flag, value, rc, regex): the value may name a path of ``world`` as {key}."""
    rows: list[tuple[str, str, str, str]] = []
    for cmd in ("repo", "fp8-subset", "plan"):
        rows += [(cmd, "repo", v, "argument repo: repo id .* is not org/name") for v in REPO_IDS]
        rows += [(cmd, "--revision", v,
                  "argument --revision: (revision .* is not a commit id|expected one)")
                 for v in REVISIONS]
        rows += [(cmd, "--endpoint", v,
                  "argument --endpoint: .*(not an http\\(s\\) URL|credentials)")
                 for v in ENDPOINTS]
        rows += [(cmd, "--token-file", "{base}/missing", "token file not found"),
                 (cmd, "--token-file", "{base}/emptydir", "not a regular file"),
                 (cmd, "--token-file", "{base}/fifo",
                  "not a regular file \\(a folder, FIFO or device\\)"),
                 (cmd, "--token-file", "{base}/empty", "token file is empty"),
                 (cmd, "--token-file", "{base}/two-tokens", "more than one token"),
                 (cmd, "--token-file", "{base}/binary", "not UTF-8"),
                 (cmd, "--token-file", "", "argument --token-file: '' is empty"),
                 (cmd, "--local-path", "{base}/missing", "--local-path .*missing: not a directory"),
                 (cmd, "--local-path", "{base}/afile", "--local-path .*afile: not a directory"),
                 (cmd, "--local-path", "", "argument --local-path: '' is empty"),
                 (cmd, "--json", "yes", "unrecognized arguments: \\(values\\)"),
                 (cmd, "--dest", "{base}/afile", "--dest .*afile: exists and is not a folder"),
                 (cmd, "--dest", "{base}/fifo", "--dest .*fifo: exists and is not a folder"),
                 (cmd, "--dest", "{base}/link", "--dest .*link is a symbolic link"),
                 (cmd, "--dest", "{base}/foreign",
                  "holds files that `sparkspec fetch` did not write"),
                 (cmd, "--dest", "{local}", "--dest .* is the input --local-path"),
                 (cmd, "--dest", "{local}/sub", "--dest .* is inside the input --local-path"),
                 (cmd, "--dest", "", "argument --dest: '' is empty"),
                 (cmd, "--token", "hf_in_argv", "unrecognized arguments: --token")]
    for cmd in ("repo", "plan"):
        rows += [(cmd, "--include", "", "argument --include: '' is empty")]
    rows += [("fp8-subset", "--int4", "{base}/missing", "index not found"),
             ("fp8-subset", "--int4", "{base}/emptydir", "index not found"),
             ("fp8-subset", "--int4", "{base}/afile", "index not found"),
             ("fp8-subset", "--int4", "", "argument --int4: '' is empty"),
             ("fp8-subset", "--int4", "{base}", "--dest .* is inside the input --int4"),
             ("fp8-subset", "--fp8-pattern", "(",
              "--fp8-pattern '\\(': not a valid regular expression"),
             ("fp8-subset", "--fp8-pattern", "", "argument --fp8-pattern: '' is empty"),
             ("fp8-subset", "--mode", "fast", "argument --mode: invalid choice"),
             ("fp8-subset", "--mode", "", "argument --mode: invalid choice")]
    rows += [("fp8-subset", "--retries", v, "argument --retries: ") for v in [*NUMBERS, "0", "101"]]
    rows += [("serve", "--port", v, "argument --port: ") for v in [*NUMBERS, "65536"]]
    rows += [("serve", "--root", "{base}/missing", "--root .*missing: not a directory"),
             ("serve", "--root", "{base}/afile", "--root .*afile: not a directory"),
             ("serve", "--root", "", "argument --root: '' is empty"),
             ("serve", "--host", "", "argument --host: '' is empty"),
             ("serve", "--host", "no such host!", "--host no such host! --port 0: cannot listen"),
             ("serve", "--host", "256.0.0.1", "--host 256.0.0.1 --port 0: cannot listen"),
             ("serve", "--host", "127.0.0.1\n", "argument --host: .* control character"),
             ("serve", "--token-file", "{base}/missing", "token file not found"),
             ("serve", "--token-file", "{base}/emptydir", "not a regular file"),
             ("serve", "--token-file", "{base}/fifo",
              "not a regular file \\(a folder, FIFO or device\\)"),
             ("serve", "--token-file", "{base}/empty", "holds no token"),
             ("serve", "--token-file", "{base}/binary", "is not UTF-8"),
             ("serve", "--token-file", "{base}/two-tokens", "a token holds a space"),
             ("serve", "--token-file", "{root}/tokens", "is inside --root"),
             ("serve", "--token-file", "", "argument --token-file: '' is empty"),
             ("serve", "--token", "hf_in_argv", "unrecognized arguments: --token"),
             ("serve", "--verbose", "yes", "unrecognized arguments: \\(values\\)")]
    return [pytest.param(*row, id=f"{row[0]} {row[1]} {row[2]!r:.40}") for row in rows]


def _argv(cmd: str, w: dict[str, Path]) -> list[str | Path]:
    out = w["base"] / "out"
    argvs: dict[str, list[str | Path]] = {
        "repo": ["fetch", "repo", "org/tiny", "--revision", "main", "--local-path", w["src"],
                 "--dest", out],
        "fp8-subset": ["fetch", "fp8-subset", "Qwen/tiny-FP8", "--revision", "main",
                       "--int4", w["int4"], "--local-path", w["fp8"], "--dest", out],
        "plan": ["fetch", "plan", "org/tiny", "--revision", "main", "--local-path", w["src"],
                 "--dest", out],
        "serve": ["hub", "serve", "--root", w["root"], "--host", "127.0.0.1", "--port", "0",
                  "--token-file", w["base"] / "token"],
    }
    return argvs[cmd]


@pytest.mark.parametrize("cmd, flag, value, match", _rows())
def test_every_flag_refuses_bad_values(world: dict[str, Path], cmd: str, flag: str, value: str,
                                       match: str) -> None:
    """One line ``sparkspec: error: ...`` naming the flag or the file, exit 2, nothing read into or
    written (every input and the absent output unchanged by content hash)."""
    paths = {k: str(v) for k, v in world.items()}
    paths["local"] = paths["fp8" if cmd == "fp8-subset" else "src"]
    argv = _set(_argv(cmd, world), flag, value.format(**paths))
    if cmd == "fp8-subset" and flag == "--int4" and value == "{base}":
        argv = _set(argv, "--dest", world["base"] / "out")
    roots = [world["base"], world["int4"], world["fp8"]] if cmd == "fp8-subset" else [world["base"]]
    outcome = refused_untouched(argv, roots, 2, match)
    if flag == "--token":  # a secret on a mistyped flag is not echoed either
        assert value not in outcome.stderr


# --- failures of machine and server: one line, exit 1 (2 for a read-only output), nothing left ----
def test_a_full_or_read_only_disk_is_one_line_and_leaves_nothing(
        tmp_path: Path, ckpt_tmpfs: Callable[..., Path]) -> None:
    src = _small_repo(tmp_path / "src")
    (src / "model.safetensors").write_bytes(os.urandom(3 << 20))
    full, read_only = ckpt_tmpfs("1m"), ckpt_tmpfs("16m", readonly=True)
    # a read-only output: the user's to fix (exit 2)
    refused_untouched(["fetch", "repo", "org/x", "--revision", "main", "--local-path", src,
                       "--dest", read_only / "dest"], [read_only, src], 2, "Read-only file system")
    refused_untouched(["fetch", "repo", "org/x", "--revision", "main", "--local-path", src,
                       "--dest", full / "dest"], [full, src], 2, "needs 3\\.0+ ?MiB free")


def test_a_server_gone_is_one_line_exit_1(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for cmd in ("repo", "plan"):
        argv = ["fetch", cmd, "org/x", "--revision", "main",
                "--endpoint", f"http://127.0.0.1:{port}"]
        refused_untouched([*argv, "--dest", tmp_path / "dest"], [tmp_path], 1,
                          "transfer failed \\(ConnectError\\)")


def test_a_failed_download_leaves_no_temp_or_lock_file(tmp_path: Path) -> None:
    root = tmp_path / "root"
    publish(root, "org/tiny", _small_repo(tmp_path / "src"))
    (root / "org" / "tiny" / "model.safetensors").unlink()
    (tmp_path / "src" / "model.safetensors").write_bytes(os.urandom(1 << 20))
    publish(root, "org/tiny", tmp_path / "src")
    dest = tmp_path / "dest"
    with FaultyHub(root) as server:
        server.cut("model.safetensors", after=4096, times=100)  # every attempt is cut
        fetch: list[str | Path] = ["fetch", "repo", "org/tiny", "--revision", "main", "--endpoint",
                                   server.url, "--dest", dest]
        # huggingface_hub reports its retries on the way; the outcome is one last line
        failed = run(*fetch)
        lines = failed.stderr.strip().splitlines()
        assert failed.rc == 1 and "Traceback" not in failed.stderr, failed.stderr
        assert [line for line in lines
                if line.startswith("sparkspec: error: ")] == lines[-1:], lines
        assert "transfer failed" in lines[-1]
        left = ([str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()]
                if dest.exists() else [])
        assert not [p for p in left if p.endswith((".lock", ".incomplete", ".part", ".tmp"))], left
        assert "model.safetensors" not in left
        server.heal()
        outcome = run(*fetch)  # the re-run completes it
        assert outcome.rc == 0, outcome.stderr
    assert ((dest / "model.safetensors").read_bytes()
            == (tmp_path / "src" / "model.safetensors").read_bytes())
    assert not [p for p in dest.rglob("*") if p.suffix in (".lock", ".incomplete", ".part", ".tmp")]


# --- properties: whatever the segments, the endpoint resolves nothing outside its root ------------
SEGMENT = st.one_of(st.sampled_from(["org", "tiny", "evil", "secret", "secret.txt", "leak.txt",
                                     "linkdir", "fifo", "config.json", "sub", "notes.txt", "..",
                                     ".", "", "/", "\\", "\0", "\n", "%2F", "%2e%2e", "%00", "%5C",
                                     "/etc/passwd", ".sparkspec-hashes.json", ".sparkspec-revision",
                                     "resolve", "main"]),
                    st.text(max_size=10))
# names that exist in the maze, drawn often enough that most examples get past the repo lookup
KNOWN_REPOS = [("org", "tiny")] * 5 + [("evil", "secret"), ("org", ".."), ("org", "%2E%2E")]
KNOWN_FILES = ["config.json", "model.safetensors", "sub/notes.txt", "sub", "leak.txt",
               "linkdir/secret.txt", "fifo", ".sparkspec-hashes.json", ".sparkspec-revision",
               "sub/../config.json", "../tiny/config.json"]
REPO = st.integers(0, 2).flatmap(lambda i: st.sampled_from(KNOWN_REPOS) if i < 2 else
                                 st.tuples(SEGMENT, SEGMENT))
REL = st.integers(0, 2).flatmap(lambda i: st.sampled_from(KNOWN_FILES) if i < 2 else
                                st.lists(SEGMENT, min_size=1, max_size=4).map("/".join))


@pytest.fixture(scope="module")
def maze(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A root with a published repo holding a link to a secret outside, a link to the secret's
    folder and a FIFO; an org that is a link out of the root; the server on it."""
    base = tmp_path_factory.mktemp("maze")
    (base / "secret").mkdir()
    (base / "secret" / "secret.txt").write_text(f"TOP-SECRET-{uuid.uuid4().hex}\n")
    root = base / "root"
    publish(root, "org/tiny", _small_repo(base / "src"))
    repo = root / "org" / "tiny"
    (repo / "leak.txt").symlink_to(base / "secret" / "secret.txt")
    (repo / "linkdir").symlink_to(base / "secret")
    os.mkfifo(repo / "fifo")
    (root / "evil").symlink_to(base)
    with HubServer(root) as server:
        yield {"root": root.resolve(),
               "secret": (base / "secret" / "secret.txt").read_bytes().strip(),
               "server": server, "repo": repo}


@settings(max_examples=400, deadline=None)
@given(repo=REPO, rel=REL)
def test_resolution_never_leaves_the_root_nor_opens_a_non_regular_file(
        maze: dict[str, Any], repo: tuple[str, str], rel: str) -> None:
    org, name = repo
    repos = Repos(maze["root"], lambda n: None)
    try:
        fd, st_ = repos.open(repos.snapshot(org, name, "main"), rel)
    except HubError as err:
        assert err.status == 404
        return
    try:
        assert stat.S_ISREG(st_.st_mode)
        assert Path(os.readlink(f"/proc/self/fd/{fd}")).is_relative_to(maze["root"])
        assert maze["secret"] not in os.pread(fd, 1 << 16, 0)
    finally:
        os.close(fd)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(SEGMENT, st.text()), max_size=8))
def test_request_segments_are_refused_or_plain(parts: list[str]) -> None:
    for target in ("/" + "/".join(q(p) for p in parts), "/" + "/".join(parts)):
        try:
            got = segments(target)
        except HubError as err:
            assert err.status == 404
            continue
        for p in got:
            assert (p not in ("", ".", "..") and not set(p) & {"/", "\\", "\x7f"}
                    and min(p) >= " "), p


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["resolve", "tree", "info"]), repo=REPO, rel=REL)
def test_hostile_http_requests_never_get_the_secret(maze: dict[str, Any], kind: str,
                                                    repo: tuple[str, str], rel: str) -> None:
    seg = [urllib.parse.quote(x, safe="/.") for x in (*repo, rel)]
    path = {"resolve": f"/{seg[0]}/{seg[1]}/resolve/main/{seg[2]}",
            "tree": f"/api/models/{seg[0]}/{seg[1]}/tree/main/{seg[2]}?recursive=true",
            "info": f"/api/models/{seg[0]}/{seg[1]}/revision/main?blobs=true"}[kind]
    status, _, body = raw(maze["server"].url, "GET", path)
    assert status in (200, 404), (path, status)
    assert maze["secret"] not in body
    if status == 200 and kind == "resolve":  # only a file of the repo, byte for byte
        assert body == (maze["repo"] / urllib.parse.unquote(seg[2])).read_bytes()
    if status == 200 and kind != "resolve":
        names = [e.get("path") or e.get("rfilename") for e in
                 (json.loads(body) if kind == "tree" else json.loads(body)["siblings"])]
        assert set(names) <= {"config.json", "model.safetensors", "sub", "sub/notes.txt"}, names


# --- follow-ups: what a hostile tester found after the first round --------------------------------
def test_endpoint_serves_only_published_folders_and_no_dot_files(tmp_path: Path) -> None:
    """``hub serve --root /`` must not make /home/al a repo: a folder without the serve marker is
    not found and nothing is written into it; in a repo, names starting with '.' (but
    .gitattributes) are never served nor listed."""
    root = tmp_path / "root"
    publish(root, "org/tiny", _small_repo(tmp_path / "src"))
    repo = root / "org" / "tiny"
    (repo / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (repo / ".env").write_text("SECRET=1\n")
    (repo / "sub" / ".hidden").write_text("hidden\n")
    (repo / ".ssh").mkdir()
    (repo / ".ssh" / "id_rsa").write_text("REPO KEY\n")
    home = root / "home" / "al"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("PRIVATE KEY\n")
    (home / "notes.txt").write_text("mine\n")
    before = fingerprint(home)
    with HubServer(root) as server:
        for path in ("/home/al/resolve/main/.ssh/id_rsa", "/home/al/resolve/main/notes.txt",
                     "/api/models/home/al", "/api/models/home/al?blobs=true",
                     "/api/models/home/al/tree/main?recursive=true", "/org/tiny/resolve/main/.env",
                     "/org/tiny/resolve/main/sub/.hidden", "/org/tiny/resolve/main/.ssh/id_rsa",
                     "/api/models/org/tiny/tree/main/.ssh"):
            status, _, body = raw(server.url, "GET", path)
            assert status == 404 and b"KEY" not in body and b"SECRET" not in body, \
                (path, status, body[:80])
        status, _, body = raw(server.url, "GET", "/org/tiny/resolve/main/.gitattributes")
        assert (status, body) == (200, b"*.safetensors filter=lfs\n")
        status, _, body = raw(server.url, "GET", "/api/models/org/tiny/tree/main?recursive=true")
        assert sorted(e["path"] for e in json.loads(body)) == [
            ".gitattributes", "config.json", "model.safetensors", "sub", "sub/notes.txt"]
        status, _, body = raw(server.url, "GET", "/api/models/org/tiny?blobs=true")
        assert sorted(s["rfilename"] for s in json.loads(body)["siblings"]) == [
            ".gitattributes", "config.json", "model.safetensors", "sub/notes.txt"]
    assert_unchanged(before, home)


def _serve_refused(argv: list[str | Path], env: dict[str, str], match: str) -> None:
    """``hub serve`` run apart (a server that starts never returns): refused at once, one line."""
    try:
        proc = subprocess.run([sys.executable, "-m", "sparkspec.cli", "hub", "serve", "--port", "0",
                               *map(str, argv)], capture_output=True, text=True, timeout=15,
                              check=False, env={**os.environ, **env})
    except subprocess.TimeoutExpired:
        pytest.fail(f"hub serve {argv} with {env} started serving")
    assert_refused(Outcome(proc.returncode, proc.stdout, proc.stderr), 2, match)


@pytest.mark.parametrize("value", [",,", " ", "\n", "", " , \n ,"])
def test_hub_serve_refuses_a_token_variable_that_yields_no_token(tmp_path: Path,
                                                                 value: str) -> None:
    (tmp_path / "root").mkdir()
    _serve_refused(["--root", tmp_path / "root"], {"SPARKSPEC_HUB_TOKENS": value},
                   "SPARKSPEC_HUB_TOKENS.*no token")


def test_token_files_readable_by_everyone_are_refused(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    token = tmp_path / "token"
    token.write_text("hf_good\n")
    token.chmod(0o644)
    _serve_refused(["--root", tmp_path / "root", "--token-file", token], {}, "token.*chmod 600")
    src = _small_repo(tmp_path / "src")
    refused_untouched(["fetch", "plan", "org/tiny", "--revision", "main", "--local-path", src,
                       "--token-file", token], [tmp_path], 2, "token.*chmod 600")


def test_http_framing_is_strict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty segments and a slash after a file name are 404; a chunked body is refused and the
    connection closed (what follows it is never read as a second request); a half-sent request is
    dropped."""
    root = tmp_path / "root"
    publish(root, "org/tiny", _small_repo(tmp_path / "src"))
    with HubServer(root) as server:
        for path in ("//org/tiny/resolve/main/config.json", "/org//tiny/resolve/main/config.json",
                     "/org/tiny/resolve/main//config.json", "/org/tiny/resolve/main/config.json/",
                     "/org/tiny/resolve/main/sub/notes.txt/", "/api/models//org/tiny"):
            status, _, _ = raw(server.url, "GET", path)
            assert status == 404, (path, status)
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /api/models/org/tiny/paths-info/main HTTP/1.1\r\nHost: x\r\n"
                         b"Transfer-Encoding: chunked\r\n"
                         b"Content-Type: application/x-www-form-urlencoded\r\n"
                         b"\r\n0\r\n\r\n"
                         b"GET /org/tiny/resolve/main/config.json HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        assert data.split(b" ", 2)[1] in (b"400", b"501") and data.count(b"HTTP/1.1 ") == 1, \
            data[:200]
    assert Handler.timeout <= 30
    monkeypatch.setattr(Handler, "timeout", 1)
    with HubServer(root) as server:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /org/tiny/resolve/main/config.json HTTP/1.1\r\nHost:")
            assert sock.recv(65536) == b""  # closed by the server, not by our 10 s timeout


@pytest.mark.parametrize("value", ["http://127.0.0.1:1\nX", "javascript:alert(1)", "ftp://h",
                                   "http://u:p@h"])
def test_hf_endpoint_from_the_environment_is_checked_like_the_flag(tmp_path: Path,
                                                                   value: str) -> None:
    refused_untouched(["fetch", "plan", "org/x", "--revision", "main"], [tmp_path], 2,
                      "HF_ENDPOINT", env={"HF_ENDPOINT": value})


@pytest.mark.parametrize("value", ["ключ", "hf_a b", "hf_\x01"])
def test_hf_token_from_the_environment_must_be_visible_ascii(tmp_path: Path, value: str) -> None:
    out = refused_untouched(["fetch", "plan", "org/x", "--revision", "main", "--endpoint",
                             "http://127.0.0.1:1"],
                            [tmp_path], 2, "HF_TOKEN", env={"HF_TOKEN": value})
    assert value not in out.stderr
