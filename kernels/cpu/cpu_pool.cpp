// The kernels' thread pool (see cpu_pool.h for why it is not OpenMP's).
//
// Workers are created by the first region that asks for them and live as long as the process. A region is
// published by bumping a generation counter; every worker runs its chunk (or none, when the region asks for fewer
// threads than exist) and counts down. After a region a worker spins for a while before it sleeps on a condition
// variable: a decode step's regions come microseconds apart, and the host's work between two steps (the round in
// Python, ~0.1-1 ms) fits in the spin, so a step never waits for a wake-up. One region runs at a time; callers on
// other threads queue on a mutex.
#include "cpu_pool.h"

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void relax() { _mm_pause(); }
#else
static inline void relax() {}
#endif

namespace swk_pool {
namespace {

constexpr int MAX_THREADS = 256;
// How long an idle worker spins before it sleeps: long enough to span the host's work between two decode steps,
// short enough that an idle server does not hold a core for long.
constexpr std::chrono::microseconds SPIN{2000};

thread_local bool t_inside = false;   // this thread runs a region's chunk: a region started here runs inline

struct Pool {
  std::mutex submit;                   // one region at a time
  std::atomic<uint64_t> gen{0};        // bumped once per region
  std::atomic<int> left{0};            // workers that have not finished the current region
  std::atomic<int> sleepers{0};
  std::mutex sleep_m;
  std::condition_variable sleep_cv;
  // the current region: written before gen is bumped, read by the workers after they see it
  range_fn fn = nullptr;
  void* ctx = nullptr;
  int64_t n = 0;
  int nt = 1;
  int workers = 0;                     // pool threads, tids 1..workers
};

// Never destroyed (workers may still wait on it while the process exits); replaced in a forked child, which has
// none of the parent's threads and may have copied a locked mutex.
std::atomic<Pool*> g_pool{nullptr};
std::atomic<int> g_threads{1};
std::once_flag g_once;

void after_fork_child() { g_pool.store(new Pool()); }

Pool& pool() {
  std::call_once(g_once, [] {
    g_pool.store(new Pool());
    pthread_atfork(nullptr, nullptr, after_fork_child);
  });
  return *g_pool.load();
}

void worker_main(Pool* P, int tid, uint64_t seen) {
  t_inside = true;
  for (;;) {
    uint64_t g;
    auto t0 = std::chrono::steady_clock::now();
    for (unsigned k = 1;; k++) {
      g = P->gen.load(std::memory_order_acquire);
      if (g != seen) break;
      relax();
      if ((k & 255) == 0 && std::chrono::steady_clock::now() - t0 > SPIN) {
        std::unique_lock<std::mutex> lk(P->sleep_m);
        P->sleepers.fetch_add(1, std::memory_order_seq_cst);
        P->sleep_cv.wait(lk, [&] { return P->gen.load(std::memory_order_seq_cst) != seen; });
        P->sleepers.fetch_sub(1, std::memory_order_relaxed);
        t0 = std::chrono::steady_clock::now();
      }
    }
    seen = g;
    if (tid < P->nt) {
      int64_t b, e;
      chunk(P->n, P->nt, tid, b, e);
      if (b < e) P->fn(P->ctx, b, e, tid);
    }
    P->left.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace

int threads() { return g_threads.load(std::memory_order_relaxed); }

void run(int64_t n, int nt, range_fn fn, void* ctx) {
  if (nt > n) nt = (int)n;
  if (nt > MAX_THREADS) nt = MAX_THREADS;
  if (nt <= 1 || t_inside) {   // one thread, or a region inside a region: inline
    if (n > 0) fn(ctx, 0, n, 0);
    return;
  }
  Pool& P = pool();
  std::lock_guard<std::mutex> lk(P.submit);
  while (P.workers < nt - 1) {   // grow: a thread that fails to start leaves the region to the others
    const int tid = P.workers + 1;
    try {
      std::thread(worker_main, &P, tid, P.gen.load()).detach();
    } catch (...) {
      break;
    }
    P.workers = tid;
  }
  if (nt > P.workers + 1) nt = P.workers + 1;
  P.fn = fn;
  P.ctx = ctx;
  P.n = n;
  P.nt = nt;
  P.left.store(P.workers, std::memory_order_relaxed);
  P.gen.fetch_add(1, std::memory_order_seq_cst);   // publishes the region (and orders the stores above)
  if (P.sleepers.load(std::memory_order_seq_cst) > 0) {
    { std::lock_guard<std::mutex> s(P.sleep_m); }
    P.sleep_cv.notify_all();
  }
  int64_t b, e;
  chunk(n, nt, 0, b, e);
  t_inside = true;
  if (b < e) fn(ctx, b, e, 0);
  t_inside = false;
  for (unsigned k = 1; P.left.load(std::memory_order_acquire) != 0; k++) {
    relax();
    if ((k & 1023) == 0) std::this_thread::yield();   // a worker may be descheduled on a busy machine
  }
}

}  // namespace swk_pool

#if __has_include("swiftk_cpu.h")   // the public declarations: the compiler checks the definitions against them
#include "swiftk_cpu.h"
#endif

extern "C" {

// The thread count of the kernels' regions that take none from their caller (swk_layers and swk_linear take
// theirs); swiftk sets it to torch's. Returns the previous value.
int swk_set_threads(int n) {
  if (n < 1) n = 1;
  if (n > swk_pool::MAX_THREADS) n = swk_pool::MAX_THREADS;
  return swk_pool::g_threads.exchange(n);
}

// Pool threads started so far (the calling thread of a region is not one). A test reads it: regions from any
// number of host threads share these.
int swk_pool_workers(void) {
  swk_pool::Pool& P = swk_pool::pool();
  std::lock_guard<std::mutex> lk(P.submit);
  return P.workers;
}

}  // extern "C"
