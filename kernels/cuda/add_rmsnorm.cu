// CUDA skip-aware residual add + RMSNorm (twin: swiftk.runtime.ops.reference.fused_add_rmsnorm / rmsnorm;
// Triton version: kernels/triton/triton_norm.py).
//
// One block per row. The skip flag is a device byte read by the kernel, so a captured launch sequence serves every
// skip set: when set, the sublayer's delta is ignored and the residual passes through.
#include "swiftk_cuda.cuh"

namespace swiftk {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) add_rmsnorm_kernel(AddRmsNormParams p) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const T* res = static_cast<const T*>(p.residual) + row * p.s_res;
  const T* w = static_cast<const T*>(p.weight);
  T* normed = static_cast<T*>(p.normed) + row * p.s_normed;
  const bool has_delta = p.delta != nullptr;
  const bool skip = p.skip != nullptr && *p.skip != 0;
  const T* delta = has_delta ? static_cast<const T*>(p.delta) + row * p.s_delta : nullptr;
  T* new_res = has_delta ? static_cast<T*>(p.new_residual) + row * p.s_newres : nullptr;

  // pass 1: new residual (rounded to T, like the reference's add) and the sum of squares
  float ss = 0.f;
  for (int64_t d = threadIdx.x; d < p.D; d += kThreads) {
    T x = res[d];
    if (has_delta) {
      if (!skip) x = from_float<T>(to_float(x) + to_float(delta[d]));
      new_res[d] = x;
    }
    const float xf = to_float(x);
    ss += xf * xf;
  }
  const float rstd = rsqrtf(block_sum(ss, scratch) / static_cast<float>(p.D) + p.eps);
  // pass 2: each thread re-reads exactly the elements it wrote in pass 1, so no barrier is needed
  const T* src = has_delta ? new_res : res;
  for (int64_t d = threadIdx.x; d < p.D; d += kThreads) {
    const float y = to_float(from_float<T>(to_float(src[d]) * rstd));
    normed[d] = from_float<T>(to_float(w[d]) * y);
  }
}

}  // namespace

#ifndef __CUDACC_RTC__  // host launchers: the nvcc build only (NVRTC compiles the kernels alone)
cudaError_t launch_add_rmsnorm(int dtype, const AddRmsNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  SWIFTK_DISPATCH_DTYPE(dtype, add_rmsnorm_kernel<scalar_t><<<static_cast<unsigned>(p.rows), kThreads, 0,
                                                              stream>>>(p));
  return cudaGetLastError();
}

#endif  // __CUDACC_RTC__

}  // namespace swiftk
