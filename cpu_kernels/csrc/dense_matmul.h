// The packed weight formats and the dense (float32, bfloat16, float16) matmul's tiles, which the block formats'
// matmuls (int8_blocks.h, kquant_blocks.h) share their column groups with.

#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "simd.h"
#include "thread_pool.h"

namespace {

constexpr int kBlock = 32;  // the GGUF block formats' group of k values sharing a scale

// ---- matmuls over packed weights -------------------------------------------------------------------------------
//
// Weights [N, K] are packed in panels of 16 columns: panel p holds columns 16p..16p+15 (zero past N), so that one
// vector load gives 16 columns. Dense formats, k-major: F32 float [K][16], BF16 bfloat16 [K][16], F16 float16
// [K][16] (both converted to float exactly); a y[m][n] is one fma chain over k in order. The GGUF block formats Q8_0 (w = d * q) and Q4_1 (w = d * q + m), K a multiple of 32,
// are integer dot products with x quantised per block: int8_blocks.h, which states their layout and arithmetic;
// the other block formats (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) likewise in kquant_blocks.h.

enum Format : int32_t {
  kF32 = 0, kBF16 = 1, kQ8_0 = 2, kQ4_1 = 3, kQ4_0 = 4, kQ5_0 = 5, kQ5_1 = 6, kQ4_K = 7, kQ5_K = 8, kQ6_K = 9,
  kF16 = 10
};

static int64_t kquant_panel_bytes(int32_t format, int64_t K);  // kquant_blocks.h

static inline int64_t panel_bytes(int32_t format, int64_t K) {
  switch (format) {
    case kF32:
      return K * kLanes * 4;
    case kBF16:
    case kF16:
      return K * kLanes * 2;
    case kQ8_0:
      return K / kBlock * (kBlock * kLanes + kLanes * 2);
    case kQ4_1:
      return K / kBlock * (kBlock / 2 * kLanes + 2 * kLanes * 2);
    default:
      return kquant_panel_bytes(format, K);
  }
}

// A tile's accumulators into y: row r's panel p to columns p * panel_columns.. (16p.. where its panels lie side by
// side), `cols` columns in all: every panel whole but perhaps the last. A whole panel is one vector store (a copy
// through a buffer called libc's memmove for each of a tile's vectors: ~4% of a 1,550-token prefill's samples on an
// Intel Xeon).
template <int MR, int NP>
static inline void store_tile(const V16 (&acc)[MR][NP], float* y, int64_t ldy, int cols,
                              int64_t panel_columns = kLanes) {
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) {
      const int n = std::min(kLanes, cols - p * kLanes);
      if (n <= 0) break;
      vstore_at(y + r * ldy + p * panel_columns, 0, n, acc[r][p]);
    }
}

// One tile: MR rows of x times NP panels, every k. acc[r][p] is y[row r][panel p's 16 columns].
template <int MR, int NP>
static void tile_dense(int32_t format, const float* x, int64_t ldx, const uint8_t* panels, int64_t pbytes, int64_t K,
                       float* y, int64_t ldy, int cols) {
  V16 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    V16 w[NP];
    for (int p = 0; p < NP; ++p) {
      const uint8_t* base = panels + p * pbytes;
      const uint16_t* halves = reinterpret_cast<const uint16_t*>(base) + k * kLanes;
      w[p] = format == kF32    ? vload(reinterpret_cast<const float*>(base) + k * kLanes)
             : format == kBF16 ? vfrom_bf16(halves)
                               : vfrom_f16(halves);
    }
    for (int r = 0; r < MR; ++r) {
      V16 xv = vset1(x[r * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = vfma(xv, w[p], acc[r][p]);
    }
  }
  store_tile<MR, NP>(acc, y, ldy, cols);
}

// Tile shapes: accumulators MR x NP vectors must fit the register file with the weights (32 zmm or 16 ymm).
#if defined(__AVX512F__)
constexpr int kMR = 6, kNP = 2, kWideNP = 8;
#elif defined(__AVX2__)
constexpr int kMR = 4, kNP = 1, kWideNP = 1;
#else
constexpr int kMR = 4, kNP = 1, kWideNP = 1;
#endif
constexpr int kRowBlock = 96;  // rows of x per pass over a column group: they stay in cache while it streams

// A tile of 1..kMR rows and 1..kNP panels, each with the code compiled for exactly that many (a tile never reads
// past the last panel).
template <int MR = kMR, int NP = kNP>
static void run_rows(int rows, int panels_here, int32_t format, const float* x, int64_t ldx, const uint8_t* panels,
                     int64_t pbytes, int64_t K, float* y, int64_t ldy, int cols) {
  if constexpr (MR > 1) {
    if (rows < MR) return run_rows<MR - 1, NP>(rows, panels_here, format, x, ldx, panels, pbytes, K, y, ldy, cols);
  }
  if constexpr (NP > 1) {
    if (panels_here < NP) return run_rows<MR, NP - 1>(rows, panels_here, format, x, ldx, panels, pbytes, K, y, ldy, cols);
  }
  tile_dense<MR, NP>(format, x, ldx, panels, pbytes, K, y, ldy, cols);
}

// One row's split of N columns' panels among the threads: each thread one span of consecutive panels, the spans even
// to a panel, in one claim (a claim and its completion are two atomics on lines both threads write; a one-row matmul
// is a few µs, and ~15 claims made two threads slower than one on SmolLM2's q/k/v and o_proj: docs/benchmarks.md).
// span(start, end) on each thread's panels [start, end).
template <class Span>
static void for_each_thread_span(int64_t N, int threads, const Span& span) {
  const int64_t num_panels = (N + kLanes - 1) / kLanes;
  const int64_t spans = std::min<int64_t>(std::max(threads, 1), num_panels);
  parallel_for(spans, 1, threads, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) span(num_panels * i / spans, num_panels * (i + 1) / spans);
  });
}

// One row's tiles over each thread's span (for_each_thread_span). A span's tiles hold up to NP panels and never cross
// a multiple of NP, where the block formats' groups of panels start (int8_blocks.h).
template <int NP, class Tile>
static void for_each_row_span(int64_t N, int threads, const Tile& tile) {
  for_each_thread_span(N, threads, [&](int64_t start, int64_t end) {
    for (int64_t panel = start, stop; panel < end; panel = stop) {
      stop = std::min(end, (panel / NP + 1) * NP);
      const int64_t column = panel * kLanes;
      tile(1, static_cast<int>(stop - panel), 0, panel, column,
           static_cast<int>(std::min<int64_t>((stop - panel) * kLanes, N - column)));
    }
  });
}

// One row's tiles where a build keeps one panel a group (AVX2, scalar): each thread's span (for_each_thread_span) in
// tiles of up to NP panels spread over it, panel p of a tile `stride` panels on from its first, so that a thread
// reads NP streams at once. tile(panels_here, panel, stride, cols): the tile's first panel, its panels' distance
// and their columns in all. One stream a thread left AMD EPYC Zen 3's memory half idle (docs/benchmarks.md).
template <int NP, class Tile>
static void for_each_spread_span(int64_t N, int threads, const Tile& tile) {
  for_each_thread_span(N, threads, [&](int64_t start, int64_t end) {
    const int64_t stride = (end - start + NP - 1) / NP;
    for (int64_t panel = start; panel < start + stride; ++panel) {
      const int64_t here = std::min<int64_t>(NP, (end - panel + stride - 1) / stride);
      const int64_t last_column = (panel + (here - 1) * stride) * kLanes;
      tile(static_cast<int>(here), panel, stride,
           static_cast<int>((here - 1) * kLanes + std::min<int64_t>(kLanes, N - last_column)));
    }
  });
}

// The tiles of one matmul over N columns of packed panels (pbytes each): threads take column groups of NP panels;
// each group runs its rows in blocks of `row_block` (they stay in cache while the group streams), in tiles of MR.
// tile(rows, panels_here, m, panel, column, cols) computes rows m.. of panels `panel`.. (columns `column`..).
// One row: for_each_row_span.
template <int MR, int NP, class Tile>
static void for_each_tile(int64_t M, int64_t N, int64_t pbytes, int64_t row_block, int threads, const Tile& tile) {
  if (M == 1) return for_each_row_span<NP>(N, threads, tile);
  const int64_t num_panels = (N + kLanes - 1) / kLanes;
  const int64_t num_groups = (num_panels + NP - 1) / NP;
  // Rows of one row block (the weights stream once: a draft's verification, a small batch): a thread's groups in one
  // claim, one sequential stream. A claim and its completion are two atomics on lines both threads write, and a
  // claim's first group is read unprefetched: at 2 to 32 rows, quarter shares left the block formats 15-40% slower
  // (docs/benchmarks.md). More rows: a quarter of a thread's share per claim, for balance.
  const int64_t grain = M <= row_block ? (num_groups + threads - 1) / threads : num_groups / (4 * threads);
  parallel_for(num_groups, grain, threads, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const int cols = static_cast<int>(std::min<int64_t>(NP * kLanes, N - g * NP * kLanes));
      const int panels_here = static_cast<int>(std::min<int64_t>(NP, num_panels - g * NP));
      for (int64_t m0 = 0; m0 < M; m0 += row_block) {
        const int64_t m1 = std::min(M, m0 + row_block);
        for (int64_t m = m0; m < m1; m += MR)
          tile(static_cast<int>(std::min<int64_t>(MR, m1 - m)), panels_here, m, g * NP,
               g * NP * kLanes, cols);
      }
    }
  });
}

// The column groups of one dense matmul, NP panels each, rows in tiles of MR.
template <int MR, int NP>
static void matmul_groups(int32_t format, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed,
                          int64_t N, float* y, int64_t ldy, int32_t threads) {
  const int64_t pbytes = panel_bytes(format, K);
  for_each_tile<MR, NP>(M, N, pbytes, kRowBlock, threads,
                        [&](int rows, int panels_here, int64_t m, int64_t panel, int64_t column, int cols) {
                          run_rows<MR, NP>(rows, panels_here, format, x + m * ldx, ldx, packed + panel * pbytes, pbytes,
                                           K, y + m * ldy + column, ldy, cols);
                        });
}

}  // namespace
