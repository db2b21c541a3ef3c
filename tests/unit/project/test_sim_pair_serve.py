"""The simulated pair's serve knobs are sim01's plus float32 (its group_vars/spark_cluster.yml says
why): its group's value replaces sim01's whole, so a knob changed in one file and not the other
would let the pair serve differently from what the single-node reference and sim01's tests
assume."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]


def test_the_pair_serves_sim01_s_knobs_in_float32() -> None:
    sim = yaml.safe_load(
        (ROOT / "inventories/sim/group_vars/all.yml").read_text())["sparkspec_serve"]
    pair = yaml.safe_load((ROOT / "inventories/sim-pair/group_vars/spark_cluster.yml").read_text())
    assert pair["sparkspec_serve"] == \
        {**sim, "extra_args": [*sim["extra_args"], "--dtype", "float32"]}
