#!/usr/bin/env bash
# Compile and link the CUDA kernels (kernels/cuda/*.cu) and host code (csrc/) for sm_80 and sm_90 with nvcc via CMake,
# so a broken CUDA source fails CI. No GPU needed; nothing is run.
# Env: PYTHON (default: the python3 on PATH, i.e. the active venv), BUILD_DIR (default build/cuda-ci),
#      CUDA_ARCHS (default "80;90"), JOBS (default nproc).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3)}"
BUILD_DIR="${BUILD_DIR:-build/cuda-ci}"
CUDA_ARCHS="${CUDA_ARCHS:-80;90}"
JOBS="${JOBS:-$(nproc)}"
command -v nvcc >/dev/null || { echo "build_cuda.sh: nvcc not found on PATH" >&2; exit 1; }
PYBIND11_DIR="$("$PYTHON" -m pybind11 --cmakedir)"
start=$(date +%s)
cmake -S . -B "$BUILD_DIR" \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_CUDA_COMPILER="$(command -v nvcc)" \
  -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCHS" \
  -DPython_EXECUTABLE="$PYTHON" \
  -Dpybind11_DIR="$PYBIND11_DIR"
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "build_cuda.sh: built $(ls "$BUILD_DIR"/_C*.so "$BUILD_DIR"/libswiftk.so 2>/dev/null | tr '\n' ' ')in $(( $(date +%s) - start ))s"

# Triton kernels: compile to sm_80/sm_90 cubins without a GPU (the CPU interpreter tests cannot catch compile
# errors). SWIFTK_TRITON_AOT=0 skips this step.
if [ "${SWIFTK_TRITON_AOT:-1}" != "0" ]; then
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 "$PYTHON" -m kernels.triton.aot_check
fi
echo "build_cuda.sh: done in $(( $(date +%s) - start ))s"
