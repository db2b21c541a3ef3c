"""Side by side: ``vllm bench serve`` and ``sparkspec bench`` on the same server, prompts and
temperature, interleaved; the drift-free ratio compares the tools (docs/design.md, "Module notes").

    python -m tests.support.bench_vs_vllm --url http://127.0.0.1:8000 --model NAME \\
        --vllm-python .cache/vllm-venv/bin/python --repeats 20 [--api-key-file FILE]
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2 as httpx

from sparkspec.argtypes import number, temperature
from sparkspec.bench import metrics
from sparkspec.bench.client import MAX_TOKENS, BenchConfig, preflight, run_bench, sync_client
from sparkspec.bench.suites import file_of, suites_for
from sparkspec.cli.bench import (
    MAX_CONCURRENCY,
    api_key,
    arg_type,
    check_label,
    check_url,
    json_bytes,
)
from sparkspec.cli.common import Parser
from sparkspec.errors import UserError
from sparkspec.jsonfile import read_json
from sparkspec.outputs import Output, check_outputs, json_format, write_outputs

FORMAT = "sparkspec-bench-vs-vllm/1"  # marks a result of this harness as ours to replace

DEFAULT_VLLM_PYTHON = ".cache/vllm-venv/bin/python"
DEFAULT_REPEATS = 20
DEFAULT_MAX_TOKENS = 256
TOLERANCE = 0.05
_LAUNCH = ("import sys; from vllm.benchmarks import serve; "
           "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
           "p = P(); serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))")


def _vllm_bench(python: str, url: str, model: str, tokenizer: str, dataset: Path, num_prompts: int,
                max_tokens: int, concurrency: int, temperature: float, api_key: str | None,
                workdir: Path, tag: str) -> dict[str, Any]:
    args = ["--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "custom",
            "--dataset-path", str(dataset), "--num-prompts", str(num_prompts),
            "--skip-chat-template", "--disable-shuffle", "--custom-output-len", str(max_tokens),
            "--ignore-eos", "--max-concurrency", str(concurrency),
            "--temperature", str(temperature),
            "--extra-body", json.dumps({"chat_template_kwargs": {"enable_thinking": False}}),
            "--disable-tqdm", "--save-result", "--result-dir", str(workdir), "--result-filename",
            f"{tag}.json"]
    env = dict(os.environ, **({"OPENAI_API_KEY": api_key} if api_key else {}))
    proc = subprocess.run([python, "-c", _LAUNCH, *args], capture_output=True, text=True, env=env,
                          timeout=1800, check=False)
    if proc.returncode != 0:
        raise UserError(f"vllm bench serve failed (exit {proc.returncode}): "
                        f"{_last_line(proc.stderr)}")
    return dict(read_json(workdir / f"{tag}.json", "vllm bench serve wrote no result",
                          "run it again"))


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def _check_vllm_python(python: str) -> None:
    """The reference tool must import, with the pandas its custom dataset reads JSONL with, before
    any run."""
    if not Path(python).is_file():
        raise UserError(f"--vllm-python {python}: not found; run scripts/bootstrap (it makes "
                        f"{DEFAULT_VLLM_PYTHON}) or point it at a python with vLLM installed")
    probe = subprocess.run([python, "-c", "import pandas, "
                                          "vllm.benchmarks.serve"], capture_output=True, text=True,
                           timeout=600, check=False)
    if probe.returncode != 0:
        raise UserError(f"--vllm-python {python}: cannot run vllm bench serve "
                        f"({_last_line(probe.stderr)}); run scripts/bootstrap, or pip install "
                        "pandas there (vLLM's [bench] extra)")


def _spread(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values)
    stdev = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": mean, "median": statistics.median(values), "min": min(values),
            "max": max(values), "stdev": stdev, "sem": stdev / math.sqrt(len(values)),
            "relative_range": (max(values) - min(values)) / mean if mean else 0.0}


def _measured(tool_run: Callable[[], dict[str, Any]], client: httpx.Client, url: str,
              api_key: str | None) -> dict[str, Any]:
    """One tool's run plus what the server itself saw over it (its counters before and after)."""
    before = metrics.scrape(client, url, api_key)
    result = tool_run()
    after = metrics.settled(client, url, before, result["total_output_tokens"], api_key)
    seen = metrics.delta(before, after)
    return {"output_throughput": result["output_throughput"], "duration": result["duration"],
            "total_output_tokens": result["total_output_tokens"],
            "spec_decode_acceptance_rate": result.get("spec_decode_acceptance_rate"),
            "server_generation_tokens": int(seen.generation_tokens),
            "server_request_seconds": seen.request_seconds,
            "client_overhead_s": result["duration"] - seen.request_seconds}


def summarize(ours: list[dict[str, Any]], ref: list[dict[str, Any]],
              concurrency: int) -> dict[str, Any]:
    """Spread per tool, the ratio ours / vllm three ways, and whether it is within ``TOLERANCE``.

    The server's own speed drifts between runs on a shared machine, so beside the ratio of the means
    this gives the paired ratios (each repeat's two runs are neighbours in time, in alternating
    order) and, at concurrency 1, the drift-free ratio: each run's busy share (the server's summed
    request latency over the tool's duration), which is the throughput the tool reports divided by
    the speed the server had meanwhile.
    """
    a = [r["output_throughput"] for r in ours]
    b = [r["output_throughput"] for r in ref]
    paired = [x / y for x, y in zip(a, b, strict=False)]
    ratio = statistics.fmean(a) / statistics.fmean(b)
    out: dict[str, Any] = {
        "ours": _spread(a), "vllm": _spread(b), "ratio_of_means": ratio,
        "paired_ratios": paired, "paired_ratio": _spread(paired),
        "tolerance": TOLERANCE, "within_tolerance": abs(ratio - 1.0) <= TOLERANCE,
        "same_token_counts": [r["total_output_tokens"] for r in ours] == [r["total_output_tokens"]
                                                                          for r in ref],
        "ours_client_overhead_s": _spread([r["client_overhead_s"] for r in ours]),
        "vllm_client_overhead_s": _spread([r["client_overhead_s"] for r in ref]),
        "drift_free_ratio": None,
    }
    if concurrency == 1 and all(r["server_request_seconds"] > 0 for r in ours + ref):
        share = [r["server_request_seconds"] / r["duration"] for r in ours]
        share_ref = [r["server_request_seconds"] / r["duration"] for r in ref]
        out["drift_free_ratio"] = statistics.fmean(share) / statistics.fmean(share_ref)
    return out


def run(url: str, model: str, repeats: int = DEFAULT_REPEATS,
        vllm_python: str = DEFAULT_VLLM_PYTHON, suite: str = "all",
        max_tokens: int = DEFAULT_MAX_TOKENS, concurrency: int = 1, temperature: float = 0.0,
        api_key: str | None = None) -> dict[str, Any]:
    if repeats < 2:
        raise UserError(f"--repeats {repeats}: need at least 2 for a spread; use 8 or more")
    _check_vllm_python(vllm_python)
    # vllm bench serve's custom data set is single prompts: an agent suite's turns are left out
    prompts = [p for _, ps in suites_for(suite) for p in ps if not p.messages]
    if not prompts:
        raise UserError(f"--suite {suite}: no single prompts (vllm bench serve has no "
                        "conversations); use structured, open or all")
    ours_runs: list[dict[str, Any]] = []
    vllm_runs: list[dict[str, Any]] = []
    with sync_client() as client, tempfile.TemporaryDirectory(prefix="sparkspec-vs-vllm-") as tmp:
        served = preflight(client, url, model, api_key)
        tokenizer = str(served.get("root") or model)
        work = Path(tmp)
        dataset = work / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": p.prompt}) + "\n" for p in prompts))
        cfg = BenchConfig(url=url, model=model, suite=str(dataset), concurrency=concurrency,
                          max_tokens=max_tokens, temperature=temperature, api_key=api_key,
                          ignore_eos=True)
        tools: dict[str, tuple[list[dict[str, Any]], Callable[[int], dict[str, Any]]]] = {
            "vllm": (vllm_runs,
                     lambda i: _vllm_bench(vllm_python, url, model, tokenizer, dataset,
                                           len(prompts), max_tokens, concurrency, temperature,
                                           api_key, work, f"r{i}")),
            "ours": (ours_runs, lambda i: run_bench(cfg)),
        }
        for i in range(repeats):
            for name in (("vllm", "ours") if i % 2 == 0 else ("ours", "vllm")):
                runs, tool = tools[name]
                runs.append(_measured(functools.partial(tool, i), client, url, api_key))
    return {"format": FORMAT, "url": url, "model": model, "prompts": len(prompts),
            "max_tokens": max_tokens, "concurrency": concurrency, "temperature": temperature,
            "repeats": repeats, "ours_runs": ours_runs,
            "vllm_runs": vllm_runs} | summarize(ours_runs, vllm_runs, concurrency)


def print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sparkspec bench vs vllm bench serve: {r['prompts']} prompts x "
                        f"{r['max_tokens']} tokens, concurrency {r['concurrency']}, "
                        f"T={r['temperature']}, {r['repeats']} interleaved repeats")
    for col in ("output tok/s", "mean", "median", "stdev", "min", "max", "client overhead s"):
        table.add_column(col, justify="right")
    for name in ("ours", "vllm"):
        s, o = r[name], r[f"{name}_client_overhead_s"]
        table.add_row("sparkspec" if name == "ours" else "vllm bench serve", f"{s['mean']:.1f}",
                      f"{s['median']:.1f}", f"{s['stdev']:.1f} ({s['stdev'] / s['mean']:.1%})",
                      f"{s['min']:.1f}", f"{s['max']:.1f}", f"{o['mean']:.3f}")
    p = r["paired_ratio"]
    drift = r["drift_free_ratio"]
    table.caption = (f"ratio of means {r['ratio_of_means']:.3f} "
                     f"({'within' if r['within_tolerance'] else 'NOT within'} "
                     f"{r['tolerance']:.0%}); paired ratios mean {p['mean']:.3f} +- "
                     f"{p['sem']:.3f} (s.e.), median {p['median']:.3f}; drift-free ratio "
                     f"{'n/a' if drift is None else f'{drift:.3f}'}; same token counts: "
                     f"{r['same_token_counts']}")
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="sparkspec bench-vs-vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, type=arg_type(lambda v, f: check_url(v), "--url"))
    parser.add_argument("--model", required=True, type=arg_type(check_label, "--model"))
    parser.add_argument("--repeats", type=number(int, 1, 1000), default=DEFAULT_REPEATS)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--suite", default="all")
    parser.add_argument("--max-tokens", type=number(int, 1, MAX_TOKENS), default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--concurrency", type=number(int, 1, MAX_CONCURRENCY), default=1)
    parser.add_argument("--temperature", type=temperature, default=0.0)
    parser.add_argument("--api-key-file", metavar="FILE", help="file holding the API key (default: "
                        "$SPARKSPEC_API_KEY)")
    parser.add_argument("--output", default="reports/bench-vs-vllm.json")
    a = parser.parse_args(argv)
    out = Output(a.output, "--output", json_format(FORMAT),
                 (("--suite", file_of(a.suite)), ("--api-key-file", a.api_key_file)))
    try:
        check_outputs([out])
        result = run(a.url, a.model, a.repeats, a.vllm_python, a.suite, a.max_tokens, a.concurrency,
                     a.temperature, api_key(a.api_key_file))
        write_outputs([(out, json_bytes(result))])
    except UserError as exc:
        print(f"sparkspec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print_table(result)
    print(f"-> {a.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
