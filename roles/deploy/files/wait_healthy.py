"""Wait until a vLLM unit answers /health with 200; stop early when the unit crashes (run by the
deploy role).

Usage: python3 wait_healthy.py URL UNIT TIMEOUT_S DELAY_S [--journal-fail REGEX]...
       [--journal-need REGEX]... [--startup REGEX]... [--progress-file PATH]
"""

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

# on the host the deploy puts sparkspec_host.py beside this file; in the checkout it is the
# contract role's
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path.append(os.path.join(_HERE, "..", "..", "sparkspec", "module_utils"))
from sparkspec_host import atomic_write, systemd_show  # noqa: E402


def unit_state(unit):
    return systemd_show(unit, ["ActiveState", "SubState", "Result", "NRestarts"])


def health(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


HEALTH_POLL_S = 0.2
HEALTHY_US: list[int] = []   # when /health first answered (µs, CLOCK_MONOTONIC)
SECRET = re.compile(r"(key|token|secret|passw\w*|auth\w*)(['\"]?\s*[:=]\s*)"
                    r"(\[?['\"]?)[^'\",\s\])}]+", re.IGNORECASE)


def last_log_line(unit):
    out = subprocess.run(["journalctl", "-u", unit, "-n", "1", "-o", "cat", "--no-pager", "-q"],
                         capture_output=True, text=True, check=False).stdout.strip()
    out = SECRET.sub(r"\1\2\3***", out.splitlines()[-1] if out else "")
    return out if len(out) <= 160 else out[:157] + "..."


def write_progress(path, waited, state, unit):
    """Replace PATH atomically with the wait's progress (a reader never sees half a file)."""
    note = f"unit {state.get('ActiveState', '?')}/{state.get('SubState', '?')}"
    log = last_log_line(unit)
    doc = {"what": f"wait for {unit} /health", "elapsed_s": round(waited),
           "note": note + (f": {log}" if log else ""), "time": time.time()}
    atomic_write(path, json.dumps(doc).encode(), mode=0o600, durable=False)


def crashed(state, restarts_at_start):
    restarts = int(state.get("NRestarts", "0") or 0)
    if restarts > restarts_at_start:
        return f"the unit crashed and systemd restarted it ({restarts - restarts_at_start} time(s))"
    if state.get("SubState") == "auto-restart":
        return "the unit crashed (systemd is about to restart it)"
    if state.get("ActiveState") in ("failed", "inactive"):
        return f"the unit is {state.get('ActiveState')} (result: {state.get('Result', 'unknown')})"
    return None


def journal_hits(unit, patterns):
    """Lines of the unit's current invocation's journal that one of patterns matches."""
    invocation = systemd_show(unit, ["InvocationID"]).get("InvocationID", "").strip()
    if not invocation:
        return []
    out = subprocess.run(["journalctl", "--no-pager", "--output=cat",
                          f"_SYSTEMD_INVOCATION_ID={invocation}"],
                         capture_output=True, text=True, check=False).stdout
    return [ln for ln in out.splitlines() if any(re.search(p, ln) for p in patterns)]


def startup_lines(unit, patterns):
    """{start_us, lines: [[monotonic µs, text]...]} of the unit's current invocation (secrets
    masked)."""
    shown = systemd_show(unit, ["InvocationID", "InactiveExitTimestampMonotonic"])
    invocation = shown.get("InvocationID", "").strip()
    lines = []
    if invocation:
        out = subprocess.run(["journalctl", "--no-pager", "--output=json",
                              f"_SYSTEMD_INVOCATION_ID={invocation}"],
                             capture_output=True, text=True, check=False).stdout
        for raw in out.splitlines():
            try:
                entry = json.loads(raw)
                text, at = entry.get("MESSAGE"), int(entry["__MONOTONIC_TIMESTAMP"])
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            if isinstance(text, str) and any(re.search(p, text) for p in patterns):
                lines.append([at, SECRET.sub(r"\1\2\3***", text)[:400]])
    start = shown.get("InactiveExitTimestampMonotonic", "0").strip()
    return {"start_us": int(start) if start.isdigit() else 0,
            "healthy_us": HEALTHY_US[0] if HEALTHY_US else 0, "lines": lines}


def _take(argv, flag):
    """The values of every ``flag VALUE`` pair in argv, and argv without them."""
    values = []
    while flag in argv:
        at = argv.index(flag)
        values.append(argv[at + 1])
        argv = argv[:at] + argv[at + 2:]
    return values, argv


def main(argv):
    progress = None
    patterns, argv = _take(argv, "--journal-fail")
    needs, argv = _take(argv, "--journal-need")
    startup, argv = _take(argv, "--startup")
    if "--progress-file" in argv:
        at = argv.index("--progress-file")
        progress, argv = os.path.expanduser(argv[at + 1]), argv[:at] + argv[at + 2:]
        os.makedirs(os.path.dirname(progress) or ".", exist_ok=True)
    try:
        rc = wait(argv, progress)
        if rc == 0 and patterns:
            for hit in journal_hits(argv[1], patterns):
                print("journal: " + SECRET.sub(r"\1\2\3***", hit))
        for need in needs if rc == 0 else []:
            found = journal_hits(argv[1], [need])
            print("journal-has: " + SECRET.sub(r"\1\2\3***", found[0]) if found else
                  f"journal-missing: {need}")
        if rc == 0 and startup:
            print("startup: " + json.dumps(startup_lines(argv[1], startup)))
        return rc
    finally:
        if progress:
            try:
                os.unlink(progress)
            except FileNotFoundError:
                pass


def wait(argv, progress):
    """/health is polled every HEALTH_POLL_S (a local request: the play sees readiness within a
    fifth of a second); the unit's state every DELAY_S (a systemctl call: a crash rolls back within
    DELAY_S)."""
    url, unit, timeout, delay = (argv[0].rstrip("/") + "/health", argv[1], float(argv[2]),
                                 float(argv[3]))
    start = time.monotonic()
    restarts_at_start = int(unit_state(unit).get("NRestarts", "0") or 0)
    written = None
    checked = None
    while True:
        waited = time.monotonic() - start
        if health(url) == 200:
            # CLOCK_MONOTONIC, systemd's and the journal's
            HEALTHY_US.append(time.monotonic_ns() // 1000)
            print(f"healthy after {waited:.0f} s")
            return 0
        if checked is None or waited - checked >= delay:
            checked = waited
            state = unit_state(unit)
            reason = crashed(state, restarts_at_start)
            if progress and (written is None or waited - written >= 5):
                write_progress(progress, waited, state, unit)
                written = waited
            if reason:
                print(f"{reason} {waited:.0f} s after the start")
                return 1
        if waited >= timeout:
            print(f"/health did not answer 200 within {timeout:.0f} s")
            return 1
        time.sleep(min(HEALTH_POLL_S, delay))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
