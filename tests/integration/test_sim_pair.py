"""The simulated pair: two nodes that reach each other over their bridge, the controller over SSH
on each node's address, and the pair's hub from inside each node, let in only with the token."""

from __future__ import annotations

import secrets
import subprocess
from pathlib import Path

import pytest

from sparkspec.errors import UserError
from tests.support.simpair import SimPair

ROOT = Path(__file__).resolve().parents[2]
PROBE_PORT = 8765


def ssh(pair: SimPair, host: str, command: str,
        stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(pair.ssh_argv(host, command), input=stdin, capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.mark.sim
def test_controller_reaches_each_node_over_ssh(sim_pair: SimPair) -> None:
    for node in sim_pair.nodes:
        proc = ssh(sim_pair, node.host, "hostname; ip -4 -o addr show eth0")
        assert proc.returncode == 0, proc.stderr
        hostname, addr = proc.stdout.splitlines()
        assert hostname == node.host
        assert f" {node.address}/24 " in addr


@pytest.mark.sim
@pytest.mark.parametrize("server,client",
                         [("pair-head", "pair-worker"), ("pair-worker", "pair-head")])
def test_nodes_reach_each_other(sim_pair: SimPair, server: str, client: str) -> None:
    """A listener on one node answers the other, by address and by hostname, with what the server
    holds."""
    marker = secrets.token_hex(8)
    unit = "sparkspec-pair-probe"
    start = (f"mkdir -p /tmp/probe && echo {marker} > /tmp/probe/marker && "
             f"systemd-run --unit={unit} "
             f"python3 -m http.server {PROBE_PORT} --directory /tmp/probe")
    assert ssh(sim_pair, server, start).returncode == 0
    try:
        for target in (sim_pair.node(server).address, server):
            fetch = (f"for i in $(seq 50); do curl -fsS http://{target}:{PROBE_PORT}/marker "
                     "&& exit 0; sleep 0.2; done; exit 1")
            proc = ssh(sim_pair, client, fetch)
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.strip() == marker
    finally:
        ssh(sim_pair, server, f"systemctl stop {unit}")


@pytest.mark.sim
def test_hub_answers_inside_each_node_with_the_token_only(sim_pair: SimPair) -> None:
    url = f"{sim_pair.hub.url}/api/models/sparkspec/sim-tiny"
    assert url.startswith(f"http://{sim_pair.gateway}:")
    curl = f"curl -sS -o /dev/null -m 10 -w '%{{http_code}}' -H @- {url}"
    header = f"Authorization: Bearer {sim_pair.hub.ensure_token()}\n"
    for node in sim_pair.nodes:
        assert sim_pair.hub_status(node.host) == "200"
        assert ssh(sim_pair, node.host, curl, stdin=header).stdout == "200"
        assert ssh(sim_pair, node.host, curl, stdin="X-Nothing: 1\n").stdout == "401"


def test_subnet_env_moves_every_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARKSPEC_PAIR_SUBNET", "10.90.5.0/24")
    pair = SimPair(ROOT)
    assert [n.address for n in pair.nodes] == ["10.90.5.10", "10.90.5.11"]
    assert (pair.subnet, pair.gateway) == ("10.90.5.0/24", "10.90.5.1")
    assert pair.hub.url.startswith("http://10.90.5.1:")
    options = pair.run_options(pair.node("worker"))
    assert "host" not in options
    assert options[options.index("--ip") + 1] == "10.90.5.11"


@pytest.mark.parametrize("value", ["10.90.5.0/16", "10.90.5.7/24", "fd00::/120", "pair"])
def test_subnet_env_refuses_anything_but_an_ipv4_slash_24(monkeypatch: pytest.MonkeyPatch,
                                                          value: str) -> None:
    monkeypatch.setenv("SPARKSPEC_PAIR_SUBNET", value)
    with pytest.raises(UserError, match="SPARKSPEC_PAIR_SUBNET="):
        SimPair(ROOT)
