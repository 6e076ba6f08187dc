// CUDA KV commit (twin: swiftk.runtime.ops.reference.kv_commit; Triton version: kernels/triton/triton_kv_commit.py).
//
// One block per (layer, k|v, kv head) plane, all layers in one launch. For a chunk of head_dim columns the block
// loads the n source rows into shared memory, synchronises, then writes the n destination rows. Each plane
// belongs to one block and every element (slot, d) is read before any write of the same column chunk, so
// overlapping src/dst slot lists are safe.
#include "swiftk_cuda.cuh"

namespace swiftk {
namespace {

constexpr int kThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kThreads) kv_commit_kernel(KvCommitParams p, int64_t chunk) {
  extern __shared__ unsigned char smem_raw[];
  T* buf = reinterpret_cast<T*>(smem_raw);
  const int64_t plane = blockIdx.x;
  const int64_t h = plane % p.KV;
  const int64_t c = (plane / p.KV) % 2;
  const int64_t layer = plane / (2 * p.KV);
  T* base = static_cast<T*>(p.cache) + layer * p.s_l + c * p.s_c + h * p.s_h;
  for (int64_t d0 = 0; d0 < p.hd; d0 += chunk) {
    const int64_t width = (p.hd - d0) < chunk ? (p.hd - d0) : chunk;
    const int64_t total = p.n * width;
    for (int64_t e = threadIdx.x; e < total; e += kThreads) {
      const int64_t i = e / width, d = e % width;
      buf[e] = base[p.src[i] * p.s_s + d0 + d];
    }
    __syncthreads();
    for (int64_t e = threadIdx.x; e < total; e += kThreads) {
      const int64_t i = e / width, d = e % width;
      base[p.dst[i] * p.s_s + d0 + d] = buf[e];
    }
    __syncthreads();  // buf is refilled by the next chunk
  }
}

#ifndef __CUDACC_RTC__
template <typename T>
cudaError_t launch(const KvCommitParams& p, cudaStream_t stream) {
  const int64_t row_bytes = p.n * static_cast<int64_t>(sizeof(T));
  int64_t chunk = kKvCommitSmemBytes / row_bytes;  // columns per pass that fit the shared buffer
  if (chunk < 1) return cudaErrorInvalidValue;      // caller checks n against the budget first
  if (chunk > p.hd) chunk = p.hd;
  const size_t smem = static_cast<size_t>(chunk * row_bytes);
  const unsigned blocks = static_cast<unsigned>(p.L * 2 * p.KV);
  kv_commit_kernel<T><<<blocks, kThreads, smem, stream>>>(p, chunk);
  return cudaGetLastError();
}

#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__  // host launchers: the nvcc build only (NVRTC compiles the kernels alone)
cudaError_t launch_kv_commit(int dtype, const KvCommitParams& p, cudaStream_t stream) {
  if (p.n == 0 || p.L == 0 || p.KV == 0) return cudaSuccess;
  SWIFTK_DISPATCH_DTYPE(dtype, return launch<scalar_t>(p, stream));
  return cudaSuccess;
}

#endif  // __CUDACC_RTC__

}  // namespace swiftk
