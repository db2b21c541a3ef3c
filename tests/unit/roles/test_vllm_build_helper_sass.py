"""The role's SASS check (``vllm_build_helper.py sass``) with the role's default core extensions,
FA2 included.

A stand-in site-packages laid out as a real vLLM 0.32.0 CUDA build lays out its extensions, each a
shared object compiled by nvcc (PATH) from one tiny kernel, read with cuobjdump
(tests.support.torch_standin.buildenv's venv), the core list read from
roles/vllm_build/defaults/main.yml: all sm_121a passes; an FA2 built for sm_80 + PTX (what an
unedited flash-attention gives, see test_vllm_build_helper_fa_archs.py) is reported without the
arch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.torch_standin import buildenv

ROOT = Path(__file__).resolve().parents[3]
HELPER = ROOT / "roles" / "vllm_build" / "files" / "vllm_build_helper.py"
CORE = yaml.safe_load((ROOT / "roles" / "vllm_build" / "defaults" / "main.yml").read_text())[
    "vllm_build_core_extensions"]
# Where a real build puts each core extension, relative to site-packages/vllm.
FILES = {"_C_stable_libtorch": "_C_stable_libtorch.abi3.so",
         "_moe_C_stable_libtorch": "_moe_C_stable_libtorch.abi3.so",
         "vllm_flash_attn._vllm_fa2_C": "vllm_flash_attn/_vllm_fa2_C.abi3.so"}
FA2 = FILES["vllm_flash_attn._vllm_fa2_C"]
HOST_ONLY = "cumem_allocator.abi3.so"   # an extension without device code (vLLM builds a few)
KERNEL = '__global__ void scale(float *x) { x[threadIdx.x] *= 2.0f; }\n' \
         'extern "C" void launch(float *x) { scale<<<1, 32>>>(x); }\n'
GENCODE = {"sm_121a": ["-gencode", "arch=compute_121a,code=sm_121a"],
           "sm_80+PTX": ["-gencode", "arch=compute_80,code=sm_80", "-gencode",
                         "arch=compute_80,code=compute_80"]}


@pytest.fixture(scope="session")
def objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One shared object per GENCODE variant and a host-only one, compiled once per test session."""
    if shutil.which("nvcc") is None:
        pytest.fail("nvcc is not on PATH: the stand-in extensions need CUDA >= 13.0's nvcc")
    out = tmp_path_factory.mktemp("sass-objects")
    (out / "k.cu").write_text(KERNEL)
    built = {}
    for name, flags in GENCODE.items():
        built[name] = out / f"{name.replace('+', '_')}.so"
        subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", *flags, "-o", str(built[name]),
                        str(out / "k.cu")],
                       check=True, capture_output=True)
    (out / "host.c").write_text("int host_only(void) { return 1; }\n")
    built["host"] = out / "host.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built["host"]), str(out / "host.c")],
                   check=True)
    return built


@pytest.fixture(scope="session")
def cuobjdump() -> Path:
    return buildenv.cuobjdump(buildenv.build_venv())


def site(tmp: Path, objects: dict[str, Path], variant: dict[str, str | None]) -> Path:
    """site-packages with vllm/ holding the core extensions (``variant``: module -> object kind,
    None leaves it out) and a host-only extension."""
    root = tmp / "site-packages"
    for module, kind in variant.items():
        if kind is not None:
            dest = root / "vllm" / FILES[module]
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(objects[kind], dest)
    shutil.copy(objects["host"], root / "vllm" / HOST_ONLY)
    return root


def sass(root: Path, cuobjdump: Path) -> dict:
    result = subprocess.run([sys.executable, str(HELPER), "sass", str(root), str(cuobjdump),
                             "sm_121a", json.dumps(CORE)], capture_output=True, text=True,
                            check=True)
    return json.loads(result.stdout)


def test_the_default_core_extensions_include_fa2() -> None:
    assert CORE == list(FILES)


def test_every_core_extension_built_for_sm_121a_passes(tmp_path: Path, objects: dict[str, Path],
                                                       cuobjdump: Path) -> None:
    report = sass(site(tmp_path, objects, {m: "sm_121a" for m in CORE}), cuobjdump)
    assert report == {"extensions": {**{FILES[m]: {"sass": ["sm_121a"]} for m in CORE},
                                     HOST_ONLY: {"sass": []}},
                      "missing_core": [], "without_arch": []}


def test_an_fa2_built_for_sm_80_and_ptx_is_reported_without_the_arch(tmp_path: Path,
                                                                     objects: dict[str, Path],
                                                                     cuobjdump: Path) -> None:
    variant: dict[str, str | None] = {m: "sm_121a" for m in CORE}
    variant["vllm_flash_attn._vllm_fa2_C"] = "sm_80+PTX"
    report = sass(site(tmp_path, objects, variant), cuobjdump)
    assert report["extensions"][FA2] == {"sass": ["sm_80"]}   # cuobjdump --list-elf lists no PTX
    assert report["missing_core"] == [] and report["without_arch"] == [FA2]


def test_a_build_without_fa2_is_reported_missing(tmp_path: Path, objects: dict[str, Path],
                                                 cuobjdump: Path) -> None:
    variant: dict[str, str | None] = {m: "sm_121a" for m in CORE}
    variant["vllm_flash_attn._vllm_fa2_C"] = None
    report = sass(site(tmp_path, objects, variant), cuobjdump)
    assert report["missing_core"] == ["vllm_flash_attn._vllm_fa2_C"] and \
        report["without_arch"] == []
