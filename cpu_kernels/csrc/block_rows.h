// Rows of a Q8_0 matrix as float32: an embedding lookup from the blocks a GGUF file stores (llama.cpp keeps token
// embeddings in Q8_0), in one call where torch took a handful of ops a decode step.
//
// w[k] = float(d) * float(q[k]) for the block's float16 scale d: one rounded product, as gguf (and torch's
// scales.float() * quants.float()) compute it; every build the same bits (the conversions are exact).

#pragma once

#include <stdint.h>

#include <algorithm>

#include "dense_matmul.h"
#include "kquant_blocks.h"
#include "simd.h"
#include "thread_pool.h"

namespace {

// out[i, K] = row ids[i] of the Q8_0 matrix of `rows` rows with float16 scales [rows, K / 32] and int8 quants
// [rows, K]; false (out untouched) if an id is not a row.
static bool q8_0_rows(const uint16_t* scales, const int8_t* quants, int64_t rows, int64_t K, const int64_t* ids,
                      int64_t n, float* out, int threads) {
  if (std::any_of(ids, ids + n, [&](int64_t id) { return id < 0 || id >= rows; })) return false;
  const int64_t nblocks = K / kBlock;
  parallel_for(n, kRowsPerClaim, threads, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const uint16_t* row_scales = scales + ids[i] * nblocks;
      const int8_t* row = quants + ids[i] * K;
      for (int64_t b = 0; b < nblocks; ++b) {
        uint16_t scale[kLanes];
        std::fill(scale, scale + kLanes, row_scales[b]);
        const V16 d = vfrom_f16(scale);
        for (int64_t k = b * kBlock; k < (b + 1) * kBlock; k += kLanes)
          vstore(out + i * K + k, vmul(d, vfrom_i8(row + k)));
      }
    }
  });
  return true;
}

}  // namespace
