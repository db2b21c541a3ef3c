"""vLLM stand-in (sparkspec tests): a package named vllm whose _C extension holds one CUDA
kernel."""

import ctypes
from pathlib import Path

__version__ = "0.32.0+standin"


def standin_archs() -> str:
    """The CUDA archs _C was compiled for (what the build's CMake selected), read from the
    extension."""
    (so,) = Path(__file__).parent.glob("_C*.so")
    lib = ctypes.CDLL(str(so))
    lib.vllm_standin_archs.restype = ctypes.c_char_p
    return lib.vllm_standin_archs().decode()
