// A forward's next weights asked for while the memory would idle (the pool's `warm`, thread_pool.h).
//
// A decode step streams every weight once, and between its matmuls one thread runs the small steps (norms, RoPE and
// the K/V stores, residual adds, the MLP's activation) with the memory idle; so it is while the host prepares the
// step. The pool's first worker, idle then, asks the caches for the next weight's first bytes, each thread's share
// of it (for_each_thread_span's split) together, until the matmul's job starts; a forward's first weights, in the
// order it reads them, before it starts. Prefetches only: no result can change.
//
// SmolLM2-135M's files (scripts/quantize_model.py) on AMD EPYC Zen 5 (2 cores, 32 MB L3), each decode step after a
// 268 MB stream flushed the caches, warming off and on taking turns in one process (scripts/bench_weight_warming.py,
// docs/benchmarks.md): a step at B = 1 1.03-1.09x faster in 12 of 13 runs over eight files (0.99 once), B = 2 and 4
// 1.02-1.09x, B = 8 0.96-1.05x, B = 32 0.95-1.01x (one run's noise here is ~5 %); kWarmTokens stops at 8.

#pragma once

#include <algorithm>
#include <atomic>
#include <fstream>
#include <string>

#include "dense_matmul.h"
#include "int8_blocks.h"
#include "packed_matmul.h"
#include "thread_pool.h"

namespace {

// Rows up to which a forward warms its weights: a decode step of a few sequences, a short extend or verification.
constexpr int64_t kWarmTokens = 8;

// The size of this CPU's last-level cache as Linux lists it (the largest level of cpu0's caches); 0 where it does
// not. glibc's sysconf is not used: on AMD EPYC under a hypervisor it gave 384 MB for a 32 MB L3.
static int64_t last_level_cache_bytes() {
  int64_t bytes = 0;
  int deepest = 0;
  for (int index = 0; index < 16; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    int64_t size = 0;
    char unit = 0;
    if (!(level_file >> level) || !(size_file >> size)) break;
    size_file >> unit;
    size <<= unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0;
    if (level >= deepest) deepest = level, bytes = size;
  }
  return bytes;
}

// Half the last-level cache (1 MB where unknown): lines warmed past it would push out the first ones before their
// matmul reads them.
static int64_t default_warm_bytes() {
  const int64_t cache = last_level_cache_bytes();
  return cache > 0 ? cache / 2 : int64_t{1} << 20;
}

// The most bytes one warm asks for; 0 turns warming off (set from any thread).
static std::atomic<int64_t>& warm_bytes() {
  static std::atomic<int64_t> bytes{default_warm_bytes()};
  return bytes;
}

// Warm ranges of `threads` threads' shares of a weight: at most this many threads' (a range each).
static int warm_group(int threads) { return std::clamp(threads, 1, Pool::kWarmRanges); }

// Where each of warm_group(threads) threads' share of w (one part) starts, from the start of its group of panels,
// and up to `budget` bytes of all of them, split evenly (empty for threads without panels): ranges written at
// starts[n..], sizes[n..]; returns the new n.
static int weight_spans(const PackedRef& w, int threads, int64_t budget, const uint8_t** starts, int64_t* sizes,
                        int n) {
  const int group = warm_group(threads);
  const int64_t pbytes = panel_bytes(w.format, w.in_features), num_panels = (w.out_features + kLanes - 1) / kLanes;
  const int64_t spans = std::min<int64_t>(group, num_panels);
  for (int64_t i = 0; i < group; ++i, ++n) {
    const int64_t first = i < spans ? num_panels * i / spans / kGroupPanels * kGroupPanels : 0;
    const int64_t end = i < spans ? num_panels * (i + 1) / spans : 0;
    starts[n] = w.data + first * pbytes;
    sizes[n] = std::min(budget / spans, (end - first) * pbytes);
  }
  return n;
}

// Warm w's first bytes (its first part's) for a matmul of `rows` rows on `threads` threads to come: nothing where
// its rows do not stream the weight or one thread runs it.
static void warm_weight(const PackedRef* w, int64_t rows, int threads) {
  const int64_t budget = warm_bytes().load(std::memory_order_relaxed);
  if (w == nullptr || rows > kWarmTokens || threads <= 1 || budget == 0) return;
  const uint8_t* starts[Pool::kWarmRanges];
  int64_t sizes[Pool::kWarmRanges];
  const int n = weight_spans(*w, threads, budget, starts, sizes, 0);
  Pool::instance().warm(starts, sizes, n, warm_group(threads));
}

// Warm the weights `weights[0..count)` in order (a forward's first ones, first parts), up to warm_bytes() in all,
// each thread's share of each together: nothing where `rows` do not stream them or one thread runs them.
static void warm_weights(const PackedRef* const* weights, int count, int64_t rows, int threads) {
  int64_t left = warm_bytes().load(std::memory_order_relaxed);
  if (rows > kWarmTokens || threads <= 1 || left == 0) return;
  const uint8_t* starts[Pool::kWarmRanges];
  int64_t sizes[Pool::kWarmRanges];
  const int group = warm_group(threads);
  int n = 0;
  for (int i = 0; i < count && left > 0 && n + group <= Pool::kWarmRanges; ++i) {
    const int first = n;
    n = weight_spans(*weights[i], threads, left, starts, sizes, n);
    for (int r = first; r < n; ++r) left -= sizes[r];
  }
  Pool::instance().warm(starts, sizes, n, group);
}

}  // namespace
