// The vector layer the CPU kernel files are written in; they hold no intrinsics of their own. Two parts:
// - float vectors (cpu_linear.cpp, cpu_decode.cpp, cpu_topk.cpp, cpu_quant.cpp): one type `vec` and its ops, for
//   AVX-512 (F/BW/VL), AVX2+FMA, or portable C++ over an 8-float struct, picked by the -march macros at build time,
//   with the 16-byte integer ops (b16) cpu_quant.cpp's block decoders widen to floats;
// - integer vectors (the int8 block kernels, cpu_qdot*.cpp; cpu_quant.cpp's block decoders): bytes, int16 and
//   int32 lanes of 256 bits and the integer dot products (at the end of this file), with 512-bit pairs under
//   AVX-512 VNNI. Without AVX2+FMA+F16C those kernels run their scalar definitions instead.
//
// vsum is one fixed lane order per ISA: kernels reduce their vector partial sums with it, so a row's result does not
// depend on the tiling, the rows beside it or the thread count (batch invariance).
#pragma once

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_gguf.h"   // h2f / f2h: float16's scalar conversions

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SWK_ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#define SWK_ISA 256
#else
#define SWK_ISA 0
#endif

#if SWK_ISA
#include <immintrin.h>
#endif

#if SWK_ISA == 512
#define SWK_W 16
typedef __m512 vec;
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vset1(float a) { return _mm512_set1_ps(a); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
static inline vec vld(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vld_tail(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline void vst(float* p, vec v) { _mm512_storeu_ps(p, v); }
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
static inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
static inline vec vfnma(vec a, vec b, vec c) { return _mm512_fnmadd_ps(a, b, c); }   // c - a * b
static inline vec vfloor(vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
// y * 2^n for integral n in (-127, 128), exactly: n's float32 exponent built in the integer unit
static inline vec vldexp(vec y, vec n) {
  return _mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n),
                                                                                    _mm512_set1_epi32(127)), 23)));
}
static inline vec vld_bf16(const void* p) {   // 16 bfloat16 -> float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline vec vld_i8(const void* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
static inline vec vld_bf16_tail(const void* p, int n) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p)), 16));
}
static inline vec vld_i8_tail(const void* p, int n) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8((__mmask16)((1u << n) - 1), p)));
}
// bit j set where lane j > t or is NaN
static inline unsigned vmask_gt_or_nan(vec v, float t) {
  return (unsigned)(_mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_GT_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q));
}

// 16 horizontal sums at once: a shuffle tree over 16 accumulators (28 shuffles, 15 adds) in place of 16 separate
// reductions (~64 shuffles), pairing lanes as vsum does (halves of 256, of 128, lanes j and j + 2, then 0 and 1),
// so every sum is bitwise the one vsum gives: batch invariance holds across tile shapes.
// Lane 4b + t of the result is the sum of in[b + 4t].
static inline vec hsum16(const vec (&in)[16]) {
  vec t[8], u[4], x[2];
  for (int p = 0; p < 8; p++)   // 256-bit halves: blocks 0-1 <- in[2p], blocks 2-3 <- in[2p + 1]
    t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(in[2 * p], in[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(in[2 * p], in[2 * p + 1], 0xEE));
  for (int q = 0; q < 4; q++)   // 128-bit halves: block b <- in[4q + b]
    u[q] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0xDD));
  for (int s = 0; s < 2; s++)   // lanes j and j + 2 within each block
    x[s] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * s], u[2 * s + 1]), _mm512_unpackhi_ps(u[2 * s], u[2 * s + 1]));
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x[0]), _mm512_castps_pd(x[1]))),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x[0]), _mm512_castps_pd(x[1]))));
}
// 512-bit only: lane masks of visible keys and the ops on them, and 4 x 4 tiles stored a quarter per row
typedef __mmask16 vmask;
static inline vmask vmask_bytes(const uint8_t* p) {   // lane j: byte j of p[0, 16) nonzero
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return _mm_test_epi8_mask(b, b);
}
static inline vmask vmask_bytes2(const uint8_t* a, const uint8_t* b) {   // lanes 0-7: a[0, 8), 8-15: b[0, 8)
  int64_t a8, b8;
  memcpy(&a8, a, 8);
  memcpy(&b8, b, 8);
  const __m128i v = _mm_set_epi64x(b8, a8);
  return _mm_test_epi8_mask(v, v);
}
static inline void vst_mask(float* p, vmask m, vec v) { _mm512_mask_storeu_ps(p, m, v); }
static inline void vst_lo8_mask(float* p, vmask m, vec v) { _mm256_mask_storeu_ps(p, (__mmask8)m, _mm512_castps512_ps256(v)); }
static inline void vst_hi8_mask(float* p, vmask m, vec v) {
  _mm256_mask_storeu_ps(p, (__mmask8)(m >> 8), _mm512_castps512_ps256(_mm512_shuffle_f32x4(v, v, 0xEE)));
}
static inline vec vmax_mask(vec acc, vmask m, vec v) { return _mm512_mask_max_ps(acc, m, acc, v); }
static inline float vmax_all(vec v) { return _mm512_reduce_max_ps(v); }
static inline vec vbcast4(const float* p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }   // p[0..4) x 4
static inline void vst_quarters(float* y, int64_t ld, vec v) {   // lanes 4i .. 4i + 3 to y + i * ld
  _mm_storeu_ps(y, _mm512_extractf32x4_ps(v, 0));
  _mm_storeu_ps(y + ld, _mm512_extractf32x4_ps(v, 1));
  _mm_storeu_ps(y + 2 * ld, _mm512_extractf32x4_ps(v, 2));
  _mm_storeu_ps(y + 3 * ld, _mm512_extractf32x4_ps(v, 3));
}
#elif SWK_ISA == 256
#define SWK_W 8
typedef __m256 vec;
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vset1(float a) { return _mm256_set1_ps(a); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
static inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
static inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
static inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
static inline vec vld(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vld_tail(const float* p, int n) {
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
static inline void vst(float* p, vec v) { _mm256_storeu_ps(p, v); }
static inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
static inline vec vfnma(vec a, vec b, vec c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vec vfloor(vec a) { return _mm256_floor_ps(a); }
static inline vec vldexp(vec y, vec n) {
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                                                    _mm256_set1_epi32(127)), 23)));
}
static inline vec vld_bf16(const void* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline vec vld_i8(const void* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
static inline unsigned vmask_gt_or_nan(vec v, float t) {
  return (unsigned)_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v, _mm256_set1_ps(t), _CMP_GT_OQ),
                                                   _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
// Lane j = vsum(a[j]), bitwise: the same pairings in the same order (lanes i and i + 4, then i and i + 2, then 0
// and 1), done for 8 vectors at once.
static inline vec hsum8(const vec (&a)[8]) {
  vec b[4], c[2];
  for (int p = 0; p < 4; p++)   // b[p] = [a[p] lo + hi | a[p + 4] lo + hi]
    b[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[p], a[p + 4], 0x20), _mm256_permute2f128_ps(a[p], a[p + 4], 0x31));
  for (int p = 0; p < 2; p++)   // lanes i and i + 2 of b[2p] and b[2p + 1]
    c[p] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * p], b[2 * p + 1], 0x44), _mm256_shuffle_ps(b[2 * p], b[2 * p + 1], 0xEE));
  return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], 0x88), _mm256_shuffle_ps(c[0], c[1], 0xDD));
}
#else
#define SWK_W 8
struct vec { float v[8]; };
static inline vec vzero() { return vec{}; }
static inline vec vset1(float a) { vec r; for (int i = 0; i < 8; i++) r.v[i] = a; return r; }
static inline vec vfma(vec a, vec b, vec c) {
  for (int i = 0; i < 8; i++) c.v[i] += a.v[i] * b.v[i];
  return c;
}
static inline vec vmul(vec a, vec b) { for (int i = 0; i < 8; i++) a.v[i] *= b.v[i]; return a; }
static inline vec vadd(vec a, vec b) { for (int i = 0; i < 8; i++) a.v[i] += b.v[i]; return a; }
static inline vec vsub(vec a, vec b) { for (int i = 0; i < 8; i++) a.v[i] -= b.v[i]; return a; }
static inline vec vdiv(vec a, vec b) { for (int i = 0; i < 8; i++) a.v[i] /= b.v[i]; return a; }
static inline vec vld(const float* p) { vec r; memcpy(r.v, p, sizeof r.v); return r; }
static inline vec vld_tail(const float* p, int n) { vec r{}; memcpy(r.v, p, n * sizeof(float)); return r; }
static inline void vst(float* p, vec v) { memcpy(p, v.v, sizeof v.v); }
static inline float vsum(vec v) {
  float s = 0.0f;
  for (int i = 0; i < 8; i++) s += v.v[i];
  return s;
}
static inline vec vmin(vec a, vec b) { for (int i = 0; i < 8; i++) a.v[i] = b.v[i] < a.v[i] ? b.v[i] : a.v[i]; return a; }
static inline vec vmax(vec a, vec b) { for (int i = 0; i < 8; i++) a.v[i] = b.v[i] > a.v[i] ? b.v[i] : a.v[i]; return a; }
static inline vec vfnma(vec a, vec b, vec c) { for (int i = 0; i < 8; i++) c.v[i] -= a.v[i] * b.v[i]; return c; }
static inline vec vfloor(vec a) { for (int i = 0; i < 8; i++) a.v[i] = floorf(a.v[i]); return a; }
static inline vec vldexp(vec y, vec n) {
  for (int i = 0; i < 8; i++) {
    const uint32_t b = (uint32_t)((int32_t)n.v[i] + 127) << 23;
    float s;
    memcpy(&s, &b, 4);
    y.v[i] *= s;
  }
  return y;
}
static inline vec vld_bf16(const void* p) {
  vec r;
  for (int i = 0; i < 8; i++) {
    uint16_t h;
    memcpy(&h, (const uint8_t*)p + 2 * i, 2);
    const uint32_t b = (uint32_t)h << 16;
    memcpy(&r.v[i], &b, 4);
  }
  return r;
}
static inline vec vld_i8(const void* p) { vec r; for (int i = 0; i < 8; i++) r.v[i] = (float)((const int8_t*)p)[i]; return r; }
static inline unsigned vmask_gt_or_nan(vec v, float t) {
  unsigned m = 0;
  for (int i = 0; i < 8; i++) m |= (unsigned)(v.v[i] > t || v.v[i] != v.v[i]) << i;
  return m;
}
static inline vec hsum8(const vec (&a)[8]) { vec r; for (int j = 0; j < 8; j++) r.v[j] = vsum(a[j]); return r; }
#endif

#if SWK_W == 8
// The last n < 8 weights of a row (rare: K % 8 != 0), widened through a zero-padded copy
static inline vec vld_bf16_tail(const void* p, int n) {
  alignas(32) uint8_t buf[16] = {0};
  memcpy(buf, p, 2 * (size_t)n);
  return vld_bf16(buf);
}
static inline vec vld_i8_tail(const void* p, int n) {
  alignas(32) uint8_t buf[8] = {0};
  memcpy(buf, p, (size_t)n);
  return vld_i8(buf);
}
#endif

// ---- float16 rows (the KV cache's 16-bit format): SWK_W halves widened to a vec, exactly ---------------------------
#if SWK_ISA == 512
static inline vec vld_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
#elif SWK_ISA == 256 && defined(__F16C__)
static inline vec vld_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
#else
static inline vec vld_h(const uint16_t* p) {
  alignas(64) float b[SWK_W];
  for (int i = 0; i < SWK_W; i++) b[i] = swk_gguf::h2f((const uint8_t*)(p + i));
  return vld(b);
}
#endif
// n floats stored as float16 bits, rounded to nearest even (8 at a time where F16C has an instruction for it)
static inline void vst_h_row(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < n; i++) dst[i] = swk_gguf::f2h(src[i]);
}

// ---- 16-byte integer vectors: cpu_quant.cpp's block decoders (float activations) -----------------------------------
#if SWK_ISA
typedef __m128i b16;
static inline b16 ld16(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
static inline b16 nib(b16 v, int hi) { return _mm_and_si128(hi ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(0x0F)); }
static inline b16 bor(b16 a, b16 b) { return _mm_or_si128(a, b); }
static inline b16 bsub(b16 a, int k) { return _mm_sub_epi8(a, _mm_set1_epi8((char)k)); }
// byte j = 0x10 where bit j of `bits` (16 bits) is set: Q5_0's fifth bit
static inline b16 bit16(uint32_t bits) {
#if SWK_ISA == 512
  return _mm_maskz_mov_epi8((__mmask16)bits, _mm_set1_epi8(0x10));
#else
  const b16 sel = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  b16 v = _mm_shuffle_epi8(_mm_set1_epi16((short)bits), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, sel), sel), _mm_set1_epi8(0x10));
#endif
}
// byte j = 0x10 where bit c of v[j] is set: Q5_K's fifth bit
static inline b16 bit_at(b16 v, int c) {
  const b16 sel = _mm_set1_epi8((char)(1 << c));
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(v, sel), sel), _mm_set1_epi8(0x10));
}
// byte j = ((v[j] >> s) & 3) << 4: Q6_K's two high bits
static inline b16 two_at(b16 v, int s) {
  return _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(v, s), _mm_set1_epi8(3)), 4);
}
#else
struct b16 { uint8_t v[16]; };
static inline b16 ld16(const uint8_t* p) { b16 r; memcpy(r.v, p, 16); return r; }
static inline b16 nib(b16 a, int hi) {
  for (int i = 0; i < 16; i++) a.v[i] = (uint8_t)((a.v[i] >> (hi ? 4 : 0)) & 0x0F);
  return a;
}
static inline b16 bor(b16 a, b16 b) {
  for (int i = 0; i < 16; i++) a.v[i] |= b.v[i];
  return a;
}
static inline b16 bsub(b16 a, int k) {
  for (int i = 0; i < 16; i++) a.v[i] = (uint8_t)(a.v[i] - k);
  return a;
}
static inline b16 bit16(uint32_t bits) {
  b16 r;
  for (int i = 0; i < 16; i++) r.v[i] = (uint8_t)(((bits >> i) & 1) << 4);
  return r;
}
static inline b16 bit_at(b16 a, int c) {
  for (int i = 0; i < 16; i++) a.v[i] = (uint8_t)(((a.v[i] >> c) & 1) << 4);
  return a;
}
static inline b16 two_at(b16 a, int s) {
  for (int i = 0; i < 16; i++) a.v[i] = (uint8_t)(((a.v[i] >> s) & 3) << 4);
  return a;
}
#endif

// 32 signed bytes (lo: 0-15, hi: 16-31) as 32 / SWK_W float vectors, in order
static inline void vcvt_i8x32(b16 lo, b16 hi, vec (&out)[32 / SWK_W]) {
#if SWK_ISA == 512
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
#elif SWK_ISA == 256
  const b16 q[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
  for (int i = 0; i < 4; i++) out[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q[i]));
#else
  for (int i = 0; i < 32; i++) out[i / 8].v[i % 8] = (float)(int8_t)(i < 16 ? lo.v[i] : hi.v[i - 16]);
#endif
}
// out[i] = a * (byte i of v as unsigned), i < 8 (one rounding each, as a scalar loop)
static inline void scale_u8x8(uint64_t v, float a, float* out) {
#if SWK_ISA
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(a),
                                      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v)))));
#else
  for (int i = 0; i < 8; i++) out[i] = a * (float)(uint8_t)(v >> (8 * i));
#endif
}
// out[i] = a * p[i] (p: 16 signed bytes)
static inline void scale_i8x16(const void* p, float a, float* out) {
#if SWK_ISA
  const __m128i v = _mm_loadu_si128((const __m128i*)p);
  const __m256 av = _mm256_set1_ps(a);
  _mm256_storeu_ps(out, _mm256_mul_ps(av, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(av, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
#else
  for (int i = 0; i < 16; i++) out[i] = a * (float)((const int8_t*)p)[i];
#endif
}

#if SWK_ISA == 512
// AVX-512 only: 4-bit codes as table indices. A vidx's 16 int32 lanes index a 16-float table; vpermps reads only
// each index's low 4 bits.
typedef __m512i vidx;
static inline vidx vidx_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline vidx vidx_shr(vidx i, int n) { return _mm512_srli_epi32(i, n); }
// lanes 4k .. 4k + 3: the 16 bytes at p + o[k] (as 4 lanes of 4 bytes)
static inline vidx vidx_bytes4x16(const uint8_t* p, int o0, int o1, int o2, int o3) {
  auto q = [&](int o) { return _mm_loadu_si128((const __m128i*)(p + o)); };
  return _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(q(o0)), q(o1), 1), q(o2), 2),
                            q(o3), 3);
}
static inline vec viota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline vec viota(float base) { return _mm512_add_ps(viota(), _mm512_set1_ps(base)); }   // base + 0..15
static inline vec vlookup(vidx i, vec table) { return _mm512_permutexvar_ps(i, table); }
// lane j: hi[i_j] where bit j of `high` is set, else lo[i_j]
static inline vec vlookup2(vidx i, vec lo, vec hi, uint32_t high) {
  return _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(i, lo), (__mmask16)high, i, hi);
}
// lanes 4k .. 4k + 3 = a[2k + odd], k < 4 (a: 8 floats)
static inline vec vspread4(const float* a, int odd) {
  const __m512 a16 = _mm512_castps256_ps512(_mm256_loadu_ps(a));
  return odd ? _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7), a16)
             : _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), a16);
}
// bit j = bit c of p[j], j < 32
static inline uint32_t bits_at32(const uint8_t* p, int c) {
  return (uint32_t)_mm256_test_epi8_mask(_mm256_loadu_si256((const __m256i*)p), _mm256_set1_epi8((char)(1 << c)));
}
#endif

// exp on a vector (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp like torch's vectorized
// exp). Written out because the compiler vectorizes no libm call under strict IEEE flags, and scalar expf over
// the SwiGLU activations and attention scores cost several ms per verify pass.
static inline vec vexp(vec x) {
  x = vmin(vmax(x, vset1(-87.3f)), vset1(88.3f));
  const vec fx = vfloor(vfma(x, vset1(1.44269504088896341f), vset1(0.5f)));
  x = vfnma(fx, vset1(0.693359375f), x);
  x = vfnma(fx, vset1(-2.12194440e-4f), x);
  vec y = vset1(1.9875691500E-4f);
  y = vfma(y, x, vset1(1.3981999507E-3f));
  y = vfma(y, x, vset1(8.3334519073E-3f));
  y = vfma(y, x, vset1(4.1665795894E-2f));
  y = vfma(y, x, vset1(1.6666665459E-1f));
  y = vfma(y, x, vset1(5.0000001201E-1f));
  y = vfma(y, vmul(x, x), vadd(x, vset1(1.0f)));
  return vldexp(y, fx);
}

// ---- integer vectors -----------------------------------------------------------------------------------------------
// 256-bit vectors whatever SWK_ISA is: the block kernels' lanes are 8 weight rows of 32 bits (iv: as bytes, int16 or
// int32; fv: 8 floats). SWI_VNNI: vpdpbusd on 256-bit vectors (AVX-512 VNNI + VL, or AVX-VNNI). SWI_V512: AVX-512
// VNNI's 512-bit vectors (zv, zf), whose lanes are 8 weight rows x 2 activation rows.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SWI_SIMD 1
#include <immintrin.h>
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SWI_VNNI 1
#elif defined(__AVXVNNI__)
#define SWI_VNNI 1
#else
#define SWI_VNNI 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SWI_V512 1
#else
#define SWI_V512 0
#endif
#else
#define SWI_SIMD 0
#define SWI_VNNI 0
#define SWI_V512 0
#endif

// p, as far as the compiler knows, another pointer: loads through it are issued where they are written instead of
// kept in registers from an earlier load of the same bytes. A K-format decode that reads a block's bytes twice
// (Q4_K's low and high nibbles, Q6_K's high bits) then reloads them from L1, where GCC 12 held 8 of the 16 AVX2
// registers and spilled the rows' sums of a 4-row pass instead (passes of 4-16 rows 1.15-1.19x faster on Qwen-1.5B's
// shapes, Zen 3). With AVX-512 (32 registers; passes of 2 rows or more take the pairs) it is p itself.
template <class T>
static inline T* fresh(T* p) {
#if !SWI_V512
  __asm__("" : "+r"(p));
#endif
  return p;
}

#if SWI_SIMD
typedef __m256i iv;
typedef __m256 fv;
static inline iv i_zero() { return _mm256_setzero_si256(); }
static inline iv i8_set1(int v) { return _mm256_set1_epi8((char)v); }
static inline iv i16_set1(int v) { return _mm256_set1_epi16((short)v); }
static inline iv i32_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline iv i32_bcast(const void* p) {   // the 4 bytes at p in every 32-bit lane
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
static inline iv i_ld(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline iv i_lda(const void* p) { return _mm256_load_si256((const __m256i*)p); }   // 32-byte aligned
static inline iv i_and(iv a, iv b) { return _mm256_and_si256(a, b); }
static inline iv i_or(iv a, iv b) { return _mm256_or_si256(a, b); }
static inline iv i_xor(iv a, iv b) { return _mm256_xor_si256(a, b); }
static inline iv i16_shr(iv a, int n) { return _mm256_srli_epi16(a, n); }   // logical
static inline iv i16_shl(iv a, int n) { return _mm256_slli_epi16(a, n); }
static inline iv i16_sar(iv a, int n) { return _mm256_srai_epi16(a, n); }   // arithmetic
static inline iv i32_shr(iv a, int n) { return _mm256_srli_epi32(a, n); }
static inline iv i32_shl(iv a, int n) { return _mm256_slli_epi32(a, n); }
static inline iv i32_sar(iv a, int n) { return _mm256_srai_epi32(a, n); }
static inline iv i16_add(iv a, iv b) { return _mm256_add_epi16(a, b); }
static inline iv i32_add(iv a, iv b) { return _mm256_add_epi32(a, b); }
static inline iv i32_sub(iv a, iv b) { return _mm256_sub_epi32(a, b); }
static inline iv i32_mul(iv a, iv b) { return _mm256_mullo_epi32(a, b); }
static inline iv i8_sub(iv a, iv b) { return _mm256_sub_epi8(a, b); }
static inline void i_halves(iv v, b16* lo, b16* hi) { *lo = _mm256_castsi256_si128(v), *hi = _mm256_extracti128_si256(v, 1); }
static inline iv i8_abs(iv a) { return _mm256_abs_epi8(a); }
static inline iv i8_sign(iv a, iv b) { return _mm256_sign_epi8(a, b); }   // a negated where b < 0, zero where b == 0
static inline iv i8_lo4(iv v) { return _mm256_and_si256(v, i8_set1(0x0F)); }   // each byte's low nibble
static inline iv i8_hi4(iv v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), i8_set1(0x0F)); }
// per 32-bit lane, its bytes 0-3 moved to positions (a, b, c, d): k < 0 leaves a zero byte
static inline iv i8_pick(iv v, int a, int b, int c, int d) {
  auto at = [](int k, int L) { return (char)(k < 0 ? -128 : 4 * L + k); };
  const iv ctl = _mm256_setr_epi8(
      at(a, 0), at(b, 0), at(c, 0), at(d, 0), at(a, 1), at(b, 1), at(c, 1), at(d, 1), at(a, 2), at(b, 2), at(c, 2),
      at(d, 2), at(a, 3), at(b, 3), at(c, 3), at(d, 3), at(a, 0), at(b, 0), at(c, 0), at(d, 0), at(a, 1), at(b, 1),
      at(c, 1), at(d, 1), at(a, 2), at(b, 2), at(c, 2), at(d, 2), at(a, 3), at(b, 3), at(c, 3), at(d, 3));
  return _mm256_shuffle_epi8(v, ctl);
}
// byte j = 0x10 where bit k of byte j of v is set
static inline iv i8_bit_to4(iv v, int k) {
  const iv m = i8_set1(1 << k);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, m), m), i8_set1(0x10));
}
// byte j of each 32-bit lane = 0x10 where bit 4 v + j of the lane is set (Q5_0's fifth bits, 4 per weight vector)
static inline iv i8_bits_to4(iv h, int v) {
#if defined(__AVX512BITALG__) && defined(__AVX512VL__) && defined(__AVX512BW__)
  // one bit gather per 64-bit lane (two rows' words), then 0x10 where set: 3 ops in place of 6
  const uint64_t b = 4 * v, sel = b | (b + 1) << 8 | (b + 2) << 16 | (b + 3) << 24 | (b + 32) << 32 | (b + 33) << 40 |
                                  (b + 34) << 48 | (b + 35) << 56;
  return _mm256_maskz_mov_epi8(_mm256_bitshuffle_epi64_mask(h, _mm256_set1_epi64x((long long)sel)), i8_set1(0x10));
#else
  // bits 4v .. 4v + 3 shifted down, then spread one per byte (to bit 4) by a multiply whose four shifted copies
  // cannot overlap
  const iv spread = _mm256_set1_epi32((1 << 4) | (1 << 11) | (1 << 18) | (1 << 25));
  return _mm256_and_si256(_mm256_mullo_epi32(_mm256_and_si256(_mm256_srli_epi32(h, 4 * v), _mm256_set1_epi32(0xF)),
                                             spread),
                          i8_set1(0x10));
#endif
}
// the integer products: unsigned bytes u times signed bytes s, adjacent pairs summed into int16 (saturating; the
// kernels keep their sums below 2^15), and int16 pairs multiplied and summed into int32
static inline iv u8i8_pairs(iv u, iv s) { return _mm256_maddubs_epi16(u, s); }
static inline iv i16_pairs(iv a, iv b) { return _mm256_madd_epi16(a, b); }
#if SWI_VNNI
// acc + the sum of each 32-bit lane's 4 products u x s (vpdpbusd), exact in int32
static inline iv u8i8_dot(iv acc, iv u, iv s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif
static inline fv f8_zero() { return _mm256_setzero_ps(); }
static inline fv f8_set1(float a) { return _mm256_set1_ps(a); }
static inline fv f8_ld(const float* p) { return _mm256_loadu_ps(p); }
static inline void f8_st(float* p, fv v) { _mm256_storeu_ps(p, v); }
static inline fv f8_f16(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }   // 8 halves
static inline fv f8_i32(iv v) { return _mm256_cvtepi32_ps(v); }
static inline fv f8_mul(fv a, fv b) { return _mm256_mul_ps(a, b); }
static inline fv f8_fma(fv a, fv b, fv c) { return _mm256_fmadd_ps(a, b, c); }
static inline fv f8_fnma(fv a, fv b, fv c) { return _mm256_fnmadd_ps(a, b, c); }   // c - a * b

// Activation quantization, 8 floats per op (exact: max is exact and x * id rounds as the scalar definition does).
// amax of |x[0, n)| (n a multiple of 8), or -1 where a value is inf or NaN
static inline float f8_absmax(const float* x, int n) {
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), big = _mm256_set1_ps(FLT_MAX);
  __m256 mx = _mm256_setzero_ps();
  int fin = 0xFF;
  for (int i = 0; i < n; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), absm);
    fin &= _mm256_movemask_ps(_mm256_cmp_ps(a, big, _CMP_LE_OQ));
    mx = _mm256_max_ps(mx, a);
  }
  if (fin != 0xFF) return -1.f;
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}
// q[0, 32) = round_half_even(x[i] * id) saturated to int8
static inline void i8_round32(const float* x, float id, int8_t* q) {
  const __m256 v = _mm256_set1_ps(id);
  __m256i r[4];
  for (int j = 0; j < 4; j++)
    r[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * j), v),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // packs interleave the 128-bit halves; the permute puts the 32 bytes back in order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
// the sums of q[0, 16) and q[16, 32): q + 128 as unsigned bytes summed 8 at a time (vpsadbw)
static inline void i8_sums16(const int8_t* q, int* t0, int* t1) {
  const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)q), _mm256_set1_epi8((char)0x80));
  const __m256i sad = _mm256_sad_epu8(u, _mm256_setzero_si256());
  *t0 = (int)(_mm256_extract_epi64(sad, 0) + _mm256_extract_epi64(sad, 1)) - 16 * 128;
  *t1 = (int)(_mm256_extract_epi64(sad, 2) + _mm256_extract_epi64(sad, 3)) - 16 * 128;
}
#endif

#if SWI_V512
typedef __m512i zv;
typedef __m512 zf;
static inline zv z_zero() { return _mm512_setzero_si512(); }
static inline zv z_dup2(iv v) {   // lanes 2r and 2r + 1 = lane r of v
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                  _mm512_castsi256_si512(v));
}
static inline zf zf_dup2(fv v) { return _mm512_castsi512_ps(z_dup2(_mm256_castps_si256(v))); }
static inline zv z_bcast8(const void* p) {   // the 8 bytes at p in every 64-bit lane
  int64_t v;
  memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}
static inline zf zf_bcast8(const void* p) { return _mm512_castsi512_ps(z_bcast8(p)); }   // 2 floats, repeated
static inline zv z_dot(zv acc, zv u, zv s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline zv z32_add(zv a, zv b) { return _mm512_add_epi32(a, b); }
static inline zv z32_sub(zv a, zv b) { return _mm512_sub_epi32(a, b); }
static inline zv z32_mul(zv a, zv b) { return _mm512_mullo_epi32(a, b); }
static inline zv z32_shl(zv a, int n) { return _mm512_slli_epi32(a, n); }
static inline zv z16_pairs(zv a, zv b) { return _mm512_madd_epi16(a, b); }
static inline zf zf_zero() { return _mm512_setzero_ps(); }
static inline zf zf_i32(zv v) { return _mm512_cvtepi32_ps(v); }
static inline zf zf_mul(zf a, zf b) { return _mm512_mul_ps(a, b); }
static inline zf zf_fma(zf a, zf b, zf c) { return _mm512_fmadd_ps(a, b, c); }
static inline zf zf_fnma(zf a, zf b, zf c) { return _mm512_fnmadd_ps(a, b, c); }
// two rows of 32-bit words interleaved: out[0, 32) = a0 b0 a1 b1 ... a15 b15
static inline void z32_zip16(const int32_t* a, const int32_t* b, int32_t* out) {
  const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi32(
                               va, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), vb));
  _mm512_storeu_si512(out + 16, _mm512_permutex2var_epi32(
                                    va, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), vb));
}
// lanes 2r + h of v to row h, lane r: (even lanes, odd lanes)
static inline void zf_unzip(zf v, fv* even, fv* odd) {
  const __m512i o = _mm512_castps_si512(
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), v));
  *even = _mm256_castsi256_ps(_mm512_castsi512_si256(o));
  *odd = _mm256_castsi256_ps(_mm512_extracti64x4_epi64(o, 1));
}
static inline void f8_st_n(float* p, int n, fv v) { _mm256_mask_storeu_ps(p, (__mmask8)((1u << n) - 1), v); }   // n < 8
#endif
