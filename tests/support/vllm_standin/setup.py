"""vLLM stand-in's setup.py (sparkspec tests): vLLM 0.32.0's build interface, cut to one CMake
extension.

As vLLM's: torch is imported from the build environment (no build isolation) and decides the target
device (a CPU torch silently builds a CPU package without _C, vLLM's torch trap); MAX_JOBS (default:
the CPUs) and NVCC_THREADS (default 1) give ``num_jobs = max(1, MAX_JOBS // NVCC_THREADS)`` for
``cmake --build -j`` and the ninja job pool; NVCC_THREADS reaches nvcc as ``--threads``; CMAKE_ARGS
is split and appended to the configure command; the nvcc used is CUDA_HOME/bin/nvcc; ccache is the
compiler launcher when on PATH; TORCH_CUDA_ARCH_LIST reaches CMake through torch's CMake package.
The wheel records what reached the build in vllm/_standin_build.json.
"""

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from torch.utils.cpp_extension import CUDA_HOME

ROOT_DIR = Path(__file__).parent.resolve()
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
logger = logging.getLogger("vllm-standin setup.py")

if os.getenv("VLLM_TARGET_DEVICE") is not None:
    VLLM_TARGET_DEVICE = os.environ["VLLM_TARGET_DEVICE"]
elif torch.version.cuda is not None:
    VLLM_TARGET_DEVICE = "cuda"
    logger.info("Auto-detected CUDA")
else:
    VLLM_TARGET_DEVICE = "cpu"


def _is_cuda() -> bool:
    return VLLM_TARGET_DEVICE == "cuda" and torch.version.cuda is not None


def get_nvcc_cuda_version() -> tuple[int, int]:
    assert CUDA_HOME is not None, "CUDA_HOME is not set"
    out = subprocess.check_output([CUDA_HOME + "/bin/nvcc", "-V"], universal_newlines=True)
    match = re.search(r"release (\d+)\.(\d+)", out)
    if match is None:
        raise RuntimeError(f"{CUDA_HOME}/bin/nvcc -V reported no CUDA release")
    return int(match.group(1)), int(match.group(2))


class CMakeExtension(Extension):
    def __init__(self, name: str, cmake_lists_dir: str = ".") -> None:
        super().__init__(name, sources=[], py_limited_api=True)
        self.cmake_lists_dir = os.path.abspath(cmake_lists_dir)


class cmake_build_ext(build_ext):
    def compute_num_jobs(self) -> tuple[int, int | None]:
        max_jobs = os.getenv("MAX_JOBS")
        if max_jobs is not None:
            num_jobs = int(max_jobs)
            logger.info("Using MAX_JOBS=%d as the number of jobs.", num_jobs)
        else:
            num_jobs = len(os.sched_getaffinity(0))
        nvcc_threads = None
        if _is_cuda() and CUDA_HOME is not None and get_nvcc_cuda_version() >= (11, 2):
            nvcc_threads = int(os.getenv("NVCC_THREADS") or 1)
            if os.getenv("NVCC_THREADS") is not None:
                logger.info("Using NVCC_THREADS=%d as the number of nvcc threads.", nvcc_threads)
            num_jobs = max(1, num_jobs // nvcc_threads)
        return num_jobs, nvcc_threads

    def build_extensions(self) -> None:
        build_temp = Path(self.build_temp)
        build_temp.mkdir(parents=True, exist_ok=True)
        num_jobs, nvcc_threads = self.compute_num_jobs()
        cmake_args = [
            f"-DCMAKE_BUILD_TYPE={os.getenv('CMAKE_BUILD_TYPE') or 'RelWithDebInfo'}",
            f"-DVLLM_TARGET_DEVICE={VLLM_TARGET_DEVICE}",
        ]
        if shutil.which("ccache") is not None:
            cmake_args += ["-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"]
        cmake_args += [f"-DVLLM_PYTHON_EXECUTABLE={sys.executable}"]
        cmake_args += ["-DVLLM_PYTHON_PATH={}".format(":".join(sys.path))]
        fc_base_dir = os.environ.get("FETCHCONTENT_BASE_DIR", os.path.join(ROOT_DIR, ".deps"))
        cmake_args += [f"-DFETCHCONTENT_BASE_DIR={fc_base_dir}"]
        if nvcc_threads:
            cmake_args += [f"-DNVCC_THREADS={nvcc_threads}"]
        build_tool = []
        if shutil.which("ninja") is not None:
            build_tool = ["-G", "Ninja"]
            cmake_args += ["-DCMAKE_JOB_POOL_COMPILE:STRING=compile",
                           f"-DCMAKE_JOB_POOLS:STRING=compile={num_jobs}"]
        if CUDA_HOME is not None:
            cmake_args += [f"-DCMAKE_CUDA_COMPILER={CUDA_HOME}/bin/nvcc"]
        other_cmake_args = os.environ.get("CMAKE_ARGS")
        if other_cmake_args:
            cmake_args += other_cmake_args.split()
        for ext in self.extensions:
            subprocess.check_call(["cmake", ext.cmake_lists_dir, *build_tool, *cmake_args],
                                  cwd=build_temp)
        targets = [ext.name.removeprefix("vllm.") for ext in self.extensions]
        build_args = ["--build", ".", f"-j={num_jobs}", *[f"--target={name}" for name in targets]]
        subprocess.check_call(["cmake", *build_args], cwd=build_temp)
        for ext in self.extensions:
            target = Path(self.get_ext_fullpath(ext.name))
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(build_temp / f"{ext.name.removeprefix('vllm.')}.abi3.so", target)
        record = {
            "max_jobs": os.getenv("MAX_JOBS"),
            "nvcc_threads": nvcc_threads,
            "num_jobs": num_jobs,
            "torch_version": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "torch_cuda_arch_list": os.getenv("TORCH_CUDA_ARCH_LIST"),
            "cmake_args": cmake_args,
            "cmake": json.loads((build_temp / "standin_cmake.json").read_text()),
        }
        info = Path(self.get_ext_fullpath("vllm._C")).parent / "_standin_build.json"
        info.write_text(json.dumps(record, indent=1) + "\n")


def get_requirements() -> list[str]:
    """requirements/cuda.txt with its -r includes, as vLLM's setup.py reads it for
    install_requires."""

    def read(name: str) -> list[str]:
        out: list[str] = []
        for line in (ROOT_DIR / "requirements" / name).read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("-r "):
                out += read(line.split()[1])
            elif line and not line.startswith("--"):
                out.append(line)
        return out

    return read("cuda.txt") if _is_cuda() else read("common.txt")


setup(
    version="0.32.0+standin",
    packages=["vllm"],
    install_requires=get_requirements(),
    ext_modules=[CMakeExtension(name="vllm._C")] if _is_cuda() else [],
    cmdclass={"build_ext": cmake_build_ext},
)
