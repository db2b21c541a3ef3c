"""The build environment of the vLLM stand-in tests: stand-in torch wheels and a cached build venv.

``python -m tests.support.torch_standin.buildenv OUTDIR`` writes both stand-in torch wheels (cu130,
cpu) into OUTDIR and prints their paths (the vllm_build scenario can install them in its container).

``build_venv()`` is a venv under .cache/ with what vLLM's requirements/build/cuda.txt installs
(cmake, ninja, setuptools, wheel), the stand-in torch 2.13.0+cu130 in place of the real one, and
cuobjdump from nvidia-cuda-cuobjdump (this machine's CUDA has none). It is rebuilt only when the
pins or the stand-in torch's sources change (a stamp file holds their digest). nvcc comes from PATH,
as on a Spark.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
VARIANTS = {"cu130": "13.0", "cpu": "none"}
# Exact pins: the venv is what the tests measured. cmake >= 3.26.1 is vLLM 0.32.0's floor.
BUILD_PINS = ("cmake==3.31.10", "ninja==1.13.2", "setuptools==80.9.0", "wheel==0.45.1",
              "nvidia-cuda-cuobjdump==13.5.37")


def torch_wheel(out: Path, variant: str) -> Path:
    """The stand-in torch wheel for ``variant`` (a key of VARIANTS), built into ``out`` from a
    copy."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "torch_standin"
        shutil.copytree(HERE, src,
                        ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        env = dict(os.environ, TORCH_STANDIN_CUDA=VARIANTS[variant])
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
             "--no-index", "--wheel-dir", tmp, str(src)],
            check=True, env=env,
        )
        (wheel,) = Path(tmp).glob(f"torch-*+{variant}-*.whl")
        target = out / wheel.name
        shutil.move(str(wheel), target)
    return target


def _sources_digest() -> str:
    digest = hashlib.sha256("\n".join(BUILD_PINS).encode())
    for path in sorted(HERE.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(HERE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def build_venv() -> Path:
    """The cached build venv (see the module docstring); returns its folder. Safe to call from
    parallel processes: one builds it under a lock, the others wait and reuse it."""
    venv = ROOT / ".cache" / "vllm-standin-build"
    stamp = venv / ".sparkspec-stamp"
    want = _sources_digest()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / "vllm-standin-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file() and stamp.read_text() == want:
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
               "--disable-pip-version-check"]
        subprocess.run([*pip, *BUILD_PINS], check=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([*pip, "--no-index", str(torch_wheel(Path(tmp), "cu130"))], check=True)
        stamp.write_text(want)
    return venv


def cuobjdump(venv: Path) -> Path:
    """The cuobjdump that nvidia-cuda-cuobjdump installed into ``venv``."""
    (found,) = venv.glob("lib/python3*/site-packages/nvidia/cu*/bin/cuobjdump")
    return found


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.support.torch_standin.buildenv OUTDIR")
    for name in VARIANTS:
        print(torch_wheel(Path(sys.argv[1]), name))
