"""The Results Summary table and plot on the controller (tasks/report.py): `invoke report` as a user
types it, the verify role's `python -m tasks report`, and `sparkspec report` on a host saying where
it went. The hostile inputs and outputs of the report are in tests/bench/test_bench_hostile*.py
(tests.badinput.run routes `report` to tasks.report.main)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import BIN, ROOT

HEADER = ("| Method | Model | Avg tok/s | Peak tok/s | Drafts | Draft tokens | Accepted | "
          "Acceptance Rate | Acceptance per position | Mean acceptance length | Lossless | Notes |")


def _result(method: str, avg: float, rate: float | None) -> dict[str, object]:
    spec = rate is not None
    return {"method": method, "served_model": {"id": "tiny"}, "suite": "all", "max_concurrency": 1,
            "temperature": 0.0, "completed": 3, "failed": 0, "output_throughput": avg * 1.5,
            "per_request_tok_s_mean": avg, "per_request_tok_s_max": avg + 5,
            "spec_decode_acceptance_rate": rate,
            "spec_decode_acceptance_length": 2.5 if spec else None, "partial": False,
            "spec_decode_num_drafts": 40 if spec else None,
            "spec_decode_draft_tokens": 80 if spec else None,
            "spec_decode_accepted_tokens": 60 if spec else None,
            "spec_decode_per_position_acceptance_rates": [0.875, 0.625] if spec else None,
            "model_id": "tiny", "suites": {"structured": {"per_request_tok_s_mean": avg + 1},
                                           "open": {"per_request_tok_s_mean": avg - 1}}}


def _inputs(folder: Path) -> tuple[list[Path], Path]:
    paths = []
    for name, avg, rate in (("baseline", 36.5, None), ("mtp", 48.25, 71.0)):
        paths.append(folder / f"{name}.json")
        paths[-1].write_text(json.dumps(_result(name, avg, rate)))
    # 2 of 3 identical (allowed down to 0.6): the note names the divergence
    loss = folder / "lossless-mtp.json"
    loss.write_text(json.dumps({"format": "sparkspec-lossless-report/1", "method": "mtp",
                                "model": "tiny", "identical": 2, "total": 3, "passed": True,
                                "mismatches": [
                                    {"id": "s3", "offset": 7, "expected": "abc", "actual": "abd",
                                     "token_index": 4, "expected_token": 99,
                                     "actual_token": 100}]}))
    return paths, loss


def _run(*argv: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300, check=False)


def test_invoke_report_writes_the_table_and_plot(tmp_path: Path) -> None:
    paths, loss = _inputs(tmp_path)
    md, png = tmp_path / "out" / "r.md", tmp_path / "out" / "r.png"
    done = _run(BIN / "invoke", "report", "--inputs", paths[0], "--inputs", paths[1], "--lossless",
                loss, "--markdown", md, "--plot", png, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"changed": True, "rows": 2,
                                                        "markdown": str(md), "plot": str(png)}
    lines = md.read_text().splitlines()
    assert lines[0] == HEADER
    assert lines[2].startswith("| baseline | tiny | 36.5 | 41.5 | n/a | n/a | n/a | n/a "
                               "| n/a | n/a | reference | ")
    assert lines[3].startswith("| mtp | tiny | 48.2 | 53.2 | 40 | 80 | 60 | 71.0% | 87.5% / "
                               "62.5% | 2.50 | 2/3 pass | first divergence in s3 at token 4: "
                               "expected id 99 vs got id 100 ('abc' vs 'abd')")
    assert "structured 49.2 tok/s" in lines[3]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_invoke_report_refuses_a_bad_result_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    done = _run(BIN / "invoke", "report", "--inputs", bad, "--markdown", tmp_path / "r.md")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"sparkspec: error: {bad}: has no 'completed'; "
                                        "pass files written by `sparkspec bench` (or run "
                                        "the bench again)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.json"]


def test_the_verify_roles_command_line_prints_the_table(tmp_path: Path) -> None:
    """`python -m tasks report`, from the checkout (the role's chdir), without --markdown: the table
    on stdout."""
    paths, _ = _inputs(tmp_path)
    done = _run(sys.executable, "-m", "tasks", "report", "--inputs", *paths)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    main, per_suite = done.stdout.split("\n\n")
    assert main.splitlines()[0] == HEADER and len(main.splitlines()) == 4
    assert per_suite.startswith("| Method | Model | Suite |")   # the inputs have suites


def test_the_host_cli_has_no_report(tmp_path: Path) -> None:
    """The table and the plot are the controller's (`invoke report`); the host's CLI knows no
    report."""
    paths, _ = _inputs(tmp_path)
    done = _run(sys.executable, "-m", "sparkspec.cli", "report", "--inputs", *map(str, paths),
                "--markdown", str(tmp_path / "r.md"), cwd=tmp_path)
    assert done.returncode == 2 and "invalid choice: 'report'" in done.stderr, done.stderr
    assert not (tmp_path / "r.md").exists()
