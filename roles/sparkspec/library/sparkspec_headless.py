#!/usr/bin/python
"""sparkspec_headless: serve headless (the default target multi-user, the display manager stopped),
with the memory that freed, or put back what was there before; the record says both."""

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
short_description: Serve headless, measuring the memory it frees, or put back the target and display
  manager
description:
  - present sets the default target to C(target) and stops a running display manager
    (display-manager.service), and records what was there (the default target, the display manager
    and whether it ran) and the available memory before and after the stop. absent puts back what
    the record says and removes it. SSH is not touched.
options:
  state: {description: present (headless) or absent (as before), type: str, required: true,
          choices: [present, absent]}
  target: {description: the systemd target to boot into, type: str, default: multi-user.target}
  record: {description: the record's file (root's), type: path, required: true}
  settle_s: {description: seconds to wait after the stop before the available memory is read again,
             type: float, default: 5}
author: sparkspec
"""

RETURN = r"""
record: {description: the record (null once absent), type: dict, returned: always}
note: {description: what absent could not put back (a display manager uninstalled since), type: str,
       returned: when state is absent}
"""

DM = "display-manager.service"
NAME = r"[A-Za-z0-9][A-Za-z0-9@._-]{0,199}"
TARGET, SERVICE = re.compile(NAME + r"\.target"), re.compile(NAME + r"\.service")


def _systemctl(module: AnsibleModule, *args: str) -> str:
    """systemctl ARGS (unit names after --, never read as options); a failure stops the module."""
    verb, units = args[0], args[1:]
    result = subprocess.run(["systemctl", verb, "--", *units], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        module.fail_json(msg=f"systemctl {' '.join(args)}: "
                             f"{result.stderr.strip() or result.returncode}")
    return result.stdout.strip()


def _write(path: str, record: dict[str, Any]) -> None:
    atomic_write(path, (json.dumps(record, indent=1, sort_keys=True) + "\n").encode(), mode=0o644)


def _record(module: AnsibleModule, path: str) -> dict[str, Any] | None:
    """The record an earlier run wrote, checked: a target to go back to, a display manager service
    (or none) and whether it ran."""
    if not os.path.lexists(path):
        return None
    doc = read_json(path) if os.path.isfile(path) and not os.path.islink(path) else None
    if not (isinstance(doc, dict) and isinstance(doc.get("previous_default"), str)
            and TARGET.fullmatch(doc["previous_default"])
            and (doc.get("display_manager") is None
                 or isinstance(doc["display_manager"], str)
                 and SERVICE.fullmatch(doc["display_manager"]))
            and isinstance(doc.get("display_manager_was_active"), bool)):
        module.fail_json(msg=f"{path} is not a headless record sparkspec wrote; remove it after "
                             "checking the host's default target (systemctl get-default) and "
                             "display manager")
    return doc


def present(module: AnsibleModule, record: dict[str, Any] | None) -> dict[str, Any]:
    p = module.params
    default = _systemctl(module, "get-default")
    dm = systemd_show(DM, ["Id", "LoadState", "ActiveState"])
    loaded = dm.get("LoadState") == "loaded" and bool(SERVICE.fullmatch(dm.get("Id", "")))
    running = loaded and dm.get("ActiveState") in ("active", "activating", "reloading")
    if record is None:   # what is there now, to put back
        record = {"previous_default": default if TARGET.fullmatch(default) else "graphical.target",
                  "display_manager": dm["Id"] if loaded else None,
                  "display_manager_was_active": running, "freed_bytes": None}
    todo = (["set-default"] if default != p["target"] else []) + (["stop"] if running else [])
    if not todo and os.path.exists(p["record"]):
        return {"changed": False, "record": record}
    if module.check_mode:
        return {"changed": True, "record": record}
    _write(p["record"], record)   # first: a failure below still leaves what to put back
    before = mem_available()
    if "set-default" in todo:
        _systemctl(module, "set-default", p["target"])
    if running:
        _systemctl(module, "stop", DM)
        time.sleep(p["settle_s"])
        after = mem_available()
        if before is not None and after is not None:
            record.update(mem_available_before=before, mem_available_after=after,
                          freed_bytes=after - before,
                          measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        _write(p["record"], record)
    return {"changed": True, "record": record}


def absent(module: AnsibleModule, record: dict[str, Any] | None) -> dict[str, Any]:
    if record is None:
        return {"changed": False, "record": None, "note": ""}
    note = ""
    if not module.check_mode:
        if _systemctl(module, "get-default") != record["previous_default"]:
            _systemctl(module, "set-default", record["previous_default"])
        if record["display_manager_was_active"]:
            if systemd_show(DM, ["LoadState"]).get("LoadState") == "loaded":
                _systemctl(module, "start", DM)
            else:
                note = f"{record['display_manager']} is no longer installed: not started"
        os.unlink(module.params["record"])
    return {"changed": True, "record": None, "note": note}


def main() -> None:
    module = AnsibleModule(argument_spec={
        "state": {"type": "str", "required": True, "choices": ["present", "absent"]},
        "target": {"type": "str", "default": "multi-user.target"},
        "record": {"type": "path", "required": True},
        "settle_s": {"type": "float", "default": 5.0},
    }, supports_check_mode=True)
    target, settle = module.params["target"], module.params["settle_s"]
    if not TARGET.fullmatch(target):
        module.fail_json(msg=f"headless_target {target!r} is not a systemd target name (e.g. "
                             "multi-user.target)")
    if not 0 <= settle <= 600:
        module.fail_json(msg=f"headless_settle_s {settle!r} is not a number of seconds from 0 to "
                             "600")
    loaded = systemd_show(target, ["LoadState"]).get("LoadState")
    if module.params["state"] == "present" and loaded != "loaded":
        module.fail_json(msg=f"sparkspec_headless: this host's systemd has no {target} (LoadState "
                             f"{loaded or 'unknown'}), so it cannot boot headless; set "
                             "sparkspec_headless: false")
    record = _record(module, module.params["record"])
    module.exit_json(**(present if module.params["state"] == "present" else absent)(module, record))


if __name__ == "__main__":
    main()
