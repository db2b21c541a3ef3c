"""The unit's quoting against the real systemd of the simulated Spark: hostile renders of the unit
template (tests/support/systemd_rules.HOSTILE_RENDERS: served model names and vLLM arguments with
quotes, backslashes, control characters, % specifiers, $ variables, ';' and command prefixes, from a
venv whose path holds a space and a %) are installed under throwaway names in /run/systemd/system
(never started), `systemd-analyze verify` accepts them without a parser warning, and after
`systemctl daemon-reload` the ExecStart systemd loaded (`systemctl show -p ExecStart --value`, and
exactly over D-Bus) is the record's argv, and what tests/support/systemd_rules.py reads from the
same file. The units are removed afterwards."""

from __future__ import annotations

import base64
import json
import re
import shlex
import subprocess

import pytest

from tests.support import systemd_rules as rules

pytestmark = [pytest.mark.sim]

PREFIX = "sparkspec-quote-test"
VENV = f"/run/{PREFIX}/venv 100%"
CLEANUP = (f"rm -f /run/systemd/system/{PREFIX}-*.service; rm -rf /run/{PREFIX}; "
           "systemctl daemon-reload")
# systemd-analyze's warnings that are about this image's seccomp tables, not the unit's text
UNRELATED = re.compile(r"Failed to parse system call")


def _ssh(sim, script: str) -> str:
    proc = subprocess.run(sim.ssh_argv("bash -s"), input=script.encode(), capture_output=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc.stdout.decode()


@pytest.fixture
def installed(sim):
    """The hostile renders installed as units (name, argv of the record, unit text); removed
    afterwards."""
    units = []
    script = [f"set -e; mkdir -p {shlex.quote(VENV)}/bin; "
              f"ln -sf /bin/true {shlex.quote(VENV)}/bin/python"]
    for i, (served_name, extra_args) in enumerate(rules.HOSTILE_RENDERS):
        text, argv = rules.render_unit(served_name, extra_args, venv=VENV)
        name = f"{PREFIX}-{i}.service"
        units.append((name, argv, text))
        data = base64.b64encode(text.encode()).decode()
        script.append(f"echo {data} | base64 -d > /run/systemd/system/{name}")
    _ssh(sim, "\n".join([*script, "systemctl daemon-reload"]))
    yield units
    _ssh(sim, CLEANUP)


def _report(sim, name: str) -> dict[str, str]:
    """verify's exit code and output, systemctl show's ExecStart and the D-Bus ExecStart, each
    base64'd."""
    b64 = "| base64 -w0; echo"
    script = f"""
        unit=/run/systemd/system/{name}
        out=$(systemd-analyze verify --man=no "$unit" 2>&1) && rc=0 || rc=$?
        echo "verify_rc $rc"; printf 'verify %s\\n' "$(printf '%s' "$out" | base64 -w0)"
        printf 'show '; systemctl show -p ExecStart --value {name} {b64}
        path=$(busctl call org.freedesktop.systemd1 /org/freedesktop/systemd1 \\
               org.freedesktop.systemd1.Manager LoadUnit s {name} | cut -d'"' -f2)
        printf 'bus '; busctl --json=short get-property org.freedesktop.systemd1 "$path" \\
            org.freedesktop.systemd1.Service ExecStart {b64}
    """
    out = {}
    for line in _ssh(sim, script).splitlines():
        key, _, value = line.partition(" ")
        out[key] = value if key == "verify_rc" else base64.b64decode(value).decode()
    return out


def test_systemd_loads_each_hostile_render_with_the_records_argv(installed, sim):
    for name, argv, text in installed:
        report = _report(sim, name)
        warnings = [ln for ln in report["verify"].splitlines()
                    if name in ln and not UNRELATED.search(ln)]
        assert report["verify_rc"] == "0" and not warnings, (name, report["verify"])
        # systemd keeps $ for exec time ($$ is one $ then): the loaded argv is the record's with $
        # doubled
        stored = [a.replace("$", "$$") for a in argv]
        [(path, bus_argv, *_)] = json.loads(report["bus"])["data"]
        assert path == argv[0] and bus_argv == stored, (name, bus_argv, stored)
        [exec_start] = [v for s, k, v in rules.unit_entries(text) if k == "ExecStart"]
        # the tests' rules read what systemd read
        assert rules.exec_command(exec_start).argv == bus_argv
        assert f"path={argv[0]} ; argv[]={' '.join(stored)} ; " in report["show"], report["show"]
