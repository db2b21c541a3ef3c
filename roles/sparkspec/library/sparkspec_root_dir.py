#!/usr/bin/python
"""sparkspec_root_dir: check, changing nothing, that a folder root will write into can only be
redirected by root: every existing part of its path a real folder owned by root and writable by no
one else.
"""

from __future__ import annotations

import os
import pwd
import stat

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: sparkspec_root_dir
short_description: Check that a folder and all its parents can only be changed by root
description:
  - Walks the absolute path from / and stops at the first part that does not exist (root makes the
    rest).
  - A part that is a symbolic link, not a folder, not owned by root, or writable by its group or
    others is a problem; so is a relative path, an empty part, or a . or .. part.
options:
  path:
    description: The folder root will write into.
    type: str
    required: true
  var:
    description: The variable that set it, named in the problem.
    type: str
    required: true
author: sparkspec
"""

RETURN = r"""
problem: {description: one line naming the variable, the part at fault and the fix; empty when the
          folder is fine, type: str, returned: always}
"""


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def problem(path: str, var: str) -> str:
    """The first reason ``path`` is not a folder only root can redirect, else ""."""
    fix = ("give a folder whose every parent is root's alone, e.g. under "
           "/var/lib/sparkspec-monitoring")
    parts = path[1:].rstrip("/").split("/")
    if not path.startswith("/") or any(part in ("", ".", "..") for part in parts):
        return f"{var} {path!r} is not an absolute path without empty, . or .. parts; {fix}"
    # "/" first, then each longer prefix: /var, /var/lib, ...
    for current in ["/"] + ["/" + "/".join(parts[:n]) for n in range(1, len(parts) + 1)]:
        try:
            info = os.lstat(current)
        except FileNotFoundError:
            return ""               # root creates this part and the rest
        except OSError as exc:
            return f"{var} {path!r}: {current} cannot be read ({exc.strerror}); {fix}"
        if stat.S_ISLNK(info.st_mode):
            return (f"{var} {path!r}: {current} is a symbolic link, which its owner could point "
                    f"elsewhere; {fix}")
        if not stat.S_ISDIR(info.st_mode):
            return f"{var} {path!r}: {current} is not a folder; {fix}"
        if info.st_uid != 0:
            return (f"{var} {path!r}: {current} belongs to {_owner(info.st_uid)}, who could swap "
                    f"what is in it for a link to where root then writes; {fix}")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            mode = stat.S_IMODE(info.st_mode)
            return f"{var} {path!r}: {current} is writable by others (mode {mode:04o}), who " \
                   f"could plant a link there; {fix}"
    return ""


def main() -> None:
    module = AnsibleModule(argument_spec={"path": {"type": "str", "required": True},
                                          "var": {"type": "str", "required": True}},
                           supports_check_mode=True)
    module.exit_json(changed=False, problem=problem(module.params["path"], module.params["var"]))


if __name__ == "__main__":
    main()
