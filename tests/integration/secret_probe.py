"""Runs INSIDE the simulated Spark (copied there by test_secrets.py; stdlib only, python3 of the
container).

The strings to look for come from a 0600 file, never from this program's command line (a probe that
put them in argv would be the leak it looks for). Output is JSON on stdout, with every secret
replaced by its label.

  sample NEEDLES STOP SECONDS   read every /proc/*/cmdline every 0.2 s until STOP exists or
                                SECONDS pass
  scan NEEDLES ROOT... [--skip DIR]...
                                every regular file under the roots holding a secret, with its mode
                                and owner, and the journal's lines holding one
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys
import time


def needles(path: str) -> dict[str, bytes]:
    """label -> secret, from lines `label secret`."""
    out = {}
    with open(path, "rb") as fh:
        for line in fh.read().decode().splitlines():
            label, _, secret = line.partition(" ")
            if secret:
                out[label] = secret.encode()
    return out


def redact(data: bytes, secrets: dict[str, bytes]) -> str:
    for label, secret in secrets.items():
        data = data.replace(secret, f"<{label}>".encode())
    return data.replace(b"\0", b" ").decode(errors="replace")[:300]


def sample(secrets: dict[str, bytes], stop: str, seconds: float) -> dict[str, object]:
    deadline = time.monotonic() + seconds
    passes, processes, hits = 0, set(), {}
    while not os.path.exists(stop) and time.monotonic() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    cmdline = fh.read()
            except OSError:
                continue
            processes.add(pid)
            for label, secret in secrets.items():
                if secret in cmdline:
                    hits.setdefault(label, []).append(redact(cmdline, secrets))
        passes += 1
        time.sleep(0.2)
    return {"passes": passes, "processes": len(processes), "hits": hits}


def scan(secrets: dict[str, bytes], roots: list[str], skip: list[str]) -> dict[str, object]:
    found = []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.join(folder, d) not in skip]
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.lstat(path)
                    if not stat.S_ISREG(st.st_mode) or st.st_size > 256 << 20:
                        continue
                    with open(path, "rb") as fh:
                        data = fh.read()
                except OSError:
                    continue
                labels = sorted(label for label, secret in secrets.items() if secret in data)
                if labels:
                    found.append({"path": path, "labels": labels,
                                  "mode": oct(stat.S_IMODE(st.st_mode)),
                                  "owner": pwd.getpwuid(st.st_uid).pw_name,
                                  "group": grp.getgrgid(st.st_gid).gr_name})
    journal = subprocess.run(["journalctl", "--no-pager", "--output", "cat"], capture_output=True,
                             check=False).stdout
    in_journal = {label: redact(line, secrets) for label, secret in secrets.items()
                  for line in journal.splitlines() if secret in line}
    return {"files": found, "journal": in_journal, "journal_bytes": len(journal)}


def main() -> None:
    mode, path, *rest = sys.argv[1:]
    secrets = needles(path)
    if mode == "sample":
        result = sample(secrets, rest[0], float(rest[1]))
    else:
        roots = [a for i, a in enumerate(rest)
                 if a != "--skip" and (i == 0 or rest[i - 1] != "--skip")]
        skip = [rest[i + 1] for i, a in enumerate(rest) if a == "--skip"]
        result = scan(secrets, roots, [path.rsplit("/", 1)[0], *skip])
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
