"""The role Python in one place (issue #22): the modules and plugins live in the contract role, and
what the host side reads and writes (dpkg's status, JSON records, systemd's properties,
MemAvailable, torch's version.py, atomic writes) is parsed or written in one file,
roles/sparkspec/module_utils/sparkspec_host.py, which the probes run as text, the modules import as
module_utils and the scripts import from beside them."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[3]
HOST_CODE = ROOT / "roles/sparkspec/module_utils/sparkspec_host.py"
PLUGIN_FOLDERS = ("library", "module_utils", "filter_plugins", "lookup_plugins", "action_plugins")

# What must be parsed or written in HOST_CODE only: a second copy is the duplication this guards
# against.
ONE_PLACE = {
    "dpkg-query": "dpkg's status (which packages are installed)",
    "db:Status-Status": "dpkg's status (which packages are installed)",
    '"systemctl", "show"': "systemd's properties",
    "MemAvailable": "/proc/meminfo",
    "literal_eval": "torch's version.py",
    "mkstemp": "the atomic write",
    "os.replace": "the atomic write",
}


def _role_and_task_python() -> list[Path]:
    return sorted([*ROOT.glob("roles/**/*.py"), *ROOT.glob("tasks/**/*.py")])


@pytest.mark.parametrize("needle", sorted(ONE_PLACE))
def test_each_host_parse_and_the_atomic_write_have_one_source(needle: str) -> None:
    found = [p.relative_to(ROOT) for p in _role_and_task_python()
             if needle in p.read_text(encoding="utf-8")]
    assert found == [HOST_CODE.relative_to(ROOT)], (
        f"{ONE_PLACE[needle]} ({needle!r}) belongs in {HOST_CODE.relative_to(ROOT)} only; "
        f"found in {found}")


def test_modules_and_plugins_live_in_the_contract_role() -> None:
    elsewhere = [p.relative_to(ROOT) for p in ROOT.glob("roles/*/*")
                 if p.is_dir() and p.name in PLUGIN_FOLDERS and p.parent.name != "sparkspec"]
    assert not elsewhere, f"move {elsewhere} to roles/sparkspec/ (every role depends on it)"
    assert (ROOT / "roles/sparkspec/library/sparkspec_unit.py").is_file()


def test_no_python_travels_as_an_inline_string() -> None:
    """A probe is the host code's text with a subcommand, never a second copy in a string of a
    task."""
    for path in _role_and_task_python():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and "\nimport " in node.value):
                if "sys.argv" in node.value:
                    pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno}: Python in a string; "
                                f"make it a probe of {HOST_CODE.name}")


def _probe(python: str, *argv: str, stdin: str = "") -> dict:
    proc = subprocess.run([python, "-c", HOST_CODE.read_text(encoding="utf-8"), *argv], input=stdin,
                          capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _venv(tmp_path: Path, cuda: str) -> Path:
    """A venv-shaped folder whose torch/version.py is written as torch writes it (annotated
    assignments)."""
    torch = tmp_path / "venv/lib/python3.12/site-packages/torch"
    torch.mkdir(parents=True)
    (torch / "version.py").write_text(
        "from typing import Optional\n\n__all__ = ['__version__', 'debug', 'cuda']\n"
        f"__version__ = '2.13.0+cu130'\ndebug = False\ncuda: Optional[str] = {cuda!r}\n"
        "hip: Optional[str] = None\n")
    return tmp_path / "venv"


def test_tools_probe_reads_dpkg_the_wheel_and_the_record(tmp_path: Path) -> None:
    wheel, record = tmp_path / "w.whl", tmp_path / "record.json"
    wheel.write_bytes(b"wheel bytes")
    record.write_text('{"sha256": "ab", "extras": []}')
    doc = _probe(sys.executable, "tools", str(wheel), json.dumps(["no-such-package-x1"]), "[]",
                 str(record))
    assert doc["missing"] == ["no-such-package-x1"]
    assert doc["wheel"] == hashlib.sha256(b"wheel bytes").hexdigest()
    assert doc["record"] == {"sha256": "ab", "extras": []}
    record.write_text("{not json")
    assert _probe(sys.executable, "tools", str(wheel), "[]", "[]", str(record))["record"] is None


def test_a_script_runs_with_the_host_code_beside_it_as_on_the_host(tmp_path: Path) -> None:
    """The build helper as the role installs it (a folder with the helper and sparkspec_host.py, no
    checkout): it imports the host code, and reads torch's version.py with its annotated cuda (a
    CUDA build)."""
    folder = tmp_path / "work/vllm-build"
    folder.mkdir(parents=True)
    shutil.copy(ROOT / "roles/vllm_build/files/vllm_build_helper.py", folder)
    shutil.copy(HOST_CODE, folder)
    helper = [sys.executable, str(folder / "vllm_build_helper.py"), "torch"]
    run = subprocess.run([*helper, str(_venv(tmp_path, "13.0"))], capture_output=True, text=True,
                         check=False, timeout=60)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == {"torch": "2.13.0+cu130", "cuda": "13.0"}
    (folder / "sparkspec_host.py").unlink()
    missing = subprocess.run([*helper, str(tmp_path)], capture_output=True, text=True, check=False,
                             timeout=60)
    assert "No module named 'sparkspec_host'" in missing.stderr, \
        "the helper needs the host code beside it"


def test_atomic_write_keeps_the_mode_and_leaves_no_temp_file(tmp_path: Path) -> None:
    sys.path.insert(0, str(HOST_CODE.parent))
    try:
        from sparkspec_host import atomic_write
    finally:
        sys.path.remove(str(HOST_CODE.parent))
    target = tmp_path / "CMakeLists.txt"
    target.write_text("old\n")
    target.chmod(0o640)
    atomic_write(str(target), b"new\n")
    assert target.read_text() == "new\n" and (target.stat().st_mode & 0o777) == 0o640
    atomic_write(str(tmp_path / "fresh"), b"x", mode=0o600)
    assert (tmp_path / "fresh").stat().st_mode & 0o777 == 0o600
    with pytest.raises(TypeError):
        atomic_write(str(target), "not bytes")   # type: ignore[arg-type]
    assert (sorted(os.listdir(tmp_path)) == ["CMakeLists.txt", "fresh"]
            and target.read_text() == "new\n")


def test_invoke_status_sends_the_status_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """tasks/lib/status.py's probe is the host code's status probe: run here as the host would run
    it (sh -c)."""
    from tasks.lib import status

    def as_root(command: str) -> SimpleNamespace:
        proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False,
                              timeout=60)
        return SimpleNamespace(exited=proc.returncode, stdout=proc.stdout, stderr=proc.stderr)

    unit = "sparkspec-no-such-unit-x1"
    host = SimpleNamespace(name="here", python=sys.executable, as_root=as_root,
                           vars={"sparkspec_unit_name": unit, "sparkspec_method": "mtp"})
    got = status._probe(host)   # type: ignore[arg-type]
    assert got.unit == unit and got.method is None and got.health is None
    assert got.mem_available is not None and got.mem_available > 0
    assert got.inventory_method == "mtp"
