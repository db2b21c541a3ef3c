"""provision.yml against the simulated Spark, over SSH, as on a real Spark."""

from __future__ import annotations

import re

import pytest

from tests.conftest import BIN, run_cli

pytestmark = pytest.mark.sim


def _recap(output: str, host: str = "sim01") -> dict[str, int]:
    m = re.search(rf"^{host}\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", output,
                  re.MULTILINE)
    assert m, f"no play recap for {host} in output:\n{output[-2000:]}"
    return dict(zip(("ok", "changed", "unreachable", "failed"), map(int, m.groups())))


def test_provision_converges_then_reports_no_change(sim):
    first = run_cli(f"{BIN}/invoke", "provision", "--host", "sim01")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr
    second = run_cli(f"{BIN}/invoke", "provision", "--host", "sim01")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr
    assert _recap(second.stdout)["changed"] == 0, second.stdout[-4000:]
    # The tools venv on the host runs the package built from this tree.
    version = run_cli(*sim.ssh_argv("/opt/sparkspec/venvs/tools/bin/sparkspec", "--version"))
    assert version.returncode == 0 and version.stdout.startswith("sparkspec "), version.stderr


def test_check_mode_changes_nothing(sim):
    result = run_cli(f"{BIN}/invoke", "provision", "--host", "sim01", "--check")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert _recap(result.stdout)["failed"] == 0
