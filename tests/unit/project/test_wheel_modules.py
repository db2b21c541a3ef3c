"""The host wheel holds what a host runs: built the way the sparkspec_tools role builds it
(roles/sparkspec_tools/files/build_wheel.py), every .py module in it is imported by a host command,
found by the static import closure (every ``import`` anywhere in a module, lazy ones inside handlers
included) from the wheel's console scripts and ``python -m sparkspec.cli``. A module only a test,
the simulation or the controller uses belongs in tests/support or on the controller side, not in the
wheel."""

from __future__ import annotations

import ast
import configparser
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
BUILD = ROOT / "roles/sparkspec_tools/files/build_wheel.py"
# `python -m sparkspec.cli`, the same command as `sparkspec` (the simulation and tasks run it so)
MAIN_MODULES = ("sparkspec.cli.__main__",)
# In the wheel though no host command imports them yet, each with the issue that moves it; an entry
# that a host command imports, or that left the wheel, fails the test (drop it then).
KNOWN_EXCEPTIONS: set[str] = set()


def _wheel(tmp: Path) -> Path:
    project, dist = tmp / "project", tmp / "dist"
    project.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, project / name)
    shutil.copytree(ROOT / "src", project / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run([sys.executable, str(BUILD), str(project), str(dist)],
                          capture_output=True, text=True,
                          env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"}, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    return Path(json.loads(proc.stdout.strip().splitlines()[-1])["wheel"])


def _modules(wheel: zipfile.ZipFile) -> dict[str, tuple[str, bool]]:
    """module name -> (source, is a package) of every .py file in the wheel."""
    out = {}
    for name in wheel.namelist():
        if name.endswith(".py") and ".dist-info/" not in name:
            parts = name[:-3].split("/")
            package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if package else parts)] = (wheel.read(name).decode(), package)
    return out


def _entry_modules(wheel: zipfile.ZipFile) -> list[str]:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    entries = configparser.ConfigParser()
    entries.read_string(wheel.read(name).decode())
    scripts = [value.split(":")[0].strip() for value in entries["console_scripts"].values()]
    assert scripts, "the wheel has no console script"
    return scripts


def _imports(module: str, source: str, package: bool, known: set[str]) -> set[str]:
    """The wheel's modules that ``module`` imports, anywhere in its body (with their parent
    packages)."""
    base = module if package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            anchor = base
            for _ in range(node.level - 1 if node.level else 0):
                anchor = anchor.rpartition(".")[0]
            target = (f"{anchor}.{node.module}" if node.module
                      else anchor) if node.level else node.module or ""
            found.add(target)
            # `from pkg import module`
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {parent for name in found for parent in _with_parents(name) if parent in known}


def _with_parents(name: str) -> list[str]:
    """``a.b.c`` -> a, a.b, a.b.c: importing a module runs its packages' ``__init__`` first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _closure(modules: dict[str, tuple[str, bool]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = [parent for root in roots for parent in _with_parents(root)]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        todo.extend(_imports(name, *modules[name], set(modules)))
    return seen


def test_every_module_of_the_wheel_is_imported_by_a_host_command(tmp_path: Path) -> None:
    with zipfile.ZipFile(_wheel(tmp_path)) as wheel:
        modules = _modules(wheel)
        roots = [*_entry_modules(wheel), *MAIN_MODULES]
    assert set(roots) <= set(modules), roots
    # `sparkspec hub serve`
    assert "sparkspec.hub.server" in modules and "sparkspec.cli.hub" in modules
    reached = _closure(modules, roots)
    unused = sorted(set(modules) - reached - KNOWN_EXCEPTIONS)
    assert not unused, (f"in the host wheel but imported by no host command: {', '.join(unused)}; "
                        "move them to tests/support (test and simulation tooling) or tasks/ "
                        "(controller side)")
    stale = sorted(KNOWN_EXCEPTIONS & (reached | (KNOWN_EXCEPTIONS - set(modules))))
    assert not stale, (f"imported by a host command now, or gone from the wheel: {stale}; "
                       "drop them from KNOWN_EXCEPTIONS")


def test_the_closure_sees_lazy_relative_and_from_imports() -> None:
    """The closure is not vacuous: a root's packages, an import inside a function, a relative one
    and ``from pkg import mod`` each reach their module; a module nothing imports is not reached."""
    modules = {
        "pkg": ("", True),
        "pkg.cli": ("def handler():\n    from .sub import lazy\n    from . import rel\n", False),
        "pkg.sub": ("", True),
        "pkg.sub.lazy": ("from ..deep import thing\n", False),
        "pkg.sub.sibling": ("", False),
        "pkg.rel": ("", False),
        "pkg.deep": ("", False),
        "pkg.orphan": ("import os\n", False),
    }
    assert _closure(modules, ["pkg.cli"]) == {"pkg", "pkg.cli", "pkg.sub", "pkg.sub.lazy",
                                              "pkg.rel", "pkg.deep"}
