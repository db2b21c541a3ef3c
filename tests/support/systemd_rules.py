"""systemd's parse-back rules (every version >= 249), written from systemd's sources and independent
of sparkspec.systemd: what systemd reads from a unit file (src/shared/conf-parser.c), an Exec line
(src/core/load-fragment.c config_parse_exec over src/basic/extract-word.c and escape.c's
cunescape_one), its % specifiers (src/shared/specifier.c), the $ expansion at exec time
(src/basic/env-util.c) and an environment file (src/basic/env-file.c). The tests quote a value,
parse the text back with these rules and compare with the record. Input these rules do not model, or
that systemd would refuse, ignore or change (an unknown escape, a specifier, $VAR, two commands on
one line), raises Refused."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WHITESPACE = " \t\n\r"
COMMENTS = "#;"
# read_line(): \n, \r, NUL and their pairs all end a line.
LINE_END = re.compile(r"\r\n|\n\r|\n|\r|\0")
EXEC_PREFIXES = "-@:+!"
SHELL_NEED_ESCAPE = '"\\`$'
SIMPLE_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                  "\\": "\\", '"': '"', "'": "'", "s": " "}


class Refused(ValueError):
    """systemd would refuse, drop or change this text (or these rules do not model it)."""


def unit_entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of every assignment, as config_parse() reads them: comments skipped
    (inside continuations too), a line ending in an unescaped backslash joined to the next with a
    space, key and value stripped of whitespace."""
    out: list[tuple[str, str, str]] = []
    section, continuation = "", None
    for raw in LINE_END.split(text):
        stripped = raw.lstrip(WHITESPACE)
        if stripped and stripped[0] in COMMENTS:
            continue
        line = raw if continuation is None else continuation + raw
        escaped = False
        for char in line:
            escaped = not escaped if char == "\\" else False
        if escaped:
            continuation = line[:-1] + " "
            continue
        continuation = None
        line = line.strip(WHITESPACE)
        if not line:
            continue
        if line.startswith("["):
            if not line.endswith("]"):
                raise Refused(f"bad section header {line!r}")
            section = line[1:-1]
            continue
        key, eq, value = line.partition("=")
        if not eq or not key.strip(WHITESPACE):
            raise Refused(f"not an assignment: {line!r}")
        out.append((section, key.strip(WHITESPACE), value.strip(WHITESPACE)))
    if continuation is not None:
        raise Refused("the file ends in a continuation")
    return out


def _cunescape_one(text: str, i: int) -> tuple[str, int]:
    """The character an escape after a backslash stands for, and how many characters it took."""
    c = text[i:i + 1]
    if c in SIMPLE_ESCAPES:
        return SIMPLE_ESCAPES[c], 1
    width = {"x": 2, "u": 4, "U": 8}.get(c)
    if width is not None:
        digits = text[i + 1:i + 1 + width]
        if len(digits) != width or not re.fullmatch(r"[0-9a-fA-F]+", digits):
            raise Refused(f"bad \\{c} escape")
        code = int(digits, 16)
        if code == 0 or (c == "x" and code >= 0x80) or 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            raise Refused(f"\\{c}{digits}: NUL, an 8-bit byte or not a character")
        return chr(code), 1 + width
    digits = text[i:i + 3]
    if re.fullmatch(r"[0-7]{3}", digits):
        code = int(digits, 8)
        if code == 0 or code >= 0x80:
            raise Refused(f"\\{digits}: NUL or an 8-bit byte")
        return chr(code), 3
    raise Refused(f"unknown escape \\{c}")


def extract_word(text: str, pos: int, *, cunescape: bool) -> tuple[str | None, int]:
    """extract_first_word(separators=whitespace, EXTRACT_UNQUOTE [|EXTRACT_CUNESCAPE]): the word
    from pos (None at the end) and where the next one starts. Quotes may open and close anywhere in
    a word; a backslash escapes inside quotes and out (without cunescape it keeps the next character
    as is)."""
    n = len(text)
    while pos < n and text[pos] in WHITESPACE:
        pos += 1
    if pos >= n:
        return None, n
    out: list[str] = []
    quote = ""
    while True:
        if pos >= n:
            if quote:
                raise Refused("unbalanced quoting")
            return "".join(out), n
        c = text[pos]
        if c == "\\":
            if pos + 1 >= n:
                raise Refused("a trailing backslash")
            if cunescape:
                char, used = _cunescape_one(text, pos + 1)
            else:
                char, used = text[pos + 1], 1
            out.append(char)
            pos += 1 + used
        elif quote:
            if c == quote:
                quote = ""
            else:
                out.append(c)
            pos += 1
        elif c in "'\"":
            quote = c
            pos += 1
        elif c in WHITESPACE:
            while pos < n and text[pos] in WHITESPACE:
                pos += 1
            return "".join(out), pos
        else:
            out.append(c)
            pos += 1


def specifiers(word: str) -> str:
    """specifier_printf(): %% is %, a stray % at the end stays; any other %X would be replaced."""
    out: list[str] = []
    i = 0
    while i < len(word):
        if word[i] == "%" and i + 1 < len(word):
            if word[i + 1] != "%":
                raise Refused(f"specifier %{word[i + 1]} would be replaced")
            i += 1
        out.append(word[i])
        i += 1
    return "".join(out)


def env_expand(word: str) -> str:
    """replace_env_argv() for one word, with no variable set: $$ is $; ${X} and a word that is $X
    would be replaced."""
    if word.startswith("$") and word[1:2] not in ("{", "$"):
        raise Refused(f"{word!r} would be replaced by a variable's words")
    out: list[str] = []
    i = 0
    while i < len(word):
        if word[i] == "$" and word[i + 1:i + 2] in ("$", "{"):
            if word[i + 1] == "{":
                raise Refused("${...} would be replaced by a variable")
            i += 1
        out.append(word[i])
        i += 1
    return "".join(out)


@dataclass
class ExecCommand:
    prefixes: str
    path: str
    # as systemd stores it (systemctl show): specifiers resolved, $ not yet expanded
    argv: list[str]

    def exec_argv(self) -> list[str]:
        """What the program gets (no ':' prefix: $ expanded)."""
        return self.argv if ":" in self.prefixes else [env_expand(w) for w in self.argv]


def exec_command(value: str) -> ExecCommand:
    """config_parse_exec() for a value holding one command."""
    first, pos = extract_word(value, 0, cunescape=True)
    if first is None or first == ";":
        raise Refused("no command")
    prefixes = ""
    while first[:1] and first[0] in EXEC_PREFIXES and first[0] not in prefixes.replace("!!", ""):
        if first.startswith("!!"):
            prefixes, first = prefixes + "!!", first[2:]
        else:
            prefixes, first = prefixes + first[0], first[1:]
    path = specifiers(first)
    if not path or re.search(r"[\x00-\x1f\x7f\"'\\]", path) or path.endswith("/"):
        raise Refused(f"executable {path!r}: empty, a special character or a folder")
    argv = [] if "@" in prefixes else [path]
    while pos < len(value):
        rest = value[pos:]
        if rest[0] == ";" and (len(rest) == 1 or rest[1] in WHITESPACE):
            raise Refused("a second command after ';'")
        if rest.startswith("\\;") and (len(rest) == 2 or rest[2] in WHITESPACE):
            argv.append(";")
            pos += 2
            while pos < len(value) and value[pos] in WHITESPACE:
                pos += 1
            continue
        word, pos = extract_word(value, pos, cunescape=True)
        if word is None:
            break
        argv.append(specifiers(word))
    return ExecCommand(prefixes, path, argv)


def simplified_path(path: str) -> str:
    """path_simplify_and_warn(PATH_CHECK_ABSOLUTE): absolute, no '..'; // and /./ folded."""
    if not path.startswith("/"):
        raise Refused(f"{path!r} is not absolute")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise Refused(f"{path!r} is not normalized")
    return "/" + "/".join(parts)


def path_list(value: str) -> list[str]:
    """ReadWritePaths=/ReadOnlyPaths=: words unquoted (no C escapes), '-' and '+' prefixes kept
    apart."""
    out: list[str] = []
    pos = 0
    while True:
        word, pos = extract_word(value, pos, cunescape=False)
        if word is None:
            return out
        prefix = ""
        for mark in "-+":
            if word.startswith(mark):
                prefix, word = prefix + mark, word[1:]
        out.append(prefix + simplified_path(specifiers(word)))


def raw_path(value: str) -> str:
    """WorkingDirectory=/EnvironmentFile=: the raw value, specifiers resolved, simplified ('-'
    kept)."""
    prefix = "-" if value.startswith("-") else ""
    return prefix + simplified_path(specifiers(value[len(prefix):]))


def env_file(text: str) -> dict[str, str]:
    """parse_env_file_internal(): NAME=value lines; 'single' and "double" quotes (inside double
    quotes only \\ " ` $ are escapes, any other backslash stays); an unquoted backslash escapes the
    next character; a comment line's backslash swallows the next character, a newline too (systemd <
    254)."""
    out: dict[str, str] = {}
    state, key, value, trailing = "PRE_KEY", "", "", 0
    for c in text + "\n":
        if state == "PRE_KEY":
            if c in COMMENTS:
                state = "COMMENT"
            elif c not in WHITESPACE:
                state, key = "KEY", c
        elif state == "KEY":
            if c in "\n\r":
                state, key = "PRE_KEY", ""
            elif c == "=":
                state, key, value = "PRE_VALUE", key.rstrip(WHITESPACE), ""
            else:
                key += c
        elif state in ("PRE_VALUE", "VALUE") and c in "\n\r":
            out[key] = value[:len(value) - trailing] if state == "VALUE" else value
            state, trailing = "PRE_KEY", 0
        elif state == "PRE_VALUE" and c in "'\"":
            state = "SINGLE" if c == "'" else "DOUBLE"
        elif state in ("PRE_VALUE", "VALUE") and c == "\\":
            state = "VALUE_ESCAPE"
        elif state == "PRE_VALUE" and c in WHITESPACE:
            pass
        elif state in ("PRE_VALUE", "VALUE"):
            state, value = "VALUE", value + c
            trailing = trailing + 1 if c in WHITESPACE else 0
        elif state == "VALUE_ESCAPE":
            state, trailing = "VALUE", 0
            value += "" if c == "\n" else c
        elif state == "SINGLE":
            state, value = ("PRE_VALUE", value) if c == "'" else ("SINGLE", value + c)
        elif state == "DOUBLE":
            state, value = ("PRE_VALUE", value) if c == '"' else \
                ("DOUBLE_ESCAPE", value) if c == "\\" else ("DOUBLE", value + c)
        elif state == "DOUBLE_ESCAPE":
            state = "DOUBLE"
            value += c if c in SHELL_NEED_ESCAPE else "" if c == "\n" else "\\" + c
        elif state == "COMMENT":
            state = "COMMENT_ESCAPE" if c == "\\" else "PRE_KEY" if c in "\n\r" else "COMMENT"
        else:  # COMMENT_ESCAPE
            state = "COMMENT"
    if state not in ("PRE_KEY", "COMMENT"):
        raise Refused(f"the file ends inside a value ({state})")
    if any("\0" in v for v in out.values()):
        raise Refused("a NUL in a value")
    return out


# ---- the real unit template, rendered in-process -------------------------------------------------

# (served_model_name, extra_args) for the unit template: hostile to systemd's lines, quotes,
# escapes, specifiers, $ expansion, ';' and command prefixes; each must reach vLLM exactly.
HOSTILE_RENDERS: list[tuple[str, list[str]]] = [
    ("plain", []),
    ("m%n $HOME 'q' \"d\" \\ ;",
     ["--tokenizer", "/opt/a b/%i", ";", "", "${X}", "\\;", "$$", "--x=a'b\"c\\"]),
    ("grüße ✓", ["--chat-template", "{{ x }}\t{% y %}", "+", "-", "@", "!"]),
    ("[Service]", ["--x", "line1\nExecStartPre=+/bin/sh\r\x1b[0m", "#", "--y=%%%", "\\x41"]),
]
_LOADER: list[bool] = []


def small_contract() -> dict[str, Any]:
    """A one-profile, plain-model contract (sparkspec_<key> values without the prefix), fresh each
    call."""
    return {"method": "baseline", "method_switch": "", "methods": {}, "profile": "p",
            "profiles": {"p": {"kind": "plain", "dir": "m", "served_model_name": "m",
                               "model": {"repo": "org/m", "revision": "a" * 40}}},
            "stage_profiles": ["p"], "models_dir": "/opt/models", "sources_dir": "/opt/models/s",
            "heads_dir": "/opt/models/h", "vllm_venv": "/opt/venvs/vllm"}


def render_unit(served_name: str, extra_args: list[str],
                venv: str = "/opt/venvs/vllm") -> tuple[str, list[str]]:
    """The deploy role's unit template rendered by Ansible's templating with the contract role's
    filters (in-process: no playbook, no host), for the registry's resolution of a small contract
    with a hostile served_model_name, extra_args and venv (set on the resolved host, past the
    schema, so the quoting alone must hold); and the argv the unit must run: the venv's python and
    vllm_command's arguments."""
    from sparkspec import registry

    resolved = registry.resolve(small_contract())
    resolved["venv"] = venv
    resolved["profile"]["served_model_name"] = served_name
    resolved["serve"]["extra_args"] = extra_args
    return render_resolved(resolved)


def render_resolved(resolved: dict[str, Any], template: str = "vllm.service.j2",
                    extra: dict[str, Any] | None = None) -> tuple[str, list[str]]:
    """The unit template rendered for a resolved host (:func:`render_unit`), and the argv vLLM's
    unit must run (``template``: another of the deploy role's templates, e.g. a Ray cluster's
    ray.service.j2)."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.plugins.loader import filter_loader, init_plugin_loader
    from ansible.template import Templar, trust_as_template

    from sparkspec import registry

    venv = resolved["venv"]
    vllm = registry.vllm_command(resolved, {"unit": "u", "bind_address": "127.0.0.1", "port": 8000,
                                            "user": "sparkspec"})
    argv = [f"{resolved['venv']}/bin/python", "-m", "vllm.entrypoints.openai.api_server",
            *vllm["args"]]
    cluster = resolved.get("cluster")
    entry = [f"{venv}/bin/vllm", "serve"]
    if cluster and cluster["ray"]:   # a Ray cluster's head: `vllm serve` with the Ray executor
        argv = [*entry, *vllm["args"]]
    elif cluster:   # `vllm serve` under sparkspec's peer check
        peers = [w for p in cluster["peers"] for w in ("--peer", p)]
        argv = ["/opt/venvs/tools/bin/sparkspec", "cluster", "supervise",
                "--rank", str(cluster["rank"]), "--listen", cluster["listen"], *peers,
                "--join-timeout", str(cluster["join_timeout"]),
                "--lost-after", str(cluster["lost_after"]), "--", *entry, *vllm["args"]]
    if not _LOADER:
        init_plugin_loader()
        filter_loader.add_directory(str(ROOT / "roles/sparkspec/filter_plugins"))
        _LOADER.append(True)
    variables = {
        "ansible_managed": "Ansible managed", "sparkspec_resolved": resolved,
        "sparkspec_user": "sparkspec", "sparkspec_unit_name": "sparkspec-vllm",
        "deploy_drop_page_cache": True, "_deploy_venv": venv, "_deploy_args": vllm["args"],
        "deploy_restart_sec": 10, "deploy_timeout_stop_sec": 90, "deploy_limit_nofile": 65536,
        "deploy_read_write_paths": ["/var/lib/sparkspec"], "sparkspec_models_dir": "/opt/models",
        "deploy_private_devices": False, "deploy_device_allow": ["char-nvidia* rw"],
        "deploy_address_families": ["AF_UNIX", "AF_INET"],
        "deploy_memory_deny_write_execute": False,
        "deploy_unit_extra": [] if cluster else ["LimitMEMLOCK=infinity"],
        "sparkspec_tools_venv": "/opt/venvs/tools", "_deploy_serve_entry": entry,
        "_deploy_ray_unit": "sparkspec-vllm-ray", "deploy_env": {}, "deploy_render_root": "",
        "deploy_render_show_secrets": False, "deploy_memory_guard": False, **(extra or {})}
    templates = ROOT / "roles/deploy/templates"
    loader = DataLoader()
    loader.set_basedir(str(templates))     # where {% include %} finds sandbox.j2
    source = (templates / template).read_text()
    return (str(Templar(loader=loader, variables=variables).template(trust_as_template(source))),
            argv)
