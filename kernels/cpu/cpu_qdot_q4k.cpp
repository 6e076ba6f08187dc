// Q4_K on int8 activations (cpu_qdot.h: the matmul; this file: the format). A superblock is 256 weights in 8
// sub-blocks of 32: 4-bit quants q, per sub-block a 6-bit scale sc and min mn (12 bytes, swk_gguf::k_scale_min), and
// float16 d and dmin: w = d sc q - dmin mn. Packed (cpu_qdot.h): d, dmin, the scale bytes and the 128 quant bytes
// of the 8 rows, each as 4-byte groups.
#include "cpu_qdot.h"

namespace swk_qdot {

template <>
struct Codec<Q4_K> {
  static constexpr Field fields[] = {{0, 2}, {2, 2}, {4, 12}, {16, 128}};

  SWK_QDOT_SCALAR static float ref_block(const uint8_t* blk, const QX& X, int64_t m, int64_t b, float acc) {
    const int8_t* x = X.q.data() + m * X.K + 256 * b;
    const int64_t i0 = m * (X.K / 32) + 8 * b;   // the superblock's first activation block
    uint8_t sc[8], mn[8];
    k_scale_min(blk + 4, sc, mn);
    const float d = h2f(blk), dmin = h2f(blk + 2);
    for (int s = 0; s < 8; s++) {   // sub-blocks 2k and 2k + 1: the low and high nibbles of 32 bytes
      int32_t u = 0;
      for (int l = 0; l < 32; l++) u += ((blk[16 + 32 * (s / 2) + l] >> (4 * (s & 1))) & 15) * x[32 * s + l];
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
      for (int c = 0; c < 8; c++) q[c] = i_ld(p + 128 + 256 * pr + 32 * c);
#pragma GCC unroll 16
      for (int h = 0; h < 2; h++)
#pragma GCC unroll 16
        for (int c = 0; c < 8; c++) put(16 * pr + 8 * h + c, h ? i8_hi4(q[c]) : i8_lo4(q[c]));
    }
  }
#endif
};

SWK_QDOT_FAMILY(Q4_K)
}  // namespace swk_qdot
