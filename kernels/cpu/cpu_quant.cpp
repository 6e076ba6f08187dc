// GGUF weights kept in their block format: y[M, N] = x[M, K] @ W[N, K]^T with W in ggml's row-major block layout
// (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), dequantized in registers 32 elements at a time and accumulated in
// float32 (float32 activations: the exact de-quantized model; kernels/cpu/cpu_qdot.cpp is the int8-activation path,
// built into the same library); plus the plain dequantization, equal bit for bit to gguf.quants.dequantize (the spec
// for the layouts). Python binding: swiftk/runtime/ops/cpu_quant.py; tests: tests/test_cpu_quant.py.
//
// Why: reading a 4-6 bit weight costs a fraction of a float32 one; the dequantization is a few vector ops per 16
// weights, done once per weight and shared by every activation row. Those ops, not the reads, then bound a decode
// step, so Q4_K (the bulk of Q4_K_M files) has an AVX-512 path with its scales factored out of the dot products.
//
// Batch invariance (as kernels/cpu/cpu_linear.cpp): each y[m, n] is one fixed sequence of vector ops in k order (per
// format and ISA), then one fixed lane reduction, whatever M, the tiling or the thread count.
//
// ISA: AVX-512 (F/BW/VL) or AVX2+FMA+F16C by the -march macros, else portable C++ (same code over an 8-float
// struct). The block decoders are written once over a few 16-byte primitives that exist in each ISA.
#include <stdint.h>
#include <string.h>

#include <new>
#include <type_traits>
#include <vector>

#include "cpu_gguf.h"
#include "cpu_pool.h"
#include "cpu_simd.h"

namespace {

using namespace swk_gguf;

constexpr int W = SWK_W;  // floats per vector (cpu_simd.h)
constexpr int NV = 32 / W;  // vectors per 32-element chunk

// 32 signed 8-bit quants (lo: elements 0-15, hi: 16-31) -> NV float vectors: a0 * q (- b0) for the first 16,
// a1 * q (- b1) for the next. A multiply, then a subtraction: gguf rounds twice too (no FMA), which keeps
// swk_q_dequant bit-exact and makes the matmul's weights exactly the dequantized ones.
template <bool MIN>
inline void to_vecs(b16 lo, b16 hi, float a0, float a1, float b0, float b1, vec (&out)[NV]) {
  vcvt_i8x32(lo, hi, out);
  for (int i = 0; i < NV; i++) {
    out[i] = vmul(out[i], vset1(i < NV / 2 ? a0 : a1));
    if (MIN) out[i] = vsub(out[i], vset1(i < NV / 2 ? b0 : b1));
  }
}

// ---- formats: kernels/cpu/cpu_gguf.h (ggml type ids, Fmt<T>::BS elements / TS bytes per block, h2f)

// Q4_K/Q5_K: 8 six-bit (scale, min) pairs packed in 12 bytes -> a[s] = d * scale, b[s] = dmin * min
inline void k_scales(const uint8_t* blk, float (&a)[8], float (&b)[8]) {
  const float d = h2f(blk), dmin = h2f(blk + 2);
  const uint8_t* s = blk + 4;
  // the bit fields four bytes per 32-bit op, then one 8-wide convert and multiply (runs once per 256 weights)
  uint32_t u0, u1, u2;
  memcpy(&u0, s, 4);
  memcpy(&u1, s + 4, 4);
  memcpy(&u2, s + 8, 4);
  const uint64_t sc = (u0 & 0x3F3F3F3Fu) | (uint64_t)((u2 & 0x0F0F0F0Fu) | ((u0 >> 2) & 0x30303030u)) << 32;
  const uint64_t mn = (u1 & 0x3F3F3F3Fu) | (uint64_t)(((u2 >> 4) & 0x0F0F0F0Fu) | ((u1 >> 2) & 0x30303030u)) << 32;
  scale_u8x8(sc, d, a);
  scale_u8x8(mn, dmin, b);
}

// Q6_K: d times its 16 int8 scales
inline void q6_scales(const uint8_t* blk, float (&a)[16]) { scale_i8x16(blk + 192, h2f(blk + 208), a); }

#if SWK_ISA == 512
// AVX-512: a 4-bit quant indexes a 16-float table (vpermps reads only the index's low 4 bits: no masking), a 5-bit
// one picks between two tables by its fifth bit (a write mask). The table holds a * i (- b) for every i, the very
// products gguf computes, built once per block or sub-block in place of converting and scaling every element.
template <int T> constexpr bool kLut = T == Q4_0 || T == Q4_1 || T == Q5_0 || T == Q4_K || T == Q5_K;

inline vec table(float a, vec i) { return vmul(vset1(a), i); }
inline vec table(float a, vec i, float b) { return vsub(table(a, i), vset1(b)); }

template <int T, class F>
inline void decode_lut(const uint8_t* blk, F&& f) {
  vec w[NV];
  if constexpr (T == Q4_0 || T == Q4_1) {
    const float d = h2f(blk);
    const vec t = T == Q4_0 ? table(d, viota(-8.f)) : table(d, viota(), -h2f(blk + 2));
    const vidx q = vidx_u8(blk + (T == Q4_0 ? 2 : 4));
    w[0] = vlookup(q, t);
    w[1] = vlookup(vidx_shr(q, 4), t);
    f(0, w);
  } else if constexpr (T == Q5_0) {
    const float d = h2f(blk);
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const vec lo = table(d, viota(-16.f)), hi = table(d, viota());
    const vidx q = vidx_u8(blk + 6);
    w[0] = vlookup2(q, lo, hi, qh & 0xFFFF);
    w[1] = vlookup2(vidx_shr(q, 4), lo, hi, qh >> 16);
    f(0, w);
  } else {  // Q4_K, Q5_K
    float a[8], b[8];
    k_scales(blk, a, b);
    const uint8_t* qs = blk + (T == Q4_K ? 16 : 48);
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {  // chunks 2p (low nibbles) and 2p + 1 (high) of the same 32 bytes
      const vidx q0 = vidx_u8(qs + 32 * p), q1 = vidx_u8(qs + 32 * p + 16);
      for (int h = 0; h < 2; h++) {
        const int c = 2 * p + h;
        const vidx i0 = h ? vidx_shr(q0, 4) : q0, i1 = h ? vidx_shr(q1, 4) : q1;
        const vec lo = table(a[c], viota(), b[c]);
        if constexpr (T == Q4_K) {
          w[0] = vlookup(i0, lo);
          w[1] = vlookup(i1, lo);
        } else {
          const vec hi = table(a[c], viota(16.f), b[c]);
          const uint32_t k = bits_at32(blk + 16, c);   // qh: bit c of byte l, element l of chunk c's fifth bit
          w[0] = vlookup2(i0, lo, hi, k & 0xFFFF);
          w[1] = vlookup2(i1, lo, hi, k >> 16);
        }
        f(c, w);
      }
    }
  }
}
#endif

// One block -> f(c, w) for each 32-element chunk c in order, w its NV float vectors.
template <int T, class F>
inline void decode(const uint8_t* blk, F&& f) {
#if SWK_ISA == 512
  if constexpr (kLut<T>) {
    decode_lut<T>(blk, f);
    return;
  }
#endif
  vec w[NV];
  if constexpr (T == Q4_0) {  // d, 16 bytes: element j low nibble of byte j, element 16 + j its high nibble; q - 8
    const float d = h2f(blk);
    const b16 q = ld16(blk + 2);
    to_vecs<false>(bsub(nib(q, 0), 8), bsub(nib(q, 1), 8), d, d, 0.f, 0.f, w);
    f(0, w);
  } else if constexpr (T == Q4_1) {  // d, m, nibbles as Q4_0: d * q + m
    const float d = h2f(blk), m = h2f(blk + 2);
    const b16 q = ld16(blk + 4);
    to_vecs<true>(nib(q, 0), nib(q, 1), d, d, -m, -m, w);  // x - (-m) is x + m exactly
    f(0, w);
  } else if constexpr (T == Q5_0) {  // d, 32 fifth bits (little-endian u32), nibbles as Q4_0; q - 16
    const float d = h2f(blk);
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    const b16 q = ld16(blk + 6);
    to_vecs<false>(bsub(bor(nib(q, 0), bit16(qh & 0xFFFF)), 16), bsub(bor(nib(q, 1), bit16(qh >> 16)), 16), d, d,
                   0.f, 0.f, w);
    f(0, w);
  } else if constexpr (T == Q8_0) {  // d, 32 int8
    const float d = h2f(blk);
    to_vecs<false>(ld16(blk + 2), ld16(blk + 18), d, d, 0.f, 0.f, w);
    f(0, w);
  } else if constexpr (T == Q4_K) {  // d, dmin, scales[12], qs[128]: chunk c = nibble c & 1 of bytes 32 * (c / 2)...
    float a[8], b[8];
    k_scales(blk, a, b);
    const uint8_t* qs = blk + 16;
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
      const uint8_t* p = qs + 32 * (c / 2);
      to_vecs<true>(nib(ld16(p), c & 1), nib(ld16(p + 16), c & 1), a[c], a[c], b[c], b[c], w);
      f(c, w);
    }
  } else if constexpr (T == Q5_K) {  // d, dmin, scales[12], qh[32] (bit c: chunk c's fifth bit), qs[128] as Q4_K
    float a[8], b[8];
    k_scales(blk, a, b);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + 48;
    const b16 h0 = ld16(qh), h1 = ld16(qh + 16);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
      const uint8_t* p = qs + 32 * (c / 2);
      to_vecs<true>(bor(nib(ld16(p), c & 1), bit_at(h0, c)), bor(nib(ld16(p + 16), c & 1), bit_at(h1, c)), a[c], a[c],
                    b[c], b[c], w);
      f(c, w);
    }
  } else if constexpr (T == Q6_K) {  // ql[128], qh[64], int8 scales[16] (one per 16 elements), d; q - 32
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    float a[16];
    q6_scales(blk, a);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {  // half h = c / 4, quarter u = c % 4 of it
      const int h = c / 4, u = c % 4;
      const uint8_t* pl = ql + 64 * h + 32 * (u & 1);
      const uint8_t* ph = qh + 32 * h;
#if SWI_SIMD  // the same byte ops 32 at a time
      const iv l = i_ld(pl), hb = i_ld(ph);
      const iv q = i8_sub(i_or(i_and((u >> 1) ? i16_shr(l, 4) : l, i8_set1(0x0F)),
                               i16_shl(i_and(i16_shr(hb, 2 * u), i8_set1(3)), 4)),
                          i8_set1(32));
      b16 lo, hi;
      i_halves(q, &lo, &hi);
#else
      const b16 lo = bsub(bor(nib(ld16(pl), u >> 1), two_at(ld16(ph), 2 * u)), 32);
      const b16 hi = bsub(bor(nib(ld16(pl + 16), u >> 1), two_at(ld16(ph + 16), 2 * u)), 32);
#endif
      to_vecs<false>(lo, hi, a[2 * c], a[2 * c + 1], 0.f, 0.f, w);
      f(c, w);
    }
  }
}

// ---- the matmul ------------------------------------------------------------------------------------------------
// M <= MR_REG: every weight chunk is decoded into registers and used at once by all M rows (acc[R][M] in registers).
// Larger M: a span of KS elements of R weight rows is decoded once into an L1 buffer, and register tiles of MT rows
// run over it, their accumulators parked in memory between spans: the decode is still done once per weight.
// AVX2 has 16 vector registers: tiles there hold 8 accumulators.
#if SWK_ISA == 512
constexpr int MR_REG = 4, MT = 4;
#else
constexpr int MR_REG = 2, MT = 2;
#endif
constexpr int MR_WIDE_MAX = 32;  // AVX-512: passes up to this many rows run on register tiles of <= 8 rows
constexpr int KS = 256;  // span: one K-quant superblock, or 8 blocks of 32
constexpr int MB = 64;   // activation rows per pass of the span path (bounds its accumulator buffer)

// Software prefetch of the weight stream into L2, whole row groups ahead (the group this thread runs next) and at
// least 8 KiB: without it the hardware prefetcher, facing R interleaved row streams, left DRAM latency exposed
// (as kernels/cpu/cpu_linear.cpp found for its weights). A prefetch past the end of W is harmless.
inline int64_t pf_distance(int64_t group_bytes) { return (8192 + group_bytes - 1) / group_bytes * group_bytes; }
template <int TS>
inline void prefetch_block(const uint8_t* p) {
  for (int o = 0; o < TS; o += 64) __builtin_prefetch(p + o, 0, 2);
}

template <int T, int R, int M_>
void tile_reg(const float* x, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t ldy, int64_t n0) {
  constexpr int BS = Fmt<T>::BS, TS = Fmt<T>::TS;
  vec acc[R][M_];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M_; m++) acc[r][m] = vzero();
  const uint8_t* wr = w + n0 * rb;
  const int64_t nb = K / BS, pf = pf_distance(R * rb);
  for (int64_t blk = 0; blk < nb; blk++) {
    const float* xb = x + blk * BS;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      prefetch_block<TS>(wr + r * rb + blk * TS + pf);
      decode<T>(wr + r * rb + blk * TS, [&](int c, const vec (&wv)[NV]) {
        const float* xc = xb + c * 32;
#pragma GCC unroll 4
        for (int m = 0; m < M_; m++)
#pragma GCC unroll 4
          for (int v = 0; v < NV; v++) acc[r][m] = vfma(wv[v], vld(xc + m * K + v * W), acc[r][m]);
      });
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M_; m++) y[m * ldy + n0 + r] = vsum(acc[r][m]);
}

// M_ activation rows (x points at row m0, column k0) over a decoded span wbuf[R][KS] of length ks.
template <int R, int M_>
inline void tile_span(const float* x, int64_t K, const float (&wbuf)[R][KS], int ks, float* accbuf, bool first) {
  vec acc[R][M_];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M_; m++) acc[r][m] = first ? vzero() : vld(accbuf + (m * R + r) * W);
  for (int k = 0; k < ks; k += W) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
      const vec wv = vld(&wbuf[r][k]);
#pragma GCC unroll 4
      for (int m = 0; m < M_; m++) acc[r][m] = vfma(wv, vld(x + m * K + k), acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M_; m++) vst(accbuf + (m * R + r) * W, acc[r][m]);
}

template <int T, int R>
void rows_span(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t ldy, int64_t n0) {
  constexpr int BS = Fmt<T>::BS, TS = Fmt<T>::TS;
  alignas(64) float wbuf[R][KS];
  alignas(64) float accbuf[MB * R * W];
  const uint8_t* wr = w + n0 * rb;
  const int64_t pf = pf_distance(R * rb);
  for (int64_t mb0 = 0; mb0 < M; mb0 += MB) {
    const int64_t mb = M - mb0 < MB ? M - mb0 : MB;
    for (int64_t k0 = 0; k0 < K; k0 += KS) {
      const int ks = (int)(K - k0 < KS ? K - k0 : KS);
      for (int r = 0; r < R; r++)
        for (int kb = 0; kb < ks; kb += BS) {
          const uint8_t* b = wr + r * rb + (k0 + kb) / BS * TS;
          if (mb0 == 0) prefetch_block<TS>(b + pf);
          decode<T>(b, [&](int c, const vec (&wv)[NV]) {
            for (int v = 0; v < NV; v++) vst(&wbuf[r][kb + c * 32 + v * W], wv[v]);
          });
        }
      const float* xs = x + mb0 * K + k0;
      int64_t m = 0;
      for (; m + MT <= mb; m += MT) tile_span<R, MT>(xs + m * K, K, wbuf, ks, accbuf + m * R * W, k0 == 0);
      switch (mb - m) {
        case 3: tile_span<R, 3>(xs + m * K, K, wbuf, ks, accbuf + m * R * W, k0 == 0); break;
        case 2: tile_span<R, 2>(xs + m * K, K, wbuf, ks, accbuf + m * R * W, k0 == 0); break;
        case 1: tile_span<R, 1>(xs + m * K, K, wbuf, ks, accbuf + m * R * W, k0 == 0); break;
        default: break;
      }
    }
    for (int64_t m = 0; m < mb; m++)
      for (int r = 0; r < R; r++) y[(mb0 + m) * ldy + n0 + r] = vsum(vld(accbuf + (m * R + r) * W));
  }
}

// Row groups of R weight rows, then the N % R rows left one by one, spread over the pool's threads.
template <int R, class G, class S>
void over_rows(int64_t N, int64_t K, G&& group, S&& single) {
  const int64_t ng = N / R, n = ng + N % R;
  swk_pool::parallel_for(n, N * K >= 65536 ? swk_pool::threads() : 1, [&](int64_t i, int) {
    if (i < ng) group(i * R);
    else single(ng * R + (i - ng));
  });
}

#if SWK_ISA == 512
// ---- Q4_K with its scales factored out (AVX-512) ------------------------------------------------------------------
// sum_i (a q_i - b) x_i = a sum_i q_i x_i - b sum_i x_i per 32-element chunk: the 4-bit quants become floats with one
// shift and one table permute, and a and b are applied once per chunk instead of once per weight (fewer vector ops
// per weight: the decode step is bound by them, bench/results/history.md). The quants are read as 32-bit lanes of 4 bytes, so x is permuted once per call into
// the order the lanes yield (xp) and each chunk's sum of x is precomputed (xs). Every path (any M, any tile) runs
// the same per-(row, activation) sequence below, which keeps the batch invariance.
//
// Lanes: v0 holds bytes [0,16) [32,48) [64,80) [96,112) of qs, v1 bytes [16,32) [48,64) [80,96) [112,128). Lane j's
// byte s (step v = s, or 4 + s for v1) nibble h is element 32 (2 (j / 4) + h) + 16 (v / 4) + 4 (j % 4) + s.
struct Q4K {
  vidx v0, v1;
  vec a0, a1, b;  // per lane: the scale of its chunk for h = 0 and 1; b: the 8 chunks' mins, then 8 zeros
};

inline Q4K q4k_load(const uint8_t* blk) {
  float a[8], b[8];
  k_scales(blk, a, b);
  const uint8_t* qs = blk + 16;
  Q4K q;
  q.v0 = vidx_bytes4x16(qs, 0, 32, 64, 96);
  q.v1 = vidx_bytes4x16(qs, 16, 48, 80, 112);
  q.a0 = vspread4(a, 0);
  q.a1 = vspread4(a, 1);
  q.b = vld_tail(b, 8);   // the 8 mins, then 8 zeros
  return q;
}

// The 16 quants (as floats 0..15) of step v, nibble h: vpermps reads only each lane's low 4 bits.
inline vec q4k_q(const Q4K& q, int h, int v) {
  const vidx src = v < 4 ? q.v0 : q.v1;
  const int sh = 8 * (v % 4) + 4 * h;
  return vlookup(sh ? vidx_shr(src, sh) : src, viota());
}

// x [M, K] -> xp [M, K] (each 256-block in lane order: h * 128 + 16 v + j) and xs [M, K / 16] (per block: its 8
// chunk sums, then 8 zeros, matching Q4K::b).
void q4k_prepare(const float* x, int64_t M, int64_t K, float* xp, float* xs) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t b = 0; b < K / 256; b++) {
      const float* xb = x + m * K + b * 256;
      float* o = xp + m * K + b * 256;
      for (int h = 0; h < 2; h++)
        for (int v = 0; v < 8; v++)
          for (int j = 0; j < 16; j++)
            o[h * 128 + v * 16 + j] = xb[32 * (2 * (j / 4) + h) + 16 * (v / 4) + 4 * (j % 4) + v % 4];
      float* s = xs + m * (K / 16) + b * 16;
      for (int c = 0; c < 8; c++) {
        float t = 0.f;
        for (int i = 0; i < 32; i++) t += xb[32 * c + i];
        s[c] = t;
        s[8 + c] = 0.f;
      }
    }
}

// One block of one weight row against one activation row: the sequence every path below runs.
//   for h: P = q(h, 0) * x + q(h, 1) * x + ... (in v order); acc += P * a_h;   then acc -= b * xs
template <int R, int M_>
void q4k_tile(const float* xp, const float* xs, int64_t K, const uint8_t* w, int64_t rb, float* y, int64_t ldy,
              int64_t n0) {
  vec acc[R][M_];
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M_; m++) acc[r][m] = vzero();
  const uint8_t* wr = w + n0 * rb;
  const int64_t nb = K / 256, pf = pf_distance(R * rb);
  for (int64_t blk = 0; blk < nb; blk++) {
    const float* xb = xp + blk * 256;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
      prefetch_block<144>(wr + r * rb + blk * 144 + pf);
      const Q4K q = q4k_load(wr + r * rb + blk * 144);
#pragma GCC unroll 2
      for (int h = 0; h < 2; h++) {
        vec P[M_];
#pragma GCC unroll 8
        for (int v = 0; v < 8; v++) {
          const vec qf = q4k_q(q, h, v);
          for (int m = 0; m < M_; m++) {
            const vec xv = vld(xb + m * K + h * 128 + 16 * v);
            P[m] = v ? vfma(qf, xv, P[m]) : vmul(qf, xv);
          }
        }
        for (int m = 0; m < M_; m++) acc[r][m] = vfma(P[m], h ? q.a1 : q.a0, acc[r][m]);
      }
      for (int m = 0; m < M_; m++)
        acc[r][m] = vfnma(q.b, vld(xs + m * (K / 16) + blk * 16), acc[r][m]);
    }
  }
  for (int r = 0; r < R; r++)
    for (int m = 0; m < M_; m++) y[m * ldy + n0 + r] = vsum(acc[r][m]);
}

void q4k_linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy) {
  const int64_t rb = K / 256 * 144;
  thread_local std::vector<float> buf;
  buf.resize((size_t)(M * K + M * (K / 16)));
  float* xp = buf.data();
  float* xs = xp + M * K;
  q4k_prepare(x, M, K, xp, xs);
  if (M == 1) {  // 8 rows: enough independent FMA chains at one activation row
    over_rows<8>(N, K, [&](int64_t n0) { q4k_tile<8, 1>(xp, xs, K, w, rb, y, ldy, n0); },
                 [&](int64_t n0) { q4k_tile<1, 1>(xp, xs, K, w, rb, y, ldy, n0); });
    return;
  }
  // any other M: register tiles over chunks of <= 4 activation rows, each row group's blocks decoded again per
  // chunk from L1 (measured as fast as a decode-once span path up to 128 rows, and simpler)
  auto rows = [&](auto r_const, int64_t n0) {
    constexpr int R = decltype(r_const)::value;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const float* xm = xp + m0 * K;
      const float* sm = xs + m0 * (K / 16);
      float* ym = y + m0 * ldy;
      switch (M - m0 < 4 ? M - m0 : 4) {
        case 1: q4k_tile<R, 1>(xm, sm, K, w, rb, ym, ldy, n0); break;
        case 2: q4k_tile<R, 2>(xm, sm, K, w, rb, ym, ldy, n0); break;
        case 3: q4k_tile<R, 3>(xm, sm, K, w, rb, ym, ldy, n0); break;
        default: q4k_tile<R, 4>(xm, sm, K, w, rb, ym, ldy, n0); break;
      }
    }
  };
  over_rows<4>(N, K, [&](int64_t n0) { rows(std::integral_constant<int, 4>(), n0); },
               [&](int64_t n0) { rows(std::integral_constant<int, 1>(), n0); });
  if (buf.size() > (1 << 22)) std::vector<float>().swap(buf);  // a prefill's copy is not kept past its call
}
#endif

template <int T>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N, float* y, int64_t ldy) {
#if SWK_ISA == 512
  if constexpr (T == Q4_K) {
    q4k_linear(x, M, K, w, N, y, ldy);
    return;
  }
#endif
  const int64_t rb = K / Fmt<T>::BS * Fmt<T>::TS;  // bytes per weight row
  auto one = [&](int64_t n0) {
    if (M == 1) tile_reg<T, 1, 1>(x, K, w, rb, y, ldy, n0);
    else rows_span<T, 1>(x, M, K, w, rb, y, ldy, n0);
  };
  if (M == 1) {  // 8 rows: enough independent FMA chains at one activation row
    over_rows<8>(N, K, [&](int64_t n0) { tile_reg<T, 8, 1>(x, K, w, rb, y, ldy, n0); }, one);
  } else if (M <= MR_REG) {
    over_rows<4>(N, K, [&](int64_t n0) {
      switch (M) {
        case 2: tile_reg<T, 4, 2>(x, K, w, rb, y, ldy, n0); break;
#if SWK_ISA == 512
        case 3: tile_reg<T, 4, 3>(x, K, w, rb, y, ldy, n0); break;
        case 4: tile_reg<T, 4, 4>(x, K, w, rb, y, ldy, n0); break;
#endif
        default: break;
      }
    }, [&](int64_t n0) { rows_span<T, 1>(x, M, K, w, rb, y, ldy, n0); });
  }
#if SWK_ISA == 256
  else if (M <= 4) {
    // 3-4 rows: register tiles of 2 weight rows (16 registers: 8 accumulators, a chunk's 4 weight vectors, x)
    over_rows<2>(N, K, [&](int64_t n0) {
      if (M == 3) tile_reg<T, 2, 3>(x, K, w, rb, y, ldy, n0);
      else tile_reg<T, 2, 4>(x, K, w, rb, y, ldy, n0);
    }, [&](int64_t n0) { rows_span<T, 1>(x, M, K, w, rb, y, ldy, n0); });
  }
#endif
#if SWK_ISA == 512
  else if (M <= MR_WIDE_MAX) {
    // Verify-sized passes: the M <= 4 register tiles over chunks of 4 activation rows, each row group's blocks
    // decoded again per chunk from L1 (cheaper than parking accumulators in memory as the span path does).
    over_rows<4>(N, K, [&](int64_t n0) {
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* xm = x + m0 * K;
        float* ym = y + m0 * ldy;
        switch (M - m0 < 4 ? M - m0 : 4) {
          case 1: tile_reg<T, 4, 1>(xm, K, w, rb, ym, ldy, n0); break;
          case 2: tile_reg<T, 4, 2>(xm, K, w, rb, ym, ldy, n0); break;
          case 3: tile_reg<T, 4, 3>(xm, K, w, rb, ym, ldy, n0); break;
          default: tile_reg<T, 4, 4>(xm, K, w, rb, ym, ldy, n0); break;
        }
      }
    }, [&](int64_t n0) {
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t mm = M - m0 < 4 ? M - m0 : 4;
        if (mm == 1) tile_reg<T, 1, 1>(x + m0 * K, K, w, rb, y + m0 * ldy, ldy, n0);
        else rows_span<T, 1>(x + m0 * K, mm, K, w, rb, y + m0 * ldy, ldy, n0);
      }
    });
  }
#endif
  else {
    over_rows<4>(N, K, [&](int64_t n0) { rows_span<T, 4>(x, M, K, w, rb, y, ldy, n0); }, one);
  }
}

template <int T>
void dequant(const uint8_t* blocks, int64_t n, float* out) {
  const int64_t nb = n / Fmt<T>::BS;
  swk_pool::parallel_for(nb, nb >= 16384 ? swk_pool::threads() : 1, [&](int64_t i, int) {
    decode<T>(blocks + i * Fmt<T>::TS, [&](int c, const vec (&wv)[NV]) {
      for (int v = 0; v < NV; v++) vst(out + i * Fmt<T>::BS + c * 32 + v * W, wv[v]);
    });
  });
}

}  // namespace

#if __has_include("swiftk_cpu.h")   // the public declarations: the compiler checks the definitions against them
#include "swiftk_cpu.h"
#endif

extern "C" {

// kernels/cpu/cpu_qdot.cpp, linked into the same library: the same matmul with int8 activations
int swk_qi_linear_ld(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y,
                     int64_t ldy);

// Elements per block of ggml type `type`, or -1 for a type this file does not handle.
int swk_q_block_size(int type) { return block_size(type); }

// Bytes per block of ggml type `type`, or -1.
int swk_q_type_size(int type) { return type_size(type); }

// 512 (AVX-512), 256 (AVX2+FMA) or 0 (portable): the path this build was compiled for.
int swk_q_isa(void) { return SWK_ISA; }

// Return codes: 0 done; -1 null pointer or non-positive size; -2 unknown type; -3 n or K not a multiple of the
// block size (nothing written); -4 out of memory (the matmuls: y incomplete).

// out[n] = the n elements (whole blocks) of type `type` at `blocks`, as gguf.quants.dequantize gives them.
int swk_q_dequant(int type, const void* blocks, int64_t n, float* out) {
  if (!blocks || !out || n < 1) return -1;
  const int bs = swk_q_block_size(type);
  if (bs < 0) return -2;
  if (n % bs) return -3;
  const uint8_t* b = (const uint8_t*)blocks;
  return by_type(type, [&](auto t) { dequant<decltype(t)::value>(b, n, out); });
}

// y[M, N] (float32, row-major, ldy floats per row: y may be a column slice of a wider output) = x[M, K]
// (float32, row-major) @ W^T, W = N rows of K / block_size consecutive blocks of type `type` (ggml's layout of a
// [N, K] weight). Threads: swk_set_threads' (swiftk sets torch's). `type` | SWK_Q_INT8_ACT: the same with the
// rows of x quantized to int8 (kernels/cpu/cpu_qdot.cpp).
int swk_q_linear_ld(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y,
                    int64_t ldy) {
  if (type & SWK_Q_INT8_ACT) return swk_qi_linear_ld(x, M, K, w, type & ~SWK_Q_INT8_ACT, N, y, ldy);
  if (!x || !w || !y || M < 1 || K < 1 || N < 1 || ldy < N) return -1;
  const int bs = swk_q_block_size(type);
  if (bs < 0) return -2;
  if (K % bs) return -3;
  const uint8_t* wb = (const uint8_t*)w;
  try {   // Q4_K's activation buffer is sized before its parallel region: a failed allocation lands here
    by_type(type, [&](auto t) { linear<decltype(t)::value>(x, M, K, wb, N, y, ldy); });
  } catch (const std::bad_alloc&) {
    return -4;
  }
  return 0;
}

int swk_q_linear(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y) {
  return swk_q_linear_ld(x, M, K, w, type, N, y, N);
}

}  // extern "C"
