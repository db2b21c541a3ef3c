"""The sparkspec role's sparkspec_root_dir module (the monitoring and Grafana roles' check that only
root can redirect a folder root writes into), run as Ansible runs a module: its file with the
arguments in a JSON file, on real folders. The cases that need another owner run as root (as CI
does): they build a root-owned chain under this checkout (every parent root's, mode 0755) and give
one part away."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MODULE = ROOT / "roles/sparkspec/library/sparkspec_root_dir.py"
VAR = "monitoring_textfile_dir"


def problem(tmp_path: Path, path: str) -> str:
    (tmp_path / "args.json").write_text(
        json.dumps({"ANSIBLE_MODULE_ARGS": {"path": path, "var": VAR}}))
    proc = subprocess.run([sys.executable, str(MODULE), str(tmp_path / "args.json")],
                          capture_output=True, text=True, check=False, timeout=60)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["changed"] is False, result
    return str(result["problem"])


@pytest.mark.parametrize("path",
                         ["/usr/share", "/usr/share/", "/usr/share/sparkspec-absent/textfile"])
def test_a_root_chain_and_its_missing_rest_are_fine(tmp_path: Path, path: str) -> None:
    assert problem(tmp_path, path) == ""


@pytest.mark.parametrize("path", ["var/lib/x", "", "/var//lib", "/var/lib/../tmp", "/var/./lib"])
def test_a_path_that_is_not_plain_and_absolute_is_refused(tmp_path: Path, path: str) -> None:
    assert problem(tmp_path, path).startswith(f"{VAR} {path!r} is not an absolute path")


def test_a_world_writable_parent_is_refused(tmp_path: Path) -> None:
    line = problem(tmp_path, "/tmp/sparkspec-textfile")          # /tmp: 1777
    assert line == (f"{VAR} '/tmp/sparkspec-textfile': /tmp is writable by others (mode 1777), "
                    "who could plant a link there; give a folder whose every parent is root's "
                    "alone, e.g. under /var/lib/sparkspec-monitoring")


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    assert "/etc/passwd is not a folder" in problem(tmp_path, "/etc/passwd/textfile")


@pytest.fixture
def chain() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another owner needs root (CI runs as root)")
    # a chain of root's folders whatever the checkout's parents are (a clone under /tmp sits
    # below 1777)
    base = Path(tempfile.mkdtemp(prefix="sparkspec-root-dir-", dir="/var/lib"))
    os.chmod(base, 0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base)


def test_a_parent_owned_by_a_service_user_is_refused(tmp_path: Path, chain: Path) -> None:
    owned = chain / "prometheus"
    owned.mkdir(mode=0o755)
    os.chown(owned, 65534, 65534)
    assert problem(tmp_path, str(chain)) == ""
    line = problem(tmp_path, str(owned / "node-exporter"))
    assert f": {owned} belongs to " in line and "(uid 65534), who could swap" in line


def test_a_link_is_refused_even_to_a_root_folder(tmp_path: Path, chain: Path) -> None:
    (chain / "real").mkdir(mode=0o755)
    (chain / "link").symlink_to(chain / "real")
    assert f": {chain / 'link'} is a symbolic link" in \
        problem(tmp_path, str(chain / "link" / "textfile"))
    assert f": {chain / 'link'} is a symbolic link" in problem(tmp_path, str(chain / "link"))


def test_a_group_writable_folder_is_refused(tmp_path: Path, chain: Path) -> None:
    shared = chain / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    assert f": {shared} is writable by others (mode 0775)" in problem(tmp_path, str(shared))
