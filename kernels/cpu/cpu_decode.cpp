// The CPU decoder-layer loop in one call: for T <= 32 new tokens (a decode step, a draft step, a verify pass, a
// matchness pass), every layer of [start, end) with its skip flags -- RMSNorm, QKV (+bias), RoPE, KV write,
// masked GQA attention over the cache, O, residual, RMSNorm, gate/up, SwiGLU, down, residual -- on float32
// activations, with the weights in any format of kernels/cpu/cpu_linear.cpp (float32, bfloat16, int8 + row scale).
// Torch twin: swiftk/runtime/model.py `Model._layers` on the torch ops (tests/test_cpu_decode.py holds them close and
// checks this path's own batch invariance).
//
// Why: at these sizes a decode step on the torch path spends ~a third of its time outside the matmuls, in ~20
// small ops per layer, each a Python call and an ATen dispatch; here those ops are a few loops over D-sized rows
// and the only per-layer cost left is the weight reads.
//
// Batch invariance: every row (token) is computed on its own with a fixed reduction order (norm statistics,
// attention over the visible slots in slot order, the linear kernel's fixed order), so a token's hidden state in
// a verify pass equals the one it gets in a one-token step bit for bit, as long as it sees the same keys.
#include <algorithm>
#include <math.h>
#include <stdint.h>
#include <string.h>


#include <new>
#include <vector>

// The public declarations (csrc/include/swiftk_cpu.h), when the build puts csrc/include on the include path
// (kernels/cpu/CMakeLists.txt does, for pip install and the first-use build): the compiler then checks that the
// definitions below match them. An installed package may lack csrc/: then the file compiles without them.
#if __has_include("swiftk_cpu.h")
#include "swiftk_cpu.h"
#define SWK_HAVE_HEADER 1
#endif

#include "cpu_gguf.h"
#include "cpu_pool.h"
#include "cpu_simd.h"

// The matmuls of the same library this file calls (kernels/cpu/cpu_linear.cpp, cpu_quant.cpp; with csrc/include on
// the path the compiler checks these against swiftk_cpu.h's declarations).
extern "C" int swk_linear(const float* x, int64_t M, int64_t K, const void* w, int wt, const float* scale, int64_t N,
                          float* y, int nthreads);
extern "C" int swk_q_linear_ld(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y,
                               int64_t ldy);

namespace {

// Layer table: per layer, NPTR addresses (see swk_layers) and 4 weight types. Public: csrc/include/swiftk_cpu.h.
enum { P_ATTN_NORM, P_WQKV, P_WQKV_SCALE, P_BQKV, P_WO, P_WO_SCALE, P_MLP_NORM, P_WGU, P_WGU_SCALE, P_WDOWN,
       P_WDOWN_SCALE, P_KV, NPTR };
enum { KV_F32 = 0, KV_F16 = 1 };   // the KV cache's element type (kv_type)
#ifdef SWK_HAVE_HEADER
static_assert(KV_F32 == SWK_KV_FLOAT32 && KV_F16 == SWK_KV_FLOAT16, "KV types differ from swiftk_cpu.h");
static_assert(SWK_CPU_ERR_NOMEM == -2, "swk_layers' out-of-memory code");
static_assert((int)P_ATTN_NORM == SWK_P_ATTN_NORM && (int)P_WQKV == SWK_P_WQKV &&
                  (int)P_WQKV_SCALE == SWK_P_WQKV_SCALE && (int)P_BQKV == SWK_P_BQKV && (int)P_WO == SWK_P_WO &&
                  (int)P_WO_SCALE == SWK_P_WO_SCALE && (int)P_MLP_NORM == SWK_P_MLP_NORM &&
                  (int)P_WGU == SWK_P_WGU && (int)P_WGU_SCALE == SWK_P_WGU_SCALE && (int)P_WDOWN == SWK_P_WDOWN &&
                  (int)P_WDOWN_SCALE == SWK_P_WDOWN_SCALE && (int)P_KV == SWK_P_KV &&
                  (int)NPTR == SWK_LAYER_TABLE_WIDTH,
              "layer table order differs from csrc/include/swiftk_cpu.h");
#endif

// exp of p[0, n) in place; p has room for n rounded up to the vector width (padding is overwritten), so every
// element goes through the same vector code whatever n is.
void exp_inplace(float* p, int64_t n) {
  for (int64_t i = 0; i < n; i += SWK_W) vst(p + i, vexp(vld(p + i)));
}

// The KV cache's element types: float32 (KT = float) or float16 bits (KT = uint16_t). Rows of either are read as
// floats (a half widens exactly), so attention over a 16-bit cache runs attention over a float32 cache's ops on the
// values the cache holds: the same bits as a float32 cache holding those values.
static inline vec kld(const float* p) { return vld(p); }
static inline vec kld(const uint16_t* p) { return vld_h(p); }
static inline float kf(float x) { return x; }
static inline float kf(uint16_t h) { return swk_gguf::h2f((const uint8_t*)&h); }
static inline void kst(float* dst, const float* src, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
static inline void kst(uint16_t* dst, const float* src, int64_t n) { vst_h_row(dst, src, n); }

// Sum of a[i] * b[i] over [0, n): vector lanes in a fixed order then the fixed lane reduction (n % SWK_W tail
// scalar), the same arithmetic for a row whatever the pass.
template <typename KT>
float dot(const float* a, const KT* b, int64_t n) {
  vec acc = vzero();
  int64_t i = 0;
  for (; i + SWK_W <= n; i += SWK_W) acc = vfma(vld(a + i), kld(b + i), acc);
  float s = vsum(acc);
  for (; i < n; i++) s += a[i] * kf(b[i]);
  return s;
}

void rmsnorm_rows(const float* x, const float* w, float* y, int64_t T, int64_t D, float eps) {
  for (int64_t t = 0; t < T; t++) {
    const float* xr = x + t * D;
    float* yr = y + t * D;
    const float ss = dot(xr, xr, D);
    const float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (int64_t i = 0; i < D; i++) yr[i] = w[i] * (xr[i] * r);
  }
}

int g_attention_tiles = 1;   // swk_set_attention_tiles: 0 runs every pass on per-token work items (A/B, tests)

// A block weight's descriptor (int64): n_parts, then (address, ggml type, rows) per part: row groups in their own
// formats, each writing its columns of y [M, N].
// swk_layers checked the descriptors, so a part fails only when its kernel cannot allocate: the pass stops there.
struct BlockKernelFailed {};
void linear_blocks(const float* x, int64_t M, int64_t K, const int64_t* desc, int64_t N, float* y) {
  int64_t col = 0;
  for (int64_t i = 0; i < desc[0]; i++) {
    const int64_t* p = desc + 1 + 3 * i;
    if (swk_q_linear_ld(x, M, K, (const void*)p[0], (int)p[1], p[2], y + col, N) != 0) throw BlockKernelFailed();
    col += p[2];
  }
}

void linear_any(int wt, const float* x, int64_t M, int64_t K, const void* w, const float* scale, int64_t N,
                float* y, int nthreads) {
  switch (wt) {
    case 3: linear_blocks(x, M, K, (const int64_t*)w, N, y); break;
    // swk_layers checked the operands (an int8 weight has its scales), so swk_linear accepts them
    default: swk_linear(x, M, K, w, wt, wt == 2 ? scale : nullptr, N, y, nthreads); break;
  }
}

// Rotate-half RoPE (HF layout) of n_heads heads of x [hd] at one position; cos/sin [hd/2].
void rope_row(float* x, int64_t n_heads, int64_t hd, const float* c, const float* s) {
  const int64_t h2 = hd / 2;
  for (int64_t hh = 0; hh < n_heads; hh++) {
    float* v = x + hh * hd;
    for (int64_t i = 0; i < h2; i++) {
      const float a = v[i], b = v[i + h2];
      v[i] = a * c[i] - b * s[i];
      v[i + h2] = b * c[i] + a * s[i];
    }
  }
}

// out [hd] = softmax(q . K_s * scale over visible s) . V_s for one query head; K, V [S, hd] of its KV head.
// Scores of 16 keys at a time share one reduction tree (hsum16: each score bitwise the dot() it replaces); the
// weighted sum of V rows stays in registers. Every step runs in slot order, the same for a token whatever T.
constexpr int MAXV = 16;   // register path for hd <= 16 vectors

// Scores q . K_s * scale of one query head over keys [s0, s1) into p[s] for the visible s, with their running max
// mx. s0 and, unless s1 == S, s1 are multiples of 16, so whatever split of [0, S) the caller walks, every key gets
// the ops of one call over [0, S): blocks of 16 keys (8 on AVX2), dot() for those past the last full block.
template <typename KT>
void head_scores(const float* q, const KT* K, const uint8_t* vis, int64_t s0, int64_t s1, int64_t hd,
                 float scale, float* p, float& mx) {
  const bool vec_hd = hd % SWK_W == 0 && hd / SWK_W <= MAXV;
  int64_t s = s0;
#if SWK_W == 16
  if (vec_hd) {
    const int64_t nv = hd / SWK_W;
    vec mv = vset1(-INFINITY);
    for (; s + 16 <= s1; s += 16) {
      vec acc[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; j++) acc[j] = vzero();
      for (int64_t v = 0; v < nv; v++) {
        const vec qv = vld(q + v * SWK_W);
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) acc[j] = vfma(qv, kld(K + (s + j) * hd + v * SWK_W), acc[j]);
      }
      vec in[16];
#pragma GCC unroll 16
      for (int j = 0; j < 16; j++) in[(j / 4) + 4 * (j % 4)] = acc[j];   // lane j = key s + j
      const vec sc = vmul(hsum16(in), vset1(scale));
      const vmask m = vmask_bytes(vis + s);   // the visible keys' lanes
      vst_mask(p + s, m, sc);
      mv = vmax_mask(mv, m, sc);   // max is exact: the lanes' order does not matter
    }
    mx = std::max(mx, vmax_all(mv));
  }
#else
  if (vec_hd) {   // AVX2: 8 keys at a time, their sums in one shuffle tree (hsum8: each bitwise vsum, i.e. dot())
    const int64_t nv = hd / SWK_W;
    for (; s + 8 <= s1; s += 8) {
      vec acc[8];
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++) acc[j] = vzero();
      for (int64_t v = 0; v < nv; v++) {
        const vec qv = vld(q + v * SWK_W);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) acc[j] = vfma(qv, kld(K + (s + j) * hd + v * SWK_W), acc[j]);
      }
      alignas(32) float sc[8];
      vst(sc, vmul(hsum8(acc), vset1(scale)));
      for (int j = 0; j < 8; j++) {
        if (!vis[s + j]) continue;
        p[s + j] = sc[j];
        if (sc[j] > mx) mx = sc[j];
      }
    }
  }
#endif
  for (; s < s1; s++) {   // the keys past the blocks (all of them when hd is not a vector multiple)
    if (!vis[s]) continue;
    p[s] = dot(q, K + s * hd, hd) * scale;
    if (p[s] > mx) mx = p[s];
  }
}

// p[s] = exp(score - max) over the visible slots, 0 elsewhere
void probs_from_scores(const uint8_t* vis, int64_t S, float mx, float* p) {
  for (int64_t s = 0; s < S; s++) p[s] = vis[s] ? p[s] - mx : 0.0f;
  exp_inplace(p, S);
}

// p[s] = exp(q . K_s * scale - max) over the visible slots s, 0 elsewhere (attend_row's first half)
template <typename KT>
void head_probs(const float* q, const KT* K, const uint8_t* vis, int64_t S, int64_t hd, float scale, float* p) {
  float mx = -INFINITY;
  head_scores(q, K, vis, 0, S, hd, scale, p, mx);
  probs_from_scores(vis, S, mx, p);
}

template <typename KT>
void attend_row(const float* q, const KT* K, const KT* V, const uint8_t* vis, int64_t S, int64_t hd,
                float scale, float* p, float* out) {
  const bool vec_hd = hd % SWK_W == 0 && hd / SWK_W <= MAXV;
  head_probs(q, K, vis, S, hd, scale, p);
  float den = 0.0f;
  int64_t s;
  if (vec_hd) {
    const int64_t nv = hd / SWK_W;
    vec o[MAXV];
    for (int64_t v = 0; v < nv; v++) o[v] = vzero();
    for (s = 0; s < S; s++) {
      if (!vis[s]) continue;
      const float e = p[s];
      den += e;
      const vec ev = vset1(e);
      const KT* vr = V + s * hd;
      for (int64_t v = 0; v < nv; v++) o[v] = vfma(ev, kld(vr + v * SWK_W), o[v]);
    }
    const vec inv = vset1(1.0f / den);
    for (int64_t v = 0; v < nv; v++) vst(out + v * SWK_W, vmul(o[v], inv));
    return;
  }
  for (int64_t i = 0; i < hd; i++) out[i] = 0.0f;
  for (s = 0; s < S; s++) {
    if (!vis[s]) continue;
    const float e = p[s];
    den += e;
    const KT* v = V + s * hd;
    for (int64_t i = 0; i < hd; i++) out[i] += e * kf(v[i]);
  }
  const float inv = 1.0f / den;
  for (int64_t i = 0; i < hd; i++) out[i] *= inv;
}

// Weighted sums of V rows over slots [s0, s1) for NR consecutive query heads of one token, carried in o and den
// from tile to tile: per visible slot in slot order den += e, o = fma(e, V_s, o) -- attend_row's second half, so a
// head summed in tiles or in one call gets the same bits.
template <int NV, int NR, typename KT>
void pv_tile(const KT* V, int64_t s0, int64_t s1, const uint8_t* vis, const float* p, int64_t Sp, float* o,
             float* den) {   // head i: probs p + i * Sp, sums o + i * hd, den[i]
  constexpr int64_t hd = NV * SWK_W;
  vec acc[NR][NV];
  float d[NR];
#pragma GCC unroll 4
  for (int i = 0; i < NR; i++) {
    d[i] = den[i];
    for (int v = 0; v < NV; v++) acc[i][v] = vld(o + i * hd + v * SWK_W);
  }
  for (int64_t s = s0; s < s1; s++) {
    if (!vis[s]) continue;
    const KT* vr = V + s * hd;
    vec vv[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; v++) vv[v] = kld(vr + v * SWK_W);
#pragma GCC unroll 4
    for (int i = 0; i < NR; i++) {
      const float e = p[i * Sp + s];
      d[i] += e;
      const vec ev = vset1(e);
#pragma GCC unroll 16
      for (int v = 0; v < NV; v++) acc[i][v] = vfma(ev, vv[v], acc[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < NR; i++) {
    den[i] = d[i];
    for (int v = 0; v < NV; v++) vst(o + i * hd + v * SWK_W, acc[i][v]);
  }
}

// pv_tile for n <= NR heads
template <int NV, int NR, typename KT>
void pv_heads(int64_t n, const KT* V, int64_t s0, int64_t s1, const uint8_t* vis, const float* p, int64_t Sp,
              float* o, float* den) {
  if constexpr (NR > 1)
    if (n < NR) return pv_heads<NV, NR - 1, KT>(n, V, s0, s1, vis, p, Sp, o, den);
  pv_tile<NV, NR, KT>(V, s0, s1, vis, p, Sp, o, den);
}

#if SWK_W == 16
// attend_row for NH query heads of one KV head and one token (hd = 64): the same ops per head in the same order
// (so the same bits), their weighted sums of V rows interleaved (pv_tile): each head's chain of FMAs waits on its
// own latency, so one head per loop left the cores idle (22% of a SmolLM2 verify pass of 8 was attention).
template <int NH, typename KT>
void attend_heads(const float* q, const KT* K, const KT* V, const uint8_t* vis, int64_t S, float scale,
                  float* p, int64_t Sp, float* out) {
  constexpr int64_t hd = 64, NV = hd / SWK_W;
  for (int i = 0; i < NH; i++) head_probs(q + i * hd, K, vis, S, hd, scale, p + i * Sp);
  alignas(64) float o[NH * hd] = {};
  float den[NH] = {};
  pv_tile<NV, NH, KT>(V, 0, S, vis, p, Sp, o, den);
  for (int i = 0; i < NH; i++) {
    const vec inv = vset1(1.0f / den[i]);
    for (int v = 0; v < NV; v++) vst(out + i * hd + v * SWK_W, vmul(vld(o + i * hd + v * SWK_W), inv));
  }
}
#endif

#if SWK_W == 16
// head_scores for two rows at once over [s0, s1), 8 keys of each per hsum16 (its lanes are independent vsums, so each
// score keeps its bits): half the loads per FMA of one row's 16 keys. Keys past the last full block of 16 in [0, S)
// go through dot(), as in head_scores.
template <typename KT>
void pair_scores(const float* qa, const float* qb, const KT* K, const uint8_t* va, const uint8_t* vb, int64_t s0,
                 int64_t s1, int64_t S, int64_t hd, float scale, float* pa, float* pb, float& ma, float& mb) {
  const int64_t nv = hd / SWK_W, end = std::min(s1, S / 16 * 16);
  vec mv = vset1(-INFINITY);
  int64_t s = s0;
  for (; s < end; s += 8) {
    vec acc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) acc[j] = vzero();
    for (int64_t v = 0; v < nv; v++) {
      const vec a = vld(qa + v * SWK_W), b = vld(qb + v * SWK_W);
#pragma GCC unroll 8
      for (int j = 0; j < 8; j++) {
        const vec k = kld(K + (s + j) * hd + v * SWK_W);
        acc[j] = vfma(a, k, acc[j]);
        acc[8 + j] = vfma(b, k, acc[8 + j]);
      }
    }
    vec in[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++) in[(j / 4) + 4 * (j % 4)] = acc[j];   // lanes 0-7: row a, 8-15: row b
    const vec sc = vmul(hsum16(in), vset1(scale));
    const vmask m = vmask_bytes2(va + s, vb + s);   // the visible keys' lanes
    vst_lo8_mask(pa + s, m, sc);
    vst_hi8_mask(pb + s, m, sc);
    mv = vmax_mask(mv, m, sc);   // max is exact: any order gives head_scores' value
  }
  alignas(64) float mx[16];
  vst(mx, mv);
  for (int j = 0; j < 8; j++) {
    ma = std::max(ma, mx[j]);
    mb = std::max(mb, mx[8 + j]);
  }
  if (s < s1) {   // the tail of [0, S)
    head_scores(qa, K, va, s, s1, hd, scale, pa, ma);
    head_scores(qb, K, vb, s, s1, hd, scale, pb, mb);
  }
}
#endif

// A pass of several tokens: the attention of every row (token, query head) that shares one KV head, over a block
// of tokens. One work item per row re-read the head's K and V from L2 or memory per row (at 1024 slots a pass of
// 8 spent more time there than in its matmuls). Here a tile of keys stays in L1 while every row scores it, then a
// tile of V rows while every row adds it in, each row with a decode step's ops in its order, so its bits.
// Tokens [t0, t1) x the G query heads of KV head g; q rows in qkv [T, NQKV], results into att [T, H, hd]; vis rows
// of VS bytes, of which slots [0, S) are read (every visible slot of these rows lies below S).
// Scratch: p [(t1 - t0) * G, Sp], o [(t1 - t0) * G, hd], den and mx [(t1 - t0) * G].
template <int NV, typename KT>
void attend_group(const float* qkv, int64_t NQKV, int64_t t0, int64_t t1, int64_t g, int64_t G, int64_t H,
                  const KT* K, const KT* V, const uint8_t* vis, int64_t VS, int64_t S, float scale, float* p,
                  int64_t Sp, float* o, float* den, float* mx, float* att) {
  constexpr int64_t hd = NV * SWK_W;
  constexpr int64_t TS = std::max<int64_t>(16, 6144 / hd / 16 * 16);   // a tile of K or V rows: ~24 KB, in L1
  constexpr int NR = NV <= 4 ? 4 : NV <= 8 ? 2 : 1;               // heads sharing each V load
  const int64_t R = (t1 - t0) * G;
  for (int64_t r = 0; r < R; r++) mx[r] = -INFINITY;
  for (int64_t s0 = 0; s0 < S; s0 += TS) {
    const int64_t s1 = std::min(S, s0 + TS);
    int64_t r = 0;
#if SWK_W == 16
    for (; r + 2 <= R; r += 2) {
      const int64_t ta = t0 + r / G, tb = t0 + (r + 1) / G;
      pair_scores(qkv + ta * NQKV + (g * G + r % G) * hd, qkv + tb * NQKV + (g * G + (r + 1) % G) * hd, K,
                  vis + ta * VS, vis + tb * VS, s0, s1, S, hd, scale, p + r * Sp, p + (r + 1) * Sp, mx[r],
                  mx[r + 1]);
    }
#endif
    for (; r < R; r++) {
      const int64_t t = t0 + r / G;
      head_scores(qkv + t * NQKV + (g * G + r % G) * hd, K, vis + t * VS, s0, s1, hd, scale, p + r * Sp, mx[r]);
    }
  }
  for (int64_t r = 0; r < R; r++) {
    probs_from_scores(vis + (t0 + r / G) * VS, S, mx[r], p + r * Sp);
    den[r] = 0.0f;
  }
  for (int64_t i = 0; i < R * hd; i++) o[i] = 0.0f;
  for (int64_t s0 = 0; s0 < S; s0 += TS) {
    const int64_t s1 = std::min(S, s0 + TS);
    for (int64_t t = t0; t < t1; t++)
      for (int64_t i = 0; i < G; i += NR) {
        const int64_t r = (t - t0) * G + i, n = std::min<int64_t>(NR, G - i);
        pv_heads<NV, NR, KT>(n, V, s0, s1, vis + t * VS, p + r * Sp, Sp, o + r * hd, den + r);
      }
  }
  for (int64_t r = 0; r < R; r++) {
    const vec inv = vset1(1.0f / den[r]);
    float* out = att + ((t0 + r / G) * H + g * G + r % G) * hd;
    for (int v = 0; v < NV; v++) vst(out + v * SWK_W, vmul(vld(o + r * hd + v * SWK_W), inv));
  }
}

// The layer loop of swk_layers and swk_layers_multi: rows of one cache (kvs null: the table's P_KV) or of several
// (row t reads and writes the caches kvs[row_cache[t] * n_layers + l], one per layer; row_cache nondecreasing, so
// each cache's rows are one contiguous segment), their elements KT. Arguments as swk_layers' (below).
template <typename KT>
int layers(int64_t n_layers, const uint64_t* table, const int* wtypes, const uint8_t* flags, int64_t T, int64_t D,
           int64_t H, int64_t KV, int64_t hd, int64_t I, float eps, float scale, int64_t max_slots,
           const int64_t* slots, const float* cos_t, const float* sin_t, const uint8_t* vis, int64_t S, float* h,
           int nthreads, int64_t n_caches, const uint64_t* kvs, const int64_t* row_cache) {
  if (n_layers < 0 || !table || !wtypes || !flags || T < 1 || D < 1 || H < 1 || KV < 1 || H % KV || hd < 2 ||
      hd % 2 || I < 1 || S < 1 || S > max_slots || !slots || !cos_t || !sin_t || !vis || !h || nthreads < 1)
    return -1;
  if (kvs) {
    if (n_caches < 1 || !row_cache) return -1;
    for (int64_t i = 0; i < n_caches * n_layers; i++)
      if (!kvs[i]) return -1;
    for (int64_t t = 0; t < T; t++)
      if (row_cache[t] < 0 || row_cache[t] >= n_caches || (t && row_cache[t] < row_cache[t - 1])) return -1;
  }
  for (int64_t i = 0; i < 4 * n_layers; i++)
    if (wtypes[i] < 0 || wtypes[i] > 3) return -1;
  // each weight's operands (K, N as the layer reads it): an int8 weight needs its scales, a block descriptor parts
  // whose rows cover N exactly in formats whose blocks divide K (the block kernel's errors are not read mid-pass)
  const int64_t nqkv = (H + 2 * KV) * hd, wk[4] = {D, H * hd, D, I}, wn[4] = {nqkv, D, 2 * I, D};
  const int wp[4] = {P_WQKV, P_WO, P_WGU, P_WDOWN}, ws[4] = {P_WQKV_SCALE, P_WO_SCALE, P_WGU_SCALE, P_WDOWN_SCALE};
  for (int64_t l = 0; l < n_layers; l++)
    for (int j = 0; j < 4; j++) {
      const uint64_t* P = table + l * NPTR;
      const int wt = wtypes[4 * l + j];
      if (!P[wp[j]] || (wt == 2 && !P[ws[j]])) return -1;
      if (wt != 3) continue;
      const int64_t* desc = (const int64_t*)P[wp[j]];
      int64_t rows = 0;
      if (desc[0] < 1) return -1;
      for (int64_t i = 0; i < desc[0]; i++) {
        const int64_t* d = desc + 1 + 3 * i;
        const int bs = swk_gguf::block_size((int)(d[1] & ~(int64_t)SWK_Q_INT8_ACT));
        if (!d[0] || bs < 0 || wk[j] % bs || d[2] < 1 || d[2] > wn[j] - rows) return -1;
        rows += d[2];
      }
      if (rows != wn[j]) return -1;
    }
  try {   // every buffer is sized before a parallel region: a failed allocation (or a block part's) lands here
    // Row t reads slots [0, ext[t]): up to its last visible one. A row of a short sequence batched with a long one
    // scans its own extent, not the pass's S; the slots it skips are invisible to it, so its bits do not change.
    std::vector<int64_t> ext(T);
    for (int64_t t = 0; t < T; t++) {
      if (slots[t] < 0 || slots[t] >= max_slots) return -1;
      int64_t e = S;
      while (e > 0 && !vis[t * S + e - 1]) e--;
      if (!e) return -1;
      ext[t] = e;
    }
    const int64_t NQKV = (H + 2 * KV) * hd, G = H / KV;
    const bool grouped = SWK_W == 16 && hd == 64 && G > 1 && T * KV >= 2 * nthreads;
    std::vector<float> x(T * D), qkv(T * NQKV), att(T * H * hd), o(T * D), gu(T * 2 * I), act(T * I);
    const int64_t Sp = (S + SWK_W - 1) / SWK_W * SWK_W;   // exp_inplace's padded length
    std::vector<float> probs;   // up to 4 heads per work item (attend_heads)
    // A pass of several tokens on a vector head size: attend_group's items, KV heads x blocks of tokens (two items
    // a thread, <= ~32 rows an item: its probs stay a few MB at long contexts), a block never across two caches.
    const int64_t NVh = hd / SWK_W;
    const bool tiled = g_attention_tiles && T > 1 && hd % SWK_W == 0 && (NVh == 2 || NVh == 4 || NVh == 8 || NVh == 16);
    std::vector<int64_t> blk;   // block b: tokens [blk[b], blk[b + 1])
    int64_t rmax = 0;
    if (tiled) {
      int64_t nseg = 1;
      for (int64_t t = 1; kvs && t < T; t++) nseg += row_cache[t] != row_cache[t - 1];
      for (int64_t t0 = 0; t0 < T;) {
        int64_t t1 = t0 + 1;
        while (kvs && t1 < T && row_cache[t1] == row_cache[t0]) t1++;
        if (!kvs) t1 = T;
        const int64_t n = t1 - t0;
        const int64_t nb = std::min(n, std::max((2 * nthreads + KV * nseg - 1) / (KV * nseg), (n * G + 31) / 32));
        for (int64_t b = 0; b < nb; b++) blk.push_back(t0 + b * n / nb);
        rmax = std::max(rmax, (n + nb - 1) / nb * G);
        t0 = t1;
      }
      blk.push_back(T);
    }
    const int64_t nblk = tiled ? (int64_t)blk.size() - 1 : 0, per_thread = rmax * (Sp + hd + 2);
    auto group_fn = NVh == 2 ? attend_group<2, KT> : NVh == 4 ? attend_group<4, KT>
                    : NVh == 8 ? attend_group<8, KT> : attend_group<16, KT>;
    std::vector<float> scratch;
    if (tiled) scratch.resize((size_t)nthreads * per_thread);
    else probs.resize((size_t)nthreads * 4 * Sp);
    for (int64_t li = 0; li < n_layers; li++) {
      const uint64_t* P = table + li * NPTR;
      const int* wt = wtypes + li * 4;
      // the layer's cache of row t
      auto cache_of = [&](int64_t t) { return (KT*)(kvs ? kvs[row_cache[t] * n_layers + li] : P[P_KV]); };
      if (!flags[2 * li]) {
        rmsnorm_rows(h, (const float*)P[P_ATTN_NORM], x.data(), T, D, eps);
        linear_any(wt[0], x.data(), T, D, (const void*)P[P_WQKV], (const float*)P[P_WQKV_SCALE], NQKV, qkv.data(),
                   nthreads);
        const int64_t plane = KV * max_slots * hd;   // K, then V
        for (int64_t t = 0; t < T; t++) {
          float* r = qkv.data() + t * NQKV;
          KT* kv = cache_of(t);
          if (P[P_BQKV]) {
            const float* b = (const float*)P[P_BQKV];
            for (int64_t i = 0; i < NQKV; i++) r[i] += b[i];
          }
          rope_row(r, H + KV, hd, cos_t + t * (hd / 2), sin_t + t * (hd / 2));   // q and k heads
          for (int64_t g = 0; g < KV; g++) {
            kst(kv + (g * max_slots + slots[t]) * hd, r + (H + g) * hd, hd);
            kst(kv + plane + (g * max_slots + slots[t]) * hd, r + (H + KV + g) * hd, hd);
          }
        }
        if (tiled) {   // a pass of several tokens: items of (KV head, block of tokens), see attend_group
          swk_pool::parallel_for(KV * nblk, T * H * S * hd > 65536 ? nthreads : 1, [&](int64_t j, int tid) {
            const int64_t g = j / nblk, b = j % nblk, t0 = blk[b], t1 = blk[b + 1];
            float* w = scratch.data() + (size_t)tid * per_thread;
            float *p = w, *o = p + rmax * Sp, *den = o + rmax * hd, *mx = den + rmax;
            const KT* kv = cache_of(t0);
            const KT *Kg = kv + g * max_slots * hd, *Vg = kv + plane + g * max_slots * hd;
            const int64_t e = *std::max_element(ext.begin() + t0, ext.begin() + t1);
            group_fn(qkv.data(), NQKV, t0, t1, g, G, H, Kg, Vg, vis, S, e, scale, p, Sp, o, den, mx, att.data());
          });
        } else {
          // work items of up to 4 query heads sharing a KV head (one token), where there are enough to keep every
          // thread busy (a decode step keeps one head per item); a head's result is the same bits either way
          const int64_t per = grouped ? 4 : 1, chunks = (G + per - 1) / per, work = T * KV * chunks;
          swk_pool::parallel_for(work, T * H * S * hd > 65536 ? nthreads : 1, [&](int64_t j, int tid) {
            const int64_t t = j / (KV * chunks), g = j / chunks % KV, h0 = g * G + j % chunks * per;
            const int64_t nh = std::min(per, g * G + G - h0), e = ext[t];
            float* p = probs.data() + (size_t)tid * 4 * Sp;
            const float* q = qkv.data() + t * NQKV + h0 * hd;
            const KT* kv = cache_of(t);
            const KT *Kg = kv + g * max_slots * hd, *Vg = kv + plane + g * max_slots * hd;
            float* out = att.data() + (t * H + h0) * hd;
#if SWK_W == 16
            if (nh == 4) return attend_heads<4, KT>(q, Kg, Vg, vis + t * S, e, scale, p, Sp, out);
            if (nh == 3) return attend_heads<3, KT>(q, Kg, Vg, vis + t * S, e, scale, p, Sp, out);
            if (nh == 2) return attend_heads<2, KT>(q, Kg, Vg, vis + t * S, e, scale, p, Sp, out);
#endif
            for (int64_t i = 0; i < nh; i++)
              attend_row(q + i * hd, Kg, Vg, vis + t * S, e, hd, scale, p, out + i * hd);
          });
        }
        linear_any(wt[1], att.data(), T, H * hd, (const void*)P[P_WO], (const float*)P[P_WO_SCALE], D, o.data(),
                   nthreads);
        for (int64_t i = 0; i < T * D; i++) h[i] += o[i];
      }
      if (!flags[2 * li + 1]) {
        rmsnorm_rows(h, (const float*)P[P_MLP_NORM], x.data(), T, D, eps);
        linear_any(wt[2], x.data(), T, D, (const void*)P[P_WGU], (const float*)P[P_WGU_SCALE], 2 * I, gu.data(),
                   nthreads);
        for (int64_t t = 0; t < T; t++) {   // SwiGLU: silu(gate) * up
          const float* g = gu.data() + t * 2 * I;
          float* a = act.data() + t * I;
          int64_t i = 0;
          for (; i + SWK_W <= I; i += SWK_W) {
            const vec gv = vld(g + i);
            const vec e = vexp(vmul(gv, vset1(-1.0f)));
            vst(a + i, vmul(vdiv(gv, vadd(vset1(1.0f), e)), vld(g + I + i)));
          }
          for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * g[I + i];
        }
        linear_any(wt[3], act.data(), T, I, (const void*)P[P_WDOWN], (const float*)P[P_WDOWN_SCALE], D, o.data(),
                   nthreads);
        for (int64_t i = 0; i < T * D; i++) h[i] += o[i];
      }
    }
  } catch (const std::bad_alloc&) {
    return -2;   // SWK_CPU_ERR_NOMEM
  } catch (const BlockKernelFailed&) {
    return -2;
  }
  return 0;
}

}  // namespace

extern "C" {

// Runs layers [0, n_layers) of the table (the caller offsets it to its start layer) over residual h [T, D]
// (updated in place).
//   table: n_layers * NPTR addresses per layer, in enum order (P_BQKV and the *_SCALE entries may be 0; P_KV is
//          the layer's cache [2, KV, max_slots, hd] of kv_type); wtypes: n_layers * 4 (wqkv, wo, gate_up, down:
//          0 float32, 1 bfloat16, 2 int8 with its scale, 3 GGUF blocks: the address is a descriptor, see
//          linear_blocks); flags: n_layers * 2 bytes (attention, MLP skipped).
//   kv_type: the cache's elements, KV_F32 (float32) or KV_F16 (float16 bits: k and v rounded to nearest even when
//          written, widened exactly when read).
//   slots [T]: cache slot of each new token; cos/sin [T, hd/2]; vis [T, S] bytes: token t attends slot s
//          (every row sees at least one slot, S <= max_slots).
// Returns 0, -1 on bad arguments (nothing computed) or -2 out of memory (h and the cache partly written).
int swk_layers(int64_t n_layers, const uint64_t* table, const int* wtypes, const uint8_t* flags, int64_t T,
               int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, float eps, float scale, int64_t max_slots,
               const int64_t* slots, const float* cos_t, const float* sin_t, const uint8_t* vis, int64_t S,
               float* h, int nthreads, int kv_type) {
  auto run = kv_type == KV_F16 ? layers<uint16_t> : layers<float>;
  if (kv_type != KV_F32 && kv_type != KV_F16) return -1;
  return run(n_layers, table, wtypes, flags, T, D, H, KV, hd, I, eps, scale, max_slots, slots, cos_t, sin_t, vis, S,
             h, nthreads, 0, nullptr, nullptr);
}

// swk_layers over the rows of several sequences, each with its own cache (one pass reads every weight once for all
// of them): row t reads and writes the caches kvs[row_cache[t] * n_layers + l] (layer l's [2, KV, max_slots, hd];
// the table's P_KV entries are not read), slots[t] and vis[t] are in its cache's slots. row_cache [T] is
// nondecreasing in [0, n_caches). Each row's result is the one it gets in a pass of its own sequence alone.
int swk_layers_multi(int64_t n_layers, const uint64_t* table, const int* wtypes, const uint8_t* flags, int64_t T,
                     int64_t D, int64_t H, int64_t KV, int64_t hd, int64_t I, float eps, float scale,
                     int64_t max_slots, const int64_t* slots, const float* cos_t, const float* sin_t,
                     const uint8_t* vis, int64_t S, float* h, int nthreads, int64_t n_caches, const uint64_t* kvs,
                     const int64_t* row_cache, int kv_type) {
  auto run = kv_type == KV_F16 ? layers<uint16_t> : layers<float>;
  if (!kvs || (kv_type != KV_F32 && kv_type != KV_F16)) return -1;
  return run(n_layers, table, wtypes, flags, T, D, H, KV, hd, I, eps, scale, max_slots, slots, cos_t, sin_t, vis, S,
             h, nthreads, n_caches, kvs, row_cache);
}

// 1 (the default): passes of several tokens attend in tiles (attend_group); 0: per-token work items, as a decode
// step. The same bits either way; the switch exists for A/B timings and the tests that check that.
void swk_set_attention_tiles(int on) { g_attention_tiles = on != 0; }

// Addresses per layer in swk_layers' table.
int swk_layer_table_width(void) { return NPTR; }

}  // extern "C"
