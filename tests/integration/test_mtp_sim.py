"""The sim-mtp profile (a tiny Qwen3-Next with one MTP layer, tests/support/qwen3next.py) as the
provision staged it on the simulated Spark. Its repo ships the MTP head in
model_extra_tensors.safetensors without listing it, as Intel's INT4 AutoRound repos do; the profile
is a hybrid without an fp8 source, so the served checkpoint is what `checkpoint assemble` wrote (no
layer in FP8, no mtp.* tensor) plus exactly the head `checkpoint add-mtp` registered.

That this MTP serves through the real unit (drafts, accepted tokens per position, lossless against
baseline on sim-mtp) is proven by the five-row compare (tests/integration/test_compare.py, row
mtp@sim-mtp), which serves it once for the whole suite. Without add-mtp's entries vLLM 0.32 does not
start MTP at all ("Following weights were not initialized from checkpoint",
tests/integration/test_hybrid_cpu.py), so that row serves what add-mtp registered.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.support import qwen3next

pytestmark = [pytest.mark.sim]

MODEL = "/opt/sparkspec/models/sim-qwen3-next"
SOURCE = "/opt/sparkspec/models/sources/sparkspec--sim-qwen3-next"
EXTRA = "model_extra_tensors.safetensors"
HEADER = ("import json, struct, sys; f = open(sys.argv[1], 'rb'); "
          "n = struct.unpack('<Q', f.read(8))[0]; "
          "print(json.dumps(sorted(k for k in json.loads(f.read(n)) if k != '__metadata__')))")


def ssh(sim, command: str) -> str:
    result = run_cli(*sim.ssh_argv(command), timeout=120)
    assert result.returncode == 0, f"{command}: {result.stderr}"
    return result.stdout


def test_served_mtp_head_is_exactly_what_add_mtp_registered(provisioned):
    source_index = json.loads(ssh(provisioned, f"cat {SOURCE}/model.safetensors.index.json"))
    # the repo does not list it
    assert not any(t.startswith("mtp.") for t in source_index["weight_map"])
    head = json.loads(ssh(provisioned, f"python3 -c \"{HEADER}\" {SOURCE}/{EXTRA}"))
    assert (len(head) == qwen3next.expected_mtp_tensors()
            and all(t.startswith("mtp.") for t in head))

    index = json.loads(ssh(provisioned, f"cat {MODEL}/model.safetensors.index.json"))
    mtp_map = {t: f for t, f in index["weight_map"].items() if t.startswith("mtp.")}
    assert sorted(mtp_map) == head and set(mtp_map.values()) == {EXTRA}
    # assemble wrote the rest (its manifest maps no mtp.* tensor); add-mtp placed the head file
    # beside it
    manifest = json.loads(ssh(provisioned, f"cat {MODEL}/sparkspec-manifest.json"))
    assert (manifest["weight_map"]
            and not any(t.startswith("mtp.") for t in manifest["weight_map"]))
    assert ssh(provisioned,
               f"cmp {SOURCE}/{EXTRA} {MODEL}/{EXTRA} && echo same").strip() == "same"
    config = json.loads(ssh(provisioned, f"cat {MODEL}/config.json"))
    assert config["num_nextn_predict_layers"] >= 1
    assert config["sparkspec_hybrid"]["fp8_layers"] == [] and "quantization_config" not in config
