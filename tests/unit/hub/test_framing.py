"""The hub endpoint's request framing (RFC 9112, :mod:`sparkspec.hub.framing`), as raw bytes over a
socket to a real server: malformed request lines, header fields and body lengths are answered once
with their 4xx/5xx, ``Connection: close`` and the connection closed, and what follows them (a
smuggled request) is never answered; a body is always consumed, never read as the next request; a
body or head cut short is not answered. After each case a good request on a fresh connection is
answered, nothing under the root changed, and the server wrote no traceback."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkspec.hub.server import MAX_FORM_BYTES, Handler, HubServer
from tests.badinput import (
    fingerprint,
)
from tests.support.hubpublish import publish
from tests.unit.conftest import _small_repo
from tests.unit.hub.conftest import raw

# the smuggled request's answer: must never come back
CONFIG = b'{"model_type": "framing-secret-config"}\n'
GOOD = b"GET /api/models/org/tiny HTTP/1.1\r\nHost: hub\r\n\r\n"
LAST = b"GET /api/models/org/tiny HTTP/1.1\r\nHost: hub\r\nConnection: close\r\n\r\n"
SMUGGLED = b"GET /org/tiny/resolve/main/config.json HTTP/1.1\r\nHost: hub\r\n\r\n"
FORM = b"paths=config.json"


@dataclass
class Hub:
    server: HubServer
    root: Path
    port: int


@pytest.fixture(scope="module")
def module_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """One server for the module (stopping one takes up to half a second), serving org/tiny."""
    tmp = tmp_path_factory.mktemp("framing")
    (tmp / "src").mkdir()
    (tmp / "src" / "config.json").write_bytes(CONFIG)
    publish(tmp / "root", "org/tiny", tmp / "src")
    with HubServer(tmp / "root") as server:
        yield Hub(server, tmp / "root", int(server.url.rsplit(":", 1)[1]))


@pytest.fixture()
def hub(module_hub: Hub, capfd: pytest.CaptureFixture[str]) -> Iterator[Hub]:
    """The module's server; afterwards it still answers a good request, its root is unchanged and
    its stderr holds no traceback."""
    before = fingerprint(module_hub.root)
    yield module_hub
    assert [r[0] for r in responses(exchange(module_hub.port, LAST))] == [200]
    assert fingerprint(module_hub.root) == before
    assert capfd.readouterr().err == ""  # no traceback, nor any line: every refusal is the client's


def exchange(port: int, data: bytes, half_close: bool = False) -> bytes:
    """Send ``data`` and read until the server closes the connection (a server that keeps it open
    fails the test by timing out); ``half_close`` ends our side after sending, as a client that sent
    everything does."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


def responses(data: bytes, head: bool = False) -> list[tuple[int, dict[str, str], bytes]]:
    """The responses in ``data``, framed by their Content-Length (none for the answer to a HEAD)."""
    out = []
    while data:
        top, blank, data = data.partition(b"\r\n\r\n")
        assert blank and top.startswith(b"HTTP/1.1 "), top[:200]
        lines = top.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip()
                   for k, _, v in (line.partition(":") for line in lines[1:])}
        size = 0 if head else int(headers["content-length"])
        out.append((int(lines[0].split(" ")[1]), headers, data[:size]))
        data = data[size:]
    return out


def _req(line: bytes, *fields: bytes, body: bytes = b"") -> bytes:
    return line + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n" + body


_MODEL = b"GET /api/models/org/tiny HTTP/1.1"
_PATHS = b"POST /api/models/org/tiny/paths-info/main HTTP/1.1"
_HOST = b"Host: hub"
REFUSED = [
    # request line
    ("double space", _req(b"GET  /api/models/org/tiny HTTP/1.1", _HOST), 400),
    ("leading space", _req(b" " + _MODEL, _HOST), 400),
    ("trailing space", _req(_MODEL + b" ", _HOST), 400),
    ("tab separator", _req(b"GET\t/api/models/org/tiny HTTP/1.1", _HOST), 400),
    ("HTTP/0.9 simple request", b"GET /api/models/org/tiny\r\n", 400),
    ("no version", _req(b"GET /api/models/org/tiny ", _HOST), 400),
    *[(f"version {v!r}", _req(b"GET /api/models/org/tiny " + v, _HOST), 400)
      for v in (b"HTTP/2.0", b"HTTP/1.2", b"HTTP/0.9", b"http/1.1", b"HTTP/1.01", b"HTTP/01.1",
                b"HTTP/1", b"HTTP/1.1/", b"HTTPS/1.1")],
    ("bare CR separator", _req(b"GET /api/models/org/tiny\rHTTP/1.1", _HOST), 400),
    ("bare CR line end", b"GET /api/models/org/tiny HTTP/1.1\r\r\nHost: hub\r\n\r\n", 400),
    ("method not a token", _req(b"G@T /api/models/org/tiny HTTP/1.1", _HOST), 400),
    ("NUL in method", _req(b"GE\x00T /api/models/org/tiny HTTP/1.1", _HOST), 400),
    ("absolute-form", _req(b"GET http://hub/api/models/org/tiny HTTP/1.1", _HOST), 400),
    ("asterisk with GET", _req(b"GET * HTTP/1.1", _HOST), 400),
    ("relative target", _req(b"GET api/models/org/tiny HTTP/1.1", _HOST), 400),
    ("control in target", _req(b"GET /api/models/org/ti\x01ny HTTP/1.1", _HOST), 400),
    ("DEL in target", _req(b"GET /api/models/org/ti\x7fny HTTP/1.1", _HOST), 400),
    ("raw UTF-8 in target", _req(b"GET /api/models/org/caf\xc3\xa9 HTTP/1.1", _HOST), 400),
    ("OPTIONS *: not served", _req(b"OPTIONS * HTTP/1.1", _HOST), 501),
    ("PUT: not served",
     _req(b"PUT /org/tiny/resolve/main/config.json HTTP/1.1", _HOST, b"Content-Length: 0"), 501),
    ("request line too long", _req(b"GET /" + b"a" * 20_000 + b" HTTP/1.1", _HOST), 414),
    ("nine empty lines first", b"\r\n" * 9 + GOOD, 400),
    # header fields
    ("HTTP/1.1 without Host", _req(_MODEL), 400),
    ("two Host fields", _req(_MODEL, _HOST, b"Host: other"), 400),
    ("Host with a space", _req(_MODEL, b"Host: hub x"), 400),
    ("Host with a path", _req(_MODEL, b"Host: hub/x"), 400),
    ("space before the colon", _req(_MODEL, b"Host : hub"), 400),
    ("obs-fold", _req(_MODEL, _HOST, b"X-Note: a", b" folded"), 400),
    ("first field folded", _req(_MODEL, b" " + _HOST), 400),
    ("NUL in a value", _req(_MODEL, _HOST, b"X-Note: a\x00b"), 400),
    ("control in a value", _req(_MODEL, _HOST, b"X-Note: a\x1bb"), 400),
    ("DEL in a value", _req(_MODEL, _HOST, b"X-Note: a\x7fb"), 400),
    ("bare CR in a value", _req(_MODEL, _HOST, b"X-Note: a\rb"), 400),
    ("no colon", _req(_MODEL, b"Host hub"), 400),
    ("name not a token", _req(_MODEL, _HOST, b"X(Note): a"), 400),
    ("empty name", _req(_MODEL, _HOST, b": a"), 400),
    ("field too long", _req(_MODEL, _HOST, b"X-Note: " + b"a" * 20_000), 431),
    ("too many fields", _req(_MODEL, _HOST, *[b"X-N%d: a" % i for i in range(100)]), 431),
    ("head too large", _req(_MODEL, _HOST, *[b"X-N%d: " % i + b"a" * 10_000 for i in range(7)]),
     431),
    # bodies
    *[(f"Content-Length {v!r}", _req(_MODEL, _HOST, b"Content-Length: " + v), 400)
      for v in (b"abc", b"-1", b"+5", b"5, 5", b"0x10", b"1e3", b"", b"5 5")],
    ("two differing Content-Lengths",
     _req(_MODEL, _HOST, b"Content-Length: 1", b"Content-Length: 2"), 400),
    ("chunked", _req(_PATHS, _HOST, b"Transfer-Encoding: chunked", body=b"0\r\n\r\n"), 501),
    ("Transfer-Encoding and Content-Length",
     _req(_PATHS, _HOST, b"Transfer-Encoding: chunked", b"Content-Length: 5",
          body=b"0\r\n\r\n"), 400),
    ("Transfer-Encoding in HTTP/1.0", _req(b"POST /api/models/org/tiny/paths-info/main HTTP/1.0",
                                          b"Transfer-Encoding: chunked", body=b"0\r\n\r\n"), 400),
    ("paths-info over the form limit",
     _req(_PATHS, _HOST, b"Content-Length: %d" % (MAX_FORM_BYTES + 1)), 413),
    ("GET body over the limit",
     _req(_MODEL, _HOST, b"Content-Length: %d" % (MAX_FORM_BYTES + 1)), 413),
    ("Content-Length of 30 digits", _req(_MODEL, _HOST, b"Content-Length: " + b"9" * 30), 413),
]


@pytest.mark.parametrize(("data", "status"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_a_malformed_request_is_refused_once_and_closed(hub: Hub, data: bytes, status: int) -> None:
    """One answer with the status, ``Connection: close`` and the reason; the server closes (exchange
    reads to its end) and the request sent after it on the same connection is never answered."""
    reply = exchange(hub.port, data + SMUGGLED)
    got = responses(reply)
    assert [r[0] for r in got] == [status], reply[:300]
    headers, body = got[0][1], got[0][2]
    assert headers["connection"] == "close" and headers["x-error-message"]
    assert json.loads(body) == {"error": headers["x-error-message"]}
    assert CONFIG not in reply


def test_the_answer_to_a_refused_head_request_has_no_body(hub: Hub) -> None:
    reply = exchange(hub.port, _req(b"HEAD /api/models/org/tiny HTTP/1.1", _HOST, _HOST))
    assert reply.startswith(b"HTTP/1.1 400 ") and reply.endswith(b"\r\n\r\n")


ACCEPTED = [
    ("HTTP/1.0 without Host, closed", _req(b"GET /api/models/org/tiny HTTP/1.0"), [200]),
    ("HTTP/1.0 keep-alive", _req(b"GET /api/models/org/tiny HTTP/1.0", b"Connection: keep-alive"),
     [200, 200]),
    ("Connection: close", _req(_MODEL, _HOST, b"Connection: close"), [200]),
    ("bare LF line ends", b"GET /api/models/org/tiny HTTP/1.1\nHost: hub\n\n", [200, 200]),
    ("one empty line first", b"\r\n" + GOOD, [200, 200]),
    ("OWS, HTAB and obs-text in values",
     _req(_MODEL, b"Host:hub  ", b"X-Note: \ta\tcaf\xe9 \t"), [200, 200]),
    ("Host with a port", _req(_MODEL, b"Host: hub:8080"), [200, 200]),
    ("Host an IPv6 literal", _req(_MODEL, b"Host: [::1]:80"), [200, 200]),
    ("equal Content-Lengths",
     _req(_MODEL, _HOST, b"Content-Length: 3", b"Content-Length: 3", body=b"abc"), [200, 200]),
    ("Content-Length 000", _req(_MODEL, _HOST, b"Content-Length: 000"), [200, 200]),
    ("a GET's body is dropped",
     _req(_MODEL, _HOST, b"Content-Length: %d" % len(SMUGGLED), body=SMUGGLED), [200, 200]),
    ("a HEAD's body is dropped",
     _req(b"HEAD /org/tiny/resolve/main/nope HTTP/1.1", _HOST,
          b"Content-Length: %d" % len(SMUGGLED), body=SMUGGLED), [404, 200]),
    ("a POST's body is read where unused",
     _req(b"POST /api/models/org/nope/paths-info/main HTTP/1.1", _HOST,
          b"Content-Length: %d" % len(SMUGGLED), body=SMUGGLED), [404, 200]),
    ("paths-info", _req(_PATHS, _HOST, b"Content-Length: %d" % len(FORM), body=FORM), [200, 200]),
    ("an unknown path", _req(b"GET /nope HTTP/1.1", _HOST), [404, 200]),
]


@pytest.mark.parametrize(("data", "statuses"), [c[1:] for c in ACCEPTED],
                         ids=[c[0] for c in ACCEPTED])
def test_a_well_formed_request_is_answered_and_the_connection_kept_in_step(
        hub: Hub, data: bytes, statuses: list[int]) -> None:
    """The request, then a last one on the same connection: both answered in order (a body consumed,
    never read as a request), or only the first where the first asked to close."""
    reply = exchange(hub.port, data + LAST)
    if data.startswith(b"HEAD"):  # the answer to HEAD has no body: the next answer follows its head
        first, _, rest = reply.partition(b"\r\n\r\n")
        got = [*responses(first + b"\r\n\r\n", head=True), *responses(rest)]
    else:
        got = responses(reply)
    assert [r[0] for r in got] == statuses, reply[:400]
    assert CONFIG not in reply
    if len(statuses) == 2:
        assert json.loads(got[1][2])["id"] == "org/tiny"
        assert got[1][1]["connection"] == "close"


@pytest.mark.parametrize("data", [
    _req(_PATHS, _HOST, b"Content-Length: 100", body=FORM),  # body cut short
    _req(_MODEL, _HOST, b"Content-Length: 10", body=b"abc"),
    b"GET /api/models/org/tiny HTTP/1.1\r\nHost: hub\r\n",  # head cut short
    b"GET /api/models/org/tiny HTTP/1.1",
], ids=["paths-info body", "GET body", "head", "request line"])
def test_a_request_cut_short_is_not_answered(hub: Hub, data: bytes) -> None:
    assert exchange(hub.port, data, half_close=True) == b""


def test_expect_100_continue_is_answered_before_the_body(hub: Hub) -> None:
    with socket.create_connection(("127.0.0.1", hub.port), timeout=10) as sock:
        sock.sendall(_req(_PATHS, _HOST, b"Expect: 100-continue",
                          b"Content-Length: %d" % len(FORM)))
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(FORM + LAST)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    got = responses(reply)
    assert [r[0] for r in got] == [200, 200]
    assert [p["path"] for p in json.loads(got[0][2])] == ["config.json"]


# --- property: whatever the bytes, an answer only when well-formed --------------------------------
_TCHAR = rb"[!#$%&'*+.^_`|~0-9A-Za-z-]"
_WELL_FORMED = re.compile(  # written apart from sparkspec.hub.framing, from RFC 9112's grammar
    rb"(?:\r?\n){0,8}(GET|HEAD|POST) /[!-~]* HTTP/1\.([01])\r?\n"
    rb"((?:" + _TCHAR + rb"+:[\t -~\x80-\xff]*\r?\n)*)\r?\n")
BASES = [GOOD, LAST, _req(b"HEAD /org/tiny/resolve/main/config.json HTTP/1.1", _HOST),
         _req(_PATHS, _HOST, b"Content-Length: %d" % len(FORM), body=FORM),
         _req(b"GET /api/models/org/tiny HTTP/1.0")]
_SPECIAL = b" \t\r\n\x00\x01\x7f\x80\xff:/*?%#"


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request with one to four bytes inserted, deleted or replaced (often by a byte special
    to HTTP)."""
    data = bytearray(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        byte = draw(st.sampled_from(list(_SPECIAL)) | st.integers(0, 255))
        match draw(st.sampled_from(["insert", "delete", "replace"])):
            case "insert":
                data.insert(at, byte)
            case "delete":
                del data[at]
            case _:
                data[at] = byte
    return bytes(data)


def _well_formed(data: bytes) -> bool:
    match = _WELL_FORMED.match(data)
    if not match:
        return False
    fields = [line.split(b":", 1) for line in match.group(3).splitlines()]
    hosts = [v.strip(b" \t") for n, v in fields if n.lower() == b"host"]
    lengths = [v.strip(b" \t") for n, v in fields if n.lower() == b"content-length"]
    return (len(hosts) == 1 or (match.group(2) == b"0" and not hosts)) \
        and all(re.fullmatch(rb"[\w.~!$&'()*+,;=%:\[\]-]*", h) for h in hosts) \
        and len(set(lengths)) <= 1 and all(v.isdigit() for v in lengths) \
        and not any(n.lower() == b"transfer-encoding" for n, _ in fields)


_TCHARS = "!#$%&'*+.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ-"
_FRAMING_NAMES = {"host", "content-length", "transfer-encoding", "connection", "expect"}


@st.composite
def well_formed(draw: st.DrawFn) -> bytes:
    """A request RFC 9112 allows, drawn from its grammar: GET or HEAD of the model info with any
    visible query, HTTP/1.1 with one Host or HTTP/1.0 with at most one, other fields with any token
    name and any value of HTAB, visible ASCII and obs-text, each line ended by CRLF or a bare LF."""
    def end() -> bytes:
        return draw(st.sampled_from([b"\r\n", b"\n"]))

    method = draw(st.sampled_from([b"GET", b"HEAD"]))
    query = draw(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7e), max_size=20))
    version = draw(st.sampled_from([b"1.0", b"1.1"]))
    lines = [method + b" /api/models/org/tiny?" + query.encode() + b" HTTP/" + version]
    names = st.text(st.sampled_from(_TCHARS), min_size=1, max_size=12).filter(
        lambda n: n.lower() not in _FRAMING_NAMES)
    values = st.binary(max_size=30).map(
        lambda v: bytes(b for b in v if b == 9 or 0x20 <= b != 0x7f))
    fields = [n.encode() + b":" + v
              for n, v in draw(st.lists(st.tuples(names, values), max_size=6))]
    if version == b"1.1" or draw(st.booleans()):
        fields.insert(draw(st.integers(0, len(fields))), b"Host: " + draw(st.sampled_from(
            [b"hub", b"127.0.0.1:8080", b"[::1]", b"", b"a.b-c_d~e%41"])))
    return b"".join(line + end() for line in [*lines, *fields]) + end()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(well_formed())
def test_a_well_formed_request_is_answered_200(hub: Hub, data: bytes) -> None:
    reply = exchange(hub.port, data, half_close=True)
    assert reply.startswith(b"HTTP/1.1 200 "), (data, reply[:300])
    assert _well_formed(data)  # the oracle below agrees


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=120) | mutated() | well_formed())
def test_any_bytes_get_an_error_or_nothing_and_200_only_when_well_formed(hub: Hub,
                                                                         data: bytes) -> None:
    reply = exchange(hub.port, data, half_close=True)
    if not reply:
        return  # cut short: nothing to answer
    status = re.match(rb"HTTP/1\.1 ([1-5][0-9][0-9]) ", reply)
    assert status, reply[:200]
    if int(status.group(1)) < 400:
        assert _well_formed(data), (data, reply[:200])


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
