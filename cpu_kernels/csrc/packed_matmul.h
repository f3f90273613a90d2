// A matmul over a packed weight: the dispatch by format (dense_matmul.h, int8_blocks.h, kquant_blocks.h), and a
// stack of parts in different formats multiplied part by part into consecutive columns.

#pragma once

#include <stdint.h>

#include "dense_matmul.h"
#include "int8_blocks.h"
#include "kquant_blocks.h"

namespace {

// y[M, N] = x[M, K] @ W.T with W packed in one format (dense_matmul.h); x rows ldx apart, y rows ldy apart.
// Dense formats: one or two rows (a decode step, a short draft) take wider column groups on AVX-512: a tile's
// accumulators are its only independent fma chains, and two panels' would leave the fma units waiting on their
// latency. The AVX2 build keeps one panel, which measured faster there than two or four (docs/benchmarks.md).
static void matmul(int32_t format, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed, int64_t N,
                   float* y, int64_t ldy, int32_t threads) {
  if (format == kQ8_0 || format == kQ4_1) return int8_matmul(format, x, M, K, ldx, packed, N, y, ldy, threads);
  if (is_kquant_format(format)) return kquant_matmul(format, x, M, K, ldx, packed, N, y, ldy, threads);
  if constexpr (kWideNP > kNP) {
    const int64_t num_panels = (N + kLanes - 1) / kLanes;
    const bool many_groups = num_panels >= kWideNP * 4 * threads;  // enough wide groups to keep every thread busy
    if (M == 1)
      return many_groups ? matmul_groups<1, kWideNP>(format, x, M, K, ldx, packed, N, y, ldy, threads)
                         : matmul_groups<1, kWideNP / 2>(format, x, M, K, ldx, packed, N, y, ldy, threads);
    if (M == 2) return matmul_groups<2, kWideNP / 2>(format, x, M, K, ldx, packed, N, y, ldy, threads);
  }
  matmul_groups<kMR, kNP>(format, x, M, K, ldx, packed, N, y, ldy, threads);
}

// A packed weight; `next`, where not null, the weight stacked below it (its rows are the next output columns): the
// parts of a stack whose formats differ (a k-quant file's q and k beside a v of more bits), each multiplied as stored.
struct PackedRef {
  const uint8_t* data;
  int32_t format;
  int64_t out_features, in_features;
  const PackedRef* next;
};

// y[M, columns of every part] = x[M, K] @ W.T for a packed weight or a stack of parts, each part into its columns.
static void stacked_matmul(const PackedRef* w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
                           int32_t threads) {
  int64_t column = 0;
  for (const PackedRef* part = w; part != nullptr; part = part->next) {
    matmul(part->format, x, M, part->in_features, ldx, part->data, part->out_features, y + column, ldy, threads);
    column += part->out_features;
  }
}

}  // namespace
