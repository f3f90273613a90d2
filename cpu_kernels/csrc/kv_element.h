// The KV pool's element types: float32 (K and V as computed), bfloat16 and float16 (half the bytes: half a decode
// step's attention reads, which stream from memory, and half the pool's memory).
//
// A 16-bit pool rounds K and V once, when a token's row is written: to nearest, ties to even, in integer arithmetic
// on each value (float16 by vcvtps2ph where the build has F16C: the same bits), so every build stores the same bits
// (and the same as torch's .to(torch.bfloat16 / torch.float16)).
// Every read converts exactly to float32, so attention computes with the same float32 values whichever path reads
// them (a token alone, a run of tokens) and its arithmetic (attention.h) is unchanged.

#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

namespace {

enum KvDtype : int32_t { kKvFloat32 = 0, kKvBfloat16 = 1, kKvFloat16 = 2 };

static inline uint32_t float_bits(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof bits);
  return bits;
}

static inline uint16_t float_to_bf16(float x) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN stays NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline uint16_t float_to_half(float x) {
  const uint32_t bits = float_bits(x), sign = (bits >> 16) & 0x8000u, magnitude = bits & 0x7fffffffu;
  uint32_t half;
  if (magnitude > 0x7f800000u) {
    half = 0x7e00u | ((magnitude >> 13) & 0x3ffu);  // NaN stays NaN
  } else if (magnitude >= 0x477ff000u) {
    half = 0x7c00u;  // 65520 and above round to infinity
  } else if (magnitude >= 0x38800000u) {  // a normal half: rebias the exponent, round 23 mantissa bits to 10
    const uint32_t rebiased = magnitude - 0x38000000u;
    half = (rebiased + 0xfffu + ((rebiased >> 13) & 1u)) >> 13;
  } else if (magnitude >= 0x33000000u) {  // a subnormal half, units of 2^-24 (2^-14 rounds up to the smallest normal)
    const uint32_t significand = (magnitude & 0x7fffffu) | 0x800000u, shift = 126u - (magnitude >> 23);
    half = (significand + (1u << (shift - 1)) - 1u + ((significand >> shift) & 1u)) >> shift;
  } else {
    half = 0;  // at most 2^-25: ties to even at zero
  }
  return static_cast<uint16_t>(sign | half);
}

struct KvFloat32 {
  using T = float;
  static V16 load(const T* p) { return vload(p); }
  static void store(T* dst, const float* src, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
};

// float_to_bf16's integer steps on 8 values at once where the build has AVX2.
struct KvBfloat16 {
  using T = uint16_t;
  static V16 load(const T* p) { return vfrom_bf16(p); }
  static void store(T* dst, const float* src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__)
    const __m256i one = _mm256_set1_epi32(1), half_ulp = _mm256_set1_epi32(0x7fff);
    for (; i + 8 <= n; i += 8) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m256i high = _mm256_srli_epi32(bits, 16);
      const __m256i rounded =
          _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half_ulp, _mm256_and_si256(high, one))), 16);
      const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                                _mm256_set1_epi32(0x7f800000));
      const __m256i out = _mm256_blendv_epi8(rounded, _mm256_or_si256(high, _mm256_set1_epi32(0x40)), is_nan);
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(out, out), 0xD8);  // 8 uint16 in order
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
    }
#endif
    for (; i < n; ++i) dst[i] = float_to_bf16(src[i]);
  }
};

// Builds with F16C convert 8 values an instruction: vcvtps2ph rounds to nearest, ties to even, and gives
// float_to_half's bits for every one of the 2^32 float32 inputs (checked exhaustively on AMD EPYC, with and without
// FTZ/DAZ); the integer routine took a token's K and V ~0.35 µs, a k = 8 extend's ~2.8 µs a layer.
struct KvFloat16 {
  using T = uint16_t;
  static V16 load(const T* p) { return vfrom_f16(p); }
  static void store(T* dst, const float* src, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; ++i) dst[i] = float_to_half(src[i]);
  }
};

// f(KvFloat32()), f(KvBfloat16()) or f(KvFloat16()) for a KvDtype; false for an unknown one.
template <class F>
static bool with_kv_element(int32_t dtype, F&& f) {
  switch (dtype) {
    case kKvFloat32: f(KvFloat32()); return true;
    case kKvBfloat16: f(KvBfloat16()); return true;
    case kKvFloat16: f(KvFloat16()); return true;
    default: return false;
  }
}

}  // namespace
