"""The development tooling's one entry point for the controller's tasks: `invoke sim.*` and `invoke
bench.*` (tasks/dev.py) call these plain functions, and nothing else under tasks/ or src/ reaches
into tests/ (tests/unit/project/test_import_graph.py checks it). A checkout without tests/ still
runs every host task.

Each function takes the tasks' own options, checks them as the harness's command line does (the
harnesses keep their `python -m tests.support.<name>` command lines for use by hand), and returns
the exit code or what it did.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.sim import Sim


def sim_up(root: Path, rebuild: bool = False) -> str:
    """Start the simulated Spark (its image built once; again with ``rebuild``); one line saying
    what ran."""
    sim = Sim(root)
    if rebuild:
        sim.down()
        sim.podman("rmi", "-f", sim.image, check=False)
    state = sim.up()
    return f"{sim.container} {state} (image {sim.image}, ssh root@127.0.0.1 -p {sim.ssh_port})"


def sim_down(root: Path) -> str:
    """Stop and remove the simulated Spark and its hub (the cached image stays); what it did."""
    return Sim(root).down()


def sim_pair_up(root: Path) -> str:
    """Start the simulated pair (sim01's image, built once) and its hub; one line saying what
    ran."""
    from tests.support.simpair import SimPair

    pair = SimPair(root)
    state = pair.up()
    nodes = ", ".join(f"{n.host} root@{n.address}:22" for n in pair.nodes)
    return f"{state} ({nodes}; hub {pair.hub.url}; inventory inventories/sim-pair)"


def sim_pair_down(root: Path) -> str:
    """Remove the simulated pair's containers and network and stop its hub (the image stays); what
    it did."""
    from tests.support.simpair import SimPair

    return SimPair(root).down()


def bench_checkpoint(root: Path, workdir: str, size_gb: float, repeats: int) -> int:
    """assemble against cp -r on the same disk (tests.support.ckpt_bench).

    A process of its own: assemble's peak RSS comes from wait4 on its child, and a child's ru_maxrss
    starts at its parent's size, so the parent must be the small harness, not invoke with Ansible
    and Fabric loaded."""
    argv = [sys.executable, "-m", "tests.support.ckpt_bench",
            "--workdir", str(Path(workdir).absolute()),
            "--size-gb", str(size_gb), "--repeats", str(repeats)]
    return subprocess.run(argv, cwd=root, check=False).returncode


def bench_client() -> int:
    """The bench client's parse ceiling against a local one-token-per-event server; prints the
    figures."""
    from tests.support import bench_ceiling

    json.dump(bench_ceiling.run(), sys.stdout, indent=2)
    print()
    return 0


def bench_vs_vllm(url: str, model: str, repeats: int, max_tokens: int, concurrency: int, suite: str,
                  vllm_python: str, output: str) -> int:
    """Side by side with `vllm bench serve` on one server (tests.support.bench_vs_vllm)."""
    from tests.support import bench_vs_vllm

    return bench_vs_vllm.main(["--url", url, "--model", model, "--repeats", str(repeats),
                               "--max-tokens", str(max_tokens), "--concurrency", str(concurrency),
                               "--suite", suite, "--vllm-python", vllm_python, "--output", output])


def bench_switch(host: str, inventory: str, to: str, back: str, repeats: int, output: str) -> int:
    """A method switch's cost beyond vLLM's stop and start, and a no-op provision's
    (tests.support.bench_switch). It times `invoke deploy` and `invoke provision` as processes of
    their own: the user's commands, as typed."""
    from tests.support import bench_switch

    return bench_switch.main(["--host", host, "--inventory", inventory, "--to", to, "--back", back,
                              "--repeats", str(repeats), "--output", output])


def bench_cold_start(host: str, inventory: str, repeats: int, compile_: bool, output: str) -> int:
    """A cold start (compile cache emptied) against a warm one (tests.support.bench_cold_start)."""
    from tests.support import bench_cold_start

    return bench_cold_start.main(["--host", host, "--inventory", inventory,
                                  "--repeats", str(repeats), "--output", output]
                                 + (["--compile"] if compile_ else []))
