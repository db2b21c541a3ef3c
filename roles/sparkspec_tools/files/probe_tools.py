"""What the host already has of the tools venv, read in one run (the sparkspec_tools role runs this file's text
with the venv's ``python -c``; no venv yet: the run fails and the role does every step).

argv: the wheel's path on the host, the JSON list of the system packages, the JSON list of the extras, the
record file the role writes after an install.

Prints one JSON document:
  missing    which system packages dpkg does not list as installed
  wheel      sha256 of the wheel file on the host, or null when absent
  record     the role's record of the wheel installed last ({sha256, extras}), or null
  unmet      the requirements of the installed sparkspec (with the extras) that no installed distribution
             satisfies, or ["sparkspec"] when sparkspec is not installed (null: could not be checked)
  command    whether `sparkspec --version` of the venv runs (exit 0)
"""

import hashlib
import importlib.metadata as m
import json
import pathlib
import shutil
import subprocess
import sys


def sha256(path):
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def unmet(extras):
    """Requirements of the installed sparkspec (its own and those of the extras) that nothing installed meets."""
    try:
        from pip._vendor.packaging.requirements import Requirement   # the venv's pip carries packaging
    except ImportError:
        return None
    try:
        dist = m.distribution("sparkspec")
    except m.PackageNotFoundError:
        return ["sparkspec"]
    out = []
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in ["", *extras]):
            continue
        try:
            version = m.version(req.name)
        except m.PackageNotFoundError:
            out.append(text)
            continue
        if not req.specifier.contains(version, prereleases=True):
            out.append(text)
    return out


def read_record(path):
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None


def main():
    wheel, system, extras, record = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    query = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\\n", *system],
                           capture_output=True, text=True, check=False) \
        if system and shutil.which("dpkg-query") else None
    ok = {ln.split()[0] for ln in query.stdout.splitlines() if ln.endswith(" installed")} if query else set()
    command = pathlib.Path(sys.executable).with_name("sparkspec")
    runs = command.is_file() and subprocess.run([str(command), "--version"], capture_output=True,
                                                check=False).returncode == 0
    print(json.dumps({"missing": [p for p in system if p not in ok] if query or not system else system,
                      "wheel": sha256(wheel), "record": read_record(record), "unmet": unmet(extras),
                      "command": runs}))


main()
