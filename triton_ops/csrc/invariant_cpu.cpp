// Batch-invariant CPU kernels for the model forward: matmuls over packed weights (float32, bfloat16, float16, and the
// GGUF block formats Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the k-quants Q4_K, Q5_K, Q6_K), attention over a token KV pool, RMSNorm and SiLU-and-multiply; and the
// grammar's token mask applied to the logits; and the sampler's Exp(1) draws.
//
// Invariance by construction: every output element is computed by one fixed sequence of IEEE operations that
// depends only on that element's own inputs and the tensor shapes that do not vary with the batch (K, head_dim,
// hidden size), never on the number of rows, the other rows, the tiling or the thread count:
// - a matmul output y[m][n] is one chain of fused multiply-adds over k = 0, 1, ..., K - 1; for the block formats,
//   an exact integer sum per 32-block of x quantised to int8, then one fixed float sequence per block
//   (int8_blocks.h). SIMD lanes hold different columns n, never parts of one float sum, so an AVX-512 lane, an AVX2
//   lane and the scalar fallback run the same chain and give the same bits;
// - reductions along a row (a dot product of q and k, a sum of squares) accumulate into 16 partial sums, lane l
//   taking the indices equal to l modulo 16, which are then added in one fixed tree;
// - exp is one polynomial evaluated with the same fma sequence in every lane and in the scalar tail;
// - threads split independent output elements (columns, rows, tokens and heads), never one element's sum.
//
// Threads: a pool of its own (not OpenMP), whose caller takes work too and never waits for a worker that has not
// claimed any. A fork-join team waits at every region's end for all its threads, so on a busy machine (a grammar
// compile beside the decode, other processes) one descheduled thread stalled each of a forward's ~150 regions
// for a time slice: measured 2.7 s a decode step instead of 29 ms.
// So batching, the row-padding a library may or may not do, speculative verification (k rows at once) and the
// thread count can never change a token's logits, on any x86-64 CPU with AVX2 or AVX-512, and elsewhere through
// the scalar path.

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int kLanes = 16;  // one "vector" is 16 float32 lanes on every ISA
constexpr int kBlock = 32;  // the GGUF block formats' group of k values sharing a scale

// std::vector's allocator, except that a new element of a trivial type is left uninitialised: the kernels' scratch
// buffers (a layer's activations, a matmul's quantised rows) are written in full before they are read, and zeroing
// them first cost a long prefill ~1.4 GB of stores.
template <class T>
struct UninitializedAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  UninitializedAllocator() = default;
  template <class U>
  UninitializedAllocator(const UninitializedAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible<U>::value) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T>
using Buffer = std::vector<T, UninitializedAllocator<T>>;

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

// The fixed tree that adds 16 partial sums: ((0+8) + (4+12)) + ((2+10) + (6+14)) and so on, pairwise by halves.
static inline float tree_sum(V16 a) {
  alignas(64) float s[kLanes];
  vstore(s, a);
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) s[l] = s[l] + s[l + width];
  return s[0];
}

// tree_sum of 16 vectors at once: lane i of the result is tree_sum(a[i]), the same pairings in the same order
// (IEEE addition is commutative, so only the pairing matters). AVX-512: a network of shuffles, 30 shuffles and
// 15 additions instead of 16 stores and 240 scalar additions.
static inline V16 tree_sum16(const V16* a) {
#if defined(__AVX512F__)
  __m512 z[8], w[4], v[2];
  for (int m = 0; m < 8; ++m)  // width 8: lanes 0-7 hold a[2m]'s sums, lanes 8-15 a[2m+1]'s
    z[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m].r, a[2 * m + 1].r, 0x44),
                         _mm512_shuffle_f32x4(a[2 * m].r, a[2 * m + 1].r, 0xEE));
  for (int n = 0; n < 4; ++n)  // width 4: 128-bit block k holds a[4n + k]'s
    w[n] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * n], z[2 * n + 1], 0x88),
                         _mm512_shuffle_f32x4(z[2 * n], z[2 * n + 1], 0xDD));
  for (int n = 0; n < 2; ++n)  // width 2: block k holds a[8n + k] in lanes 0-1, a[8n + 4 + k] in lanes 2-3
    v[n] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * n], w[2 * n + 1], 0x44),
                         _mm512_shuffle_ps(w[2 * n], w[2 * n + 1], 0xEE));
  // width 1: block k holds a[k], a[4 + k], a[8 + k], a[12 + k]
  __m512 r = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return {_mm512_permutexvar_ps(order, r)};
#else
  alignas(64) float sums[kLanes];
  for (int i = 0; i < kLanes; ++i) sums[i] = tree_sum(a[i]);
  return vload(sums);
#endif
}

static inline float tree_max(V16 a) {
  alignas(64) float s[kLanes];
  vstore(s, a);
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) s[l] = s[l] > s[l + width] ? s[l] : s[l + width];
  return s[0];
}

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

// ---- the thread pool --------------------------------------------------------------------------------------------
//
// One job at a time: a forward's regions come one after another, and a caller on another thread (ctypes releases
// the GIL: a mask applied beside a forward) waits for the running job. A job is `total` items
// claimed `grain` at a time through `state_` = generation << 32 | next item, by compare-and-swap, so a claim made
// for an old generation fails; the caller claims too and then waits only for claimed items to finish. Workers spin
// a little after a job (the next region of the forward comes within microseconds), then sleep.

class Pool {
 public:
  using Fn = void (*)(const void*, int64_t, int64_t);

  static Pool& instance() {
    static Pool* pool = nullptr;
    static pid_t owner = 0;
    if (pool == nullptr || owner != getpid()) {  // a forked child has none of its parent's threads
      pool = new Pool();                          // never freed: workers may outlive static destruction
      owner = getpid();
    }
    return *pool;
  }

  void run(int64_t total, int64_t grain, int threads, Fn fn, const void* ctx) {
    if (threads <= 1 || total <= grain) {
      fn(ctx, 0, total);
      return;
    }
    std::lock_guard<std::mutex> one_job(run_mutex_);  // callers on other threads wait their turn
    grow(threads - 1);
    const uint64_t gen = ++generation_;
    Job& job = jobs_[gen & 1];
    job.fn.store(fn, std::memory_order_relaxed);
    job.ctx.store(ctx, std::memory_order_relaxed);
    job.total.store(total, std::memory_order_relaxed);
    job.grain.store(grain, std::memory_order_relaxed);
    job.helpers.store(threads - 1, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    state_.store(gen << 32, std::memory_order_release);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_all();
    }
    claim_and_run(gen, job);
    for (int spins = 0; done_.load(std::memory_order_acquire) < total; ++spins)
      if (spins > 4096) std::this_thread::yield();
  }

 private:
  struct Job {
    std::atomic<Fn> fn{nullptr};
    std::atomic<const void*> ctx{nullptr};
    std::atomic<int64_t> total{0}, grain{1};
    std::atomic<int> helpers{0};
  };

  void grow(int workers) {
    while (static_cast<int>(workers_) < workers) {
      const int id = workers_++;
      std::thread([this, id] { work(id); }).detach();
    }
  }

  void claim_and_run(uint64_t gen, Job& job) {
    for (;;) {
      uint64_t state = state_.load(std::memory_order_acquire);
      if (state >> 32 != (gen & 0xffffffffu)) return;
      const int64_t first = static_cast<int64_t>(state & 0xffffffffu);
      const int64_t total = job.total.load(std::memory_order_relaxed);
      if (first >= total) return;
      const int64_t last = std::min(total, first + job.grain.load(std::memory_order_relaxed));
      if (!state_.compare_exchange_weak(state, (state & ~0xffffffffull) | static_cast<uint64_t>(last),
                                        std::memory_order_acq_rel))
        continue;
      job.fn.load(std::memory_order_relaxed)(job.ctx.load(std::memory_order_relaxed), first, last);
      done_.fetch_add(last - first, std::memory_order_release);
    }
  }

  void work(int id) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t gen = state_.load(std::memory_order_acquire) >> 32;
      const auto started = std::chrono::steady_clock::now();
      for (int spins = 0; gen == seen; ++spins) {
        if ((spins & 255) == 255 && std::chrono::steady_clock::now() - started > std::chrono::microseconds(300)) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [&] { return (state_.load(std::memory_order_acquire) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        }
        gen = state_.load(std::memory_order_acquire) >> 32;
      }
      seen = gen;
      Job& job = jobs_[gen & 1];
      if (id < job.helpers.load(std::memory_order_relaxed)) claim_and_run(gen, job);
    }
  }

  std::atomic<uint64_t> state_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int> workers_{0};
  uint64_t generation_ = 0;
  Job jobs_[2];
  std::mutex mutex_, run_mutex_;
  std::condition_variable wake_;
};

constexpr int64_t kRowsPerClaim = 32;  // rows of a norm or an activation: below this, one thread does them all

// f(first, last) over items [0, total) on up to `threads` threads, `grain` items per claim.
template <class F>
static void parallel_for(int64_t total, int64_t grain, int threads, const F& f) {
  Pool::instance().run(
      total, std::max<int64_t>(1, grain), threads,
      [](const void* ctx, int64_t first, int64_t last) { (*static_cast<const F*>(ctx))(first, last); }, &f);
}

// ---- matmuls over packed weights -------------------------------------------------------------------------------
//
// Weights [N, K] are packed in panels of 16 columns: panel p holds columns 16p..16p+15 (zero past N), so that one
// vector load gives 16 columns. Dense formats, k-major: F32 float [K][16], BF16 bfloat16 [K][16], F16 float16
// [K][16] (both converted to float exactly); a y[m][n] is one fma chain over k in order. The GGUF block formats Q8_0 (w = d * q) and Q4_1 (w = d * q + m), K a multiple of 32,
// are integer dot products with x quantised per block: int8_blocks.h, which states their layout and arithmetic;
// the other block formats (Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) likewise in kquant_blocks.h.

enum Format : int32_t {
  kF32 = 0, kBF16 = 1, kQ8_0 = 2, kQ4_1 = 3, kQ4_0 = 4, kQ5_0 = 5, kQ5_1 = 6, kQ4_K = 7, kQ5_K = 8, kQ6_K = 9,
  kF16 = 10
};

static int64_t kquant_panel_bytes(int32_t format, int64_t K);  // kquant_blocks.h

static inline int64_t panel_bytes(int32_t format, int64_t K) {
  switch (format) {
    case kF32:
      return K * kLanes * 4;
    case kBF16:
    case kF16:
      return K * kLanes * 2;
    case kQ8_0:
      return K / kBlock * (kBlock * kLanes + kLanes * 2);
    case kQ4_1:
      return K / kBlock * (kBlock / 2 * kLanes + 2 * kLanes * 2);
    default:
      return kquant_panel_bytes(format, K);
  }
}

// A tile's accumulators into y: row r's panel p to columns 16p.., the first `cols` columns of the tile only.
template <int MR, int NP>
static inline void store_tile(const V16 (&acc)[MR][NP], float* y, int64_t ldy, int cols) {
  alignas(64) float out[kLanes];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) {
      const int n = std::min(kLanes, cols - p * kLanes);
      if (n <= 0) break;
      vstore(out, acc[r][p]);
      memcpy(y + r * ldy + p * kLanes, out, n * sizeof(float));
    }
}

// One tile: MR rows of x times NP panels, every k. acc[r][p] is y[row r][panel p's 16 columns].
template <int MR, int NP>
static void tile_dense(int32_t format, const float* x, int64_t ldx, const uint8_t* panels, int64_t pbytes, int64_t K,
                       float* y, int64_t ldy, int cols) {
  V16 acc[MR][NP];
  for (int r = 0; r < MR; ++r)
    for (int p = 0; p < NP; ++p) acc[r][p] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    V16 w[NP];
    for (int p = 0; p < NP; ++p) {
      const uint8_t* base = panels + p * pbytes;
      const uint16_t* halves = reinterpret_cast<const uint16_t*>(base) + k * kLanes;
      w[p] = format == kF32    ? vload(reinterpret_cast<const float*>(base) + k * kLanes)
             : format == kBF16 ? vfrom_bf16(halves)
                               : vfrom_f16(halves);
    }
    for (int r = 0; r < MR; ++r) {
      V16 xv = vset1(x[r * ldx + k]);
      for (int p = 0; p < NP; ++p) acc[r][p] = vfma(xv, w[p], acc[r][p]);
    }
  }
  store_tile<MR, NP>(acc, y, ldy, cols);
}

// Tile shapes: accumulators MR x NP vectors must fit the register file with the weights (32 zmm or 16 ymm).
#if defined(__AVX512F__)
constexpr int kMR = 6, kNP = 2, kWideNP = 8;
#elif defined(__AVX2__)
constexpr int kMR = 4, kNP = 1, kWideNP = 1;
#else
constexpr int kMR = 4, kNP = 1, kWideNP = 1;
#endif
constexpr int kRowBlock = 96;  // rows of x per pass over a column group: they stay in cache while it streams

// A tile of 1..kMR rows and 1..kNP panels, each with the code compiled for exactly that many (a tile never reads
// past the last panel).
template <int MR = kMR, int NP = kNP>
static void run_rows(int rows, int panels_here, int32_t format, const float* x, int64_t ldx, const uint8_t* panels,
                     int64_t pbytes, int64_t K, float* y, int64_t ldy, int cols) {
  if constexpr (MR > 1) {
    if (rows < MR) return run_rows<MR - 1, NP>(rows, panels_here, format, x, ldx, panels, pbytes, K, y, ldy, cols);
  }
  if constexpr (NP > 1) {
    if (panels_here < NP) return run_rows<MR, NP - 1>(rows, panels_here, format, x, ldx, panels, pbytes, K, y, ldy, cols);
  }
  tile_dense<MR, NP>(format, x, ldx, panels, pbytes, K, y, ldy, cols);
}

// The tiles of one matmul over N columns of packed panels (pbytes each): threads take column groups of NP panels;
// each group runs its rows in blocks of `row_block` (they stay in cache while the group streams), in tiles of MR.
// tile(rows, panels_here, m, panel, column, cols) computes rows m.. of panels `panel`.. (columns `column`..).
template <int MR, int NP, class Tile>
static void for_each_tile(int64_t M, int64_t N, int64_t pbytes, int64_t row_block, int threads, const Tile& tile) {
  const int64_t num_panels = (N + kLanes - 1) / kLanes;
  const int64_t num_groups = (num_panels + NP - 1) / NP;
  parallel_for(num_groups, num_groups / (4 * threads), threads, [&](int64_t first, int64_t last) {
    for (int64_t g = first; g < last; ++g) {
      const int cols = static_cast<int>(std::min<int64_t>(NP * kLanes, N - g * NP * kLanes));
      const int panels_here = static_cast<int>(std::min<int64_t>(NP, num_panels - g * NP));
      for (int64_t m0 = 0; m0 < M; m0 += row_block) {
        const int64_t m1 = std::min(M, m0 + row_block);
        for (int64_t m = m0; m < m1; m += MR)
          tile(static_cast<int>(std::min<int64_t>(MR, m1 - m)), panels_here, m, g * NP,
               g * NP * kLanes, cols);
      }
    }
  });
}

// The column groups of one dense matmul, NP panels each, rows in tiles of MR.
template <int MR, int NP>
static void matmul_groups(int32_t format, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed,
                          int64_t N, float* y, int64_t ldy, int32_t threads) {
  const int64_t pbytes = panel_bytes(format, K);
  for_each_tile<MR, NP>(M, N, pbytes, kRowBlock, threads,
                        [&](int rows, int panels_here, int64_t m, int64_t panel, int64_t column, int cols) {
                          run_rows<MR, NP>(rows, panels_here, format, x + m * ldx, ldx, packed + panel * pbytes, pbytes,
                                           K, y + m * ldy + column, ldy, cols);
                        });
}

#include "int8_blocks.h"
#include "kquant_blocks.h"
#include "attention.h"
#include "sampling_noise.h"

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

// out[T, N] = gate / (1 + exp(exponent(gate))) * up, with gate = x[:, :N] and up = x[:, N:2N]: the gated MLPs'
// one form (SiLU's exponent is -gate, GELU-tanh's -2u).
template <class Exponent>
static void gated_mul(const float* x, int64_t T, int64_t N, float* out, int32_t threads, const Exponent& exponent) {
  parallel_for(T, kRowsPerClaim, threads, [&](int64_t first, int64_t last) {
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

}  // namespace

extern "C" {

int32_t invariant_row_tile() { return kMR; }

const char* invariant_isa() { return kDotIsa; }

// y[M, N] = x[M, K] @ W.T with W packed (see above); x rows ldx apart, y rows ldy apart.
// Dense formats: one or two rows (a decode step, a short draft) take wider column groups on AVX-512: a tile's
// accumulators are its only independent fma chains, and two panels' would leave the fma units waiting on their
// latency (decode B=1 on an AMD EPYC: 5.9 ms against 6.6). The AVX2 build keeps one panel, which measured faster there
// than two or four.
void invariant_matmul(int32_t format, const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed,
                      int64_t N, float* y, int64_t ldy, int32_t threads) {
  if (format == kQ8_0 || format == kQ4_1) return int8_matmul(format, x, M, K, ldx, packed, N, y, ldy, threads);
  if (is_kquant_format(format)) return kquant_matmul(format, x, M, K, ldx, packed, N, y, ldy, threads);
  if constexpr (kWideNP > kNP) {
    const int64_t num_panels = (N + kLanes - 1) / kLanes;
    const bool many_groups = num_panels >= kWideNP * 4 * threads;  // enough wide groups to keep every thread busy
    if (M == 1)
      return many_groups ? matmul_groups<1, kWideNP>(format, x, M, K, ldx, packed, N, y, ldy, threads)
                         : matmul_groups<1, kWideNP / 2>(format, x, M, K, ldx, packed, N, y, ldy, threads);
    if (M == 2) return matmul_groups<2, kWideNP / 2>(format, x, M, K, ldx, packed, N, y, ldy, threads);
  }
  matmul_groups<kMR, kNP>(format, x, M, K, ldx, packed, N, y, ldy, threads);
}

// Causal attention of query tokens over their own rows of a token KV pool (head_dim 16, 32, 64, 96, 128 or 256, at
// most 8 query heads per KV head: invariant_attention_supports).
// q [T, H, D]; k_pool, v_pool [R, Hkv, D]; token t attends to the pool rows rows[row_start[t] + j],
// j < num_keys[t]; out [T, H, D]. The H query heads are Hkv groups of H / Hkv sharing one KV head. Tokens that
// share row_start are one sequence's; attention.h states the arithmetic, the same for every token in any call.
void invariant_attention(const float* q, int64_t T, int64_t H, int64_t D, const float* k_pool, const float* v_pool,
                         int64_t Hkv, const int64_t* rows, const int64_t* row_start, const int64_t* num_keys,
                         float scale, float* out, int32_t threads) {
  attention(q, T, H, D, k_pool, v_pool, Hkv, rows, row_start, num_keys, scale, out, threads);
}

int32_t invariant_attention_supports(int64_t head_dim, int64_t group) {
  return (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256) &&
         group >= 1 && group <= 8;
}

// out[T, N] = x * rsqrt(mean(x^2) + eps) * weight, as transformers' LlamaRMSNorm orders it.
// The sum of squares: 16 partial sums (lane n mod 16) then the fixed tree.
void invariant_rms_norm(const float* x, int64_t T, int64_t N, int64_t ldx, const float* weight, float eps, float* out,
                        int64_t ldo, int32_t threads) {
  parallel_for(T, kRowsPerClaim, threads, [&](int64_t first, int64_t last) {
  for (int64_t t = first; t < last; ++t) {
    const float* row = x + t * ldx;
    V16 partial = vzero();
    for (int64_t n = 0; n < N; n += kLanes) {
      V16 v = vload_at(row, n, N);
      partial = vfma(v, v, partial);
    }
    const float inverse = 1.0f / sqrtf(tree_sum(partial) / static_cast<float>(N) + eps);
    V16 r = vset1(inverse);
    for (int64_t n = 0; n < N; n += kLanes)
      vstore_at(out + t * ldo, n, N, vmul(vmul(vload_at(row, n, N), r), vload_at(weight, n, N)));
  }
  });
}

// out[T, N] = silu(gate) * up = gate / (1 + exp(-gate)) * up, with gate = x[:, :N] and up = x[:, N:2N].
void invariant_silu_mul(const float* x, int64_t T, int64_t N, float* out, int32_t threads) {
  gated_mul(x, T, N, out, threads, [](V16 g) { return vsub(vzero(), g); });
}

// out[T, N] = gelu_tanh(gate) * up, with gate = x[:, :N] and up = x[:, N:2N] (Gemma's MLP). gelu_tanh(g) =
// g / 2 * (1 + tanh(u)) with u = sqrt(2 / pi) * (g + 0.044715 g^3) is g / (1 + exp(-2u)): SiLU's form, u's
// products rounded one by one, then one exp, one division.
void invariant_gelu_tanh_mul(const float* x, int64_t T, int64_t N, float* out, int32_t threads) {
  gated_mul(x, T, N, out, threads, [](V16 g) {
    V16 inner = vadd(g, vmul(vset1(0.044715f), vmul(vmul(g, g), g)));
    return vmul(vset1(-1.5957691216057308f), inner);  // -2 sqrt(2 / pi)
  });
}

// x[T, N] = cap * tanh(x / cap) in place, rows ldx apart (Gemma's soft-capping of logits); tanh(y) as
// 2 / (1 + exp(-2y)) - 1, whose exp saturates to give +-1 for large |y|.
void invariant_softcap(float* x, int64_t T, int64_t N, int64_t ldx, float cap, int32_t threads) {
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


// Masks rows of logits [*, vocab] (float32, or a 16-bit float: element_bytes 4 or 2) in place by int32 words
// [*, num_words]: the rows rows[0..num_rows) of both, or rows 0..num_rows when rows is null. Rows and the word
// ranges of long rows are split between threads.
void invariant_mask_logits(void* logits, int32_t element_bytes, uint32_t neg_inf_bits, int64_t vocab, int64_t ldl,
                           const int32_t* words, int64_t num_words, int64_t ldw, const int64_t* rows,
                           int64_t num_rows, int32_t threads) {
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

// out[rows, vocab]: the sampler's Exp(1) draws, row r's from keys[r] (sampling_noise.h).
void invariant_exponentials(const uint64_t* keys, int64_t rows, int64_t vocab, float* out, int32_t threads) {
  exponentials_of_rows(keys, rows, vocab, out, threads);
}

// tokens[rows]: the sampler's race over logits [rows, vocab] (row stride ld) at temperatures[rows] with the draws
// of keys[rows] (sampling_noise.h); -1 for a row of only -inf.
void invariant_gumbel_race(const float* logits, int64_t ld, int64_t rows, int64_t vocab, const float* temperatures,
                           const uint64_t* keys, int64_t* tokens, int32_t threads) {
  gumbel_race_rows(logits, ld, rows, vocab, temperatures, keys, tokens, threads);
}

}  // extern "C"

#include "decoder_layer.h"
