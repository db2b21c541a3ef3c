"""The deploy role's vLLM argument checker and its cache, with the real vLLM of the test venv."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.bench.conftest import REPO, VLLM_PYTHON, vllm_available

CHECKER = REPO / "roles" / "deploy" / "files" / "check_vllm_args.py"
ARGS = ["--model", "/models/m", "--port", "8000", "--max-model-len", "1024"]

pytestmark = pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available()))


def check(cache: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([VLLM_PYTHON, str(CHECKER), "--cache", str(cache), *argv],
                          capture_output=True, text=True, timeout=300, check=False)


def test_accepted_line_is_checked_then_found_in_the_cache(tmp_path):
    first = check(tmp_path, *ARGS)
    assert first.returncode == 0, first.stderr
    verb, key = first.stdout.split()
    assert verb == "checked" and len(key) == 64
    # the checker never writes the cache: its caller (root) does
    assert list(tmp_path.iterdir()) == []
    (tmp_path / key).touch()
    again = check(tmp_path, *ARGS)
    assert again.stdout.split() == ["cached", key]
    other = check(tmp_path, *ARGS, "--enforce-eager")
    assert other.stdout.split()[0] == "checked" and other.stdout.split()[1] != key


def test_refused_line_is_refused_even_with_a_cache(tmp_path):
    result = check(tmp_path, *ARGS, "--no-such-flag")
    assert result.returncode == 2
    assert "vLLM refused the command line" in result.stderr and "--no-such-flag" in result.stderr
    assert result.stdout == ""



def test_unknown_speculative_config_key_is_refused():
    """vLLM's parser takes any JSON object; the checker refuses a key its SpeculativeConfig lacks
    (vLLM itself would refuse it only at engine start) in one line naming the key, for
    --speculative-config and -sc; hyphens are read as vLLM reads them. One import of vLLM
    (--records) for the three lines."""
    bad = '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_maxx":4}'
    fine = ('{"method":"dflash","num-speculative-tokens":15,"attention_backend":"FLASHINFER",'
            '"model":"/models/head"}')
    records = [[*ARGS, "--speculative-config", bad], [*ARGS, "-sc", bad], [*ARGS, "-sc", fine]]
    result = subprocess.run([VLLM_PYTHON, str(CHECKER), "--records"], input=json.dumps(records),
                            capture_output=True, text=True, timeout=300, check=False)
    refused = ("vLLM refused the command line: --speculative-config key 'prompt_lookup_maxx' is "
               "not a field of this vLLM's SpeculativeConfig (its engine would refuse it at "
               "start); use prompt_lookup_max")
    assert result.stdout.splitlines() == [refused, refused, "ok"], result.stderr[-2000:]
    assert result.returncode == 2
