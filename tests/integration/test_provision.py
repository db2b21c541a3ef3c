"""provision.yml against the simulated Spark, over SSH, as on a real Spark."""

from __future__ import annotations

import pytest

from tasks.lib.play import PlayResult, failure_summary, run_playbook
from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.sim


def _provision(*, check: bool = False) -> PlayResult:
    """provision.yml on sim01 through ansible-runner: what happened comes from its events."""
    result = run_playbook(ROOT / "playbooks" / "provision.yml", ROOT / "inventories" / "sim",
                          "sim01", check=check, quiet=True)
    assert result.rc == 0 and not result.unreachable, failure_summary(result, "sim01")
    return result


def test_provision_converges_then_reports_no_change(provisioned):
    """The session's first provision (`invoke provision --host sim01`, the user's command, in the
    `provisioned` fixture; this file runs first on sim01, tests/conftest.py) converged; the same
    play again changes nothing."""
    second = _provision()
    assert second.changed == {"sim01": 0}, second
    # The tools venv on the host runs the package built from this tree.
    version = run_cli(*provisioned.ssh_argv("/opt/sparkspec/venvs/tools/bin/sparkspec",
                                            "--version"))
    assert version.returncode == 0 and version.stdout.startswith("sparkspec "), version.stderr


def test_check_mode_changes_nothing(sim):
    result = _provision(check=True)
    assert result.failed == {"sim01": 0}, result
