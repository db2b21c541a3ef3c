"""Shared fixtures: the project root and the simulated Spark."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


SIM_FIXTURES = {"sim", "provisioned", "api_key"}   # the one simulated Spark, sim01
# Files whose tests run first on sim01: test_provision's no-change run follows the session's first provision.
SIM_FIRST = ("test_provision.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`invoke test`, --dist loadgroup) the tests run on two workers side by side:
    - group "sim": every test of a file that has a test on sim01 (there is one simulated Spark, and such a file's
      tests share its state from test to test), in file order, test_provision.py first;
    - group "host": every other test (molecule's scenarios too: their own containers, on podman's own network),
      so each session fixture (a vLLM server, generated checkpoints) is made once."""
    sim_files = {item.path for item in items if SIM_FIXTURES & set(getattr(item, "fixturenames", ()))}
    first = [i for i in items if i.path in sim_files and i.path.name in SIM_FIRST]
    items[:] = first + [i for i in items if i not in first]
    for item in items:
        item.add_marker(pytest.mark.xdist_group("sim" if item.path in sim_files else "host"))


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
    """The simulated Spark's image and the files its containers mount, without starting sim01 (molecule)."""
    from tests.support.sim import Sim

    sim = Sim(ROOT)
    sim.assets(log=lambda msg: print(msg, file=sys.stderr))
    return sim


@pytest.fixture(scope="session")
def provisioned(sim):
    """The simulated Spark after the whole provision pipeline (it serves the sim inventory's method)."""
    result = run_cli(f"{BIN}/invoke", "provision", "--host", "sim01", timeout=1800)
    PROVISION_OUTPUT.append(result.stdout + result.stderr)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    return sim


@pytest.fixture(scope="session")
def api_key(sim) -> str:
    """The simulated Spark's vLLM API key (generated per machine by `invoke sim.up`, 0600)."""
    return sim.api_key_file.read_text().strip()


def run_cli(*argv: str, env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """Run a project command (invoke task or sparkspec CLI) the way a user would, from the project root."""
    full_env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    return subprocess.run(list(argv), cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout,
                          check=False)
