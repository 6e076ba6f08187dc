// Q4_0 and Q4_1 on int8 activations (cpu_qdot.h: the matmul; this file: the formats). A block is 32 weights as
// 4-bit quants q and a float16 scale d: w = d (q - 8) for Q4_0; Q4_1 adds a float16 min m, w = d q + m. Packed
// (cpu_qdot.h): d of the 8 rows, [m of the 8 rows,] the 16 quant bytes of the 8 rows as 4-byte groups.
#include "cpu_qdot.h"

namespace swk_qdot {

template <int T>
struct Q4Codec {
  static constexpr bool kMin = T == Q4_1;
  static constexpr int kQs = kMin ? 4 : 2;   // offset of the quants in the file's block

  SWK_QDOT_SCALAR static float ref_block(const uint8_t* blk, const QX& X, int64_t m, int64_t b, float acc) {
    const int8_t* x = X.q.data() + m * X.K + 32 * b;
    const int64_t i = m * (X.K / 32) + b;
    int32_t isum = 0;
    for (int j = 0; j < 16; j++) isum += (blk[kQs + j] & 15) * x[j] + (blk[kQs + j] >> 4) * x[j + 16];
    if (!kMin) isum -= 8 * X.s[i];   // the quants' offset through the activation block's sum
    acc = fmaf((float)isum, h2f(blk) * X.d[i], acc);
    if (kMin) acc = fmaf(h2f(blk + 2), X.ds[i], acc);
    return acc;
  }

#if SWI_SIMD
  template <class P>
  static inline void unpack(const uint8_t* p, int bi, Span& S, P&& put) {
    S.dw[bi] = f8_f16(p);
    if (kMin) S.mw[bi] = f8_f16(p + 16);
    const uint8_t* q = p + (kMin ? 32 : 16);
    iv t[4];
#pragma GCC unroll 16
    for (int c = 0; c < 4; c++) t[c] = i_ld(q + 32 * c);
#pragma GCC unroll 16
    for (int c = 0; c < 4; c++) put(c, i8_lo4(t[c]));   // elements 0-15: the low nibbles
#pragma GCC unroll 16
    for (int c = 0; c < 4; c++) put(4 + c, i8_hi4(t[c]));   // 16-31: the high ones
  }
#endif
};

template <> struct Codec<Q4_0> : Q4Codec<Q4_0> { static constexpr Field fields[] = {{0, 2}, {2, 16}}; };
template <> struct Codec<Q4_1> : Q4Codec<Q4_1> { static constexpr Field fields[] = {{0, 2}, {2, 2}, {4, 16}}; };

SWK_QDOT_FAMILY(Q4_0)
SWK_QDOT_FAMILY(Q4_1)
}  // namespace swk_qdot
