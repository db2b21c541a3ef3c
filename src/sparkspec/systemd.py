"""Quoting for the places a value lands in a systemd unit or its environment file: one function per
place.

Each returns the text systemd (every version >= 249) reads back as exactly the value, or raises
UserError (one line naming the value's variable and the fix) for what that place cannot carry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NoReturn

from sparkspec.errors import UserError

# Words that need no quotes once % and $ are doubled (what systemd's unit generators leave bare).
SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# The prefixes config_parse_exec strips from the first word, after unquoting.
EXEC_PREFIXES = "@-:+!"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
UNIT_LINE = re.compile(r"[A-Za-z]+=.*")
PATH_MAX, NAME_MAX = 4096, 255
_SPAN = r"[0-9]+(\.[0-9]+)?(us|ms|s|min|h|d|w)?"
# setting_value's kinds: the pattern the whole value must match, what it is, and the fix.
SETTINGS: Mapping[str, tuple[re.Pattern[str], str, str]] = {
    "user": (re.compile(r"[a-z_][a-z0-9_-]{0,31}"),
             "a system user name (lowercase letters, digits, '_-')", "fix it"),
    "device": (re.compile(r"((char|block)-[A-Za-z0-9_*?:+-][A-Za-z0-9_.*?:+-]*"
                          r"|/dev(/[A-Za-z0-9_:+-][A-Za-z0-9_.:+-]*)+)( [rwm]{1,3})?"),
               "a DeviceAllow= entry (char-NAME, block-NAME or /dev/PATH, then r, w, m)",
               "write e.g. 'char-nvidia* rw' or '/dev/nvidia0 rw'"),
    "address_family": (re.compile(r"AF_[A-Z0-9]+"), "a socket family name (AF_UNIX, AF_INET, ...)",
                       "write the AF_ name"),
    "timespan": (re.compile(rf"{_SPAN}( {_SPAN})*|infinity"), "a time span (e.g. 10, 90s, 2min)",
                 "give seconds or a number with us, ms, s, min, h, d or w"),
    "rlimit": (re.compile(r"([0-9]+|infinity)(:([0-9]+|infinity))?"),
               "a number, infinity or SOFT:HARD",
               "set it to e.g. 65536, or null for the service's default"),
    "integer": (re.compile(r"[0-9]+"), "a non-negative integer", "give a number"),
}


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(name: str | None, problem: str, fix: str) -> NoReturn:
    raise UserError(f"{name or 'the value'}: {problem}; {fix}")


def _text(value: object, name: str | None, what: str) -> str:
    """The value as text: a string or a number (not a bool, which YAML makes of a bare yes/true)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        _fail(name, f"{type(value).__name__} value",
              "give a string or a number (quote true/false to mean the word)")
    text = str(value)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        _fail(name, f"{what} holds a lone surrogate, which is not UTF-8", "fix the text")
    return text


def _no_controls(text: str, name: str | None, what: str, fix: str = "remove it") -> None:
    if (m := CONTROL.search(text)) is not None:
        _fail(name, f"{what} holds the control character {m.group()!r}, which would end or bend "
                    "the unit's line", fix)


def _no_continuation(text: str, name: str | None, what: str) -> None:
    if text.endswith("\\"):
        _fail(name, f"{what} ends in a backslash, which would join the file's next line to it",
              "remove it")


def _quote(text: str, escape_controls: bool) -> str:
    """A single-quoted word: backslash and quote escaped (and control characters as \\xNN for Exec
    lines, whose words systemd C-unescapes)."""
    out = []
    for char in text:
        if char in "\\'":
            out.append("\\" + char)
        elif escape_controls and CONTROL.fullmatch(char):
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(char)
    return "'" + "".join(out) + "'"


def _absolute(text: str, name: str | None, what: str) -> None:
    """Absolute and in the form systemd simplifies paths to (no //, /./, /../, trailing /)."""
    if not text.startswith("/"):
        _fail(name, f"{what} {_show(text)} is not an absolute path", "give it from /")
    parts = text[1:].split("/") if text != "/" else []
    if any(part in ("", ".", "..") for part in parts):
        _fail(name, f"{what} {_show(text)} is not a normalised path (no empty, '.' or '..' "
                    "components, no trailing /)", "write it as the plain absolute path")
    if len(text.encode()) >= PATH_MAX or any(len(part.encode()) > NAME_MAX for part in parts):
        _fail(name, f"{what} is longer than a path may be ({PATH_MAX} bytes, {NAME_MAX} a name)",
              "shorten it")


def word(value: object, name: str | None = None) -> str:
    """One argument of an Exec line after the first: any text but NUL reaches the program as is."""
    text = _text(value, name, "the argument")
    if "\0" in text:
        _fail(name, "the argument holds a NUL character, which no command line can carry",
              "remove it")
    text = text.replace("%", "%%").replace("$", "$$")
    return text if SAFE.fullmatch(text) else _quote(text, escape_controls=True)


def executable(value: object, name: str | None = None) -> str:
    """The first word of an Exec line: an absolute, normalised path that systemd runs as written."""
    text = _text(value, name, "the executable")
    if text[:1] and text[0] in EXEC_PREFIXES:
        _fail(name, f"the executable {_show(text)} starts with {text[0]!r}, a prefix systemd "
                    "strips after unquoting ('+' would run it as root outside the sandbox)",
              "give the absolute path alone")
    _no_controls(text, name, "the executable")
    if (bad := set(text) & set("\"'\\$")):
        _fail(name, f"the executable {_show(text)} holds {''.join(sorted(bad))!r}, which systemd "
                    "refuses in (or expands into) a command's path", "use a path without it")
    _absolute(text, name, "the executable")
    if text == "/":
        _fail(name, "the executable '/' is a folder", "give the program's path")
    text = text.replace("%", "%%")
    return text if SAFE.fullmatch(text) else _quote(text, escape_controls=False)


def _path(value: object, name: str | None) -> str:
    """An absolute, normalised path without control characters (every path setting's rule)."""
    text = _text(value, name, "the path")
    _no_controls(text, name, "the path")
    _absolute(text, name, "the path")
    return text


def path_list_item(value: object, name: str | None = None) -> str:
    """One path of ReadWritePaths=/ReadOnlyPaths= (quoted words, no C escapes, then specifiers)."""
    text = _path(value, name).replace("%", "%%")
    return text if SAFE.fullmatch(text) else _quote(text, escape_controls=False)


def path(value: object, name: str | None = None) -> str:
    """A single-path setting taken raw (WorkingDirectory=, EnvironmentFile=, which also globs)."""
    text = _path(value, name)
    if text != text.rstrip() or set(text) & set("*?[\\"):
        _fail(name, f"the path {_show(text)} ends in a space or holds a glob or escape character",
              "rename it")
    return text.replace("%", "%%")


def text(value: object, name: str | None = None) -> str:
    """Free text inside a setting's value (Description=, SyslogIdentifier=): specifiers escaped."""
    out = _text(value, name, "the text")
    _no_controls(out, name, "the text")
    _no_continuation(out, name, "the text")
    if out != out.strip():
        _fail(name, f"the text {_show(out)} starts or ends with a space, which systemd strips",
              "trim it")
    return out.replace("%", "%%")


def comment(value: object, name: str | None = None) -> str:
    """Text on a comment line of a unit or environment file (nothing is resolved there)."""
    out = _text(value, name, "the text")
    _no_controls(out, name, "the text")
    _no_continuation(out, name, "the text")
    return out


def setting_value(value: object, kind: str, name: str | None = None) -> str:
    """A single-token setting of a known kind (SETTINGS): the value as written, or refused."""
    pattern, what, fix = SETTINGS[kind]
    shown = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
    if not (isinstance(shown, str) and pattern.fullmatch(shown)):
        raise UserError(f"{name or 'the value'} {_show(value)} is not {what}; {fix}")
    return shown


def unit_line(value: object, name: str | None = None) -> str:
    """A verbatim line of the unit (deploy_unit_extra): Key=value, one line, no continuation."""
    if not isinstance(value, str):
        _fail(name, f"{type(value).__name__} value", "give the line as a string, Key=value")
    _no_controls(value, name, f"the line {_show(value)}", "write one line per item")
    if not UNIT_LINE.fullmatch(value):
        _fail(name, f"{_show(value)} is not Key=value with a key of letters",
              "write e.g. LimitMEMLOCK=infinity")
    _no_continuation(value, name, "the line")
    return value


def env_name(value: object, name: str | None = None) -> str:
    """A variable name in an environment file."""
    if not (isinstance(value, str) and ENV_NAME.fullmatch(value)):
        _fail(name, f"{_show(value)} is not a variable name (letters, digits, '_'; not starting "
                    "with a digit)", "rename it")
    return value


def env_value(value: object, name: str | None = None) -> str:
    """A value in an environment file: double-quoted with the four characters systemd unescapes
    there escaped. Newline, CR and NUL are refused. The value itself is never shown (it may be a
    secret)."""
    out = _text(value, name, "the value")
    if "\n" in out or "\r" in out:
        _fail(name, "the value holds a newline, which an environment or config file cannot carry",
              "remove it")
    if "\0" in out:
        _fail(name, "the value holds a NUL character, which no environment can carry", "remove it")
    for char in ("\\", '"', "`", "$"):
        out = out.replace(char, "\\" + char)
    return f'"{out}"'
