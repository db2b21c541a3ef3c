"""HTTP/1.1 request framing as RFC 9112 requires, for the hub's handler
(:mod:`sparkspec.hub.server`): :func:`read_head` reads one request's head strictly, or raises
:class:`FramingError` naming the status to answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

MAX_REQUEST_LINE = 16 * 1024  # bytes with the line end; nginx's default is 8 KiB
MAX_FIELD_LINE = 16 * 1024
MAX_HEAD = 64 * 1024  # every header field line together
MAX_FIELDS = 100
MAX_EMPTY_LINES = 8  # empty lines ignored before a request line (RFC 9112 §2.2: at least one)
VERSIONS = ("HTTP/1.0", "HTTP/1.1")

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 §5.6.2
_ORIGIN_FORM = re.compile(rb"/[\x21-\x7e]*")  # visible ASCII: no space, control or raw byte >= 0x80
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # controls but HTAB (obs-text 0x80-0xff ok)
# RFC 9110 §7.2
_HOST = re.compile(rb"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(:[0-9]*)?")
_DIGITS = re.compile(rb"[0-9]+")


class Lines(Protocol):
    def readline(self, size: int, /) -> bytes: ...


class FramingError(Exception):
    """A request the server answers with ``status`` and then closes the connection on."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message, self.method = status, message, ""


class Gone(Exception):
    """The client closed the connection in the middle of a request: nothing to answer."""


@dataclass(frozen=True)
class Head:
    method: str
    target: str
    version: str
    fields: list[tuple[str, str]]  # names and values as sent (latin-1 decoded, values without OWS)
    length: int  # the body's length in bytes (Content-Length, or 0)
    keep_alive: bool
    expect_continue: bool


def read_head(rfile: Lines) -> Head | None:
    """Read one request's line and header fields from ``rfile``; None when the client closed the
    connection before sending a byte of it. Raise :class:`FramingError` for a malformed head,
    :class:`Gone` for one cut short."""
    for empty in range(MAX_EMPTY_LINES + 1):
        line = _line(rfile, MAX_REQUEST_LINE, 414, "Request line too long", first=empty == 0)
        if line is None:
            return None
        if line:
            break
    else:
        raise FramingError(400, "Bad request: empty lines instead of a request line")
    method, target, version = _request_line(line)
    fields: list[tuple[str, str]] = []
    total = 0
    try:
        while field := _line(rfile, MAX_FIELD_LINE, 431, "Header field too long"):
            total += len(field)
            if total > MAX_HEAD or len(fields) >= MAX_FIELDS:
                raise FramingError(431, "Request header fields too large")
            fields.append(_field(field))
        return _frame(method, target, version, fields)
    except FramingError as err:
        err.method = method  # the answer to a HEAD has no body
        raise


def _line(rfile: Lines, limit: int, status: int, message: str, first: bool = False) -> bytes | None:
    """One line without its line end (CRLF or LF); None for end of input before a first line."""
    raw = rfile.readline(limit + 1)
    if len(raw) > limit:
        raise FramingError(status, message)
    if not raw.endswith(b"\n"):
        if first and not raw:
            return None
        raise Gone()
    line = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1]
    if b"\r" in line:
        raise FramingError(400, "Bad request: a bare CR")
    return line


def _request_line(line: bytes) -> tuple[str, str, str]:
    parts = line.split(b" ")
    if len(parts) != 3:
        raise FramingError(400, "Bad request line: not METHOD SP target SP HTTP-version")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise FramingError(400, "Bad request line: the method is not a token")
    if version.decode("latin-1") not in VERSIONS:
        raise FramingError(400, "Bad request line: HTTP-version is not HTTP/1.0 or HTTP/1.1")
    if not (_ORIGIN_FORM.fullmatch(target) or (target == b"*" and method == b"OPTIONS")):
        raise FramingError(400, "Bad request line: the target is not an absolute path")
    return method.decode("ascii"), target.decode("ascii"), version.decode("ascii")


def _field(line: bytes) -> tuple[str, str]:
    if line[:1] in (b" ", b"\t"):
        raise FramingError(400, "Bad header field: obsolete line folding")
    name, colon, value = line.partition(b":")
    if not colon or not _TOKEN.fullmatch(name):
        raise FramingError(400, "Bad header field: the name is not a token followed by a colon")
    value = value.strip(b" \t")
    if _BAD_VALUE.search(value):
        raise FramingError(400, "Bad header field: a control character in the value")
    return name.decode("ascii"), value.decode("latin-1")


def _frame(method: str, target: str, version: str, fields: list[tuple[str, str]]) -> Head:
    """The head's meaning for framing: Host, body length, whether the connection stays open."""
    def values(name: str) -> list[str]:
        return [v for n, v in fields if n.lower() == name]

    hosts = values("host")
    if len(hosts) > 1 or (version == "HTTP/1.1" and not hosts):
        raise FramingError(400, "Bad request: an HTTP/1.1 request needs exactly one Host field")
    if hosts and not _HOST.fullmatch(hosts[0].encode("latin-1")):
        raise FramingError(400, "Bad request: the Host field is not host[:port]")
    lengths = values("content-length")
    if values("transfer-encoding"):
        if lengths or version == "HTTP/1.0":
            raise FramingError(400, "Bad request: Transfer-Encoding with Content-Length or in "
                                    "HTTP/1.0")
        raise FramingError(501, "Transfer-Encoding is not supported; send a Content-Length")
    if any(not _DIGITS.fullmatch(v.encode("latin-1")) for v in lengths) or len(set(lengths)) > 1:
        raise FramingError(400, "Bad request: Content-Length is not one number")
    digits = lengths[0].lstrip("0") if lengths else ""
    # too many digits: refused as too large
    length = int(digits or "0") if len(digits) <= 18 else 1 << 62
    connection = {t.strip().lower() for v in values("connection") for t in v.split(",")}
    keep_alive = "close" not in connection and (version == "HTTP/1.1" or "keep-alive" in connection)
    expect = version == "HTTP/1.1" and [v.lower() for v in values("expect")] == ["100-continue"]
    return Head(method, target, version, fields, length, keep_alive, expect)
