// Batch-invariant CPU kernels for the model forward: matmuls over packed weights (float32, bfloat16, float16, and the
// GGUF block formats Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the k-quants Q4_K, Q5_K, Q6_K), attention over a token KV
// pool, RMSNorm, the gated activations, soft-capping and whole decoder layers; and the grammar's token mask applied to
// the logits and the sampler's Exp(1) draws, which share its thread pool. This file holds the extern "C" entry
// points (cpu_kernels/library.py declares their signatures); each concern has a header of its own:
//   simd.h            the 16-lane float vector, the fixed reduction trees, exp
//   thread_pool.h     the pool and parallel_for          buffer.h         uninitialised scratch buffers
//   dense_matmul.h    formats, panels, the dense tiles   int8_blocks.h    Q8_0, Q4_1   kquant_blocks.h  the others
//   packed_matmul.h   the dispatch by format, stacks     attention.h      attention over the KV pool
//   kv_element.h      the KV pool's float32, bfloat16 or float16 elements
//   norm_activation.h RMSNorm, SiLU, GELU-tanh, softcap  decoder_layer.h  a layer's two blocks, every layer
//   mask_logits.h     the grammar's mask                 sampling_noise.h the sampler's draws and race
//   block_rows.h      rows of Q8_0 blocks as float32 (an embedding lookup)
//   masked_logits.h   the lm_head over the panels a grammar's mask allows
//   shm_gather.h      all-gathers between tensor-parallel ranks of one machine through a shared mapping
//   weight_warming.h  a forward's next weights asked of the caches while the memory would idle
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
// for a time slice (a decode step ~100x slower; docs/benchmarks.md).
// So batching, the row-padding a library may or may not do, speculative verification (k rows at once) and the
// thread count can never change a token's logits, on any x86-64 CPU with AVX2 or AVX-512, and elsewhere through
// the scalar path.

#include <stdint.h>

#include "attention.h"
#include "block_rows.h"
#include "decoder_layer.h"
#include "int8_blocks.h"
#include "mask_logits.h"
#include "norm_activation.h"
#include "packed_matmul.h"
#include "packed_rows.h"
#include "sampling_noise.h"
#include "shm_gather.h"

extern "C" {

int32_t invariant_row_tile() { return kMR; }

// Rows one tile of a matmul over a weight of `format` multiplies together (a dense format's kMR, a block format's
// kInt8MR): rows past a multiple of it take another tile's pass, which the block formats pay in compute.
int32_t invariant_weight_row_tile(int32_t format) {
  return is_block_format(format) ? kInt8MR : kMR;
}

int32_t invariant_group_panels() { return static_cast<int32_t>(kGroupPanels); }

const char* invariant_isa() { return kDotIsa; }

// y[M, columns of every part] = x[M, K] @ W.T for a packed weight or a stack of parts (packed_matmul.h), each part
// into its columns; x rows ldx apart, y rows ldy apart.
void invariant_packed_matmul(const PackedRef* w, const float* x, int64_t M, int64_t ldx, float* y, int64_t ldy,
                             int32_t threads) {
  stacked_matmul(w, x, M, ldx, y, ldy, threads);
}

// Causal attention of query tokens over their own rows of a token KV pool (head_dim 16, 32, 64, 96, 128 or 256, at
// most 8 query heads per KV head: invariant_attention_supports).
// q [T, H, D]; k_pool, v_pool [R, Hkv, D] of the KvDtype kv_dtype (kv_element.h); token t attends to the pool
// rows rows[row_start[t] + j], j < num_keys[t]; out [T, H, D]. The H query heads are Hkv groups of H / Hkv sharing
// one KV head. Tokens that share row_start are one sequence's; attention.h states the arithmetic, the same for
// every token in any call.
void invariant_attention(const float* q, int64_t T, int64_t H, int64_t D, const void* k_pool, const void* v_pool,
                         int32_t kv_dtype, int64_t Hkv, const int64_t* rows, const int64_t* row_start,
                         const int64_t* num_keys, float scale, float* out, int32_t threads) {
  attention(q, T, H, D, k_pool, v_pool, kv_dtype, Hkv, rows, row_start, num_keys, scale, out, threads);
}

int32_t invariant_attention_supports(int64_t head_dim, int64_t group) { return attention_supports(head_dim, group); }

// out[n] = x[n] as a KV pool of the KvDtype kv_dtype stores it (kv_element.h); 0 for an unknown type.
int32_t invariant_kv_store(const float* x, int64_t n, int32_t kv_dtype, void* out) {
  return with_kv_element(kv_dtype, [&](auto kv) {
    using KV = decltype(kv);
    KV::store(static_cast<typename KV::T*>(out), x, n);
  });
}

// out[T, N] = RMSNorm of x's rows times weight (norm_activation.h); x rows ldx apart, out rows ldo apart.
void invariant_rms_norm(const float* x, int64_t T, int64_t N, int64_t ldx, const float* weight, float eps, float* out,
                        int64_t ldo, int32_t threads) {
  rms_norm(x, T, N, ldx, weight, eps, out, ldo, threads);
}

// out[T, N] = silu(gate) * up, with gate = x[:, :N] and up = x[:, N:2N].
void invariant_silu_mul(const float* x, int64_t T, int64_t N, float* out, int32_t threads) {
  silu_mul(x, T, N, out, threads);
}

// out[T, N] = gelu_tanh(gate) * up, with gate = x[:, :N] and up = x[:, N:2N] (Gemma's MLP).
void invariant_gelu_tanh_mul(const float* x, int64_t T, int64_t N, float* out, int32_t threads) {
  gelu_tanh_mul(x, T, N, out, threads);
}

// x[T, N] = cap * tanh(x / cap) in place, rows ldx apart (Gemma's soft-capping of logits).
void invariant_softcap(float* x, int64_t T, int64_t N, int64_t ldx, float cap, int32_t threads) {
  softcap(x, T, N, ldx, cap, threads);
}

// One layer's attention block (o_proj's output into out, before the residual add), writing the batch's K and V into
// the layer's pools: out [T, hidden], or where rows is not null [count, hidden] for the tokens rows[0 .. count) alone.
void invariant_attention_block(const ModelShape* shape, const LayerRef* layer, const BatchRef* batch,
                               const float* hidden, void* k_layer, void* v_layer, const int64_t* rows, int64_t count,
                               float* out, int32_t threads) {
  attention_block(shape, layer, batch, hidden, k_layer, v_layer, rows, count, out, threads);
}

// One layer's MLP block (down's output into out, before the residual add).
void invariant_mlp_block(const ModelShape* shape, const LayerRef* layer, int64_t T, const float* hidden, float* out,
                         int32_t threads) {
  mlp_block(shape, layer, T, hidden, out, threads, nullptr);
}

// Every layer on one rank: hidden [T, hidden] in, the last layer's output out (in place); a layer's pools are
// layer_bytes apart.
void invariant_decoder(const ModelShape* shape, const LayerRef* layers, int32_t num_layers, const BatchRef* batch,
                       float* hidden, void* k_pool, void* v_pool, int64_t layer_bytes, int32_t threads) {
  decoder(shape, layers, num_layers, batch, hidden, k_pool, v_pool, layer_bytes, threads, nullptr);
}

// Warm the caches with the first weights a forward of `tokens` tokens over these layers (then lm_head, or null)
// reads, while the host prepares it (weight_warming.h); nothing for many tokens or one thread.
void invariant_warm_decoder(const LayerRef* layers, int32_t num_layers, const PackedRef* lm_head, int64_t tokens,
                            int32_t threads) {
  warm_decoder(layers, num_layers, lm_head, tokens, threads);
}

// The most bytes a warm of the caches asks for (weight_warming.h): by default half the last-level cache; 0: none.
int64_t invariant_warm_bytes() { return warm_bytes().load(); }
void invariant_set_warm_bytes(int64_t bytes) { warm_bytes().store(std::max<int64_t>(bytes, 0)); }

// invariant_decoder, then logits [num_logits, the lm_head's columns] of the output rows logit_rows: each row's RMSNorm
// by final_norm times the lm_head (a decode step's last kernels in the same call); with fewer output rows than tokens
// the last layer runs for those rows alone, and hidden's other rows stay its input; masks (null: none) the rows'
// grammar masks, int32 words ldm apart: a row that allows few panels gets those, the others -inf (masked_logits.h).
void invariant_decoder_logits(const ModelShape* shape, const LayerRef* layers, int32_t num_layers,
                              const BatchRef* batch, float* hidden, void* k_pool, void* v_pool, int64_t layer_bytes,
                              const int64_t* logit_rows, int64_t num_logits, const float* final_norm,
                              const PackedRef* lm_head, const int32_t* masks, int64_t ldm, float* logits,
                              int32_t threads) {
  decoder_logits(shape, layers, num_layers, batch, hidden, k_pool, v_pool, layer_bytes, logit_rows, num_logits,
                 final_norm, lm_head, masks, ldm, logits, threads);
}

// out[n, K] = rows ids[n] of a Q8_0 matrix (float16 scales [rows, K / 32], int8 quants [rows, K]) as float32
// (block_rows.h); 0 (out untouched) if an id is not one of its rows.
int32_t invariant_q8_0_rows(const uint16_t* scales, const int8_t* quants, int64_t rows, int64_t K, const int64_t* ids,
                            int64_t n, float* out, int32_t threads) {
  return q8_0_rows(scales, quants, rows, K, ids, n, out, threads);
}

// out[n, K] = rows ids[n] of a packed weight (one part, any format) as float32, as gguf's de-quantisation gives them
// (packed_rows.h); 0 (out untouched) if an id is not one of its rows or the weight is a stack.
int32_t invariant_packed_rows(const PackedRef* w, const int64_t* ids, int64_t n, float* out, int32_t threads) {
  return packed_rows(*w, ids, n, out, threads);
}

// Masks rows of logits [*, vocab] (float32, or a 16-bit float: element_bytes 4 or 2) in place by int32 words
// [*, num_words]: the rows rows[0..num_rows) of both, or rows 0..num_rows when rows is null (mask_logits.h).
void invariant_mask_logits(void* logits, int32_t element_bytes, uint32_t neg_inf_bits, int64_t vocab, int64_t ldl,
                           const int32_t* words, int64_t num_words, int64_t ldw, const int64_t* rows,
                           int64_t num_rows, int32_t threads) {
  mask_logits(logits, element_bytes, neg_inf_bits, vocab, ldl, words, num_words, ldw, rows, num_rows, threads);
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

// out[size * bytes]: every rank's src in rank order, through a mapping shared by the ranks of one machine
// (shm_gather.h); 0, or 1 + a rank whose process is gone.
int32_t invariant_shm_all_gather(void* region, int32_t rank, int32_t size, int64_t slot_bytes, int64_t sequence,
                                 const void* src, int64_t bytes, void* out, const int32_t* pids) {
  return shm_gather::all_gather(region, rank, size, slot_bytes, sequence, src, bytes, out, pids);
}

}  // extern "C"
