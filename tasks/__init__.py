"""Invoke tasks, the commands a Spark owner types: this module assembles the collection from host,
compare/, tune/, upgrade/, report, observe, dev and molecule_tasks, over the shared libraries in
lib/ (docs/design.md)."""

from __future__ import annotations

import io
import sys

from invoke import Collection

from tasks import compare, dev, host, molecule_tasks, observe, report, tune, upgrade

# Each line reaches a pipe or a log when it is printed (`invoke tune ... | tee tune.log` shows each
# step as it starts, in order with the play's output, which the runner writes to the same stream),
# not in 8 KiB blocks.
for _stream in (sys.stdout, sys.stderr):
    if isinstance(_stream, io.TextIOWrapper):
        _stream.reconfigure(line_buffering=True)

bench = Collection("bench")
bench.add_task(dev.bench_checkpoint, "checkpoint")
bench.add_task(dev.bench_client, "client")
bench.add_task(dev.bench_vs_vllm, "vs-vllm")
bench.add_task(dev.bench_switch, "switch")
bench.add_task(dev.bench_cold_start, "cold-start")

sim = Collection("sim")
sim.add_task(dev.sim_up, "up")
sim.add_task(dev.sim_down, "down")
sim.add_task(dev.sim_pair_up, "pair-up")
sim.add_task(dev.sim_pair_down, "pair-down")
sim.add_task(dev.sim_ssh, "ssh")

ns = Collection(host.provision, host.deploy, host.render, host.teardown, observe.status,
                host.verify, host.monitoring, upgrade.upgrade, upgrade.rollback,
                observe.logs, compare.compare, tune.tune, report.report, dev.lint, dev.test,
                molecule_tasks.molecule,
                sim, bench)
ns.configure({"sparkspec": {"inventory": "inventories/sim", "sim_host": "sim01"}})
