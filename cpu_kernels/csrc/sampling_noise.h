// The sampler's Exp(1) draws and the race over them: in this library for the reason mask_logits.h gives.
//
// Row r of the sampler's exponential race takes one Exp(1) draw per token, keyed by (its request's seed, its output
// position) alone: that key keeps a request's tokens independent of its batch and of speculation. The draws come
// from a counter-based generator, so a row costs one pass over the vocabulary: SplitMix64 at counter c from the
// row's key gives the 32-bit words of tokens 2c and 2c + 1 (the very stream a SplitMix64 generator seeded with the
// key produces), and a word j becomes E = -log(u) with u uniform in (0, 1):
// - the word's top bit picks the half of (0, 1) and its other 31 bits k give t = (k + 1/2) 2^-32 in (0, 1/2]:
//   u = 1 - t (E = -log1p(-t), fine near 0, where the race's winners are decided) or u = t (E = -log t);
// - log t = e ln2 + log1p(m - 1) with t = 2^e m, m in [sqrt(1/2), sqrt(2)) taken from t's bits;
// - log1p(y) = 2 atanh(y / (2 + y)) by its odd series to s^17 (|s| <= 1/3: truncation below 2e-10).
// Integer operations and IEEE float adds, multiplies and one division (no fma, no library call): the same bits in
// every lane of every build, and a loop the compiler vectorises. Draws lie in [1.1e-10, 22.9].

#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "simd.h"
#include "thread_pool.h"

namespace {

constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ull;

static inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// log(2^e (1 + y)) = e ln2 + log1p(y) for y in [sqrt(1/2) - 1, sqrt(2) - 1] (or y in [-1/2, 0) with e = 0):
// log1p(y) = 2 atanh(s), s = y / (2 + y), by its odd series to s^17 (|s| <= 1/3: truncation below 2e-10).
static inline float log_of_parts(float e, float y) {
  const float s = y / (2.0f + y), w = s * s;
  float r = 0x1.e1e1e2p-5f;  // 1/17, then 1/15 .. 1/3, each rounded to float
  r = r * w + 0x1.111112p-4f;
  r = r * w + 0x1.3b13b2p-4f;
  r = r * w + 0x1.745d18p-4f;
  r = r * w + 0x1.c71c72p-4f;
  r = r * w + 0x1.24924ap-3f;
  r = r * w + 0x1.99999ap-3f;
  r = r * w + 0x1.555556p-2f;
  const float two_s = s + s;
  const float log1p_y = two_s + two_s * (r * w);
  // e ln2 with ln2 split in two (the first part's product is exact), added smallest first
  return e * 0x1.63p-1f + (e * -0x1.bd0106p-13f + log1p_y);
}

// The exponent and mantissa of a positive normal float x = 2^e m, m in [sqrt(1/2), sqrt(2)): e, and m - 1 (exact).
static inline void split_positive(float x, float* e, float* m_less_1) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  const uint32_t mantissa_bits = (bits & 0x007fffffu) | 0x3f800000u;  // m in [1, 2)
  const uint32_t halve = (0x3fb504f3u - mantissa_bits) >> 31;      // 1 where m > sqrt(2): halve it
  const uint32_t m_bits = mantissa_bits - (halve << 23);
  float m;
  memcpy(&m, &m_bits, sizeof m);
  *e = static_cast<float>(static_cast<int32_t>(bits >> 23) - 127 + static_cast<int32_t>(halve));
  *m_less_1 = m - 1.0f;  // exact by Sterbenz's lemma
}

// Branch-free (bit selects, no conditional), so that the loop calling it vectorises.
static inline float exponential_of_word(uint32_t word) {
  const uint32_t upper = word >> 31;                              // 1: u = t, 0: u = 1 - t
  const uint32_t k = (word ^ (0u - upper)) & 0x7fffffffu;         // the other 31 bits, flipped in the upper half
  const float t = (static_cast<float>(static_cast<int32_t>(k)) + 0.5f) * 0x1p-32f;  // (0, 1/2]
  float e, m_less_1, y;
  split_positive(t, &e, &m_less_1);
  const float minus_t = -t;
  uint32_t m_less_1_bits, minus_t_bits;
  memcpy(&m_less_1_bits, &m_less_1, sizeof m_less_1_bits);
  memcpy(&minus_t_bits, &minus_t, sizeof minus_t_bits);
  const uint32_t y_bits = (m_less_1_bits & (0u - upper)) | (minus_t_bits & (upper - 1u));
  memcpy(&y, &y_bits, sizeof y);
  return -log_of_parts(e * static_cast<float>(upper), y);
}

constexpr int64_t kNoiseChunk = 1024;  // tokens a claim's words are drawn for at once

// The 32-bit words of 2 * pairs tokens from token `first` (even) on, for `key`: tokens 2c and 2c + 1 take the
// c-th output of the key's SplitMix64 stream (counter c + 1), little-endian.
static inline void draw_words(uint64_t key, int64_t first, int64_t pairs, uint32_t* words) {
  const uint64_t counter = static_cast<uint64_t>(first / 2) + 1;
  for (int64_t c = 0; c < pairs; ++c) {
    const uint64_t z = splitmix64(key + (counter + c) * kSplitMixGamma);
    memcpy(words + 2 * c, &z, sizeof z);
  }
}

// out[r, v] for rows r < rows, tokens v < vocab: the draws of row r's key.
static void exponentials_of_rows(const uint64_t* keys, int64_t rows, int64_t vocab, float* out, int threads) {
  static_assert(kNoiseChunk % 2 == 0, "a chunk holds whole counters");
  const int64_t chunks = (vocab + kNoiseChunk - 1) / kNoiseChunk;
  parallel_for(rows * chunks, 4, threads, [&](int64_t first, int64_t last) {
    alignas(64) uint32_t words[kNoiseChunk];
    for (int64_t item = first; item < last; ++item) {
      const int64_t row = item / chunks, begin = (item % chunks) * kNoiseChunk;
      const int64_t n = std::min(kNoiseChunk, vocab - begin);
      draw_words(keys[row], begin, (n + 1) / 2, words);
      float* draws = out + row * vocab + begin;
      for (int64_t v = 0; v < n; ++v) draws[v] = exponential_of_word(words[v]);
    }
  });
}

// log x for a positive normal float, by the same series.
static inline float log_positive(float x) {
  float e, m_less_1;
  split_positive(x, &e, &m_less_1);
  return log_of_parts(e, m_less_1);
}

// ---- the race -----------------------------------------------------------------------------------------------------
//
// tokens[r] = argmax over v of (l_v - max l) / t_r - log E_v, the first such v on ties, over row r's logits l and
// the draws E of keys[r]: the Gumbel race, a sample of softmax(l / t_r) (-log E is Gumbel-distributed), which is
// the exponential race argmax p_v / E_v in logarithms, with no exp and no normalisation. A row at temperature 0
// (greedy) gets its first largest logit, with no draws. A row whose logits are all -inf gets -1. The scores are the
// same bits in every build (the operations above, one division, one subtraction) and the maximum is exact in any
// order, so every build picks the same token.
//
// Draws are made only where they can matter: -log E never exceeds kMaxGumbel (E >= 1.1e-10), so a group of 16
// tokens whose (l_v - max l) / t_r all lie more than kMaxGumbel + 1 below a score already reached cannot hold the
// winner, nor tie with it, and is skipped (the +1 covers the score's rounding). The score of the row's first
// largest logit starts the bound. The tokens picked are those of drawing everywhere (the tests compare).

constexpr float kMaxGumbel = 23.0f;  // above -log(1.1e-10)
constexpr int64_t kRaceGroup = 16;

static inline float race_score(float x, uint64_t key, int64_t token) {
  uint32_t pair[2];
  draw_words(key, token - token % 2, 1, pair);
  return x - log_positive(exponential_of_word(pair[token % 2]));
}

static void gumbel_race_rows(const float* logits, int64_t ld, int64_t rows, int64_t vocab, const float* temperatures,
                             const uint64_t* keys, int64_t* tokens, int threads) {
  static_assert(kNoiseChunk % kRaceGroup == 0 && kRaceGroup % 2 == 0, "groups of whole counters fill a chunk");
  parallel_for(rows, 1, threads, [&](int64_t first, int64_t last) {
    alignas(64) float xs[kNoiseChunk], scores[kNoiseChunk];
    for (int64_t row = first; row < last; ++row) {
      const float* l = logits + row * ld;
      const uint64_t key = keys[row];
      V16 peaks = vset1(-INFINITY);
      for (int64_t v = 0; v < vocab; v += kLanes)
        peaks = vmax(peaks, vload_head_fill(l + v, std::min<int64_t>(kLanes, vocab - v), -INFINITY));
      const float peak = tree_max(peaks), t = temperatures[row];
      tokens[row] = -1;
      if (!(peak > -INFINITY)) continue;
      int64_t argmax = 0;
      while (l[argmax] != peak) ++argmax;
      if (!(t > 0.0f)) {
        tokens[row] = argmax;
        continue;
      }
      float threshold = race_score((l[argmax] - peak) / t, key, argmax) - (kMaxGumbel + 1.0f), best = -INFINITY;
      for (int64_t begin = 0; begin < vocab; begin += kNoiseChunk) {
        const int64_t n = std::min(kNoiseChunk, vocab - begin);
        for (int64_t v = 0; v < n; ++v) xs[v] = (l[begin + v] - peak) / t;
        for (int64_t v = n; v < kNoiseChunk; ++v) xs[v] = -INFINITY;
        for (int64_t g = 0; g < n; g += kRaceGroup) {
          float* group = scores + g;
          if (!(tree_max(vload(xs + g)) >= threshold)) {
            for (int64_t v = 0; v < kRaceGroup; ++v) group[v] = -INFINITY;
            continue;
          }
          alignas(64) uint32_t words[kRaceGroup];
          draw_words(key, begin + g, kRaceGroup / 2, words);
          for (int64_t v = 0; v < kRaceGroup; ++v) group[v] = xs[g + v] - log_positive(exponential_of_word(words[v]));
        }
        V16 top = vset1(-INFINITY);
        for (int64_t v = 0; v < n; v += kLanes) top = vmax(top, vload(scores + v));
        const float chunk_best = tree_max(top);
        if (chunk_best > best) {  // strictly: an earlier chunk keeps a tie
          best = chunk_best;
          threshold = std::max(threshold, best - (kMaxGumbel + 1.0f));
          int64_t v = 0;
          while (scores[v] != chunk_best) ++v;
          tokens[row] = begin + v;
        }
      }
    }
  });
}

}  // namespace
