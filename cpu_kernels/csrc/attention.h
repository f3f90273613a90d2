// Causal attention over a token KV pool, on the SIMD layer's vectors, tree_sum and exp.
//
// Per query token and head, over its keys j = 0 .. L - 1, one fixed sequence whatever else is in the call:
//   s_j = (q . k_j) * scale, where q . k_j is 16 partial sums P_l = chain over c of q[l + 16c] * k_j[l + 16c]
//         (from 0, c in order), added in tree_sum's fixed tree;
//   p_j = exp(s_j - max s); Z = 16 partial sums of p_j (lane j mod 16, in order of j), added in the same tree;
//   out = (chain over j of p_j v_j) * (1 / Z).
// The pool holds K and V as float32 or 16-bit floats (kv_element.h), read exactly as float32: the same arithmetic.
// Two layouts compute those bits:
// - a token alone in its sequence (a decode step): head_dim in lanes. One key's 16 partial sums fill a vector;
//   tree_sum16 adds 16 keys' at once with shuffles.
// - a run of consecutive tokens of one sequence (a prefill, an extend, a speculative verification): keys in lanes,
//   over the sequence's keys transposed once per call. Lane j's P_l are then whole vectors and the tree is vertical
//   additions, no shuffles; a tile of tokens (times the query heads of a KV head) shares every key and value load,
//   which a token alone cannot (docs/benchmarks.md: a 1,550-token prompt's attention 1.5x faster).

#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "buffer.h"
#include "kv_element.h"
#include "simd.h"
#include "thread_pool.h"

namespace {

// Accumulator budgets (vectors) of the two tiled loops: the register file is 32 zmm, or 16 ymm holding 8 vectors.
// kValueChunksPerPass: the chunks of head_dim a pass of weigh_values holds (0: all), so that more rows share each
// value load; every accumulator is still one chain over j in order, the same bits.
#if defined(__AVX512F__)
// A tile's scores are built for 4 query rows x 2 key blocks at once, the score tree's nodes of width 4 in registers
// (3 live vectors each: 24 accumulators) and the tree above them through memory (score_block).
constexpr int kScoreRows = 4;
constexpr int kScoreBlocks = 2;
constexpr int kScoreNodeWidth = 4;
constexpr int kValueAccumulators = 24;
constexpr int kValueChunksPerPass = 0;  // every chunk of head_dim in one pass
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Scores for 3 query rows at once, the tree's nodes of width 8 in registers (2 live vectors each: 12 ymm, a key
// vector's 2 and a broadcast); values one 16-float chunk a pass, 6 rows (12 ymm). AMD EPYC Zen 3, one layer's
// prefill of 1,550 tokens (SmolLM2's heads, 16-bit pool), GOP/s, the best of 3 interleaved runs: 1 thread 41 -> 56-57,
// 2 threads 72 -> 97-125 (values in passes alone: 1 thread 46; rows 2 or 4 a score tile within the noise of 3).
constexpr int kScoreRows = 3;
constexpr int kScoreBlocks = 1;
constexpr int kScoreNodeWidth = 8;
constexpr int kValueAccumulators = 6;
constexpr int kValueChunksPerPass = 1;
#else
constexpr int kScoreRows = 1;
constexpr int kScoreBlocks = 1;
constexpr int kScoreNodeWidth = 1;
constexpr int kValueAccumulators = 6;
constexpr int kValueChunksPerPass = 0;
#endif
constexpr int kTileQueryRows = 24;  // query rows (tokens x heads of a KV head) per work item of a run, at least
constexpr int kMaxTileRows = kTileQueryRows + 7;  // whole tokens of up to 8 heads
// Shorter runs take the head_dim-in-lanes path token by token: transposing the keys costs more than the tiles save
// (measured break-even between 8 and 16 tokens, docs/benchmarks.md).
constexpr int64_t kMinRunTokens = 12;
constexpr int64_t kKeptKeyFloats = int64_t{4} << 20;  // 16 MB of transposed keys at most kept between calls

// exp(s_j - max s) in place over s[0..L); returns 1 / Z.
static inline float softmax_numerators(float* s, int64_t L) {
  V16 peaks = vset1(-INFINITY);  // max is exact in any order
  for (int64_t j = 0; j < L; j += kLanes) peaks = vmax(peaks, vload_head_fill(s + j, std::min<int64_t>(kLanes, L - j), -INFINITY));
  const V16 peak = vset1(tree_max(peaks));
  V16 totals = vzero();  // lane l sums p_j for j = l mod 16, in order of j; then the fixed tree
  for (int64_t j = 0; j < L; j += kLanes) {
    const V16 p = vexp(vsub(vload_at(s, j, L), peak));
    vstore_at(s, j, L, p);
    totals = vadd(totals, j + kLanes <= L ? p : vload_head(s + j, L - j));
  }
  return 1.0f / tree_sum(totals);
}

// ---- a token alone: head_dim in lanes --------------------------------------------------------------------------

// Chunks of head_dim a pass over the values of a token alone holds for GROUP heads: all where the build weighs
// values in one pass (kValueChunksPerPass 0), else the most that divide CHUNKS within kValueAccumulators (AVX2: 3
// heads of 4 chunks held 24 ymm and spilled; 2 chunks a pass, 12). Each accumulator is one chain over j either way.
static constexpr int value_pass_chunks(int chunks, int group) {
  if (kValueChunksPerPass == 0) return chunks;
  int pass = chunks;
  while (pass > 1 && (pass * group > kValueAccumulators || chunks % pass != 0)) --pass;
  return pass;
}

// A decode step's keys and values stream from memory (each token its own sequence), through the pool's row
// indirection, which the hardware prefetcher cannot follow: rows this many keys ahead are asked for in advance.
constexpr int64_t kPrefetchKeys = 32;

template <class T>
static inline void prefetch_row(const T* row, int chunks) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < chunks * kLanes * static_cast<int64_t>(sizeof(T)); at += 64)
    _mm_prefetch(bytes + at, _MM_HINT_T0);
}

// GROUP query heads of CHUNKS 16-float chunks (in registers) over one KV head. `scores` holds GROUP x L floats.
template <int GROUP, int CHUNKS, class KV>
static void attend(const float* q, const typename KV::T* k_pool, const typename KV::T* v_pool, int64_t row_stride,
                   const int64_t* rows, int64_t L, float scale, float* scores, float* out) {
  V16 query[GROUP][CHUNKS];
  for (int h = 0; h < GROUP; ++h)
    for (int c = 0; c < CHUNKS; ++c) query[h][c] = vload(q + (h * CHUNKS + c) * kLanes);
  V16 partials[GROUP][kLanes];
  for (int64_t j0 = 0; j0 < L; j0 += kLanes) {  // 16 keys at a time
    const int64_t n = std::min<int64_t>(kLanes, L - j0);
    for (int64_t jj = 0; jj < kLanes; ++jj) {
      if (jj >= n) {
        for (int h = 0; h < GROUP; ++h) partials[h][jj] = vzero();
        continue;
      }
      const typename KV::T* key = k_pool + rows[j0 + jj] * row_stride;
      if (j0 + jj + kPrefetchKeys < L) prefetch_row(k_pool + rows[j0 + jj + kPrefetchKeys] * row_stride, CHUNKS);
      V16 k[CHUNKS];
      for (int c = 0; c < CHUNKS; ++c) k[c] = KV::load(key + c * kLanes);
      for (int h = 0; h < GROUP; ++h) {
        V16 partial = vzero();
        for (int c = 0; c < CHUNKS; ++c) partial = vfma(query[h][c], k[c], partial);
        partials[h][jj] = partial;
      }
    }
    for (int h = 0; h < GROUP; ++h) vstore_at(scores + h * L, j0, L, vmul(tree_sum16(partials[h]), vset1(scale)));
  }
  float inverse[GROUP];
  for (int h = 0; h < GROUP; ++h) inverse[h] = softmax_numerators(scores + h * L, L);
  // the values weighted by unnormalised p_j, kPass chunks of head_dim a pass (value_pass_chunks)
  constexpr int kPass = value_pass_chunks(CHUNKS, GROUP);
  for (int c0 = 0; c0 < CHUNKS; c0 += kPass) {
    V16 acc[GROUP][kPass];
    for (int h = 0; h < GROUP; ++h)
      for (int c = 0; c < kPass; ++c) acc[h][c] = vzero();
    for (int64_t j = 0; j < L; ++j) {
      const typename KV::T* value = v_pool + rows[j] * row_stride + c0 * kLanes;
      if (c0 == 0 && j + kPrefetchKeys < L) prefetch_row(v_pool + rows[j + kPrefetchKeys] * row_stride, CHUNKS);
      for (int c = 0; c < kPass; ++c) {
        const V16 v = KV::load(value + c * kLanes);
        for (int h = 0; h < GROUP; ++h) acc[h][c] = vfma(vset1(scores[h * L + j]), v, acc[h][c]);
      }
    }
    for (int h = 0; h < GROUP; ++h)
      for (int c = 0; c < kPass; ++c)
        vstore(out + (h * CHUNKS + c0 + c) * kLanes, vmul(acc[h][c], vset1(inverse[h])));
  }
}

template <class KV>
using AttendFn = void (*)(const float*, const typename KV::T*, const typename KV::T*, int64_t, const int64_t*, int64_t,
                          float, float*, float*);

template <int CHUNKS, class KV>
static AttendFn<KV> attend_for_group(int64_t group) {
  switch (group) {
    case 1: return attend<1, CHUNKS, KV>;
    case 2: return attend<2, CHUNKS, KV>;
    case 3: return attend<3, CHUNKS, KV>;
    case 4: return attend<4, CHUNKS, KV>;
    case 5: return attend<5, CHUNKS, KV>;
    case 6: return attend<6, CHUNKS, KV>;
    case 7: return attend<7, CHUNKS, KV>;
    case 8: return attend<8, CHUNKS, KV>;
    default: return nullptr;
  }
}

// ---- a run of tokens: keys in lanes ----------------------------------------------------------------------------

// `value`, as the compiler sees it only once `prior` is computed (no instruction: the processor still overlaps
// them). The score tree's leaves start from a zero ordered after the node before them, so that the compiler keeps
// them in the order written (depth first, a few live vectors per output); left free, it computes all 16 leaves ahead
// of their additions and spills them.
static inline V16 ordered_after(const V16& prior, V16 value) {
#if defined(__AVX512F__)
  asm("" : "+v"(value.r) : "v"(prior.r));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  asm("" : "+x"(value.lo), "+x"(value.hi) : "x"(prior.lo), "x"(prior.hi));
#else
  (void)prior;
#endif
  return value;
}

// `a`, loaded into a register once: the compiler would otherwise fold the load into each of its R fmas.
static inline V16 in_register(V16 a) {
#if defined(__AVX512F__)
  asm("" : "+v"(a.r));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  asm("" : "+x"(a.lo), "+x"(a.hi));
#endif
  return a;
}

// A key block b holds 16 keys transposed, kt[d][lane] = k_{16b + lane}[d] (zero past the run's last key).
// The node of tree_sum's tree that starts at partial l and pairs l with l + WIDTH, for R query rows (packed, D = 16
// CHUNKS floats apart) and B consecutive key blocks: T(l, 16) = P_l, T(l, w) = T(l, 2w) + T(l + w, 2w); the whole
// sum is T(0, 1). Evaluated depth first, a node of width w holds log2(16 / w) + 1 live vectors per output, and each
// step over d loads R broadcasts and B key vectors for R x B fmas. `fence`: the last node computed (ordered_after).
template <int R, int B, int CHUNKS, int WIDTH>
[[gnu::always_inline]] static inline void score_tree(const float* q, const float* kt, int l, V16 (&out)[R][B],
                                                     V16& fence) {
  constexpr int64_t kBlockFloats = CHUNKS * kLanes * kLanes;
  if constexpr (WIDTH == kLanes) {
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) out[r][b] = ordered_after(fence, vzero());
    for (int c = 0; c < CHUNKS; ++c) {
      V16 k[B];
      for (int b = 0; b < B; ++b) k[b] = in_register(vload(kt + b * kBlockFloats + (l + c * kLanes) * kLanes));
      for (int r = 0; r < R; ++r) {
        const V16 x = vset1(q[r * CHUNKS * kLanes + l + c * kLanes]);
        for (int b = 0; b < B; ++b) out[r][b] = vfma(x, k[b], out[r][b]);
      }
    }
  } else {
    V16 other[R][B];
    score_tree<R, B, CHUNKS, WIDTH * 2>(q, kt, l, out, fence);
    score_tree<R, B, CHUNKS, WIDTH * 2>(q, kt, l + WIDTH, other, fence);
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) out[r][b] = vadd(out[r][b], other[r][b]);
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) fence = ordered_after(out[r][b], fence);
  }
}

// scores[r * stride + 16b ..] = (q_r . k_j) * scale for R rows and the 16 keys of each of B blocks. The tree's
// nodes of width kScoreNodeWidth are evaluated in registers, one after another (depth first); the tree above them is
// added up through a stack in L1 (the lower node first, as tree_sum pairs them), so that only 2, 3, 4 or 5 vectors
// per output are live and R x B can grow.
template <int R, int B, int CHUNKS>
[[gnu::always_inline]] static inline void score_block(const float* q, const float* kt, float scale, float* scores,
                                                      int64_t stride) {
  // the tree has w nodes of width w, kLevels = log2(w) levels above them
  constexpr int kNodes = kScoreNodeWidth, kLevels = kNodes == 8 ? 3 : kNodes == 4 ? 2 : kNodes == 2 ? 1 : 0;
  V16 stack[kLevels > 0 ? kLevels : 1][R][B];
  V16 fence = vzero();
  int depth = 0;
  for (int i = 0; i < kNodes; ++i) {
    int node = 0;  // the i-th node of width kNodes, depth first: i's bits reversed
    for (int bit = 0; bit < kLevels; ++bit) node |= ((i >> bit) & 1) << (kLevels - 1 - bit);
    V16 s[R][B];
    score_tree<R, B, CHUNKS, kNodes>(q, kt, node, s, fence);
    for (int merges = i + 1; merges % 2 == 0; merges /= 2) {
      --depth;
      for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) s[r][b] = vadd(stack[depth][r][b], s[r][b]);
    }
    if (i + 1 == kNodes) {
      for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) vstore(scores + r * stride + b * kLanes, vmul(s[r][b], vset1(scale)));
    } else {
      for (int r = 0; r < R; ++r)
        for (int b = 0; b < B; ++b) stack[depth][r][b] = s[r][b];
      ++depth;
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < B; ++b) fence = ordered_after(s[r][b], fence);
  }
}

// Every row of the tile over B key blocks, R rows at a time, then the rows left R' < R at a time.
template <int B, int CHUNKS, int R = kScoreRows>
static inline void score_rows(int rows, const float* q, const float* kt, float scale, float* scores, int64_t stride) {
  int r0 = 0;
  for (; r0 + R <= rows; r0 += R)
    score_block<R, B, CHUNKS>(q + r0 * CHUNKS * kLanes, kt, scale, scores + r0 * stride, stride);
  if constexpr (R > 1) {
    if (r0 < rows)
      score_rows<B, CHUNKS, R - 1>(rows - r0, q + r0 * CHUNKS * kLanes, kt, scale, scores + r0 * stride, stride);
  }
}

// scores[r * stride + j] = (q_r . k_j) * scale for every row of a tile (packed queries) and j < 16 blocks: B key
// blocks at a time (held in L1 while every row passes over them), each row's scores in the same fixed sequence.
template <int CHUNKS>
static void score_tile(int rows, const float* q, const float* kt, int64_t blocks, float scale, float* scores,
                       int64_t stride) {
  constexpr int64_t kBlockFloats = CHUNKS * kLanes * kLanes;
  int64_t b = 0;
  for (; b + kScoreBlocks <= blocks; b += kScoreBlocks)
    score_rows<kScoreBlocks, CHUNKS>(rows, q, kt + b * kBlockFloats, scale, scores + b * kLanes, stride);
  for (; b < blocks; ++b) score_rows<1, CHUNKS>(rows, q, kt + b * kBlockFloats, scale, scores + b * kLanes, stride);
}

// out_r = (chain over j < L_r of p_rj v_j) * inverse_r for R rows at a time; every row's keys are a prefix of the
// run's, so one value load serves every row that attends to it.
template <int CHUNKS, class KV, int R = std::max(1, std::min(kTileQueryRows, kValueAccumulators / CHUNKS))>
static void weigh_values(int rows, const typename KV::T* v_pool, int64_t row_stride, const int64_t* keys,
                         const int64_t* L, const float* const* p, const float* inverse, float* const* out,
                         int64_t out_offset) {
  if constexpr (R > 1) {
    if (rows < R)
      return weigh_values<CHUNKS, KV, R - 1>(rows, v_pool, row_stride, keys, L, p, inverse, out, out_offset);
  }
  for (int r0 = 0; r0 + R <= rows; r0 += R) {
    int64_t shared = L[r0], longest = L[r0];
    for (int r = 1; r < R; ++r) shared = std::min(shared, L[r0 + r]), longest = std::max(longest, L[r0 + r]);
    V16 acc[R][CHUNKS];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CHUNKS; ++c) acc[r][c] = vzero();
    for (int64_t j = 0; j < shared; ++j) {
      const typename KV::T* value = v_pool + keys[j] * row_stride;
      for (int c = 0; c < CHUNKS; ++c) {
        const V16 v = KV::load(value + c * kLanes);
        for (int r = 0; r < R; ++r) acc[r][c] = vfma(vset1(p[r0 + r][j]), v, acc[r][c]);
      }
    }
    for (int64_t j = shared; j < longest; ++j) {  // the keys that only the later tokens see
      const typename KV::T* value = v_pool + keys[j] * row_stride;
      for (int c = 0; c < CHUNKS; ++c) {
        const V16 v = KV::load(value + c * kLanes);
        for (int r = 0; r < R; ++r)
          if (j < L[r0 + r]) acc[r][c] = vfma(vset1(p[r0 + r][j]), v, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CHUNKS; ++c)
        vstore(out[r0 + r] + out_offset + c * kLanes, vmul(acc[r][c], vset1(inverse[r0 + r])));
  }
  if constexpr (R > 1) {
    const int done = rows / R * R;
    if (done < rows)
      weigh_values<CHUNKS, KV, R - 1>(rows - done, v_pool, row_stride, keys, L + done, p + done, inverse + done,
                                      out + done, out_offset);
  }
}

// One work item of a run: `rows` query rows (q pointers, their key counts L, out pointers) over one KV head whose
// keys are transposed in `kt`; `scores` has room for rows x (L rounded up to 16).
template <int CHUNKS, class KV>
static void attend_tile(int rows, const float* const* q, const float* kt, const typename KV::T* v_pool,
                        int64_t row_stride, const int64_t* keys, const int64_t* L, float scale, float* scores,
                        float* const* out) {
  int64_t longest = 0;
  for (int r = 0; r < rows; ++r) longest = std::max(longest, L[r]);
  const int64_t blocks = (longest + kLanes - 1) / kLanes;
  alignas(64) float packed[kMaxTileRows * CHUNKS * kLanes];  // the rows' queries side by side: fixed offsets
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < CHUNKS; ++c) vstore(packed + (r * CHUNKS + c) * kLanes, vload(q[r] + c * kLanes));
  const float* row_scores[kMaxTileRows];
  float* writable[kMaxTileRows];
  float inverse[kMaxTileRows];
  for (int r = 0; r < rows; ++r) writable[r] = scores + r * blocks * kLanes, row_scores[r] = writable[r];
  score_tile<CHUNKS>(rows, packed, kt, blocks, scale, scores, blocks * kLanes);
  for (int r = 0; r < rows; ++r) inverse[r] = softmax_numerators(writable[r], L[r]);
  constexpr int kPass = kValueChunksPerPass == 0 ? CHUNKS : kValueChunksPerPass;
  for (int c0 = 0; c0 < CHUNKS; c0 += kPass)
    weigh_values<kPass, KV>(rows, v_pool + c0 * kLanes, row_stride, keys, L, row_scores, inverse, out, c0 * kLanes);
}

template <class KV>
using AttendTileFn = void (*)(int, const float* const*, const float*, const typename KV::T*, int64_t, const int64_t*,
                              const int64_t*, float, float*, float* const*);

// The runs of a call: consecutive tokens that share a sequence (the same key_starts), longest key list `keys`, their
// transposed keys at kt_offset in the call's buffer; a token alone (or in a run too short to tile) has kt_offset -1.
struct Run {
  int64_t first, tokens, keys, kt_offset;
};

// 16 keys' head_dim chunk of 16 floats (rows[lane], null past the run's end) as kt[d][lane]: data movement only.
static inline void transpose_chunk(const float* const* rows, float* kt) {
#if defined(__AVX512F__)
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = rows[i] != nullptr ? _mm512_loadu_ps(rows[i]) : _mm512_setzero_ps();
  for (int i = 0; i < 8; ++i) {  // the 16x16 transpose of unpacks, then 128-bit blocks, then 256-bit halves
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 8; ++i) {
    _mm512_storeu_ps(kt + i * kLanes, _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
    _mm512_storeu_ps(kt + (i + 8) * kLanes, _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD));
  }
#else
  for (int d = 0; d < kLanes; ++d)
    for (int lane = 0; lane < kLanes; ++lane) kt[d * kLanes + lane] = rows[lane] != nullptr ? rows[lane][d] : 0.0f;
#endif
}

// Transposes each run's keys, per KV head, into blocks of 16 (kt[g][b][d][lane]) of float32, threads taking blocks.
template <class KV>
static void transpose_keys(const std::vector<Run>& runs, const typename KV::T* k_pool, int64_t Hkv, int64_t D,
                           const int64_t* rows, const int64_t* row_start, float* kt, int threads) {
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (run, block)
  for (size_t i = 0; i < runs.size(); ++i)
    for (int64_t b = 0; b < (runs[i].keys + kLanes - 1) / kLanes; ++b) blocks.emplace_back(i, b);
  parallel_for(static_cast<int64_t>(blocks.size()), 8, threads, [&](int64_t first, int64_t last) {
    for (int64_t item = first; item < last; ++item) {
      const Run& run = runs[blocks[item].first];
      const int64_t b = blocks[item].second, num_blocks = (run.keys + kLanes - 1) / kLanes;
      const int64_t* keys = rows + row_start[run.first];
      for (int64_t g = 0; g < Hkv; ++g) {
        const typename KV::T* key[kLanes];
        for (int lane = 0; lane < kLanes; ++lane) {
          const int64_t j = b * kLanes + lane;
          key[lane] = j < run.keys ? k_pool + (keys[j] * Hkv + g) * D : nullptr;
        }
        float* block = kt + run.kt_offset + (g * num_blocks + b) * D * kLanes;
        for (int64_t c = 0; c < D; c += kLanes) {
          if constexpr (std::is_same_v<typename KV::T, float>) {
            transpose_chunk(key, block + c * kLanes);
          } else {  // the chunk's 16 keys as float32 first
            float converted[kLanes][kLanes];
            const float* chunk[kLanes];
            for (int lane = 0; lane < kLanes; ++lane) {
              chunk[lane] = key[lane] != nullptr ? converted[lane] : nullptr;
              if (key[lane] != nullptr) vstore(converted[lane], KV::load(key[lane]));
            }
            transpose_chunk(chunk, block + c * kLanes);
          }
          for (int lane = 0; lane < kLanes; ++lane)
            if (key[lane] != nullptr) key[lane] += kLanes;
        }
      }
    }
  });
}

// Causal attention of query tokens over their own rows of a token KV pool of KV's elements; see invariant_attention
// in cpu_kernels.cpp.
template <class KV>
static void attention_over(const float* q, int64_t T, int64_t H, int64_t D, const typename KV::T* k_pool,
                           const typename KV::T* v_pool, int64_t Hkv, const int64_t* rows, const int64_t* row_start,
                           const int64_t* num_keys, float scale, float* out, int threads) {
  const int64_t group = H / Hkv;
  AttendFn<KV> attend_one = nullptr;  // the caller pads head_dim to a multiple of 16 and groups to at most 8 heads
  AttendTileFn<KV> attend_run = nullptr;
  switch (D) {
    case 16: attend_one = attend_for_group<1, KV>(group), attend_run = attend_tile<1, KV>; break;
    case 32: attend_one = attend_for_group<2, KV>(group), attend_run = attend_tile<2, KV>; break;
    case 64: attend_one = attend_for_group<4, KV>(group), attend_run = attend_tile<4, KV>; break;
    case 96: attend_one = attend_for_group<6, KV>(group), attend_run = attend_tile<6, KV>; break;
    case 128: attend_one = attend_for_group<8, KV>(group), attend_run = attend_tile<8, KV>; break;
    case 256: attend_one = attend_for_group<16, KV>(group), attend_run = attend_tile<16, KV>; break;
  }
  if (attend_one == nullptr) return;
  std::vector<Run> runs;
  int64_t kt_floats = 0, max_keys = 0;
  for (int64_t t = 0; t < T; ++t) max_keys = std::max(max_keys, num_keys[t]);
  for (int64_t t = 0, end; t < T; t = end) {
    int64_t keys = num_keys[t];
    for (end = t + 1; end < T && row_start[end] == row_start[t]; ++end) keys = std::max(keys, num_keys[end]);
    if (end - t < kMinRunTokens) {
      for (int64_t u = t; u < end; ++u) runs.push_back({u, 1, num_keys[u], -1});
      continue;
    }
    runs.push_back({t, end - t, keys, kt_floats});
    kt_floats += Hkv * (keys + kLanes - 1) / kLanes * kLanes * D;
  }
  std::vector<Run> tiled;
  for (const Run& run : runs)
    if (run.kt_offset >= 0) tiled.push_back(run);
  // The transposed keys (written in full): the caller's buffer, kept between calls up to kKeptKeyFloats, so that a
  // layer's ~1 MB is not mapped and faulted in afresh at every call (the workers below have buffers of their own).
  thread_local Buffer<float> kept;
  Buffer<float> larger;
  Buffer<float>& buffer = kt_floats <= kKeptKeyFloats ? kept : larger;
  if (buffer.size() < static_cast<size_t>(kt_floats)) buffer.resize(kt_floats);
  float* const kt = buffer.data();
  transpose_keys<KV>(tiled, k_pool, Hkv, D, rows, row_start, kt, threads);
  // Work items, longest first (a run's later tokens see more keys): (run, first token, tokens, KV head).
  const int64_t tile_tokens = (kTileQueryRows + group - 1) / group;
  struct Item {
    const Run* run;
    int64_t first, tokens, g;
  };
  std::vector<Item> items;
  for (const Run& run : runs)
    for (int64_t t = run.first; t < run.first + run.tokens; t += tile_tokens)
      for (int64_t g = 0; g < Hkv; ++g)
        items.push_back({&run, t, std::min(tile_tokens, run.first + run.tokens - t), g});
  std::sort(items.begin(), items.end(),
            [&](const Item& a, const Item& b) { return num_keys[a.first] > num_keys[b.first]; });
  parallel_for(static_cast<int64_t>(items.size()), 1, threads, [&](int64_t first, int64_t last) {
    thread_local std::vector<float> scores;  // each thread's, kept between calls: no allocation per claim
    const size_t need = std::max(group, tile_tokens * group) * ((max_keys + kLanes - 1) / kLanes) * kLanes;
    if (scores.size() < need) scores.resize(need);
    for (int64_t i = first; i < last; ++i) {
      const Item& item = items[i];
      const int64_t g = item.g;
      if (item.run->kt_offset < 0) {
        const int64_t t = item.first;
        attend_one(q + (t * H + g * group) * D, k_pool + g * D, v_pool + g * D, Hkv * D, rows + row_start[t],
                   num_keys[t], scale, scores.data(), out + (t * H + g * group) * D);
        continue;
      }
      const float* queries[kMaxTileRows];
      float* outs[kMaxTileRows];
      int64_t L[kMaxTileRows];
      int n = 0;
      for (int64_t t = item.first; t < item.first + item.tokens; ++t)
        for (int64_t h = g * group; h < (g + 1) * group; ++h, ++n)
          queries[n] = q + (t * H + h) * D, outs[n] = out + (t * H + h) * D, L[n] = num_keys[t];
      const int64_t num_blocks = (item.run->keys + kLanes - 1) / kLanes;
      attend_run(n, queries, kt + item.run->kt_offset + g * num_blocks * D * kLanes, v_pool + g * D, Hkv * D,
                 rows + row_start[item.first], L, scale, scores.data(), outs);
    }
  });
}

// Attention over a pool of the KvDtype `kv_dtype` (kv_element.h).
static void attention(const float* q, int64_t T, int64_t H, int64_t D, const void* k_pool, const void* v_pool,
                      int32_t kv_dtype, int64_t Hkv, const int64_t* rows, const int64_t* row_start,
                      const int64_t* num_keys, float scale, float* out, int threads) {
  with_kv_element(kv_dtype, [&](auto kv) {
    using KV = decltype(kv);
    attention_over<KV>(q, T, H, D, static_cast<const typename KV::T*>(k_pool),
                       static_cast<const typename KV::T*>(v_pool), Hkv, rows, row_start, num_keys, scale, out,
                       threads);
  });
}

// The head sizes and query heads per KV head `attention` runs.
static bool attention_supports(int64_t head_dim, int64_t group) {
  return (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 96 || head_dim == 128 || head_dim == 256) &&
         group >= 1 && group <= 8;
}

}  // namespace
