// The MoA drafter (swiftk/moa/model.py) at generation time. swk_moa_step: one draft step for one token (its
// self-attention over the drafter's own token stream, the cross-attention to the target's verified states, the MLP
// and the projection to the target's hidden size). swk_moa_ingest: a round's catch-up on newly verified positions
// (their cross-attention keys/values and their self-attention keys/values). Torch twins: swiftk/moa/runner.py
// `MoARunner.step` / `MoARunner.sync` (tests/test_moa.py holds them equal to float32 rounding; the draft only
// proposes, the target's pass decides, so rounding never reaches the output).
//
// Why our own: in torch the step is ~100 ops on vectors of a few hundred floats, 25-35 us of dispatch each on a
// 2-core Zen 3 -- a third of a SmolLM2 decode step. Here it is one call that reads ~5 MB of float32 weights.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <new>
#include <vector>

#include "cpu_simd.h"

#if __has_include("swiftk_cpu.h")   // the public declaration: the compiler checks the definition against it
#include "swiftk_cpu.h"
#endif

namespace {

constexpr float EPS = 1e-6f;   // the drafter's RMSNorm epsilon (moa/model.py `rms`)

enum { TOK_IN, SA_NORM, SA_QKV, SA_OUT, CA_NORM, CA_Q, CA_SINK, CA_OUT, MLP_NORM, GATE_UP, DOWN, OUT_NORM, OUT,
       INV_FREQ, CA_KV, N_WEIGHTS };

float dot(const float* a, const float* b, int64_t n) {
  vec s0 = vzero(), s1 = vzero();
  int64_t i = 0;
  for (; i + 2 * SWK_W <= n; i += 2 * SWK_W) {
    s0 = vfma(vld(a + i), vld(b + i), s0);
    s1 = vfma(vld(a + i + SWK_W), vld(b + i + SWK_W), s1);
  }
  for (; i + SWK_W <= n; i += SWK_W) s0 = vfma(vld(a + i), vld(b + i), s0);
  if (i < n) s0 = vfma(vld_tail(a + i, (int)(n - i)), vld_tail(b + i, (int)(n - i)), s0);
  return vsum(vadd(s0, s1));
}

// Bytes of a weight matrix prefetched (into L2) ahead of the row being read: the target's pass between two rounds
// evicts the drafter's ~6 MB, and one thread's dot products over 1 KB rows leave DRAM idle without it.
constexpr int64_t AHEAD = 8192;

// y[o] (+)= W[o, :] . x for a row-major W [rows, cols] (torch's Linear weight)
void matvec(const float* W, const float* x, int64_t rows, int64_t cols, float* y, bool accumulate) {
  const char* base = (const char*)W;
  const int64_t bytes = rows * cols * (int64_t)sizeof(float);
  int64_t pf = 0;
  for (int64_t o = 0; o < rows; o++) {
    const int64_t want = (o + 1) * cols * (int64_t)sizeof(float) + AHEAD;
    for (; pf < want && pf < bytes; pf += 64) __builtin_prefetch(base + pf, 0, 2);
    float v = dot(W + o * cols, x, cols);
    y[o] = accumulate ? y[o] + v : v;
  }
}

void rmsnorm(const float* x, const float* w, int64_t n, float* y) {
  float ss = dot(x, x, n);
  float r = 1.0f / sqrtf(ss / (float)n + EPS);
  for (int64_t i = 0; i < n; i++) y[i] = x[i] * r * w[i];
}

// rotate-half RoPE of `heads` vectors of hd floats at position pos (moa/model.py `rope`)
void rope(float* x, int64_t heads, int64_t hd, int64_t pos, const float* inv_freq) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < half; j++) {
    float a = (float)pos * inv_freq[j], c = cosf(a), s = sinf(a);
    for (int64_t h = 0; h < heads; h++) {
      float* v = x + h * hd;
      float x1 = v[j], x2 = v[j + half];
      v[j] = x1 * c - x2 * s;
      v[j + half] = x2 * c + x1 * s;
    }
  }
}

// o [heads, hd] = softmax(q . k / sqrt(hd)) v per head, over an optional always-visible first key/value (sink_k,
// sink_v [heads, hd]) and then S rows of k, v [S, heads, hd]
void attend(const float* q, const float* sink_k, const float* sink_v, const float* k, const float* v, int64_t S,
            int64_t heads, int64_t hd, float* scores, float* o) {
  const float scale = 1.0f / sqrtf((float)hd);
  const int64_t d = heads * hd, first = sink_k ? 1 : 0;
  for (int64_t h = 0; h < heads; h++) {
    const float* qh = q + h * hd;
    float mx = -INFINITY;
    if (sink_k) mx = scores[0] = dot(qh, sink_k + h * hd, hd) * scale;
    for (int64_t j = 0; j < S; j++) {
      float s = dot(qh, k + j * d + h * hd, hd) * scale;
      scores[first + j] = s;
      mx = s > mx ? s : mx;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < S + first; j++) sum += (scores[j] = expf(scores[j] - mx));
    float* oh = o + h * hd;
    for (int64_t i = 0; i < hd; i++) oh[i] = 0.0f;
    for (int64_t j = 0; j < S + first; j++) {
      const float* vj = (sink_v && j == 0) ? sink_v + h * hd : v + (j - first) * d + h * hd;
      const float wj = scores[j] / sum;
      for (int64_t i = 0; i < hd; i++) oh[i] += wj * vj[i];
    }
  }
}

}  // namespace

extern "C" {

// w: the N_WEIGHTS float32 tensors above in that order (Linear weights row-major [out, in]; ca_sink [2, d]: the
// sink's key, then its value; inv_freq [hd / 2]; ca_kv [2 d, lsa_dim] is read by swk_moa_ingest only); dims: {hidden D, width d, heads, mlp}. emb [D]: the token's
// target embedding at position p; sa_k, sa_v [>= p + 1, d]: the stream's rotated keys and values (row p written
// here); ca_k, ca_v [n, d]: the verified positions' cross-attention keys (rotated) and values; anchor [d] or null:
// the anchor term added after self-attention. out [D]: the predicted activation. Returns 0, -1 on bad arguments,
// -2 out of memory.
int swk_moa_step(const float* const* w, const int64_t* dims, const float* emb, int64_t p, int64_t n, float* sa_k,
                 float* sa_v, const float* ca_k, const float* ca_v, const float* anchor, float* out) {
  if (!w || !dims || !emb || !sa_k || !sa_v || !out || p < 0 || n < 0 || (n && (!ca_k || !ca_v))) return -1;
  for (int i = 0; i < N_WEIGHTS; i++)
    if (!w[i]) return -1;
  const int64_t D = dims[0], d = dims[1], heads = dims[2], m = dims[3];
  if (D < 1 || d < 1 || heads < 1 || m < 1 || d % heads || (d / heads) % 2) return -1;
  const int64_t hd = d / heads, S = (p + 1 > n + 1 ? p + 1 : n + 1);
  thread_local std::vector<float> buf;
  try {
    buf.resize((size_t)(3 * d + 3 * d + 2 * m + m + S));
  } catch (const std::bad_alloc&) {
    return -2;
  }
  float *x = buf.data(), *t = x + d, *o = t + d, *qkv = o + d, *gu = qkv + 3 * d, *mid = gu + 2 * m,
        *scores = mid + m;
  // the token stream: x = tok_in(emb); q, k, v of rms(x), rotated; row p of the stream's cache
  matvec(w[TOK_IN], emb, d, D, x, false);
  rmsnorm(x, w[SA_NORM], d, t);
  matvec(w[SA_QKV], t, 3 * d, d, qkv, false);
  rope(qkv, heads, hd, p, w[INV_FREQ]);
  rope(qkv + d, heads, hd, p, w[INV_FREQ]);
  memcpy(sa_k + p * d, qkv + d, (size_t)d * sizeof(float));
  memcpy(sa_v + p * d, qkv + 2 * d, (size_t)d * sizeof(float));
  attend(qkv, nullptr, nullptr, sa_k, sa_v, p + 1, heads, hd, scores, o);   // prefix and chain: all visible
  matvec(w[SA_OUT], o, d, d, x, true);
  if (anchor)
    for (int64_t i = 0; i < d; i++) x[i] += anchor[i];
  // cross-attention to the verified states, behind the sink
  rmsnorm(x, w[CA_NORM], d, t);
  matvec(w[CA_Q], t, d, d, qkv, false);
  rope(qkv, heads, hd, p, w[INV_FREQ]);
  attend(qkv, w[CA_SINK], w[CA_SINK] + d, ca_k, ca_v, n, heads, hd, scores, o);
  matvec(w[CA_OUT], o, d, d, x, true);
  // MLP (SwiGLU), then the projection to the target's hidden size
  rmsnorm(x, w[MLP_NORM], d, t);
  matvec(w[GATE_UP], t, 2 * m, d, gu, false);
  for (int64_t i = 0; i < m; i++) mid[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[m + i];
  matvec(w[DOWN], mid, d, m, x, true);
  rmsnorm(x, w[OUT_NORM], d, t);
  matvec(w[OUT], t, D, d, out, false);
  return 0;
}

// w, dims: as swk_moa_step's, dims with a fifth entry lsa_dim a. For the t positions p0 .. p0 + t - 1: feats [t, a]
// their LSA features (the torch side computes them: one batched pass over the target's layers), emb [t, D] their
// tokens' target embeddings. Writes rows p0 .. p0 + t - 1 of ca_k, ca_v (the cross-attention keys, rotated, and
// values) and of sa_k, sa_v (the stream's own keys, rotated, and values), each [>= p0 + t, d]. Returns 0, -1 on bad
// arguments, -2 out of memory.
int swk_moa_ingest(const float* const* w, const int64_t* dims, const float* feats, const float* emb, int64_t p0,
                   int64_t t, float* ca_k, float* ca_v, float* sa_k, float* sa_v) {
  if (!w || !dims || !feats || !emb || !ca_k || !ca_v || !sa_k || !sa_v || p0 < 0 || t < 0) return -1;
  for (int i = 0; i < N_WEIGHTS; i++)
    if (!w[i]) return -1;
  const int64_t D = dims[0], d = dims[1], heads = dims[2], a = dims[4];
  if (D < 1 || d < 1 || heads < 1 || a < 1 || d % heads || (d / heads) % 2) return -1;
  const int64_t hd = d / heads;
  thread_local std::vector<float> buf;
  try {
    buf.resize((size_t)(4 * d));
  } catch (const std::bad_alloc&) {
    return -2;
  }
  float *x = buf.data(), *kv = x + d, *u = kv + 2 * d;
  for (int64_t i = 0; i < t; i++) {
    const int64_t p = p0 + i;
    matvec(w[CA_KV], feats + i * a, 2 * d, a, kv, false);     // cross-attention: k then v of the features
    rope(kv, heads, hd, p, w[INV_FREQ]);
    memcpy(ca_k + p * d, kv, (size_t)d * sizeof(float));
    memcpy(ca_v + p * d, kv + d, (size_t)d * sizeof(float));
    matvec(w[TOK_IN], emb + i * D, d, D, x, false);           // the stream: k, v of rms(tok_in(emb)); q unused
    rmsnorm(x, w[SA_NORM], d, u);
    matvec(w[SA_QKV] + d * d, u, 2 * d, d, kv, false);
    rope(kv, heads, hd, p, w[INV_FREQ]);
    memcpy(sa_k + p * d, kv, (size_t)d * sizeof(float));
    memcpy(sa_v + p * d, kv + d, (size_t)d * sizeof(float));
  }
  return 0;
}

}  // extern "C"
