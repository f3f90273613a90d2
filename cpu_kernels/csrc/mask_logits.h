// The grammar's token mask on the logits: in this library rather than beside the bitmask code in triton_ops because
// it runs on the kernels' one thread pool (a mask applied beside a forward waits its turn instead of oversubscribing
// the cores) and is built and loaded with them (a server compiles nothing more for it).

#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>

#include "thread_pool.h"

namespace {

// ---- the grammar's token mask on the logits --------------------------------------------------------------------
//
// Logit c of a row stays as it is when bit c % 32 of the row's word c / 32 is set, and becomes -inf (the bit
// pattern the caller passes) otherwise, as do columns past the last word. Only stores of -inf: no arithmetic
// touches a logit, so every build writes the same bits.

constexpr int64_t kMaskWordsPerClaim = 512;  // 16k logits: below two of these, one thread masks the row

template <class T>
static inline void mask_word(T* p, uint32_t word, T neg_inf, int width) {
  if (word == 0xffffffffu && width == 32) return;  // all allowed: a free-text row is mostly such words
  for (int j = 0; j < width; ++j) p[j] = ((word >> j) & 1u) ? p[j] : neg_inf;
}

static inline void mask_word_f32(float* p, uint32_t word, uint32_t neg_inf_bits) {
#if defined(__AVX512F__)
  const __m512 neg_inf = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(neg_inf_bits)));
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>(~word & 0xffffu), neg_inf);
  _mm512_mask_storeu_ps(p + 16, static_cast<__mmask16>(~word >> 16), neg_inf);
#else
  uint32_t* bits = reinterpret_cast<uint32_t*>(p);
  mask_word(bits, word, neg_inf_bits, 32);
#endif
}

static inline void mask_word_16(uint16_t* p, uint32_t word, uint16_t neg_inf_bits) {
#if defined(__AVX512BW__)
  _mm512_mask_storeu_epi16(p, static_cast<__mmask32>(~word), _mm512_set1_epi16(static_cast<int16_t>(neg_inf_bits)));
#else
  mask_word(p, word, neg_inf_bits, 32);
#endif
}

// Columns [32 * first_word, 32 * last_word) of one row, clipped to the vocab.
static void mask_row_words(void* row, int32_t element_bytes, uint32_t neg_inf_bits, int64_t vocab,
                           const int32_t* words, int64_t num_words, int64_t first_word, int64_t last_word) {
  for (int64_t w = first_word; w < last_word; ++w) {
    const int64_t column = w * 32;
    const int width = static_cast<int>(std::min<int64_t>(32, vocab - column));
    const uint32_t word = w < num_words ? static_cast<uint32_t>(words[w]) : 0u;
    if (element_bytes == 4) {
      float* p = static_cast<float*>(row) + column;
      if (width == 32)
        mask_word_f32(p, word, neg_inf_bits);
      else
        mask_word(reinterpret_cast<uint32_t*>(p), word, neg_inf_bits, width);
    } else {
      uint16_t* p = static_cast<uint16_t*>(row) + column;
      if (width == 32)
        mask_word_16(p, word, static_cast<uint16_t>(neg_inf_bits));
      else
        mask_word(p, word, static_cast<uint16_t>(neg_inf_bits), width);
    }
  }
}

// Masks rows of logits [*, vocab] (float32, or a 16-bit float: element_bytes 4 or 2) in place by int32 words
// [*, num_words]: the rows rows[0..num_rows) of both, or rows 0..num_rows when rows is null. Rows and the word
// ranges of long rows are split between threads.
static void mask_logits(void* logits, int32_t element_bytes, uint32_t neg_inf_bits, int64_t vocab, int64_t ldl,
                        const int32_t* words, int64_t num_words, int64_t ldw, const int64_t* rows, int64_t num_rows,
                        int32_t threads) {
  const int64_t row_words = (vocab + 31) / 32;
  const int64_t chunks = (row_words + kMaskWordsPerClaim - 1) / kMaskWordsPerClaim;
  parallel_for(num_rows * chunks, 1, threads, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const int64_t r = rows != nullptr ? rows[item / chunks] : item / chunks;
      const int64_t first_word = (item % chunks) * kMaskWordsPerClaim;
      void* row = static_cast<char*>(logits) + r * ldl * element_bytes;
      mask_row_words(row, element_bytes, neg_inf_bits, vocab, words + r * ldw, num_words, first_word,
                     std::min(row_words, first_word + kMaskWordsPerClaim));
    }
  });
}

}  // namespace
