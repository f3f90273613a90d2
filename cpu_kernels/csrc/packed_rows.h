// Rows of a packed weight as float32: a tied model's token embeddings looked up from its output head's panels, so
// that the matrix is held once (the embedded model kept its 30 MB of Q8_0 embedding twice, a quarter of its weights;
// a dense tied model its float32 embedding beside the head's panels; a k-quant file's tied embedding its blocks).
//
// Row n is column n of the packed weight: panel n / 16, lane n % 16 (dense_matmul.h, int8_blocks.h,
// kquant_blocks.h). Its values are the weight's as Python's BlockQuantized.dequantize (gguf's reference
// de-quantisation) computes them, in its order and roundings: float32 as stored, bfloat16 and float16 converted
// exactly, Q8_0 float(d) * float(q) (as q8_0_rows, block_rows.h), the other block formats S * float(q - offset) + M
// with S and M per (sub-)block (kquant_panel_row). Every build gives the same bits.

#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "dense_matmul.h"
#include "int8_blocks.h"
#include "kquant_blocks.h"
#include "packed_matmul.h"
#include "simd.h"
#include "thread_pool.h"

namespace {

// Whether packed_rows reads the rows of a weight packed in `format`: every format the matmuls take.
static bool packed_rows_support(int32_t format) {
  return format == kF32 || format == kBF16 || format == kF16 || format == kQ8_0 || format == kQ4_1 ||
         format == kQ4_0 || format == kQ5_0 || format == kQ5_1 || is_k_format(format);
}

// A float16 value as float32, exactly, on every build.
static inline float half_value(uint16_t h) {
  uint16_t lanes[kLanes];
  std::fill(lanes, lanes + kLanes, h);
  alignas(64) float values[kLanes];
  vstore(values, vfrom_f16(lanes));
  return values[0];
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
  constexpr int kQuads = kBlock / 4, kQuadBytes = kQuads * kLanes * 4;  // per block: [quad][lane][4], then scales
  const PanelGroup group = panel_group(packed, pbytes, num_panels, panel);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* block = group_block(group, b, 0, int8_block_bytes(kQ8_0), 1);
    const V16 d = vset1(half_value(reinterpret_cast<const uint16_t*>(block + kQuadBytes)[lane]));
    int8_t quants[kBlock];
    for (int quad = 0; quad < kQuads; ++quad)
      std::copy_n(reinterpret_cast<const int8_t*>(block) + quad * kLanes * 4 + lane * 4, 4, quants + quad * 4);
    for (int k = 0; k < kBlock; k += kLanes) vstore(out + b * kBlock + k, vmul(d, vfrom_i8(quants + k)));
  }
}

// Row `lane` of panel `panel` of a weight of the block format F other than Q8_0 (Q4_1's panels are the 4-bit
// formats', kquant_blocks.h) into out[K]: per 32-block, the lane's quants from the block's vectors (combination
// c = 2i + h holds k = 16h + 4i + j at byte 4 lane + j), then w = S_h * float(q - offset) + M, S_h and M the
// (sub-)block's scale and minimum as BlockQuantized.dequantize forms them (a k-quant's d * float(sc), Q6_K's per
// half; M = -(dmin * float(m)) or Q4_1's and Q5_1's m), one rounding each, in that order.
template <int32_t F>
static void block_panel_row(const uint8_t* packed, int64_t pbytes, int64_t num_panels, int64_t panel, int64_t lane,
                            int64_t K, float* out) {
  constexpr int bits = F == kQ4_1 ? 4 : quant_bits(F);
  constexpr int64_t block_bytes = F == kQ4_1 ? int8_block_bytes(kQ4_1) : kquant_block_bytes(F);
  constexpr int64_t head_bytes = kquant_head_bytes(F), per_super = kquant_blocks_per_super(F);
  constexpr int32_t offset = quant_offset(F);
  constexpr bool has_min = F == kQ4_1 || F == kQ5_1 || F == kQ4_K || F == kQ5_K;  // w = S q + M; the others S q
  const PanelGroup group = panel_group(packed, pbytes, num_panels, panel);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* block = group_block(group, b, head_bytes, block_bytes, per_super);
    int8_t q[kBlock];  // the lane's quants less the offset, k in order
    for (int c = 0; c < 8; ++c) {
      uint8_t combination[4 * kLanes];
      if constexpr (bits == 4) {
        for (int j = 0; j < 4; ++j) {
          const uint8_t pair = block[c / 2 * 4 * kLanes + lane * 4 + j];
          combination[lane * 4 + j] = c % 2 == 0 ? pair & 15 : pair >> 4;
        }
      } else {
        const B64 joined = join_wide<bits>(block, c);
        memcpy(combination, &joined, sizeof combination);
      }
      for (int j = 0; j < 4; ++j)
        q[16 * (c % 2) + 4 * (c / 2) + j] = static_cast<int8_t>(combination[lane * 4 + j] - offset);
    }
    const uint8_t* values = block + bits * 4 * kLanes;  // the block's per-lane values after its quant vectors
    const auto half_at = [&](const uint8_t* p) { return half_value(reinterpret_cast<const uint16_t*>(p)[lane]); };
    float scale[2], min = 0.0f;
    if constexpr (is_k_format(F)) {
      const uint8_t* head = group_head(group, b, head_bytes, block_bytes, per_super);
      const float d = half_at(head);
      if constexpr (F == kQ6_K) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(values);
        scale[0] = d * static_cast<float>(sc[lane]), scale[1] = d * static_cast<float>(sc[kLanes + lane]);
      } else {
        scale[0] = scale[1] = d * static_cast<float>(values[lane]);
        min = -(half_at(head + 2 * kLanes) * static_cast<float>(values[kLanes + lane]));
      }
    } else {
      scale[0] = scale[1] = half_at(values);
      if constexpr (has_min) min = half_at(values + 2 * kLanes);
    }
    for (int k = 0; k < kBlock; k += kLanes) {
      const V16 w = vmul(vset1(scale[k / kLanes]), vfrom_i8(q + k));
      vstore(out + b * kBlock + k, has_min ? vadd(w, vset1(min)) : w);
    }
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
        case kQ8_0:
          q8_0_panel_row(w.data, pbytes, num_panels, panel, lane, K, row);
          break;
        case kQ4_1: block_panel_row<kQ4_1>(w.data, pbytes, num_panels, panel, lane, K, row); break;
        case kQ4_0: block_panel_row<kQ4_0>(w.data, pbytes, num_panels, panel, lane, K, row); break;
        case kQ5_0: block_panel_row<kQ5_0>(w.data, pbytes, num_panels, panel, lane, K, row); break;
        case kQ5_1: block_panel_row<kQ5_1>(w.data, pbytes, num_panels, panel, lane, K, row); break;
        case kQ4_K: block_panel_row<kQ4_K>(w.data, pbytes, num_panels, panel, lane, K, row); break;
        case kQ5_K: block_panel_row<kQ5_K>(w.data, pbytes, num_panels, panel, lane, K, row); break;
        default: block_panel_row<kQ6_K>(w.data, pbytes, num_panels, panel, lane, K, row);
      }
    }
  });
  return true;
}

}  // namespace
