"""The ``sparkspec fetch`` and ``sparkspec hub serve`` command line (sparkspec.cli.hub): every flag
fed bad values, HF_ENDPOINT checked like --endpoint, no token on the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.badinput import (
    Outcome,
    assert_refused,
    refused_untouched,
)
from tests.support.hubpublish import publish
from tests.unit.conftest import _serve_refused, _small_repo

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


@pytest.mark.usefixtures("_quiet")
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


@pytest.mark.usefixtures("_quiet")
@pytest.mark.parametrize("value", [",,", " ", "\n", "", " , \n ,"])
def test_hub_serve_refuses_a_token_variable_that_yields_no_token(tmp_path: Path,
                                                                 value: str) -> None:
    (tmp_path / "root").mkdir()
    _serve_refused(["--root", tmp_path / "root"], {"SPARKSPEC_HUB_TOKENS": value},
                   "SPARKSPEC_HUB_TOKENS.*no token")


@pytest.mark.usefixtures("_quiet")
@pytest.mark.parametrize("value", ["http://127.0.0.1:1\nX", "javascript:alert(1)", "ftp://h",
                                   "http://u:p@h"])
def test_hf_endpoint_from_the_environment_is_checked_like_the_flag(tmp_path: Path,
                                                                   value: str) -> None:
    refused_untouched(["fetch", "plan", "org/x", "--revision", "main"], [tmp_path], 2,
                      "HF_ENDPOINT", env={"HF_ENDPOINT": value})
