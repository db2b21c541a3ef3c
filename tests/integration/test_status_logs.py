"""`invoke status` (Fabric, no playbook), `invoke logs` and `invoke verify` on the simulated
Spark."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import BIN, ROOT, run_cli

pytestmark = pytest.mark.sim

UNIT = "sparkspec-vllm"
RECORD = f"/etc/sparkspec/{UNIT}.json"
DESIRED = f"/etc/sparkspec/{UNIT}.desired.json"


def _ssh(sim, command: str) -> str:
    result = run_cli(*sim.ssh_argv(command))
    assert result.returncode == 0, result.stderr
    return result.stdout


def _status(*extra: str) -> dict:
    result = run_cli(f"{BIN}/invoke", "status", "--host", "sim01", "--json", *extra, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    [status] = json.loads(result.stdout)
    return status


def _error_line(result) -> str:
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("sparkspec: error: "), result.stderr
    return lines[0]


def test_status_shows_what_runs(provisioned):
    record = json.loads(_ssh(provisioned, f"cat {RECORD}"))
    main_pid = int(_ssh(provisioned, f"systemctl show -p MainPID --value {UNIT}.service"))
    status = _status()
    assert (status["host"], status["unit"], status["state"], status["sub_state"]) == \
        ("sim01", UNIT, "active", "running")
    assert (status["method"], status["profile"], status["model"], status["url"]) == \
        (record["method"], record["profile"], record["served_model_name"], record["url"])
    assert status["main_pid"] == main_pid
    assert status["health"] == 200
    assert status["memory_current"] > 0 and status["mem_available"] > 0
    # the sim's systemd keeps no MemoryCurrent: the RSS of the unit's tasks
    if status["memory_source"] == "rss":
        rss = _ssh(provisioned, f"grep VmRSS /proc/{main_pid}/status").split()[1]
        assert status["memory_current"] >= int(rss) * 1024 * 0.5
    else:
        assert status["memory_source"] == "MemoryCurrent"
    assert status["inventory_method"] == "baseline"  # the sim inventory's sparkspec_method


def test_status_says_when_a_switch_differs_from_the_inventory(provisioned):
    before = run_cli(*provisioned.ssh_argv(f"cat {DESIRED}"))
    switch = {"method": "ngram5", "inventory_method": "baseline", "time": "2026-01-01T00:00:00Z"}
    _ssh(provisioned, f"echo '{json.dumps(switch)}' > {DESIRED}")
    try:
        status = _status()
    finally:  # put back what the host had (a real switch recorded by another test), or nothing
        if before.returncode == 0:
            _ssh(provisioned, f"echo '{before.stdout.strip()}' > {DESIRED}")
        else:
            _ssh(provisioned, f"rm -f {DESIRED}")
    assert (status["desired_method"], status["inventory_method"]) == ("ngram5", "baseline")
    assert any(n.startswith("desired ngram5 (switched by deploy) ≠ inventory baseline")
               for n in status["notes"]), status["notes"]
    table = run_cli(f"{BIN}/invoke", "status", "--host", "sim01", timeout=120)
    assert table.returncode == 0 and "sim01" in table.stdout, table.stderr


def _inventory_copy(tmp_path: Path, **settings: object) -> Path:
    inv = tmp_path / "inv"
    shutil.copytree(ROOT / "inventories/sim", inv)
    hosts = yaml.safe_load((inv / "hosts.yml").read_text())
    host = hosts["all"]["children"]["sparks"]["hosts"]["sim01"]
    host["ansible_ssh_private_key_file"] = str(ROOT / ".sim/id_ed25519")
    host.update(settings)
    (inv / "hosts.yml").write_text(yaml.safe_dump(hosts))
    return inv


def test_status_of_an_unreachable_host_is_one_line(sim, tmp_path):
    inv = _inventory_copy(tmp_path, ansible_port=1)  # nothing listens on port 1 of loopback
    result = run_cli(f"{BIN}/invoke", "status", "--host", "sim01", "--inventory", str(inv),
                     timeout=120)
    assert result.returncode == 1
    line = _error_line(result)
    assert "host sim01 is unreachable over SSH (127.0.0.1:1" in line, line


def test_an_unknown_host_key_is_refused_not_asked(sim, tmp_path):
    """Without the sim's StrictHostKeyChecking=no, an unknown host key is refused as Ansible's ssh
    refuses it: Fabric does not trust it silently, and the play stops at once instead of asking on
    the runner's terminal."""
    known = tmp_path / "known_hosts"
    known.write_text("")
    # another name for the host: ssh's ControlPath differs, so no master connection of an earlier
    # play is reused
    inv = _inventory_copy(tmp_path, ansible_host="localhost",
                          ansible_ssh_common_args=f"-o UserKnownHostsFile={known}")
    status = run_cli(f"{BIN}/invoke", "status", "--host", "sim01", "--inventory", str(inv),
                     timeout=120)
    assert status.returncode == 1
    assert "not found in known_hosts" in _error_line(status)
    play = run_cli(f"{BIN}/invoke", "verify", "--host", "sim01", "--inventory", str(inv),
                   timeout=300)
    assert play.returncode == 2
    line = _error_line(play)
    assert ("host sim01 is unreachable over SSH" in line
            and "Host key verification failed" in line), line


def test_logs_prints_the_units_last_lines(provisioned):
    result = run_cli(f"{BIN}/invoke", "logs", "--host", "sim01", "--lines", "5", timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [ln for ln in result.stdout.splitlines() if ln.strip()]
    assert 1 <= len(lines) <= 5, result.stdout
    journal = _ssh(provisioned, f"journalctl -u {UNIT}.service --no-pager").splitlines()
    assert all(ln in journal for ln in lines), (lines, journal[-10:])
    other = _ssh(provisioned,
                 "journalctl -u ssh.service -u sshd.service -n 200 --no-pager").splitlines()
    assert not any(ln in other for ln in lines)


@pytest.mark.parametrize(("argv", "expected"), [
    (["--lines", "0"], "--lines '0' is not a whole number"),
    (["--lines", "x"], "--lines 'x' is not a whole number"),
    (["--lines", "-3"], "--lines '-3' is not a whole number"),
    (["--host", "nope"], "host 'nope' is not in inventory"),
], ids=["zero", "not-a-number", "negative", "unknown-host"])
def test_logs_bad_input_is_one_line(argv, expected):
    full = ["--host", "sim01", *argv] if "--host" not in argv else argv
    result = run_cli(f"{BIN}/invoke", "logs", *full, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert expected in _error_line(result)
    assert result.stdout == ""


@pytest.mark.slow
def test_verify_passes_on_what_runs(provisioned):
    method = json.loads(_ssh(provisioned, f"cat {RECORD}"))["method"]
    report = ROOT / "reports/sim01" / f"{method}.json"
    start = time.time()
    result = run_cli(f"{BIN}/invoke", "verify", "--host", "sim01", timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    assert "sparkspec: verify.yml on sim01: changed=" in result.stdout
    assert "TASK [verify" in result.stdout              # the play's own output was shown
    assert Path(report).stat().st_mtime >= start - 1    # the benchmark of what runs was fetched now
    assert json.loads(report.read_text())               # and is JSON


def test_sim_tasks_run_from_the_command_line(sim):
    """`invoke sim.*` import the simulator (tests.support) when they run, through the invoke
    executable, whose sys.path holds neither the checkout nor the current folder (`invoke sim.up`
    of the README's first command)."""
    result = run_cli(f"{BIN}/invoke", "sim.ssh", "--command", "cat /etc/hostname", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-1] == "sim01"
