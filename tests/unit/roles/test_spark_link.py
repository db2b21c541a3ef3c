"""The optional link role (roles/spark_link): its netplan file for a head and a worker, rendered by
Ansible's own templating; its checks, one line each; real plays (connection=local) that show it off
by default, its check mode and its file; netplan's own generator on the file where one is installed;
its defaults against their facts (docs/spark-facts.md)."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from sparkspec.registry import cluster as registry_cluster
from tasks.lib.play import failure_summary, run_playbook
from tests.support import facts as facts_file

ROOT = Path(__file__).resolve().parents[3]
ROLE = ROOT / "roles" / "spark_link"
DEFAULTS: dict[str, Any] = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
ROLE_VARS: dict[str, Any] = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())
HEAD = {"role": "head", "interface": "enp1s0f0np0", "address": "192.168.100.10",
        "rdma_devices": ["rocep1s0f0", "roceP2p1s0f0"]}
WORKER = {**HEAD, "role": "worker", "address": "192.168.100.11"}


def _templar(host: str, **variables: Any) -> Any:
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template

    role_vars = {k: trust_as_template(v) if isinstance(v, str) else v for k, v in ROLE_VARS.items()}
    fixed = {"ansible_managed": "Ansible managed", "inventory_hostname": host}
    return Templar(loader=DataLoader(), variables={**DEFAULTS, **role_vars, **fixed, **variables})


def render(host: str, **variables: Any) -> str:
    from ansible.template import trust_as_template

    source = (ROLE / "templates" / "link.yaml.j2").read_text()
    return str(_templar(host, **variables).template(trust_as_template(source)))


def problems(**variables: Any) -> list[str]:
    from ansible.template import trust_as_template

    out = _templar("n1", **variables).template(trust_as_template("{{ _spark_link_problems }}"))
    return [" ".join(p.split()) for p in out]


@pytest.mark.parametrize(("host", "node"), [("spark01", HEAD), ("spark02", WORKER)])
def test_the_file_is_what_netplan_reads(host: str, node: dict[str, Any]) -> None:
    text = render(host, sparkspec_cluster_node=node)
    assert text.startswith("#\n# Ansible managed\n#\n")
    assert yaml.safe_load(text) == {"network": {"version": 2, "ethernets": {node["interface"]: {
        "dhcp4": False, "addresses": [f"{node['address']}/24"], "mtu": 9000}}}}
    # the other knobs land where netplan reads them; a string MTU from -e becomes a number
    other = yaml.safe_load(render(host,
                                  sparkspec_cluster_node={**node, "interface": "enP2p1s0f0np0"},
                                  spark_link_mtu="4200", spark_link_prefix=30,
                                  spark_link_renderer="NetworkManager"))["network"]
    assert other == {"version": 2, "renderer": "NetworkManager", "ethernets": {"enP2p1s0f0np0": {
        "dhcp4": False, "addresses": [f"{node['address']}/30"], "mtu": 4200}}}


def test_good_values_pass() -> None:
    assert problems(sparkspec_cluster_node=HEAD) == []
    assert problems(sparkspec_cluster_node=WORKER, spark_link_mtu="1280", spark_link_prefix=1) == []
    assert problems(sparkspec_cluster_node=HEAD, spark_link_mtu=9216, spark_link_prefix="30") == []


@pytest.mark.parametrize(("variables", "line"), [
    ({"sparkspec_cluster_node": "enp1s0f0np0"},
     "sparkspec_cluster_node is not a mapping; give {role, interface, address, rdma_devices} "
     "(docs/cluster.md)"),
    ({"sparkspec_cluster_node": {**HEAD, "interface": "enp1s0/f0"}},
     "sparkspec_cluster_node.interface \"enp1s0/f0\" is not a network interface name (1-15 "
     "letters, digits, '_.-'); give the link's interface, e.g. enp1s0f0np0"),
    ({"sparkspec_cluster_node": {**HEAD, "interface": "a" * 16}},
     "sparkspec_cluster_node.interface \"aaaa"),
    ({"sparkspec_cluster_node": {**HEAD, "address": "fe80::1"}},
     "sparkspec_cluster_node.address \"fe80::1\" is not an IPv4 address; give this node's "
     "address on the link, e.g. 192.168.100.10 (the link role writes IPv4 only)"),
    ({"sparkspec_cluster_node": {k: v for k, v in HEAD.items() if k != "address"}},
     "sparkspec_cluster_node.address null is not an IPv4 address"),
    ({"spark_link_mtu": 1279},
     "spark_link_mtu 1279 is not a whole number from 1280 to 9216; give the link's MTU, the same "
     "on every node (9000: jumbo frames, docs/spark-facts.md)"),
    ({"spark_link_mtu": 9217}, "spark_link_mtu 9217 is not a whole number"),
    ({"spark_link_mtu": "9000.5"}, "spark_link_mtu \"9000.5\" is not a whole number"),
    ({"spark_link_mtu": True}, "spark_link_mtu true is not a whole number"),
    ({"spark_link_prefix": 31},
     "spark_link_prefix 31 is not a whole number from 1 to 30; give the prefix length of the "
     "link's addresses (24, as in NVIDIA's netplan file)"),
    ({"spark_link_prefix": 0}, "spark_link_prefix 0 is not a whole number from 1 to 30"),
    ({"spark_link_prefix": "/24"}, "spark_link_prefix \"/24\" is not a whole number"),
    ({"spark_link_netplan_file": "60-link.yml"},
     "spark_link_netplan_file \"60-link.yml\" is not a file name ending in .yaml"),
    ({"spark_link_netplan_file": "../60-link.yaml"}, "spark_link_netplan_file \"../60-link.yaml\""),
])
def test_a_bad_value_is_one_line_naming_it(variables: dict[str, Any], line: str) -> None:
    found = problems(**{"sparkspec_cluster_node": HEAD, **variables})
    assert len(found) == 1 and found[0].startswith(line), found


def test_the_patterns_are_the_registrys() -> None:
    """The interface rule is the registry's (what lands in NCCL_SOCKET_IFNAME); the address rule
    takes what Python's ipaddress takes as IPv4, and nothing else."""
    assert ROLE_VARS["_spark_link_ifname_re"] == f"^{registry_cluster._IFNAME.pattern}$"
    ipv4 = re.compile(ROLE_VARS["_spark_link_ipv4_re"])
    for text in ["192.168.100.10", "10.0.0.1", "0.0.0.0", "255.255.255.255", "256.1.1.1",
                 "01.2.3.4", "1.2.3", "1.2.3.4.5", "1.2.3.4 ", "fe80::1", "::ffff:1.2.3.4",
                 "a.b.c.d", ""]:
        try:
            ok = isinstance(ipaddress.ip_address(text), ipaddress.IPv4Address)
        except ValueError:
            ok = False
        assert bool(ipv4.match(text)) == ok, text


def test_the_defaults_are_the_facts() -> None:
    facts = {name: fact["value"] for name, fact in facts_file.load().items()}
    assert DEFAULTS["spark_link_mtu"] == facts["link_mtu"]
    assert DEFAULTS["spark_link_prefix"] == facts["link_prefix"]
    assert DEFAULTS["spark_link_manage"] is False          # off by default (issue 24)
    low, high = facts["link_busbw_gb_s"]
    assert f"busbw about {low}-{high} GB/s" in \
        " ".join((ROOT / "docs/cluster.md").read_text().split())


# --- real plays -----------------------------------------------------------------------------------

def _inventory(tmp_path: Path, hosts: dict[str, dict[str, Any]]) -> Path:
    local = {"ansible_connection": "local",
             "ansible_python_interpreter": "{{ ansible_playbook_python }}",
             "spark_link_apply": False}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump({"all": {"hosts": {h: {**local, **v}
                                                      for h, v in hosts.items()}}}))
    return path


def _dir(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return folder


def test_the_role_writes_only_when_asked(tmp_path: Path) -> None:
    book = tmp_path / "link.yml"
    book.write_text(yaml.safe_dump([{"name": "Link", "hosts": "all", "gather_facts": False,
                                     "roles": [{"role": str(ROLE)}]}]))
    dirs = {name: _dir(tmp_path, name) for name in ("head1", "worker1", "off1", "alone1", "check1")}
    inventory = _inventory(tmp_path, {
        "head1": {"spark_link_manage": True, "spark_link_netplan_dir": str(dirs["head1"]),
                  "sparkspec_cluster_node": HEAD},
        "worker1": {"spark_link_manage": "true", "spark_link_netplan_dir": str(dirs["worker1"]),
                    "sparkspec_cluster_node": WORKER},
        # off by default: nothing, even with a node and bad values
        "off1": {"spark_link_netplan_dir": str(dirs["off1"]), "spark_link_mtu": "x",
                 "sparkspec_cluster_node": HEAD},
        # not in a cluster: nothing
        "alone1": {"spark_link_manage": True, "spark_link_netplan_dir": str(dirs["alone1"])},
        # check mode: it would write, and does not; the handler would run netplan apply (absent
        # here), and check mode skips it
        "check1": {"spark_link_manage": True, "spark_link_netplan_dir": str(dirs["check1"]),
                   "spark_link_apply": True, "sparkspec_cluster_node": WORKER},
    })
    first = run_playbook(book, inventory, "head1,worker1,off1,alone1", quiet=True)
    assert (first.rc, first.failures) == (0, [])
    assert first.changed == {"head1": 1, "worker1": 1, "off1": 0, "alone1": 0}
    for host, node in (("head1", HEAD), ("worker1", WORKER)):
        written = dirs[host] / DEFAULTS["spark_link_netplan_file"]
        assert written.stat().st_mode & 0o777 == 0o600
        assert written.read_text() == render(host, sparkspec_cluster_node=node)
    assert list(dirs["off1"].iterdir()) == list(dirs["alone1"].iterdir()) == []

    check = run_playbook(book, inventory, "head1,check1,off1", check=True, quiet=True)
    assert (check.rc, check.failures) == (0, [])
    assert check.changed == {"head1": 0, "check1": 1, "off1": 0}     # head1's file is already right
    assert list(dirs["check1"].iterdir()) == list(dirs["off1"].iterdir()) == []


def test_a_bad_value_stops_the_node_with_one_line(tmp_path: Path) -> None:
    book = tmp_path / "link.yml"
    book.write_text(yaml.safe_dump([{"name": "Link", "hosts": "all", "gather_facts": False,
                                     "roles": [{"role": str(ROLE)}]}]))
    folder = _dir(tmp_path, "bad1")
    inventory = _inventory(tmp_path, {"bad1": {"spark_link_manage": True, "spark_link_mtu": 1500000,
                                               "spark_link_netplan_dir": str(folder),
                                               "sparkspec_cluster_node": HEAD}})
    result = run_playbook(book, inventory, "bad1", quiet=True)
    assert result.rc != 0
    assert failure_summary(result, "bad1") == (
        "bad1: spark_link_mtu 1500000 is not a whole number from 1280 to 9216; give the link's "
        "MTU, the same on every node (9000: jumbo frames, docs/spark-facts.md)")
    assert list(folder.iterdir()) == []


def _generator() -> list[str] | None:
    """netplan's generator: `netplan generate` where netplan is installed, or the command in
    SPARK_LINK_NETPLAN_GENERATE (e.g. an unpacked netplan.io's /usr/libexec/netplan/generate)."""
    if os.environ.get("SPARK_LINK_NETPLAN_GENERATE"):
        return os.environ["SPARK_LINK_NETPLAN_GENERATE"].split()
    netplan = shutil.which("netplan")
    return [netplan, "generate"] if netplan else None


@pytest.mark.skipif(_generator() is None,
                    reason="netplan is not installed (set SPARK_LINK_NETPLAN_GENERATE)")
def test_netplan_generates_the_link(tmp_path: Path) -> None:
    command = _generator()
    assert command is not None
    for host, node in (("spark01", HEAD), ("spark02", WORKER)):
        root = tmp_path / host
        (root / "etc/netplan").mkdir(parents=True)
        path = root / "etc/netplan" / DEFAULTS["spark_link_netplan_file"]
        path.write_text(render(host, sparkspec_cluster_node=node))
        path.chmod(0o600)
        proc = subprocess.run([*command, "--root-dir", str(root)], capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 0, proc.stderr
        network = (root / f"run/systemd/network/10-netplan-{node['interface']}.network").read_text()
        link = (root / f"run/systemd/network/10-netplan-{node['interface']}.link").read_text()
        assert f"Address={node['address']}/24" in network.splitlines()
        assert "MTUBytes=9000" in link.splitlines()
    # the generator refuses what the role's check refuses (it is a real check, not a stub)
    bad = tmp_path / "bad"
    (bad / "etc/netplan").mkdir(parents=True)
    text = render("spark01", sparkspec_cluster_node=HEAD).replace("/24", "/33")
    (bad / "etc/netplan/60-sparkspec-link.yaml").write_text(text)
    proc = subprocess.run([*command, "--root-dir", str(bad)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode != 0
