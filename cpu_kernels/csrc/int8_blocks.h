// Matmuls over GGUF block weights (Q8_0, Q4_1) as integer dot products with activations quantised per block, as
// llama.cpp multiplies its quantised weights, in the column groups of dense_matmul.h.
//
// Each row of x is quantised per 32-block: amax = max |x|, d = amax / 127, q = round-half-even(x * (127 / amax)) in
// [-127, 127] (q = 0 where amax is 0). A weight block's product with it is an integer sum, exact in any order, so the
// SIMD width, the instruction (AVX512-VNNI vpdpbusd, AVX-VNNI, or vpmaddubsw and vpmaddwd), the tiling and the threads
// cannot change it. Then, per output element and per block b in order, one fixed float sequence:
//   acc = fma(d_w * d_x, float(sum of q_w q_x), acc)            (the sum is exact in float: |sum| < 2^24)
//   Q4_1: acc = fma(m_w, d_x * float(sum of q_x), acc)          (the block minimum times the block's sum of x)
// so every build computes the same bits for a row, whatever else shares the call.
//
// Packed layout per panel of 16 columns, per 32-block (Python's pack_q8_0 and pack_q4_1): the quants as 16 lanes of
// 4 consecutive k, lane = column, so that one 32-bit broadcast of 4 quantised x values feeds 16 columns:
// - Q8_0: int8 q[8 quads][16 lanes][4], then float16 d[16]                              (544 bytes)
// - Q4_1: uint8 [4][16 lanes][4]: byte j of lane l in vector i holds k = 4i + j in its low nibble and k = 16 + 4i + j
//   in its high nibble; then float16 d[16], m[16]                                          (320 bytes)
// The panels are stored in groups of kGroupPanels, block by block (PanelGroup): a group holds its panels' block 0
// side by side, then their block 1, and so on.

#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "buffer.h"
#include "dense_matmul.h"
#include "simd.h"
#include "thread_pool.h"

namespace {

// ---- 64 bytes as 16 lanes of 4, and 16 int32 sums ----------------------------------------------------------------

#if defined(__AVX512F__) && defined(__AVX512BW__)
struct B64 {
  __m512i r;
};
struct I16 {
  __m512i r;
};
static inline I16 izero() { return {_mm512_setzero_si512()}; }
static inline I16 iset1(int32_t v) { return {_mm512_set1_epi32(v)}; }
static inline B64 bload(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
static inline B64 bbroadcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return {_mm512_set1_epi32(v)};
}
static inline B64 blow(B64 b) { return {_mm512_and_si512(b.r, _mm512_set1_epi8(15))}; }
#if defined(__GFNI__)
// Each byte shifted right by 4 as one affine map over GF(2) (result bit i = byte bit i + 4): one instruction on the
// vector ports where the shift and mask are two, for every 64 bytes of 4-bit quants a tile reads.
static inline B64 bhigh(B64 b) {
  return {_mm512_gf2p8affine_epi64_epi8(b.r, _mm512_set1_epi64(0x1020408000000000), 0)};
}
#else
static inline B64 bhigh(B64 b) { return {_mm512_and_si512(_mm512_srli_epi16(b.r, 4), _mm512_set1_epi8(15))}; }
#endif
static inline V16 vfrom_i32(I16 a) { return {_mm512_cvtepi32_ps(a.r)}; }
static inline I16 isub_scalar(I16 a, int32_t b) { return {_mm512_sub_epi32(a.r, _mm512_set1_epi32(b))}; }
#if defined(__AVX512VNNI__)
constexpr int32_t kSignedBias = 128;  // signed weights enter vpdpbusd as unsigned w + 128
static inline B64 bsigned(B64 w) { return {_mm512_xor_si512(w.r, _mm512_set1_epi8(static_cast<char>(0x80)))}; }
static inline I16 dot_u(I16 acc, B64 u, B64 s) { return {_mm512_dpbusd_epi32(acc.r, u.r, s.r)}; }
static inline I16 dot_s(I16 acc, B64 w, B64 s) { return dot_u(acc, w, s); }
static const char* const kDotIsa = "avx512-vnni";
#else
constexpr int32_t kSignedBias = 0;
static inline B64 bsigned(B64 w) { return w; }
// u * s in pairs: below 2 * 128 * 127, so vpmaddubsw never saturates
static inline I16 dot_u(I16 acc, B64 u, B64 s) {
  return {_mm512_add_epi32(acc.r, _mm512_madd_epi16(_mm512_maddubs_epi16(u.r, s.r), _mm512_set1_epi16(1)))};
}
static inline I16 dot_s(I16 acc, B64 w, B64 s) {  // |w| * (s with w's sign)
  const __mmask64 negative = _mm512_movepi8_mask(w.r);
  const __m512i signed_s = _mm512_mask_sub_epi8(s.r, negative, _mm512_setzero_si512(), s.r);
  return dot_u(acc, {_mm512_abs_epi8(w.r)}, {signed_s});
}
static const char* const kDotIsa = "avx512";
#define INT8_WORD_SUMS 1
struct W32 {
  __m512i r;
};
static inline W32 wstart(I16) { return {_mm512_setzero_si512()}; }
static inline W32 wdot(W32 w, B64 u, B64 s) { return {_mm512_add_epi16(w.r, _mm512_maddubs_epi16(u.r, s.r))}; }
static inline I16 wend(I16 acc, W32 w) {
  return {_mm512_add_epi32(acc.r, _mm512_madd_epi16(w.r, _mm512_set1_epi16(1)))};
}
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct B64 {
  __m256i lo, hi;
};
struct I16 {
  __m256i lo, hi;
};
static inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline I16 iset1(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
static inline B64 bload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
static inline B64 bbroadcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  const __m256i b = _mm256_set1_epi32(v);
  return {b, b};
}
static inline B64 blow(B64 b) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(b.lo, m), _mm256_and_si256(b.hi, m)};
}
static inline B64 bhigh(B64 b) {
  const __m256i m = _mm256_set1_epi8(15);
  return {_mm256_and_si256(_mm256_srli_epi16(b.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(b.hi, 4), m)};
}
static inline V16 vfrom_i32(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
static inline I16 isub_scalar(I16 a, int32_t b) {
  const __m256i v = _mm256_set1_epi32(b);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
#if defined(__AVXVNNI__)
constexpr int32_t kSignedBias = 128;
static inline B64 bsigned(B64 w) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  return {_mm256_xor_si256(w.lo, flip), _mm256_xor_si256(w.hi, flip)};
}
static inline I16 dot_u(I16 acc, B64 u, B64 s) {
  return {_mm256_dpbusd_avx_epi32(acc.lo, u.lo, s.lo), _mm256_dpbusd_avx_epi32(acc.hi, u.hi, s.hi)};
}
static inline I16 dot_s(I16 acc, B64 w, B64 s) { return dot_u(acc, w, s); }
static const char* const kDotIsa = "avx2-vnni";
#else
constexpr int32_t kSignedBias = 0;
static inline B64 bsigned(B64 w) { return w; }
static inline __m256i dot_u8(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline I16 dot_u(I16 acc, B64 u, B64 s) { return {dot_u8(acc.lo, u.lo, s.lo), dot_u8(acc.hi, u.hi, s.hi)}; }
static inline I16 dot_s(I16 acc, B64 w, B64 s) {
  return {dot_u8(acc.lo, _mm256_abs_epi8(w.lo), _mm256_sign_epi8(s.lo, w.lo)),
          dot_u8(acc.hi, _mm256_abs_epi8(w.hi), _mm256_sign_epi8(s.hi, w.hi))};
}
static const char* const kDotIsa = "avx2";
#define INT8_WORD_SUMS 1
struct W32 {
  __m256i lo, hi;
};
static inline W32 wstart(I16) { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline W32 wdot(W32 w, B64 u, B64 s) {
  return {_mm256_add_epi16(w.lo, _mm256_maddubs_epi16(u.lo, s.lo)),
          _mm256_add_epi16(w.hi, _mm256_maddubs_epi16(u.hi, s.hi))};
}
static inline I16 wend(I16 acc, W32 w) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(w.lo, ones)),
          _mm256_add_epi32(acc.hi, _mm256_madd_epi16(w.hi, ones))};
}
#endif
#else
struct B64 {
  int8_t b[4 * kLanes];
};
struct I16 {
  int32_t v[kLanes];
};
static inline I16 izero() { return {}; }
static inline I16 iset1(int32_t v) {
  I16 out;
  for (auto& lane : out.v) lane = v;
  return out;
}
static inline B64 bload(const uint8_t* p) {
  B64 out;
  memcpy(out.b, p, sizeof out.b);
  return out;
}
static inline B64 bbroadcast4(const int8_t* p) {
  B64 out;
  for (int l = 0; l < kLanes; ++l) memcpy(out.b + 4 * l, p, 4);
  return out;
}
static inline B64 blow(B64 b) {
  for (auto& v : b.b) v = static_cast<int8_t>(static_cast<uint8_t>(v) & 15);
  return b;
}
static inline B64 bhigh(B64 b) {
  for (auto& v : b.b) v = static_cast<int8_t>(static_cast<uint8_t>(v) >> 4);
  return b;
}
static inline V16 vfrom_i32(I16 a) {
  V16 out;
  for (int l = 0; l < kLanes; ++l) out.v[l] = static_cast<float>(a.v[l]);
  return out;
}
static inline I16 isub_scalar(I16 a, int32_t b) {
  for (auto& v : a.v) v -= b;
  return a;
}
constexpr int32_t kSignedBias = 0;
static inline B64 bsigned(B64 w) { return w; }
static inline I16 dot_u(I16 acc, B64 u, B64 s) {
  for (int l = 0; l < kLanes; ++l)
    for (int j = 0; j < 4; ++j) acc.v[l] += static_cast<uint8_t>(u.b[4 * l + j]) * s.b[4 * l + j];
  return acc;
}
static inline I16 dot_s(I16 acc, B64 w, B64 s) {
  for (int l = 0; l < kLanes; ++l)
    for (int j = 0; j < 4; ++j) acc.v[l] += w.b[4 * l + j] * s.b[4 * l + j];
  return acc;
}
static const char* const kDotIsa = "scalar";
#endif

// Sums of unsigned quants u times x, between wstart(acc) and wend(acc, w): w = wdot(w, u, x) per product. Builds
// without VNNI keep vpmaddubsw's pair sums as 16-bit words there and widen them with one vpmaddwd at wend, rather
// than one per product (the multiply ports are what a row's tiles wait on: AVX2 on AMD EPYC Zen 3); the others add
// into the int32 sums directly. Exact while the words cannot overflow: u < 2^bits and |x| <= 128 give a pair sum of
// at most 2 * (2^bits - 1) * 128, so kWordDots<bits> products between widenings (8 for 4-bit quants, 4 for 5-bit, 2
// for 6-bit): the same integers as dot_u's. AVX2 on AMD EPYC Zen 3, SmolLM2's 16 matmuls of 4 layers at 64 rows on 2
// threads, medians of 5 interleaved rounds: Q4_1 11.7 -> 11.2 ms, Q5_0 15.4 -> 13.3 (one row: docs/benchmarks.md).
#ifndef INT8_WORD_SUMS
using W32 = I16;
static inline W32 wstart(I16 acc) { return acc; }
static inline W32 wdot(W32 w, B64 u, B64 s) { return dot_u(w, u, s); }
static inline I16 wend(I16, W32 w) { return w; }
#endif
template <int bits>
constexpr int kWordDots = 32767 / (2 * ((1 << bits) - 1) * 128);

// A row's sums, made whole in registers where the tile's code puts this: left free, GCC reassociates the integer
// additions of a block, computes its products first and spills them (AVX2: the 4-row Q4_1 tile stored 116 ymm a
// block to the stack; kept, none). Integer sums: the same values in any order. AMD EPYC Zen 3, SmolLM2's Q4_1
// matmuls on 2 threads, the two builds alternating in one process: 4 rows 1.16-1.26x the rate, 32 rows 1.47-1.66x,
// 512 rows 1.37x, one row 1.01-1.05x. The k-quant tiles of several rows keep theirs too (kInt8MR's note). The Q8_0
// tile (36 spilled) measured up to 16% slower kept, as the k-quant tiles did at 2 rows; it and the k-quant one-row
// tiles keep GCC's order.
template <class Sums>
static inline void keep_in_registers(Sums& sums) {
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  asm("" : "+x"(sums.lo), "+x"(sums.hi));
#else
  (void)sums;
#endif
}

// 16 integral floats in [-127, 127] to int8
static inline void vstore_i8(int8_t* p, V16 a) {
#if defined(__AVX512F__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(a.r)));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  const __m256i words = _mm256_permute4x64_epi64(
      _mm256_packs_epi32(_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)), 0xD8);  // 16 int16 in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
#else
  for (int l = 0; l < kLanes; ++l) p[l] = static_cast<int8_t>(a.v[l]);
#endif
}

// ---- the activations, quantised ----------------------------------------------------------------------------------

// Rows of x quantised per 32-block: q [M][K], and per row and block d_x, d_x * sum(q) and -kSignedBias * sum(q),
// where a Q8_0 block's integer sums start: vpdpbusd adds kSignedBias to each signed weight, and starting the sums at
// minus its products takes it back without an instruction of its own per sum (the same integers).
struct QuantizedRows {
  Buffer<int8_t> q;
  Buffer<float> scale, scaled_sum;
  Buffer<int32_t> signed_start;
  int64_t K = 0, nblocks = 0;
};

// Where block `at`'s integer sums of one row start (at = row * nblocks + block).
template <int32_t F>
static inline I16 block_sums_start(const QuantizedRows& x, int64_t at) {
  if constexpr (F == kQ8_0 && kSignedBias != 0) return iset1(x.signed_start[at]);
  return izero();
}

// 16 consecutive blocks of a row as quantize_row quantises each: the 16 blocks' trees side by side (tree_max16,
// tree_sum16: the same pairings) and their divisions as one vector's, each lane the same IEEE operation. A block's
// scalar steps (its maximum and sum trees, two divisions) were most of its time, alone (AMD EPYC: 6 -> 3.7 ns a
// block); an 8-row matmul quantises its rows on one thread while the others wait.
static void quantize_16_blocks(const float* x, int8_t* q, float* scale, float* scaled_sum, int32_t* signed_start) {
  V16 parts[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    const V16 x0 = vload(x + j * kBlock), x1 = vload(x + j * kBlock + kLanes);
    parts[j] = vmax(vmax(x0, vsub(vzero(), x0)), vmax(x1, vsub(vzero(), x1)));
  }
  const V16 amax = tree_max16(parts);
  alignas(64) float amaxes[kLanes], inverses[kLanes], sums[kLanes];
  vstore(amaxes, amax);
  vstore(inverses, vdiv(vset1(127.0f), amax));
  for (int j = 0; j < kLanes; ++j) inverses[j] = amaxes[j] > 0.0f ? inverses[j] : 0.0f;
  for (int j = 0; j < kLanes; ++j) {
    const V16 inverse = vset1(inverses[j]);
    const V16 q0 = vround(vmul(vload(x + j * kBlock), inverse));
    const V16 q1 = vround(vmul(vload(x + j * kBlock + kLanes), inverse));
    vstore_i8(q + j * kBlock, q0);
    vstore_i8(q + j * kBlock + kLanes, q1);
    parts[j] = vadd(q0, q1);
  }
  const V16 sum = tree_sum16(parts), d = vdiv(amax, vset1(127.0f));
  vstore(scale, d);
  vstore(scaled_sum, vmul(d, sum));
  vstore(sums, sum);
  for (int j = 0; j < kLanes; ++j) signed_start[j] = -kSignedBias * static_cast<int32_t>(sums[j]);
}

static void quantize_row(const float* x, int64_t nblocks, int8_t* q, float* scale, float* scaled_sum,
                         int32_t* signed_start) {
  int64_t b = 0;
  for (; b + kLanes <= nblocks; b += kLanes)
    quantize_16_blocks(x + b * kBlock, q + b * kBlock, scale + b, scaled_sum + b, signed_start + b);
  for (; b < nblocks; ++b) {
    const V16 x0 = vload(x + b * kBlock), x1 = vload(x + b * kBlock + kLanes);
    const V16 magnitudes = vmax(vmax(x0, vsub(vzero(), x0)), vmax(x1, vsub(vzero(), x1)));
    const float amax = tree_max(magnitudes);  // max is exact in any order
    const V16 inverse = vset1(amax > 0.0f ? 127.0f / amax : 0.0f);
    const V16 q0 = vround(vmul(x0, inverse)), q1 = vround(vmul(x1, inverse));
    vstore_i8(q + b * kBlock, q0);
    vstore_i8(q + b * kBlock + kLanes, q1);
    const float sum = tree_sum(vadd(q0, q1));  // integers below 2^24: exact
    scale[b] = amax / 127.0f;
    scaled_sum[b] = scale[b] * sum;
    signed_start[b] = -kSignedBias * static_cast<int32_t>(sum);
  }
}

// Threads split the row-blocks: a thread's share in one claim up to one row block of the tiles (for_each_tile's
// rule), a quarter of it past that, and at least kBlocksPerClaim (~1 µs: handing work to another thread costs about
// that; below it one thread quantises all). AMD EPYC, 2 threads, SmolLM2's matmuls at 32 rows: rows on one thread
// -> blocks on two: 3% faster; at 8 and 16 rows no faster, so they stay on one. Each block is quantised alone: the
// same bits however they are split.
constexpr int64_t kBlocksPerClaim = 256;
constexpr int64_t kInt8RowBlock = 64;  // rows per pass of the tiles over a column group: their quants stay in cache

static void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int threads, QuantizedRows* out) {
  const int64_t nblocks = K / kBlock;
  out->K = K;
  out->nblocks = nblocks;
  out->q.resize(M * K);
  out->scale.resize(M * nblocks);
  out->scaled_sum.resize(M * nblocks);
  out->signed_start.resize(M * nblocks);
  const int64_t units = M * nblocks, share = (units + threads - 1) / threads;
  parallel_for(units, std::max(kBlocksPerClaim, M <= kInt8RowBlock ? share : share / 4), threads,
               [&](int64_t first, int64_t last) {
                 for (int64_t u = first; u < last;) {  // row-block u: row u / nblocks's block u % nblocks
                   // rows end to end (ldx == K): a run crosses them, 16 blocks at a time past a row's end
                   const int64_t m = u / nblocks, b = u % nblocks;
                   const int64_t n = ldx == K ? last - u : std::min(last - u, nblocks - b);
                   quantize_row(x + m * ldx + b * kBlock, n, out->q.data() + m * K + b * kBlock,
                                out->scale.data() + u, out->scaled_sum.data() + u, out->signed_start.data() + u);
                   u += n;
                 }
               });
}

// ---- the tiles ---------------------------------------------------------------------------------------------------

static constexpr int64_t int8_block_bytes(int32_t format) { return format == kQ8_0 ? 8 * 64 + 32 : 4 * 64 + 64; }

// ---- the panels, in groups -----------------------------------------------------------------------------------------
//
// Block weights store their panels in groups of kGroupPanels (the last group holds the rest), block by block: per
// super-block (Q4_K, Q5_K, Q6_K; per 32-block for the others) the group's panels' heads side by side, then per block
// the group's panels' blocks side by side (Python's packed_weights._grouped, which asks the build for the width). A
// one-row tile over a whole group then reads one sequential stream, where separate panels were 8 streams a few KB
// long each, on which the hardware prefetchers kept fewer reads in flight (docs/benchmarks.md: one thread streamed
// ~31 GB/s, a sum 47). The AVX2 and scalar builds, whose tiles are one panel wide, keep one panel a group: a tile
// over 1 of 8 panels strided through the group (AVX2, one thread, from memory: Q4_1 43 -> 26 GB/s). Where the bytes
// are changes no arithmetic: the same bits.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int64_t kGroupPanels = 8;
#else
constexpr int64_t kGroupPanels = 1;
#endif

// A tile's panels: `width` panels from `base` on, the tile's first one `first` of them. A spread tile's panels
// (for_each_spread_span) lie `spread` panels apart, `spread_bytes` from one to the next; the others' side by side.
struct PanelGroup {
  const uint8_t* base;
  int64_t width, first;
  int64_t spread = 0, spread_bytes = 0;
};

// Where the tile's panel p has what its first panel has at `first`: `unit` bytes on per panel in a group.
static inline const uint8_t* tile_panel(const PanelGroup& g, const uint8_t* first, int p, int64_t unit) {
  return first + p * (g.spread != 0 ? g.spread_bytes : unit);
}

// Columns from one of the tile's panels' outputs to the next.
static inline int64_t tile_columns(const PanelGroup& g) { return g.spread != 0 ? g.spread * kLanes : kLanes; }

// The group holding `panel` of a weight of `num_panels` panels of `pbytes` each.
static inline PanelGroup panel_group(const uint8_t* packed, int64_t pbytes, int64_t num_panels, int64_t panel) {
  const int64_t start = panel / kGroupPanels * kGroupPanels;
  return {packed + start * pbytes, std::min(kGroupPanels, num_panels - start), panel - start};
}

// Where block b of the tile's first panel is, in a group of super-blocks (head, then `per_super` blocks per panel;
// per_super 1 and no head for the 32-block formats); the tile's next panels' blocks follow it.
static inline const uint8_t* group_block(const PanelGroup& g, int64_t b, int64_t head_bytes, int64_t block_bytes,
                                         int64_t per_super) {
  const uint8_t* super = g.base + (b / per_super) * g.width * (head_bytes + per_super * block_bytes);
  return super + g.width * head_bytes + ((b % per_super) * g.width + g.first) * block_bytes;
}

// Where the head of the super-block holding block b of the tile's first panel is; its next panels' heads follow.
static inline const uint8_t* group_head(const PanelGroup& g, int64_t b, int64_t head_bytes, int64_t block_bytes,
                                        int64_t per_super) {
  return g.base + (b / per_super) * g.width * (head_bytes + per_super * block_bytes) + g.first * head_bytes;
}

// Cache hints, the same bits either way. A tile of several rows asks for the same block of the next column
// group's panels while it computes: the next group's first tile would otherwise wait on memory (docs/benchmarks.md:
// SmolLM2's matmuls at 8 rows from memory). A tile of one row asks for its own panels' blocks kRowAhead blocks on:
// a one-row tile does little work per byte, and the hardware prefetchers alone kept too few reads in flight (one
// thread streamed 30 GB/s, 46 with these hints; a sum reads 47). Past the last block the hint reaches the next
// group's first blocks, which the thread's next tile reads; past the weight it fetches nothing anyone reads. Builds
// of one-panel groups give one-row tiles no hints: there a single panel streams, and the hints measured slower
// (AVX2, one thread: Q4_1 44 -> 38 GB/s, Q5_0 37 -> 32).
// - Q8_0 and Q4_1 ask kAheadBytes of a group on (kInt8Ahead blocks, at least kRowAhead): about 10 KB in flight a
//   thread. Q4_1 4 blocks (10 KB) rather than 2: SmolLM2's 120 one-row Q4_1 matmuls of a step from memory on 2
//   threads, best of 6 alternating runs, 849 -> 808 µs (5 and 6 alike, 8 slower); Q8_0 stays at 2 (8.7 KB): its
//   lm_head (49152 x 576) from memory, 568 µs at 2 blocks, 675 at 3, 622 at 4 (AMD EPYC). The k-quant one-row
//   tiles ask about 11 KB on, a quarter of a block at a time (kquant_blocks.h's kOneRowAhead).
// - In groups of panels, a group's first row tile of several also asks for its own blocks ahead: nothing asked for
//   a claim's first group, and a few rows' claims hold few groups (8 rows: down's 9 a thread). The 120 matmuls at
//   8 rows, best of 6: 2072 -> 1983 µs; 4 to 32 rows 3-5% faster.
constexpr int64_t kRowAhead = 2;
constexpr int64_t kAheadBytes = 10240;
template <int32_t F>
constexpr int64_t kInt8Ahead = std::max(kRowAhead, kAheadBytes / (kGroupPanels * int8_block_bytes(F)));
template <int MR>
constexpr bool kHinted = MR > 1 || kGroupPanels > 1;
template <int64_t kBytes>
static inline void prefetch_bytes(const uint8_t* p) {
  for (int64_t at = 0; at < kBytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + kBytes - 1), _MM_HINT_T0);
}

// Block b of MR rows from `row` on times NP panels (their blocks from `block` on, block_bytes apart) into acc: the
// integer sums, then per panel and row the block's float steps, int8_tile's loop body to the operation (for the
// streamed rows below). int8_tile keeps its own copy: built on this step, GCC 12's code for its tiles changed, and
// the Q8_0 lm_head at 8 rows from memory went 394 -> 442 µs (4 rows 303 -> 261; the 120 Q4_1 matmuls at 8 rows
// +1-2%; AMD EPYC; re-measured in the session after, seq.cpp/lmh.cpp alternating 3 times: 4 and 8 rows +1.5-3%, the
// lm_head +1-4%, and the tile's hints passed in as a callback 20-40% slower). The invariance tests hold both to the
// same bits.
template <int32_t F, int MR, int NP>
static inline __attribute__((always_inline)) void int8_block(V16 (&acc)[MR][NP], const QuantizedRows& x, int64_t row,
                                                             const uint8_t* block, int64_t b) {
  constexpr int64_t block_bytes = int8_block_bytes(F);
  const int64_t K = x.K, nblocks = x.nblocks;
  I16 s[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) s[r][p] = block_sums_start<F>(x, (row + r) * nblocks + b);
  const int8_t* xq = x.q.data() + row * K + b * kBlock;
  if constexpr (F == kQ8_0) {
    for (int i = 0; i < 8; ++i) {
      B64 w[NP];
      for (int p = 0; p < NP; ++p) w[p] = bsigned(bload(block + p * block_bytes + i * 64));
      for (int r = 0; r < MR; ++r) {
        const B64 xv = bbroadcast4(xq + r * K + 4 * i);
        for (int p = 0; p < NP; ++p) s[r][p] = dot_s(s[r][p], w[p], xv);
      }
    }
  } else {
    W32 w[MR][NP];  // 8 products of 4-bit quants: one widening
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NP; ++p) w[r][p] = wstart(s[r][p]);
    for (int i = 0; i < 4; ++i) {
      B64 lo[NP], hi[NP];
      for (int p = 0; p < NP; ++p) {
        const B64 packed = bload(block + p * block_bytes + i * 64);
        lo[p] = blow(packed);
        hi[p] = bhigh(packed);
      }
      for (int r = 0; r < MR; ++r) {
        const B64 x_lo = bbroadcast4(xq + r * K + 4 * i), x_hi = bbroadcast4(xq + r * K + 16 + 4 * i);
        for (int p = 0; p < NP; ++p) w[r][p] = wdot(wdot(w[r][p], lo[p], x_lo), hi[p], x_hi);
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NP; ++p) s[r][p] = wend(s[r][p], w[r][p]);
  }
  constexpr int64_t scales_at = F == kQ8_0 ? 8 * 64 : 4 * 64;
  for (int p = 0; p < NP; ++p) {
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(block + p * block_bytes + scales_at);
    const V16 d = vfrom_f16(scales);
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (row + r) * nblocks + b;
      acc[r][p] = vfma(vmul(d, vset1(x.scale[at])), vfrom_i32(s[r][p]), acc[r][p]);
    }
    if constexpr (F == kQ4_1) {
      const V16 mins = vfrom_f16(scales + kLanes);
      for (int r = 0; r < MR; ++r) acc[r][p] = vfma(mins, vset1(x.scaled_sum[(row + r) * nblocks + b]), acc[r][p]);
    }
  }
}

// MR rows from `row` on, times NP panels of group g, every block; `next`: the next column group's panels.
template <int32_t F, int MR, int NP>
static void int8_tile(const QuantizedRows& x, int64_t row, const PanelGroup& g, const PanelGroup& next, float* y,
                      int64_t ldy, int cols) {
  constexpr int64_t block_bytes = int8_block_bytes(F);
  const int64_t K = x.K, nblocks = x.nblocks;
  V16 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vzero();
  for (int64_t b = 0; b < nblocks; ++b) {
    I16 s[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NP; ++p) s[r][p] = block_sums_start<F>(x, (row + r) * nblocks + b);
    const int8_t* xq = x.q.data() + row * K + b * kBlock;
    const uint8_t* block = group_block(g, b, 0, block_bytes, 1);
    const uint8_t* panel_block[NP];
    for (int p = 0; p < NP; ++p) panel_block[p] = tile_panel(g, block, p, block_bytes);
    if constexpr (MR > 1) {
      prefetch_bytes<NP * block_bytes>(group_block(next, b, 0, block_bytes, 1));
      if (kGroupPanels > 1 && row == 0)
        prefetch_bytes<NP * block_bytes>(group_block(g, b + kInt8Ahead<F>, 0, block_bytes, 1));
    } else if constexpr (kHinted<MR>)
      prefetch_bytes<NP * block_bytes>(group_block(g, b + kInt8Ahead<F>, 0, block_bytes, 1));
    if constexpr (F == kQ8_0) {
      for (int i = 0; i < 8; ++i) {
        B64 w[NP];
        for (int p = 0; p < NP; ++p) w[p] = bsigned(bload(panel_block[p] + i * 64));
        for (int r = 0; r < MR; ++r) {
          const B64 xv = bbroadcast4(xq + r * K + 4 * i);
          for (int p = 0; p < NP; ++p) s[r][p] = dot_s(s[r][p], w[p], xv);
        }
      }
    } else {
      W32 w[MR][NP];  // 8 products of 4-bit quants: one widening
      for (int r = 0; r < MR; ++r)
        for (int p = 0; p < NP; ++p) w[r][p] = wstart(s[r][p]);
      for (int i = 0; i < 4; ++i) {
        B64 lo[NP], hi[NP];
        for (int p = 0; p < NP; ++p) {
          const B64 packed = bload(panel_block[p] + i * 64);
          lo[p] = blow(packed);
          hi[p] = bhigh(packed);
        }
        for (int r = 0; r < MR; ++r) {
          const B64 x_lo = bbroadcast4(xq + r * K + 4 * i), x_hi = bbroadcast4(xq + r * K + 16 + 4 * i);
          for (int p = 0; p < NP; ++p)
            w[r][p] = wdot(wdot(w[r][p], lo[p], x_lo), hi[p], x_hi), keep_in_registers(w[r][p]);
        }
      }
      for (int r = 0; r < MR; ++r)
        for (int p = 0; p < NP; ++p) s[r][p] = wend(s[r][p], w[r][p]);
    }
    constexpr int64_t scales_at = F == kQ8_0 ? 8 * 64 : 4 * 64;
    for (int p = 0; p < NP; ++p) {
      const uint16_t* scales = reinterpret_cast<const uint16_t*>(panel_block[p] + scales_at);
      const V16 d = vfrom_f16(scales);
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (row + r) * nblocks + b;
        acc[r][p] = vfma(vmul(d, vset1(x.scale[at])), vfrom_i32(s[r][p]), acc[r][p]);
      }
      if constexpr (F == kQ4_1) {
        const V16 mins = vfrom_f16(scales + kLanes);
        for (int r = 0; r < MR; ++r)
          acc[r][p] = vfma(mins, vset1(x.scaled_sum[(row + r) * nblocks + b]), acc[r][p]);
      }
    }
  }
  store_tile<MR, NP>(acc, y, ldy, cols, tile_columns(g));
}

// A tile of 1..MR rows and 1..NP panels, each with the code compiled for exactly that many.
template <int32_t F, int MR, int NP>
static void int8_rows(int rows, int panels_here, const QuantizedRows& x, int64_t row, const PanelGroup& g,
                      const PanelGroup& next, float* y, int64_t ldy, int cols) {
  if constexpr (MR > 1) {
    if (rows < MR) return int8_rows<F, MR - 1, NP>(rows, panels_here, x, row, g, next, y, ldy, cols);
  }
  if constexpr (NP > 1) {
    if (panels_here < NP) return int8_rows<F, MR, NP - 1>(rows, panels_here, x, row, g, next, y, ldy, cols);
  }
  int8_tile<F, MR, NP>(x, row, g, next, y, ldy, cols);
}

// Tile shapes: MR x NP integer sums and as many float accumulators beside the weights (32 zmm or 16 ymm), for every
// block format (the k-quant formats' tiles in kquant_blocks.h too). On an AMD EPYC (AVX512-VNNI), SmolLM2's four
// matmuls at 512 rows: 4 x 2 1.14-1.21 TOP/s, 3 x 3 1.06-1.11, 2 x 4 ~1.0, 4 x 3 and 8 x 1 ~0.92-0.94, 6 x 2
// 0.82-0.89 (the larger tiles spill). AVX2 on AMD EPYC Zen 3, the same matmuls on 2 threads, the best of 4
// interleaved runs (GOP/s, 2 / 3 / 4 rows a tile): Q4_1 at 8 rows 183 / 180 / 204, at 512 218 / 237 / 245; Q8_0 at
// 8 rows 138 / 150 / 167, at 512 194 / 184 / 176. The k-quant tiles took 2 rows on AVX2 while GCC spilled their
// word sums (Q5_0 at 8 rows 146 / 140 / 96, at 512 202 / 131 / 144); with the sums kept in registers
// (keep_in_registers) 4 rows against 2, in one process (scripts/bench_kernel_ab.py): 4 to 512 rows 1.1-1.45x the
// rate for Q4_0, Q4_K, Q5_0, Q5_1 and Q5_K, Q6_K 1.0-1.1x.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int kInt8MR = 4, kInt8NP = 2;
#else
constexpr int kInt8MR = 4, kInt8NP = 1;
#endif

template <int32_t F, int MR, int NP>
static void int8_groups(const QuantizedRows& x, int64_t M, const uint8_t* packed, int64_t N, float* y, int64_t ldy,
                        int threads) {
  static_assert(kGroupPanels % NP == 0, "a tile's panels lie in one group");
  const int64_t pbytes = x.nblocks * int8_block_bytes(F), num_panels = (N + kLanes - 1) / kLanes;
  for_each_tile<MR, NP>(M, N, pbytes, kInt8RowBlock, threads,
                        [&](int rows, int panels_here, int64_t m, int64_t panel, int64_t column, int cols) {
                          int8_rows<F, MR, NP>(rows, panels_here, x, m,
                                            panel_group(packed, pbytes, num_panels, panel),
                                            panel_group(packed, pbytes, num_panels, panel + NP),
                                            y + m * ldy + column, ldy, cols);
                        });
}

// ---- two rows, block by block -------------------------------------------------------------------------------------
//
// Two rows (an extend of two tokens: a short draft verified; a batch of two) stream the weights as one row does
// (for_each_row_span: each thread an even span of panels, in pieces within a group): per block, the piece's panels
// side by side are one sequential read, hinted kInt8Ahead blocks on as the one-row tile's, and 2 x 2 tiles go over
// them while they are in L1; each row's and panel's float accumulator waits in a stash in L1 between blocks (stored
// and loaded again, the same bits). The column groups' tiles read a block's 8 panels in passes of 2 or 4, strided,
// and streamed slower: SmolLM2's 120 Q4_1 matmuls at 2 rows from memory 1,095-1,126 -> 958 µs (one row ~790-830),
// its Q8_0 lm_head (49152 x 576) 341-367 -> 244-246 µs (AMD EPYC Zen 5, 2 threads; docs/benchmarks.md). At 3 rows
// the same (1,205 both); at 4 and 8 slower (1,118-1,135 -> 1,468-1,481 µs, 1,931-1,952 -> 2,687-2,713): there the
// tiles are near compute-bound (per row, panel and block 8 vpdpbusd, a vmulps and 2 vfmadd share the two FMA pipes:
// ~5.5 cycles at best, the 4 x 2 tile ~5.7-6.5 in L1), and the stash's loads and stores and the shorter runs of the
// tiles (8.3 cycles) cost more than the stream gains; they keep the tiles.
constexpr int kStreamedRows = 2;
constexpr int kStreamedNP = 2;  // 2 x 4: 1,025 µs against 2 x 2's 947-963 in one run
constexpr int64_t kStashLd = kGroupPanels * kLanes;  // a row's accumulators in the stash: its group's columns

// Block b of M rows times NP panels (their blocks from `block` on), the accumulators in stash.
template <int32_t F, int M, int NP>
static inline __attribute__((always_inline)) void int8_block_stashed(float* stash, const QuantizedRows& x,
                                                                     const uint8_t* block, int64_t b) {
  V16 acc[M][NP];
  for (int r = 0; r < M; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vload(stash + r * kStashLd + p * kLanes);
  int8_block<F, M, NP>(acc, x, 0, block, b);
  for (int r = 0; r < M; ++r)
    for (int p = 0; p < NP; ++p) vstore(stash + r * kStashLd + p * kLanes, acc[r][p]);
}

// Block b of M rows times the piece's panels from p on (n of them), NP at a time, then fewer.
template <int32_t F, int M, int NP>
static inline __attribute__((always_inline)) void int8_block_panels(float* stash, const QuantizedRows& x,
                                                                    const uint8_t* block, int64_t b, int p, int n) {
  constexpr int64_t block_bytes = int8_block_bytes(F);
  for (; p + NP <= n; p += NP) int8_block_stashed<F, M, NP>(stash + p * kLanes, x, block + p * block_bytes, b);
  if constexpr (NP > 1)
    if (p < n) int8_block_panels<F, M, NP / 2>(stash, x, block, b, p, n);
}

// M rows times `panels` panels of group g from g.first on, into y's first `cols` columns.
template <int32_t F, int M>
static void int8_streamed_piece(const QuantizedRows& x, const PanelGroup& g, int panels, float* y, int64_t ldy,
                                int cols) {
  constexpr int64_t block_bytes = int8_block_bytes(F);
  const int64_t piece_bytes = panels * block_bytes;
  const auto hint = [&](int64_t b) {
    const uint8_t* p = group_block(g, b, 0, block_bytes, 1);
    for (int64_t at = 0; at < piece_bytes; at += 64) _mm_prefetch(reinterpret_cast<const char*>(p + at), _MM_HINT_T0);
  };
  alignas(64) float stash[M * kStashLd];
  for (float& v : stash) v = 0.0f;
  for (int64_t b = 0; b < kInt8Ahead<F>; ++b) hint(b);  // a thread's first piece: nothing asked for it yet
  for (int64_t b = 0; b < x.nblocks; ++b) {
    hint(b + kInt8Ahead<F>);
    int8_block_panels<F, M, kStreamedNP>(stash, x, group_block(g, b, 0, block_bytes, 1), b, 0, panels);
  }
  for (int r = 0; r < M; ++r) memcpy(y + r * ldy, stash + r * kStashLd, cols * sizeof(float));
}

template <int32_t F>
static void int8_streamed_rows(const QuantizedRows& x, const uint8_t* packed, int64_t N, float* y, int64_t ldy,
                               int threads) {
  const int64_t pbytes = x.nblocks * int8_block_bytes(F), num_panels = (N + kLanes - 1) / kLanes;
  for_each_row_span<kGroupPanels>(
      N, threads, [&](int, int panels, int64_t, int64_t panel, int64_t column, int cols) {
        int8_streamed_piece<F, kStreamedRows>(x, panel_group(packed, pbytes, num_panels, panel), panels, y + column,
                                              ldy, cols);
      });
}

template <int V>
using Int = std::integral_constant<int, V>;

// The block formats' tile shape for M rows and N columns: groups(Int<MR>(), Int<NP>()). One row (a decode step)
// takes a whole group of panels a tile where the registers hold them: a tile's sums are its only independent
// dot-product chains, and the threads' spans of panels balance whatever the tile's width (for_each_row_span).
// Two rows of Q8_0 and Q4_1 stream instead (int8_streamed_rows); the k-quant formats' take the 2 x 4 tile. Past
// those, kInt8MR rows a tile.
template <class Groups>
static void with_block_tile(int64_t M, int64_t N, int threads, const Groups& groups) {
  if constexpr (kInt8NP > 1) {
    if (M == 1) return groups(Int<1>(), Int<static_cast<int>(kGroupPanels)>());
    if (M == 2) return groups(Int<2>(), Int<4>());
  }
  groups(Int<kInt8MR>(), Int<kInt8NP>());
}

// One row where a build keeps one panel a group (kGroupPanels 1: AVX2, scalar): tiles of up to kSpreadPanels panels
// spread over each thread's span (for_each_spread_span); rows(panels_here, group, y at the tile's first column, cols).
// AMD EPYC Zen 3 (AVX2), SmolLM2's 120 one-row Q4_1 matmuls of a step from memory on 2 threads, min / medians of
// three runs of 5-10 interleaved rounds on a busy machine: one panel a tile 2,840 / 3,432-3,975 µs; 2 spread 2,155 /
// 2,657-2,711; 3 1,974 / 2,440-2,707; 4 2,052 / 2,675-2,811. Q8_0 and its lm_head alike; Q5_0's medians within
// the noise. One thread, 3 spread: Q4_1 5,416 / 5,755 -> 3,254 / 4,116, Q5_0 6,353 / 6,616 -> 4,350 / 4,567.
constexpr int kSpreadPanels = 3;
template <class Rows>
static void spread_tiles(const uint8_t* packed, int64_t pbytes, int64_t N, float* y, int threads, const Rows& rows) {
  const int64_t num_panels = (N + kLanes - 1) / kLanes;
  for_each_spread_span<kSpreadPanels>(N, threads, [&](int here, int64_t panel, int64_t stride, int cols) {
    PanelGroup g = panel_group(packed, pbytes, num_panels, panel);
    g.spread = stride, g.spread_bytes = stride * pbytes;
    rows(here, g, y + panel * kLanes, cols);
  });
}

// y[M, N] = x[M, K] @ W.T for block weights: x quantised, then the tiles.
static void int8_matmul(int32_t format, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed,
                        int64_t N, float* y, int64_t ldy, int threads) {
  QuantizedRows quantized;
  quantize_rows(x, M, K, ldx, threads, &quantized);
  const auto shapes = [&](auto f) {
    constexpr int32_t F = decltype(f)::value;
    if constexpr (kGroupPanels == 1)
      if (M == 1)
        return spread_tiles(packed, quantized.nblocks * int8_block_bytes(F), N, y, threads,
                            [&](int here, const PanelGroup& g, float* at, int cols) {
                              int8_rows<F, 1, kSpreadPanels>(1, here, quantized, 0, g, g, at, ldy, cols);
                            });
    with_block_tile(M, N, threads, [&](auto mr, auto np) {
      int8_groups<decltype(f)::value, decltype(mr)::value, decltype(np)::value>(quantized, M, packed, N, y, ldy,
                                                                                threads);
    });
  };
  if (kGroupPanels > 1 && M == kStreamedRows)
    return format == kQ8_0 ? int8_streamed_rows<kQ8_0>(quantized, packed, N, y, ldy, threads)
                           : int8_streamed_rows<kQ4_1>(quantized, packed, N, y, ldy, threads);
  if (format == kQ8_0) return shapes(Int<kQ8_0>());
  shapes(Int<kQ4_1>());
}

}  // namespace
