"""The verify role's regression checks on the simulated Spark (sim01 serves baseline, prefix caching
off for every sim profile): run through the verify playbook with the bench and the lossless check
skipped. The tool-call check passes, streaming and not; the prefix-cache check passes on baseline
("prefix caching off: not checked") and fails when the host's verify block forces the expectation
on."""

from __future__ import annotations

import json

import pytest

from tests.conftest import BIN, ROOT, run_cli

SIM = "sim01"
CHECKS = ROOT / "reports" / SIM / "checks"


def _verify(*extra: str):
    return run_cli(f"{BIN}/ansible-playbook", "-i", "inventories/sim", "--limit", SIM,
                   "playbooks/verify.yml", "--skip-tags", "bench,lossless",
                   "-e", json.dumps({"verify_warmup_requests": 0,
                                     "verify_report_name": "checks"}),
                   *extra, timeout=300)


@pytest.mark.sim
def test_checks_pass_on_baseline(provisioned):
    result = _verify()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr
    assert "baseline prefix-cache check: prefix caching off: not checked;" in result.stdout
    assert ("baseline tool-call check: tool call round trip passes, streaming and not"
            in result.stdout)
    tool = json.loads((CHECKS / "checks.tool-call.json").read_text())
    assert tool["passed"] is True and tool["method"] == "baseline"
    assert {m: len(v["calls"]) for m, v in tool["modes"].items()} == {"non-streaming": 1,
                                                                       "streaming": 1}
    prefix = json.loads((CHECKS / "checks.prefix-cache.json").read_text())
    assert (prefix["expected"] is False and prefix["server_prefix_caching"] is False
            and prefix["passed"])


@pytest.mark.sim
def test_prefix_cache_check_fails_when_expected_on(provisioned):
    result = _verify("-e", json.dumps({"sparkspec_verify": {"prefix_cache": True}}))
    assert result.returncode != 0
    expected = ("baseline prefix-cache check: FAIL (prefix caching expected on, no hits: the unit "
                "serves with prefix caching off (serve knob enable_prefix_caching)): 0 of 0 "
                "queried tokens hit")
    assert expected in result.stdout, result.stdout[-4000:]
    prefix = json.loads((CHECKS / "checks.prefix-cache.json").read_text())
    assert prefix["expected"] is True and prefix["repeat_hits"] == 0 and prefix["passed"] is False
