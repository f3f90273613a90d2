// The lm_head's product for rows whose grammar allows few tokens: only the panels of 16 columns that hold an allowed
// token, the others -inf, which is what masking them gives anyway.
//
// A logit is one output column of the lm_head: its bits are the same fixed sequence whatever else a call computes
// (the tiles, their rows and columns: dense_matmul.h, int8_blocks.h, kquant_blocks.h), so the allowed tokens' logits
// are the full product's, bit for bit. In the serving benchmark's answers (SmolLM2's 49,152 tokens, 3,072 panels)
// 60% of a JSON schema's positions and 58% of a regex's allow under a tenth of the panels (medians 7% and 0.1%).
// Rows allowing fewer than a quarter of the panels take this path, the others the full product with one another.
// AMD EPYC Zen 3 (AVX2), the embedded file's Q8_0 lm_head, a decode step against no mask: one row allowing 0.1% of
// the panels 0.80x, 10% 0.85x, 24% 0.90x; eight rows 0.80x, 0.88x, 0.96x.

#pragma once

#include <stdint.h>
#include <string.h>

#include <limits>
#include <vector>

#include "buffer.h"
#include "dense_matmul.h"
#include "int8_blocks.h"
#include "kquant_blocks.h"
#include "packed_matmul.h"
#include "thread_pool.h"

namespace {

constexpr int64_t kPanelsPerClaim = 16;  // a claim's panels: ~160 KB of Q8_0 weights at SmolLM2's width

// Panel p (columns 16p ..) holds an allowed token in mask words [ceil(N / 32)] (bit j of word w: token 32w + j).
static inline bool panel_allowed(const int32_t* words, int64_t p) {
  return (static_cast<uint32_t>(words[p / 2]) >> (16 * (p % 2)) & 0xFFFFu) != 0;
}

// y[N] = x[K] @ W.T at `panels` (their columns; the others untouched) of one packed weight.
static void panels_matmul(const PackedRef& w, const float* x, const std::vector<int64_t>& panels, float* y,
                          int threads) {
  const int32_t format = w.format;
  const int64_t K = w.in_features, N = w.out_features, num_panels = (N + kLanes - 1) / kLanes;
  const int64_t count = static_cast<int64_t>(panels.size());
  const auto columns = [&](int64_t p) { return static_cast<int>(std::min<int64_t>(kLanes, N - p * kLanes)); };
  if (is_block_format(format)) {
    QuantizedRows quantized;
    quantize_rows(x, 1, K, K, 1, &quantized);
    // one(g, y at the panel's first column, columns): the panel's one-row tile, for panels of pbytes each
    const auto each = [&](int64_t pbytes, const auto& one) {
      parallel_for(count, kPanelsPerClaim, threads, [&](int64_t first, int64_t last) {
        for (int64_t i = first; i < last; ++i)
          one(panel_group(w.data, pbytes, num_panels, panels[i]), y + panels[i] * kLanes, columns(panels[i]));
      });
    };
    const auto int8 = [&](auto f) {
      constexpr int32_t F = decltype(f)::value;
      each(quantized.nblocks * int8_block_bytes(F), [&](const PanelGroup& g, float* at, int cols) {
        int8_rows<F, 1, 1>(1, 1, quantized, 0, g, g, at, kLanes, cols);
      });
    };
    if (format == kQ8_0) return int8(Int<kQ8_0>());
    if (format == kQ4_1) return int8(Int<kQ4_1>());
    const Buffer<int32_t> halves = half_block_sums(quantized, 1, 1);
    return with_kquant_format(format, [&](auto f) {
      constexpr int32_t F = decltype(f)::value;
      each(kquant_panel_bytes(F, K), [&](const PanelGroup& g, float* at, int cols) {
        kquant_rows<F, 1, 1>(1, 1, quantized, halves.data(), 0, g, g, at, kLanes, cols);
      });
    });
  }
  const int64_t pbytes = panel_bytes(format, K);
  parallel_for(count, kPanelsPerClaim, threads, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t p = panels[i];
      run_rows<1, 1>(1, 1, format, x, K, w.data + p * pbytes, pbytes, K, y + p * kLanes, kLanes, columns(p));
    }
  });
}

// logits[M, N] = x[M, K] @ W.T, where row i's mask words (masks + i * ldm; N / 32 rounded up) allow fewer than a
// quarter of the panels: only their panels, the others' columns -inf; every other row (or all, for masks null or a
// stacked weight) the full product. The rows of x are K apart.
static void masked_logits(const PackedRef& w, const float* x, int64_t M, const int32_t* masks, int64_t ldm,
                          float* logits, int threads) {
  const int64_t K = w.in_features, N = w.out_features, num_panels = (N + kLanes - 1) / kLanes;
  const auto few = [&](const std::vector<int64_t>& panels) {
    return static_cast<int64_t>(panels.size()) * 4 < num_panels;
  };
  if (masks == nullptr || w.next != nullptr) return stacked_matmul(&w, x, M, K, logits, N, threads);
  std::vector<int64_t> full_rows;
  std::vector<std::vector<int64_t>> sparse(M);
  for (int64_t i = 0; i < M; ++i) {
    const int32_t* words = masks + i * ldm;
    for (int64_t p = 0; p < num_panels && few(sparse[i]); ++p)
      if (panel_allowed(words, p)) sparse[i].push_back(p);
    if (!few(sparse[i])) full_rows.push_back(i);
  }
  const int64_t F = static_cast<int64_t>(full_rows.size());
  if (F == M) return stacked_matmul(&w, x, M, K, logits, N, threads);
  if (F > 0) {
    Buffer<float> gathered(F * K), out(F * N);
    for (int64_t j = 0; j < F; ++j) memcpy(gathered.data() + j * K, x + full_rows[j] * K, K * sizeof(float));
    stacked_matmul(&w, gathered.data(), F, K, out.data(), N, threads);
    for (int64_t j = 0; j < F; ++j) memcpy(logits + full_rows[j] * N, out.data() + j * N, N * sizeof(float));
  }
  for (int64_t i = 0; i < M; ++i) {
    if (!few(sparse[i])) continue;  // computed in full above
    float* row = logits + i * N;
    std::fill(row, row + N, -std::numeric_limits<float>::infinity());
    panels_matmul(w, x + i * K, sparse[i], row, threads);
  }
}

}  // namespace
