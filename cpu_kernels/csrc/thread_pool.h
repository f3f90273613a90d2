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
//
// Between jobs the first worker can warm the caches (`warm`): it asks them for byte ranges it is handed, with
// prefetches (they cannot fault and write nothing), until the ranges end, a job comes or newer ranges replace them.
// A decode step's memory is idle while one thread runs its small steps between matmuls (norms, RoPE, residual
// adds) and while the host prepares the step; the next weights can stream meanwhile (weight_warming.h).

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

  static constexpr int kWarmRanges = 64;

  // The first worker, while no job runs, asks the caches for the n (at most kWarmRanges) ranges starts[i] ..
  // + sizes[i] in groups of `group`, a group's ranges a line of each in turn (a weight's thread spans read
  // together, so that each thread finds its first lines there); the ranges a later call hands replace these.
  // Nothing where no worker has started.
  void warm(const uint8_t* const* starts, const int64_t* sizes, int n, int group) {
    if (workers_.load(std::memory_order_relaxed) == 0) return;
    {
      std::lock_guard<std::mutex> lock(warm_mutex_);
      warm_count_ = std::min(n, kWarmRanges);
      std::copy(starts, starts + warm_count_, warm_starts_);
      std::copy(sizes, sizes + warm_count_, warm_sizes_);
      warm_group_ = std::max(group, 1);
      warm_generation_.fetch_add(1, std::memory_order_seq_cst);
    }
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
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

  // The ranges `warm` handed last, walked until they end, a job of a generation after `seen` comes or newer
  // ranges replace them (checked every kWarmCheckBytes of each range). Returns the ranges' warm generation.
  uint64_t warm_caches(uint64_t seen) {
    constexpr int64_t kWarmCheckBytes = 2048;
    const uint8_t* starts[kWarmRanges];
    int64_t sizes[kWarmRanges];
    int count, group;
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(warm_mutex_);
      count = warm_count_, group = warm_group_;
      generation = warm_generation_.load(std::memory_order_relaxed);
      std::copy(warm_starts_, warm_starts_ + count, starts);
      std::copy(warm_sizes_, warm_sizes_ + count, sizes);
    }
    for (int first = 0; first < count; first += group) {
      const int last = std::min(count, first + group);
      const int64_t longest = *std::max_element(sizes + first, sizes + last);
      for (int64_t at = 0; at < longest; at += 64) {
        if (at % kWarmCheckBytes == 0 && ((state_.load(std::memory_order_relaxed) >> 32) != seen ||
                                          warm_generation_.load(std::memory_order_relaxed) != generation))
          return generation;
        for (int i = first; i < last; ++i)
          if (at < sizes[i]) __builtin_prefetch(starts[i] + at, 0, 3);
      }
    }
    return generation;
  }

  void work(int id) {
    uint64_t seen = 0, warmed = 0;
    const auto warm_waiting = [&] { return id == 0 && warm_generation_.load(std::memory_order_seq_cst) != warmed; };
    for (;;) {
      uint64_t gen = state_.load(std::memory_order_acquire) >> 32;
      auto started = std::chrono::steady_clock::now();
      for (int spins = 0; gen == seen; ++spins) {
        if (warm_waiting()) {
          warmed = warm_caches(seen);
          started = std::chrono::steady_clock::now();
        }
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() - started > std::chrono::microseconds(300)) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [&] { return (state_.load(std::memory_order_acquire) >> 32) != seen || warm_waiting(); });
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
  std::atomic<uint64_t> warm_generation_{0};
  const uint8_t* warm_starts_[kWarmRanges] = {};
  int64_t warm_sizes_[kWarmRanges] = {};
  int warm_count_ = 0, warm_group_ = 1;
  std::mutex mutex_, run_mutex_, warm_mutex_;
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
