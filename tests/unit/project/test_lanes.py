"""`invoke test`'s scopes (tests/conftest.py lane_of): what shares the one simulated Spark runs in
one scope, the other integration tests in another, and each unit test file in a scope of its own."""

from __future__ import annotations

from tests.conftest import SIM_LANE, lane_of


def test_scopes() -> None:
    assert "tests/integration/test_provision.py" in SIM_LANE
    assert lane_of("tests/integration/test_provision.py::test_provision_converges") == "sim"
    assert lane_of("tests/integration/test_deploy.py::test_switch_to_baseline") == "sim"
    # the simulated pair and molecule: containers of their own, beside sim01
    assert "tests/integration/test_cluster_sim.py" not in SIM_LANE
    assert lane_of("tests/integration/test_cluster_sim.py::"
                   "test_teardown_takes_the_pair_down") == "host"
    assert lane_of("tests/integration/test_molecule.py::"
                   "test_molecule_scenario[deploy-default]") == "host"
    assert lane_of("tests/bench/test_real_vllm.py::test_x") == "host"
    assert lane_of("tests/unit/project/test_lanes.py::test_scopes") == \
        "tests/unit/project/test_lanes.py"
