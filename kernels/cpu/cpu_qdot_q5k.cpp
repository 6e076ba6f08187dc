// Q5_K on int8 activations (cpu_qdot.h: the matmul; this file: the format). Q4_K's superblock (cpu_qdot_q4k.cpp)
// with a fifth bit per weight: 32 bytes qh, bit s of byte l the fifth bit of element l of sub-block s. Packed
// (cpu_qdot.h): d, dmin, the scale bytes, qh and the 128 quant bytes of the 8 rows, each as 4-byte groups.
#include "cpu_qdot.h"

namespace swk_qdot {

template <>
struct Codec<Q5_K> {
  static constexpr Field fields[] = {{0, 2}, {2, 2}, {4, 12}, {16, 32}, {48, 128}};

  SWK_QDOT_SCALAR static float ref_block(const uint8_t* blk, const QX& X, int64_t m, int64_t b, float acc) {
    const int8_t* x = X.q.data() + m * X.K + 256 * b;
    const int64_t i0 = m * (X.K / 32) + 8 * b;   // the superblock's first activation block
    uint8_t sc[8], mn[8];
    k_scale_min(blk + 4, sc, mn);
    const float d = h2f(blk), dmin = h2f(blk + 2);
    for (int s = 0; s < 8; s++) {
      int32_t u = 0;
      for (int l = 0; l < 32; l++) {
        const int q = ((blk[48 + 32 * (s / 2) + l] >> (4 * (s & 1))) & 15) | ((blk[16 + l] >> s) & 1) << 4;
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
    for (int pr = 0; pr < 4; pr++) {   // sub-blocks 2 pr (low nibbles) and 2 pr + 1 (high) share 32 bytes per row
      iv q[8];
#pragma GCC unroll 16
      for (int c = 0; c < 8; c++) q[c] = i_ld(p + 384 + 256 * pr + 32 * c);
#pragma GCC unroll 16
      for (int h = 0; h < 2; h++)
#pragma GCC unroll 16
        for (int c = 0; c < 8; c++)   // the fifth bits: bit 2 pr + h of qh's bytes
          put(16 * pr + 8 * h + c, i_or(h ? i8_hi4(q[c]) : i8_lo4(q[c]), i8_bit_to4(i_ld(p + 128 + 32 * c), 2 * pr + h)));
    }
  }
#endif
};

SWK_QDOT_FAMILY(Q5_K)
}  // namespace swk_qdot
