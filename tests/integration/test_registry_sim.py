"""Methods as data, on the simulated Spark: a method defined only in an inventory (ngram5) renders,
deploys and is served; and what wins between the inventory's method and a switch (`invoke deploy
--method`), recorded on the host and kept by a later provision. The tests run in file order and
leave the host serving baseline."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import BIN, ROOT, run_cli

pytestmark = [pytest.mark.sim, pytest.mark.slow]

UNIT = "sparkspec-vllm"
DESIRED = f"/etc/sparkspec/{UNIT}.desired.json"
NGRAM5 = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 5,
                                 "prompt_lookup_min": 2, "prompt_lookup_max": 5}}


@pytest.fixture(scope="module")
def ngram5_inventory(tmp_path_factory) -> Path:
    """A copy of inventories/sim that defines ngram5 (and nothing else new)."""
    inv = tmp_path_factory.mktemp("inv") / "sim"
    shutil.copytree(ROOT / "inventories/sim", inv)
    hosts = yaml.safe_load((inv / "hosts.yml").read_text())
    sim01 = hosts["all"]["children"]["sparks"]["hosts"]["sim01"]
    sim01["ansible_ssh_private_key_file"] = str(ROOT / ".sim/id_ed25519")
    (inv / "hosts.yml").write_text(yaml.safe_dump(hosts))
    group_vars = yaml.safe_load((inv / "group_vars/all.yml").read_text())
    group_vars["sparkspec_methods"] = {"ngram5": NGRAM5}
    (inv / "group_vars/all.yml").write_text(yaml.safe_dump(group_vars))
    return inv


def ssh(sim, command: str, check: bool = True) -> str:
    result = run_cli(*sim.ssh_argv(command), timeout=120)
    assert result.returncode == 0 or not check, f"{command}: {result.stderr}"
    return result.stdout.strip()


def invoke(*argv: str, timeout: float = 1200):
    return run_cli(f"{BIN}/invoke", *argv, timeout=timeout)


def served_spec(sim) -> dict | None:
    """The --speculative-config of the process the unit runs now (its command line, not a file
    about it)."""
    pid = ssh(sim, f"systemctl show -p MainPID --value {UNIT}")
    args = ssh(sim, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines()
    if "--speculative-config" not in args:
        return None
    return json.loads(args[args.index("--speculative-config") + 1])


def test_unknown_method_lists_the_inventorys_own(ngram5_inventory):
    result = invoke("deploy", "--host", "sim01", "--method", "ngram6", "--inventory",
                    str(ngram5_inventory))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "sparkspec: error: unknown method 'ngram6'; choose one "
        "of baseline, dflash, eagle3, mtp, ngram, ngram5")


def test_ngram5_renders(ngram5_inventory, tmp_path):
    result = invoke("render", "--host", "sim01", "--method", "ngram5", "--dest", str(tmp_path),
                    "--inventory", str(ngram5_inventory))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr
    record = json.loads((tmp_path / f"etc/sparkspec/{UNIT}.json").read_text())
    assert record["method"] == "ngram5"
    spec = record["args"][record["args"].index("--speculative-config") + 1]
    assert json.loads(spec) == NGRAM5["speculative_config"]
    assert "(ngram5)" in (tmp_path / f"etc/systemd/system/{UNIT}.service").read_text()


def test_ngram5_deploys_and_is_served(provisioned, ngram5_inventory):
    result = invoke("deploy", "--host", "sim01", "--method", "ngram5", "--inventory",
                    str(ngram5_inventory), "--skip-tags", "verify")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr
    assert served_spec(provisioned) == NGRAM5["speculative_config"]
    desired = json.loads(ssh(provisioned, f"cat {DESIRED}"))
    assert (desired["method"], desired["inventory_method"]) == ("ngram5", "baseline")
    result = invoke("status", "--host", "sim01", "--json", "--inventory", str(ngram5_inventory))
    assert result.returncode == 0, result.stdout + result.stderr
    [status] = json.loads(result.stdout)
    assert (status["method"], status["desired_method"], status["inventory_method"],
            status["health"]) == ("ngram5", "ngram5", "baseline", 200)


def test_a_switch_survives_a_provision_and_the_play_says_so(provisioned, ngram5_inventory):
    """The ngram5 switch (the test before leaves it serving; deployed here when run alone)."""
    if served_spec(provisioned) != NGRAM5["speculative_config"]:
        result = invoke("deploy", "--host", "sim01", "--method", "ngram5", "--inventory",
                        str(ngram5_inventory), "--skip-tags", "verify")
        assert result.returncode == 0, result.stdout[-5000:] + result.stderr
    assert json.loads(ssh(provisioned, f"cat {DESIRED}"))["method"] == "ngram5"
    result = invoke("provision", "--host", "sim01", "--inventory", str(ngram5_inventory),
                    "--skip-tags", "verify", timeout=1800)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr
    out = result.stdout + result.stderr
    assert ("the switch wins while the inventory still says baseline); go back with: "
            "invoke deploy --method baseline") in " ".join(out.split())
    assert served_spec(provisioned) == NGRAM5["speculative_config"]
    assert json.loads(ssh(provisioned, f"cat /etc/sparkspec/{UNIT}.json"))["method"] == "ngram5"


def test_going_back_to_the_inventorys_method_removes_the_record(provisioned, ngram5_inventory):
    result = invoke("deploy", "--host", "sim01", "--method", "baseline", "--inventory",
                    str(ngram5_inventory), "--skip-tags", "verify")
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr
    assert served_spec(provisioned) is None
    assert ssh(provisioned, f"test -e {DESIRED} && echo present || echo absent") == "absent"
    assert json.loads(ssh(provisioned, f"cat /etc/sparkspec/{UNIT}.json"))["method"] == "baseline"
