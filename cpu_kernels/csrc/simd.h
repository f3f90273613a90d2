// The SIMD layer: a 16-lane float vector (one zmm, two ymm, or an array in the scalar build) and the few operations
// on it the kernels use, each the same IEEE operation in every lane of every build; the fixed reduction trees and the
// exp polynomial built on them.

#pragma once

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int kLanes = 16;  // one "vector" is 16 float32 lanes on every ISA

// ---- a 16-lane float vector: one zmm, two ymm, or an array -------------------------------------------------

#if defined(__AVX512F__)
struct V16 {
  __m512 r;
};
static inline V16 vzero() { return {_mm512_setzero_ps()}; }
static inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
static inline V16 vset1(float x) { return {_mm512_set1_ps(x)}; }
static inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.r); }
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.r, b.r, c.r)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.r, b.r)}; }
static inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.r, b.r)}; }
static inline V16 vsub(V16 a, V16 b) { return {_mm512_sub_ps(a.r, b.r)}; }
static inline V16 vdiv(V16 a, V16 b) { return {_mm512_div_ps(a.r, b.r)}; }
static inline V16 vmax(V16 a, V16 b) { return {_mm512_max_ps(a.r, b.r)}; }
static inline V16 vmin(V16 a, V16 b) { return {_mm512_min_ps(a.r, b.r)}; }
static inline V16 vround(V16 a) { return {_mm512_roundscale_ps(a.r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// 2^n for integral float n in the normal range
static inline V16 vexp2i(V16 n) {
  __m512i i = _mm512_cvtps_epi32(n.r);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(127)), 23))};
}
static inline V16 vfrom_f16(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
static inline V16 vfrom_bf16(const uint16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct V16 {
  __m256 lo, hi;
};
static inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
static inline void vstore(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
static inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
static inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline V16 vsub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
static inline V16 vdiv(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
static inline V16 vmax(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
static inline V16 vmin(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
static inline V16 vround(V16 a) {
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, mode), _mm256_round_ps(a.hi, mode)};
}
static inline __m256 exp2i8(__m256 n) {
  __m256i i = _mm256_cvtps_epi32(n);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(127)), 23));
}
static inline V16 vexp2i(V16 n) { return {exp2i8(n.lo), exp2i8(n.hi)}; }
static inline V16 vfrom_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
static inline V16 vfrom_bf16(const uint16_t* p) {
  __m256i w0 = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256i w1 = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16))};
}
#else
// The scalar path: the same operations lane by lane (fmaf is a fused multiply-add wherever it is available).
struct V16 {
  float v[kLanes];
};
#define LANEWISE(expr)                             \
  V16 out;                                         \
  for (int l = 0; l < kLanes; ++l) out.v[l] = (expr); \
  return out
static inline V16 vzero() { LANEWISE(0.0f); }
static inline V16 vload(const float* p) { LANEWISE(p[l]); }
static inline V16 vset1(float x) { LANEWISE(x); }
static inline void vstore(float* p, V16 a) { memcpy(p, a.v, sizeof a.v); }
static inline V16 vfma(V16 a, V16 b, V16 c) { LANEWISE(fmaf(a.v[l], b.v[l], c.v[l])); }
static inline V16 vmul(V16 a, V16 b) { LANEWISE(a.v[l] * b.v[l]); }
static inline V16 vadd(V16 a, V16 b) { LANEWISE(a.v[l] + b.v[l]); }
static inline V16 vsub(V16 a, V16 b) { LANEWISE(a.v[l] - b.v[l]); }
static inline V16 vdiv(V16 a, V16 b) { LANEWISE(a.v[l] / b.v[l]); }
static inline V16 vmax(V16 a, V16 b) { LANEWISE(a.v[l] > b.v[l] ? a.v[l] : b.v[l]); }
static inline V16 vmin(V16 a, V16 b) { LANEWISE(a.v[l] < b.v[l] ? a.v[l] : b.v[l]); }
static inline V16 vround(V16 a) { LANEWISE(nearbyintf(a.v[l])); }
static inline float exp2i1(float n) {
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
static inline V16 vexp2i(V16 n) { LANEWISE(exp2i1(n.v[l])); }
static inline float half_to_float(uint16_t h) {
  uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int shift = 0;
    while (!(mantissa & 0x400)) {
      mantissa <<= 1;
      ++shift;
    }
    bits = sign | ((113 - shift) << 23) | ((mantissa & 0x3ff) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
static inline V16 vfrom_f16(const uint16_t* p) { LANEWISE(half_to_float(p[l])); }
static inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}
static inline V16 vfrom_bf16(const uint16_t* p) { LANEWISE(bf16_to_float(p[l])); }
#undef LANEWISE
#endif

// The first n <= 16 floats of p, `fill` after: a tail goes through the same vector code as the full chunks.
static inline V16 vload_head_fill(const float* p, int64_t n, float fill) {
  if (n == kLanes) return vload(p);
  alignas(64) float padded[kLanes];
  for (int l = 0; l < kLanes; ++l) padded[l] = l < n ? p[l] : fill;
  return vload(padded);
}

static inline V16 vload_head(const float* p, int64_t n) { return vload_head_fill(p, n, 0.0f); }

static inline void vstore_head(float* p, V16 a, int64_t n) {
  alignas(64) float padded[kLanes];
  vstore(padded, a);
  memcpy(p, padded, n * sizeof(float));
}

// a chunk of 16 floats at p + i, or the tail of a row of n
static inline V16 vload_at(const float* p, int64_t i, int64_t n) {
  return i + kLanes <= n ? vload(p + i) : vload_head(p + i, n - i);
}

static inline void vstore_at(float* p, int64_t i, int64_t n, V16 a) {
  if (i + kLanes <= n)
    vstore(p + i, a);
  else
    vstore_head(p + i, a, n - i);
}

// The fixed trees over 16 lanes, pairwise by halves: lane l with lane l + width, width 8, 4, 2, 1, the lower lane the
// first operand (tree_sum: ((0+8) + (4+12)) + ((2+10) + (6+14)) and so on). The SIMD builds pair the halves of their
// registers, the scalar build the elements of an array: the same operations on the same operands.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
static inline __m256 halves_of(V16 a, bool high) {
#if defined(__AVX512F__)
  return high ? _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.r), 1)) : _mm512_castps512_ps256(a.r);
#else
  return high ? a.hi : a.lo;
#endif
}
// `op` (an _mm_ operation of 4 lanes) over the tree: 16 lanes to 8 (two 4-lane halves each side), 4, 2 and 1.
template <class Op>
static inline float tree_reduce(V16 a, const Op& op) {
  const __m256 lo = halves_of(a, false), hi = halves_of(a, true);
  const __m128 w8_lo = op(_mm256_castps256_ps128(lo), _mm256_castps256_ps128(hi));
  const __m128 w8_hi = op(_mm256_extractf128_ps(lo, 1), _mm256_extractf128_ps(hi, 1));
  const __m128 w4 = op(w8_lo, w8_hi);
  const __m128 w2 = op(w4, _mm_movehl_ps(w4, w4));
  return _mm_cvtss_f32(op(w2, _mm_shuffle_ps(w2, w2, 1)));
}
static inline float tree_sum(V16 a) {
  return tree_reduce(a, [](__m128 x, __m128 y) { return _mm_add_ps(x, y); });
}
#else
static inline float tree_sum(V16 a) {
  alignas(64) float s[kLanes];
  vstore(s, a);
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) s[l] = s[l] + s[l + width];
  return s[0];
}
#endif

// tree_sum (op: addition) or tree_max (op: maximum) of 16 vectors at once: lane i of the result is that tree over
// a[i], the same pairings with the same operand order. AVX-512: a network of shuffles, 30 shuffles and 15 operations
// instead of 16 stores and 240 scalar ones.
#if defined(__AVX512F__)
template <class Op>
static inline V16 tree_reduce16(const V16* a, const Op& op) {
  __m512 z[8], w[4], v[2];
  for (int m = 0; m < 8; ++m)  // width 8: lanes 0-7 hold a[2m]'s, lanes 8-15 a[2m+1]'s
    z[m] = op(_mm512_shuffle_f32x4(a[2 * m].r, a[2 * m + 1].r, 0x44),
              _mm512_shuffle_f32x4(a[2 * m].r, a[2 * m + 1].r, 0xEE));
  for (int n = 0; n < 4; ++n)  // width 4: 128-bit block k holds a[4n + k]'s
    w[n] = op(_mm512_shuffle_f32x4(z[2 * n], z[2 * n + 1], 0x88), _mm512_shuffle_f32x4(z[2 * n], z[2 * n + 1], 0xDD));
  for (int n = 0; n < 2; ++n)  // width 2: block k holds a[8n + k] in lanes 0-1, a[8n + 4 + k] in lanes 2-3
    v[n] = op(_mm512_shuffle_ps(w[2 * n], w[2 * n + 1], 0x44), _mm512_shuffle_ps(w[2 * n], w[2 * n + 1], 0xEE));
  // width 1: block k holds a[k], a[4 + k], a[8 + k], a[12 + k]
  __m512 r = op(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(order, r)};
}
static inline V16 tree_sum16(const V16* a) {
  return tree_reduce16(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}
static inline V16 tree_max16(const V16* a) {
  return tree_reduce16(a, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); });
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2: the same network on ymm pairs, 30 shuffles and 30 operations instead of 16 trees of extracts and 4-lane
// operations, each stored (a decode step's attention adds 16 keys' partial sums at a time).
template <class Op>
static inline V16 tree_reduce16(const V16* a, const Op& op) {
  __m256 z[16], u[8], v[4], r[2];
  for (int i = 0; i < 16; ++i) z[i] = op(a[i].lo, a[i].hi);  // width 8: lane m of z[i] pairs a[i]'s m and m + 8
  for (int k = 0; k < 8; ++k)  // width 4: the low 128 bits hold z[2k]'s, the high z[2k+1]'s
    u[k] = op(_mm256_permute2f128_ps(z[2 * k], z[2 * k + 1], 0x20),
              _mm256_permute2f128_ps(z[2 * k], z[2 * k + 1], 0x31));
  for (int m = 0; m < 4; ++m)  // width 2: the low half holds a[4m]'s and a[4m+2]'s, the high a[4m+1]'s and a[4m+3]'s
    v[m] = op(_mm256_shuffle_ps(u[2 * m], u[2 * m + 1], 0x44), _mm256_shuffle_ps(u[2 * m], u[2 * m + 1], 0xEE));
  for (int n = 0; n < 2; ++n)  // width 1: the low half holds a[8n + 2i]'s, the high a[8n + 2i + 1]'s
    r[n] = op(_mm256_shuffle_ps(v[2 * n], v[2 * n + 1], 0x88), _mm256_shuffle_ps(v[2 * n], v[2 * n + 1], 0xDD));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return {_mm256_permutevar8x32_ps(r[0], order), _mm256_permutevar8x32_ps(r[1], order)};
}
static inline V16 tree_sum16(const V16* a) {
  return tree_reduce16(a, [](__m256 x, __m256 y) { return _mm256_add_ps(x, y); });
}
static inline V16 tree_max16(const V16* a) {
  return tree_reduce16(a, [](__m256 x, __m256 y) { return _mm256_max_ps(x, y); });
}
#endif

// tree_sum's tree with a > b ? a : b (maxps: the second operand where they are equal or either is NaN).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
static inline float tree_max(V16 a) {
  return tree_reduce(a, [](__m128 x, __m128 y) { return _mm_max_ps(x, y); });
}
#else
static inline float tree_max(V16 a) {
  alignas(64) float s[kLanes];
  vstore(s, a);
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) s[l] = s[l] > s[l + width] ? s[l] : s[l + width];
  return s[0];
}
#endif

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
static inline V16 tree_sum16(const V16* a) {
  alignas(64) float sums[kLanes];
  for (int i = 0; i < kLanes; ++i) sums[i] = tree_sum(a[i]);
  return vload(sums);
}
static inline V16 tree_max16(const V16* a) {
  alignas(64) float peaks[kLanes];
  for (int i = 0; i < kLanes; ++i) peaks[i] = tree_max(a[i]);
  return vload(peaks);
}
#endif

// exp(x) for x <= 0 (softmax) and any x (SiLU): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2, p a degree-6
// polynomial by Horner's rule with fma; below -87 it underflows to 0, above 88 it saturates (never met: callers
// pass x <= 0 or exp(-x) of a SiLU input, whose overflow only sends silu to 0 as it should).
static inline V16 vexp(V16 x) {
  x = vmax(vmin(x, vset1(88.0f)), vset1(-87.0f));
  V16 n = vround(vmul(x, vset1(1.44269504088896341f)));
  V16 r = vfma(n, vset1(-0.693359375f), x);  // ln2 split in two: the first part's product is exact
  r = vfma(n, vset1(2.12194440e-4f), r);
  V16 p = vset1(1.0f / 720);
  p = vfma(p, r, vset1(1.0f / 120));
  p = vfma(p, r, vset1(1.0f / 24));
  p = vfma(p, r, vset1(1.0f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
  return vmul(p, vexp2i(n));
}

}  // namespace
