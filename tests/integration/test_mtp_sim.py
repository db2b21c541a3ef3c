"""The sim-mtp profile (a tiny Qwen3-Next with one MTP layer, tests/support/qwen3next.py) as the provision staged
it on the simulated Spark: its index maps every MTP tensor of the repo's extra file, and nothing else there.

That MTP serves through the real unit (drafts, accepted tokens per position, lossless against baseline on
sim-mtp) is proven by the five-row compare (tests/integration/test_compare.py, row mtp@sim-mtp), which serves
it once for the whole suite.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.support import qwen3next

pytestmark = [pytest.mark.sim]


def ssh(sim, command: str) -> str:
    result = run_cli(*sim.ssh_argv(command), timeout=120)
    assert result.returncode == 0, f"{command}: {result.stderr}"
    return result.stdout


def test_staged_mtp_profile_maps_its_whole_mtp_head(provisioned):
    index = json.loads(ssh(provisioned, "cat /opt/sparkspec/models/sim-qwen3-next/model.safetensors.index.json"))
    mtp_map = {t: f for t, f in index["weight_map"].items() if t.startswith("mtp.")}
    assert set(mtp_map.values()) == {"model_extra_tensors.safetensors"}
    assert len(mtp_map) == qwen3next.expected_mtp_tensors()
    config = json.loads(ssh(provisioned, "cat /opt/sparkspec/models/sim-qwen3-next/config.json"))
    assert config["num_nextn_predict_layers"] >= 1
