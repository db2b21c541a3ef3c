"""`sparkspec check needle-metrics`: a needle report's figures per tier as gauges for the node
exporter's textfile collector, read back with prometheus_client's parser; a report or argument it
cannot trust is refused in one line with nothing written."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sparkspec.bench import needle
from tests.badinput import refused_untouched, run

from .fakevllm import MODEL, FakeVllm
from .test_answers_needle import _reader

UNIT = "sparkspec-vllm"


def samples(path: Path) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Metric name -> {sorted labels: value} of a textfile."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def _tier(tier: int) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"unit": UNIT, "method": "ngram", "model": MODEL,
                         "tier": str(tier)}.items()))


@pytest.fixture(scope="module")
def measured(server: FakeVllm, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A needle report from the fake: found at 256 tokens, lost at 512 (measured, not checked)."""
    server.reset()
    server.answer = _reader(drop_above=400)
    path = tmp_path_factory.mktemp("needle") / "needle.json"
    out = run("check", "needle", "--url", server.url, "--model", MODEL, "--timeout", "20",
              "--tiers", "256,512", "--expect", "any", "--method", "ngram", "--output", str(path))
    assert out.rc == 0, out.stderr
    return path.read_bytes()


@pytest.fixture()
def report(measured: bytes, tmp_path: Path) -> Path:
    (tmp_path / "work").mkdir()
    path = tmp_path / "work" / "needle.json"
    path.write_bytes(measured)
    return path


@pytest.fixture()
def textfiles(tmp_path: Path) -> Path:
    folder = tmp_path / "textfile"
    folder.mkdir()
    return folder


def publish(report: Path, folder: Path, *extra: str, method: str = "ngram") -> list[str]:
    return ["check", "needle-metrics", "--report", str(report), "--unit", UNIT, "--method",
            method, "--dir", str(folder), *extra]


def test_each_tier_becomes_gauges_with_the_reports_figures(report: Path, textfiles: Path) -> None:
    out = run(*publish(report, textfiles, "--json"))
    assert out.rc == 0, out.stderr
    target = textfiles / f"sparkspec-needle.{UNIT}+ngram.prom"
    assert json.loads(out.stdout.splitlines()[-1]) == {"changed": True, "path": str(target)}
    assert oct(target.stat().st_mode & 0o777) == "0o644"
    got = samples(target)
    doc = json.loads(report.read_text())
    assert got["sparkspec_needle_found_ratio"] == {_tier(256): 1.0, _tier(512): 0.0}
    assert got["sparkspec_needle_tokens_per_second"] == {
        _tier(t["tier"]): pytest.approx(t["per_request_tok_s_mean"]) for t in doc["tiers"]}
    assert got["sparkspec_needle_ttft_seconds"] == {
        _tier(t["tier"]): pytest.approx(t["mean_ttft_ms"] / 1000) for t in doc["tiers"]}
    # the fake serves no speculative decoding: no acceptance, rather than a made-up 0
    assert "sparkspec_needle_acceptance_ratio" not in got
    (when,) = got["sparkspec_needle_checked_timestamp_seconds"].values()
    assert when == datetime.datetime.strptime(doc["date"], needle.DATE).timestamp()


def test_acceptance_is_a_ratio_per_tier() -> None:
    doc = {"format": needle.FORMAT, "method": "mtp+int8_lm_head", "model": "m",
           "date": "2026-12-06T10:00:00+0000",
           "tiers": [{"tier": 8192, "answers": [{"found": True}, {"found": False}],
                      "per_request_tok_s_mean": 41.2, "mean_ttft_ms": 900.0,
                      "spec_decode_acceptance_rate": 71.0}]}
    text = needle.textfile(doc, UNIT).decode()
    fams = {f.name: f.samples for f in text_string_to_metric_families(text)}
    (acc,) = fams["sparkspec_needle_acceptance_ratio"]
    assert acc.value == pytest.approx(0.71) and acc.labels["method"] == "mtp+int8_lm_head"
    assert fams["sparkspec_needle_found_ratio"][0].value == 0.5
    assert fams["sparkspec_needle_checked_timestamp_seconds"][0].value == 1796551200.0


def _edit(*path: str | int, value: Any) -> Any:
    """A change to a report: the value at ``path`` (keys and list indices) replaced."""
    def change(doc: dict[str, Any]) -> Any:
        target: Any = doc
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
        return doc
    return change


@pytest.mark.parametrize(("change", "line"), [
    (_edit("format", value="sparkspec-check-answers/1"), "is not a needle report"),
    (_edit("method", value="mtp"), "was measured with --method 'mtp', not 'ngram'"),
    (_edit("tiers", 0, "per_request_tok_s_mean", value="fast"),
     "'per_request_tok_s_mean' is str 'fast', expected int or float or NoneType"),
    (_edit("tiers", 0, "answers", 0, "found", value=1), "'found' is int 1, expected bool"),
    (_edit("tiers", 1, "tier", value=8), "'tier' is below 128 tokens"),
    (_edit("tiers", value=[]), "holds 0 tiers, not 1 to 16"),
    (_edit("date", value="yesterday"), "'date' is not a time"),
    (lambda doc: [doc], "is not a JSON object"),
], ids=["format", "method", "tok-s-string", "found-int", "tier-small", "no-tiers", "date",
        "a-list"])
def test_a_report_it_cannot_trust_is_refused(report: Path, textfiles: Path, change: Any,
                                             line: str) -> None:
    report.write_text(json.dumps(change(json.loads(report.read_text()))))
    out = refused_untouched(publish(report, textfiles), [textfiles])
    assert line in out.stderr, out.stderr


@pytest.mark.parametrize(("unit", "method", "line"), [
    ("../etc/x", "ngram", "--unit '../etc/x' is not a unit name"),
    ("a+b", "ngram", "--unit 'a+b' is not a unit name"),
    (UNIT, "ngram/../../x", "--method 'ngram/../../x' is not a method label"),
    (UNIT, "ngram+Int8", "--method 'ngram+Int8' is not a method label"),
], ids=["unit-path", "unit-plus", "method-path", "lever-case"])
def test_a_name_that_would_leave_the_folder_is_refused(report: Path, textfiles: Path, unit: str,
                                                       method: str, line: str) -> None:
    argv = publish(report, textfiles, method=method)
    argv[argv.index("--unit") + 1] = unit
    out = refused_untouched(argv, [textfiles, report.parent])
    assert line in out.stderr, out.stderr


def test_a_folder_that_is_a_link_or_missing_is_refused(report: Path, textfiles: Path,
                                                       tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(textfiles)
    for folder in (link, tmp_path / "missing", Path("relative")):
        out = refused_untouched(publish(report, folder), [tmp_path])
        assert "is not an absolute path to a folder (a link is refused)" in out.stderr
    assert not (tmp_path / "missing").exists() and os.listdir(textfiles) == []


def test_a_report_that_is_a_link_or_the_output_is_refused(report: Path, textfiles: Path,
                                                          tmp_path: Path) -> None:
    """root would read through another user's link, or overwrite the report it reads."""
    link = tmp_path / "link.json"
    link.symlink_to(report)
    out = refused_untouched(publish(link, textfiles), [tmp_path])
    assert "is a symbolic link; give the report itself" in out.stderr
    same = textfiles / f"sparkspec-needle.{UNIT}+ngram.prom"
    same.write_bytes(report.read_bytes())
    out = refused_untouched(publish(same, textfiles), [tmp_path])
    assert f"is the input --report {same}" in out.stderr
