// Integer dot products on GGUF blocks: y[M, N] = x[M, K] @ W[N, K]^T with W in its ggml block format (Q4_0, Q4_1,
// Q5_0, Q8_0, Q4_K, Q5_K, Q6_K) and every activation row quantized to int8 on its own: blocks of 32 for the
// 32-element formats, of 256 for the K formats, one float32 scale per block (amax / 127, round half to even).
// Quants multiply in integers and sum exactly in int32; the float epilogue (weight scale x activation scale x
// integer sum, the mins and offsets through the activation block sums) runs once per block, in k order. This is
// the arithmetic of llama.cpp's CPU backend (q8_0 / q8_K activations), with float32 activation scales.
// Python binding: swiftk/runtime/ops/cpu_quant.py (act="int8"); tests: tests/test_cpu_qdot.py.
//
// Files: this header is the matmul, whatever the format: the activation quantizer, the packed layout, the vector
// paths and the scalar driver. Each format family's file defines the format (Codec<T>: its packed fields, its scalar
// definition, its vector decode) and instantiates the matmul for it: cpu_qdot_q4.cpp (Q4_0, Q4_1), cpu_qdot_q58.cpp
// (Q5_0, Q8_0), cpu_qdot_q4k.cpp and cpu_qdot_q5k.cpp (both over KCodec45, below), cpu_qdot_q6k.cpp (separate
// units: the build compiles them in parallel). cpu_qdot.cpp holds the entry points. No file here holds an intrinsic: the vector ops and
// integer dot products are cpu_simd.h's (iv/fv lanes, u8i8_pairs, i16_pairs, u8i8_dot, and the 512-bit zv/zf).
//
// Why: with float32 activations every weight costs a float FMA per activation row, so a verify pass of 8 tokens
// cost ~3.4 decode steps (bench/results/history.md). Here one byte-multiply instruction does 32 products.
//
// Layout of the work: the 32-bit lanes of a vector are 8 consecutive weight rows. For each block, the 8 rows' quants
// are transposed in registers (4 bytes of one row per lane) and kept in an L1 buffer; every activation row of the
// pass then runs over that buffer with its 4 activation bytes broadcast. A lane ends a block holding its row's
// whole integer sum, so the float epilogue applies the 8 rows' scales in one vector op and nothing is reduced
// across lanes: the decode is shared by all rows of the pass and the per-row float work is one op per block.
//
// Batch invariance: integer sums are exact, and each (weight row, activation row) runs the same float epilogue
// sequence whatever M, its position in the pass, the group of 8 it falls in, or the thread count (threads split
// groups of output rows, never k). Every ISA path computes the same integers and the same float ops, so AVX2,
// VNNI and the portable build agree bit for bit with the scalar definition (swk_qi_linear_ref), tested.
//
// ISA: AVX2+FMA+F16C (vpmaddubsw + vpmaddwd; no int16 saturation can happen: weights enter as unsigned 4-6 bit
// values or, for Q8_0, through the sign trick, and at most as many products are summed in int16 as fit), with
// vpdpbusd when AVX-512 VNNI (+VL) or AVX-VNNI is compiled in, else portable C++. With AVX-512 VNNI, passes of 2 rows
// or more run 512-bit vectors whose 16 lanes are 8 weight rows x 2 activation rows (lanes 2r, 2r + 1: weight row
// r against rows a, b): each lane runs the 8-lane path's integers and float ops, so the bits do not change.
#pragma once

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <new>
#include <type_traits>
#include <vector>

#include "cpu_gguf.h"
#include "cpu_pool.h"
#include "cpu_simd.h"

namespace swk_qdot {

using namespace swk_gguf;

// ---- activations ------------------------------------------------------------------------------------------------
// One pass's activations, quantized row by row in blocks of 32 elements (for the K formats too: one scale per 256
// elements, as llama.cpp's q8_K, cost Qwen2.5-Coder-1.5B 8% of perplexity on chat text, 32 about 1%).
struct QX {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> d;       // [M, K / 32] block scales (NaN for a block holding an inf or NaN)
  std::vector<int32_t> s;     // [M, K / 32] sums of q per block
  std::vector<float> ds;      // [M, K / 32] d * s (the mins' term)
  std::vector<int16_t> s16;   // [M, K / 16] sums of q per 16 (Q6_K's offset)
};

// The definition: d = amax / 127, q = round_half_even(x * (127 / amax)) (|q| <= 127). A block holding an inf or
// NaN gets q = 0 and d = NaN, so the rows it feeds come out NaN as with float activations.
inline void quant_block_ref(const float* x, int n, int8_t* q, float* d) {
  float amax = 0.f;
  bool finite = true;
  for (int i = 0; i < n; i++) {
    const float a = fabsf(x[i]);
    finite = finite && a <= FLT_MAX;
    amax = a > amax ? a : amax;
  }
  if (!finite) {
    memset(q, 0, n);
    *d = NAN;
    return;
  }
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < n; i++) {
    const float r = nearbyintf(x[i] * id);
    q[i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
  }
  *d = amax / 127.f;
}

#if SWI_SIMD
// The same, 8 floats per op: max is exact and x * id rounds alike, so q and d equal quant_block_ref's.
inline void quant_block_simd(const float* x, int n, int8_t* q, float* d) {
  const float amax = f8_absmax(x, n);
  if (amax < 0.f) {
    memset(q, 0, n);
    *d = NAN;
    return;
  }
  const float id = amax > 0.f ? 127.f / amax : 0.f;
  for (int i = 0; i < n; i += 32) i8_round32(x + i, id, q + i);
  *d = amax / 127.f;
}
#endif

inline void quant_block(const float* x, int n, int8_t* q, float* d, bool simd) {
#if SWI_SIMD
  if (simd) return quant_block_simd(x, n, q, d);
#endif
  (void)simd;
  quant_block_ref(x, n, q, d);
}

inline void quantize(const float* x, int64_t M, int64_t K, QX& X, bool simd) {
  X.M = M, X.K = K;
  X.q.resize((size_t)(M * K));
  X.d.resize((size_t)(M * (K / 32)));
  X.s.resize(X.d.size());
  X.ds.resize(X.d.size());
  X.s16.resize((size_t)(M * (K / 16)));
  swk_pool::parallel_for(M, M >= 4 && M * K >= (1 << 13) ? swk_pool::threads() : 1, [&](int64_t m, int) {
    for (int64_t b = 0; b < K / 32; b++) {
      const int64_t i = m * (K / 32) + b;
      int8_t* q = X.q.data() + m * K + 32 * b;
      quant_block(x + m * K + 32 * b, 32, q, X.d.data() + i, simd);
      int t0 = 0, t1 = 0;
#if SWI_SIMD
      if (simd) {   // vpsadbw: the same integers, a tenth of the time
        i8_sums16(q, &t0, &t1);
      } else
#endif
        for (int j = 0; j < 16; j++) t0 += q[j], t1 += q[16 + j];
      X.s16[2 * i] = (int16_t)t0;
      X.s16[2 * i + 1] = (int16_t)t1;
      X.s[i] = t0 + t1;
      X.ds[i] = X.d[i] * (float)X.s[i];
    }
  });
}

// ---- the scalar definition --------------------------------------------------------------------------------------
// Codec<T>::ref_block (the format's family file): block b (of Fmt<T>::BS elements) of one weight row against
// activation row m, per 32 elements the integer sum, then its float epilogue onto acc. The vector path computes the
// same integers and the same float ops. Not vectorized (SWK_QDOT_SCALAR): GCC 12 with AVX-512 VNNI turns Q8_0's
// signed x signed byte sum into vpdpbusd (unsigned x signed) and gets it wrong (seen on a Sapphire Rapids host);
// the definition must not depend on the compiler's vectorizer.
#define SWK_QDOT_SCALAR __attribute__((optimize("no-tree-vectorize")))

// The formats: each family's file (cpu_qdot_q4.cpp: Q4_0, Q4_1; cpu_qdot_q58.cpp: Q5_0, Q8_0; cpu_qdot_q4k.cpp,
// cpu_qdot_q5k.cpp, cpu_qdot_q6k.cpp) defines Codec<T> and instantiates this header's templates for it:
//   static constexpr Field fields[]: the packed layout (below);
//   static float ref_block(const uint8_t* blk, const QX& X, int64_t m, int64_t b, float acc): the definition;
//   template <class P> static void unpack(const uint8_t* p, int bi, Span& S, P&& put): the vector path's decode
//     of block (32-element formats) or superblock (K formats) bi of a span from its packed bytes p: scales into S,
//     then put(v, w) for each weight vector in k order (weight vector v: elements 4v .. 4v + 3 of each row).
template <int T> struct Codec;

template <int T>
void linear_ref(const QX& X, const uint8_t* w, int64_t N, float* y, int64_t ldy) {
  constexpr int BS = Fmt<T>::BS, TS = Fmt<T>::TS;
  const int64_t K = X.K, rb = K / BS * TS;
  swk_pool::parallel_for(N, N * K >= 65536 ? swk_pool::threads() : 1, [&](int64_t n, int) {
    for (int64_t m = 0; m < X.M; m++) {
      float acc = 0.f;
      for (int64_t b = 0; b < K / BS; b++) acc = Codec<T>::ref_block(w + n * rb + b * TS, X, m, b, acc);
      y[m * ldy + n] = acc;
    }
  });
}

// ---- the packed layout ------------------------------------------------------------------------------------------
// The vector path reads weights repacked once at load (swk_qi_repack): rows in groups of 8, and per group and block
// the 8 rows' fields side by side: each float16 field of the block as 8 halves (16 bytes), each run of quant bytes
// as 4-byte groups, 8 rows per 32 bytes (lane r = row r). The bytes are the file's, permuted: the same size, so a
// matrix keeps its shape; rows past the last full group of 8 stay in the file's layout. Fields per format, in the
// order they are stored (Codec<T>::fields, offsets within the file's block).
struct Field { int off, n; };   // n == 2: a float16 field; else n bytes of quants (a multiple of 4)

// packed <-> file layout of one group of 8 rows: block b of row r lives at rows[r] + b * TS in the file's layout
template <int T, bool PACK>
void group_permute(uint8_t* packed, uint8_t* const* rows, int64_t nblk) {
  constexpr int TS = Fmt<T>::TS;
  for (int64_t b = 0; b < nblk; b++) {
    uint8_t* p = packed + b * 8 * TS;
    for (const Field& f : Codec<T>::fields) {
      for (int c = 0; c < (f.n == 2 ? 1 : f.n / 4); c++)
        for (int r = 0; r < 8; r++) {
          const int len = f.n == 2 ? 2 : 4;
          uint8_t* a = p + (f.n == 2 ? 2 * r : 32 * c + 4 * r);
          uint8_t* o = rows[r] + b * TS + f.off + 4 * c;
          if (PACK) memcpy(a, o, len);
          else memcpy(o, a, len);
        }
      p += f.n == 2 ? 16 : 8 * f.n;
    }
  }
}

template <int T>
void repack(const uint8_t* src, int64_t N, int64_t K, uint8_t* dst) {
  const int64_t rb = K / Fmt<T>::BS * Fmt<T>::TS, full = N / 8;
  swk_pool::parallel_for(full, N * rb >= (1 << 22) ? swk_pool::threads() : 1, [&](int64_t g, int) {
    uint8_t* rows[8];
    for (int r = 0; r < 8; r++) rows[r] = const_cast<uint8_t*>(src) + (8 * g + r) * rb;
    group_permute<T, true>(dst + 8 * g * rb, rows, K / Fmt<T>::BS);
  });
  memcpy(dst + 8 * full * rb, src + 8 * full * rb, (size_t)((N - 8 * full) * rb));
}

// rows ids[i] of a packed matrix, in the file's layout, into out[i]
template <int T>
void unpack_rows(const uint8_t* packed, int64_t N, int64_t K, const int64_t* ids, int64_t n, uint8_t* out) {
  const int64_t rb = K / Fmt<T>::BS * Fmt<T>::TS, full = N / 8;
  std::vector<uint8_t> tmp;
  for (int64_t i = 0; i < n; i++) {
    const int64_t id = ids[i], g = id / 8;
    if (g >= full) {
      memcpy(out + i * rb, packed + id * rb, (size_t)rb);
      continue;
    }
    tmp.resize((size_t)(8 * rb));
    uint8_t* rows[8];
    for (int r = 0; r < 8; r++) rows[r] = tmp.data() + r * rb;
    group_permute<T, false>(const_cast<uint8_t*>(packed) + 8 * g * rb, rows, K / Fmt<T>::BS);
    memcpy(out + i * rb, rows[id % 8], (size_t)rb);
  }
}

#if SWI_SIMD
// ---- the vector path --------------------------------------------------------------------------------------------
// int16 products summed per int16 lane before widening (AVX2): 4-bit weights 8 (8 x 2 x 15 x 127 < 2^15), 5-bit 4,
// 6-bit 2
template <int T> constexpr int kG = T == Q4_0 || T == Q4_1 || T == Q4_K ? 8 : T == Q5_0 || T == Q5_K ? 4 : 2;
// weight vectors per scale: a 32-element block or K sub-block is 8 (4 bytes of 8 rows each), Q6_K's 16 elements 4
template <int T> constexpr int kVS = T == Q6_K ? 4 : 8;
// Q4_K and Q5_K with VNNI: a sub-block's integer sum u times its scale sc in float, float(u) * float(sc), not
// float(sc * u): both are exact (|sc * u| <= 63 * 32 * 31 * 127 < 2^24), so the bits are the same, and a float
// multiply is one uop where vpmulld is two on the port the dot products need
template <int T> constexpr bool kFloatScale = SWI_VNNI && (T == Q4_K || T == Q5_K);
// weight vectors per decoded span: 8 blocks of a 32-element format or one K superblock (256 elements per row)
constexpr int kSpanV = 64;

// One span of a group of 8 weight rows, decoded: weight vector v holds elements 4v .. 4v + 3 of the span of each
// row (lane r = row r) as unsigned bytes (Q8_0 on AVX2: |w| here, w in ws; with VNNI w + 128).
struct alignas(32) Span {
  iv w[kSpanV], ws[kSpanV];
  fv dw[8], mw[8];   // 32-element formats: per block, the 8 rows' d (and Q4_1's m)
  fv d, dm;          // K formats: d, dmin
  iv sc16[16];       // per sub-block: each row's scale in both int16 halves of its lane
  iv sc32[16];       // the same as int32 (VNNI)
  fv scf[8];         // Q4_K/Q5_K with VNNI: the same as float32 (kFloatScale)
  iv mn[8];          // Q6_K: per 32 elements its two scales as an int16 pair
  fv mnf[8];         // Q4_K/Q5_K: per sub-block each row's dmin * min (exact in float32)
};

// Q4_K and Q5_K's 12 scale bytes (packed: 3 dwords per row), swk_gguf::k_scale_min 8 rows per op: the scales
// into S.sc32 (VNNI) or S.sc16, each row's dmin * min into S.mnf
inline void unpack_k_scales(const uint8_t* p, Span& S) {
  const iv t1 = i_ld(p), t2 = i_ld(p + 32), t3 = i_ld(p + 64), m6 = i8_set1(0x3F), m4 = i8_set1(0x0F);
  const iv m30 = i8_set1(0x30);
  const iv sclo = i_and(t1, m6), mnlo = i_and(t2, m6);
  const iv schi = i_or(i_and(t3, m4), i_and(i16_shr(t1, 2), m30));
  const iv mnhi = i_or(i_and(i16_shr(t3, 4), m4), i_and(i16_shr(t2, 2), m30));
#pragma GCC unroll 16
  for (int s = 0; s < 8; s++) {
#if SWI_VNNI
    S.sc32[s] = i8_pick(s < 4 ? sclo : schi, s % 4, -1, -1, -1);
    S.scf[s] = f8_i32(S.sc32[s]);
#else
    S.sc16[s] = i8_pick(s < 4 ? sclo : schi, s % 4, -1, s % 4, -1);
#endif
  }
#pragma GCC unroll 16
  for (int j = 0; j < 8; j++) S.mnf[j] = f8_mul(S.dm, f8_i32(i8_pick(j < 4 ? mnlo : mnhi, j % 4, -1, -1, -1)));
}

template <int T>
inline void decode(const uint8_t* p, int nb, Span& S) {
  constexpr int GBT = 8 * Fmt<T>::TS;
  for (int bi = 0; bi < nb; bi++) {
    iv* w = S.w + 8 * bi * (Fmt<T>::BS == 32);
    [[maybe_unused]] iv* ws = S.ws + 8 * bi * (Fmt<T>::BS == 32);
    Codec<T>::unpack(p + bi * GBT, bi, S, [&](int v, iv q) {
      if constexpr (T == Q8_0) {
#if SWI_VNNI
        w[v] = i_xor(q, i8_set1(0x80));   // w + 128: unsigned, its offset through the block sum
#else
        w[v] = i8_abs(q);
        ws[v] = q;
#endif
      } else {
        w[v] = q;
      }
    });
  }
}

// out[g][m] (+)= sum over vectors v < NV of unsigned weight bytes w[g][v] times activation bytes x[m] + 4 v, in int32
// lanes, times the per-lane integer scale (sc16[g]: in both int16 halves of a lane; sc32[g]: as int32) when SCALED.
// Each broadcast of 4 activation bytes serves the NG groups' weight vectors and each weight vector the MT rows.
// AVX2 sums G products in int16 before vpmaddwd; VNNI accumulates in int32 and scales with one multiply.
template <int G, int NV, int MT, int NG, bool SCALED>
inline void dot_u8(const iv* const (&w)[NG], const int8_t* const (&x)[MT], iv (&out)[NG][MT],
                   const iv* const (&sc16)[NG], const iv* const (&sc32)[NG]) {
#if SWI_VNNI
  (void)sc16;
  iv a[NG][MT];
  for (int g = 0; g < NG; g++)
    for (int m = 0; m < MT; m++) a[g][m] = i_zero();
#pragma GCC unroll 16
  for (int v = 0; v < NV; v++) {
    iv wv[NG];
    for (int g = 0; g < NG; g++) wv[g] = i_lda(w[g] + v);
    for (int m = 0; m < MT; m++) {
      const iv xb = i32_bcast(x[m] + 4 * v);
      for (int g = 0; g < NG; g++) a[g][m] = u8i8_dot(a[g][m], wv[g], xb);
    }
  }
  for (int g = 0; g < NG; g++)
    for (int m = 0; m < MT; m++)
      out[g][m] = i32_add(out[g][m], SCALED ? i32_mul(a[g][m], *sc32[g]) : a[g][m]);
#else
  (void)sc32;
#pragma GCC unroll 16
  for (int v0 = 0; v0 < NV; v0 += G) {
    iv p[NG][MT];
#pragma GCC unroll 8
    for (int v = v0; v < v0 + G; v++) {
      iv wv[NG];
      for (int g = 0; g < NG; g++) wv[g] = i_lda(w[g] + v);
      for (int m = 0; m < MT; m++) {
        const iv xb = i32_bcast(x[m] + 4 * v);
        for (int g = 0; g < NG; g++) {
          const iv t = u8i8_pairs(wv[g], xb);
          p[g][m] = v == v0 ? t : i16_add(p[g][m], t);
        }
      }
    }
    for (int g = 0; g < NG; g++) {
      const iv s = SCALED ? *sc16[g] : i16_set1(1);
      for (int m = 0; m < MT; m++) out[g][m] = i32_add(out[g][m], i16_pairs(p[g][m], s));
    }
  }
#endif
}

// The float epilogue of 32 elements j (of a span or a superblock) of a group's 8 rows against activation row m, its
// activation block a: ref_block's float ops for those 32 elements, lane by lane.
template <int T>
inline fv epilogue(const Span& S, int j, const QX& X, int64_t m, int64_t a, iv isum, fv acc) {
  const int64_t i = m * (X.K / 32) + a;
  const fv xd = f8_set1(X.d[i]);
  if constexpr (Fmt<T>::BS == 32) {
    constexpr int off = T == Q4_0 ? 8 : T == Q5_0 ? 16 : T == Q8_0 && SWI_VNNI ? 128 : 0;
    if (off) isum = i32_sub(isum, i32_set1(off * X.s[i]));
    acc = f8_fma(f8_i32(isum), f8_mul(S.dw[j], xd), acc);
    if (T == Q4_1) acc = f8_fma(S.mw[j], f8_set1(X.ds[i]), acc);
  } else if constexpr (T == Q6_K) {   // the offset 32: both scales times the activation sums per 16
    const iv o = i16_pairs(S.mn[j], i32_bcast(X.s16.data() + 2 * i));
    isum = i32_sub(isum, i32_shl(o, 5));
    acc = f8_fma(f8_i32(isum), f8_mul(S.d, xd), acc);
  } else {   // Q4_K, Q5_K: the min times the activation sum
    acc = f8_fma(f8_i32(isum), f8_mul(S.d, xd), acc);
    acc = f8_fnma(S.mnf[j], f8_set1(X.ds[i]), acc);
  }
  return acc;
}

// Activation rows m0 .. m0 + MT - 1 over the decoded spans S[g] of NG groups (blocks b0 .. b0 + nb - 1), onto
// acc[g][m]: lane r is weight row r of group g's running sum, 32 elements at a time.
template <int T, int MT, int NG>
inline void mpart(const Span* S, int nb, const QX& X, int64_t m0, int64_t b0, fv (&acc)[NG][MT]) {
  const int64_t K = X.K, a0 = b0 * (Fmt<T>::BS / 32);
  const int nsub = Fmt<T>::BS == 32 ? nb : 8;
  const iv zero = i_zero();
  for (int j = 0; j < nsub; j++) {
    const int8_t* x[MT];
    iv isum[NG][MT];
    for (int m = 0; m < MT; m++) x[m] = X.q.data() + (m0 + m) * K + 32 * (a0 + j);
    for (int g = 0; g < NG; g++)
      for (int m = 0; m < MT; m++) isum[g][m] = zero;
    if constexpr (T == Q8_0 && !SWI_VNNI) {   // |w| times x with w's sign: the sign trick
      const iv ones = i16_set1(1);
#pragma GCC unroll 8
      for (int v = 0; v < 8; v++) {
        iv wa[NG], ws[NG];
        for (int g = 0; g < NG; g++) wa[g] = S[g].w[8 * j + v], ws[g] = S[g].ws[8 * j + v];
        for (int m = 0; m < MT; m++) {
          const iv xb = i32_bcast(x[m] + 4 * v);
          for (int g = 0; g < NG; g++)
            isum[g][m] = i32_add(
                isum[g][m], i16_pairs(u8i8_pairs(wa[g], i8_sign(xb, ws[g])), ones));
        }
      }
    } else if constexpr (Fmt<T>::BS == 32) {
      const iv* w[NG];
      const iv* none[NG] = {};
      for (int g = 0; g < NG; g++) w[g] = S[g].w + 8 * j;
      dot_u8<kG<T>, 8, MT, NG, false>(w, x, isum, none, none);
    } else {
      for (int k = 0; k < 8 / kVS<T>; k++) {   // the scales of these 32 elements (Q6_K: two of 16)
        const int js = 8 / kVS<T> * j + k;
        const int8_t* xk[MT];
        for (int m = 0; m < MT; m++) xk[m] = x[m] + 4 * kVS<T> * k;
        const iv *w[NG], *s16[NG], *s32[NG];
        for (int g = 0; g < NG; g++) w[g] = S[g].w + kVS<T> * js, s16[g] = &S[g].sc16[js], s32[g] = &S[g].sc32[js];
        dot_u8<kG<T>, kVS<T>, MT, NG, true>(w, xk, isum, s16, s32);
      }
    }
    for (int m = 0; m < MT; m++)
      for (int g = 0; g < NG; g++) acc[g][m] = epilogue<T>(S[g], j, X, m0 + m, a0 + j, isum[g][m], acc[g][m]);
  }
}

// acc: [NG][M][8] floats (each group's running sums, row by row)
template <int T, int MT, int NG>
inline void mpart_at(const Span* S, int nb, const QX& X, int64_t m0, int64_t b0, float* acc) {
  const int64_t M = X.M;
  fv a[NG][MT];
  for (int g = 0; g < NG; g++)
    for (int m = 0; m < MT; m++) a[g][m] = f8_ld(acc + 8 * (g * M + m0 + m));
  mpart<T, MT, NG>(S, nb, X, m0, b0, a);
  for (int g = 0; g < NG; g++)
    for (int m = 0; m < MT; m++) f8_st(acc + 8 * (g * M + m0 + m), a[g][m]);
}

// passes of at most this many rows take direct(), 4 rows per unpacking; longer ones the tiles (the 256-bit builds:
// with AVX-512 VNNI every pass of 2 rows or more takes the pairs). The 32-element formats: direct ahead up to 32 rows
// (AVX2, Zen 3), the tiles at 64 (AVX2 on the Xeon: prefill 0.84x with direct). The K formats, Qwen2.5-Coder-1.5B
// on the Xeon (bench.library_ab): AVX2 builds take direct at every size measured, 0.73 / 0.76 / 0.89x the tiles'
// time at 8 / 16 / 32 rows and prefill (64-row passes) 1.08x faster (library_ab_20261129-042431); with VNNI the
// tiles keep 32 rows and more (direct 0.86x at 8 rows, 1.11x at 32, prefill 0.87x: -042946). Zen 3 once measured
// the tiles ahead from 8 rows, with an older direct(): not re-measured there.
// direct() and direct2() prefetch the packed weights ahead of the block they multiply, each cache line once
// (ahead_block, below). A decode step is a stream through memory whose arithmetic per byte is small; how to prefetch
// it depends on the core (bench.library_ab):
// - AMD (EPYC, Zen 3, 20-25 GB/s): the hardware prefetchers alone left it at ~12 GB/s; into L1 (T0) 4096 bytes ahead,
//   a block's lines at its start, reached 15-19 (2048: 15, 8192: 16-17).
// - Intel (an AMX Xeon guest, 23-25 GB/s): a group's K-format block is 18-26 lines. Issued at once, their T0
//   prefetches held the line fill buffers (68% of the samples on the instruction after prefetcht0); T2 8192 bytes
//   ahead, still at once, took Qwen2.5-Coder-1.5B's step 0.73x (no software prefetch ran about as fast). Spread
//   over the block's unpacking, one line every 2-4 weight vectors, T2 took it another 0.73-0.78x, to the read
//   bandwidth measured beside it, and its passes of 2-16 rows 0.8-0.9x; the 32-element formats too (Qwen-0.5B's
//   step 0.92x, SmolLM2's 0.85x). 4096 and 16384 bytes ahead were 3% slower.
#ifndef SWI_PFD
#define SWI_PFD 4096
#endif
#ifndef SWI_PFD_L2
#define SWI_PFD_L2 8192
#endif
// Whether this core wants its weights prefetched into L2, spread over each block: Intel's. SWI_PF_L2 forces it
// (bench.library_ab's arms).
#ifdef SWI_PF_L2
inline const bool kPrefetchL2 = SWI_PF_L2;
#elif defined(__x86_64__)
inline const bool kPrefetchL2 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_is("intel") != 0;
}();
#else
inline const bool kPrefetchL2 = false;
#endif
template <int T> constexpr int kDirectMax = Fmt<T>::BS == 32 || SWI_VNNI ? 16 : 64;
// activation rows per tile, by groups per tile: what the 16 AVX2 vector registers hold
#ifndef SWI_MT2
#define SWI_MT2 4
#endif
template <int NG> constexpr int kMT = NG == 2 ? SWI_MT2 : 4;

template <int T, int NG>
inline void span_rows(const Span* S, int nb, const QX& X, int64_t b0, float* acc) {
  constexpr int MT = kMT<NG>;
  const int64_t M = X.M;
  int64_t m = 0;
  for (; m + MT <= M; m += MT) mpart_at<T, MT, NG>(S, nb, X, m, b0, acc);
  switch (M - m) {
    case 3: mpart_at<T, 3, NG>(S, nb, X, m, b0, acc); break;
    case 2: mpart_at<T, 2, NG>(S, nb, X, m, b0, acc); break;
    case 1: mpart_at<T, 1, NG>(S, nb, X, m, b0, acc); break;
    default: break;
  }
}

// The cache lines starting inside the n bytes at blk, DIST ahead, with locality HINT: each line once (groups lie back
// to back).
template <int DIST, int HINT>
inline void prefetch_lines(const uint8_t* blk, int n) {
  const uintptr_t q = (uintptr_t)(blk + DIST);
  for (uintptr_t a = (q + 63) & ~(uintptr_t)63; a < q + n; a += 64) __builtin_prefetch((const void*)a, 0, HINT);
}

// The prefetches ahead of a group's blocks of format T as they are unpacked: ahead_block() at a block's start,
// ahead_vector() at its weight vector v. On Intel (kPrefetchL2) one line into L2 (T2) SWI_PFD_L2 ahead every few
// vectors, each of the L lines the block's bytes may touch once; elsewhere all of them into L1 (T0) SWI_PFD ahead at
// the block's start. (Free functions on locals: GCC 12 dropped the prefetches whose address was a struct member.)
template <int T>
inline const uint8_t* ahead_block(const uint8_t* blk) {
  if (kPrefetchL2) return (const uint8_t*)(((uintptr_t)blk + SWI_PFD_L2) & ~(uintptr_t)63);
  prefetch_lines<SWI_PFD, 3>(blk, 8 * Fmt<T>::TS);
  return nullptr;
}
template <int T>
inline void ahead_vector(const uint8_t* line0, int v) {
  constexpr int L = (8 * Fmt<T>::TS + 127) / 64, NV = Fmt<T>::BS / 4;   // lines (+1: misalignment), vectors
  static_assert(L <= NV, "a line per vector at most");
  if (line0 && (v * L) % NV < L) __builtin_prefetch(line0 + 64 * (v * L / NV), 0, 1);
}

// Activation rows m0 .. m0 + MT - 1 (MT <= 4) against one group's packed blocks b0 .. b0 + nb - 1, each weight vector
// multiplied as it is unpacked (no L1 buffer): decode steps and small verify passes. Same integers and float ops as
// mpart.
template <int T, int MT>
inline void direct(const uint8_t* p, int nb, const QX& X, int64_t m0, int64_t b0, Span& S, fv (&acc)[MT]) {
  constexpr int GBT = 8 * Fmt<T>::TS, VS = kVS<T>;
  [[maybe_unused]] constexpr int G = kG<T>;
  const int64_t K = X.K;
  const iv zero = i_zero();
  for (int bi = 0; bi < nb; bi++) {
    const int64_t b = b0 + bi, a0 = b * (Fmt<T>::BS / 32);
    const uint8_t* const line0 = ahead_block<T>(p + bi * GBT);
    const int8_t* x[MT];
    iv isum[MT], part[MT];   // part: the running int16 (AVX2) or int32 (VNNI) sum of the current scale's products
    for (int m = 0; m < MT; m++) {
      x[m] = X.q.data() + (m0 + m) * K + Fmt<T>::BS * b;
      isum[m] = part[m] = zero;
    }
    Codec<T>::unpack(p + bi * GBT, 0, S, [&](int v, iv w) {   // scales at 0: used within this block
      const int js = v / VS;   // the scale it falls under (K formats)
      ahead_vector<T>(line0, v);
      for (int m = 0; m < MT; m++) {
        const iv xb = i32_bcast(x[m] + 4 * v);
        if constexpr (T == Q8_0 && !SWI_VNNI) {
          isum[m] = i32_add(isum[m], i16_pairs(u8i8_pairs(i8_abs(w),
                                                                                     i8_sign(xb, w)),
                                                                i16_set1(1)));
        } else {
#if SWI_VNNI
          const iv wu = T == Q8_0 ? i_xor(w, i8_set1(0x80)) : w;
          part[m] = u8i8_dot(v % VS ? part[m] : zero, wu, xb);
          if (v % VS == VS - 1)
            isum[m] = i32_add(isum[m], Fmt<T>::BS == 256 ? i32_mul(part[m], S.sc32[js]) : part[m]);
#else
          const iv t = u8i8_pairs(w, xb);
          part[m] = v % G ? i16_add(part[m], t) : t;
          if (v % G == G - 1)
            isum[m] = i32_add(isum[m], i16_pairs(part[m], Fmt<T>::BS == 256 ? S.sc16[js]
                                                                                              : i16_set1(1)));
#endif
        }
      }
      if (v % 8 == 7) {   // 32 elements done: their float epilogue
        const int j = Fmt<T>::BS == 32 ? 0 : v / 8;
        for (int m = 0; m < MT; m++) {
          acc[m] = epilogue<T>(S, j, X, m0 + m, a0 + v / 8, isum[m], acc[m]);
          isum[m] = zero;
        }
      }
    });
  }
}

template <int T, int MT>
void direct_rows(const uint8_t* p, int64_t nblk, const QX& X, int64_t m0, Span& S, float* out /* [MT][8] */) {
  fv acc[MT];
  for (int m = 0; m < MT; m++) acc[m] = f8_zero();
  direct<T, MT>(p, (int)nblk, X, m0, 0, S, acc);
  for (int m = 0; m < MT; m++) f8_st(out + 8 * m, acc[m]);
}

#if SWI_V512
// ---- 512-bit vectors: two activation rows per vector --------------------------------------------------------------
// Lanes 2r and 2r + 1 hold weight row r (its 8-lane value duplicated) against activation rows a and b of a pair. The
// pair's activations are interleaved 4 bytes at a time (XP), so one 8-byte broadcast load gives a vector's
// activations: the weight side is duplicated once per vector and shared by every pair.

// Pairs of activation rows (2p, 2p + 1; an odd M's last row paired with itself), each quantity of QX interleaved per
// 4 bytes: q as int32 words, then per 32-element block d, s, ds and the two int16 sums of s16 as one word.
struct XP {
  int64_t P = 0, K = 0;
  std::vector<int32_t> q, s, s16;   // q [P, K / 4, 2]; s, s16 [P, K / 32, 2]
  std::vector<float> d, ds;         // [P, K / 32, 2]
};

// The pairs from p0 on, as pointers: the loops index pairs by their unrolled position (a constant), not p0 + m.
struct XV {
  const int32_t *q, *s, *s16;
  const float *d, *ds;
  int64_t K;
};
inline XV pairs_from(const XP& Y, int64_t p0) {
  const int64_t o = p0 * (Y.K / 32) * 2;
  return {Y.q.data() + p0 * (Y.K / 4) * 2, Y.s.data() + o, Y.s16.data() + o, Y.d.data() + o, Y.ds.data() + o, Y.K};
}
inline const int32_t* qdata(const XP& Y) { return Y.q.data(); }
inline const int32_t* qdata(const XV& Y) { return Y.q; }

inline void pair_rows(const QX& X, XP& Y) {
  const int64_t M = X.M, K = X.K, P = (M + 1) / 2, nq = K / 4, nb = K / 32;
  Y.P = P, Y.K = K;
  Y.q.resize((size_t)(P * nq * 2));
  Y.s.resize((size_t)(P * nb * 2)), Y.s16.resize(Y.s.size()), Y.d.resize(Y.s.size()), Y.ds.resize(Y.s.size());
  // the pairs split over the threads; each pair's two rows of words interleaved 16 at a time
  swk_pool::parallel_for(P, P >= 2 && P * K >= (1 << 12) ? swk_pool::threads() : 1, [&](int64_t p, int) {
    const int64_t ma = 2 * p, mb = 2 * p + 1 < M ? 2 * p + 1 : M - 1;   // an odd M's last row paired with itself
    const int32_t* qa = (const int32_t*)(X.q.data() + ma * K);   // K is a multiple of 32: whole words
    const int32_t* qb = (const int32_t*)(X.q.data() + mb * K);
    int32_t* out = Y.q.data() + p * nq * 2;
    int64_t i = 0;
    for (; i + 16 <= nq; i += 16) z32_zip16(qa + i, qb + i, out + 2 * i);
    for (; i < nq; i++) out[2 * i] = qa[i], out[2 * i + 1] = qb[i];
    for (int h = 0; h < 2; h++)
      for (int64_t i = 0; i < nb; i++) {
        const int64_t o = (p * nb + i) * 2 + h, a = (h ? mb : ma) * nb + i;
        Y.d[o] = X.d[a], Y.s[o] = X.s[a], Y.ds[o] = X.ds[a];
        memcpy(&Y.s16[o], X.s16.data() + 2 * a, 4);
      }
  });
}

// The weight side of the float epilogue of 32 elements j, duplicated to 16 lanes once for all pairs.
struct ZW { zf d, m, sc; zv mn; };
template <int T>
inline ZW zweights(const Span& S, int j) {
  ZW z;
  if constexpr (Fmt<T>::BS == 32) {
    z.d = zf_dup2(S.dw[j]);
    if (T == Q4_1) z.m = zf_dup2(S.mw[j]);
  } else {
    z.d = zf_dup2(S.d);
    if (T == Q6_K) z.mn = z_dup2(S.mn[j]);
    else z.m = zf_dup2(S.mnf[j]);
    if (kFloatScale<T>) z.sc = zf_dup2(S.scf[j]);
  }
  return z;
}

// epilogue<T> for a pair p, activation block a: the same float ops per lane
template <int T, class V>
inline zf epilogue2(const ZW& z, const V& Y, int64_t p, int64_t a, zv isum, zf acc) {
  const int64_t i = (p * (Y.K / 32) + a) * 2;
  const zf xd = zf_bcast8(&Y.d[i]);
  if constexpr (Fmt<T>::BS == 32) {
    constexpr int sh = T == Q4_0 ? 3 : T == Q5_0 ? 4 : T == Q8_0 ? 7 : 0;   // off = 8, 16, 128 (w + 128, VNNI)
    if (sh) isum = z32_sub(isum, z32_shl(z_bcast8(&Y.s[i]), sh));
    acc = zf_fma(zf_i32(isum), zf_mul(z.d, xd), acc);
    if (T == Q4_1) acc = zf_fma(z.m, zf_bcast8(&Y.ds[i]), acc);
  } else if constexpr (T == Q6_K) {
    const zv o = z16_pairs(z.mn, z_bcast8(&Y.s16[i]));
    isum = z32_sub(isum, z32_shl(o, 5));
    acc = zf_fma(zf_i32(isum), zf_mul(z.d, xd), acc);
  } else {   // Q4_K, Q5_K: with kFloatScale, isum is the unscaled sum
    const zf u = kFloatScale<T> ? zf_mul(zf_i32(isum), z.sc) : zf_i32(isum);
    acc = zf_fma(u, zf_mul(z.d, xd), acc);
    acc = zf_fnma(z.m, zf_bcast8(&Y.ds[i]), acc);
  }
  return acc;
}

// direct<T> for MP (1..8) pairs of the pass, from Y on, against one group's blocks.
template <int T, int MP, class V>
inline void direct2(const uint8_t* p, int nb, const V& Y, Span& S, zf (&acc)[MP]) {
  constexpr int GBT = 8 * Fmt<T>::TS, VS = kVS<T>;
  const int64_t nq = Y.K / 4;
  const zv zero = z_zero();
  for (int bi = 0; bi < nb; bi++) {
    const int64_t a0 = bi * (Fmt<T>::BS / 32);
    const uint8_t* const line0 = ahead_block<T>(p + bi * GBT);
    const int32_t* x[MP];
    zv isum[MP], part[MP];
    for (int m = 0; m < MP; m++) {
      x[m] = qdata(Y) + (m * nq + Fmt<T>::BS / 4 * bi) * 2;
      isum[m] = part[m] = zero;
    }
    Codec<T>::unpack(p + bi * GBT, 0, S, [&](int v, iv w) {   // scales at 0: used within this block
      ahead_vector<T>(line0, v);
      const zv W = z_dup2(T == Q8_0 ? i_xor(w, i8_set1(0x80)) : w);
      for (int m = 0; m < MP; m++) part[m] = z_dot(v % VS ? part[m] : zero, W, z_bcast8(x[m] + 2 * v));
      if (v % VS == VS - 1 && !kFloatScale<T>) {   // kFloatScale: part goes to the epilogue as it is
        if constexpr (Fmt<T>::BS == 256) {
          const zv sc = z_dup2(S.sc32[v / VS]);
          for (int m = 0; m < MP; m++) isum[m] = z32_add(isum[m], z32_mul(part[m], sc));
        } else {
          for (int m = 0; m < MP; m++) isum[m] = z32_add(isum[m], part[m]);
        }
      }
      if (v % 8 == 7) {
        const int j = Fmt<T>::BS == 32 ? 0 : v / 8;
        const ZW z = zweights<T>(S, j);
        for (int m = 0; m < MP; m++) {
          acc[m] = epilogue2<T>(z, Y, m, a0 + v / 8, kFloatScale<T> ? part[m] : isum[m], acc[m]);
          isum[m] = zero;
        }
      }
    });
  }
}

// pairs p0 .. p0 + MP - 1 of the pass's M rows against the group of output columns n0 .. n0 + 7, into y
template <int T, int MP>
void direct2_rows(const uint8_t* p, int64_t nblk, const XP& Y, int64_t p0, Span& S, int64_t M, int64_t n0, int64_t N,
                  float* y, int64_t ldy) {
  zf acc[MP];
  for (int m = 0; m < MP; m++) acc[m] = zf_zero();
  // the first 8 pairs indexed on XP itself: through the pointer view a pass of 16 rows ran ~5% slower
  if (p0 == 0) direct2<T, MP>(p, (int)nblk, Y, S, acc);
  else direct2<T, MP>(p, (int)nblk, pairs_from(Y, p0), S, acc);
  // lanes 2r + h hold column n0 + r of row 2 (p0 + m) + h: one permute makes them two rows of 8, each one store
  // (masked in a short last group), where element-wise stores cost the small passes several percent
  const bool whole = N - n0 >= 8;
  auto put = [&](int64_t row, fv v) {
    if (whole) f8_st(y + row * ldy + n0, v);
    else f8_st_n(y + row * ldy + n0, (int)(N - n0), v);
  };
  for (int m = 0; m < MP; m++) {
    fv even, odd;
    zf_unzip(acc[m], &even, &odd);
    const int64_t row = 2 * (p0 + m);
    put(row, even);
    if (row + 1 < M) put(row + 1, odd);
  }
}

// 1-2 pairs (2-4 rows), or more than 8 (17 rows or more: long trees, prefill) against one group, 8 pairs per
// unpacking, the group's blocks from L1 after the first: 1.2-1.5x the 256-bit tiles at 17-512 rows (bench.qdot_ab).
template <int T>
void pairs_rows(const uint8_t* p, int64_t nblk, const XP& Y, Span& S, int64_t M, int64_t n0, int64_t N, float* y,
                int64_t ldy) {
  for (int64_t p0 = 0; p0 < Y.P; p0 += 8) {
    switch (Y.P - p0 < 8 ? Y.P - p0 : 8) {
      case 1: direct2_rows<T, 1>(p, nblk, Y, p0, S, M, n0, N, y, ldy); break;
      case 2: direct2_rows<T, 2>(p, nblk, Y, p0, S, M, n0, N, y, ldy); break;
      case 3: direct2_rows<T, 3>(p, nblk, Y, p0, S, M, n0, N, y, ldy); break;
      case 4: direct2_rows<T, 4>(p, nblk, Y, p0, S, M, n0, N, y, ldy); break;
      case 5: direct2_rows<T, 5>(p, nblk, Y, p0, S, M, n0, N, y, ldy); break;
      case 6: direct2_rows<T, 6>(p, nblk, Y, p0, S, M, n0, N, y, ldy); break;
      case 7: direct2_rows<T, 7>(p, nblk, Y, p0, S, M, n0, N, y, ldy); break;
      default: direct2_rows<T, 8>(p, nblk, Y, p0, S, M, n0, N, y, ldy); break;
    }
  }
}
#endif


// w: packed (swk_qi_repack). Tiles of 2 groups of 8 rows over the pool's threads; a last group of fewer rows is
// packed here, its missing rows copies of its last one.
template <int T>
void linear_simd(const QX& X, const uint8_t* w, int64_t N, float* y, int64_t ldy) {
  constexpr int BS = Fmt<T>::BS, TS = Fmt<T>::TS, GBT = 8 * TS;
  [[maybe_unused]] constexpr int SPAN = BS == 32 ? 8 : 1;   // blocks per decoded span: 256 elements of each row
  const int64_t K = X.K, M = X.M, rb = K / BS * TS, nblk = K / BS, full = N / 8, ng = (N + 7) / 8;
  [[maybe_unused]] const int64_t nt = (ng + 1) / 2;
  thread_local std::vector<uint8_t> tail;
  if (ng > full) {
    std::vector<uint8_t> rows_copy((size_t)(8 * rb));
    uint8_t* rows[8];
    for (int r = 0; r < 8; r++) {
      rows[r] = rows_copy.data() + r * rb;
      memcpy(rows[r], w + (8 * full + (8 * full + r < N ? r : N - 1 - 8 * full)) * rb, (size_t)rb);
    }
    tail.resize((size_t)(8 * rb));
    group_permute<T, true>(tail.data(), rows, nblk);
  }
  const uint8_t* tailp = tail.data();
  auto group = [&](int64_t g) { return g < full ? w + 8 * g * rb : tailp; };
#if SWI_V512
  // every pass of 2 rows or more, every format: up to 8 pairs of rows per unpacking of a group (1.2-1.4x the tiles
  // at 8-16 rows; at 4 rows 1.2x the 8-lane products on Q4_1, Q4_K and Q6_K, 1.06x on Q5_0: bench.qdot_ab; in
  // Qwen2.5-Coder-1.5B's pass of 2 tokens 1.12x), longer passes 8 pairs at a time. A decode step stays 8-lane
  if (M >= 2) {
    thread_local XP pairs;
    pair_rows(X, pairs);
    const XP& Y = pairs;   // the caller's (a thread_local named inside the parallel loop is each thread's own)
    swk_pool::parallel_for(ng, ng > 1 && N * K >= 65536 ? swk_pool::threads() : 1, [&](int64_t g, int) {
      Span S;
      switch (Y.P) {   // 5..16 rows: one unpacking of 3 to 8 pairs (in pairs_rows' loop, 8 rows ran ~4% slower);
                       // 2-4 rows and 17 or more: pairs_rows
        case 3: direct2_rows<T, 3>(group(g), nblk, Y, 0, S, M, 8 * g, N, y, ldy); break;
        case 4: direct2_rows<T, 4>(group(g), nblk, Y, 0, S, M, 8 * g, N, y, ldy); break;
        case 5: direct2_rows<T, 5>(group(g), nblk, Y, 0, S, M, 8 * g, N, y, ldy); break;
        case 6: direct2_rows<T, 6>(group(g), nblk, Y, 0, S, M, 8 * g, N, y, ldy); break;
        case 7: direct2_rows<T, 7>(group(g), nblk, Y, 0, S, M, 8 * g, N, y, ldy); break;
        case 8: direct2_rows<T, 8>(group(g), nblk, Y, 0, S, M, 8 * g, N, y, ldy); break;
        default: pairs_rows<T>(group(g), nblk, Y, S, M, 8 * g, N, y, ldy); break;
      }
    });
    if (pairs.q.size() > (1u << 20)) pairs = XP();   // a prefill's copy is not kept past its call
    return;
  }
#endif
  if (M <= kDirectMax<T>) {   // a decode step: each group's blocks straight from memory into the products
    swk_pool::parallel_for(ng, ng > 1 && N * K >= 65536 ? swk_pool::threads() : 1, [&](int64_t g, int) {
      Span S;
      alignas(32) float out[4 * 8];
      for (int64_t m0 = 0; m0 < M; m0 += 4) {   // rows 4 at a time: the group's blocks are in L1 after the first
        const int mt = (int)(M - m0 < 4 ? M - m0 : 4);
#if SWI_V512
        direct_rows<T, 1>(group(g), nblk, X, m0, S, out);   // M == 1 here: larger passes took the pairs
#else
        switch (mt) {
          case 1: direct_rows<T, 1>(group(g), nblk, X, m0, S, out); break;
          case 2: direct_rows<T, 2>(group(g), nblk, X, m0, S, out); break;
          case 3: direct_rows<T, 3>(group(g), nblk, X, m0, S, out); break;
          default: direct_rows<T, 4>(group(g), nblk, X, m0, S, out); break;
        }
#endif
        for (int m = 0; m < mt; m++)
          for (int r = 0; r < 8 && 8 * g + r < N; r++) y[(m0 + m) * ldy + 8 * g + r] = out[8 * m + r];
      }
    });
    return;
  }
#if !SWI_V512   // unreachable there (every pass of 2 rows or more took the pairs): not compiled, which halves the
                // K formats' compile time
  // each thread's accumulators, allocated here: an exception must not leave a parallel region (std::terminate)
  thread_local std::vector<float> accv;
  const int64_t per = 2 * M * 8;
  const int nth = nt > 1 && N * K >= 65536 ? swk_pool::threads() : 1;
  accv.resize((size_t)(per * nth));
  float* const accs = accv.data();   // the caller's: a thread_local named inside the region is each thread's own
  swk_pool::parallel_range(nt, nth, [&](int64_t t0, int64_t t1, int tid) {
    Span S[2];
    for (int64_t t = t0; t < t1; t++) {   // a tile: groups 2t and 2t + 1 (the last may be alone)
      const int NG = 2 * t + 1 < ng ? 2 : 1;
      const int64_t n0 = 16 * t;
      float* acc = accs + per * tid;
      memset(acc, 0, sizeof(float) * 8 * NG * M);
      for (int64_t b0 = 0; b0 < nblk; b0 += SPAN) {
        const int nb = (int)(nblk - b0 < SPAN ? nblk - b0 : SPAN);
        // the next tiles' span into L2 ahead of its use: 2 tiles, 32 rows (measured better than 1 or 4)
        for (int64_t g = 2 * t + 4; g < 2 * t + 6 && g < full; g++)
          for (int o = 0; o < nb * GBT; o += 64) __builtin_prefetch(group(g) + b0 * GBT + o, 0, 2);
        for (int g = 0; g < NG; g++) decode<T>(group(2 * t + g) + b0 * GBT, nb, S[g]);
        if (NG == 2) span_rows<T, 2>(S, nb, X, b0, acc);
        else span_rows<T, 1>(S, nb, X, b0, acc);
      }
      for (int g = 0; g < NG; g++)
        for (int64_t m = 0; m < M; m++)
          for (int r = 0; r < 8 && n0 + 8 * g + r < N; r++) y[m * ldy + n0 + 8 * g + r] = acc[8 * (g * M + m) + r];
    }
  });
  if (accv.size() > (1u << 16)) std::vector<float>().swap(accv);
#endif
  if (tail.size() > (1u << 16)) std::vector<uint8_t>().swap(tail);
}
#endif

template <int T>
void linear(const QX& X, const uint8_t* w, int64_t N, float* y, int64_t ldy, bool ref) {
#if SWI_SIMD
  if (!ref) return linear_simd<T>(X, w, N, y, ldy);
#endif
  (void)ref;
  // the scalar path reads the file's layout: unpack the packed rows first
  std::vector<uint8_t> plain;
  const int64_t rb = X.K / Fmt<T>::BS * Fmt<T>::TS;
  plain.resize((size_t)(N * rb));
  std::vector<int64_t> ids((size_t)N);
  for (int64_t i = 0; i < N; i++) ids[i] = i;
  unpack_rows<T>(w, N, X.K, ids.data(), N, plain.data());
  linear_ref<T>(X, plain.data(), N, y, ldy);
}

// Q4_K and Q5_K, the codec both family files use (cpu_qdot_q4k.cpp, cpu_qdot_q5k.cpp): a superblock of 256 weights
// in 8 sub-blocks of 32, 4-bit quants q (Q5_K: a fifth bit per weight in 32 bytes qh, bit s of byte l for element l
// of sub-block s), per sub-block a 6-bit scale sc and min mn (swk_gguf::k_scale_min), float16 d and dmin:
// w = d sc q - dmin mn. Packed: d, dmin, the scale bytes, [qh,] the 128 quant bytes of the 8 rows.
template <int T>
struct KCodec45 {
  static constexpr bool kHigh = T == Q5_K;
  static constexpr int kQs = kHigh ? 48 : 16;      // the quants' offset in the file's block
  static constexpr int kQsPacked = kHigh ? 384 : 128;   // and in a packed group's block

  SWK_QDOT_SCALAR static float ref_block(const uint8_t* blk, const QX& X, int64_t m, int64_t b, float acc) {
    const int8_t* x = X.q.data() + m * X.K + 256 * b;
    const int64_t i0 = m * (X.K / 32) + 8 * b;   // the superblock's first activation block
    uint8_t sc[8], mn[8];
    k_scale_min(blk + 4, sc, mn);
    const float d = h2f(blk), dmin = h2f(blk + 2);
    for (int s = 0; s < 8; s++) {   // sub-blocks 2k and 2k + 1: the low and high nibbles of 32 bytes
      int32_t u = 0;
      for (int l = 0; l < 32; l++) {
        int q = (blk[kQs + 32 * (s / 2) + l] >> (4 * (s & 1))) & 15;
        if (kHigh) q |= ((blk[16 + l] >> s) & 1) << 4;
        u += q * x[32 * s + l];
      }
      acc = fmaf((float)(sc[s] * u), d * X.d[i0 + s], acc);
      acc = fmaf(-(dmin * (float)mn[s]), X.ds[i0 + s], acc);   // dmin * mn is exact (11 x 6 bits)
    }
    return acc;
  }

#if SWI_SIMD
  template <class P>
  static inline void unpack(const uint8_t* p, int, Span& S, P&& put) {
    S.d = f8_f16(p);
    S.dm = f8_f16(p + 16);
    unpack_k_scales(p + 32, S);
#pragma GCC unroll 16
    for (int pr = 0; pr < 4; pr++)   // sub-blocks 2 pr (low nibbles) and 2 pr + 1 (high) share 32 bytes per row
#pragma GCC unroll 16
      for (int h = 0; h < 2; h++) {
        const uint8_t* q = fresh(p + kQsPacked + 256 * pr);   // read again for the high nibbles (fresh: why)
        [[maybe_unused]] const uint8_t* qh = fresh(p + 128);
#pragma GCC unroll 16
        for (int c = 0; c < 8; c++) {
          iv w = h ? i8_hi4(i_ld(q + 32 * c)) : i8_lo4(i_ld(q + 32 * c));
          if (kHigh) w = i_or(w, i8_bit_to4(i_ld(qh + 32 * c), 2 * pr + h));   // the fifth bits
          put(16 * pr + 8 * h + c, w);
        }
      }
  }
#endif
};

// The formats' heavy templates are instantiated once each, in their family's file (SWK_QDOT_FAMILY below)
#define SWK_QDOT_TEMPLATES(T, EXT)                                                                    \
  EXT template void linear<T>(const QX&, const uint8_t*, int64_t, float*, int64_t, bool);               \
  EXT template void linear_ref<T>(const QX&, const uint8_t*, int64_t, float*, int64_t);                 \
  EXT template void repack<T>(const uint8_t*, int64_t, int64_t, uint8_t*);                              \
  EXT template void unpack_rows<T>(const uint8_t*, int64_t, int64_t, const int64_t*, int64_t, uint8_t*);
#define SWK_QDOT_EXTERN(T) SWK_QDOT_TEMPLATES(T, extern)
SWK_QDOT_EXTERN(Q4_0) SWK_QDOT_EXTERN(Q4_1) SWK_QDOT_EXTERN(Q5_0) SWK_QDOT_EXTERN(Q8_0)
SWK_QDOT_EXTERN(Q4_K) SWK_QDOT_EXTERN(Q5_K) SWK_QDOT_EXTERN(Q6_K)
#define SWK_QDOT_FAMILY(T) SWK_QDOT_TEMPLATES(T, )

}  // namespace swk_qdot
