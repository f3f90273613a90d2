// Rows of a packed weight as float32: a tied model's token embeddings looked up from its output head's panels, so
// that the matrix is held once (the embedded model kept its 30 MB of Q8_0 embedding twice, a quarter of its weights;
// a dense tied model its float32 embedding beside the head's panels).
//
// Row n is column n of the packed weight: panel n / 16, lane n % 16 (dense_matmul.h, int8_blocks.h). Its values are
// the weight's as the matmuls read them: float32 as stored, bfloat16 and float16 converted exactly, Q8_0 the one
// rounded product float(d) * float(q) that q8_0_rows (block_rows.h) and gguf compute: the same bits on every build.

#pragma once

#include <stdint.h>

#include <algorithm>

#include "dense_matmul.h"
#include "int8_blocks.h"
#include "kquant_blocks.h"
#include "packed_matmul.h"
#include "simd.h"
#include "thread_pool.h"

namespace {

// Whether packed_rows reads the rows of a weight packed in `format`.
static bool packed_rows_support(int32_t format) {
  return format == kF32 || format == kBF16 || format == kF16 || format == kQ8_0;
}

// Row `lane` of a dense panel (values [K][16]) into out[K].
template <class T, class Convert>
static void dense_panel_row(const T* panel, int64_t lane, int64_t K, float* out, Convert convert) {
  for (int64_t k0 = 0; k0 < K; k0 += kLanes) {
    T chunk[kLanes] = {};
    const int64_t n = std::min<int64_t>(kLanes, K - k0);
    for (int64_t j = 0; j < n; ++j) chunk[j] = panel[(k0 + j) * kLanes + lane];
    vstore_at(out, k0, K, convert(chunk));
  }
}

// Row `lane` of panel `panel` of a Q8_0 weight (its group's blocks side by side, int8_blocks.h) into out[K].
static void q8_0_panel_row(const uint8_t* packed, int64_t pbytes, int64_t num_panels, int64_t panel, int64_t lane,
                           int64_t K, float* out) {
  constexpr int kQuads = kBlock / 4, kQuantBytes = kQuads * kLanes * 4;  // per block: [quad][lane][4], then scales
  const PanelGroup group = panel_group(packed, pbytes, num_panels, panel);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* block = group_block(group, b, 0, int8_block_bytes(kQ8_0), 1);
    uint16_t scale[kLanes];
    std::fill(scale, scale + kLanes, reinterpret_cast<const uint16_t*>(block + kQuantBytes)[lane]);
    const V16 d = vfrom_f16(scale);
    int8_t quants[kBlock];
    for (int quad = 0; quad < kQuads; ++quad)
      std::copy_n(reinterpret_cast<const int8_t*>(block) + quad * kLanes * 4 + lane * 4, 4, quants + quad * 4);
    for (int k = 0; k < kBlock; k += kLanes) vstore(out + b * kBlock + k, vmul(d, vfrom_i8(quants + k)));
  }
}

// out[i, K] = row ids[i] of the packed weight w (one part, of a format packed_rows_support takes); false (out
// untouched) if an id is not a row or the weight is not one whose rows it reads.
static bool packed_rows(const PackedRef& w, const int64_t* ids, int64_t n, float* out, int threads) {
  const int64_t N = w.out_features, K = w.in_features;
  if (!packed_rows_support(w.format) || w.next != nullptr) return false;
  if (std::any_of(ids, ids + n, [&](int64_t id) { return id < 0 || id >= N; })) return false;
  const int64_t pbytes = panel_bytes(w.format, K), num_panels = (N + kLanes - 1) / kLanes;
  parallel_for(n, kRowsPerClaim, threads, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t panel = ids[i] / kLanes, lane = ids[i] % kLanes;
      const uint8_t* start = w.data + panel * pbytes;
      float* row = out + i * K;
      switch (w.format) {
        case kF32:
          dense_panel_row(reinterpret_cast<const float*>(start), lane, K, row, [](const float* p) { return vload(p); });
          break;
        case kBF16:
          dense_panel_row(reinterpret_cast<const uint16_t*>(start), lane, K, row,
                          [](const uint16_t* p) { return vfrom_bf16(p); });
          break;
        case kF16:
          dense_panel_row(reinterpret_cast<const uint16_t*>(start), lane, K, row,
                          [](const uint16_t* p) { return vfrom_f16(p); });
          break;
        default:
          q8_0_panel_row(w.data, pbytes, num_panels, panel, lane, K, row);
      }
    }
  });
  return true;
}

}  // namespace
