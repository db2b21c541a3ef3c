"""MTP served for real on the simulated Spark: the sim-mtp profile (a tiny Qwen3-Next with one MTP layer, see
tests/support/qwen3next.py) through the real unit, checked lossless against baseline on the same profile by the
verify role, with drafts and accepted tokens in vLLM's own /metrics.

The profile is chosen per play with ``-e sparkspec_profile=sim-mtp`` (a profile the host stages); the method
through the thin deploy-<method>.yml playbooks, as ``invoke deploy`` runs them. The test leaves the host on
the inventory's own method and profile (baseline on sim-tiny), as it found it after provisioning.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import BIN, run_cli
from tests.counters import raw_counters
from tests.support import qwen3next

pytestmark = [pytest.mark.sim, pytest.mark.slow]

URL = "http://127.0.0.1:8000"
PROFILE = "sim-mtp"
UNIT = "sparkspec-vllm"
K = 2  # the mtp method's num_speculative_tokens (roles/sparkspec/defaults)


def play(method: str, *extra_vars: str, skip_tags: str = "") -> subprocess.CompletedProcess[str]:
    argv = [f"{BIN}/ansible-playbook", "-i", "inventories/sim", "--limit", "sim01", f"playbooks/deploy-{method}.yml"]
    for ev in extra_vars:
        argv += ["-e", ev]
    if skip_tags:
        argv += ["--skip-tags", skip_tags]
    return run_cli(*argv, timeout=1200)


def record(sim) -> dict:
    result = run_cli(*sim.ssh_argv(f"cat /etc/sparkspec/{UNIT}.json"), timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def ssh(sim, command: str) -> str:
    result = run_cli(*sim.ssh_argv(command), timeout=120)
    assert result.returncode == 0, f"{command}: {result.stderr}"
    return result.stdout


def test_mtp_serves_lossless_with_accepted_drafts(provisioned):
    try:
        # baseline on the profile first: the verify role records the profile's reference outputs (T=0)
        base = play("baseline", f"sparkspec_profile={PROFILE}", '{"verify_rerecord_reference": true}')
        assert base.returncode == 0, base.stdout[-5000:] + base.stderr
        assert (record(provisioned)["method"], record(provisioned)["profile"]) == ("baseline", PROFILE)

        mtp = play("mtp", f"sparkspec_profile={PROFILE}")
        assert mtp.returncode == 0, mtp.stdout[-5000:] + mtp.stderr
        rec = record(provisioned)
        assert (rec["method"], rec["profile"], rec["served_model_name"]) == ("mtp", PROFILE, PROFILE)
        # the unit serves the staged model with MTP from its own head (no draft model) and prefix caching off
        unit = ssh(provisioned, f"systemctl cat {UNIT}")
        assert '"method":"mtp"' in unit.replace(" ", "") and "/sim-qwen3-next" in unit, unit
        assert "--no-enable-prefix-caching" in unit, unit
        assert "mtp is lossless against baseline" in mtp.stdout, mtp.stdout[-5000:]

        counters = raw_counters(URL)   # the verify role's bench and lossless check ran on this server
        drafts = counters["vllm:spec_decode_num_drafts_total"]
        accepted = counters["vllm:spec_decode_num_accepted_tokens_total"]
        per_position = [counters[f"vllm:spec_decode_num_accepted_tokens_per_pos_total/{i}"] for i in range(K)]
        assert drafts > 0
        assert counters["vllm:spec_decode_num_draft_tokens_total"] == K * drafts
        # the MTP layer is built from its target (qwen3next): well above the ~0 a random layer accepts
        assert accepted / (K * drafts) > 0.2, counters
        assert sum(per_position) == accepted and per_position[0] > 0, per_position

        # the head it served is the one the repo ships apart from the shards, all of it and nothing else
        index = json.loads(ssh(provisioned, "cat /opt/sparkspec/models/sim-qwen3-next/model.safetensors.index.json"))
        mtp_map = {t: f for t, f in index["weight_map"].items() if t.startswith("mtp.")}
        assert set(mtp_map.values()) == {"model_extra_tensors.safetensors"}
        assert len(mtp_map) == qwen3next.expected_mtp_tensors()
    finally:
        back = play("baseline", skip_tags="verify")   # the inventory's method and profile
        assert back.returncode == 0, back.stdout[-3000:] + back.stderr
    rec = record(provisioned)
    assert (rec["method"], rec["profile"]) == ("baseline", "sim-tiny")
