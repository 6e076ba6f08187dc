// Q6_K on int8 activations (cpu_qdot.h: the matmul; this file: the format). A superblock is 256 weights as 6-bit
// quants (low 4 bits in ql, high 2 in qh), 16 int8 scales of 16 weights each and a float16 d: w = d sc (q - 32).
// Packed (cpu_qdot.h): d, the scale bytes, ql and qh of the 8 rows, each as 4-byte groups.
#include "cpu_qdot.h"

namespace swk_qdot {

template <>
struct Codec<Q6_K> {
  static constexpr Field fields[] = {{208, 2}, {192, 16}, {0, 128}, {128, 64}};

  SWK_QDOT_SCALAR static float ref_block(const uint8_t* blk, const QX& X, int64_t m, int64_t b, float acc) {
    const int8_t* x = X.q.data() + m * X.K + 256 * b;
    const int64_t i0 = m * (X.K / 32) + 8 * b;   // the superblock's first activation block
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t* sc = (const int8_t*)(blk + 192);
    const float d = h2f(blk + 208);
    int q[256];
    for (int h = 0; h < 2; h++)
      for (int l = 0; l < 32; l++) {
        q[128 * h + l] = (ql[64 * h + l] & 15) | ((qh[32 * h + l] & 3) << 4);
        q[128 * h + 32 + l] = (ql[64 * h + 32 + l] & 15) | (((qh[32 * h + l] >> 2) & 3) << 4);
        q[128 * h + 64 + l] = (ql[64 * h + l] >> 4) | (((qh[32 * h + l] >> 4) & 3) << 4);
        q[128 * h + 96 + l] = (ql[64 * h + 32 + l] >> 4) | (((qh[32 * h + l] >> 6) & 3) << 4);
      }
    for (int t = 0; t < 8; t++) {   // 32 elements: two scales of 16
      int32_t isum = 0;
      for (int j = 2 * t; j < 2 * t + 2; j++) {
        int32_t u = 0;
        for (int e = 0; e < 16; e++) u += q[16 * j + e] * x[16 * j + e];
        isum += sc[j] * (u - 32 * X.s16[2 * i0 + j]);   // the offset 32 through the activations' sums per 16
      }
      acc = fmaf((float)isum, d * X.d[i0 + t], acc);
    }
    return acc;
  }

#if SWI_SIMD
  template <class P>
  static inline void unpack(const uint8_t* p, int, Span& S, P&& put) {
    S.d = f8_f16(p);
    iv sc[4];   // 16 int8 scales as 4 dwords per row
#pragma GCC unroll 16
    for (int k = 0; k < 4; k++) sc[k] = i_ld(p + 16 + 32 * k);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) {
#if SWI_VNNI
      S.sc32[j] = i32_sar(i8_pick(sc[j / 4], -1, -1, -1, j % 4), 24);
#else
      S.sc16[j] = i16_sar(i8_pick(sc[j / 4], -1, j % 4, -1, j % 4), 8);
#endif
    }
#pragma GCC unroll 16
    for (int j = 0; j < 8; j++) S.mn[j] = i16_sar(i8_pick(sc[j / 2], -1, 2 * (j % 2), -1, 2 * (j % 2) + 1), 8);
    // quarter u of half h (elements 128 h + 32 u + 4 c ..): ql's low nibbles (u < 2) or high ones, and bits 2u,
    // 2u + 1 of each qh byte moved to bits 4, 5 (what a 16-bit shift carries across bytes is masked off)
    const iv m30 = i8_set1(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
      for (int u = 0; u < 4; u++)
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {   // each u reads its bytes again (cpu_simd.h, fresh: why)
          const uint8_t *pl = fresh(p + 144 + 512 * h + 256 * (u & 1)), *ph = fresh(p + 1168 + 256 * h);
          const iv l = i_ld(pl + 32 * c), qh = i_ld(ph + 32 * c);
          const iv hs = u < 2 ? i16_shl(qh, 4 - 2 * u) : u == 3 ? i16_shr(qh, 2) : qh;
          put(32 * h + 8 * u + c, i_or(u >> 1 ? i8_hi4(l) : i8_lo4(l), i_and(hs, m30)));
        }
  }
#endif
};

SWK_QDOT_FAMILY(Q6_K)
}  // namespace swk_qdot
