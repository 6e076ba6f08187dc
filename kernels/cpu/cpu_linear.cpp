// Skinny CPU matmul for decoding: y[M, N] = x[M, K] @ W[N, K]^T (* scale[N]) for the few rows of a decode step, a
// draft step or a verify pass; W in float32, bfloat16 or int8 with a per-row scale; x and y float32.
// Torch twin: swiftk/runtime/ops/reference.py `linear` (tests/test_cpu_linear.py holds them equal).
//
// Why our own: at a few rows the cost is reading W once, but MKL's sgemm at M = 4..16 runs at a fraction of the
// bandwidth it reaches at M = 1 (an 8-token verify pass cost ~2 decode steps). Here each block of NR weight rows
// is loaded once per MR activation rows held in registers (the next MR rows find it in L1), and the weight stream
// is prefetched ahead so that its DRAM reads overlap the FMAs: M = 1..8 cost little more than M = 1.
//
// Batch invariance: y[m, n] is summed the same way (vector-lane partial sums over k, then a fixed lane reduction)
// whatever M, the blocking or the thread count, so a token's logits in a verify pass equal its logits in a
// one-token step bit for bit.
//
// AVX-512 (F/BW/VL), AVX2+FMA or portable C++ (cpu_simd.h), chosen by -march at build time; threads: the library's
// pool (cpu_pool.h).
#include <stdint.h>

#include "cpu_pool.h"
#include "cpu_simd.h"

// Weights as float vectors: float32 (0), bfloat16 (1), int8 (2); ld_w_tail for the last n < SWK_W of a row.
template <int WT> static inline vec ld_w(const void* p) {
  return WT == 0 ? vld((const float*)p) : WT == 1 ? vld_bf16(p) : vld_i8(p);
}
template <int WT> static inline vec ld_w_tail(const void* p, int n) {
  return WT == 0 ? vld_tail((const float*)p, n) : WT == 1 ? vld_bf16_tail(p, n) : vld_i8_tail(p, n);
}

namespace {

constexpr int NR = 4;  // weight rows per block
// Activation rows per register tile: a tile holds NR * MR accumulators, MR activation vectors and one weight
// vector. AVX-512 has 32 registers; AVX2 has 16, where a 4 x 4 tile spills (measured: bench/results/history.md).
constexpr int MR = SWK_W == 16 ? 4 : 3;
// At 1-2 rows a 4-row block has too few independent FMA chains to hide the FMA latency (int8 weights, whose
// conversion adds work per byte, ran at half the bandwidth): use 8-row blocks there. Each y[m, n] is still one
// accumulator summed in the same k order, so batch invariance holds.
constexpr int NR_SMALL_M = 8;
// Software prefetch of the weight stream this many bytes ahead of the loads, into L2 (T1). Without it the hardware
// prefetcher ran too short a distance to overlap DRAM reads with the FMAs of 4..16 activation rows: memory time
// and compute time added up (fp32 SmolLM2-135M, 2 threads: a verify pass of 8 tokens cost 1.6 decode steps).
// Prefetching into L1 (T0) 8 KiB ahead brought it to 1.45; into L2, whose miss queue holds more lines in flight
// than L1's fill buffers, 1.31 (Qwen2.5-Coder-0.5B: 1.56 -> 1.34); 8-32 KiB ahead measured alike, 4 KiB worse.
// One row unchanged. Prefetching past the end of W is harmless (a prefetch never faults).
// With more activation rows than one register tile holds (M > MR), each weight block is run by several tiles in
// turn, the later ones reading it from L1/L2. Were every tile to issue the block's prefetches, all DRAM requests
// would go out during the first tile and the memory would idle during the others; so tile j of mt prefetches only
// weight rows r with r % mt == j, which spreads the next block's requests over the whole block's time. Qwen2.5-Coder-
// 0.5B's 24 layers streamed from DRAM, time relative to one row: 6 rows 1.29 -> 1.22, 8 rows 1.29 -> 1.26; its LM
// head at 8 rows 1.19 -> 1.14 (small: at 8 rows the FMAs, ~60% of the memory time, are most of what remains).
constexpr int64_t PREFETCH_BYTES = 16384;

template <int WT> constexpr int64_t esize() { return WT == 0 ? 4 : WT == 1 ? 2 : 1; }

#if SWK_W == 16
// The 4 x 4 tile's sums: acc[r][m] -> y[m0 + m, n0 + r] (int8: times scale[n0 + r], as in tile).
template <int WT>
inline void store_4x4(const vec (&acc)[4][4], const float* scale, float* y, int64_t N, int64_t n0, int64_t m0) {
  // in[4r + m] = acc[r][m], and lane 4b + t sums in[b + 4t]: lane 4m + r holds acc[r][m]
  vec out = hsum16(reinterpret_cast<const vec (&)[16]>(acc));
  if (WT == 2) out = vmul(out, vbcast4(scale + n0));
  vst_quarters(y + m0 * N + n0, N, out);
}
#endif

// Rows [n0, n0+R) of W against activation rows [m0, m0+M_): R*M_ accumulators in registers.
// Prefetches for weight rows r with r % pf_period == pf_phase only (see PREFETCH_BYTES).
template <int WT, int R, int M_>
inline void tile(const float* x, int64_t K, const char* w, const float* scale, float* y, int64_t N, int64_t n0,
                 int64_t m0, int pf_phase = 0, int pf_period = 1) {
  vec acc[R][M_];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 4
    for (int m = 0; m < M_; m++) acc[r][m] = vzero();
  bool pf[R];
  for (int r = 0; r < R; r++) pf[r] = r % pf_period == pf_phase;
  const char* wr = w + n0 * K * esize<WT>();
  const float* xr = x + m0 * K;
  const int64_t Kv = K - K % SWK_W;
  for (int64_t k = 0; k < Kv; k += SWK_W) {
    vec xv[M_];
#pragma GCC unroll 4
    for (int m = 0; m < M_; m++) xv[m] = vld(xr + m * K + k);
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      if (pf[r]) __builtin_prefetch(wr + (r * K + k) * esize<WT>() + PREFETCH_BYTES, 0, 2);   // into L2 (T1)
      vec wv = ld_w<WT>(wr + (r * K + k) * esize<WT>());
#pragma GCC unroll 4
      for (int m = 0; m < M_; m++) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
  if (Kv < K) {
    const int n = (int)(K - Kv);
    vec xv[M_];
    for (int m = 0; m < M_; m++) xv[m] = vld_tail(xr + m * K + Kv, n);
    for (int r = 0; r < R; r++) {
      vec wv = ld_w_tail<WT>(wr + (r * K + Kv) * esize<WT>(), n);
      for (int m = 0; m < M_; m++) acc[r][m] = vfma(wv, xv[m], acc[r][m]);
    }
  }
#if SWK_W == 16
  if constexpr (R == 4 && M_ == 4) {
    store_4x4<WT>(acc, scale, y, N, n0, m0);
    return;
  }
#endif
  for (int r = 0; r < R; r++) {
    const float s = WT == 2 ? scale[n0 + r] : 1.0f;
    for (int m = 0; m < M_; m++) y[(m0 + m) * N + n0 + r] = WT == 2 ? vsum(acc[r][m]) * s : vsum(acc[r][m]);
  }
}

// The last M % MR activation rows: one tile of that many.
template <int WT, int R, int C>
inline void tail(int left, const float* x, int64_t K, const char* w, const float* scale, float* y, int64_t N,
                 int64_t n0, int64_t m0, int j, int mt) {
  if constexpr (C > 0) {
    if (left == C) tile<WT, R, C>(x, K, w, scale, y, N, n0, m0, j, mt);
    else tail<WT, R, C - 1>(left, x, K, w, scale, y, N, n0, m0, j, mt);
  }
}

template <int WT, int R>
inline void rows(const float* x, int64_t M, int64_t K, const char* w, const float* scale, float* y, int64_t N,
                 int64_t n0) {
  const int mt = (int)((M + MR - 1) / MR);  // tiles that run this block, in turn
  int64_t m0 = 0;
  int j = 0;
  for (; m0 + MR <= M; m0 += MR, j++) tile<WT, R, MR>(x, K, w, scale, y, N, n0, m0, j, mt);
  tail<WT, R, MR - 1>((int)(M - m0), x, K, w, scale, y, N, n0, m0, j, mt);
}

template <int WT, int R>
void blocks(const float* x, int64_t M, int64_t K, const char* w, const float* scale, float* y, int64_t N,
            int nthreads) {
  const int64_t nblocks = N / R;
  swk_pool::parallel_for(nblocks, nthreads, [&](int64_t b, int) {
    if (M == 1) tile<WT, R, 1>(x, K, w, scale, y, N, b * R, 0);
    else if (M == 2 && R == NR_SMALL_M) tile<WT, R, 2>(x, K, w, scale, y, N, b * R, 0);
    else rows<WT, R>(x, M, K, w, scale, y, N, b * R);
  });
  for (int64_t n0 = nblocks * R; n0 < N; n0++) rows<WT, 1>(x, M, K, w, scale, y, N, n0);
}

template <int WT>
void run(const float* x, int64_t M, int64_t K, const char* w, const float* scale, int64_t N, float* y, int nthreads) {
  if (N * K < 32768) nthreads = 1;  // not worth waking a second thread
  if (M <= 2) blocks<WT, NR_SMALL_M>(x, M, K, w, scale, y, N, nthreads);
  else blocks<WT, NR>(x, M, K, w, scale, y, N, nthreads);
}

}  // namespace

#if __has_include("swiftk_cpu.h")   // the public declarations: the compiler checks the definitions against them
#include "swiftk_cpu.h"
#endif

extern "C" {

// y[M, N] (float32, row-major) = x[M, K] (float32, row-major) @ W[N, K]^T, W row-major of type wt (0 float32,
// 1 bfloat16, 2 int8 times scale[N]); nthreads >= 1. Returns 0, or -1 on bad arguments (nothing written).
int swk_linear(const float* x, int64_t M, int64_t K, const void* w, int wt, const float* scale, int64_t N, float* y,
               int nthreads) {
  if (!x || !w || !y || M < 1 || K < 1 || N < 1 || nthreads < 1) return -1;
  if ((wt == 2) != (scale != nullptr)) return -1;
  const char* wc = (const char*)w;
  switch (wt) {
    case 0: run<0>(x, M, K, wc, scale, N, y, nthreads); return 0;
    case 1: run<1>(x, M, K, wc, scale, N, y, nthreads); return 0;
    case 2: run<2>(x, M, K, wc, scale, N, y, nthreads); return 0;
    default: return -1;
  }
}

// Vector width in floats this build was compiled for (16: AVX-512, 8: AVX2 or portable).
int swk_vector_width(void) { return SWK_W; }

}  // extern "C"
