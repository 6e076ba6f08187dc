// KV cache commit on the CPU: the accepted tree path's entries moved to the slots after the committed prefix, in
// every layer's K and V planes at once. Torch twin: swiftk/runtime/ops/reference.py `kv_commit`
// (tests/test_cpu_kv.py holds them equal).
//
// Why our own: torch's advanced-index copy over the whole cache is large enough for an OpenMP region, and libgomp
// keeps a thread team per calling thread: a decode on a server's worker thread left a pool of its own behind
// (tests/test_threads.py). The copy is small (rows x head_dim x planes floats), so it runs serially here.
#include <stdint.h>
#include <string.h>

#include <new>
#include <vector>

#if __has_include("swiftk_cpu.h")   // the public declaration: the compiler checks the definition against it
#include "swiftk_cpu.h"
#endif

extern "C" {

// cache [planes, S, hd] float32 (planes = layers x 2 x KV heads): in every plane, row src[i] -> row dst[i] for
// i < n, all sources read before any destination is written (overlapping ranges are safe). Returns 0, -1 on bad
// arguments (nothing written), -2 out of memory.
int swk_kv_commit(float* cache, int64_t planes, int64_t S, int64_t hd, const int64_t* src, const int64_t* dst,
                  int64_t n) {
  if (!cache || planes < 1 || S < 1 || hd < 1 || n < 0 || (n && (!src || !dst))) return -1;
  for (int64_t i = 0; i < n; i++)
    if (src[i] < 0 || src[i] >= S || dst[i] < 0 || dst[i] >= S) return -1;
  thread_local std::vector<float> rows;
  try {
    rows.resize((size_t)(n * hd));
  } catch (const std::bad_alloc&) {
    return -2;
  }
  const size_t bytes = sizeof(float) * (size_t)hd;
  for (int64_t p = 0; p < planes; p++) {
    float* plane = cache + p * S * hd;
    for (int64_t i = 0; i < n; i++) memcpy(rows.data() + i * hd, plane + src[i] * hd, bytes);
    for (int64_t i = 0; i < n; i++) memcpy(plane + dst[i] * hd, rows.data() + i * hd, bytes);
  }
  if (rows.size() > (1u << 20)) std::vector<float>().swap(rows);
  return 0;
}

}  // extern "C"
