"""The verify role's regression checks on the simulated Spark (baseline, prefix caching off) through
the verify playbook, bench and lossless skipped: the tool-call check passes; the prefix-cache check
passes, and fails when the host's verify block expects caching; the needle's figures reach the
textfile folder, and a folder root should not write is refused."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import BIN, ROOT, run_cli

SIM = "sim01"
CHECKS = ROOT / "reports" / SIM / "checks"
TEXTFILE = "/var/lib/sparkspec-monitoring/textfile"    # verify_textfile_dir


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
    # the needle's figures per tier, rendered by root from the report for the node exporter
    report = json.loads((CHECKS / "checks.needle.json").read_text())
    text = run_cli(*provisioned.ssh_argv(f"cat {TEXTFILE}/sparkspec-needle.sparkspec-vllm+baseline"
                                         ".prom")).stdout
    published = {(f.name, s.labels["tier"]): s.value for f in text_string_to_metric_families(text)
                  for s in f.samples if "tier" in s.labels}
    assert published == {
        **{("sparkspec_needle_found_ratio", str(t["tier"])):
           sum(a["found"] for a in t["answers"]) / len(t["answers"]) for t in report["tiers"]},
        **{("sparkspec_needle_tokens_per_second", str(t["tier"])):
           pytest.approx(t["per_request_tok_s_mean"]) for t in report["tiers"]},
        **{("sparkspec_needle_ttft_seconds", str(t["tier"])):
           pytest.approx(t["mean_ttft_ms"] / 1000) for t in report["tiers"]}}, text


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


@pytest.mark.sim
@pytest.mark.parametrize(("folder", "line"), [
    ("/tmp/figures", "verify_textfile_dir '/tmp/figures': /tmp is writable by others (mode 1777)"),
    ("/var/lib/x y", "is not an absolute path of letters, digits and . _ / -; give the monitoring "
                     "role's textfile folder"),
], ids=["redirectable", "space"])
def test_a_textfile_folder_root_should_not_write_is_refused(provisioned, folder, line):
    """root renders the needle's figures there: a folder another user could swap for a link, or a
    path with a character no unit or shell expects, is refused before any check runs."""
    result = _verify("-e", json.dumps({"verify_textfile_dir": folder}))
    assert result.returncode != 0
    assert line in result.stdout, result.stdout[-4000:]
    assert "TASK [verify : Run the check" not in result.stdout
    assert run_cli(*provisioned.ssh_argv(f"test -e '{folder}'")).returncode != 0
