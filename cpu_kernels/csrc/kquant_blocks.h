// Matmuls over the other GGUF block formats (Q4_0, Q5_0, Q5_1 in blocks of 32; the k-quants Q4_K, Q5_K, Q6_K in
// super-blocks of 256) as integer dot products with activations quantised per 32-block, exactly as int8_blocks.h
// does for Q8_0 and Q4_1, whose quantised rows, byte vectors and tile shapes it uses.
//
// Every quant enters the dot product unsigned (0..15, 0..31 or 0..63: vpmaddubsw's pairs stay below 2 * 63 * 127,
// so no build saturates), and a format's offset comes off the exact integer sum: s = sum(q_w q_x) - offset * sum(q_x).
// With d_x, X = sum(q_x) and scaled_sum = d_x * float(X) per x block (int8_blocks.h), per output element and per
// 32-block b in order, one fixed float sequence:
//   Q4_0 (w = d (q - 8)), Q5_0 (w = d (q - 16)):
//     acc = fma(d * d_x, float(s), acc)                      the same bits as Q8_0 holding the integers q - offset
//   Q5_1 (w = d q + m):
//     acc = fma(d * d_x, float(s), acc); acc = fma(m, scaled_sum, acc)                   as Q4_1
//   Q4_K, Q5_K (w = d sc_j q - dmin m_j, sub-block j of 32 of a super-block, sc_j and m_j 6-bit integers):
//     d_j = d * float(sc_j), m_j = dmin * float(m_j)        (exact: an 11-bit mantissa times 6 bits)
//     acc = fma(d_j * d_x, float(s), acc); acc = fma(m_j, -scaled_sum, acc)
//   Q6_K (w = d sc_h (q - 32), two sub-blocks h of 16 per x block, sc_h int8): s_0, s_1 the halves' integer sums,
//     c = fma(float(sc_0), float(s_0), float(sc_1) * float(s_1))      (exact: each product < 2^23, the sum < 2^24)
//     acc = fma(d * d_x, c, acc)
// so, as for the other formats, a row's bits do not depend on the batch, the tiles, the threads or the build.
//
// Packed layout per panel of 16 columns (Python's pack_q4_0 ... pack_q6_k). A 32-block's quants come in 8
// combinations of 64 bytes, 16 lanes of 4: combination c = 2i + h, byte j of lane l holds the quant of column l at
// k = 16h + 4i + j. The 4-bit formats store them as the Q4_1 panel: 4 vectors, vector i holding combination 2i in
// its low nibbles and 2i + 1 in its high nibbles. The 5- and 6-bit formats store `bits` vectors r[0..bits) that
// join_wide reads (and Python's _wide_quant_vectors writes): combination j < bits in the low bits of r[j]'s bytes,
// the others as xors of r's 16-bit words shifted, from the bits above.
// Then per block:       Q4_0 float16 d[16] (288 bytes); Q5_0 d[16] (352); Q5_1 d[16], m[16] (384);
//                       Q4_K uint8 sc[16], m[16] (288); Q5_K sc[16], m[16] (352); Q6_K int8 sc_0[16], sc_1[16] (416).
// A k-quant super-block is a head, Q4_K and Q5_K float16 d[16], dmin[16], Q6_K d[16], then its 8 blocks. Panels are
// stored in groups, block by block, as int8_blocks.h's (PanelGroup): per super-block the group's heads, then per block
// the group's blocks.

#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>

#include "buffer.h"
#include "dense_matmul.h"
#include "int8_blocks.h"
#include "simd.h"
#include "thread_pool.h"

namespace {

// ---- 16-bit shifts, bytes xor'ed and masked, and 16 small integers as floats ----------------------------------

#if defined(__AVX512F__) && defined(__AVX512BW__)
// h's 16-bit words shifted right: bits move from each word's high byte into its low byte
static inline B64 bsrl16(B64 h, int shift) { return {_mm512_srli_epi16(h.r, shift)}; }
static inline B64 bxor(B64 a, B64 b) { return {_mm512_xor_si512(a.r, b.r)}; }
// (a ^ b) & mask per byte, one vpternlogd
static inline B64 bxor_and(B64 a, B64 b, uint8_t mask) {
  return {_mm512_ternarylogic_epi32(a.r, b.r, _mm512_set1_epi8(static_cast<char>(mask)), 0x28)};
}
static inline B64 band(B64 a, uint8_t mask) {
  return {_mm512_and_si512(a.r, _mm512_set1_epi8(static_cast<char>(mask)))};
}
static inline V16 vfrom_u8(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
static inline V16 vfrom_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static inline B64 bsrl16(B64 h, int shift) { return {_mm256_srli_epi16(h.lo, shift), _mm256_srli_epi16(h.hi, shift)}; }
static inline B64 bxor(B64 a, B64 b) { return {_mm256_xor_si256(a.lo, b.lo), _mm256_xor_si256(a.hi, b.hi)}; }
static inline B64 band(B64 a, uint8_t mask) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
  return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
static inline B64 bxor_and(B64 a, B64 b, uint8_t mask) { return band(bxor(a, b), mask); }
static inline V16 vfrom_u8(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
static inline V16 vfrom_i8(const int8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
#else
static inline B64 bsrl16(B64 h, int shift) {  // little-endian words of bytes 2w, 2w + 1, as the vector builds'
  for (int w = 0; w < 2 * kLanes; ++w) {
    const unsigned word = (static_cast<unsigned>(static_cast<uint8_t>(h.b[2 * w + 1])) << 8 |
                           static_cast<uint8_t>(h.b[2 * w])) >> shift;
    h.b[2 * w] = static_cast<int8_t>(word & 0xFF);
    h.b[2 * w + 1] = static_cast<int8_t>(word >> 8);
  }
  return h;
}
static inline B64 bxor(B64 a, B64 b) {
  for (int i = 0; i < 4 * kLanes; ++i) a.b[i] = static_cast<int8_t>(a.b[i] ^ b.b[i]);
  return a;
}
static inline B64 band(B64 a, uint8_t mask) {
  for (auto& v : a.b) v = static_cast<int8_t>(v & mask);
  return a;
}
static inline B64 bxor_and(B64 a, B64 b, uint8_t mask) { return band(bxor(a, b), mask); }
static inline V16 vfrom_u8(const uint8_t* p) {
  V16 out;
  for (int l = 0; l < kLanes; ++l) out.v[l] = static_cast<float>(p[l]);
  return out;
}
static inline V16 vfrom_i8(const int8_t* p) {
  V16 out;
  for (int l = 0; l < kLanes; ++l) out.v[l] = static_cast<float>(p[l]);
  return out;
}
#endif

// The 5- or 6-bit quants of combination c from a block's vectors r[0..BITS) at `vectors` (Python's
// _wide_quant_vectors solves for their bits; its _WIDE_QUANT_READS lists the xors below). The 8 combinations take
// 19 (18) vector operations (AVX2, each on both halves), where nibbles and planes of the bits above them took 36:
// SmolLM2's Q5_0 matmuls (one row) were bound by those operations on AVX2 (docs/benchmarks.md).
template <int BITS>
static inline B64 join_wide(const uint8_t* vectors, int c) {
  constexpr uint8_t mask = (1 << BITS) - 1;
  const auto r = [vectors](int j) { return bload(vectors + j * 64); };
  if (c < BITS) return band(r(c), mask);
  if constexpr (BITS == 5) {
    if (c == 5) return bxor_and(bsrl16(r(0), 5), bsrl16(r(1), 2), mask);
    if (c == 6) return bxor_and(bsrl16(r(2), 5), bsrl16(r(3), 2), mask);
    return bxor_and(bxor(bsrl16(r(4), 5), bsrl16(r(3), 4)), bsrl16(r(1), 3), mask);
  }
  const int first = c == 6 ? 0 : 3;
  return bxor_and(bxor(bsrl16(r(first), 6), bsrl16(r(first + 1), 4)), bsrl16(r(first + 2), 2), mask);
}

// ---- the formats' shapes -----------------------------------------------------------------------------------------

static constexpr bool is_k_format(int32_t format) { return format == kQ4_K || format == kQ5_K || format == kQ6_K; }
static constexpr int quant_bits(int32_t format) {
  return format == kQ4_0 || format == kQ4_K ? 4 : format == kQ6_K ? 6 : 5;
}
static constexpr int32_t quant_offset(int32_t format) {
  return format == kQ4_0 ? 8 : format == kQ5_0 ? 16 : format == kQ6_K ? 32 : 0;
}
static constexpr int64_t kQuantBytes = 4 * 64;  // a block's first 4 vectors (the 4-bit formats' all)
static constexpr int64_t kquant_block_bytes(int32_t format) {
  const int64_t wide = (quant_bits(format) - 4) * 64;  // the 5- and 6-bit formats' further vectors
  if (is_k_format(format)) return kQuantBytes + wide + 2 * kLanes;  // sc and m, or Q6_K's sc_0 and sc_1
  return kQuantBytes + wide + (format == kQ5_1 ? 2 : 1) * kLanes * 2;
}
static constexpr int64_t kquant_head_bytes(int32_t format) {
  return format == kQ6_K ? kLanes * 2 : is_k_format(format) ? 2 * kLanes * 2 : 0;
}
static constexpr int64_t kquant_blocks_per_super(int32_t format) { return is_k_format(format) ? 8 : 1; }

static int64_t kquant_panel_bytes(int32_t format, int64_t K) {
  const int64_t per_super = kquant_blocks_per_super(format);
  return K / (kBlock * per_super) * (kquant_head_bytes(format) + per_super * kquant_block_bytes(format));
}

// Per row and 16-element half of each x block, the sum of its quants: [M][2 * nblocks].
static Buffer<int32_t> half_block_sums(const QuantizedRows& x, int64_t M, int threads) {
  const int64_t halves = 2 * x.nblocks;
  Buffer<int32_t> sums(M * halves);
  parallel_for(M, kRowsPerClaim, threads, [&](int64_t first, int64_t last) {
    for (int64_t i = first * halves; i < last * halves; ++i) {
      const int8_t* q = x.q.data() + i * (kBlock / 2);
      int32_t s = 0;
      for (int j = 0; j < kBlock / 2; ++j) s += q[j];
      sums[i] = s;
    }
  });
  return sums;
}

// ---- the tiles ---------------------------------------------------------------------------------------------------

// A one-row tile's cache hints (int8_blocks.h's, for these formats): its own panels' block kOneRowAhead blocks on,
// about 11 KB of a group ahead, asked for a quarter at a time among the quants' loads rather than all at the block's
// start.
// SmolLM2's gate_up (576 x 3072) in Q5_0 from memory on 2 threads, median of 600 (AMD EPYC, Q5_0 then in nibbles
// and a plane of fifth bits): spread 13.8 at 3 blocks as before, 13.0 at 4, 13.1 at 6 (5 slower in a step's 121
// matmuls); all at the block's start 14.9; hints per load, or a far one into L2, 17 µs.
// docs/benchmarks.md: in a decode step the L3 then keeps less of the lm_head, and the step is no faster.
template <int32_t F>
constexpr int64_t kOneRowAhead = std::max(kRowAhead, 11264 / (kGroupPanels * kquant_block_bytes(F)));

// The tile's four quarters of a block unrolled on builds without AVX-512: GCC kept the 5- and 6-bit formats'
// quarters a loop, their joins' shift counts in registers behind branches. AMD EPYC Zen 3 (AVX2), SmolLM2's Q5_0
// matmuls on 2 threads (in nibbles and a plane then), the two builds alternating in one process: one row 1.49-1.52x
// the rate, 4 to 512 rows 0.97-1.01x. The AVX-512 builds were not measured with it and keep their loop.
#if !defined(__AVX512F__)
#define KQUANT_UNROLL_QUARTERS _Pragma("GCC unroll 4")
#else
#define KQUANT_UNROLL_QUARTERS
#endif

// MR rows from `row` on, times NP panels of group g, every block; `next`: the next column group's panels.
template <int32_t F, int MR, int NP>
static void kquant_tile(const QuantizedRows& x, const int32_t* halves, int64_t row, const PanelGroup& g,
                        const PanelGroup& next, float* y, int64_t ldy, int cols) {
  constexpr int bits = quant_bits(F);
  constexpr int32_t offset = quant_offset(F);
  constexpr bool two_sums = F == kQ6_K;
  constexpr int64_t block_bytes = kquant_block_bytes(F), head_bytes = kquant_head_bytes(F);
  constexpr int64_t per_super = kquant_blocks_per_super(F);
  const int64_t K = x.K, nblocks = x.nblocks;
  V16 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vzero();
  for (int64_t b = 0; b < nblocks; ++b) {
    const uint8_t* head = group_head(g, b, head_bytes, block_bytes, per_super);
    const uint8_t* block = group_block(g, b, head_bytes, block_bytes, per_super);
    const uint8_t *panel_head[NP], *panel_block[NP];
    for (int p = 0; p < NP; ++p)
      panel_head[p] = tile_panel(g, head, p, head_bytes), panel_block[p] = tile_panel(g, block, p, block_bytes);
    const int8_t* xq = x.q.data() + row * K + b * kBlock;
    if constexpr (kHinted<MR>) {
      // several rows: the next group's block (int8_blocks.h); one row: its own block kOneRowAhead on, a quarter of
      // it per quarter of this block's quants below, and the heads here
      const PanelGroup& hinted = MR > 1 ? next : g;
      const int64_t ahead = MR > 1 ? b : b + kOneRowAhead<F>;
      if constexpr (MR > 1) prefetch_bytes<NP * block_bytes>(group_block(next, b, head_bytes, block_bytes, per_super));
      if constexpr (head_bytes > 0)
        if (ahead % per_super == 0)
          prefetch_bytes<NP * head_bytes>(group_head(hinted, ahead, head_bytes, block_bytes, per_super));
    }
    I16 s[MR][NP], t[MR][NP];
    for (int r = 0; r < MR; ++r)
      for (int p = 0; p < NP; ++p) s[r][p] = t[r][p] = izero();
    // each i adds 2 products to s (Q6_K: 1 to s and 1 to t); widened every `widen` of i
    constexpr int widen = kWordDots<bits> / (two_sums ? 1 : 2);
    static_assert(widen >= 1 && 4 % widen == 0, "whole widenings per block");
    W32 ws[MR][NP], wt[MR][NP];
    KQUANT_UNROLL_QUARTERS
    for (int i = 0; i < 4; ++i) {
      if (i % widen == 0)
        for (int r = 0; r < MR; ++r)
          for (int p = 0; p < NP; ++p) ws[r][p] = wstart(s[r][p]), wt[r][p] = wstart(t[r][p]);
      B64 lo[NP], hi[NP];
      if constexpr (kHinted<MR> && MR == 1) {
        constexpr int64_t bytes = NP * block_bytes, quarter = (bytes + 255) / 256 * 64;  // whole lines
        const uint8_t* ahead = group_block(g, b + kOneRowAhead<F>, head_bytes, block_bytes, per_super);
        for (int64_t at = i * quarter; at < std::min((i + 1) * quarter, bytes + 63); at += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + at), _MM_HINT_T0);
      }
      for (int p = 0; p < NP; ++p) {
        if constexpr (bits > 4) {
          lo[p] = join_wide<bits>(panel_block[p], 2 * i);
          hi[p] = join_wide<bits>(panel_block[p], 2 * i + 1);
        } else {
          const B64 packed = bload(panel_block[p] + i * 64);
          lo[p] = blow(packed);
          hi[p] = bhigh(packed);
        }
      }
      for (int r = 0; r < MR; ++r) {
        const B64 x_lo = bbroadcast4(xq + r * K + 4 * i), x_hi = bbroadcast4(xq + r * K + 16 + 4 * i);
        for (int p = 0; p < NP; ++p) {
          if constexpr (two_sums) {
            ws[r][p] = wdot(ws[r][p], lo[p], x_lo);
            wt[r][p] = wdot(wt[r][p], hi[p], x_hi);
            if constexpr (MR > 1) keep_in_registers(ws[r][p]), keep_in_registers(wt[r][p]);
          } else {
            ws[r][p] = wdot(wdot(ws[r][p], lo[p], x_lo), hi[p], x_hi);
            if constexpr (MR > 1) keep_in_registers(ws[r][p]);
          }
        }
      }
      if (i % widen == widen - 1)
        for (int r = 0; r < MR; ++r)
          for (int p = 0; p < NP; ++p) {
            s[r][p] = wend(s[r][p], ws[r][p]);
            if constexpr (two_sums) t[r][p] = wend(t[r][p], wt[r][p]);
          }
    }
    for (int p = 0; p < NP; ++p) {
      const uint8_t* scales = panel_block[p] + kQuantBytes + (bits - 4) * 64;
      const uint16_t* supers = reinterpret_cast<const uint16_t*>(panel_head[p]);
      const uint16_t* halves16 = reinterpret_cast<const uint16_t*>(scales);
      const int8_t* signed_scales = reinterpret_cast<const int8_t*>(scales);
      // the weights' scale (and minimum) vectors: for the k-quants, products exact in float
      const V16 d = F == kQ4_K || F == kQ5_K ? vmul(vfrom_f16(supers), vfrom_u8(scales))
                    : F == kQ6_K             ? vfrom_f16(supers)
                                             : vfrom_f16(halves16);
      const V16 m = F == kQ5_1                 ? vfrom_f16(halves16 + kLanes)
                    : F == kQ4_K || F == kQ5_K ? vmul(vfrom_f16(supers + kLanes), vfrom_u8(scales + kLanes))
                                               : vzero();
      for (int r = 0; r < MR; ++r) {
        const int64_t at = (row + r) * nblocks + b;
        const int32_t half0 = halves[2 * at], half1 = halves[2 * at + 1];
        const V16 d_dx = vmul(d, vset1(x.scale[at]));
        if constexpr (F == kQ4_0 || F == kQ5_0) {
          acc[r][p] = vfma(d_dx, vfrom_i32(isub_scalar(s[r][p], offset * (half0 + half1))), acc[r][p]);
        } else if constexpr (F == kQ5_1) {
          acc[r][p] = vfma(d_dx, vfrom_i32(s[r][p]), acc[r][p]);
          acc[r][p] = vfma(m, vset1(x.scaled_sum[at]), acc[r][p]);
        } else if constexpr (F == kQ4_K || F == kQ5_K) {
          acc[r][p] = vfma(d_dx, vfrom_i32(s[r][p]), acc[r][p]);
          acc[r][p] = vfma(m, vset1(-x.scaled_sum[at]), acc[r][p]);
        } else {
          const V16 c = vfma(vfrom_i8(signed_scales), vfrom_i32(isub_scalar(s[r][p], offset * half0)),
                             vmul(vfrom_i8(signed_scales + kLanes), vfrom_i32(isub_scalar(t[r][p], offset * half1))));
          acc[r][p] = vfma(d_dx, c, acc[r][p]);
        }
      }
    }
  }
  store_tile<MR, NP>(acc, y, ldy, cols, tile_columns(g));
}

// A tile of 1..MR rows and 1..NP panels, each with the code compiled for exactly that many.
template <int32_t F, int MR, int NP>
static void kquant_rows(int rows, int panels_here, const QuantizedRows& x, const int32_t* halves, int64_t row,
                        const PanelGroup& g, const PanelGroup& next, float* y, int64_t ldy, int cols) {
  if constexpr (MR > 1) {
    if (rows < MR) return kquant_rows<F, MR - 1, NP>(rows, panels_here, x, halves, row, g, next, y, ldy, cols);
  }
  if constexpr (NP > 1) {
    if (panels_here < NP) return kquant_rows<F, MR, NP - 1>(rows, panels_here, x, halves, row, g, next, y, ldy, cols);
  }
  kquant_tile<F, MR, NP>(x, halves, row, g, next, y, ldy, cols);
}

template <int32_t F, int MR, int NP>
static void kquant_groups(const QuantizedRows& x, const int32_t* halves, int64_t M, const uint8_t* packed, int64_t N,
                          float* y, int64_t ldy, int threads) {
  static_assert(kGroupPanels % NP == 0, "a tile's panels lie in one group");
  const int64_t pbytes = kquant_panel_bytes(F, x.K), num_panels = (N + kLanes - 1) / kLanes;
  for_each_tile<MR, NP>(M, N, pbytes, kInt8RowBlock, threads,
                        [&](int rows, int panels_here, int64_t m, int64_t panel, int64_t column, int cols) {
                          kquant_rows<F, MR, NP>(rows, panels_here, x, halves, m,
                                                 panel_group(packed, pbytes, num_panels, panel),
                                                 panel_group(packed, pbytes, num_panels, panel + NP),
                                                 y + m * ldy + column, ldy, cols);
                        });
}

// int8_matmul's tile shapes (with_block_tile).
template <int32_t F>
static void kquant_shapes(const QuantizedRows& x, const int32_t* halves, int64_t M, const uint8_t* packed, int64_t N,
                          float* y, int64_t ldy, int threads) {
  if constexpr (kGroupPanels == 1)
    if (M == 1)
      return spread_tiles(packed, kquant_panel_bytes(F, x.K), N, y, threads,
                          [&](int here, const PanelGroup& g, float* at, int cols) {
                            kquant_rows<F, 1, kSpreadPanels>(1, here, x, halves, 0, g, g, at, ldy, cols);
                          });
  with_block_tile(M, N, threads, [&](auto mr, auto np) {
    kquant_groups<F, decltype(mr)::value, decltype(np)::value>(x, halves, M, packed, N, y, ldy, threads);
  });
}

static constexpr bool is_kquant_format(int32_t format) { return format >= kQ4_0 && format <= kQ6_K; }
// Every block format (Q8_0, Q4_1 and the ones above): integer dot products with rows quantised per 32-block.
static constexpr bool is_block_format(int32_t format) {
  return format == kQ8_0 || format == kQ4_1 || is_kquant_format(format);
}

// f(Int<F>()) for F the format above that `format` names.
template <class Fn>
static void with_kquant_format(int32_t format, const Fn& f) {
  switch (format) {
    case kQ4_0:
      return f(Int<kQ4_0>());
    case kQ5_0:
      return f(Int<kQ5_0>());
    case kQ5_1:
      return f(Int<kQ5_1>());
    case kQ4_K:
      return f(Int<kQ4_K>());
    case kQ5_K:
      return f(Int<kQ5_K>());
    default:
      return f(Int<kQ6_K>());
  }
}

// y[M, N] = x[M, K] @ W.T for the formats above: x quantised as for Q8_0, then the tiles.
static void kquant_matmul(int32_t format, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed,
                          int64_t N, float* y, int64_t ldy, int threads) {
  QuantizedRows quantized;
  quantize_rows(x, M, K, ldx, threads, &quantized);
  const Buffer<int32_t> halves = half_block_sums(quantized, M, threads);
  with_kquant_format(format, [&](auto f) {
    kquant_shapes<decltype(f)::value>(quantized, halves.data(), M, packed, N, y, ldy, threads);
  });
}

}  // namespace
