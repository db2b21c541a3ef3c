"""roles/deploy/files/deploy_lock.py, run as the deploy runs it (without systemd: no
$NOTIFY_SOCKET): it holds the lock root's alone (mode 0600, also on a file an older sparkspec left
world-readable: flock works on a read-only descriptor, so a lock others can open is one they can
hold), and a second holder gives up after its wait in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "roles" / "deploy" / "files" / "deploy_lock.py"


def test_the_lock_is_root_only_and_a_second_holder_gives_up(tmp_path: Path) -> None:
    lock = tmp_path / "run" / "sparkspec-vllm.lock"
    lock.parent.mkdir()
    lock.write_text("")
    lock.chmod(0o644)
    env = {"PATH": "/usr/bin:/bin"}
    holder = subprocess.Popen([sys.executable, str(SCRIPT), str(lock), "5"], stdout=subprocess.PIPE,
                              text=True, env=env)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == f"deploy lock: holding {lock}"
        assert lock.stat().st_mode & 0o777 == 0o600
        second = subprocess.run([sys.executable, str(SCRIPT), str(lock), "1"], capture_output=True,
                                text=True, env=env, timeout=30, check=False)
        assert second.returncode == 1
        assert second.stdout.strip() == (f"deploy lock: {lock} is still held after 1 s "
                                          "(a watchdog restart or another deploy)")
    finally:
        holder.terminate()
        holder.wait(timeout=30)
    assert holder.returncode == 0
