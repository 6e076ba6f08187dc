// Q5_0 and Q8_0 on int8 activations (cpu_qdot.h: the matmul; this file: the formats). Q5_0: 32 weights as 4-bit
// quants, their fifth bits in a 32-bit word qh and a float16 scale d, w = d (q - 16). Q8_0: 32 int8 quants and d,
// w = d q. Packed (cpu_qdot.h): d of the 8 rows, [qh of the 8 rows,] the quant bytes of the 8 rows as 4-byte groups.
#include "cpu_qdot.h"

namespace swk_qdot {

template <>
struct Codec<Q5_0> {
  static constexpr Field fields[] = {{0, 2}, {2, 4}, {6, 16}};

  SWK_QDOT_SCALAR static float ref_block(const uint8_t* blk, const QX& X, int64_t m, int64_t b, float acc) {
    const int8_t* x = X.q.data() + m * X.K + 32 * b;
    const int64_t i = m * (X.K / 32) + b;
    uint32_t qh;
    memcpy(&qh, blk + 2, 4);
    int32_t isum = 0;
    for (int j = 0; j < 16; j++) {
      const int lo = (blk[6 + j] & 15) | ((qh >> j) & 1) << 4, hi = (blk[6 + j] >> 4) | ((qh >> (j + 16)) & 1) << 4;
      isum += lo * x[j] + hi * x[j + 16];
    }
    isum -= 16 * X.s[i];   // the quants' offset through the activation block's sum
    return fmaf((float)isum, h2f(blk) * X.d[i], acc);
  }

#if SWI_SIMD
  template <class P>
  static inline void unpack(const uint8_t* p, int bi, Span& S, P&& put) {
    S.dw[bi] = f8_f16(p);
    const iv H = i_ld(p + 16);
    iv t[4];
#pragma GCC unroll 16
    for (int c = 0; c < 4; c++) t[c] = i_ld(p + 48 + 32 * c);
    // elements 4v .. 4v + 3 take bits 4v .. 4v + 3 of qh, each moved to bit 4 of its byte
#pragma GCC unroll 16
    for (int v = 0; v < 8; v++) put(v, i_or(v < 4 ? i8_lo4(t[v]) : i8_hi4(t[v - 4]), i8_bits_to4(H, v)));
  }
#endif
};

template <>
struct Codec<Q8_0> {
  static constexpr Field fields[] = {{0, 2}, {2, 32}};

  SWK_QDOT_SCALAR static float ref_block(const uint8_t* blk, const QX& X, int64_t m, int64_t b, float acc) {
    const int8_t* x = X.q.data() + m * X.K + 32 * b;
    int32_t isum = 0;
    for (int j = 0; j < 32; j++) isum += (int8_t)blk[2 + j] * x[j];
    return fmaf((float)isum, h2f(blk) * X.d[m * (X.K / 32) + b], acc);
  }

#if SWI_SIMD
  // the quants as they are (signed): decode() and the products make them unsigned (w + 128, or |w| and its sign)
  template <class P>
  static inline void unpack(const uint8_t* p, int bi, Span& S, P&& put) {
    S.dw[bi] = f8_f16(p);
#pragma GCC unroll 16
    for (int v = 0; v < 8; v++) put(v, i_ld(p + 16 + 32 * v));
  }
#endif
};

SWK_QDOT_FAMILY(Q5_0)
SWK_QDOT_FAMILY(Q8_0)
}  // namespace swk_qdot
