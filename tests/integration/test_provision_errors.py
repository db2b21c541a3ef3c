"""Bad input is refused before anything changes, with one line that names the problem."""

from __future__ import annotations

import pytest

from tests.conftest import BIN, run_cli
from tests.support.siminventory import sim_inventory_copy

pytestmark = pytest.mark.sim


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.startswith("sparkspec: error:")]
    assert len(lines) == 1, f"expected one error line, got stderr:\n{stderr}"
    return lines[0]


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"method": "warp"}, "sparkspec_method: unknown method 'warp'; choose one of baseline, "
                             "ngram, mtp, eagle3, dflash"),
        ({"disk": "-5"}, "preflight_required_disk_gb '-5' is not a number >= 0"),
        ({"disk": "lots"}, "preflight_required_disk_gb 'lots' is not a number >= 0"),
        ({"disk": "99999999"}, "the staged profiles (sim-tiny, sim-hybrid, sim-mtp) need "
                               "99999999.0 GB in all"),
    ],
    ids=["unknown-method", "negative-disk", "non-numeric-disk", "disk-too-small"],
)
def test_bad_values_refused_in_preflight(sim, extra, expected):
    # through ansible-playbook: the play itself refuses (invoke refuses an unknown method before any
    # play)
    var = "sparkspec_method" if "method" in extra else "preflight_required_disk_gb"
    argv = [f"{BIN}/ansible-playbook", "-i", "inventories/sim", "--limit", "sim01",
            "playbooks/provision.yml", "-e", f"{var}={extra.get('method', extra.get('disk'))}"]
    result = run_cli(*argv)
    assert result.returncode != 0
    assert expected in result.stdout + result.stderr, result.stdout[-3000:] + result.stderr
    # Nothing ran past preflight, nothing changed.
    assert "TASK [sparkspec_tools" not in result.stdout
    assert "changed=0" in result.stdout


def test_unknown_method_is_one_line_from_invoke(sim):
    result = run_cli(f"{BIN}/invoke", "provision", "--host", "sim01", "--method", "warp")
    assert result.returncode == 2
    line = _error_line(result.stderr)
    assert "unknown method 'warp'; choose one of baseline, dflash, eagle3, mtp, ngram" in line
    assert "PLAY" not in result.stdout  # refused before any play ran


def test_host_not_in_inventory(sim):
    result = run_cli(f"{BIN}/invoke", "provision", "--host", "spark99")
    assert result.returncode == 2
    line = _error_line(result.stderr)
    assert "host 'spark99' is not in inventory" in line and "sim01" in line


def test_missing_required_variable(sim, tmp_path):
    inv = sim_inventory_copy(tmp_path, lambda host, gv: gv.pop("sparkspec_profile"))
    result = run_cli(f"{BIN}/invoke", "provision", "--host", "sim01", "--inventory", str(inv))
    assert result.returncode == 2
    assert "missing required arguments: sparkspec_profile" in _error_line(result.stderr)
    assert "TASK [sparkspec_tools" not in result.stdout


def test_unreachable_host(sim, tmp_path):
    def to_closed_port(host, _gv):
        host["ansible_port"] = 1  # nothing listens on port 1 of loopback

    inv = sim_inventory_copy(tmp_path, to_closed_port)
    result = run_cli(f"{BIN}/invoke", "provision", "--host", "sim01", "--inventory", str(inv),
                     timeout=300)
    assert result.returncode == 2
    assert "host sim01 is unreachable over SSH" in _error_line(result.stderr)


UNIT_FILES = "/etc/systemd/system/sparkspec-vllm.service /etc/sparkspec/sparkspec-vllm.env " \
             "/etc/sparkspec/sparkspec-vllm.json"


def _unit_state(provisioned) -> str:
    """The unit's files and its start (a restart changes the invocation)."""
    command = f"sha256sum {UNIT_FILES}; systemctl show -p InvocationID --value sparkspec-vllm"
    result = run_cli(*provisioned.ssh_argv(command), timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize(("levers", "package", "expected"), [
    ({"int8_lm_head": True}, "0.31.0",
     "lever int8_lm_head does not fit vLLM 0.31.0: its hooks were read against vLLM 0.32.0"),
    ({"int8_lm_head": {"min_vocab": 100000}}, None,
     "lever int8_lm_head: /opt/sparkspec/models/sim-tiny's vocabulary (512) is below the lever's "
     "min_vocab 100000"),
    ({"int8_lm_head\nExecStartPre=/bin/sh -c id": True}, None,
     "sparkspec_levers.'int8_lm_head\\nExecStartPre=/bin/sh -c id': "),
], ids=["release-it-does-not-fit", "head-below-min-vocab", "a-unit-line-in-its-name"])
def test_a_lever_that_cannot_apply_changes_nothing(provisioned, tmp_path, levers, package,
                                                   expected):
    """A lever named with a line of the unit in it (the contract; an unknown one is refused there
    too: tests/unit/registry/test_levers.py), one the vLLM release (right after preflight) or the
    model's head (the deploy's validation, from the checkpoint's config.json) cannot take: one line,
    exit 2, the unit as it was."""
    def mutate(_host, group_vars):
        group_vars["sparkspec_levers"] = levers
        if package:   # another release sparkspec knows (its record: the INC patch fits it)
            group_vars.update(sparkspec_vllm_release=package)

    inv = sim_inventory_copy(tmp_path, mutate)
    before = _unit_state(provisioned)
    result = run_cli(f"{BIN}/invoke", "deploy", "--host", "sim01", "--method", "baseline",
                     "--inventory", str(inv), timeout=600)
    assert result.returncode == 2, result.stdout[-3000:]
    assert expected in _error_line(result.stderr)
    assert _unit_state(provisioned) == before
