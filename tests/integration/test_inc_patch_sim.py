"""vllm_install's INC patch on the simulated Spark's release venv: applied once and recorded,
removable byte-for-byte, refused for a release it does not fit, and named as the fix for an
unpatched `existing` venv (docs/design.md "Module notes")."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from sparkspec.registry import releases
from tasks.lib.play import PlayResult, run_playbook
from tests.conftest import ROOT

pytestmark = pytest.mark.sim

PATCH = ROOT / "roles/vllm_install/files/patches/vllm-0.32.0-inc-mixed-fp8.patch"
VENV = f"/opt/sparkspec/venvs/vllm-{releases.DEFAULT}"   # wheel mode: a venv per release
INC = "vllm/model_executor/layers/quantization/inc/inc.py"
RECORD = f"{VENV}/sparkspec-patches.json"


def _role(**extra: object) -> PlayResult:
    return run_playbook(ROOT / "playbooks/provision.yml", ROOT / "inventories/sim/hosts.yml",
                        "sim01", tags=["vllm"], extra_vars=extra, quiet=True)


def _sh(sim, command: str) -> str:
    import subprocess

    proc = subprocess.run(sim.ssh_argv(command), capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _inc_digest(sim) -> str:
    return _sh(sim, f"sha256sum {VENV}/lib/python3*/site-packages/{INC}").split()[0]


def _wheel_digest(sim) -> str:
    """inc.py's sha256 as the installed wheel's RECORD lists it (urlsafe base64 there)."""
    line = next(ln for ln in _sh(sim, f"cat {VENV}/lib/python3*/site-packages/"
                                      "vllm*.dist-info/RECORD").splitlines()
                if ln.startswith(f"{INC},"))
    b64 = line.split(",")[1].removeprefix("sha256=")
    return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()


def _messages(result: PlayResult) -> list[str]:
    return [f.msg for f in result.failures]


def test_inc_patch_applied_recorded_removable_and_refused(provisioned) -> None:
    sim = provisioned
    wheel = _wheel_digest(sim)
    # after provision: applied (the file differs from the wheel's) and recorded with the patch's
    # digest
    assert _inc_digest(sim) != wheel
    record = json.loads(_sh(sim, f"cat {RECORD}"))
    assert record == {"patches": [{"name": PATCH.name,
                                   "sha256": hashlib.sha256(PATCH.read_bytes()).hexdigest(),
                                   "vllm": "0.32.0"}]}
    stamp = _sh(sim, f"stat -c %Y.%s {VENV}/lib/python3*/site-packages/{INC} {RECORD}")
    again = _role()
    assert again.rc == 0 and again.total_changed == 0, again.failures
    assert _sh(sim, f"stat -c %Y.%s {VENV}/lib/python3*/site-packages/{INC} {RECORD}") == stamp
    try:
        off = _role(vllm_install_inc_patch=False)
        assert off.rc == 0 and off.total_changed > 0, off.failures
        assert _inc_digest(sim) == wheel  # byte-identical to the wheel's file
        assert _sh(sim, f"test -e {RECORD} && echo present || echo absent").strip() == "absent"
        assert _role(vllm_install_inc_patch=False).total_changed == 0
        # a vLLM the patch was not written for: refused before anything changes
        refused = _role(_vllm_install_inc_patch_fits=["0.31.0"])
        assert refused.rc != 0 and _inc_digest(sim) == wheel
        assert any(m.startswith(f"the INC patch {PATCH.name} fits vLLM 0.31.0, not vLLM 0.32.0")
                   and "vllm_install_inc_patch: false" in m
                   for m in _messages(refused)), _messages(refused)
        # a hybrid profile on an unpatched existing venv: fails naming the fix; the venv is not
        # touched
        existing = _role(vllm_install_mode="existing", sparkspec_vllm_venv=VENV,
                         sparkspec_profile="sim-hybrid")
        assert existing.rc != 0 and _inc_digest(sim) == wheel
        assert any("lacks the INC patch" in m and "vllm_install_patch_existing: true" in m
                   for m in _messages(existing)), _messages(existing)
        # a hybrid without FP8 layers (sim-mtp: the INT4 source and its MTP head) needs no patch:
        # the same venv passes
        no_fp8 = _role(vllm_install_mode="existing", sparkspec_vllm_venv=VENV,
                       sparkspec_profile="sim-mtp")
        assert no_fp8.rc == 0 and _inc_digest(sim) == wheel, no_fp8.failures
        # allowed to patch the existing venv: patched, with the original file kept in the backup
        # folder
        allowed = _role(vllm_install_mode="existing", sparkspec_vllm_venv=VENV,
                        sparkspec_profile="sim-hybrid", vllm_install_patch_existing=True)
        assert allowed.rc == 0 and allowed.total_changed > 0, allowed.failures
        assert _inc_digest(sim) != wheel
        backup = _sh(sim, f"sha256sum {VENV}/sparkspec-patches-backup/{INC}")
        assert backup.split()[0] == wheel
    finally:
        _sh(sim, f"rm -rf {VENV}/sparkspec-patches-backup")
        back = _role()
        assert back.rc == 0, back.failures
    assert _inc_digest(sim) != wheel and json.loads(_sh(sim, f"cat {RECORD}")) == record


def test_journal_line_fails_the_deploy_and_rolls_back(provisioned) -> None:
    """deploy_journal_fail_patterns on this start's journal. vLLM 0.32 on the tiny model cannot
    print the weight_scale_inv skip warning (no hybrid loads on CPU), so the trigger is a line the
    real vLLM prints on every start of that model, named as the pattern: the same read, fail and
    rollback path."""
    from tasks.lib.play import failure_summary

    sim = provisioned
    unit = "sparkspec-vllm"
    before = json.loads(_sh(sim, f"cat /etc/sparkspec/{unit}.json"))["method"]
    method = "baseline" if before != "baseline" else "ngram"
    result = run_playbook(ROOT / f"playbooks/deploy-{method}.yml",
                          ROOT / "inventories/sim/hosts.yml", "sim01",
                          extra_vars={"deploy_journal_fail_patterns":
                                      ["Resolved architecture: Qwen3ForCausalLM"]},
                          quiet=True)
    message = failure_summary(result, "sim01")
    assert result.rc != 0, message
    assert "journal of sparkspec-vllm shows '" in message
    assert "Resolved architecture: Qwen3ForCausalLM" in message
    assert "vllm_install_inc_patch: true" in message, message
    assert f"restored the previous unit (method {before}, serving again)" in message, message
    assert json.loads(_sh(sim, f"cat /etc/sparkspec/{unit}.json"))["method"] == before
