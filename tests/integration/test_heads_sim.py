"""EAGLE3 and DFlash heads on the simulated Spark: the heads the simulated hub publishes
(tests/support/heads.py) are fetched by checkpoint_fetch like real heads, and the deploy role checks
a head against the served model before anything changes. Serving them (drafts, lossless against
baseline, the distilled EAGLE3's acceptance) is the five-row compare's job (test_compare.py), which
serves each method once for the whole suite."""

from __future__ import annotations

import json

import pytest

from tasks.lib import inventory
from tasks.lib.play import failure_summary, run_playbook
from tests.conftest import ROOT, run_cli
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
def test_fetched_head_is_the_published_one(provisioned, method):
    """The provision fetched each head from the simulated hub like a real head: where the resolver
    puts it, the generated config byte for byte, a revision marker. That the heads serve (drafts,
    lossless against baseline, the distilled EAGLE3's accepted tokens per position) is proven by the
    five-row compare (test_compare.py)."""
    heads_dir = inventory.load("inventories/sim").host_vars(
        SIM, ("sparkspec_heads_dir",))["sparkspec_heads_dir"]
    folder = HEADS[method].replace("/", "--")
    local = json.loads((ROOT / ".sim/gen" / folder / "config.json").read_text())
    assert json.loads(_ssh(provisioned, f"cat {heads_dir}/{folder}/config.json")) == local
    assert _ssh(provisioned,
                f"test -s {heads_dir}/{folder}/.sparkspec-revision && echo ok").strip() == "ok"
    if method == "dflash":
        assert local["dflash_config"]["block_size"] == heads.DFLASH_BLOCK


def test_bad_head_is_refused_before_the_unit_changes(provisioned):
    """A DFlash head without dflash_config (a copy of the fetched one, corrupted on the host, named
    by the profile through extra vars) fails the deploy's validation in one line; the unit keeps
    serving what it served."""
    before = _ssh(provisioned, "cat /etc/sparkspec/sparkspec-vllm.json; "
                               "systemctl show -p MainPID --value sparkspec-vllm")
    folder = HEADS["dflash"].replace("/", "--")
    heads_dir = inventory.load("inventories/sim").host_vars(
        SIM, ("sparkspec_heads_dir",))["sparkspec_heads_dir"]
    good = f"{heads_dir}/{folder}"
    bad = good + "-bad"
    profiles = inventory.load("inventories/sim").host_vars(
        SIM, ("sparkspec_profiles",))["sparkspec_profiles"]
    profiles["sim-tiny"]["heads"]["dflash"] = {"repo": HEADS["dflash"] + "-bad", "revision": "main"}
    strip = ("import json,sys; d=json.load(open(sys.argv[1])); d.pop('dflash_config'); "
             "json.dump(d, open(sys.argv[1], 'w'))")
    _ssh(provisioned,
         f"rm -rf {bad} && cp -a {good} {bad} && python3 -c \"{strip}\" {bad}/config.json")
    try:
        result = run_playbook(ROOT / "playbooks" / "deploy-dflash.yml",
                              ROOT / "inventories" / "sim", SIM,
                              extra_vars={"sparkspec_profiles": profiles}, quiet=True)
    finally:
        _ssh(provisioned, f"rm -rf {bad}")
    message = failure_summary(result, SIM)   # from the runner's events: the failed task's message
    assert result.rc != 0 and result.failed == {SIM: 1}, result
    assert message.startswith(f"sparkspec: error: {bad}/config.json: no dflash_config"), message
    assert "Traceback" not in message
    assert _ssh(provisioned, "cat /etc/sparkspec/sparkspec-vllm.json; "
                             "systemctl show -p MainPID --value sparkspec-vllm") == before
