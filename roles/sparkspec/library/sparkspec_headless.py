#!/usr/bin/python
"""sparkspec_headless: serve headless (the default target multi-user, the display manager stopped), with the
memory that freed, or put back what was there before; the record says both."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sparkspec_host import atomic_write, mem_available, read_json, systemd_show

DOCUMENTATION = r"""
module: sparkspec_headless
short_description: Serve headless, measuring the memory it frees, or put back the target and display manager
description:
  - present sets the default target to C(target) and stops a running display manager
    (display-manager.service), and records what was there (the default target, the display manager and whether
    it ran) and MemAvailable before and after the stop. absent puts back what the record says and removes it.
    SSH is not touched.
options:
  state: {description: present (headless) or absent (as before), type: str, required: true,
          choices: [present, absent]}
  target: {description: the systemd target to boot into, type: str, default: multi-user.target}
  record: {description: the record's file (root's), type: path, required: true}
  settle_s: {description: seconds to wait after the stop before MemAvailable is read again, type: float,
             default: 5}
author: sparkspec
"""

RETURN = r"""
record: {description: the record (null once absent), type: dict, returned: always}
"""

DM = "display-manager.service"
UNIT = re.compile(r"[A-Za-z0-9@._-]{1,200}\.(target|service)")


def _systemctl(module: AnsibleModule, *args: str) -> str:
    result = subprocess.run(["systemctl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0 and args[0] != "get-default":
        module.fail_json(msg=f"systemctl {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result.stdout.strip()


def _record(module: AnsibleModule, path: str) -> dict[str, Any] | None:
    """The record left by an earlier run, checked: every unit name it holds is a plain unit name."""
    if not os.path.lexists(path):
        return None
    doc = read_json(path) if os.path.isfile(path) and not os.path.islink(path) else None
    names = ([doc.get("previous_default"), doc.get("display_manager") or "x.service"]
             if isinstance(doc, dict) else [])
    if not names or not all(isinstance(n, str) and UNIT.fullmatch(n) for n in names):
        module.fail_json(msg=f"{path} is not a headless record sparkspec wrote; remove it after checking the "
                             "host's default target (systemctl get-default) and display manager")
    return doc


def present(module: AnsibleModule, record: dict[str, Any] | None) -> dict[str, Any]:
    p = module.params
    default = _systemctl(module, "get-default")
    dm = systemd_show(DM, ["Id", "LoadState", "ActiveState"])
    running = dm.get("LoadState") == "loaded" and dm.get("ActiveState") in ("active", "activating",
                                                                            "reloading")
    if record is None:
        record = {"previous_default": default if UNIT.fullmatch(default) else "graphical.target",
                  "display_manager": dm.get("Id") if dm.get("LoadState") == "loaded" else None,
                  "display_manager_was_active": running, "freed_bytes": None}
    todo = (["set-default"] if default != p["target"] else []) + (["stop"] if running else [])
    if not todo and os.path.exists(p["record"]):
        return {"changed": False, "record": record}
    if module.check_mode:
        return {"changed": True, "record": record}
    before = mem_available()
    if "set-default" in todo:
        _systemctl(module, "set-default", p["target"])
    if running:
        _systemctl(module, "stop", DM)
        time.sleep(p["settle_s"])
        after = mem_available()
        if before is not None and after is not None:
            record.update(mem_available_before=before, mem_available_after=after, freed_bytes=after - before,
                          measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    atomic_write(p["record"], (json.dumps(record, indent=1, sort_keys=True) + "\n").encode(), mode=0o644)
    return {"changed": True, "record": record}


def absent(module: AnsibleModule, record: dict[str, Any] | None) -> dict[str, Any]:
    if record is None:
        return {"changed": False, "record": None}
    if not module.check_mode:
        if _systemctl(module, "get-default") != record["previous_default"]:
            _systemctl(module, "set-default", record["previous_default"])
        if record.get("display_manager_was_active"):
            _systemctl(module, "start", DM)
        os.unlink(module.params["record"])
    return {"changed": True, "record": None}


def main() -> None:
    module = AnsibleModule(argument_spec={
        "state": {"type": "str", "required": True, "choices": ["present", "absent"]},
        "target": {"type": "str", "default": "multi-user.target"},
        "record": {"type": "path", "required": True},
        "settle_s": {"type": "float", "default": 5.0},
    }, supports_check_mode=True)
    target = module.params["target"]
    if not UNIT.fullmatch(target) or not target.endswith(".target"):
        module.fail_json(msg=f"headless_target {target!r} is not a systemd target name (e.g. "
                             "multi-user.target)")
    loaded = systemd_show(target, ["LoadState"]).get("LoadState")
    if loaded != "loaded":
        module.fail_json(msg=f"sparkspec_headless: this host's systemd has no {target} (LoadState "
                             f"{loaded or 'unknown'}), so it cannot boot headless; set sparkspec_headless: "
                             "false")
    record = _record(module, module.params["record"])
    module.exit_json(**(present if module.params["state"] == "present" else absent)(module, record))


if __name__ == "__main__":
    main()
