"""Verify and compare on the simulated Spark: the lossless check, bench figures equal to the server's own
counter deltas, and `invoke compare` writing the table and plot for baseline and ngram."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import BIN, ROOT, run_cli
from tests.counters import assert_result_equals_counter_deltas, raw_counters

pytestmark = [pytest.mark.sim, pytest.mark.slow]

URL = "http://127.0.0.1:8000"


def test_compare_baseline_and_ngram(provisioned):
    result = run_cli(f"{BIN}/invoke", "compare", "--host", "sim01", "--methods", "ngram,baseline", timeout=2400)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr
    reports = ROOT / "reports/sim01"
    table = (reports / "compare.md").read_text()
    assert re.search(r"^\| baseline \| sim-tiny \| [0-9.]+ \| [0-9.]+ \| n/a \|", table, re.MULTILINE), table
    assert re.search(r"^\| ngram \| sim-tiny \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ ?% \|", table, re.MULTILINE), table
    assert (reports / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the lossless check ran for ngram against baseline's reference, and passed
    assert "ngram is lossless against baseline" in result.stdout
    # compare restores what was running before it (baseline, from provisioning)
    assert json.loads(run_cli(*provisioned.ssh_argv("cat /etc/sparkspec/sparkspec-vllm.json")).stdout)["method"] \
        == "baseline"


def test_bench_figures_equal_counter_deltas(provisioned, api_key, tmp_path):
    deploy = run_cli(f"{BIN}/invoke", "deploy", "--host", "sim01", "--method", "ngram", "--skip-tags", "verify",
                     timeout=1200)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr
    before = raw_counters(URL)
    out = tmp_path / "bench.json"
    bench = run_cli(f"{BIN}/sparkspec", "bench", "--url", URL, "--model", "sim-tiny", "--suite", "structured",
                    "--max-tokens", "32", "--temperature", "0", "--concurrency", "2", "--output", str(out),
                    env={"SPARKSPEC_API_KEY": api_key})
    assert bench.returncode == 0, bench.stderr
    assert_result_equals_counter_deltas(json.loads(out.read_text()), before, raw_counters(URL))
    assert len(json.loads(out.read_text())["spec_decode_per_position_acceptance_rates"]) == 4


@pytest.mark.parametrize(("expect", "ok"), [(".", True), ("^the-tiny-model-never-says-this$", False)])
def test_known_answers_catch_wrong_output(provisioned, expect, ok):
    """verify asks known-answer prompts: output that does not match fails the play, whatever its speed."""
    extra = json.dumps({"verify_known_answers": [{"prompt": "Say something.", "expect": expect}],
                        "verify_lossless": False, "verify_requests": 1, "verify_max_tokens": 8})
    result = run_cli(f"{BIN}/ansible-playbook", "-i", "inventories/sim", "--limit", "sim01", "playbooks/verify.yml",
                     "-e", extra, timeout=900)
    if ok:
        assert result.returncode == 0, result.stdout[-3000:]
    else:
        assert result.returncode != 0
        assert "the model's output is wrong" in result.stdout, result.stdout[-3000:]
