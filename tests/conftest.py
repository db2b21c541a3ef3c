"""Shared fixtures: the project root and the simulated Spark."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


SIM_FIXTURES = {"sim", "provisioned", "api_key"}   # the one simulated Spark, sim01
# Files whose tests run first on sim01: test_provision's no-change run follows the session's first
# provision.
SIM_FIRST = ("test_provision.py",)


def _sim_lane() -> frozenset[str]:
    """The test files with a test that takes a sim01 fixture (read from their source: xdist's
    scheduler runs in the controller, which collects nothing). Every test of such a file runs in the
    sim lane."""
    lane = set()
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test") \
                    and SIM_FIXTURES & {a.arg for a in node.args.args}:
                lane.add(path.relative_to(ROOT).as_posix())
                break
    return frozenset(lane)


SIM_LANE = _sim_lane()


def lane_of(nodeid: str) -> str:
    """The scope a test runs in under `invoke test` (see pytest_xdist_make_scheduler)."""
    path = nodeid.split("::", 1)[0]
    if path in SIM_LANE:
        return "sim"
    return path if path.startswith("tests/unit/") else "host"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`invoke test` runs pytest-xdist with two workers and these scopes, each run whole by one
    worker in file order: "sim" (every test of a SIM_LANE file, test_provision.py first: there is
    one simulated Spark, and such a file's tests share its state from test to test), "host" (the
    other integration and bench tests, molecule's scenarios and the simulated pair too: their
    containers have podman networks of their own), so each session fixture (a vLLM server, the pair)
    is made once; and each unit test file, a scope of its own, handed to whichever worker runs out
    of work first (measured: with the unit tests in "host", the worker done with "sim" idled the
    last ~550 s of a 2944 s run). `invoke test` passes --no-loadscope-reorder: scopes go out in
    collection order, "sim" first (test_provision.py is collected first), "host" second. (xdist's
    own loadgroup cannot do this with pytest 9: it renames nodeids through an attribute pytest 9 no
    longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane_of(nodeid)

    return Lanes(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """sim01's files first, test_provision.py before them all; a test that reaches sim01 through
    another fixture in a file outside SIM_LANE would run beside sim01's lane: refused at
    collection."""
    stray = sorted({item.nodeid.split("::", 1)[0] for item in items
                    if SIM_FIXTURES & set(getattr(item, "fixturenames", ()))} - SIM_LANE)
    if stray:
        raise pytest.UsageError(f"{', '.join(stray)}: tests use sim01 only through other fixtures; "
                                "give one test of the file a sim, provisioned or api_key argument "
                                "(tests/conftest.py SIM_LANE)")
    first = [i for i in items if i.path.name in SIM_FIRST]
    items[:] = first + [i for i in items if i not in first]


@pytest.fixture(scope="session")
def project_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def sim():
    """The simulated Spark, started once per test session (the image is built once and cached)."""
    from tests.support.sim import Sim

    sim = Sim(ROOT)
    sim.up(log=lambda msg: print(msg, file=sys.stderr))
    return sim


# Output of the session's one provision (tests check it for secrets).
PROVISION_OUTPUT: list[str] = []


@pytest.fixture(scope="session")
def sim_image():
    """The simulated Spark's image and the files its containers mount, without starting sim01
    (molecule)."""
    from tests.support.sim import Sim

    sim = Sim(ROOT)
    sim.assets(log=lambda msg: print(msg, file=sys.stderr))
    return sim


@pytest.fixture(scope="session")
def sim_pair():
    """The simulated pair (pair-head and pair-worker on the bridge sparkspec-pair, with its hub),
    started once per session and left running like sim01. It shares sim01's image and files but not
    sim01, so its tests run in the host lane (not a SIM_FIXTURES name)."""
    from tests.support.simpair import SimPair

    pair = SimPair(ROOT)
    pair.up(log=lambda msg: print(msg, file=sys.stderr))
    return pair


@pytest.fixture(scope="session")
def provisioned(sim):
    """The simulated Spark after the whole provision pipeline (it serves the sim inventory's
    method)."""
    result = run_cli(f"{BIN}/invoke", "provision", "--host", "sim01", timeout=1800)
    PROVISION_OUTPUT.append(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    return sim


@pytest.fixture(scope="session")
def api_key(sim) -> str:
    """The simulated Spark's vLLM API key (generated per machine by `invoke sim.up`, 0600)."""
    return sim.api_key_file.read_text().strip()


def run_cli(*argv: str, env: dict[str, str] | None = None,
            timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run a project command (invoke task or sparkspec CLI) the way a user would, from the project
    root."""
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                **(env or {})}
    return subprocess.run(list(argv), cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout, check=False)
