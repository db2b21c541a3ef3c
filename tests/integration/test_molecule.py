"""Each role's molecule scenarios, in the simulated Spark's image: converge, idempotence, verify.

Run as a user runs them (`molecule test` in the role's folder): each scenario's dependency step
prepares its own inputs (tests/support/molecule_inputs.py, cached in .cache/molecule/), so the
harness passes nothing but the image.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import BIN, ROOT, run_cli

pytestmark = [pytest.mark.sim, pytest.mark.slow]

SCENARIOS = sorted(p.parent for p in ROOT.glob("roles/*/molecule/*/molecule.yml"))


@pytest.mark.parametrize("scenario", SCENARIOS,
                         ids=[f"{p.parts[-3]}-{p.name}" for p in SCENARIOS])
def test_molecule_scenario(sim_image, scenario, tmp_path):
    env = {"SPARKSPEC_SIM_IMAGE": sim_image.image,
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "ANSIBLE_FORCE_COLOR": "0", "NO_COLOR": "1"}
    result = run_cli("sh", "-c",
                     f"cd {scenario.parent.parent} && {BIN}/molecule test -s {scenario.name}",
                     env=env, timeout=1200)
    output = result.stdout + result.stderr
    (tmp_path / "molecule.log").write_text(output)   # the whole run, for a failure's earlier steps
    assert result.returncode == 0, output[-6000:]
    assert "Dependency completed successfully" in output and "idempotence" in output
