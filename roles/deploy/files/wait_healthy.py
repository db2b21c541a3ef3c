"""Wait until a vLLM unit answers /health with 200, and stop early when the unit crashes (run by the deploy role).

Usage: python3 wait_healthy.py URL UNIT TIMEOUT_S DELAY_S
Exit 0 with "healthy after N s" once /health answers 200. Exit 1 with one line on stdout as soon as the unit
has crashed (systemd restarted it, is about to, or marked it failed or inactive), or when TIMEOUT_S pass: a
start that crashes at once (a wrong flag vLLM's parser lets through, a missing tokenizer, too little memory)
is rolled back within a restart, not after the whole timeout. Standard library only.
"""

import subprocess
import sys
import time
import urllib.error
import urllib.request


def unit_state(unit):
    out = subprocess.run(["systemctl", "show", unit, "--property=ActiveState,SubState,Result,NRestarts"],
                         capture_output=True, text=True, check=False).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def health(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def crashed(state, restarts_at_start):
    restarts = int(state.get("NRestarts", "0") or 0)
    if restarts > restarts_at_start:
        return f"the unit crashed and systemd restarted it ({restarts - restarts_at_start} time(s))"
    if state.get("SubState") == "auto-restart":
        return "the unit crashed (systemd is about to restart it)"
    if state.get("ActiveState") in ("failed", "inactive"):
        return f"the unit is {state.get('ActiveState')} (result: {state.get('Result', 'unknown')})"
    return None


def main(argv):
    url, unit, timeout, delay = argv[0].rstrip("/") + "/health", argv[1], float(argv[2]), float(argv[3])
    start = time.monotonic()
    restarts_at_start = int(unit_state(unit).get("NRestarts", "0") or 0)
    while True:
        waited = time.monotonic() - start
        if health(url) == 200:
            print(f"healthy after {waited:.0f} s")
            return 0
        reason = crashed(unit_state(unit), restarts_at_start)
        if reason:
            print(f"{reason} {waited:.0f} s after the start")
            return 1
        if waited >= timeout:
            print(f"/health did not answer 200 within {timeout:.0f} s")
            return 1
        time.sleep(delay)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
