"""Wait until every node of a Ray cluster is alive in the head's GCS (run by the deploy role with
the vLLM venv's python, where Ray is installed).

Usage: python ray_nodes.py GCS_ADDRESS TIMEOUT NAME=ADDRESS... ;
       exit 0 when each ADDRESS is alive, else 1.
"""
from __future__ import annotations

import json
import sys
import time


def alive(gcs: str) -> set[str]:
    from ray._raylet import GcsClient  # type: ignore[import-not-found]  # as `ray status` reads the GCS

    nodes = GcsClient(address=gcs).get_all_node_info(timeout=10)
    return {n.node_manager_address for n in nodes.values() if n.state == 0}   # 0: ALIVE


def main(argv: list[str]) -> int:
    gcs, timeout, members = argv[0], float(argv[1]), dict(m.split("=", 1) for m in argv[2:])
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    error = ""
    while True:
        try:
            seen, error = alive(gcs), ""
        except Exception as exc:  # noqa: BLE001 - the head's GCS not up yet: try again until the deadline
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            error = f" (the head's Ray at {gcs}: {why})"
        missing = sorted(name for name, address in members.items() if address not in seen)
        if not missing:
            print(json.dumps({"alive": sorted(seen)}))
            return 0
        if time.monotonic() > deadline:
            print(f"{', '.join(missing)} did not join the Ray cluster at {gcs} within "
                  f"{timeout:.0f} s{error}; "
                  f"see journalctl -u <unit>-ray on {missing[0]}", file=sys.stderr)
            return 1
        time.sleep(2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
