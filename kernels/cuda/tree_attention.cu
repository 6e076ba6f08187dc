// CUDA tree attention (twin: swiftk.runtime.ops.reference.tree_attention; Triton version: kernels/triton/triton_attention.py).
//
// One block per (new token t, query head h). Keys are processed in tiles of kTile slots: each warp scores keys of
// the tile (lanes split head_dim, so K rows are read coalesced), then the block does an online-softmax update of
// its output row, threads splitting head_dim so V rows are read coalesced too. Committed slots < prefix_len are
// always visible; new token j (slot prefix_len + j) is visible iff bit j of the query's packed ancestor mask is set.
#include "swiftk_cuda.cuh"

namespace swiftk {
namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 32;
constexpr int kMaxHd = 256;
constexpr int kPerThread = kMaxHd / kThreads;
constexpr float kNeg = -1.0e30f;  // finite "minus infinity": masked keys get weight exactly 0, never NaN

template <typename T>
__global__ void __launch_bounds__(kThreads) tree_attention_kernel(TreeAttnParams p) {
  const int64_t t = blockIdx.x;
  const int64_t h = blockIdx.y;
  const int64_t kvh = h / (p.H / p.KV);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hd = static_cast<int>(p.hd);

  __shared__ float qs[kMaxHd];
  __shared__ float sc[kTile];

  const T* q = static_cast<const T*>(p.q) + t * p.sqt + h * p.sqh;
  const T* kb = static_cast<const T*>(p.k) + kvh * p.skh;
  const T* vb = static_cast<const T*>(p.v) + kvh * p.svh;
  const int32_t* bits = p.bits + t * p.sbt;
  for (int d = tid; d < hd; d += kThreads) qs[d] = to_float(q[d]) * p.scale;
  __syncthreads();

  float m = kNeg, l = 0.f;
  float acc[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) acc[i] = 0.f;

  const int64_t n_keys = p.prefix_len + p.T;
  for (int64_t start = 0; start < n_keys; start += kTile) {
    for (int kk = warp; kk < kTile; kk += kWarps) {
      const int64_t s = start + kk;
      bool vis = s < n_keys;
      if (vis && s >= p.prefix_len) {
        const int64_t j = s - p.prefix_len;
        vis = (bits[j >> 5] >> (j & 31)) & 1;
      }
      float score = kNeg;
      if (vis) {  // uniform within the warp
        const T* krow = kb + s * p.sks;
        float part = 0.f;
        for (int d = lane; d < hd; d += 32) part += qs[d] * to_float(krow[d]);
        score = warp_sum(part);
      }
      if (lane == 0) sc[kk] = score;
    }
    __syncthreads();
    float tmax = kNeg;
    for (int kk = 0; kk < kTile; ++kk) tmax = fmaxf(tmax, sc[kk]);
    const float m_new = fmaxf(m, tmax);
    const float alpha = __expf(m - m_new);
    l *= alpha;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) acc[i] *= alpha;
    for (int kk = 0; kk < kTile; ++kk) {
      const float s_k = sc[kk];
      if (s_k <= 0.5f * kNeg) continue;  // masked or past the end
      const float pk = __expf(s_k - m_new);
      l += pk;
      const T* vrow = vb + (start + kk) * p.svs;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) {
        const int d = tid + i * kThreads;
        if (d < hd) acc[i] += pk * to_float(vrow[d]);
      }
    }
    m = m_new;
    __syncthreads();  // sc is rewritten by the next tile
  }

  T* out = static_cast<T*>(p.out) + t * p.sot + h * p.soh;
  const float inv_l = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int d = tid + i * kThreads;
    if (d < hd) out[d] = from_float<T>(acc[i] * inv_l);
  }
}

}  // namespace

#ifndef __CUDACC_RTC__  // host launchers: the nvcc build only (NVRTC compiles the kernels alone)
cudaError_t launch_tree_attention(int dtype, const TreeAttnParams& p, cudaStream_t stream) {
  if (p.T == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(p.T), static_cast<unsigned>(p.H));
  SWIFTK_DISPATCH_DTYPE(dtype, tree_attention_kernel<scalar_t><<<grid, kThreads, 0, stream>>>(p));
  return cudaGetLastError();
}

#endif  // __CUDACC_RTC__

}  // namespace swiftk
