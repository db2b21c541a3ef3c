"""A copy of the simulated Spark's inventory with some values changed (tests only): the same
sim01, reached with the checkout's key, for a test that must not edit inventories/sim."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def sim_inventory_copy(dest: Path,
                       mutate: Callable[[dict[str, Any], dict[str, Any]], None]) -> Path:
    """inventories/sim copied to ``dest``/inv; ``mutate(sim01's host vars, group vars)`` edits the
    copy."""
    inv = dest / "inv"
    shutil.copytree(ROOT / "inventories/sim", inv)
    hosts = yaml.safe_load((inv / "hosts.yml").read_text())
    sim01 = hosts["all"]["children"]["sparks"]["hosts"]["sim01"]
    sim01["ansible_ssh_private_key_file"] = str(ROOT / ".sim/id_ed25519")
    group_vars = yaml.safe_load((inv / "group_vars/all.yml").read_text())
    mutate(sim01, group_vars)
    (inv / "hosts.yml").write_text(yaml.safe_dump(hosts))
    (inv / "group_vars/all.yml").write_text(yaml.safe_dump(group_vars))
    return inv
