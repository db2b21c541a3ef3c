"""The unit's files on the simulated Spark: environment values that round-trip exactly through
systemd, and the live unit confined (checkpoints read-only to it) while it serves. Rendered
without a host: test_unit_files.py."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import pytest

from sparkspec.registry import releases
from tests.integration.test_unit_files import (
    ENV,
    MAX_EXPOSURE,
    TRICKY,
    _exposure,
    _inventory,
    _render,
)


def _ssh(sim, command: str, data: bytes = b"") -> str:
    proc = subprocess.run(sim.ssh_argv(command), input=data, capture_output=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, f"{command}: {proc.stderr.decode()}"
    return proc.stdout.decode()


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
    for path in ("/opt/sparkspec/models/sim-tiny", f"/opt/sparkspec/venvs/vllm-{releases.DEFAULT}",
                 "/etc/sparkspec",
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
