"""The unit's files as `invoke render` writes them: values systemd cannot hold refused in one line
before anything is written, secrets redacted unless asked for, and a unit that `systemd-analyze
security` rates at most 4.0 (the simulated Spark's and spark01's). On sim01:
test_unit_files_sim.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import BIN, ROOT, run_cli

UNIT = "etc/systemd/system/sparkspec-vllm.service"
ENV = "etc/sparkspec/sparkspec-vllm.env"
MAX_EXPOSURE = 4.0
# Values systemd's environment-file parser treats specially, unquoted or quoted.
TRICKY = {
    "Q_DOUBLE": 'say "hi"',
    "Q_SINGLE": "it's 'quoted'",
    "BACKSLASH": "a\\b\\\\c\\n\\",
    "DOLLAR": "$HOME ${PATH} $$ $",
    "PERCENT": "100% %h %% %",
    "SPACES": "  two  spaces  ",
    "HASH": "#not a comment",
    "BACKTICK": "`id` $(id)",
    "SEMICOLON": "a;b && c | d",
    "EQUALS": "a=b=c",
    "EMPTY": "",
    "UNICODE": "grüße ✓",
    "MIXED": "a'b\"c\\d$e%f#g `h` \\\"",
}


def _inventory(tmp_path: Path, source: str, extra: dict) -> Path:
    """A copy of an inventory with `extra` as one more group_vars file (what a site's inventory
    would set)."""
    inv = tmp_path / "inv"
    shutil.copytree(ROOT / source, inv)
    group_vars = inv / "group_vars/all"
    if (inv / "group_vars/all.yml").exists():
        group_vars.mkdir()
        (inv / "group_vars/all.yml").rename(group_vars / "main.yml")
    (group_vars / "zz-test.yml").write_text(yaml.safe_dump(extra))
    return inv


def _render(inv: Path | str, host: str, dest: Path,
            *flags: str) -> subprocess.CompletedProcess[str]:
    return run_cli(f"{BIN}/invoke", "render", "--host", host, "--method", "baseline",
                   "--dest", str(dest), "--inventory", str(inv), *flags)


def _parse_env(text: str) -> dict[str, str]:
    """The env file as systemd reads it, for the simple values these tests check (one KEY="..." per
    line)."""
    out = {}
    for line in text.splitlines():
        m = re.fullmatch(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"', line)
        if m:
            out[m.group(1)] = re.sub(r"\\(.)", r"\1", m.group(2))
    return out


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"GOOD": "x", "BAD": "two\nlines"}, r"deploy_env\.BAD: .*newline"),
        ({"CR": "a\rb"}, r"deploy_env\.CR: .*newline"),
        ({"NUL": "a\x00b"}, r"deploy_env\.NUL: .*NUL"),
        ({"1BAD": "x"}, r"deploy_env: '1BAD' is not a variable name"),
        ({"A-B": "x"}, r"deploy_env: 'A-B' is not a variable name"),
        ({"A B": "x"}, r"deploy_env: 'A B' is not a variable name"),
        ({"LIST": ["a", "b"]}, r"deploy_env\.LIST: .*a string or a number"),
    ],
    ids=["newline", "carriage-return", "nul", "leading-digit", "dash", "space", "list"],
)
def test_env_values_systemd_cannot_hold_are_refused(tmp_path, env, expected):
    dest = tmp_path / "out"
    result = _render(_inventory(tmp_path, "inventories/example", {"deploy_env": env}), "spark01",
                     dest)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("sparkspec: error: ")]
    assert len(errors) == 1 and re.search(expected, errors[0]), result.stderr
    assert "Traceback" not in result.stderr
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*")), \
        "files were written"


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"sparkspec_serve": {"extra_args": ["--api-key", "sk-on-the-command-line"]}},
         r"serve.extra_args: --api-key"),
        ({"sparkspec_serve": {"extra_args": ["--api-key=sk-on-the-command-line"]}},
         r"serve.extra_args: --api-key"),
        ({"sparkspec_serve": {"extra_args": ["--hf-token", "hf_x"]}},
         r"serve.extra_args: --hf-token"),
        ({"sparkspec_serve": {"extra_args": ["--tokenizer", "x\nExecStartPre=+/bin/true"]}},
         r"holds a control character"),
        ({"deploy_limit_nofile": "65536\nExecStartPre=+/bin/true"},
         r"deploy_limit_nofile .* is not a number"),
        # a variable this version renamed: one line naming the new key, before anything is written
        ({"deploy_max_model_len": 4096}, r"deploy_max_model_len: renamed in sparkspec 0\.2\.0; "
                                         r"set sparkspec_serve\.max_model_len"),
        ({"sparkspec_methods_extra": {}},
         r"sparkspec_methods_extra: renamed .* set sparkspec_methods "),
        ({"sparkspec_serve": {"max_model_length": 4096}},
         r"sparkspec_serve\.max_model_length: unknown key; did you mean max_model_len\?"),
    ],
    ids=["api-key", "api-key-equals", "hf-token", "newline-in-arg", "newline-in-limit",
         "renamed-knob", "renamed-methods-extra", "misspelt-knob"],
)
def test_secret_flags_and_unit_line_breaks_are_refused(tmp_path, extra, expected):
    """A flag that would put a secret on vLLM's command line (the process list), or a value that
    would start another line of the unit, is refused, naming the fix."""
    dest = tmp_path / "out"
    result = _render(_inventory(tmp_path, "inventories/example", extra), "spark01", dest)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("sparkspec: error: ")]
    assert len(errors) == 1 and re.search(expected, errors[0]), result.stderr
    assert "sk-on-the-command-line" not in result.stdout + result.stderr
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*"))


SECRETS = {"sparkspec_api_key": "sk-render-test-3f9a", "deploy_env": {
    "MY_TOKEN": "tok-render-test-77", "DB_PASSWORD": "pw-render-test-12",
    "S3_SECRET_ACCESS": "sec-render-test-5", "OPENAI_API_KEY": "key-render-test-9",
    "PLAIN_SETTING": "visible-value"}}


def test_render_redacts_secrets(tmp_path):
    dest = tmp_path / "out"
    result = _render(_inventory(tmp_path, "inventories/example", SECRETS), "spark01", dest)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    env = _parse_env((dest / ENV).read_text())
    assert env["VLLM_API_KEY"] == "<redacted>"
    assert {k: env[k] for k in SECRETS["deploy_env"]} == {
        "MY_TOKEN": "<redacted>", "DB_PASSWORD": "<redacted>", "S3_SECRET_ACCESS": "<redacted>",
        "OPENAI_API_KEY": "<redacted>", "PLAIN_SETTING": "visible-value"}
    secret_values = [SECRETS["sparkspec_api_key"],
                     *(v for k, v in SECRETS["deploy_env"].items() if k != "PLAIN_SETTING")]
    files = "".join(p.read_text() for p in dest.rglob("*") if p.is_file())
    everything = result.stdout + result.stderr + files
    assert [v for v in secret_values if v in everything] == []


def test_render_shows_secrets_when_asked(tmp_path):
    dest = tmp_path / "out"
    result = _render(_inventory(tmp_path, "inventories/example", SECRETS), "spark01", dest,
                     "--show-secrets")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    env = _parse_env((dest / ENV).read_text())
    assert env["VLLM_API_KEY"] == SECRETS["sparkspec_api_key"]
    assert env["MY_TOKEN"] == "tok-render-test-77"
    assert (dest / ENV).stat().st_mode & 0o777 == 0o640
    assert SECRETS["sparkspec_api_key"] not in result.stdout + result.stderr


def _exposure(text: str) -> float:
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+)", text)
    assert m, text[-2000:]
    return float(m.group(1))


@pytest.mark.parametrize(("inventory", "host"), [
    # its inventory reads the sim's key file
    pytest.param("inventories/sim", "sim01", marks=pytest.mark.sim),
    ("inventories/example", "spark01")])
def test_rendered_unit_exposes_at_most_4(tmp_path, inventory, host):
    """systemd-analyze security (offline, on the controller: systemd >= 250) on the unit render
    writes."""
    version = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True,
                             check=False).stdout
    assert int(version.split()[1]) >= 250, \
        f"the controller needs systemd >= 250 for --offline: {version}"
    dest = tmp_path / "out"
    result = _render(inventory, host, dest)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    analyze = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                              str(dest / UNIT)], capture_output=True, text=True, check=False)
    exposure = _exposure(analyze.stdout + analyze.stderr)
    assert exposure <= MAX_EXPOSURE, analyze.stdout
