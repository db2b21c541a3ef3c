"""`invoke compare` on a cluster (tasks.lib.cluster_target, tasks.compare.plan): the group or all
its members run every play as one, the head answers (status, results, reports/compare/<head>/), part
of a cluster is refused before anything runs, and a host that serves alone works as before.
Inventory parsing only: no container."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from invoke import Context, Exit

import tasks.compare
from sparkspec.errors import UserError
from tasks.compare.plan import CONTRACT, Row, check, parse, plan, plays, results
from tasks.lib.cluster_target import Target, resolve_target
from tasks.lib.inventory import load
from tests.conftest import ROOT

PAIR = ROOT / "inventories/sim-pair"
SIM = ROOT / "inventories/sim"
NAMES = tuple(f"sparkspec_{key}" for key in CONTRACT)


@pytest.mark.parametrize("host", ["spark_cluster", "pair-head,pair-worker",
                                  "pair-worker, pair-head", "sparks"])
def test_the_group_or_all_its_members_is_the_whole_cluster_with_its_head(host):
    inv = load(PAIR)
    target = resolve_target(inv, host)
    assert (target.pattern, target.head, target.members) == ("spark_cluster", "pair-head",
                                                              ("pair-head", "pair-worker"))
    # the play's --host names every member (tasks.host.run_play reads it as hosts_of does)
    assert inv.hosts_of(target.pattern) == ["pair-head", "pair-worker"]
    assert target.placement is not None and target.placement["me"] == "pair-head"
    nodes = target.placement["members"]
    assert list(nodes) == ["pair-head", "pair-worker"]
    assert (nodes["pair-head"]["role"], nodes["pair-worker"]["role"]) == ("head", "worker")


@pytest.mark.parametrize("host, missing", [("pair-head", "pair-worker"),
                                           ("pair-worker", "pair-head")])
def test_a_member_alone_is_refused_naming_the_missing_and_the_group(host, missing):
    with pytest.raises(UserError) as err:
        resolve_target(load(PAIR), host)
    line = str(err.value)
    assert "\n" not in line
    assert line == (f"--host {host}: cluster spark_cluster runs as one, and {missing} is missing; "
                    "pass the group: --host spark_cluster")


def test_a_host_that_serves_alone_is_its_own_head():
    for host in ("sim01", "sparks"):   # the host, or a group of one host that serves alone
        assert resolve_target(load(SIM), host) == Target("sim01", "sim01", ("sim01",), None)


def _mixed(tmp_path: Path) -> Path:
    """The pair's inventory with a Spark that serves alone beside the cluster."""
    folder = tmp_path / "inv"
    folder.mkdir()
    hosts = yaml.safe_load((PAIR / "hosts.yml").read_text())
    hosts["all"]["children"]["sparks"]["children"]["alone"] = {"hosts": {"solo01": {},
                                                                         "solo02": {}}}
    (folder / "hosts.yml").write_text(yaml.safe_dump(hosts))
    (folder / "group_vars").symlink_to(PAIR / "group_vars")
    return folder


def test_a_stranger_or_several_lone_hosts_are_refused(tmp_path):
    inv = load(_mixed(tmp_path))
    assert resolve_target(inv, "solo01") == Target("solo01", "solo01", ("solo01",), None)
    with pytest.raises(UserError,
                       match=r"^--host spark_cluster,solo01: solo01 is not in cluster "
                             r"spark_cluster \(pair-head, pair-worker\); name one cluster"):
        resolve_target(inv, "spark_cluster,solo01")
    with pytest.raises(UserError,
                       match=r"^--host alone: solo01, solo02 each serve alone; name one host"):
        resolve_target(inv, "alone")


def test_the_rows_resolve_as_each_node_of_the_cluster_does():
    """The play resolves a cluster's node with its group's members: compare's check must too
    (without them the registry finds no hosts in the group)."""
    inv = load(PAIR)
    target = resolve_target(inv, "spark_cluster")
    values = inv.host_vars(target.head, NAMES)
    rows = plan(parse("baseline,ngram", values["sparkspec_profile"]))
    resolved = check(rows, values, target.placement)
    assert [r["cluster"]["rank"] for r in resolved] == [0, 0]
    assert {r["cluster"]["head"]["host"] for r in resolved} == {"pair-head"}
    with pytest.raises(UserError, match="the group has no hosts"):
        check(rows, values)


def test_every_play_runs_on_the_whole_group_and_the_results_are_the_heads(tmp_path):
    target = resolve_target(load(PAIR), "pair-head,pair-worker")
    rows = plan(parse("ngram,baseline", "sim-tiny"))
    serving = Row("baseline", "sim-tiny")
    out = plays(target, rows, serving, tmp_path)
    assert [(p.row.name, p.hosts, p.verify_only) for p in out] == [
        ("baseline@sim-tiny", "spark_cluster", True), ("ngram@sim-tiny", "spark_cluster", False)]
    assert all(p.extra["verify_reports_dir"] == str(tmp_path) for p in out)
    assert [p.extra["verify_report_name"] for p in out] == ["baseline@sim-tiny", "ngram@sim-tiny"]
    assert results(target, tmp_path, rows[1]) == (
        tmp_path / "pair-head/ngram@sim-tiny.json",
        tmp_path / "pair-head/lossless/ngram@sim-tiny.json")


def test_a_host_alone_keeps_its_own_name_and_a_row_that_does_not_serve_switches(tmp_path):
    target = resolve_target(load(SIM), "sim01")
    rows = plan(parse("ngram", "sim-tiny"))   # a baseline row is added first
    out = plays(target, rows, None, tmp_path)
    assert [(p.row.name, p.row.added, p.hosts, p.verify_only) for p in out] == [
        ("baseline@sim-tiny", True, "sim01", False), ("ngram@sim-tiny", False, "sim01", False)]
    assert results(target, tmp_path, rows[0])[0] == tmp_path / "sim01/baseline@sim-tiny.json"


@pytest.mark.parametrize("host", ["pair-head", "pair-worker"])
def test_compare_refuses_part_of_a_cluster_before_anything_runs(monkeypatch, host):
    def never(*args, **kwargs):
        raise AssertionError("ran before --host was checked")

    monkeypatch.setattr(tasks.compare, "run_play", never)
    monkeypatch.setattr(tasks.compare, "host_status", never)
    with pytest.raises(Exit) as err:
        tasks.compare.compare(Context(), host=host, inventory=str(PAIR))
    assert err.value.code == 2
    message = str(err.value.message)
    assert message.startswith(f"sparkspec: error: --host {host}: cluster spark_cluster runs as one")
    assert "pass the group: --host spark_cluster" in message
