"""The host wheel holds host code only, by concern, with no import loops and no oversized module.

The wheel is built the way the sparkspec_tools role builds it (pip wheel, no deps, no build
isolation), from a clean copy of the sources (a stale setuptools build/ tree must not decide what
the test sees), and listed.
"""

from __future__ import annotations

import ast
import email.parser
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkspec.cli import build_parser
from tests.support import cli as dev_cli

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "src"
# what moved out of the host wheel to tests/support: simulator, generators, benchmark harnesses
MOVED = {"sim", "simhub", "testckpt", "ckptlayout", "tinymodel", "ckpt_bench", "bench_ceiling",
         "bench_vs_vllm", "bench_switch", "throttle", "ansible_run", "play", "remote",
         "inventory", "status"}
SIM_ONLY_DEPS = {"tokenizers"}  # needed by the tiny-model generator only
MAX_LINES = 400


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    work = tmp_path_factory.mktemp("wheel")
    tree = work / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, tree / name)
    shutil.copytree(SRC, tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                           "--no-build-isolation", "--no-index",
                           "-w", str(work / "dist"), str(tree)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = (work / "dist").glob("sparkspec-*.whl")
    return zipfile.ZipFile(built)


def _modules(names: list[str]) -> list[str]:
    return [n for n in names if n.endswith(".py")]


def test_wheel_holds_only_the_sparkspec_package(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    outside = [n for n in names if not n.startswith(("sparkspec/", "sparkspec-"))
               or (n.startswith("sparkspec-") and ".dist-info/" not in n)]
    assert not outside, f"files outside sparkspec/ in the wheel: {outside}"
    assert {"sparkspec/cli/__init__.py", "sparkspec/checkpoint/assemble.py",
            "sparkspec/hub/fetch.py", "sparkspec/bench/client.py"} <= set(names)


def test_wheel_has_no_simulator_generator_or_harness(wheel: zipfile.ZipFile) -> None:
    stems = {Path(n).stem for n in _modules(wheel.namelist())}
    assert not stems & MOVED, f"moved modules shipped in the wheel: {sorted(stems & MOVED)}"
    for name in wheel.namelist():
        if not name.startswith("sparkspec/"):
            continue  # dist-info: METADATA carries the README, which describes the simulation
        text = wheel.read(name).decode("utf-8", errors="replace")
        assert "podman" not in text.lower(), \
            f"{name} mentions podman: simulator code in the host wheel"
        if name.endswith(".py"):
            assert not [m for m in _imports(ast.parse(text), _module_name(name))
                        if _is_test_module(m)], \
                f"{name} imports the tests"


def test_wheel_carries_the_suites_and_the_entry_point(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert {"sparkspec/bench/suites/open.jsonl", "sparkspec/bench/suites/structured.jsonl",
            "sparkspec/py.typed"} <= names
    (entry,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert re.search(r"^sparkspec\s*=\s*sparkspec\.cli:main$",
                     wheel.read(entry).decode(), re.MULTILINE)


def test_wheel_requires_no_simulation_only_dependency(wheel: zipfile.ZipFile) -> None:
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    message = email.parser.Parser().parsestr(wheel.read(meta).decode())
    requires = [re.split(r"[\s<>=!~;\[(]", r, maxsplit=1)[0].lower()
                for r in message.get_all("Requires-Dist", [])]
    assert "huggingface-hub" in requires  # the field is read at all
    assert not set(requires) & SIM_ONLY_DEPS, \
        f"simulation-only dependencies of the host wheel: {requires}"


# --- the import graph -----------------------------------------------------------------------------
def _module_name(path: str | Path) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_test_module(name: str) -> bool:
    return name == "tests" or name.startswith("tests.")


def _imports(tree: ast.AST, module: str, is_package: bool = False) -> Iterator[str]:
    """Every module an ``import`` anywhere in ``tree`` names (top level, in functions, under
    TYPE_CHECKING): ``from a import b`` names a.b when that is a module, else a."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph(trees: list[tuple[Path, Path]]) -> dict[str, set[str]]:
    """The import graph of the modules under each (root, folder): a module is named by its path from
    root."""
    files = {_module_name(p.relative_to(root)): p
             for root, folder in trees for p in folder.rglob("*.py")
             if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        named = set(_imports(tree, name, path.name == "__init__.py"))
        graph[name] = {m for m in named if m in files and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_cycle_finder_finds_a_function_local_cycle() -> None:
    a = ast.parse("import x\ndef f():\n    from pkg import b\n")
    assert set(_imports(a, "pkg.a")) >= {"x", "pkg", "pkg.b"}
    assert _cycle({"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}) == \
        ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
    assert _cycle({"pkg.a": {"pkg.b"}, "pkg.b": set()}) is None
    assert set(_imports(ast.parse("from . import common\nfrom .x import y\n"), "pkg.cli",
                        True)) >= {"pkg.cli.common", "pkg.cli.x.y"}


def test_no_import_cycle_in_the_package_or_the_test_support() -> None:
    graph = _graph([(SRC, SRC / "sparkspec"), (REPO, REPO / "tests" / "support"),
                    (REPO, REPO / "tasks")])
    assert "sparkspec.cli" in graph and "sparkspec.cli.checkpoint" in graph["sparkspec.cli"]
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_host_package_imports_neither_tests_nor_tasks_nor_the_cli_from_a_concern() -> None:
    for path in sorted((SRC / "sparkspec").rglob("*.py")):
        name = _module_name(path.relative_to(SRC))
        named = set(_imports(ast.parse(path.read_text(encoding="utf-8")), name,
                             path.name == "__init__.py"))
        outside = [m for m in named if _is_test_module(m) or m.split(".")[0] == "tasks"]
        assert not outside, f"{name} imports {outside}"
        if not name.startswith("sparkspec.cli"):
            assert not [m for m in named if m.startswith("sparkspec.cli")], \
                f"{name} imports the CLI"


def test_no_module_over_400_lines() -> None:
    roots = [SRC / "sparkspec", REPO / "tasks", REPO / "tests" / "support"]
    sizes = {str(p.relative_to(REPO)): len(p.read_text(encoding="utf-8").splitlines())
             for root in roots for p in root.rglob("*.py") if "__pycache__" not in p.parts}
    long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# --- the command lines ----------------------------------------------------------------------------
def _commands(parser: object, prefix: str = "") -> set[str]:
    """Every subcommand path of an argparse parser ("checkpoint assemble", "bench", ...)."""
    import argparse

    found: set[str] = set()
    for action in getattr(parser, "_actions", []):
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                path = f"{prefix}{name}"
                below = _commands(sub, path + " ")
                found |= below or {path}
    return found


def test_host_cli_lists_the_host_commands_and_no_generator() -> None:
    assert _commands(build_parser()) == {
        "checkpoint assemble", "checkpoint add-mtp", "checkpoint verify", "checkpoint build",
        "checkpoint check-head", "checkpoint digest",
        "fetch repo", "fetch fp8-subset", "fetch batch", "fetch plan", "hub serve",
        "bench", "check-output record", "check-output compare", "check prefix-cache",
        "check tool-call", "check answers", "check needle", "check needle-metrics",
        "cluster supervise", "memfit guard",
        "memfit measure", "memfit show",
        "memfit forget", "watchdog", "startup"}


def test_dev_cli_has_the_generators() -> None:
    assert _commands(dev_cli.build_parser()) == {"checkpoint generate", "model tiny"}
    assert all(dev_cli.handles(c.split()) for c in _commands(dev_cli.build_parser()))


@pytest.mark.parametrize(("argv", "module", "match"), [
    (["model", "tiny", "--out", "x"], "sparkspec.cli",
     r"^sparkspec: error: argument COMMAND: invalid choice: 'model'"),
    (["checkpoint", "generate", "--kind", "int4", "--out", "x"], "sparkspec.cli",
     r"^sparkspec: error: checkpoint: argument ACTION: invalid choice: 'generate'"),
    (["model", "tiny", "--out", "x", "--seed", "-1"], "tests.support",
     r"^sparkspec: error: model tiny: argument --seed: .*; see `python -m tests.support "
     r"model tiny --help`$"),
])
def test_generators_answer_only_on_the_dev_cli(argv: list[str], module: str, match: str,
                                               tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                          cwd=tmp_path if module == "sparkspec.cli" else REPO, timeout=120,
                          check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and re.search(match, lines[0]), proc.stderr
    assert not list(tmp_path.iterdir())
