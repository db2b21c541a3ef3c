"""Where a fetch reads from (sparkspec.hub.source): a mirror's names and revisions never used as
paths, a server gone, tokens from files and the environment."""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkspec.hub.server import HubServer
from tests.badinput import (
    refused_untouched,
)
from tests.support.hubpublish import publish
from tests.unit.conftest import _serve_refused, _small_repo
from tests.unit.hub.conftest import _subset, q, raw

# The hub as a hostile user meets it: the endpoint's path handling (traversal by absolute, dot,
# encoded and symlinked segments; header injection), ``fetch`` refusing outputs that would destroy
# what it did not create, names and revisions from a mirror used in paths, and tokens kept off the
# command line. Repos are laid out with the simulation's publisher (tests/support/hubpublish.py,
# whose own tests are in tests/unit/support/test_hub_testbed.py).
#
# Every refusal asserts the exact outcome: the HTTP status and that no byte of the secret file comes
# back, or for a command exit 2 with one ``sparkspec: error:`` line and every input unchanged by
# content hash.


@pytest.mark.usefixtures("_quiet")
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


@pytest.mark.usefixtures("_quiet")
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


@pytest.mark.usefixtures("_quiet")
def test_a_server_gone_is_one_line_exit_1(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for cmd in ("repo", "plan"):
        argv = ["fetch", cmd, "org/x", "--revision", "main",
                "--endpoint", f"http://127.0.0.1:{port}"]
        refused_untouched([*argv, "--dest", tmp_path / "dest"], [tmp_path], 1,
                          "transfer failed \\(ConnectError\\)")


@pytest.mark.usefixtures("_quiet")
def test_token_files_readable_by_everyone_are_refused(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    token = tmp_path / "token"
    token.write_text("hf_good\n")
    token.chmod(0o644)
    _serve_refused(["--root", tmp_path / "root", "--token-file", token], {}, "token.*chmod 600")
    src = _small_repo(tmp_path / "src")
    refused_untouched(["fetch", "plan", "org/tiny", "--revision", "main", "--local-path", src,
                       "--token-file", token], [tmp_path], 2, "token.*chmod 600")


@pytest.mark.usefixtures("_quiet")
@pytest.mark.parametrize("value", ["ключ", "hf_a b", "hf_\x01"])
def test_hf_token_from_the_environment_must_be_visible_ascii(tmp_path: Path, value: str) -> None:
    out = refused_untouched(["fetch", "plan", "org/x", "--revision", "main", "--endpoint",
                             "http://127.0.0.1:1"],
                            [tmp_path], 2, "HF_TOKEN", env={"HF_TOKEN": value})
    assert value not in out.stderr
