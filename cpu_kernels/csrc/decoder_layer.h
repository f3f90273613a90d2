// A decoder layer in two blocks, composed of the other kernels.
//
// The forward of one layer as transformers' models compute it, each operation one of the batch-invariant kernels or
// an elementwise step in a fixed order: the attention block returns o_proj's output, the MLP block down's, each
// before its residual add (under tensor parallelism the ranks sum those between the blocks). `decoder` runs
// every layer, residual adds included, for one rank: one call per forward instead of ~150 kernel calls from Python.
//
// What the families differ in is data, not code paths through the kernels:
// - Llama, Mistral, Qwen2 (q/k/v biases), Qwen3 (an RMSNorm of each query and key head), Phi-3 (q/k/v and gate/up
//   stored fused, which the runner packs stacked anyway; RoPE over the first rope_dim of each head);
// - SmolLM3: layers without RoPE (null tables);
// - Gemma 3: an RMSNorm of each block's output before its residual add, GELU-tanh in the MLP, and sliding-window
//   attention with RoPE tables of their own on most layers. Its norms' (1 + w) and its embedding's scale are taken
//   care of by the caller (llama.py): they are a weight and an elementwise product.

#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "attention.h"
#include "buffer.h"
#include "kv_element.h"
#include "norm_activation.h"
#include "masked_logits.h"
#include "packed_matmul.h"
#include "thread_pool.h"
#include "weight_warming.h"

namespace {

struct LayerRef {
  const float* input_norm;
  const float* post_norm;  // the MLP block's input norm
  const float* qkv_bias;   // or null
  const float* q_norm;     // per-head RMSNorm of q and k (Qwen3, Gemma 3), or null
  const float* k_norm;
  const float* attention_out_norm;  // RMSNorm of each block's output before the residual add (Gemma 3), or null
  const float* mlp_out_norm;
  const float* cos;  // [positions, rope_dim] tables, or null: a layer without RoPE (SmolLM3)
  const float* sin;
  int64_t rope_dim;  // RoPE turns the first rope_dim values of each head (all of head_dim but for Phi-3's partial)
  int64_t window;    // sliding-window attention: a token attends to at most its last `window` keys; 0: to all
  PackedRef qkv, o_proj, gate_up, down;
};

enum Activation : int32_t { kSilu = 0, kGeluTanh = 1 };

struct ModelShape {
  int64_t hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
  int32_t activation;  // Activation: of the MLP's gate
  int32_t kv_dtype;    // KvDtype: the KV pool's elements
};

struct BatchRef {
  int64_t tokens;
  const int64_t* positions;
  const int64_t* new_rows;
  const int64_t* key_rows;
  const int64_t* key_starts;
  const int64_t* num_keys;
};

int64_t stacked_out_features(const PackedRef& w) {
  int64_t width = 0;
  for (const PackedRef* part = &w; part != nullptr; part = part->next) width += part->out_features;
  return width;
}

void matmul_ref(const float* x, int64_t M, const PackedRef& w, float* y, int32_t threads) {
  stacked_matmul(&w, x, M, w.in_features, y, stacked_out_features(w), threads);
}

// RoPE in transformers' layout, in place on the first `rope_dim` values of `heads` heads of one token:
// x * cos + rotate_half(x) * sin, each product rounded, then the sum (the compiler fuses nothing:
// -ffp-contract=off); the rest of each head passes through.
void rotate(float* x, int64_t heads, int64_t head_dim, int64_t rope_dim, const float* cos, const float* sin) {
  const int64_t half = rope_dim / 2;
  float rotated[256];
  for (int64_t h = 0; h < heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t d = 0; d < half; ++d) rotated[d] = -v[d + half];
    for (int64_t d = half; d < rope_dim; ++d) rotated[d] = v[d - half];
    for (int64_t d = 0; d < rope_dim; ++d) v[d] = v[d] * cos[d] + rotated[d] * sin[d];
  }
}

// hidden += norm(block), or += block without a norm: one residual add of T rows.
void add_block(const ModelShape* shape, const float* norm, int64_t T, float* hidden, float* block, int32_t threads) {
  if (norm != nullptr)
    rms_norm(block, T, shape->hidden, shape->hidden, norm, shape->eps, block, shape->hidden, threads);
  const int64_t width = shape->hidden;
  parallel_for(T, kRowsPerClaim, threads, [&](int64_t first, int64_t last) {
    for (int64_t j = first * width; j < last * width; ++j) hidden[j] = hidden[j] + block[j];
  });
}

// The attention block's first half, for every token: RMSNorm, q/k/v, Qwen2's biases, the per-head q/k norms and RoPE;
// each token's K and V written to the pool and its q into q [T, heads x head_dim].
void project_qkv(const ModelShape* shape, const LayerRef* layer, const BatchRef* batch, const float* hidden,
                 void* k_layer, void* v_layer, float* q, int32_t threads) {
  const int64_t T = batch->tokens, D = shape->head_dim, H = shape->heads, Hkv = shape->kv_heads;
  const int64_t q_size = H * D, kv_size = Hkv * D, width = q_size + 2 * kv_size;
  Buffer<float> x(T * shape->hidden), qkv(T * width);
  rms_norm(hidden, T, shape->hidden, shape->hidden, layer->input_norm, shape->eps, x.data(), shape->hidden,
                     threads);
  matmul_ref(x.data(), T, layer->qkv, qkv.data(), threads);
  warm_weight(&layer->o_proj, T, threads);
  // tokens apart: rows apart; ~0.1 ns a value of a row (RoPE, the K/V stores): split from ~1.5 µs of it
  parallel_for(T, rows_per_claim(T, width, 16384, threads), threads, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      float* row = qkv.data() + t * width;
      if (layer->qkv_bias != nullptr)
        for (int64_t i = 0; i < width; ++i) row[i] = row[i] + layer->qkv_bias[i];
      if (layer->q_norm != nullptr) {
        rms_norm(row, H, D, D, layer->q_norm, shape->eps, row, D, 1);
        rms_norm(row + q_size, Hkv, D, D, layer->k_norm, shape->eps, row + q_size, D, 1);
      }
      if (layer->cos != nullptr) {
        const int64_t at = batch->positions[t] * layer->rope_dim;
        rotate(row, H + Hkv, D, layer->rope_dim, layer->cos + at, layer->sin + at);
      }
      memcpy(q + t * q_size, row, q_size * sizeof(float));
      with_kv_element(shape->kv_dtype, [&](auto kv) {
        using KV = decltype(kv);
        KV::store(static_cast<typename KV::T*>(k_layer) + batch->new_rows[t] * kv_size, row + q_size, kv_size);
        KV::store(static_cast<typename KV::T*>(v_layer) + batch->new_rows[t] * kv_size, row + q_size + kv_size,
                  kv_size);
      });
    }
  });
}

// The attention block's second half for T query tokens: token t's q (row t of q) over the pool rows
// key_rows[key_starts[t] .. + num_keys[t]], then o_proj into out [T, hidden].
void attend_and_project(const ModelShape* shape, const LayerRef* layer, int64_t T, const float* q,
                        const int64_t* key_rows, const int64_t* key_starts, const int64_t* num_keys,
                        const void* k_layer, const void* v_layer, float* out, int32_t threads) {
  Buffer<float> attended(T * shape->heads * shape->head_dim);
  std::vector<int64_t> window_starts, window_keys;
  if (layer->window > 0) {  // a token's last `window` keys: its rows from key_starts + skipped on
    window_starts.resize(T), window_keys.resize(T);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t skipped = std::max<int64_t>(0, num_keys[t] - layer->window);
      window_starts[t] = key_starts[t] + skipped, window_keys[t] = num_keys[t] - skipped;
    }
    key_starts = window_starts.data(), num_keys = window_keys.data();
  }
  attention(q, T, shape->heads, shape->head_dim, k_layer, v_layer, shape->kv_dtype, shape->kv_heads, key_rows,
            key_starts, num_keys, shape->scale, attended.data(), threads);
  matmul_ref(attended.data(), T, layer->o_proj, out, threads);
  warm_weight(&layer->gate_up, T, threads);
}

// The attention block over every token, or where `rows` is not null over the `count` tokens rows[0 .. count) alone
// (every token's K and V still written: later tokens attend to them): o_proj's output [T or count, hidden] into out.
// Each kernel computes a row alone, so a token's output is the same bits either way.
void attention_block(const ModelShape* shape, const LayerRef* layer, const BatchRef* batch, const float* hidden,
                     void* k_layer, void* v_layer, const int64_t* rows, int64_t count, float* out, int32_t threads) {
  const int64_t q_size = shape->heads * shape->head_dim;
  Buffer<float> q(batch->tokens * q_size);
  project_qkv(shape, layer, batch, hidden, k_layer, v_layer, q.data(), threads);
  if (rows == nullptr)
    return attend_and_project(shape, layer, batch->tokens, q.data(), batch->key_rows, batch->key_starts,
                              batch->num_keys, k_layer, v_layer, out, threads);
  Buffer<float> selected(count * q_size);
  std::vector<int64_t> key_starts(count), num_keys(count);
  for (int64_t i = 0; i < count; ++i) {
    memcpy(selected.data() + i * q_size, q.data() + rows[i] * q_size, q_size * sizeof(float));
    key_starts[i] = batch->key_starts[rows[i]], num_keys[i] = batch->num_keys[rows[i]];
  }
  attend_and_project(shape, layer, count, selected.data(), batch->key_rows, key_starts.data(), num_keys.data(),
                     k_layer, v_layer, out, threads);
}

// `next`: the weight read after this block (the next layer's q/k/v, the lm_head), warmed meanwhile; or null.
void mlp_block(const ModelShape* shape, const LayerRef* layer, int64_t T, const float* hidden, float* out,
               int32_t threads, const PackedRef* next) {
  const int64_t inter = stacked_out_features(layer->gate_up) / 2;
  Buffer<float> x(T * shape->hidden), gate_up(T * 2 * inter), mlp(T * inter);
  rms_norm(hidden, T, shape->hidden, shape->hidden, layer->post_norm, shape->eps, x.data(), shape->hidden,
                     threads);
  matmul_ref(x.data(), T, layer->gate_up, gate_up.data(), threads);
  warm_weight(&layer->down, T, threads);
  if (shape->activation == kGeluTanh)
    gelu_tanh_mul(gate_up.data(), T, inter, mlp.data(), threads);
  else
    silu_mul(gate_up.data(), T, inter, mlp.data(), threads);
  matmul_ref(mlp.data(), T, layer->down, out, threads);
  warm_weight(next, T, threads);
}

// One layer, its blocks' outputs added to residual [count, hidden]: for every token (rows null; residual is hidden,
// in place) or for the tokens rows[0 .. count) alone (residual holds their rows of hidden), every token's K and V
// written either way. `block` holds count x hidden floats; `next` is mlp_block's.
void decoder_layer(const ModelShape* shape, const LayerRef* layer, const BatchRef* batch, const float* hidden,
                   void* k_layer, void* v_layer, const int64_t* rows, int64_t count, float* residual, float* block,
                   int32_t threads, const PackedRef* next) {
  attention_block(shape, layer, batch, hidden, k_layer, v_layer, rows, count, block, threads);
  add_block(shape, layer->attention_out_norm, count, residual, block, threads);
  mlp_block(shape, layer, count, residual, block, threads, next);
  add_block(shape, layer->mlp_out_norm, count, residual, block, threads);
}

// Every layer on one rank: hidden [T, hidden] in, the last layer's output out (in place); a layer's pools are
// layer_bytes apart. `after`: the weight read after the last layer (the lm_head), warmed meanwhile; or null.
void decoder(const ModelShape* shape, const LayerRef* layers, int32_t num_layers, const BatchRef* batch,
             float* hidden, void* k_pool, void* v_pool, int64_t layer_bytes, int32_t threads, const PackedRef* after) {
  Buffer<float> block(batch->tokens * shape->hidden);
  for (int32_t i = 0; i < num_layers; ++i)
    decoder_layer(shape, &layers[i], batch, hidden, static_cast<char*>(k_pool) + i * layer_bytes,
                  static_cast<char*>(v_pool) + i * layer_bytes, nullptr, batch->tokens, hidden, block.data(), threads,
                  i + 1 < num_layers ? &layers[i + 1].qkv : after);
}

// Warm a forward's first weights in the order it reads them (weight_warming.h), for a forward of `tokens` tokens
// to come: called before the host's work that prepares it.
void warm_decoder(const LayerRef* layers, int32_t num_layers, const PackedRef* lm_head, int64_t tokens,
                  int32_t threads) {
  std::vector<const PackedRef*> weights;
  for (int32_t i = 0; i < num_layers; ++i)
    for (const PackedRef* w : {&layers[i].qkv, &layers[i].o_proj, &layers[i].gate_up, &layers[i].down})
      weights.push_back(w);
  if (lm_head != nullptr) weights.push_back(lm_head);
  warm_weights(weights.data(), static_cast<int>(weights.size()), tokens, threads);
}

// One layer for the output rows `rows` [count] alone, into out [count, hidden] (from hidden's rows), every token's K
// and V written. A prefill's last layer then costs its q/k/v step and one token's rest, as llama.cpp computes it.
void output_rows_layer(const ModelShape* shape, const LayerRef* layer, const BatchRef* batch, const float* hidden,
                       void* k_layer, void* v_layer, const int64_t* rows, int64_t count, float* out, int32_t threads,
                       const PackedRef* after) {
  const int64_t width = shape->hidden;
  Buffer<float> block(count * width);
  for (int64_t i = 0; i < count; ++i) memcpy(out + i * width, hidden + rows[i] * width, width * sizeof(float));
  decoder_layer(shape, layer, batch, hidden, k_layer, v_layer, rows, count, out, block.data(), threads, after);
}

// `decoder`, then the logits of the output rows `logit_rows` [num_logits]: each row's RMSNorm by `final_norm`, times
// the lm_head, into logits [num_logits, the lm_head's columns]. The same kernels as composing them from Python. Where
// fewer rows than tokens give logits (a prefill: one a sequence), the last layer runs for those rows alone
// (output_rows_layer), and `hidden` keeps the other rows' input to it. Where `masks` is not null, row i's grammar
// mask (int32 words masks + i * ldm) lets the lm_head skip the panels it disallows (masked_logits.h).
void decoder_logits(const ModelShape* shape, const LayerRef* layers, int32_t num_layers, const BatchRef* batch,
                    float* hidden, void* k_pool, void* v_pool, int64_t layer_bytes, const int64_t* logit_rows,
                    int64_t num_logits, const float* final_norm, const PackedRef* lm_head, const int32_t* masks,
                    int64_t ldm, float* logits, int32_t threads) {
  const int64_t width = shape->hidden;
  Buffer<float> selected(num_logits * width), normed(num_logits * width);
  if (num_layers > 0 && num_logits < batch->tokens) {
    const int64_t last = num_layers - 1;
    decoder(shape, layers, last, batch, hidden, k_pool, v_pool, layer_bytes, threads, &layers[last].qkv);
    output_rows_layer(shape, &layers[last], batch, hidden, static_cast<char*>(k_pool) + last * layer_bytes,
                      static_cast<char*>(v_pool) + last * layer_bytes, logit_rows, num_logits, selected.data(),
                      threads, lm_head);
  } else {
    decoder(shape, layers, num_layers, batch, hidden, k_pool, v_pool, layer_bytes, threads, lm_head);
    for (int64_t i = 0; i < num_logits; ++i)
      memcpy(selected.data() + i * width, hidden + logit_rows[i] * width, width * sizeof(float));
  }
  rms_norm(selected.data(), num_logits, width, width, final_norm, shape->eps, normed.data(), width, threads);
  masked_logits(*lm_head, normed.data(), num_logits, masks, ldm, logits, threads);
}

}  // namespace
