// GGUF block formats shared by the block kernels (kernels/cpu/cpu_quant.cpp: float32 activations; kernels/cpu/cpu_qdot.cpp:
// int8 activations): ggml type ids, block sizes, the float16 field reader and the K formats' 6-bit scales.
// gguf.constants.GGML_QUANT_SIZES and gguf.quants are the spec for the layouts.
#ifndef SWIFTK_CPU_GGUF_H_
#define SWIFTK_CPU_GGUF_H_

#include <stdint.h>
#include <string.h>

#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

// a type code with this bit set runs on swk_qi_linear_ld (int8 activations; the fused loop's descriptors)
#define SWK_Q_INT8_ACT 256

namespace swk_gguf {

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// elements (BS) and bytes (TS) per block
template <int T> struct Fmt;
template <> struct Fmt<Q4_0> { static constexpr int BS = 32, TS = 18; };
template <> struct Fmt<Q4_1> { static constexpr int BS = 32, TS = 20; };
template <> struct Fmt<Q5_0> { static constexpr int BS = 32, TS = 22; };
template <> struct Fmt<Q8_0> { static constexpr int BS = 32, TS = 34; };
template <> struct Fmt<Q4_K> { static constexpr int BS = 256, TS = 144; };
template <> struct Fmt<Q5_K> { static constexpr int BS = 256, TS = 176; };
template <> struct Fmt<Q6_K> { static constexpr int BS = 256, TS = 210; };

// The one per-format table: a runtime type id to its format's template argument, f(integral_constant<int, T>);
// -2 for a type this library does not read. Every per-format dispatch (sizes, de-quantization, the matmuls, the
// int8 kernels' repacking) goes through it, so a new format is one case here plus its Fmt and kernels.
template <class F>
inline int by_type(int type, F&& f) {
  switch (type) {
    case Q4_0: f(std::integral_constant<int, Q4_0>()); return 0;
    case Q4_1: f(std::integral_constant<int, Q4_1>()); return 0;
    case Q5_0: f(std::integral_constant<int, Q5_0>()); return 0;
    case Q8_0: f(std::integral_constant<int, Q8_0>()); return 0;
    case Q4_K: f(std::integral_constant<int, Q4_K>()); return 0;
    case Q5_K: f(std::integral_constant<int, Q5_K>()); return 0;
    case Q6_K: f(std::integral_constant<int, Q6_K>()); return 0;
    default: return -2;
  }
}

inline int block_size(int type) {
  int bs = -1;
  by_type(type, [&](auto t) { bs = Fmt<decltype(t)::value>::BS; });
  return bs;
}

inline int type_size(int type) {
  int ts = -1;
  by_type(type, [&](auto t) { ts = Fmt<decltype(t)::value>::TS; });
  return ts;
}

// float16 bits at p -> float32 (exact)
inline float h2f(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (e == 0) {  // zero or subnormal: man * 2^-24 is exact in float32
    float f = (float)man * 5.9604644775390625e-8f;
    memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (e == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((e + 112) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
#endif
}

// float32 -> float16 bits, rounded to nearest even (what torch's .half() and vcvtps2ph give): the KV cache's
// 16-bit format (kernels/cpu/cpu_decode.cpp). Overflow goes to inf, NaN stays a (quiet) NaN.
inline uint16_t f2h(float f) {
#if defined(__F16C__)
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return sign | 0x7E00;
  if (ax >= 0x47800000u) return sign | 0x7C00;   // >= 65536: inf (65520 up rounds there below)
  const int e = (int)(ax >> 23) - 127;
  if (e < -25) return sign;
  const uint32_t m = (ax & 0x7FFFFFu) | 0x800000u;   // value = m * 2^(e - 23)
  // a normal half keeps 11 of m's 24 bits; a subnormal counts units of 2^-24, i.e. m * 2^(e + 1)
  const int d = e >= -14 ? 13 : -(e + 1);
  uint32_t q = m >> d;
  const uint32_t rem = m & ((1u << d) - 1), half = 1u << (d - 1);
  q += rem > half || (rem == half && (q & 1));
  // a rounding carry into the next binade moves the exponent field by one, as the sum does
  return sign | (uint16_t)(e >= -14 ? (uint32_t)(e + 15) * 1024 + q - 1024 : q);
#endif
}

// Q4_K / Q5_K: the 8 six-bit (scale, min) pairs packed in the 12 bytes at s
inline void k_scale_min(const uint8_t* s, uint8_t (&sc)[8], uint8_t (&mn)[8]) {
  for (int j = 0; j < 4; j++) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[4 + j] & 0x3F;
    sc[4 + j] = (s[8 + j] & 0x0F) | ((s[j] >> 2) & 0x30);
    mn[4 + j] = (s[8 + j] >> 4) | ((s[4 + j] >> 2) & 0x30);
  }
}

}  // namespace swk_gguf

#endif  // SWIFTK_CPU_GGUF_H_
