"""Each role's molecule scenarios, in the simulated Spark's image: converge, idempotence, verify.

Run as a user runs them (`molecule test` in the role's folder): each scenario's dependency step
prepares its own inputs (tests/support/molecule_inputs.py, cached in .cache/molecule/), so the
harness passes nothing but the image. A scenario in SYNTAX_ONLY gets `molecule syntax` here.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import BIN, ROOT, run_cli

pytestmark = [pytest.mark.sim, pytest.mark.slow]

SCENARIOS = sorted(p.parent for p in ROOT.glob("roles/*/molecule/*/molecule.yml"))
# What sim01's tests already prove of the role, so the suite only checks the scenario parses
# (`invoke molecule --role R` runs it whole): deploy, converged and idempotent
# (test_provision, test_deploy::test_redeploy_changes_nothing), serving n-gram with drafts
# (test_deploy::test_ngram_serves_and_drafts).
SYNTAX_ONLY = {"deploy"}


@pytest.mark.parametrize("scenario", SCENARIOS,
                         ids=[f"{p.parts[-3]}-{p.name}" for p in SCENARIOS])
def test_molecule_scenario(sim_image, scenario, tmp_path):
    env = {"SPARKSPEC_SIM_IMAGE": sim_image.image,
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "ANSIBLE_FORCE_COLOR": "0", "NO_COLOR": "1"}
    whole = scenario.parts[-3] not in SYNTAX_ONLY
    result = run_cli("sh", "-c", f"cd {scenario.parent.parent} && {BIN}/molecule "
                     f"{'test' if whole else 'syntax'} -s {scenario.name}", env=env, timeout=1200)
    output = result.stdout + result.stderr
    (tmp_path / "molecule.log").write_text(output)   # the whole run, for a failure's earlier steps
    assert result.returncode == 0, output[-6000:]
    if whole:
        assert "Dependency completed successfully" in output and "idempotence" in output
    else:
        assert "syntax: Executed: Successful" in output, output[-3000:]
