"""Hostile files for `bench`, `check-output record|compare` and `report` (suites, bench results,
references: wrong types, missing keys, NaN, deep nesting, truncation, FIFOs, folders), and
`model tiny`, which never writes into a folder it did not create. Each is refused with one line
``sparkspec: error: ...`` naming the file, exit 2, before any request, with nothing written
(tests.badinput)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.badinput import fingerprint, refused_untouched, run

from .fakevllm import DROP, MODEL, TOKENS, FakeVllm, argv, bench_result

# --- files the commands read: wrong types, missing keys, nesting, truncation, non-regular files ---

SUITE_LINES = {
    "not-json": "{prompt: hi}",
    "array": '["hi"]',
    "prompt-missing": '{"id": "a"}',
    "prompt-int": '{"prompt": 5}',
    "prompt-empty": '{"prompt": ""}',
    "id-int": '{"id": 3, "prompt": "hi"}',
    "id-newline": '{"id": "a\\nb", "prompt": "hi"}',
    "expect-json-str": '{"prompt": "hi", "expect_json": "yes"}',
    "category-list": '{"prompt": "hi", "category": ["x"]}',
    "nan": '{"prompt": "hi", "weight": NaN}',
    "deep": '{"prompt": "hi", "x": ' + "[" * 5000 + "]" * 5000 + "}",
    "truncated": '{"id": "a", "prompt": "Say h',
}


@pytest.mark.parametrize("command", ["bench", "check-output record"])
@pytest.mark.parametrize("name", list(SUITE_LINES))
def test_malformed_suite_is_refused(command: str, name: str, fake: FakeVllm, work: Path) -> None:
    (work / "suite.jsonl").write_text('{"id": "ok", "prompt": "fine"}\n' + SUITE_LINES[name] + "\n")
    refused_untouched(argv(command, fake, work), [work], 2, match=r"suite\.jsonl:2")
    assert fake.seen == []


@pytest.mark.parametrize("kind", ["empty", "blank-lines", "fifo", "dir", "binary", "duplicate-ids"])
def test_suite_that_is_not_a_suite_is_refused(kind: str, fake: FakeVllm, work: Path) -> None:
    suite = work / "s.jsonl"
    if kind == "fifo":
        os.mkfifo(suite)
    elif kind == "dir":
        suite.mkdir()
    elif kind == "binary":
        suite.write_bytes(b'{"prompt": "\xff\xfe"}\n')
    elif kind == "duplicate-ids":
        suite.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    else:
        suite.write_text("" if kind == "empty" else "\n  \n")
    command = "check-output record" if kind == "duplicate-ids" else "bench"
    refused_untouched(argv(command, fake, work, **{"--suite": str(suite)}), [work], 2,
                      match=r"s\.jsonl")
    assert fake.seen == []


RESULTS: dict[str, Any] = {
    "not-an-object": [1, 2],
    "completed-missing": bench_result(completed=DROP),
    "mean-missing": bench_result(per_request_tok_s_mean=DROP),
    "completed-str": bench_result(completed="3"),
    "completed-negative": bench_result(completed=-1),
    "mean-str": bench_result(per_request_tok_s_mean="fast"),
    "mean-bool": bench_result(per_request_tok_s_mean=True),
    "peak-list": bench_result(per_request_tok_s_max=[1]),
    "rate-str": bench_result(spec_decode_acceptance_rate="70%"),
    "length-dict": bench_result(spec_decode_acceptance_length={"x": 1}),
    "throughput-str": bench_result(output_throughput="60"),
    "method-int": bench_result(method=5),
    "served-model-str": bench_result(served_model="tiny"),
    "served-id-int": bench_result(served_model={"id": 1}),
    "suites-list": bench_result(suites=["structured"]),
    "suite-mean-str": bench_result(suites={"open": {"per_request_tok_s_mean": "x"}}),
    "failed-float": bench_result(failed=0.5),
    "partial-str": bench_result(partial="no"),
    "error-int": bench_result(error=3),
    "rate-over-100": bench_result(spec_decode_acceptance_rate=250),
    "failed-huge-float": bench_result(failed=1e30),
    "completed-huge": bench_result(completed=10**30),
    "concurrency-huge": bench_result(max_concurrency=10**30),
    "max-tokens-str": bench_result(max_tokens="8"),
    "max-tokens-float": bench_result(max_tokens=8.0),
    "temperature-huge": bench_result(temperature=1e300),
}
RAW_RESULTS = {
    "nan": json.dumps(bench_result()).replace("40.0", "NaN"),
    "infinity": json.dumps(bench_result()).replace("40.0", "Infinity"),
    "overflow": json.dumps(bench_result()).replace("40.0", "1e999"),
    "deep": ('{"completed": 1, "per_request_tok_s_mean": 1.0, "x": '
             + "[" * 5000 + "]" * 5000 + "}"),
    "truncated": json.dumps(bench_result())[:-20],
    "binary": '{"method": "\xff"}',
    "empty": "",
}


@pytest.mark.parametrize("name", list(RESULTS) + list(RAW_RESULTS))
def test_malformed_bench_result_is_refused_by_report(name: str, fake: FakeVllm, work: Path) -> None:
    bad = work / "bad.json"
    if name in RESULTS:
        bad.write_text(json.dumps(RESULTS[name]))
    elif name == "binary":
        bad.write_bytes(b'{"method": "\xff"}')
    else:
        bad.write_text(RAW_RESULTS[name])
    # the good file first: nothing may be written for it either
    refused_untouched(argv("report", fake, work, **{"--inputs": None}) + ["--inputs",
                                                                          str(work / "result.json"),
                                                                       str(bad)], [work], 2,
                                                                       match=r"bad\.json")


@pytest.mark.parametrize("alias", ["same", "symlink", "dotted"])
def test_report_refuses_the_same_input_twice(alias: str, fake: FakeVllm, work: Path) -> None:
    first = work / "result.json"
    second = {"same": first, "symlink": work / "link.json",
              "dotted": work / "." / "result.json"}[alias]
    if alias == "symlink":
        second.symlink_to(first)
    refused_untouched(argv("report", fake, work, **{"--inputs": None}) + ["--inputs", str(first),
                                                                          str(second)],
                      [work], 2, match=r"--inputs .*result\.json.* twice")


def test_report_takes_two_distinct_results(fake: FakeVllm, work: Path) -> None:
    (work / "other.json").write_text(json.dumps(bench_result(method="mtp")))
    out = run(*argv("report", fake, work, **{"--inputs": None, "--plot": None}), "--inputs",
              str(work / "result.json"), str(work / "other.json"))
    assert out.rc == 0, out.stderr
    main, per_suite = (work / "out.md").read_text().split("\n\n")
    assert main.count("\n| ") == 2  # two rows after the header
    suites = len(bench_result()["suites"])
    assert per_suite.startswith("| Method | Model | Suite | Avg tok/s | Acceptance | Tool-call")
    assert per_suite.count("\n| ") == 2 * suites   # a row per method and suite


@pytest.mark.parametrize("kind", ["fifo", "dir", "missing"])
def test_report_input_that_is_not_a_file_is_refused(kind: str, fake: FakeVllm, work: Path) -> None:
    bad = work / "bad.json"
    if kind == "fifo":
        os.mkfifo(bad)
    elif kind == "dir":
        bad.mkdir()
    refused_untouched(argv("report", fake, work, **{"--inputs": str(bad)}), [work], 2,
                      match=r"bad\.json")


def test_report_rows_stay_rows_whatever_the_strings(fake: FakeVllm, work: Path) -> None:
    """A method or error string with newlines, pipes or escapes cannot add rows or break the
    table."""
    (work / "result.json").write_text(json.dumps(bench_result(
        method="evil\n| injected | row |\n", error="line1\nline2\r|x", partial=True,
        served_model={"id": "a|b\x1b[2J"}, suites={"o\npen": {"per_request_tok_s_mean": 1.0}})))
    out = run(*argv("report", fake, work))
    assert out.rc == 0, out.stderr
    main, per_suite = (work / "out.md").read_text().split("\n\n")
    lines = main.splitlines()
    assert len(lines) == 3 and lines[2].startswith("| evil")
    # 12 columns: no cell split or added
    assert "\x1b" not in lines[2] and lines[2].count(" | ") == 11
    suite_lines = per_suite.splitlines()
    assert len(suite_lines) == 3 and suite_lines[2].startswith("| evil")
    assert "| o pen |" in suite_lines[2] and suite_lines[2].count(" | ") == 5


def test_report_replaces_its_own_plot_but_no_other_png(fake: FakeVllm, work: Path) -> None:
    """A plot the report wrote (Description "sparkspec report") is replaced; any other PNG is
    refused and left as it was: another matplotlib figure (no marker: the legacy "Matplotlib
    version" rule is gone), a picture from elsewhere, and one that holds the marker's words outside
    its Description."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (work / "result.json").write_text(json.dumps(bench_result()))
    out = run(*argv("report", fake, work))
    assert out.rc == 0, out.stderr
    ours = (work / "out.png").read_bytes()
    (work / "out.md").unlink()
    os.utime(work / "out.png", (0, 0))
    out = run(*argv("report", fake, work))
    assert out.rc == 0, out.stderr
    assert ((work / "out.png").stat().st_mtime > 0
            and (work / "out.png").read_bytes()[:8] == ours[:8])
    fig = plt.figure()
    other = io.BytesIO()
    # matplotlib's default tags
    fig.savefig(other, format="png", metadata={"Title": "sparkspec report"})
    plt.close(fig)
    for foreign in (other.getvalue(), b"\x89PNG\r\n\x1a\n" + b"\0" * 64):
        (work / "out.png").write_bytes(foreign)
        (work / "out.md").unlink(missing_ok=True)
        refused_untouched(argv("report", fake, work), [work], 2, match=r"out\.png")


def _reference(**changes: Any) -> dict[str, Any]:
    doc = {"format": "sparkspec-lossless-reference/1", "model": MODEL, "method": "baseline",
           "max_tokens": TOKENS, "temperature": 0.0, "enable_thinking": False,
           "outputs": [{"id": "a", "suite": "s", "prompt": "p", "expect_json": False,
                                                   "text": "t"}]}
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not DROP}


def _output(**changes: Any) -> dict[str, Any]:
    return _reference(outputs=[{k: v for k, v in ({"id": "a", "suite": "s", "prompt": "p",
                                                   "expect_json": False,
                                                   "text": "t"} | changes).items()
                                if v is not DROP}])


REFERENCES: dict[str, Any] = {
    "format-missing": _reference(format=DROP),
    "format-other": _reference(format="something/2"),
    "outputs-missing": _reference(outputs=DROP),
    "outputs-empty": _reference(outputs=[]),
    "outputs-dict": _reference(outputs={"a": 1}),
    "output-str": _reference(outputs=["a"]),
    "id-int": _output(id=1),
    "id-empty": _output(id=""),
    "prompt-missing": _output(prompt=DROP),
    "prompt-int": _output(prompt=1),
    "text-missing": _output(text=DROP),
    "text-null": _output(text=None),
    "expect-json-str": _output(expect_json="yes"),
    "max-tokens-str": _reference(max_tokens="8"),
    "max-tokens-zero": _reference(max_tokens=0),
    "max-tokens-huge": _reference(max_tokens=10**12),
    "max-tokens-float": _reference(max_tokens=8.5),
    "thinking-str": _reference(enable_thinking="no"),
    "duplicate-ids": _reference(outputs=_output()["outputs"] * 2),
    "model-other": _reference(model="another-model"),
    "model-missing": _reference(model=DROP),
    "temperature-not-greedy": _reference(temperature=0.7),
    "temperature-nan-str": _reference(temperature="NaN"),
    "temperature-missing": _reference(temperature=DROP),
}
RAW_REFERENCES = {
    "nan": json.dumps(_reference()).replace(f'"max_tokens": {TOKENS}', '"max_tokens": NaN'),
    "deep": json.dumps(_reference(extra=0)).replace('"extra": 0',
                                                    '"extra": ' + "[" * 5000 + "]" * 5000),
    "truncated": json.dumps(_reference())[:40],
    "not-json": "format: sparkspec",
}


@pytest.mark.parametrize("name", list(REFERENCES) + list(RAW_REFERENCES) + ["fifo", "dir"])
def test_malformed_reference_is_refused(name: str, fake: FakeVllm, work: Path) -> None:
    ref = work / "bad-ref.json"
    if name == "fifo":
        os.mkfifo(ref)
    elif name == "dir":
        ref.mkdir()
    elif name in REFERENCES:
        ref.write_text(json.dumps(REFERENCES[name]))
    else:
        ref.write_text(RAW_REFERENCES[name])
    refused_untouched(argv("check-output compare", fake, work, **{"--reference": str(ref)}),
                      [work], 2, match=r"bad-ref\.json")
    assert fake.seen == []


# --- model tiny: never writes into a folder it did not create -------------------------------------

def test_tiny_model_refuses_a_folder_it_did_not_write(fake: FakeVllm, work: Path) -> None:
    model = work / "real-model"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["SomethingPrecious"]}\n')
    (model / "model.safetensors").write_bytes(b"weights of value")
    refused_untouched(["model", "tiny", "--out", str(model)], [work], 2, match=r"--out")


def test_tiny_model_refuses_a_symlink_and_a_file(fake: FakeVllm, work: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    target = tmp_path_factory.mktemp("elsewhere")
    (work / "link").symlink_to(target)
    refused_untouched(["model", "tiny", "--out", str(work / "link")], [work, target], 2,
                      match=r"--out.*link")
    refused_untouched(["model", "tiny", "--out", str(work / "key")], [work], 2, match=r"--out")


def test_tiny_model_rewrites_its_own_folder_and_an_empty_one(work: Path) -> None:
    model = work / "model"
    model.mkdir()
    first = run("model", "tiny", "--out", str(model), "--json")
    assert first.rc == 0 and json.loads(first.stdout.splitlines()[-1])["changed"] is True, \
        first.stderr
    again = run("model", "tiny", "--out", str(model), "--json")
    assert again.rc == 0 and json.loads(again.stdout.splitlines()[-1])["changed"] is False, \
        again.stderr
    other = run("model", "tiny", "--out", str(model), "--seed", "3", "--json")
    assert other.rc == 0 and json.loads(other.stdout.splitlines()[-1])["changed"] is True, \
        other.stderr
    assert sorted(p.name for p in model.iterdir()) == sorted(
        ["model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json",
         "special_tokens_map.json", "generation_config.json"])


def test_tiny_model_failure_leaves_nothing(work: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk full while writing: exit 1, and the folder it was creating is gone."""
    import errno

    from tests.support import tinymodel

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tinymodel, "_dump", full)
    before = fingerprint(work)
    out = run("model", "tiny", "--out", str(work / "new" / "model"))
    assert out.rc == 1 and out.stderr.startswith("sparkspec: "
                                                 "error: ") and out.stderr.count("\n") == 1, \
        out.stderr
    assert "No space left" in out.stderr and fingerprint(work) == before
