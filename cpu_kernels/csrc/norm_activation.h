// The row-wise kernels: RMSNorm, the gated MLP activations (SiLU, GELU-tanh) and soft-capping.

#pragma once

#include <math.h>
#include <stdint.h>

#include "simd.h"
#include "thread_pool.h"

namespace {

// Values of a row-wise step from which it splits over threads (rows_per_claim): ~1.5 µs of one thread's work, AMD
// EPYC (a norm ~0.06 ns a value over rows side by side; SiLU's exp and division ~0.17).
constexpr int64_t kNormSplitAt = 24576, kGatedSplitAt = 8192;

// R rows of rms_norm: their sums of squares side by side, each row's own chain (one row's chain of N / 16 fmas waits
// on the fma latency; R rows' hide it: 8 rows of 576 in ~0.5 µs instead of ~0.95, AMD EPYC).
template <int R>
static inline void rms_norm_rows(const float* x, int64_t N, int64_t ldx, const float* weight, float eps, float* out,
                                 int64_t ldo) {
  const int64_t full = N - N % kLanes;  // whole chunks, then the tail through vload_at
  V16 partial[R];
  for (int r = 0; r < R; ++r) partial[r] = vzero();
  for (int64_t n = 0; n < full; n += kLanes)
    for (int r = 0; r < R; ++r) {
      const V16 v = vload(x + r * ldx + n);
      partial[r] = vfma(v, v, partial[r]);
    }
  if (full < N)
    for (int r = 0; r < R; ++r) {
      const V16 v = vload_at(x + r * ldx, full, N);
      partial[r] = vfma(v, v, partial[r]);
    }
  for (int r = 0; r < R; ++r) {
    const float inverse = 1.0f / sqrtf(tree_sum(partial[r]) / static_cast<float>(N) + eps);
    const V16 scale = vset1(inverse);
    const float* row = x + r * ldx;
    float* normed = out + r * ldo;
    for (int64_t n = 0; n < full; n += kLanes) vstore(normed + n, vmul(vmul(vload(row + n), scale), vload(weight + n)));
    if (full < N) vstore_at(normed, full, N, vmul(vmul(vload_at(row, full, N), scale), vload_at(weight, full, N)));
  }
}

// out[T, N] = x * rsqrt(mean(x^2) + eps) * weight, as transformers' LlamaRMSNorm orders it.
// The sum of squares: 16 partial sums (lane n mod 16) then the fixed tree. In place (out == x) too.
static void rms_norm(const float* x, int64_t T, int64_t N, int64_t ldx, const float* weight, float eps, float* out,
                     int64_t ldo, int32_t threads) {
  parallel_for(T, rows_per_claim(T, N, kNormSplitAt, threads), threads, [&](int64_t first, int64_t last) {
    int64_t t = first;
    for (; t + 4 <= last; t += 4) rms_norm_rows<4>(x + t * ldx, N, ldx, weight, eps, out + t * ldo, ldo);
    for (; t < last; ++t) rms_norm_rows<1>(x + t * ldx, N, ldx, weight, eps, out + t * ldo, ldo);
  });
}

// out[T, N] = gate / (1 + exp(exponent(gate))) * up, with gate = x[:, :N] and up = x[:, N:2N]: the gated MLPs'
// one form (SiLU's exponent is -gate, GELU-tanh's -2u).
template <class Exponent>
static void gated_mul(const float* x, int64_t T, int64_t N, float* out, int32_t threads, const Exponent& exponent) {
  parallel_for(T, rows_per_claim(T, N, kGatedSplitAt, threads), threads, [&](int64_t first, int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    const float* gate = x + t * 2 * N;
    const float* up = gate + N;
    for (int64_t n = 0; n < N; n += kLanes) {
      V16 g = vload_at(gate, n, N);
      V16 e = vexp(exponent(g));
      vstore_at(out + t * N, n, N, vmul(vdiv(g, vadd(vset1(1.0f), e)), vload_at(up, n, N)));
    }
  }
  });
}

// out[T, N] = silu(gate) * up = gate / (1 + exp(-gate)) * up, with gate = x[:, :N] and up = x[:, N:2N].
static void silu_mul(const float* x, int64_t T, int64_t N, float* out, int32_t threads) {
  gated_mul(x, T, N, out, threads, [](V16 g) { return vsub(vzero(), g); });
}

// out[T, N] = gelu_tanh(gate) * up, with gate = x[:, :N] and up = x[:, N:2N] (Gemma's MLP). gelu_tanh(g) =
// g / 2 * (1 + tanh(u)) with u = sqrt(2 / pi) * (g + 0.044715 g^3) is g / (1 + exp(-2u)): SiLU's form, u's
// products rounded one by one, then one exp, one division.
static void gelu_tanh_mul(const float* x, int64_t T, int64_t N, float* out, int32_t threads) {
  gated_mul(x, T, N, out, threads, [](V16 g) {
    V16 inner = vadd(g, vmul(vset1(0.044715f), vmul(vmul(g, g), g)));
    return vmul(vset1(-1.5957691216057308f), inner);  // -2 sqrt(2 / pi)
  });
}

// x[T, N] = cap * tanh(x / cap) in place, rows ldx apart (Gemma's soft-capping of logits); tanh(y) as
// 2 / (1 + exp(-2y)) - 1, whose exp saturates to give +-1 for large |y|.
static void softcap(float* x, int64_t T, int64_t N, int64_t ldx, float cap, int32_t threads) {
  parallel_for(T, kRowsPerClaim, threads, [&](int64_t first, int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    float* row = x + t * ldx;
    for (int64_t n = 0; n < N; n += kLanes) {
      V16 y = vdiv(vload_at(row, n, N), vset1(cap));
      V16 e = vexp(vmul(vset1(-2.0f), y));
      V16 tanh = vsub(vdiv(vset1(2.0f), vadd(vset1(1.0f), e)), vset1(1.0f));
      vstore_at(row, n, N, vmul(tanh, vset1(cap)));
    }
  }
  });
}

}  // namespace
