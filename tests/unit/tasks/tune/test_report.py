"""`invoke tune`'s report (tasks.tune.report): the markdown (title, best-k table, a table per case,
the verdicts, the batch-size schedule), the JSON `--apply` reads, and the three files written all or
none through sparkspec.outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from sparkspec.errors import UserError
from sparkspec.outputs import PNG_SIGNATURE
from tasks.tune import fit as tune_fit
from tasks.tune import report as tune_report

SETTINGS = {"suite": "all", "temperature": 0.0, "k measured": "1,3"}
HEADER = ("| k | measured tok/s (± s.e.) | a_i of this run (%) | predicted tok/s [95 %] | "
          "E(k) | E_geo(k) | error |")


def _result(tok_s: float, **spec: Any) -> dict[str, Any]:
    return {"per_request_tok_s_mean": tok_s, "per_request_tok_s_std": 1.0, "completed": 100, **spec}


def _top(tok_s: float) -> dict[str, Any]:
    # k_max 3: 100 drafts, a = [0.8, 0.6, 0.3], 170 accepted, 270 generated: f = 1,
    # E(k) = 1.8, 2.4, 2.7
    return _result(tok_s, spec_decode_num_drafts=100, spec_decode_draft_tokens=300,
                   spec_decode_accepted_tokens=170,
                   spec_decode_per_position_acceptance_rates=[0.8, 0.6, 0.3],
                   server_generation_tokens=270)


def _found() -> list[tune_fit.Case]:
    # level 1: baseline 40, k3 80: t0 0.025, delta (2.7/80 - 0.025)/3 = 0.0029167;
    # k1 1.8/0.0279167 = 64.48, k2 77.84, k3 80: best 3 = measured best (k3 80 > k1 60).
    # level 4: baseline 70, k3 60: delta 0.0102381; k1 73.40, k2 69.04, k3 60: best 1 = measured
    # best (k1 65 > k3 60), and baseline 70 beats both.
    results = {(0, 1): _result(40.0), (3, 1): _top(80.0), (1, 1): _result(60.0),
               (0, 4): _result(70.0), (3, 4): _top(60.0), (1, 4): _result(65.0)}
    return tune_fit.cases(results, {key: f"{key}.json" for key in results}, 3, [1, 4])


def test_markdown_has_the_title_the_tables_and_the_verdicts() -> None:
    found = _found()
    assert [c.verdict for c in found] == ["predicted best k 3 = best measured k 3",
                                          "predicted best k 1 = best measured k 1"]
    text = tune_report.markdown("ngram", "spark01", SETTINGS, found)
    lines = text.splitlines()
    assert lines[0] == "# sparkspec tune: ngram on spark01"
    assert "Workload: suite all, temperature 0.0, k measured 1,3" in lines
    assert "| all prompts | 1 | 3 | 3 | predicted best k 3 = best measured k 3 |" in lines
    assert "| all prompts | 4 | 1 | 1 | predicted best k 1 = best measured k 1 |" in lines
    assert lines.count(HEADER) == 2
    assert lines.index("## all prompts, concurrency 1") < \
        lines.index("## all prompts, concurrency 4")
    assert "| 0 (baseline) | 40.0 ± 0.1 | | | 1 | 1 | |" in lines
    # k1 at level 1: measured 60, predicted 64.48 (+7.5 %), E(1) 1.80; E_geo(1) = 1 + a with
    # a = 170 / (100 + 80 + 60) = 0.7083: 1.71; its own run drafted nothing: no a_i
    assert any(re.fullmatch(r"\| 1 \| 60\.0 ± 0\.1 \|  \| 64\.5 \[\d+\.\d-\d+\.\d\] \| "
                            r"1\.80 \| 1\.71 \| \+7\.5 % \|", line) for line in lines)
    # k3, the k_max run: its a_i, E_geo(3) = 1 + 0.7083 + 0.5017 + 0.3554 = 2.57,
    # error 0 by construction
    assert any(re.fullmatch(r"\| 3 \*\*best\*\* \| 80\.0 ± 0\.1 \| 80\.0 / 60\.0 / 30\.0 \| "
                            r"80\.0 \[.*\] \| 2\.70 \| 2\.57 \| \+0\.0 % \|", line)
               for line in lines)
    assert ("- baseline (70.0 tok/s) beats every k measured: serve without drafting for this "
            "workload") in lines
    assert ("speculative_config: {num_speculative_tokens: 3, "
            "num_speculative_tokens_per_batch_size: [[1, 3, 3], [4, 4, 1]]}") in lines
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_markdown_of_a_case_without_prediction() -> None:
    results = {(0, 1): _result(40.0), (3, 1): _result(50.0, spec_decode_num_drafts=0,
                                                       server_generation_tokens=500)}
    found = tune_fit.cases(results, {key: "r.json" for key in results}, 3, [1])
    text = tune_report.markdown("mtp", "h", {}, found)
    assert re.search(r"^\| all prompts \| 1 \| - \| \S+ \| no prediction: the method drafted "
                     r"nothing in the k_max run \|$", text, re.M)
    assert "Batch-size-dependent k" not in text   # one level: no schedule
    assert "| 3 | 50.0 ± 0.1 |  |  |  |  |  |" in text


def test_document_is_json_with_the_format_and_the_best_k() -> None:
    found = _found()
    doc = json.loads(json.dumps(tune_report.document("ngram", "spark01", SETTINGS, found),
                                allow_nan=False))
    assert doc["format"] == "sparkspec-tune/1"
    assert (doc["method"], doc["host"], doc["settings"]) == ("ngram", "spark01", SETTINGS)
    assert doc["best_k"] == 3   # the whole run's at the first level
    assert doc["batch_schedule"] == [[1, 3, 3], [4, 4, 1]]
    first = doc["cases"][0]
    assert (first["suite"], first["concurrency"], first["k_max"], first["baseline_tok_s"]) == (
        "all prompts", 1, 3, 40.0)
    assert first["measured"]["1"] == {"tok_s": 60.0, "se": 0.1, "requests": 100}
    assert first["tuning"]["best_k"] == 3
    assert [r["estimate"] for r in first["tuning"]["survival"]["rates"]] == \
        pytest.approx([0.8, 0.6, 0.3])
    assert doc["cases"][1]["notes"][0].startswith("baseline (70.0 tok/s)")


def _paths(targets: list[Any]) -> list[Path]:
    """The report, plot and result paths of ``outputs``' targets, in that order."""
    by_flag = {o.flag: Path(o.path) for o in targets}
    assert sorted(by_flag) == ["plot", "report", "result"]
    return [by_flag["report"], by_flag["plot"], by_flag["result"]]


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_write_makes_the_three_files_and_replaces_its_own(tmp_path: Path) -> None:
    folder = tmp_path / "reports" / "spark01"
    targets = tune_report.outputs(str(folder), "ngram")
    found = _found()
    text = tune_report.write(targets, "ngram", "spark01", SETTINGS, found)
    md, png, js = _paths(targets)
    assert md.parent == png.parent == folder and md.name == "tune-ngram.md"
    assert md.read_text() == text and text.startswith("# sparkspec tune")
    assert png.read_bytes().startswith(PNG_SIGNATURE)
    assert json.loads(js.read_text())["format"] == "sparkspec-tune/1"
    assert _files(folder) == sorted(str(p.relative_to(folder)) for p in (md, png, js))
    # a second run replaces what the first wrote
    again = tune_report.outputs(str(folder), "ngram")
    tune_report.write(again, "ngram", "spark01", {"suite": "open"}, found)
    assert "Workload: suite open" in md.read_text()


def test_write_refuses_a_foreign_markdown_and_writes_none(tmp_path: Path) -> None:
    folder = tmp_path / "reports" / "spark01"
    targets = tune_report.outputs(str(folder), "ngram")   # checked while nothing was there
    md, png, js = _paths(targets)
    md.parent.mkdir(parents=True)
    md.write_text("# my own notes\n")
    with pytest.raises(UserError,
                       match=r"tune-ngram\.md: exists and was not written by this command"):
        tune_report.write(targets, "ngram", "spark01", SETTINGS, _found())
    assert md.read_text() == "# my own notes\n"
    assert not png.exists() and not js.exists()
    assert _files(folder) == ["tune-ngram.md"]   # no temp file either, no folder left with one
    # and checked up front too
    with pytest.raises(UserError,
                       match=r"tune-ngram\.md: exists and was not written by this command"):
        tune_report.outputs(str(folder), "ngram")


def test_write_refuses_a_foreign_json_result(tmp_path: Path) -> None:
    folder = tmp_path / "r"
    targets = tune_report.outputs(str(folder), "ngram")
    md, png, js = _paths(targets)
    js.parent.mkdir(parents=True)
    js.write_text('{"format": "something-else/1"}\n')
    with pytest.raises(UserError,
                       match=rf"{re.escape(js.name)}: exists and was not written by this command"):
        tune_report.write(targets, "ngram", "spark01", SETTINGS, _found())
    assert not png.exists() and not md.exists()
    assert js.read_text() == '{"format": "something-else/1"}\n'


def test_a_linked_report_folder_is_refused(tmp_path: Path) -> None:
    """reports/<host>/tune as a link would steer the figures elsewhere: refused before anything
    runs."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    folder = tmp_path / "reports" / "h"
    folder.mkdir(parents=True)
    (folder / "tune").symlink_to(elsewhere)
    with pytest.raises(UserError, match=r"tune: a symbolic link; remove it"):
        tune_report.outputs(str(folder), "ngram")
    assert list(elsewhere.iterdir()) == []
