// The kernels' thread pool (kernels/cpu/cpu_pool.cpp): one per process, owned by the library, whatever thread
// calls in. It replaces OpenMP, whose libgomp keeps one pool per thread that opens a parallel region: once a
// worker thread of the host (a server, a stream, a C++ host's thread) and the main thread each had one, the
// process managed more threads than a 2-CPU machine has, libgomp throttled every spin-wait, and each of the ~130
// regions of a decode step paid a sleep and a wake-up (a worker thread decoded at ~40% of the main thread's speed).
//
// parallel_for(n, nt, f) calls f(i, tid) for i in [0, n) with OpenMP's static schedule (thread tid takes one
// contiguous chunk, the first n % nt threads one item more); the calling thread is tid 0. A region started inside
// another runs on the calling thread alone. Bodies must not throw (as in an OpenMP region).
#pragma once

#include <stdint.h>

#include <type_traits>

namespace swk_pool {

typedef void (*range_fn)(void* ctx, int64_t begin, int64_t end, int tid);

// Runs fn over [0, n) on nt threads (nt <= 1 or n <= 1: on the caller, inline).
void run(int64_t n, int nt, range_fn fn, void* ctx);

// The default thread count of regions that are not given one (swk_set_threads; 1 until set).
int threads();

// [begin, end) of thread tid of nt over n items: OpenMP's schedule(static)
inline void chunk(int64_t n, int nt, int tid, int64_t& begin, int64_t& end) {
  const int64_t q = n / nt, r = n % nt;
  begin = q * tid + (tid < r ? tid : r);
  end = begin + q + (tid < r ? 1 : 0);
}

// f(begin, end, tid) once per thread over its chunk of [0, n) (per-thread state lives in f's frame)
template <class F>
void parallel_range(int64_t n, int nt, F&& f) {
  using T = std::remove_reference_t<F>;
  run(n, nt, [](void* c, int64_t b, int64_t e, int tid) { (*(T*)c)(b, e, tid); }, (void*)&f);
}

// f(i, tid) for every i in [0, n)
template <class F>
void parallel_for(int64_t n, int nt, F&& f) {
  parallel_range(n, nt, [&f](int64_t b, int64_t e, int tid) {
    for (int64_t i = b; i < e; i++) f(i, tid);
  });
}

}  // namespace swk_pool
