// Integer dot products on GGUF blocks, the entry points (the matmul: cpu_qdot.h; the formats, one file per family:
// cpu_qdot_q4.cpp, cpu_qdot_q58.cpp, cpu_qdot_q4k.cpp, cpu_qdot_q5k.cpp, cpu_qdot_q6k.cpp).
#include "cpu_qdot.h"

namespace {

using namespace swk_gguf;
using namespace swk_qdot;

// ref: the scalar definition on the file's layout (w not packed)
int run(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y, int64_t ldy, bool ref) {
  if (!x || !w || !y || M < 1 || K < 1 || N < 1 || ldy < N) return -1;
  const int bs = block_size(type);
  if (bs < 0) return -2;
  if (K % bs) return -3;
  thread_local QX X;   // reused across calls: a decode step allocates nothing
  try {   // buffers are sized before any parallel region, so a failed allocation lands here (no exception crosses C)
    quantize(x, M, K, X, !ref);
    const uint8_t* wb = (const uint8_t*)w;
    by_type(type, [&](auto t) {
      constexpr int T = decltype(t)::value;
      if (ref) linear_ref<T>(X, wb, N, y, ldy);
      else linear<T>(X, wb, N, y, ldy, false);
    });
  } catch (const std::bad_alloc&) {
    X = QX();
    return -4;
  }
  if (X.q.size() > (1u << 22)) X = QX();   // a prefill's copy is not kept past its call
  return 0;
}

}  // namespace

#if __has_include("swiftk_cpu.h")   // the public declarations: the compiler checks the definitions against them
#include "swiftk_cpu.h"
#endif

extern "C" {

// 3 (AVX-512 VNNI: small passes on 512-bit vectors), 2 (256-bit vpdpbusd), 1 (AVX2), 0 (portable): this build's path.
int swk_qi_isa(void) { return SWI_SIMD ? (SWI_V512 ? 3 : SWI_VNNI ? 2 : 1) : 0; }

// dst [N, K / block_size * type_size] bytes = src (a matrix of ggml type `type` in the file's layout) repacked for
// swk_qi_linear_ld: rows in groups of 8, each block's fields of the 8 rows side by side (the file header says how);
// rows past the last full group copied as they are. Returns 0, -1 (bad arguments), -2 (type), -3 (K).
int swk_qi_repack(int type, const void* src, int64_t N, int64_t K, void* dst) {
  if (!src || !dst || N < 1 || K < 1 || src == dst) return -1;
  const int bs = block_size(type);
  if (bs < 0) return -2;
  if (K % bs) return -3;
  return by_type(type, [&](auto t) { repack<decltype(t)::value>((const uint8_t*)src, N, K, (uint8_t*)dst); });
}

// out[i] = row ids[i] (0 <= ids[i] < N) of a packed matrix, in the file's layout (K / block_size * type_size bytes).
int swk_qi_unpack_rows(int type, const void* packed, int64_t N, int64_t K, const int64_t* ids, int64_t n, void* out) {
  if (!packed || !out || !ids || N < 1 || K < 1 || n < 0) return -1;
  const int bs = block_size(type);
  if (bs < 0) return -2;
  if (K % bs) return -3;
  for (int64_t i = 0; i < n; i++)
    if (ids[i] < 0 || ids[i] >= N) return -1;
  try {
    return by_type(type, [&](auto t) {
      unpack_rows<decltype(t)::value>((const uint8_t*)packed, N, K, ids, n, (uint8_t*)out);
    });
  } catch (const std::bad_alloc&) {
    return -4;
  }
}

// y[M, N] (float32, ldy floats per row) = x[M, K] (float32) @ W^T with x quantized to int8 as the file header says,
// W = N rows of ggml type `type` packed by swk_qi_repack. Return codes as swk_q_linear_ld (0 done; -1 null pointer
// or bad size; -2 unknown type; -3 K not a multiple of the block size; -4 out of memory). Threads: swk_set_threads'.
int swk_qi_linear_ld(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y,
                     int64_t ldy) {
  return run(x, M, K, w, type, N, y, ldy, false);
}

// The scalar definition of swk_qi_linear_ld, on W in the file's layout (not packed): equal to it bit for bit.
int swk_qi_linear_ref(const float* x, int64_t M, int64_t K, const void* w, int type, int64_t N, float* y,
                      int64_t ldy) {
  return run(x, M, K, w, type, N, y, ldy, true);
}

// The activation quantizer alone: q [M, K] int8, d [M, K / 32] float32; simd 0 runs the scalar definition. Returns
// 0, or -1 on bad arguments (K must be a multiple of 32).
int swk_qi_quantize(const float* x, int64_t M, int64_t K, int simd, int8_t* q, float* d) {
  if (!x || !q || !d || M < 1 || K < 1 || K % 32) return -1;
  try {
    QX X;
    quantize(x, M, K, X, simd != 0);
    memcpy(q, X.q.data(), X.q.size());
    memcpy(d, X.d.data(), X.d.size() * sizeof(float));
  } catch (const std::bad_alloc&) {
    return -4;
  }
  return 0;
}

}  // extern "C"
