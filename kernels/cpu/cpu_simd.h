// The float-vector layer the CPU kernel files are written in (cpu_linear.cpp, cpu_decode.cpp, cpu_topk.cpp,
// cpu_quant.cpp): one vector type and the ops they need, for AVX-512 (F/BW/VL), AVX2+FMA, or portable C++ over an
// 8-float struct, picked by the -march macros at build time. The kernel files hold no float intrinsics of their own
// (cpu_quant.cpp's block decoders and the integer dot products of cpu_qdot.h still have theirs).
//
// vsum is one fixed lane order per ISA: kernels reduce their vector partial sums with it, so a row's result does not
// depend on the tiling, the rows beside it or the thread count (batch invariance).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

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
