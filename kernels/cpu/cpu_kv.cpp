// KV cache commit on the CPU: the accepted tree path's entries moved to the slots after the committed prefix, in
// every layer's K and V planes at once, whatever the cache's element type. Torch twin:
// swiftk/runtime/ops/reference.py `kv_commit` (tests/test_cpu_kv.py holds them equal).
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

// cache [planes, S, row_bytes] (planes = layers x 2 x KV heads; a row is one slot's head_dim elements of the
// cache's type): in every plane, row src[i] -> row dst[i] for i < n, all sources read before any destination is
// written (overlapping ranges are safe). Returns 0, -1 on bad arguments (nothing written), -2 out of memory.
int swk_kv_commit(void* cache, int64_t planes, int64_t S, int64_t row_bytes, const int64_t* src, const int64_t* dst,
                  int64_t n) {
  if (!cache || planes < 1 || S < 1 || row_bytes < 1 || n < 0 || (n && (!src || !dst))) return -1;
  for (int64_t i = 0; i < n; i++)
    if (src[i] < 0 || src[i] >= S || dst[i] < 0 || dst[i] >= S) return -1;
  thread_local std::vector<uint8_t> rows;
  try {
    rows.resize((size_t)(n * row_bytes));
  } catch (const std::bad_alloc&) {
    return -2;
  }
  const size_t bytes = (size_t)row_bytes;
  for (int64_t p = 0; p < planes; p++) {
    uint8_t* plane = (uint8_t*)cache + p * S * row_bytes;
    for (int64_t i = 0; i < n; i++) memcpy(rows.data() + i * bytes, plane + src[i] * bytes, bytes);
    for (int64_t i = 0; i < n; i++) memcpy(plane + dst[i] * bytes, rows.data() + i * bytes, bytes);
  }
  if (rows.size() > (4u << 20)) std::vector<uint8_t>().swap(rows);
  return 0;
}

}  // extern "C"
