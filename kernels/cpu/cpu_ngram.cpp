// Corpus n-gram drafts (swiftk/proposers/datastore.py): a chain continuing a context from exact n-gram tables, each
// token the most frequent follower of the context's longest known suffix (n = max_n .. 1). Python twin:
// Datastore.propose (tests/test_datastore.py compares them).
//
// Why compiled: the chain's table searches ran as numpy calls, 60 us a round in the decode loop (cold caches after
// a pass), ~2.5% of a SmolLM2 step, on every round the source is consulted, most of which draft nothing.
#include <stdint.h>

namespace {

// index of key in the sorted keys[0, n), or -1
inline int64_t find_key(const int64_t* keys, int64_t n, int64_t key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (keys[mid] < key) lo = mid + 1;
    else hi = mid;
  }
  return lo < n && keys[lo] == key ? lo : -1;
}

}  // namespace

#if __has_include("swiftk_cpu.h")   // the public declarations: the compiler checks the definitions against them
#include "swiftk_cpu.h"
#endif

extern "C" {

// tables[4 * (n - 1) + f] for n = 1 .. max_n: keys, next token, its count, the key's count (int64, sorted keys),
// lens[n - 1] entries each. ctx: the last nctx (<= max_n) tokens. prob[nbuckets]: the estimate per bucket, or null.
// Writes up to k tokens and their buckets; returns how many. Stops where the context's last token is out of
// [0, 2^bits) or no suffix is known, and (with prob) before a token whose chain value falls under floor (the first
// token always stays).
int swk_ngram_propose(const int64_t* const* tables, const int64_t* lens, int max_n, int bits, const int64_t* ctx,
                      int nctx, int k, const double* prob, int nbuckets, double floor, int64_t* out_tok,
                      int32_t* out_bucket) {
  if (max_n < 1 || max_n > 4 || nctx < 0 || nctx > max_n || k < 0 || bits < 1 || bits * max_n > 63) return -1;
  int64_t c[4];
  int nc = nctx;
  for (int i = 0; i < nc; i++) c[i] = ctx[i];
  double value = 1.0;
  int got = 0;
  const int64_t lim = (int64_t)1 << bits;
  while (got < k) {
    int64_t tok = -1, n_hit = 0;
    double share = 0.0;
    for (int n = nc < max_n ? nc : max_n; n >= 1 && tok < 0; n--) {
      const int64_t* keys = tables[4 * (n - 1)];
      const int64_t len = lens[n - 1];
      if (len <= 0) continue;
      int64_t key = 0;
      bool bad = false;
      for (int i = nc - n; i < nc; i++) {
        if (c[i] < 0 || c[i] >= lim) { bad = true; break; }
        key = (key << bits) | c[i];
      }
      if (bad) return got;   // as the Python twin: an id outside the tables' range ends the chain
      const int64_t at = find_key(keys, len, key);
      if (at >= 0) {
        tok = tables[4 * (n - 1) + 1][at], n_hit = n;
        share = (double)tables[4 * (n - 1) + 2][at] / (double)tables[4 * (n - 1) + 3][at];
      }
    }
    if (tok < 0) break;
    const int b = (int)(n_hit - 1) * 4 + (share >= 0.25) + (share >= 0.5) + (share >= 0.75);   // datastore.bucket
    if (prob != nullptr) {
      if (b >= nbuckets) return -1;
      value *= prob[b];
      if (got > 0 && value < floor) break;
    }
    out_tok[got] = tok, out_bucket[got] = b, got++;
    if (nc >= max_n) {
      for (int i = 1; i < nc; i++) c[i - 1] = c[i];
      c[nc - 1] = tok;
    } else {
      c[nc++] = tok;
    }
  }
  return got;
}

}  // extern "C"
