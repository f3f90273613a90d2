// The kernels' thread pool and parallel_for over it (cpu_kernels.cpp's header: why not OpenMP).

#pragma once

#include <stdint.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace {

// ---- the thread pool --------------------------------------------------------------------------------------------
//
// One job at a time: a forward's regions come one after another, and a caller on another thread (ctypes releases
// the GIL: a mask applied beside a forward) waits for the running job. A job is `total` items
// claimed `grain` at a time through `state_` = generation << 32 | next item, by compare-and-swap, so a claim made
// for an old generation fails; the caller claims too and then waits only for claimed items to finish. Workers spin
// a little after a job (the next region of the forward comes within microseconds), then sleep.

class Pool {
 public:
  using Fn = void (*)(const void*, int64_t, int64_t);

  static Pool& instance() {
    static Pool* pool = nullptr;
    static pid_t owner = 0;
    if (pool == nullptr || owner != getpid()) {  // a forked child has none of its parent's threads
      pool = new Pool();                          // never freed: workers may outlive static destruction
      owner = getpid();
    }
    return *pool;
  }

  void run(int64_t total, int64_t grain, int threads, Fn fn, const void* ctx) {
    if (threads <= 1 || total <= grain) {
      fn(ctx, 0, total);
      return;
    }
    std::lock_guard<std::mutex> one_job(run_mutex_);  // callers on other threads wait their turn
    grow(threads - 1);
    const uint64_t gen = ++generation_;
    Job& job = jobs_[gen & 1];
    job.fn.store(fn, std::memory_order_relaxed);
    job.ctx.store(ctx, std::memory_order_relaxed);
    job.total.store(total, std::memory_order_relaxed);
    job.grain.store(grain, std::memory_order_relaxed);
    job.helpers.store(threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    state_.store(gen << 32, std::memory_order_release);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    claim_and_run(gen, job);
    for (int spins = 0; done_.load(std::memory_order_acquire) < total; ++spins)
      if (spins > 4096) std::this_thread::yield();
  }

 private:
  struct Job {
    std::atomic<Fn> fn{nullptr};
    std::atomic<const void*> ctx{nullptr};
    std::atomic<int64_t> total{0}, grain{1};
    std::atomic<int> helpers{0};
  };

  void grow(int workers) {
    while (static_cast<int>(workers_) < workers) {
      const int id = workers_++;
      std::thread([this, id] { work(id); }).detach();
    }
  }

  void claim_and_run(uint64_t gen, Job& job) {
    for (;;) {
      uint64_t state = state_.load(std::memory_order_acquire);
      if (state >> 32 != (gen & 0xffffffffu)) return;
      const int64_t first = static_cast<int64_t>(state & 0xffffffffu);
      const int64_t total = job.total.load(std::memory_order_relaxed);
      if (first >= total) return;
      const int64_t last = std::min(total, first + job.grain.load(std::memory_order_relaxed));
      if (!state_.compare_exchange_weak(state, (state & ~0xffffffffull) | static_cast<uint64_t>(last),
                                        std::memory_order_acq_rel))
        continue;
      job.fn.load(std::memory_order_relaxed)(job.ctx.load(std::memory_order_relaxed), first, last);
      done_.fetch_add(last - first, std::memory_order_release);
    }
  }

  void work(int id) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = state_.load(std::memory_order_acquire) >> 32;
      const auto started = std::chrono::steady_clock::now();
      for (int spins = 0; gen == seen; ++spins) {
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() - started > std::chrono::microseconds(300)) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [&] { return (state_.load(std::memory_order_acquire) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
        gen = state_.load(std::memory_order_acquire) >> 32;
      }
      seen = gen;
      Job& job = jobs_[gen & 1];
      if (id < job.helpers.load(std::memory_order_relaxed)) claim_and_run(gen, job);
    }
  }

  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> workers_{0};
  uint64_t generation_ = 0;
  Job jobs_[2];
  std::mutex mutex_, run_mutex_;
  std::condition_variable wake_;
};

constexpr int64_t kRowsPerClaim = 32;  // rows of a norm or an activation per claim, at most

// Rows per claim of a row-wise step over T rows of `width` values: all of them on the caller (no region) while the
// step is short, T * width below `split_at` values (a region costs ~0.4-0.5 µs on 2 threads: AMD EPYC), else each
// thread an even share up to kRowsPerClaim. A k = 8 extend's SiLU (8 x 1536 values, ~2.1 µs on one thread) and a
// batch of 32's were one thread's while the other waited. Rows are computed apart: the same bits however split.
static inline int64_t rows_per_claim(int64_t T, int64_t width, int64_t split_at, int threads) {
  if (threads <= 1 || T * width < split_at) return std::max<int64_t>(T, 1);
  return std::min<int64_t>(kRowsPerClaim, (T + threads - 1) / threads);
}

// f(first, last) over items [0, total) on up to `threads` threads, `grain` items per claim.
template <class F>
static void parallel_for(int64_t total, int64_t grain, int threads, const F& f) {
  Pool::instance().run(
      total, std::max<int64_t>(1, grain), threads,
      [](const void* ctx, int64_t first, int64_t last) { (*static_cast<const F*>(ctx))(first, last); }, &f);
}

}  // namespace
