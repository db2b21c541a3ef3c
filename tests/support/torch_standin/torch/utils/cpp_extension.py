"""CUDA_HOME found the way torch.utils.cpp_extension finds it: CUDA_HOME/CUDA_PATH, then nvcc on
PATH, then /usr/local/cuda."""

import os
import shutil


def _find_cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home is None:
        nvcc = shutil.which("nvcc")
        if nvcc is not None:
            home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        elif os.path.exists("/usr/local/cuda"):
            home = "/usr/local/cuda"
    return home


CUDA_HOME = _find_cuda_home()
ROCM_HOME = None
