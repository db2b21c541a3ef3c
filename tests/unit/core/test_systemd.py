"""sparkspec.systemd: each quoting function's output parses back by systemd's own rules
(tests/support/systemd_rules.py) to exactly the value, or is refused in one line; then the real unit
template, rendered in-process, carries exactly vLLM's argv."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ansible.errors import AnsibleError
from hypothesis import given, settings
from hypothesis import strategies as st

from sparkspec import systemd
from sparkspec.errors import UserError
from tests.support import systemd_rules as rules

ROOT = Path(__file__).resolve().parents[3]
TEMPLATES = ROOT / "roles/deploy/templates"
VAR = "some_var"
HOSTILE = ["plain", "", " ", "a b", "a\tb", "two\nlines", "cr\rhere", "nul\x00here", "%n", "%%",
           "100%", "%", "$HOME", "${X}", "$$", "$", "a$b", "'", '"', "it's \"q\"", "\\", "a\\",
           "\\n", "\\;", ";", "a;b", "+/bin/sh", "-/bin/sh", "@/bin/sh", "!/bin/sh", ":/bin/sh",
           "!!x", "grüße ✓", "\u2028", "\x7f", "\x1b[31m", "\ud800", "#x", "[Service]",
           "/opt/a b/c", "/opt/%i/$x", "/a/../b", "/a//b", "/a/", "rel/x", "/", "x" * 300, 42,
           True, None]
ST_TEXT = st.text(st.sampled_from(list(" \t\n\r\x00\\'\"$%;{}#=+-@!:/.\x7fé✓")) | st.characters(),
                  max_size=24)


def _exec(line: str) -> rules.ExecCommand:
    [(_, key, value)] = rules.unit_entries(line)
    assert key == "ExecStart"
    return rules.exec_command(value)


def _one(line: str) -> str:
    [(_, _, value)] = rules.unit_entries(line)
    return value


# function -> (how the templates place its output, what systemd must read back for the value)
CONTEXTS: dict[str, tuple[Callable[..., str], Callable[[str], Any], Callable[[Any], Any]]] = {
    "word": (systemd.word, lambda q: _exec(f"ExecStart=/usr/bin/prog {q} --end").exec_argv(),
             lambda v: ["/usr/bin/prog", str(v), "--end"]),
    "executable": (systemd.executable, lambda q: (lambda c: (c.prefixes, c.path, c.exec_argv()))(
        _exec(f"ExecStart={q} -m x")), lambda v: ("", v, [v, "-m", "x"])),
    "path_list_item": (systemd.path_list_item,
                       lambda q: rules.path_list(_one(f"ReadOnlyPaths=-{q} {q}")),
                       lambda v: ["-" + v, v]),
    "path": (systemd.path, lambda q: rules.raw_path(_one(f"WorkingDirectory={q}")), lambda v: v),
    "text": (systemd.text, lambda q: (rules.specifiers(_one(f"Description=vLLM {q} (m) by x")),
                                      rules.specifiers(_one(f"SyslogIdentifier={q}"))),
             lambda v: (f"vLLM {v} (m) by x", str(v))),
    "comment": (systemd.comment, lambda q: (rules.unit_entries(f"# a {q} b\n[S]\nA=1\n"),
                                            rules.env_file(f"# a {q} b\nA=\"1\"\n")),
                lambda v: ([("S", "A", "1")], {"A": "1"})),
    "env_value": (systemd.env_value, lambda q: rules.env_file(f"# c\nNAME={q}\nNEXT=\"x\"\n"),
                  lambda v: {"NAME": str(v), "NEXT": "x"}),
    "unit_line": (systemd.unit_line, lambda q: rules.unit_entries(f"[Service]\n{q}\nUser=x\n")[-1],
                  lambda v: ("Service", "User", "x")),
}


def _check(kind: str, value: Any) -> str:
    """The value placed by the function for ``kind`` parses back exactly, or is refused in one line:
    the outcome's name, for the tables' expectations."""
    quote, place, expect = CONTEXTS[kind]
    try:
        quoted = quote(value, VAR)
    except UserError as exc:
        message = str(exc)
        assert "\n" not in message and "\r" not in message and message.startswith(VAR), message
        assert exc.exit_code == 2
        return "refused"
    assert "\n" not in quoted and "\r" not in quoted and "\0" not in quoted, quoted
    assert place(quoted) == expect(value), (value, quoted)
    return "exact"


@pytest.mark.parametrize("kind", sorted(CONTEXTS))
@pytest.mark.parametrize("value", HOSTILE, ids=[repr(v)[:20] for v in HOSTILE])
def test_hostile_values_are_refused_in_one_line_or_read_back_exactly(kind, value):
    assert _check(kind, value) in ("refused", "exact")


@pytest.mark.parametrize(
    ("kind", "value", "outcome"),
    [
        ("word", "", "exact"), ("word", ";", "exact"), ("word", "\\;", "exact"),
        ("word", "$HOME", "exact"), ("word", "${X}", "exact"), ("word", "%n", "exact"),
        ("word", "two\nlines", "exact"), ("word", "nul\x00here", "refused"),
        ("word", "\ud800", "refused"), ("word", True, "refused"),
        ("executable", "+/bin/sh", "refused"), ("executable", "-/bin/sh", "refused"),
        ("executable", "@/bin/sh", "refused"), ("executable", "!/bin/sh", "refused"),
        ("executable", ":/bin/sh", "refused"), ("executable", "/a/../b", "refused"),
        ("executable", "/opt/a b/c", "exact"), ("executable", "/opt/%i/x", "exact"),
        ("executable", "/opt/$x", "refused"), ("executable", "rel/x", "refused"),
        ("path_list_item", "/opt/a b/c", "exact"), ("path_list_item", "/a//b", "refused"),
        ("path_list_item", "/", "exact"), ("path_list_item", "/x/two\nlines", "refused"),
        ("text", "%n", "exact"), ("text", "a\\", "refused"), ("text", " a", "refused"),
        ("text", "two\nlines", "refused"), ("comment", "a\\", "refused"),
        ("comment", "%n", "exact"), ("env_value", "$HOME `x` \\ \"", "exact"),
        ("env_value", "two\nlines", "refused"), ("env_value", "cr\rhere", "refused"),
        ("env_value", "nul\x00here", "refused"), ("unit_line", "LimitMEMLOCK=infinity", "exact"),
        ("unit_line", "A=b\nExecStartPre=+/bin/sh", "refused"),
        ("unit_line", "Exec-Start=x", "refused"), ("unit_line", "A=b\\", "refused"),
    ],
)
def test_the_rules_that_matter(kind, value, outcome):
    assert _check(kind, value) == outcome


@pytest.mark.parametrize(
    ("quote", "value", "reason"),
    [
        (systemd.executable, "+/bin/sh",
         "starts with '+', a prefix systemd strips after unquoting"),
        (systemd.executable, "/opt/a/../b", "is not a normalised path"),
        (systemd.executable, "/opt/it's",
         "which systemd refuses in (or expands into) a command's path"),
        (systemd.word, "a\x00b", "the argument holds a NUL character"),
        (systemd.path_list_item, "var/lib", "is not an absolute path"),
        (systemd.path, "/etc/x*.env", "holds a glob or escape character"),
        (systemd.text, "a\rb", "holds the control character '\\r'"),
        (systemd.unit_line, "Exec Start=x", "is not Key=value with a key of letters"),
        (systemd.env_value, "sk-secret\n", "the value holds a newline"),
        (systemd.env_name, "A-B", "is not a variable name"),
    ],
)
def test_refusals_name_the_variable_and_the_reason(quote, value, reason):
    with pytest.raises(UserError) as info:
        quote(value, VAR)
    message = str(info.value)
    assert message.startswith(f"{VAR}: ") and reason in message and "\n" not in message, message
    assert "sk-secret" not in message   # an environment value may be a secret: never shown


@pytest.mark.parametrize(
    ("kind", "value", "outcome"),
    [
        ("device", "char-nvidia* rw", "char-nvidia* rw"),
        ("device", "/dev/infiniband/rdma_cm rw", None), ("device", "char-x rwx", "refused"),
        ("device", "/dev/../etc/passwd rw", "refused"),
        ("device", "char-x\nExecStartPre=+/bin/sh", "refused"),
        ("address_family", "AF_INET6", None), ("address_family", "AF_INET AF_PACKET", "refused"),
        ("address_family", "~AF_INET", "refused"), ("timespan", 10, "10"),
        ("timespan", "90s", None), ("timespan", "1min 30s", None),
        ("timespan", "10\nExecStartPre=x", "refused"), ("timespan", True, "refused"),
        ("rlimit", 65536, "65536"), ("rlimit", "1024:infinity", None), ("rlimit", "%n", "refused"),
        ("user", "sparkspec", None), ("user", "root; rm", "refused"), ("integer", -1, "refused"),
    ],
)
def test_single_token_settings_pass_verbatim_or_are_refused(kind, value, outcome):
    try:
        written = systemd.setting_value(value, kind, VAR)
    except UserError as exc:
        assert outcome == "refused" and str(exc).startswith(f"{VAR} ") and "\n" not in str(exc)
        return
    assert written == (outcome or value)
    assert rules.unit_entries(f"[Service]\nX={written}\n") == [("Service", "X", written)]
    assert rules.specifiers(written) == written


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(set(CONTEXTS) - {"executable", "path_list_item", "path"})),
       value=ST_TEXT)
def test_random_text_is_refused_or_read_back_exactly(kind, value):
    _check(kind, value)


SEGMENT = st.text(st.sampled_from(list("ab %$'\"\\;.é\t")) | st.characters(), min_size=1,
                  max_size=8)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["executable", "path_list_item", "path"]),
       value=st.lists(SEGMENT, min_size=1, max_size=4).map(lambda parts: "/" + "/".join(parts))
             | ST_TEXT)
def test_random_paths_are_refused_or_read_back_exactly(kind, value):
    _check(kind, value)


@settings(max_examples=100, deadline=None)
@given(words=st.lists(ST_TEXT, max_size=6))
def test_a_random_command_line_reads_back_as_the_same_argv(words):
    # a NUL or a lone surrogate (not UTF-8) is refused by systemd.word (_check covers the refusals)
    kept = [w for w in words if "\0" not in w and not any(0xD800 <= ord(c) <= 0xDFFF for c in w)]
    line = "ExecStart=/usr/bin/prog " + " ".join(systemd.word(w) for w in kept)
    assert _exec(line).exec_argv() == ["/usr/bin/prog", *kept]


# ---- the real unit template, in-process (tests/support/systemd_rules.render_unit) ----------------

@pytest.mark.parametrize(("served_name", "extra_args"), rules.HOSTILE_RENDERS,
                         ids=[f"render{i}" for i in range(len(rules.HOSTILE_RENDERS))])
def test_the_unit_template_carries_vllms_argv_exactly(served_name, extra_args):
    unit, argv = rules.render_unit(served_name, extra_args)
    entries = rules.unit_entries(unit)
    [exec_start] = [v for s, k, v in entries if (s, k) == ("Service", "ExecStart")]
    command = rules.exec_command(exec_start)
    assert command.prefixes == "" and command.path == argv[0]
    assert command.exec_argv() == argv
    [description] = [v for s, k, v in entries if k == "Description"]
    assert rules.specifiers(description) == f"vLLM {served_name} (baseline) by sparkspec"
    assert [k for s, k, v in entries if s == "Service"][-1] == "LimitMEMLOCK"


def test_the_unit_restarts_a_killed_main_process_and_an_engine_death():
    """systemd restarts what a signal or a non-zero exit ended, and vLLM's exit 0 after its engine
    died (test_deploy kills the engine on sim01; a killed main process is this line's job)."""
    unit, _ = rules.render_unit("sim-tiny", [])
    service = {k: v for s, k, v in rules.unit_entries(unit) if s == "Service"}
    assert (service["Restart"], service["RestartForceExitStatus"]) == ("on-failure", "0")
    assert service["KillMode"] == "control-group"


@pytest.mark.parametrize(
    ("served_name", "extra_args", "expected"),
    [
        ("two\nlines", [], "served_model_name: the text holds the control character '\\n'"),
        ("ok", ["--x", "nul\x00"], "a vLLM argument: the argument holds a NUL character"),
        ("trailing\\", [], "served_model_name: the text ends in a backslash"),
    ],
)
def test_the_unit_template_refuses_in_one_line_and_renders_nothing(tmp_path, served_name,
                                                                   extra_args, expected):
    before = hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted(TEMPLATES.iterdir()))).hexdigest()
    out = tmp_path / "unit"
    with pytest.raises(AnsibleError) as info:
        out.write_text(rules.render_unit(served_name, extra_args)[0])
    # the filter's own error, under Ansible's "filter ... failed"
    message = str(info.value.__cause__)
    assert message.startswith(expected) and "\n" not in message, message
    assert not out.exists()
    assert hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted(TEMPLATES.iterdir()))).hexdigest() == before
