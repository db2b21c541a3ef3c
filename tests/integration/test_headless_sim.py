"""Headless mode on the simulated Spark's systemd: a display manager stand-in holding 2 GiB is
stopped and the default target set to multi-user (the freed MemAvailable measured, `invoke status`
shows it, a second run changes nothing), then put back; a host without the target, and a record
sparkspec did not write, are refused in one line, nothing changed."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import BIN, run_cli

DM_UNIT = """\
[Unit]
Description=A display manager stand-in holding 2 GiB (tests/integration/test_headless_sim.py)
[Service]
ExecStart=/usr/bin/python3 -c "import time; b = bytearray(2 << 30); b[::4096] = b'x' * (2 << 18); \\
time.sleep(9e9)"
[Install]
Alias=display-manager.service
WantedBy=graphical.target
"""
GIB = 2 ** 30


def ssh(sim, command: str) -> str:
    return subprocess.run(sim.ssh_argv(command), capture_output=True, text=True, timeout=120,
                          check=False).stdout.strip()


def provision(*, headless: bool, **extra: object) -> subprocess.CompletedProcess[str]:
    """The provision play's headless phase alone (preflight and the vLLM fit run with every tag)."""
    return run_cli(f"{BIN}/ansible-playbook", "-i", "inventories/sim", "--limit", "sim01",
                   "playbooks/provision.yml", "--tags", "headless",
                   "-e", json.dumps({"sparkspec_headless": headless, **extra}), timeout=600)


def changed(result: subprocess.CompletedProcess[str]) -> int:
    recap = [line for line in result.stdout.splitlines()
             if line.startswith("sim01") and "changed=" in line]
    return int(recap[-1].split("changed=")[1].split()[0])


@pytest.fixture
def desktop(provisioned):
    """The sim booting into graphical.target with a display manager running; afterwards as it
    was."""
    before = ssh(provisioned, "systemctl get-default")
    unit = DM_UNIT.replace("'", "'\\''")
    ssh(provisioned, f"printf '%s' '{unit}' > /etc/systemd/system/sparkspec-test-dm.service && "
                     "systemctl daemon-reload && systemctl enable sparkspec-test-dm.service && "
                     "systemctl set-default graphical.target && "
                     "systemctl start sparkspec-test-dm.service")
    assert ssh(provisioned, "systemctl is-active display-manager.service") == "active"
    try:
        yield provisioned
    finally:
        ssh(provisioned, "systemctl disable --now sparkspec-test-dm.service; rm -f "
                         "/etc/systemd/system/sparkspec-test-dm.service "
                         "/opt/sparkspec/state/headless.json; "
                         f"systemctl daemon-reload; systemctl set-default {before}")


@pytest.mark.sim
def test_headless_on_measured_shown_and_put_back(provisioned, desktop):
    sim = provisioned
    refused = provision(headless=True, headless_target="no-such.target")
    assert refused.returncode != 0
    assert ("sparkspec_headless: this host's systemd has no no-such.target "
            "(LoadState not-found), so it cannot boot headless; "
            "set sparkspec_headless: false") in refused.stdout, refused.stdout[-3000:]
    assert ssh(sim, "systemctl get-default") == "graphical.target"
    assert ssh(sim, "systemctl is-active display-manager.service") == "active"
    assert ssh(sim, "test -e /opt/sparkspec/state/headless.json || echo none") == "none"
    # a record that names a unit systemctl would take as an option (or anything sparkspec did not
    # write)
    hostile = json.dumps({"previous_default": "--now.target", "display_manager": None,
                          "display_manager_was_active": True})
    ssh(sim, f"mkdir -p /opt/sparkspec/state && echo '{hostile}' > "
             "/opt/sparkspec/state/headless.json")
    refused = provision(headless=False)
    assert refused.returncode != 0
    assert ("/opt/sparkspec/state/headless.json is not a headless record sparkspec wrote; "
            "remove it after checking") in refused.stdout, refused.stdout[-3000:]
    assert ssh(sim, "systemctl get-default") == "graphical.target"
    ssh(sim, "rm /opt/sparkspec/state/headless.json")

    on = provision(headless=True, headless_settle_s=3)
    assert on.returncode == 0, on.stdout[-3000:] + on.stderr
    assert ssh(sim, "systemctl get-default") == "multi-user.target"
    assert ssh(sim, "systemctl is-active display-manager.service") == "inactive"
    record = json.loads(ssh(sim, "cat /opt/sparkspec/state/headless.json"))
    assert (record["previous_default"], record["display_manager"],
            record["display_manager_was_active"]) == (
        "graphical.target", "sparkspec-test-dm.service", True)
    # MemAvailable after the stop less before: the stand-in's 2 GiB, less what the rest of the
    # machine took
    assert GIB <= record["freed_bytes"] <= 3 * GIB, record
    assert record["freed_bytes"] == record["mem_available_after"] - record["mem_available_before"]
    assert "headless: multi-user.target by default, sparkspec-test-dm.service stopped" in on.stdout
    status = run_cli(f"{BIN}/invoke", "status", "--host", "sim01", "--json", timeout=120)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)[0]["headless"]["freed_bytes"] == record["freed_bytes"]
    again = provision(headless=True, headless_settle_s=3)
    assert again.returncode == 0 and changed(again) == 0, again.stdout[-3000:]

    off = provision(headless=False)
    assert off.returncode == 0, off.stdout[-3000:] + off.stderr
    assert ssh(sim, "systemctl get-default") == "graphical.target"
    assert ssh(sim, "systemctl is-active display-manager.service") == "active"
    assert ssh(sim, "test -e /opt/sparkspec/state/headless.json || echo none") == "none"
    assert json.loads(run_cli(f"{BIN}/invoke", "status", "--host", "sim01", "--json",
                              timeout=120).stdout)[0]["headless"] is None
