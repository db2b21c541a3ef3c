"""Parts that need no vLLM: metrics parsing, the lossless comparison, the client ceiling, and bad
input the client refuses before any request."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sparkspec.bench import lossless, metrics
from sparkspec.errors import UserError
from tests.support import bench_ceiling, bench_vs_vllm

from .conftest import Cli, free_port

DATA = Path(__file__).parent / "data"


def test_metrics_sum_label_sets_and_keep_positions() -> None:
    text = (DATA / "metrics_ngram.txt").read_text()
    one = metrics.parse(text)
    assert one.has_spec_decode and one.num_drafts > 0 and len(one.accepted_per_pos) == 4
    # The same counters from a second engine: every figure is summed over label sets.
    two = metrics.parse(text + "\n".join(line.replace('engine="0"',
                                                      'engine="1"') for line in text.splitlines()
                                         if line.startswith("vllm:")) + "\n")
    assert two.generation_tokens == 2 * one.generation_tokens
    assert two.num_accepted_tokens == 2 * one.num_accepted_tokens
    assert two.accepted_per_pos == {p: 2 * v for p, v in one.accepted_per_pos.items()}


def test_spec_figures_from_deltas_and_none_without_spec_decode() -> None:
    after = metrics.parse((DATA / "metrics_ngram.txt").read_text())
    figures = metrics.spec_decode_figures(metrics.delta(metrics.Snapshot(has_spec_decode=True),
                                                        after))
    assert figures["spec_decode_acceptance_rate"] == pytest.approx(
        100 * after.num_accepted_tokens / after.num_draft_tokens)
    expected = 1 + after.num_accepted_tokens / after.num_drafts
    assert figures["spec_decode_acceptance_length"] == pytest.approx(expected)
    assert figures["spec_decode_per_position_acceptance_rates"] == pytest.approx(
        [v / after.num_drafts for v in after.accepted_per_pos.values()])
    base = metrics.parse((DATA / "metrics_baseline.txt").read_text())
    assert not base.has_spec_decode and base.generation_tokens > 0
    assert set(metrics.spec_decode_figures(metrics.delta(base, base)).values()) == {None}
    # Spec decoding on, but no draft in the window: rates are not applicable, counts are 0.
    idle = metrics.spec_decode_figures(metrics.delta(after, after))
    assert idle["spec_decode_num_drafts"] == 0 and idle["spec_decode_acceptance_rate"] is None


def test_first_divergence_and_json_parsing() -> None:
    assert lossless.first_divergence("abc", "abc") is None
    assert lossless.first_divergence("abcdef", "abXdef") == 2
    assert lossless.first_divergence("abc", "abcdef") == 3
    assert lossless.parses_as_json('```json\n{"a": [1, 2]}\n```')
    assert lossless.parses_as_json(' [1, {"b": null}] ')
    assert not lossless.parses_as_json('{"a": 1')


def test_compare_reports_mismatch_offset_missing_and_json() -> None:
    ref = {"outputs": [{"id": "a", "prompt": "p", "text": "hello world", "expect_json": False},
                       {"id": "b", "prompt": "p", "text": '{"x": 1}', "expect_json": True},
                       {"id": "c", "prompt": "p", "text": "gone", "expect_json": False}]}
    got = [{"id": "a", "text": "hello there"}, {"id": "b", "text": '{"x": 1}'}]
    rep = lossless.compare(ref, got)
    assert (rep["total"], rep["identical"], rep["missing"]) == (3, 1, ["c"])
    assert rep["mismatches"][0]["id"] == "a" and rep["mismatches"][0]["offset"] == 6
    assert rep["json_expected"] == 1 and rep["json_parse_failures"] == 0
    assert lossless.verdict(rep, 0.3, True)[0] and not lossless.verdict(rep, 0.5, False)[0]
    # no token ids on either side: the character offset only
    assert rep["mismatches"][0]["token_index"] is None
    with_ids = lossless.compare({"outputs": [{"id": "a", "text": "ab", "token_ids": [5, 6, 7]}]},
                                [{"id": "a", "text": "ax", "token_ids": [5, 8]}])
    first = with_ids["mismatches"][0]
    assert (first["offset"], first["token_index"], first["expected_token"],
            first["actual_token"]) == (1, 1, 6, 8)
    assert lossless.first_token_divergence([1, 2], [1, 2, 3]) == (2, None, 3)
    bad_json = lossless.compare(ref, [{"id": "b", "text": "not json"}])
    assert bad_json["json_failed_ids"] == ["b"]
    assert (lossless.verdict(bad_json, 0.0, False)[0]
            and not lossless.verdict(bad_json, 0.0, True)[0])


def test_client_ceiling_counts_every_token() -> None:
    result = bench_ceiling.run(tokens=512, requests=6, concurrency=2)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 6 * 512
    assert result["client_ceiling_tok_s"] > 0


def test_unreachable_url_is_one_line_exit_2(tmp_path: Path, cli: Cli) -> None:
    port = free_port()  # bound then released: nothing listens there
    run = cli("bench", "--url", f"http://127.0.0.1:{port}", "--model", "m", "--output",
              str(tmp_path / "o.json"))
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "unreachable" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "o.json").exists()


def test_empty_suite_is_refused(tmp_path: Path, cli: Cli) -> None:
    suite = tmp_path / "empty.jsonl"
    suite.write_text("\n")
    # a listening port: the refusal must come before any connection
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        run = cli("bench", "--url", url, "--model", "m", "--suite", str(suite), "--output",
                  str(tmp_path / "o"))
    assert (run.returncode == 2 and run.stderr.count("\n") == 1
            and "suite has no prompts" in run.stderr)
    with pytest.raises(UserError, match="no such suite"):
        from sparkspec.bench.suites import load
        load(str(tmp_path / "missing.jsonl"))


def test_reference_must_be_a_recorded_reference(tmp_path: Path, cli: Cli) -> None:
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"outputs": []}))
    run = cli("check-output", "compare", "--url", "http://127.0.0.1:1", "--model", "m",
              "--reference", str(ref))
    assert run.returncode == 2 and "sparkspec-lossless-reference/1" in run.stderr


def _run(throughput: float, server_speed: float, tokens: int = 960) -> dict[str, object]:
    """One tool's run as bench_vs_vllm records it: the server generated ``tokens`` at
    ``server_speed`` tok/s."""
    duration = tokens / throughput
    busy = tokens / server_speed
    return {"output_throughput": throughput, "duration": duration, "total_output_tokens": tokens,
            "server_request_seconds": busy, "client_overhead_s": duration - busy}


def test_side_by_side_tells_server_drift_from_a_tool_difference() -> None:
    # The server got 25% faster between the two tools' runs; both tools lost the same 4% of wall
    # time.
    ours = [_run(960.0, 1000.0), _run(960.0, 1000.0)]
    ref = [_run(768.0, 800.0), _run(768.0, 800.0)]
    drifted = bench_vs_vllm.summarize(ours, ref, concurrency=1)
    assert (drifted["ratio_of_means"] == pytest.approx(1.25)
            and drifted["within_tolerance"] is False)
    assert drifted["drift_free_ratio"] == pytest.approx(1.0)
    assert (drifted["paired_ratios"] == pytest.approx([1.25, 1.25])
            and drifted["same_token_counts"] is True)
    # Same server speed, but one tool spends 10% more wall time per run than the server needed.
    slow = bench_vs_vllm.summarize([_run(900.0, 1000.0)] * 2, [_run(990.0, 1000.0)] * 2,
                                   concurrency=1)
    assert slow["drift_free_ratio"] == pytest.approx(900 / 990)
    assert slow["ours"]["stdev"] == 0.0 and slow["ours"]["mean"] == pytest.approx(900.0)
    # With requests in flight together the server's summed latency is not its busy time: no
    # drift-free figure.
    assert bench_vs_vllm.summarize(ours, ref, concurrency=4)["drift_free_ratio"] is None
    # The server-side latency sum is read from /metrics (a histogram's _sum) and differenced like
    # the counters.
    text = ("# TYPE vllm:e2e_request_latency_seconds histogram\n"
            'vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 12.5\n'
            'vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 3.0\n')
    later = text.replace("12.5", "20.0")
    assert (metrics.delta(metrics.parse(text), metrics.parse(later)).request_seconds
            == pytest.approx(7.5))


def test_side_by_side_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "vs.json"
    base = [sys.executable, "-m", "tests.support.bench_vs_vllm", "--url", "http://127.0.0.1:9",
            "--model", "m", "--output", str(out)]
    bare = tmp_path / "bare"  # a python without vLLM (or pandas): refused before any run
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True,
                   timeout=120)
    for extra, words in ((["--repeats", "1"], "need at least 2"),
                         (["--vllm-python", str(tmp_path / "nope")],
                          "not found; run scripts/bootstrap"),
                         (["--vllm-python", str(bare / "bin/python")],
                          "cannot run vllm bench serve")):
        run = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120,
                             check=False)
        assert (run.returncode == 2 and run.stderr.count("\n") == 1
                and words in run.stderr), run.stderr
        assert "Traceback" not in run.stderr and not out.exists()
