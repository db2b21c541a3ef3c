"""The unit's files as `invoke render` writes them: environment values that round-trip exactly
through systemd, values systemd cannot hold refused in one line before anything is written, secrets
redacted unless asked for, and a unit that `systemd-analyze security` rates at most 4.0 (the
simulated Spark's and spark01's), while the live unit on the simulated Spark still serves with the
checkpoints read-only to it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
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


def _ssh(sim, command: str, data: bytes = b"") -> str:
    proc = subprocess.run(sim.ssh_argv(command), input=data, capture_output=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, f"{command}: {proc.stderr.decode()}"
    return proc.stdout.decode()


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


@pytest.mark.sim
def test_env_values_round_trip_through_systemd(sim, tmp_path):
    """deploy_env values are written so that systemd hands the service exactly those strings."""
    dest = tmp_path / "out"
    result = _render(_inventory(tmp_path, "inventories/sim", {"deploy_env": TRICKY}), "sim01",
                     dest)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    _ssh(sim, "umask 077 && cat > /root/roundtrip.env", (dest / ENV).read_bytes())
    raw = _ssh(sim, "systemd-run --wait --pipe --quiet -p EnvironmentFile=/root/roundtrip.env "
                    "/usr/bin/env -0; rm -f /root/roundtrip.env")
    seen = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
    assert {name: seen.get(name) for name in TRICKY} == TRICKY
    assert seen["HF_HUB_OFFLINE"] == "1" and seen["SPARKSPEC_PROFILE"] == "sim-tiny"


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


def _mount_of(mountinfo: str, path: str) -> tuple[list[str], list[str]]:
    """(mount options, superblock options) of the mount that holds ``path`` in a mountinfo table:
    the longest mount point above it, the last one mounted there winning (it covers the earlier
    ones)."""
    best: tuple[int, list[str], list[str]] = (-1, [], [])
    for line in mountinfo.splitlines():
        fields, _, tail = line.partition(" - ")
        point, options = fields.split()[4:6]
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= best[0]:
            best = (len(point), options.split(","), tail.split()[2].split(","))
    assert best[0] >= 0, f"no mount holds {path}"
    return best[1], best[2]


@pytest.mark.sim
def test_live_unit_is_confined_and_serves(provisioned, api_key):
    """On the simulated Spark (systemd with CAP_SYS_ADMIN, so it applies the mount confinement as on
    a Spark) the running unit rates at most 4.0; in its own mount table the checkpoints, the venv
    and /etc are read-only, its home (the caches) writable, /proc hides other users' processes; and
    it still answers."""
    exposure = _exposure(_ssh(provisioned,
                              "systemd-analyze security --no-pager sparkspec-vllm.service"))
    assert exposure <= MAX_EXPOSURE
    pid = _ssh(provisioned, "systemctl show -p MainPID --value sparkspec-vllm").strip()
    assert pid != "0"
    # the service's mount table, read as the service's user (root here lacks CAP_SYS_PTRACE over
    # it)
    mountinfo = _ssh(provisioned, f"setpriv --reuid=sparkspec --regid=sparkspec --clear-groups "
                                  f"cat /proc/{pid}/mountinfo")
    for path in ("/opt/sparkspec/models/sim-tiny", "/opt/sparkspec/venvs/vllm", "/etc/sparkspec",
                 "/usr"):
        assert "ro" in _mount_of(mountinfo, path)[0], f"{path} is writable to the service"
    assert "rw" in _mount_of(mountinfo, "/var/lib/sparkspec/.cache")[0]
    assert "hidepid=invisible" in _mount_of(mountinfo, "/proc/self")[1]
    # control: outside the unit that folder is writable (the confinement is the unit's, not the
    # container's)
    assert "rw" in _mount_of(_ssh(provisioned, "cat /proc/self/mountinfo"),
                             "/opt/sparkspec/models")[0]
    req = urllib.request.Request("http://127.0.0.1:8000/v1/completions", data=json.dumps(
        {"model": "sim-tiny", "prompt": "hello", "max_tokens": 8, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert json.loads(resp.read())["choices"][0]["text"]
