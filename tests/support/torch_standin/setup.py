"""Stand-in torch: ``TORCH_STANDIN_CUDA`` (default ``13.0``; ``none`` for the CPU build) picks the
variant."""

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

TORCH_RELEASE = "2.13.0"
CUDA = os.environ.get("TORCH_STANDIN_CUDA", "13.0").strip()
if CUDA.lower() in ("", "none", "cpu"):
    CUDA_VERSION = None
    LOCAL = "cpu"
else:
    major, _, minor = CUDA.partition(".")
    if not (major.isdigit() and minor.isdigit()):
        raise SystemExit(f"TORCH_STANDIN_CUDA={CUDA!r}: use MAJOR.MINOR (e.g. 13.0) or none")
    CUDA_VERSION = CUDA
    LOCAL = f"cu{major}{minor}"
VERSION = f"{TORCH_RELEASE}+{LOCAL}"


class build_py_with_version(build_py):
    """Writes torch/version.py for the chosen variant (as torch's own build generates it)."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "torch" / "version.py"
        target.write_text(
            f"__version__ = {VERSION!r}\n"
            f"cuda = {CUDA_VERSION!r}\n"
            "hip = None\n"
            "xpu = None\n"
            f"git_version = 'standin-{LOCAL}'\n"
        )


setup(
    version=VERSION,
    packages=["torch", "torch.utils"],
    package_data={"torch": ["share/cmake/Torch/*.cmake"]},
    cmdclass={"build_py": build_py_with_version},
)
