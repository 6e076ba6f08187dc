// Top-k indices per row of a float32 matrix: the greedy choice (k = 1) and Token Recycling's successor rows (k = 8)
// after every decode step and verify pass. Torch twin: torch.topk / torch.argmax (tests/test_cpu_topk.py).
//
// Why our own: torch's CPU argmax and topk are several times slower than one vector pass over a vocabulary row, and
// they run every round, beside a small model's decode step (measured: bench/results/history.md).
//
// Order: larger first; equal values by lower index (torch.argmax's "first maximal value"); NaN counts as larger
// than every number (torch's max reductions propagate it), so a NaN row's argmax is its first NaN.
#include <math.h>
#include <stdint.h>

#include "cpu_pool.h"
#include "cpu_simd.h"

#include <new>

namespace {

inline bool before(float a, int64_t ia, float b, int64_t ib) {  // a at ia sorts before b at ib
  const bool na = a != a, nb = b != b;
  if (na || nb) return na && (!nb || ia < ib);
  return a > b || (a == b && ia < ib);
}

// One row (or the slice [i0, V) of one: indices stay the row's): the k best (value, index) kept sorted in (v, ix); a
// vector pass skips every SWK_W elements none of which beats the current k-th (strictly: a later equal value loses the
// tie), so insertions are rare after the start. Returns how many it kept (k, or fewer in a short slice).
int row_topk(const float* x, int64_t V, int k, int64_t* out, int64_t i0 = 0, float* out_v = nullptr) {
  float v[64];
  int64_t ix[64];
  int n = 0;
  auto offer = [&](float a, int64_t i) {
    if (n == k && !before(a, i, v[k - 1], ix[k - 1])) return;
    int p = n < k ? n++ : k - 1;
    while (p > 0 && before(a, i, v[p - 1], ix[p - 1])) {
      v[p] = v[p - 1];
      ix[p] = ix[p - 1];
      p--;
    }
    v[p] = a;
    ix[p] = i;
  };
  int64_t i = i0;
  for (; i < V && n < k; i++) offer(x[i], i);
  for (; i + SWK_W <= V; i += SWK_W) {
    // lanes that may enter: greater than the k-th, or NaN
    const unsigned m = vmask_gt_or_nan(vld(x + i), v[k - 1]);
    if (m)
      for (int j = 0; j < SWK_W; j++)
        if (m >> j & 1) offer(x[i + j], i + j);
  }
  for (; i < V; i++) offer(x[i], i);
  for (int j = 0; j < n; j++) out[j] = ix[j];
  if (out_v)
    for (int j = 0; j < n; j++) out_v[j] = v[j];
  return n;
}

// Rows long enough that a second thread pays for its start: a step's logits row is read while it is still in the
// cache of the core that wrote it (the LM head splits its columns the same way), ~2x on 2 threads.
constexpr int64_t PAR_MIN = 1 << 15;
constexpr int MAX_PARTS = 64;

// Each row cut into `parts` slices scanned in parallel, then the slices' top k merged. (value, index) pairs are
// totally ordered by before(), so the merge keeps exactly the k a single pass keeps, in the same order.
// Returns false (nothing written) when its buffers cannot be had: no exception may cross the C ABI.
bool topk_parallel(const float* x, const int64_t* rows, int64_t M, int64_t V, int k, int64_t* out, int parts) {
  const int64_t chunk = ((V + parts - 1) / parts + 7) / 8 * 8;
  int64_t* ci = new (std::nothrow) int64_t[M * parts * k];
  float* cv = new (std::nothrow) float[M * parts * k];
  int* cn = new (std::nothrow) int[M * parts];
  if (!ci || !cv || !cn) {
    delete[] ci;
    delete[] cv;
    delete[] cn;
    return false;
  }
  swk_pool::parallel_for(M * parts, parts, [&](int64_t w, int) {
    const int64_t m = w / parts, lo = (w % parts) * chunk, hi = lo + chunk < V ? lo + chunk : V;
    const float* row = x + (rows ? rows[m] : m) * V;
    cn[w] = lo < hi ? row_topk(row, hi, k, ci + w * k, lo, cv + w * k) : 0;
  });
  for (int64_t m = 0; m < M; m++) {
    int at[MAX_PARTS] = {0};
    for (int j = 0; j < k; j++) {
      int best = -1;
      for (int p = 0; p < parts; p++) {
        const int64_t w = m * parts + p;
        if (at[p] >= cn[w]) continue;
        const int64_t b = w * k + at[p];
        if (best < 0 || before(cv[b], ci[b], cv[(m * parts + best) * k + at[best]], ci[(m * parts + best) * k + at[best]]))
          best = p;
      }
      out[m * k + j] = ci[(m * parts + best) * k + at[best]];
      at[best]++;
    }
  }
  delete[] ci;
  delete[] cv;
  delete[] cn;
  return true;
}

// out[M, k] int64 = indices of the k largest of rows rows[0..M) (all M rows in order when rows is null) of x[., V]
// (row-major, float32), in the order above; 1 <= k <= min(V, 64).
void topk(const float* x, const int64_t* rows, int64_t M, int64_t V, int k, int64_t* out) {
  int parts = swk_pool::threads();
  parts = parts < MAX_PARTS ? parts : MAX_PARTS;
  if (parts > 1 && V >= PAR_MIN && V / parts >= 8 * k && topk_parallel(x, rows, M, V, k, out, parts)) return;
  for (int64_t m = 0; m < M; m++) row_topk(x + (rows ? rows[m] : m) * V, V, k, out + m * k);
}

}  // namespace

#if __has_include("swiftk_cpu.h")   // the public declarations: the compiler checks the definitions against them
#include "swiftk_cpu.h"
#endif

extern "C" {

// out[M, k] int64 = indices of the k largest of each row of x[M, V] (row-major, float32), in the order above;
// 1 <= k <= min(V, 64). Returns 0, or -1 on bad arguments (nothing written).
int swk_topk_rows(const float* x, int64_t M, int64_t V, int k, int64_t* out) {
  if (!x || !out || M < 1 || V < 1 || k < 1 || k > 64 || k > V) return -1;
  topk(x, nullptr, M, V, k, out);
  return 0;
}

// Token Recycling's update in one call: the top k of rows rows[m] of x[N, V] go, as int32, to row table_rows[m] of
// table[T, k] (m in order: a token read twice keeps its later row). Returns 0, or -1 on bad arguments, an index
// out of range or no memory (nothing written).
int swk_topk_into(const float* x, int64_t N, int64_t V, const int64_t* rows, int64_t M, int k, int32_t* table,
                  int64_t T, const int64_t* table_rows) {
  if (!x || !rows || !table || !table_rows || N < 1 || M < 1 || V < 1 || k < 1 || k > 64 || k > V) return -1;
  for (int64_t m = 0; m < M; m++)
    if (rows[m] < 0 || rows[m] >= N || table_rows[m] < 0 || table_rows[m] >= T) return -1;
  int64_t* out = new (std::nothrow) int64_t[M * k];   // no exception may cross the C ABI
  if (!out) return -1;
  topk(x, rows, M, V, k, out);
  for (int64_t m = 0; m < M; m++)
    for (int j = 0; j < k; j++) table[table_rows[m] * k + j] = int32_t(out[m * k + j]);
  delete[] out;
  return 0;
}

// Greedy acceptance of a verified tree in one call (sample/rejection.py's walk, its Python twin): node i (parents
// in topological order, parents[0] = -1) is accepted when its parent was and tokens[i] is the argmax of the parent's
// row of x[N, V]; the deepest accepted node wins (the lowest index among equally deep ones). Only accepted nodes'
// rows are reduced, in the order above: a round that accepts a tokens reads a + 1 rows of the N, where the host
// walk read them all, then crossed into Python and back three times (~120 us a verify round in the loop, 1-3% of a
// SmolLM2 round). path[0 .. L) = root .. deepest, *bonus = the deepest's argmax; returns L, or -1 on bad arguments
// (a parent out of order, N or V < 1, no memory; nothing written).
int64_t swk_greedy_path(const float* x, int64_t N, int64_t V, const int64_t* parents, const int64_t* tokens,
                        int64_t* path, int64_t* bonus) {
  if (!x || !parents || !tokens || !path || !bonus || N < 1 || V < 1 || parents[0] != -1) return -1;
  for (int64_t i = 1; i < N; i++)
    if (parents[i] < 0 || parents[i] >= i) return -1;
  int64_t* top = new (std::nothrow) int64_t[N];   // no exception may cross the C ABI
  int64_t* depth = new (std::nothrow) int64_t[N];
  if (!top || !depth) {
    delete[] top;
    delete[] depth;
    return -1;
  }
  for (int64_t i = 0; i < N; i++) top[i] = depth[i] = -1;
  auto argmax = [&](int64_t r) {
    if (top[r] < 0) topk(x, &r, 1, V, 1, &top[r]);
    return top[r];
  };
  depth[0] = 0;
  int64_t best = 0;
  for (int64_t i = 1; i < N; i++) {
    const int64_t p = parents[i];
    if (depth[p] >= 0 && tokens[i] == argmax(p)) {
      depth[i] = depth[p] + 1;
      if (depth[i] > depth[best]) best = i;
    }
  }
  *bonus = argmax(best);
  const int64_t L = depth[best] + 1;
  for (int64_t i = best, j = L - 1; j >= 0; i = parents[i], j--) path[j] = i;
  delete[] top;
  delete[] depth;
  return L;
}

}  // extern "C"
