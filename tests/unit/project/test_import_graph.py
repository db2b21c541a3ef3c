"""The product never imports its test bed: nothing under tasks/ or src/ reaches into tests/ (an
import at module or function level, importlib.import_module or __import__ of a "tests..." name, a
`-m tests.` command line, a "tests/..." path), except tasks/dev.py's one development entry point,
tests/support/dev.py. And the host tasks work in a checkout without tests/: `invoke --list` and
`invoke render` run in a copy of it."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import BIN, ROOT

# the development entry point: tasks/dev.py reaches tests/ through it alone
ENTRY = "tests.support.dev"
ENTRY_USER = "tasks/dev.py"
NAME = re.compile(r"^tests(\.\w+)*$")   # a module name of the test bed
# a `-m tests.x` command line, a tests/ path
REACH = re.compile(r"(^|[\s'\"=])-m\s*tests\b|(^|[^\w.-])tests/")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants (prose, not code)."""
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and node.body):
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def reaches(source: str) -> list[tuple[int, str]]:
    """(line, what) for every reach into tests/ in a module's source."""
    tree = ast.parse(source)
    prose = _docstrings(tree)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if NAME.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if NAME.match(node.module):
                found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in prose):
            if NAME.match(node.value) and node.value != "tests":
                # importlib.import_module("tests.x"), a constant
                found.append((node.lineno, node.value))
            elif REACH.search(node.value):
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):   # ROOT / "tests" / ...
            if any(isinstance(s, ast.Constant) and s.value == "tests"
                   for s in (node.left, node.right)):
                found.append((node.lineno, "/ 'tests'"))
        elif isinstance(node, ast.JoinedStr):    # f"... -m tests.{name}"
            text = "".join(v.value for v in node.values if isinstance(v, ast.Constant))
            if REACH.search(text):
                found.append((node.lineno, text))
    return found


def _product() -> list[Path]:
    return sorted(p for top in ("tasks", "src") for p in (ROOT / top).rglob("*.py"))


@pytest.mark.parametrize("source", [
    "import tests.support.sim", "from tests.support import sim", "from tests import support",
    "def f():\n    from tests.support.sim import Sim",
    "importlib.import_module('tests.support.sim')", "__import__('tests.support')",
    "c.run(f'{sys.executable} -m tests.support.ckpt_bench --x {y}')",
    "subprocess.run([sys.executable, '-m', 'tests.support.bench_ceiling'])",
    "p = ROOT / 'tests' / 'support'", "open('tests/support/sim.py')", "NAME = 'tests.support.dev'"])
def test_every_kind_of_reach_is_found(source: str) -> None:
    assert reaches(source), source


@pytest.mark.parametrize("source", [
    '"""Run `python -m tests.support --help`: a docstring."""', "import testsuite",
    "from sparkspec import tests",
    "x = 'the tests passed'", "from .tests import x", "p = ROOT / 'tasks'"])
def test_prose_and_lookalikes_are_not_reaches(source: str) -> None:
    assert reaches(source) == [], source


def test_nothing_in_the_product_reaches_into_tests_but_the_dev_entry_point() -> None:
    found = {p.relative_to(ROOT).as_posix(): reaches(p.read_text()) for p in _product()}
    stray = {path: hits for path, hits in found.items()
             if [h for h in hits if (path, h[1]) != (ENTRY_USER, ENTRY)]}
    assert stray == {}, "only tasks/dev.py may reach tests/, through tests.support.dev"
    # the scan sees the one allowed reach, so it is looking at the right files
    assert [what for _, what in found[ENTRY_USER]] == [ENTRY]
    assert (ROOT / ENTRY.replace(".", "/")).with_suffix(".py").is_file()


@pytest.fixture(scope="module")
def without_tests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout's files (tracked, or new and not ignored), tests/ left out, copied to a fresh
    folder; nothing else (the venv is the checkout's)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout
    copy = tmp_path_factory.mktemp("checkout")
    for name in files.decode().split("\0"):
        source = ROOT / name
        if not name or name.split("/", 1)[0] == "tests" or not source.is_file():
            continue
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, copy / name, follow_symlinks=False)
    assert (copy / "tasks/__init__.py").is_file() and not (copy / "tests").exists()
    return copy


def _invoke(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "invoke"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, check=False)


def test_invoke_lists_its_tasks_without_tests(without_tests: Path) -> None:
    done = _invoke(without_tests, "--list")
    assert done.returncode == 0, done.stderr
    for name in ("provision", "deploy", "render", "compare", "status", "logs", "report", "sim.up",
                 "bench.switch"):
        assert re.search(rf"^\s+{re.escape(name)}\s", done.stdout, re.M), name


def test_render_works_without_tests(without_tests: Path, tmp_path: Path) -> None:
    done = _invoke(without_tests, "render", "--host", "spark01", "--method", "mtp",
                   "--dest", str(tmp_path), "--inventory", "inventories/example")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    record = (tmp_path / "etc/sparkspec/sparkspec-vllm.json").read_text()
    assert '"method": "mtp"' in record


def test_a_dev_task_without_tests_is_one_line(without_tests: Path) -> None:
    done = _invoke(without_tests, "sim.down")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"sparkspec: error: {without_tests / 'tests/support/dev.py'}: not in this checkout; "
        "the sim and bench tasks need the whole repository (git clone)"]
