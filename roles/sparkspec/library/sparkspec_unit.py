#!/usr/bin/python
"""The deploy role's module: stage, compare and swap the vLLM unit's files, one run per step
(``state``: staged, live or files). It lives in the contract role, which every role depends on, so
Ansible finds it.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import subprocess
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.sparkspec_host import atomic_write

DOCUMENTATION = r"""
module: sparkspec_unit
short_description: Stage, compare and swap a systemd unit's files, keep the previous version,
  restart
description: The deploy role's unit swap in one module run per step (docs/design.md,
  "Module notes").
options:
  state:
    description: staged (write the staged copy, compare), live (keep previous, install, reload,
      restart) or files (assets and absent only).
    type: str
    choices: [staged, live, files]
    required: true
  unit:
    description: The systemd unit's name, without .service (staged, live).
    type: str
  staged_root:
    description: Folder the staged files go under, at their live paths (staged, live).
    type: path
  previous_root:
    description: Folder the previous live files are kept under, at their live paths (staged, live).
    type: path
  files:
    description: The unit's files (the unit first); each path, content, mode, owner, group.
    type: list
    elements: dict
    default: []
  secret_files:
    description: Like files, without the content (path, mode, owner, group); their contents are
      secret_contents.
    type: list
    elements: dict
    default: []
  secret_contents:
    description: The contents of secret_files, in their order. A parameter of its own so that
      Ansible never logs it (the module's journal line of its arguments) and masks each value in
      the result; diff mode never shows these files.
    type: list
    elements: str
    default: []
  assets:
    description: Files installed as they are in the staged step (helper scripts), the live step
      and the files step (the method switch's record); same keys as files.
    type: list
    elements: dict
    default: []
  directories:
    description: Folders ensured in the staged step; each path, mode, owner, group.
    type: list
    elements: dict
    default: []
  stop_units:
    description: Other units stopped and disabled in the live step, so only this one serves.
    type: list
    elements: str
    default: []
  analyze:
    description: In the staged step, rate the staged unit with systemd-analyze security, and
      verify it when it differs.
    type: bool
    default: false
  check_argv:
    description: In the staged step, when the staged unit differs, a command to run as
      check_user (the deploy role's check of the command line with the installed vLLM's parser,
      check_vllm_args.py --cache DIR).
    type: list
    elements: str
    default: []
  check_user:
    description: The user check_argv runs as (the unit's user, so a venv it cannot read fails
      before the restart).
    type: str
  check_cache_dir:
    description: Folder of accepted command lines; a "checked KEY" line of check_argv writes KEY
      here (root only).
    type: path
  absent:
    description: Paths removed in the files and live steps.
    type: list
    elements: str
    default: []
  restart:
    description: In the live step, restart the unit even when its own files did not change (a
      cluster's node whose peer's files changed; vLLM's process group restarts as one).
    type: bool
    default: false
author: sparkspec
"""

RETURN = r"""
differs: {description: a live file is missing or differs from the new one, type: bool,
          returned: always}
differed: {description: the paths that differ, type: list, returned: always}
has_live: {description: the unit file is installed, type: bool, returned: always}
live_present: {description: the live files that exist, type: list, returned: always}
start_error: {description: why systemctl could not start the unit (empty when it could); the
                health wait then rolls back, type: str, returned: live}
restarted: {description: the unit was (or, in check mode, would be) restarted or started,
            type: bool, returned: live}
security: {description: systemd-analyze security of the staged unit (rc, stdout, stderr),
           type: dict, returned: analyze}
verify: {description: systemd-analyze verify of the staged unit (rc, stdout, stderr), type: dict,
         returned: analyze}
args_check: {description: check_argv's rc, stdout and stderr, type: dict, returned: when it ran}
"""

FILE_SPEC: dict[str, Any] = {
    "path": {"type": "str", "required": True},
    "content": {"type": "str", "required": True},
    "mode": {"type": "str", "default": "0644"},
    "owner": {"type": "str", "default": "root"},
    "group": {"type": "str", "default": "root"},
}
# A secret file's content is not a suboption: Ansible logs a list parameter as its Python repr,
# where the content's newlines are escaped, so a no_log suboption's value would no longer match
# itself and reach the journal in clear.
SECRET_SPEC = {k: v for k, v in FILE_SPEC.items() if k != "content"}
DIR_SPEC = {k: v for k, v in FILE_SPEC.items() if k != "content"} | {"mode": {"type": "str",
                                                                              "default": "0755"}}


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def _ids(item: dict) -> tuple[int, int, int]:
    if "uid" in item:   # numeric, as read from a file
        return item["uid"], item["gid"], item["mode"]
    return (pwd.getpwnam(item["owner"]).pw_uid, grp.getgrnam(item["group"]).gr_gid,
            int(item["mode"], 8))


def _meta_differs(path: str, item: dict) -> bool:
    st = os.stat(path)
    uid, gid, mode = _ids(item)
    return (st.st_uid, st.st_gid, st.st_mode & 0o7777) != (uid, gid, mode)


def _ensure_dir(path: str, item: dict | None = None) -> bool:
    """Creates path (and its parents, root's 0755) or fixes its owner and mode; True on a change."""
    spec = item or {"owner": "root", "group": "root", "mode": "0755"}
    changed = False
    if not os.path.isdir(path):
        _ensure_dir(os.path.dirname(path))
        os.mkdir(path)
        changed = True
    if _meta_differs(path, spec):
        uid, gid, mode = _ids(spec)
        os.chown(path, uid, gid)
        os.chmod(path, mode)
        changed = True
    return changed


def _write(path: str, data: bytes, item: dict) -> None:
    """Atomically replaces path with data, owned and moded as item says (never readable by others
    before)."""
    _ensure_dir(os.path.dirname(path))
    uid, gid, mode = _ids(item)
    atomic_write(path, data, mode=mode, uid=uid, gid=gid)


def _put(path: str, data: bytes, item: dict, check: bool) -> bool:
    """Writes path when its content or metadata differ; True if it did (or would, in check mode)."""
    if _read(path) == data and not _meta_differs(path, item):
        return False
    if not check:
        _write(path, data, item)
    return True


def _systemctl(module: AnsibleModule, *args: str, check_rc: bool = True) -> tuple[int, str]:
    rc, out, err = module.run_command(["systemctl", *args])
    if check_rc and rc != 0:
        module.fail_json(msg=f"systemctl {' '.join(args)} failed: {(err or out).strip()}")
    return rc, out.strip()


def _staged(module: AnsibleModule, files: list[dict], check: bool) -> dict:
    p = module.params
    changed = False
    for d in p["directories"]:
        if check:
            changed |= not os.path.isdir(d["path"]) or _meta_differs(d["path"], d)
        else:
            changed |= _ensure_dir(d["path"], d)
    for asset in p["assets"]:
        changed |= _put(asset["path"], asset["content"].encode(), asset, check)
    for f in files:
        changed |= _put(p["staged_root"] + f["path"], f["content"].encode(), f, check)
    differed = [f["path"] for f in files if _read(f["path"]) != f["content"].encode()]
    present = [f["path"] for f in files if os.path.exists(f["path"])]
    result = {"changed": changed, "differs": bool(differed), "differed": differed,
              "has_live": bool(files) and files[0]["path"] in present, "live_present": present}
    if p["analyze"] and not check:
        unit_file = p["staged_root"] + files[0]["path"]
        result["security"] = _run(module, ["systemd-analyze", "security", "--offline=true",
                                           "--no-pager", unit_file])
        if differed:
            result["verify"] = _run(module, ["systemd-analyze", "verify", unit_file])
            if p["check_argv"]:
                result["args_check"] = _check_args(module)
    return result


def _check_args(module: AnsibleModule) -> dict:
    """check_argv as check_user (its groups, home, a plain PATH); a "checked KEY" answer is kept."""
    p = module.params
    user = pwd.getpwnam(p["check_user"])
    proc = subprocess.run(p["check_argv"], user=user.pw_uid, group=user.pw_gid,
                          extra_groups=os.getgrouplist(user.pw_name, user.pw_gid), cwd="/",
                          capture_output=True, text=True, check=False,
                          env={"HOME": user.pw_dir, "USER": user.pw_name, "LOGNAME": user.pw_name,
                               "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"})
    answer = proc.stdout.split()
    if proc.returncode == 0 and len(answer) == 2 and answer[0] == "checked" \
            and re.fullmatch(r"[0-9a-f]{64}", answer[1]):
        _put(os.path.join(p["check_cache_dir"], answer[1]), b"",
             {"owner": "root", "group": "root", "mode": "0644"}, False)
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}


def _run(module: AnsibleModule, argv: list[str]) -> dict:
    rc, out, err = module.run_command(argv)
    return {"rc": rc, "stdout": out, "stderr": err}


def _files(module: AnsibleModule, files: list[dict], check: bool) -> dict:
    p = module.params
    changed = False
    for asset in p["assets"]:
        changed |= _put(asset["path"], asset["content"].encode(), asset, check)
    for path in p["absent"]:
        if os.path.lexists(path):
            changed = True
            if not check:
                os.unlink(path)
    return {"changed": changed}


def _active(module: AnsibleModule, unit: str) -> bool:
    return _systemctl(module, "is-active", unit, check_rc=False)[1] in ("active", "activating",
                                                                        "reloading")


def _live(module: AnsibleModule, files: list[dict], check: bool) -> dict:
    p = module.params
    before = {f["path"]: _read(f["path"]) for f in files}
    differed = [f["path"] for f in files if before[f["path"]] != f["content"].encode()]
    present = [path for path, data in before.items() if data is not None]
    has_live = bool(files) and files[0]["path"] in present
    if differed and not check:
        # the live version becomes the previous one, with its owner and mode (rollback.yml)
        if has_live:
            for path in present:
                st = os.stat(path)
                _write(p["previous_root"] + path, before[path] or b"",
                       {"uid": st.st_uid, "gid": st.st_gid, "mode": st.st_mode & 0o7777})
        for f in files:
            _write(f["path"], f["content"].encode(), f)
        _systemctl(module, "daemon-reload")
    changed = bool(differed)
    for f in files:     # metadata that drifted (e.g. the env file made world-readable by hand)
        if f["path"] not in differed and f["path"] in present and _meta_differs(f["path"], f):
            changed = True
            if not check:
                uid, gid, mode = _ids(f)
                os.chown(f["path"], uid, gid)
                os.chmod(f["path"], mode)
    for other in p["stop_units"]:
        enabled = _systemctl(module, "is-enabled", other, check_rc=False)[1] == "enabled"
        if _active(module, other) or enabled:
            changed = True
            if not check:
                _systemctl(module, "disable", "--now", other)
    # the method switch's record, with the unit it names
    changed |= _files(module, files, check)["changed"]
    unit = p["unit"]
    if _systemctl(module, "is-enabled", unit, check_rc=False)[1] != "enabled":
        changed = True
        if not check:
            _systemctl(module, "enable", unit)
    restarted = bool(differed) or p["restart"] or not _active(module, unit)
    start_error = ""
    if restarted:
        changed = True
        if not check:
            # A start job that fails (an ExecStartPre such as the memory guard refusing) is not this
            # module's failure: the new files are live, and the health wait that follows sees the
            # failed unit and rolls back to the previous ones. Failing here would leave the new,
            # unstartable unit in place.
            action = "restart" if differed or p["restart"] else "start"
            rc, out = _systemctl(module, action, unit, check_rc=False)
            start_error = "" if rc == 0 else out or f"systemctl exited {rc}"
    result: dict = {"changed": changed, "differs": bool(differed), "differed": differed,
                    "has_live": has_live, "live_present": present, "restarted": restarted,
                    "start_error": start_error}
    if module._diff:
        result["diff"] = [{"before_header": f["path"], "after_header": f["path"],
                           "before": (before[f["path"]] or b"").decode(errors="replace"),
                           "after": f["content"]}
                          for f in p["files"] if f["path"] in differed]
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "choices": ["staged", "live", "files"], "required": True},
            "unit": {"type": "str"},
            "staged_root": {"type": "path"},
            "previous_root": {"type": "path"},
            "files": {"type": "list", "elements": "dict", "default": [], "options": FILE_SPEC},
            "secret_files": {"type": "list", "elements": "dict", "default": [],
                             "options": SECRET_SPEC},
            "secret_contents": {"type": "list", "elements": "str", "default": [], "no_log": True},
            "assets": {"type": "list", "elements": "dict", "default": [], "options": FILE_SPEC},
            "directories": {"type": "list", "elements": "dict", "default": [], "options": DIR_SPEC},
            "stop_units": {"type": "list", "elements": "str", "default": []},
            "analyze": {"type": "bool", "default": False},
            "check_argv": {"type": "list", "elements": "str", "default": []},
            "check_user": {"type": "str"},
            "check_cache_dir": {"type": "path"},
            "absent": {"type": "list", "elements": "str", "default": []},
            "restart": {"type": "bool", "default": False},
        },
        required_if=[("state", "staged", ("unit", "staged_root", "previous_root")),
                     ("state", "live", ("unit", "staged_root", "previous_root"))],
        supports_check_mode=True,
    )
    secret, contents = module.params["secret_files"], module.params["secret_contents"]
    if len(secret) != len(contents):
        module.fail_json(msg=f"sparkspec_unit: {len(secret)} secret_files but {len(contents)} "
                             "secret_contents")
    if module.params["check_argv"] and not (module.params["check_user"]
                                            and module.params["check_cache_dir"]):
        module.fail_json(msg="sparkspec_unit: check_argv needs check_user and check_cache_dir")
    files = module.params["files"] + [f | {"content": c}
                                      for f, c in zip(secret, contents, strict=True)]
    step = {"staged": _staged, "live": _live, "files": _files}[module.params["state"]]
    try:
        module.exit_json(**step(module, files, module.check_mode))
    except (OSError, KeyError) as exc:   # KeyError: an owner or group the host lacks
        module.fail_json(msg=f"sparkspec_unit {module.params['state']} "
                             f"{module.params['unit'] or ''}: {exc}")


if __name__ == "__main__":
    main()
