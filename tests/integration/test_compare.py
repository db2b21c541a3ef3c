"""Verify and compare on the simulated Spark: the lossless check, bench figures equal to the server's own
counter deltas, and `invoke compare` writing the table and plot for baseline and ngram."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from tests.conftest import BIN, ROOT, run_cli

pytestmark = [pytest.mark.sim, pytest.mark.slow]

URL = "http://127.0.0.1:8000"


def scrape() -> dict[str, float]:
    """Counters summed over label sets, read from the raw exposition text (independently of sparkspec)."""
    with urllib.request.urlopen(URL + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm:[a-z_]+_total)(\{[^}]*position="(\d+)"[^}]*\}|\{[^}]*\})? ([0-9.e+-]+)$', line)
        if m:
            key = m.group(1) + (f"[{m.group(3)}]" if m.group(3) else "")
            out[key] = out.get(key, 0.0) + float(m.group(4))
    return out


def test_compare_baseline_and_ngram(provisioned):
    result = run_cli(f"{BIN}/invoke", "compare", "--host", "sim01", "--methods", "ngram,baseline", timeout=2400)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr
    reports = ROOT / "reports/sim01"
    table = (reports / "compare.md").read_text()
    assert re.search(r"^\| baseline \| sim-tiny \| [0-9.]+ \| [0-9.]+ \| n/a \|", table, re.M), table
    assert re.search(r"^\| ngram \| sim-tiny \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ ?% \|", table, re.M), table
    assert (reports / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the lossless check ran for ngram against baseline's reference, and passed
    assert "ngram is lossless against baseline" in result.stdout
    # compare restores what was running before it (baseline, from provisioning)
    assert json.loads(run_cli(*provisioned.ssh_argv("cat /etc/sparkspec/sparkspec-vllm.json")).stdout)["method"] \
        == "baseline"


def test_bench_figures_equal_counter_deltas(provisioned, tmp_path):
    deploy = run_cli(f"{BIN}/invoke", "deploy", "--host", "sim01", "--method", "ngram", "--skip-tags", "verify",
                     timeout=1200)
    assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr
    before = scrape()
    out = tmp_path / "bench.json"
    bench = run_cli(f"{BIN}/sparkspec", "bench", "--url", URL, "--model", "sim-tiny", "--suite", "structured",
                    "--max-tokens", "32", "--temperature", "0", "--concurrency", "2", "--output", str(out))
    assert bench.returncode == 0, bench.stderr
    after = scrape()
    r = json.loads(out.read_text())
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    assert r["total_output_tokens"] == d["vllm:generation_tokens_total"]
    assert r["total_input_tokens"] == d["vllm:prompt_tokens_total"]
    drafts, draft_tokens = d["vllm:spec_decode_num_drafts_total"], d["vllm:spec_decode_num_draft_tokens_total"]
    accepted = d["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0
    assert r["spec_decode_num_drafts"] == drafts
    assert r["spec_decode_draft_tokens"] == draft_tokens
    assert r["spec_decode_accepted_tokens"] == accepted
    assert r["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / draft_tokens)
    assert r["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts)
    per_pos = [d[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] / drafts for i in range(4)]
    assert r["spec_decode_per_position_acceptance_rates"] == pytest.approx(per_pos)


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
