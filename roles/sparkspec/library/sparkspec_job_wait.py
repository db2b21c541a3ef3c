#!/usr/bin/python
"""sparkspec_job_wait: wait on the host, up to some seconds, for an Ansible async job to end (the
sparkspec_progress action plugin's long poll). One round trip per wait instead of one per poll: a
job that ends is seen within 0.1 s, and its results file is removed in the same run. The job's
result comes back as async_status gives it."""

from __future__ import annotations

import json
import os
import re
import sys
import time

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: sparkspec_job_wait
short_description: Wait for an async job of this host to end, for at most some seconds
description:
  - Reads the job's results file in the async folder every 0.1 s until async_wrapper wrote the job's
    result or I(wait) seconds passed.
  - Ended, it returns the job's result with C(finished=1), as C(async_status) does, and removes the
    results file.
  - Still running, it returns C(finished=0) and the text of I(progress), when that file exists.
options:
  jid:
    description: The job id async_wrapper returned.
    type: str
    required: true
  async_dir:
    description: The async folder of the user the job runs as (C(~) is expanded for the user this
      runs as).
    type: path
    required: true
  wait:
    description: Seconds to wait at most, 0-60.
    type: float
    required: true
  progress:
    description: A progress file to return the text of (at most 64 KiB) while the job runs.
    type: path
author: sparkspec
"""


TICK_S = 0.1
MAX_PROGRESS = 1 << 16


def _job(path: str) -> dict | None:
    """The results file's document; None while async_wrapper has not written one that parses."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _text(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read(MAX_PROGRESS).decode("utf-8", "replace")
    except OSError:
        return None


def main() -> None:
    module = AnsibleModule(
        argument_spec={"jid": {"type": "str", "required": True},
                       "async_dir": {"type": "path", "required": True},
                       "wait": {"type": "float", "required": True}, "progress": {"type": "path"}},
        supports_check_mode=True)
    jid, wait = module.params["jid"], module.params["wait"]
    # async_wrapper's ids (j<random>.<pid>): a name, no path
    if not re.fullmatch(r"j[0-9]+[.][0-9]+", jid):
        module.fail_json(msg=f"jid {jid[:40]!r} is not an async job id")
    if not 0 <= wait <= 60:
        module.fail_json(msg=f"wait {wait}: give 0-60 seconds")
    path = os.path.join(module.params["async_dir"], jid)
    deadline = time.monotonic() + wait
    while True:
        if not os.path.exists(path):
            module.fail_json(msg="could not find job", ansible_job_id=jid, started=True,
                             finished=True)
        data = _job(path)
        # async_wrapper's final write: the module's result
        if data is not None and "started" not in data:
            break
        if time.monotonic() >= deadline:
            module.exit_json(ansible_job_id=jid, started=True, finished=False,
                             progress=_text(module.params["progress"]))
        time.sleep(TICK_S)
    os.unlink(path)
    data["finished"] = True
    data["ansible_job_id"] = jid
    print(f"\n{json.dumps(data)}")   # as async_status: the job's module already shaped its result
    sys.exit(0)


if __name__ == "__main__":
    main()
