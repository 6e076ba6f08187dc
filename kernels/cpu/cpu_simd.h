// The float-vector layer the CPU kernel files are written in (cpu_linear.cpp, cpu_decode.cpp, cpu_quant.cpp): one
// vector type and a few ops, for AVX-512 (F/BW/VL), AVX2+FMA, or portable C++ over an 8-float struct, picked by the
// -march macros at build time. The integer dot products (cpu_qdot.cpp) have their own layer: their ops have no
// float twin.
//
// vsum is one fixed lane order per ISA: kernels reduce their vector partial sums with it, so a row's result does not
// depend on the tiling, the rows beside it or the thread count (batch invariance).
#pragma once

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
#endif
