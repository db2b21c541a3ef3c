"""Each role's molecule scenarios, in the simulated Spark's image: converge, idempotence, verify."""

from __future__ import annotations

import os

import pytest

from tests.conftest import BIN, ROOT, run_cli
from tests.support import standin_inputs
from tests.support.tinymodel import write_tiny_model

pytestmark = [pytest.mark.sim, pytest.mark.slow]

SCENARIOS = sorted(p.parent for p in ROOT.glob("roles/*/molecule/*/molecule.yml"))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[f"{p.parts[-3]}-{p.name}" for p in SCENARIOS])
def test_molecule_scenario(sim_image, scenario, tmp_path):
    role = scenario.parts[-3]
    env = {"SPARKSPEC_SIM_IMAGE": sim_image.image, "CONTAINERS_CONF": str(sim_image.env()["CONTAINERS_CONF"]),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "ANSIBLE_FORCE_COLOR": "0", "NO_COLOR": "1"}
    if role == "deploy":
        # the model the scenario serves: sim01's sim-tiny (same generator and seed), made here so that the
        # scenario never reads .sim/gen while sim01's hub writes it
        env["SPARKSPEC_MOLECULE_MODEL"] = str(write_tiny_model(tmp_path / "sim-tiny", seed=0).path)
    if role == "vllm_build":   # the stand-in vLLM tarballs, the stand-in torch wheels, a broken patch
        env.update(standin_inputs.write(tmp_path / "standin"))
    result = run_cli("sh", "-c", f"cd {scenario.parent.parent} && {BIN}/molecule test -s {scenario.name}",
                     env=env, timeout=1200)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "idempotence" in output
