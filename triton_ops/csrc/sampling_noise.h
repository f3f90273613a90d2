// ---- the sampler's Exp(1) draws ---------------------------------------------------------------------------------
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

constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ull;

static inline uint64_t splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Branch-free (bit selects, no conditional), so that the loop calling it vectorises.
static inline float exponential_of_word(uint32_t word) {
  const uint32_t upper = word >> 31;                              // 1: u = t, 0: u = 1 - t
  const uint32_t k = (word ^ (0u - upper)) & 0x7fffffffu;         // the other 31 bits, flipped in the upper half
  const float t = (static_cast<float>(static_cast<int32_t>(k)) + 0.5f) * 0x1p-32f;  // (0, 1/2]
  uint32_t bits;
  memcpy(&bits, &t, sizeof bits);
  const uint32_t mantissa_bits = (bits & 0x007fffffu) | 0x3f800000u;  // t = 2^e m, m in [1, 2)
  const uint32_t halve = (0x3fb504f3u - mantissa_bits) >> 31;      // 1 where m > sqrt(2): halve it
  const uint32_t m_bits = mantissa_bits - (halve << 23);
  const int32_t exponent = static_cast<int32_t>(bits >> 23) - 127 + static_cast<int32_t>(halve);
  float m, y;
  memcpy(&m, &m_bits, sizeof m);
  const float m_less_1 = m - 1.0f, minus_t = -t;  // exact: m - 1 by Sterbenz's lemma
  uint32_t m_less_1_bits, minus_t_bits;
  memcpy(&m_less_1_bits, &m_less_1, sizeof m_less_1_bits);
  memcpy(&minus_t_bits, &minus_t, sizeof minus_t_bits);
  const uint32_t y_bits = (m_less_1_bits & (0u - upper)) | (minus_t_bits & (upper - 1u));
  memcpy(&y, &y_bits, sizeof y);
  const float e = static_cast<float>(exponent * static_cast<int32_t>(upper));
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
  return -(e * 0x1.63p-1f + (e * -0x1.bd0106p-13f + log1p_y));
}

constexpr int64_t kNoiseChunk = 1024;  // tokens a claim's words are drawn for at once

// out[r, v] for rows r < rows, tokens v < vocab: the draws of row r's key. Counter c's 64-bit output, stored
// little-endian, is the words of tokens 2c and 2c + 1.
static void exponentials_of_rows(const uint64_t* keys, int64_t rows, int64_t vocab, float* out, int threads) {
  static_assert(kNoiseChunk % 2 == 0, "a chunk holds whole counters");
  const int64_t chunks = (vocab + kNoiseChunk - 1) / kNoiseChunk;
  parallel_for(rows * chunks, 4, threads, [&](int64_t first, int64_t last) {
    alignas(64) uint32_t words[kNoiseChunk];
    for (int64_t item = first; item < last; ++item) {
      const int64_t row = item / chunks, begin = (item % chunks) * kNoiseChunk;
      const int64_t n = std::min(kNoiseChunk, vocab - begin);
      const uint64_t key = keys[row];
      const uint64_t counter = static_cast<uint64_t>(begin / 2) + 1;
      uint64_t draws64[kNoiseChunk / 2];
      for (int64_t c = 0; c < (n + 1) / 2; ++c) draws64[c] = splitmix64(key + (counter + c) * kSplitMixGamma);
      memcpy(words, draws64, sizeof draws64);
      float* draws = out + row * vocab + begin;
      for (int64_t v = 0; v < n; ++v) draws[v] = exponential_of_word(words[v]);
    }
  });
}
