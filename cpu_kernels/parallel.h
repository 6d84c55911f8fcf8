// What the CPU kernels share: per-thread scratch, and output rows split over the calling
// thread and helper threads (ParallelRows). Header-only; the inline functions' statics are
// one object per process however many sources include this (one set of helper threads).
#ifndef JAXINFER_CPU_KERNELS_PARALLEL_H_
#define JAXINFER_CPU_KERNELS_PARALLEL_H_

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace jaxinfer_cpu {

// Per-thread scratch for a call's working arrays, grown as needed: no allocation (or
// fresh pages to fault in) per call. The pool's threads read it only while the calling
// thread waits inside that same call.
template <typename T>
inline T* Scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// The same for n floats starting on a boundary of `align` floats (32 bytes by default:
// aligned vector loads and stores; 16 floats for 64-byte zmm rows).
inline float* AlignedScratch(std::vector<float>& v, size_t n, size_t align = 8) {
  float* base = Scratch(v, n + align - 1);
  return base + (align - reinterpret_cast<uintptr_t>(base) / 4 % align) % align;
}


// Chunks of output rows, claimed by whichever thread asks next. The caller works too and
// then waits only for chunks already claimed by running threads, so it cannot wait on a
// task the pool has not started (a task that starts late finds nothing left and returns).
struct Work {
  std::function<void(int64_t, int64_t)> rows;  // computes output rows [ob, oe)
  int64_t O, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      rows(c * chunk, std::min(O, (c + 1) * chunk));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The kernels' own helper threads, which keep polling for the next call a little while
// after each one. Handing a call's chunks to XLA's intra-op pool (ThreadPool::Schedule)
// wakes a sleeping thread, and that cost the calling thread 9.3 us per call on the 2-core
// host (timed inside ParallelRows), about what a whole one-token 576 x 576 int4 product
// takes; a decode step makes 211 calls. Most of them follow the one before within a few
// microseconds (q, k, v; gate, up, down), so a helper still polling then takes the new
// job at the cost of one atomic store. While polling it yields its core (sched_yield) to
// any other runnable thread. Polling longer also bridges attention, between v and o, but
// the default model's batch-1 int4 decode (one process, settings interleaved) was fastest
// polling 30-50 us, slower sleeping at once and slower again polling 100-1000 us: a longer
// poll slowed XLA's own work in between (its attention loop most).
// One call at a time owns them; a call made meanwhile (another thread's program) uses
// XLA's pool as before.
class Helpers {
 public:
  static constexpr int64_t kPollMicros = 50;

  // The helpers, started on first use: `threads` - 1 of them (the caller is the other one).
  static Helpers& Get(int64_t threads) {
    static Helpers* h = new Helpers(threads - 1);  // never destroyed: its threads outlive main
    return *h;
  }
  int64_t size() const { return forked_.load(std::memory_order_relaxed) ? 0 : count_; }
  std::mutex& owner() { return owner_; }

  // Every helper runs w->Run(); returns at once (the caller waits on w's own counters).
  void Post(std::shared_ptr<Work> w) {
    bool wake;
    {
      std::lock_guard<std::mutex> l(m_);
      job_ = std::move(w);
      gen_.store(gen_.load(std::memory_order_relaxed) + 1, std::memory_order_release);
      wake = sleeping_ > 0;
    }
    if (wake) cv_.notify_all();
  }

 private:
  explicit Helpers(int64_t count) : count_(std::max<int64_t>(0, count)) {
    for (int64_t k = 0; k < count_; ++k) std::thread([this] { Loop(); }).detach();
    // A forked child has none of these threads (and maybe a lock one held): it uses XLA's pool.
    pthread_atfork(nullptr, nullptr, [] { forked_.store(true); });
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kPollMicros);
      while (gen_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
        for (int k = 0; k < 16; ++k) _mm_pause();
        sched_yield();
      }
      std::shared_ptr<Work> w;
      {
        std::unique_lock<std::mutex> l(m_);
        if (gen_.load(std::memory_order_relaxed) == seen) {
          ++sleeping_;
          cv_.wait(l, [&] { return gen_.load(std::memory_order_relaxed) != seen; });
          --sleeping_;
        }
        seen = gen_.load(std::memory_order_relaxed);
        w = job_;
      }
      w->Run();
    }
  }

  const int64_t count_;
  std::mutex owner_;  // held by the call using the helpers
  std::mutex m_;      // guards job_, sleeping_, and gen_'s changes
  std::condition_variable cv_;
  std::shared_ptr<Work> job_;
  std::atomic<uint64_t> gen_{0};
  int sleeping_ = 0;
  static inline std::atomic<bool> forked_{false};
};

// rows(ob, oe) over [0, O) on the calling thread and the helpers (or XLA's pool); row_cost is the
// work per output row in weight bytes x tokens (bytes of a row read by every token), align
// the rows a chunk is a multiple of (whole tiles).
inline void ParallelRows(xla::ffi::ThreadPool& pool, int64_t O, int64_t row_cost, int64_t align,
                         std::function<void(int64_t, int64_t)> rows) {
  if (O == 0) return;
  auto w = std::make_shared<Work>();
  w->rows = std::move(rows);
  w->O = O;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // ~4 chunks per thread (balance), and at least ~64 Ki of work (a 64 KiB weight slice at one
  // token) so a chunk outweighs its scheduling. Counting the tokens matters: at 64 tokens
  // a 64 KiB minimum alone put a 576 x 192 projection on one thread (one 192-row chunk)
  // and a 576-row output in chunks of 224, 224 and 128 over two.
  const auto up = [align](int64_t n) { return (n + align - 1) / align * align; };
  const int64_t min_rows = up(std::max<int64_t>(1, 65536 / std::max<int64_t>(1, row_cost)));
  w->chunk = std::max(min_rows, up((O + 4 * threads - 1) / (4 * threads)));
  w->chunks = (O + w->chunk - 1) / w->chunk;
  std::unique_lock<std::mutex> own;  // the helpers, for this call, when it has them
  if (w->chunks > 1) {
    Helpers& helpers = Helpers::Get(threads);
    if (helpers.size() + 1 >= threads) own = std::unique_lock<std::mutex>(helpers.owner(), std::try_to_lock);
    if (own.owns_lock())
      helpers.Post(w);
    else
      for (int64_t k = 1; k < threads && k < w->chunks; ++k) pool.Schedule([w] { w->Run(); });
  }
  w->Run();
  while (w->done.load(std::memory_order_acquire) < w->chunks) _mm_pause();
}

}  // namespace jaxinfer_cpu

#endif  // JAXINFER_CPU_KERNELS_PARALLEL_H_
