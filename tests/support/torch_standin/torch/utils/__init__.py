"""torch.utils as far as a vLLM source build reads it."""

import os

# The folder CMake searches for TorchConfig.cmake (vLLM: append_cmake_prefix_path("torch", ...)).
cmake_prefix_path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "share", "cmake")
