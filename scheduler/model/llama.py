"""A Llama forward in plain torch, shaped for serving: packed new tokens of several sequences over a KV pool.

It computes what transformers' ``LlamaForCausalLM`` computes (RMSNorm, RoPE from the config's rope
parameters, grouped-query attention, SwiGLU, tied or separate lm_head; Qwen2's q/k/v biases), but takes a
flat batch of new tokens, writes their K/V into the rows of a token pool, attends over each sequence's rows, and
returns logits for the last new token of each sequence (or, for verifying drafts, after every new token).

Decode and verification are batch-invariant: a token's logits are bit for bit the same whatever else shares its
forward (other sequences, their lengths, the drafts after it), so batching and speculative decoding never change a
greedy output. Measured with this torch's MKL on CPU: a float32 matmul row's rounding depends on the row count (one
row, two or three, and the rows past the last multiple of four each take another kernel), so matmul inputs are
padded to a multiple of ``MATMUL_ROW_MULTIPLE`` rows. Attention runs per query token, as products of
``[query heads of one KV group, head_dim]`` with that token's contiguous keys, padded to the batch's widest rounded
up to ``KEY_WIDTH_MULTIPLE``; with at most ``MAX_QUERY_ROWS`` rows these gave the same values for any padding and
batch size (SDPA's blocked kernel does not). Long prompts take SDPA per sequence instead: a prefill's rounding
depends on where its cached prefix ended, as in SGLang without deterministic inference. The path is chosen per
sequence, so a short sequence's logits never depend on a long prompt sharing its forward.

Under tensor parallelism (``scheduler.model.tensor_parallel``) a model holds one rank's shard: its KV groups, its
slice of the MLP and of the vocabulary. Each shard's matmuls and attention keep the properties above; the forward
then runs collectives, so every rank of the group must run the same batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from scheduler.model.kv_pool import PADDING_ROW, TokenKVPool
from scheduler.model.tensor_parallel import ShardPlan, TensorParallelGroup

MATMUL_ROW_MULTIPLE = 4
"""Matmul inputs are padded with zero rows to a multiple of this: then MKL's float32 rows never change."""
MAX_QUERY_ROWS = 3
"""Query heads per attention product; larger KV groups are split (their keys repeated) to stay within it."""
KEY_WIDTH_MULTIPLE = 4
"""Token-wise key widths are padded to a multiple of this: MKL computes a product's last partial group of four
columns another way, so a score would otherwise change with the padding."""
TOKENWISE_MAX_NEW_TOKENS = 32
"""Sequences with at most this many new tokens (decode, jump-forward, draft verification) attend token by token."""


@dataclass(frozen=True)
class ForwardBatch:
    """New tokens of several sequences, packed: sequence ``i`` owns ``input_ids[offsets[i]:offsets[i + 1]]``.

    Sequence ``i`` has ``starts[i]`` tokens cached before these; ``rows[i]`` lists the KV pool rows of all its
    tokens, cached and new (the new ones' K/V are written there). Tensors are int64 on the model's device.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    new_rows: torch.Tensor  # [T]: the pool row each new token's K/V goes to
    logit_indices: torch.Tensor  # packed positions whose next-token logits are returned
    offsets: list[int]  # S + 1 entries
    starts: list[int]
    # Sequences with at most TOKENWISE_MAX_NEW_TOKENS new tokens attend token by token: per such token, its
    # sequence's rows padded to the longest of them, [t, L], and [t, 1, 1, L] True where that token may attend (its
    # causal prefix). token_indices: their packed positions, None when every token of the batch is one of them.
    token_rows: torch.Tensor | None
    token_mask: torch.Tensor | None
    token_indices: torch.Tensor | None
    # The other sequences, by SDPA: each one's first sequence index, its rows and its causal mask [n_i, starts[i] +
    # n_i] (None where is_causal suffices).
    extend_sequences: list[int]
    extend_rows: list[torch.Tensor]
    extend_masks: list[torch.Tensor | None]

    @classmethod
    def build(
        cls,
        rows: Sequence[Sequence[int]],
        starts: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        device: torch.device,
        num_logits: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """``num_logits[i]``: how many of sequence ``i``'s last new tokens get next-token logits (default 1; more to
        verify drafts)."""
        offsets = [0]
        for tokens in token_lists:
            offsets.append(offsets[-1] + len(tokens))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        positions = [start + j for start, tokens in zip(starts, token_lists, strict=True) for j in range(len(tokens))]
        new_rows = [row for seq_rows, start in zip(rows, starts, strict=True) for row in seq_rows[start:]]
        tokenwise = [i for i, tokens in enumerate(token_lists) if len(tokens) <= TOKENWISE_MAX_NEW_TOKENS]
        extend_sequences = [i for i, tokens in enumerate(token_lists) if len(tokens) > TOKENWISE_MAX_NEW_TOKENS]
        token_rows = token_mask = token_indices = None
        if tokenwise:
            width = -(-max(len(rows[i]) for i in tokenwise) // KEY_WIDTH_MULTIPLE) * KEY_WIDTH_MULTIPLE
            padded = [list(rows[i]) + [PADDING_ROW] * (width - len(rows[i])) for i in tokenwise]
            token_rows = as_tensor(padded).repeat_interleave(as_tensor([len(token_lists[i]) for i in tokenwise]), dim=0)
            packed = [j for i in tokenwise for j in range(offsets[i], offsets[i + 1])]
            visible = as_tensor([positions[j] for j in packed]) + 1
            token_mask = (torch.arange(width, device=device)[None, :] < visible[:, None])[:, None, None, :]
            token_indices = as_tensor(packed) if extend_sequences else None
        extend_rows: list[torch.Tensor] = []
        extend_masks: list[torch.Tensor | None] = []
        for i in extend_sequences:
            extend_rows.append(as_tensor(list(rows[i])))
            query_positions = torch.arange(starts[i], starts[i] + len(token_lists[i]), device=device)
            key_positions = torch.arange(starts[i] + len(token_lists[i]), device=device)
            extend_masks.append(None if starts[i] == 0 else key_positions[None, :] <= query_positions[:, None])
        counts = num_logits if num_logits is not None else [1] * len(token_lists)
        logit_indices = [i for end, count in zip(offsets[1:], counts, strict=True) for i in range(end - count, end)]
        return cls(
            input_ids=as_tensor([token for tokens in token_lists for token in tokens]),
            positions=as_tensor(positions),
            new_rows=as_tensor(new_rows),
            logit_indices=as_tensor(logit_indices),
            offsets=offsets,
            starts=list(starts),
            token_rows=token_rows,
            token_mask=token_mask,
            token_indices=token_indices,
            extend_sequences=extend_sequences,
            extend_rows=extend_rows,
            extend_masks=extend_masks,
        )


@dataclass(frozen=True)
class _Layer:
    """One decoder layer; its four matmul weights may be stored in a narrower dtype than its activations."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: one matmul instead of three
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up projections stacked
    down: torch.Tensor


class LlamaModel:
    """Llama-style decoder weights on one device, run by ``forward`` over a ``TokenKVPool``.

    ``weights`` hold the slices ``shard`` names (all of each tensor on a single rank); ``num_heads`` and
    ``num_kv_heads`` count this rank's heads, the pool it runs over holds only those KV heads. ``tp`` runs the
    collectives that join the shards (none on a single rank).

    Activations, norms, attention, the KV pool, the embedding and the lm_head are in ``dtype``; the decoder
    layers' matmul weights (nine tenths of the bytes a decode step streams) in ``matmul_dtype``. Decode is bound
    by memory bandwidth, so halving those bytes speeds it up; the lm_head stays in ``dtype`` because a matmul's
    output has its inputs' dtype, and bfloat16 logits would tie where float32 ones do not.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        weights: dict[str, torch.Tensor],
        max_positions: int,
        device: torch.device,
        dtype: torch.dtype,
        matmul_dtype: torch.dtype | None = None,
        shard: ShardPlan | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        self.shard = shard or ShardPlan.build(config)
        self.tp = tp or TensorParallelGroup()
        if self.tp.size != self.shard.size:
            raise ValueError(f"a shard of {self.shard.size} ranks cannot run in a group of {self.tp.size}")
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = self.shard.num_heads
        self.num_kv_heads: int = self.shard.num_kv_heads
        self.head_dim: int = self.shard.head_dim
        self.vocab_size: int = config.vocab_size
        self.eps: float = config.rms_norm_eps
        self.device = device

        self.dtype = dtype
        self.matmul_dtype = matmul_dtype or dtype

        def weight(name: str, as_dtype: torch.dtype = dtype) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"the checkpoint lacks {name!r}; is it a Llama-style causal LM?")
            return weights[name].to(device=device, dtype=as_dtype)

        def stacked(names: Sequence[str], as_dtype: torch.dtype = self.matmul_dtype) -> torch.Tensor:
            return torch.cat([weight(name, as_dtype) for name in names])

        self.embed = weight("model.embed_tokens.weight")
        if self.embed.shape[0] != self.shard.vocab[1] - self.shard.vocab[0]:
            raise ValueError(f"the embedding has {self.embed.shape[0]} rows, not those of the shard {self.shard}")
        self.norm = weight("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else weight("lm_head.weight")
        self.layers = []
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            qkv_names = [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]
            bias_names = [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
            self.layers.append(
                _Layer(
                    input_norm=weight(f"{p}input_layernorm.weight"),
                    qkv=stacked(qkv_names),
                    qkv_bias=stacked(bias_names, dtype) if bias_names[0] in weights else None,
                    o_proj=weight(f"{p}self_attn.o_proj.weight", self.matmul_dtype),
                    post_norm=weight(f"{p}post_attention_layernorm.weight"),
                    gate_up=stacked([f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]),
                    down=weight(f"{p}mlp.down_proj.weight", self.matmul_dtype),
                )
            )
        self.cos, self.sin = _rope_tables(config, self.head_dim, max_positions, device, dtype)

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of the weights this rank holds (a tied lm_head counted once)."""
        tensors = [self.embed, self.norm, self.lm_head]
        for layer in self.layers:
            tensors += [layer.input_norm, layer.qkv, layer.o_proj, layer.post_norm, layer.gate_up, layer.down]
            tensors += [layer.qkv_bias] if layer.qkv_bias is not None else []
        unique = {id(t): t for t in tensors}
        return sum(t.numel() * t.element_size() for t in unique.values())

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: TokenKVPool) -> torch.Tensor:
        """Write the batch's K/V into ``pool`` and return float32 logits ``[len(batch.logit_indices), vocab]``.

        Row ``j`` holds the next-token logits after packed token ``batch.logit_indices[j]``.
        """
        num_tokens = batch.input_ids.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        cos = self.cos[batch.positions][:, None, :]
        sin = self.sin[batch.positions][:, None, :]
        hidden = self._embed(batch.input_ids)
        for i, layer in enumerate(self.layers):
            x = F.rms_norm(hidden, hidden.shape[-1:], layer.input_norm, self.eps)
            qkv = self._matmul(x, layer.qkv)
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
            # q and k heads are rotated together: one RoPE call per layer.
            qk = _rotate(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            pool.k[i][batch.new_rows] = k
            pool.v[i][batch.new_rows] = v.view(num_tokens, self.num_kv_heads, -1)
            attention = self._attention(q, pool.k[i], pool.v[i], batch)
            hidden = hidden + self.tp.all_reduce(self._matmul(attention, layer.o_proj))
            x = F.rms_norm(hidden, hidden.shape[-1:], layer.post_norm, self.eps)
            gate, up = self._matmul(x, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + self.tp.all_reduce(self._matmul(F.silu(gate) * up, layer.down))
        selected = F.rms_norm(hidden[batch.logit_indices], hidden.shape[-1:], self.norm, self.eps)
        return self.tp.gather_columns(self._matmul(selected, self.lm_head).float(), self.shard.vocab_widths)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids`` ``[T, hidden]``: on several ranks each looks up the ids of its vocabulary
        slice, zeros for the others, and the sum over ranks (exact: one term is not zero) is every row."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.embed)
        start, stop = self.shard.vocab
        is_local = (input_ids >= start) & (input_ids < stop)
        hidden = F.embedding(torch.where(is_local, input_ids - start, 0), self.embed)
        return self.tp.all_reduce(hidden.masked_fill_(~is_local[:, None], 0.0))

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` in the weight's dtype, returned in the activations' dtype; batch-invariant rows."""
        rows = x.shape[0]
        if rows % MATMUL_ROW_MULTIPLE:
            x = torch.cat([x, x.new_zeros(MATMUL_ROW_MULTIPLE - rows % MATMUL_ROW_MULTIPLE, x.shape[1])])
        out = F.linear(x, weight) if weight.dtype == x.dtype else F.linear(x.to(weight.dtype), weight).to(x.dtype)
        return out[:rows]

    def _attention(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """``q`` [T, H, D] -> [T, H * D]: token by token for short sequences, by SDPA for the others."""
        if batch.token_rows is not None and batch.token_mask is not None and batch.token_indices is None:
            return self._tokenwise_attention(q, k_pool, v_pool, batch.token_rows, batch.token_mask)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        if batch.token_rows is not None and batch.token_mask is not None and batch.token_indices is not None:
            out[batch.token_indices] = self._tokenwise_attention(
                q[batch.token_indices], k_pool, v_pool, batch.token_rows, batch.token_mask
            )
        self._extend_attention(q, k_pool, v_pool, batch, out)
        return out

    def _tokenwise_attention(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Each query token over its own gathered rows: ``q`` [T, H, D] -> [T, H * D].

        The query heads sharing one KV head are one product's rows (no K/V repetition while there are at most
        ``MAX_QUERY_ROWS`` of them); the math is spelled out so that padding and batch size never reorder a sum.
        """
        num_tokens = rows.shape[0]
        group = self.num_heads // self.num_kv_heads
        query_rows = max(n for n in range(1, MAX_QUERY_ROWS + 1) if group % n == 0)
        keys = k_pool[rows].transpose(1, 2).contiguous()  # [T, H_kv, L, D]: strided keys change the kernel too
        values = v_pool[rows].transpose(1, 2).contiguous()
        if query_rows < group:
            keys = keys.repeat_interleave(group // query_rows, dim=1)
            values = values.repeat_interleave(group // query_rows, dim=1)
        grouped = q.reshape(num_tokens, -1, query_rows, self.head_dim)
        scores = torch.matmul(grouped, keys.transpose(-1, -2)) * self.head_dim**-0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.matmul(probs, values).reshape(num_tokens, -1)

    def _extend_attention(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch, out: torch.Tensor
    ) -> None:
        """Sequences with many new tokens: their rows of ``out`` [T, H * D], causal over each sequence's rows."""
        for seq, rows, mask in zip(batch.extend_sequences, batch.extend_rows, batch.extend_masks, strict=True):
            lo, hi = batch.offsets[seq], batch.offsets[seq + 1]
            seq_q = q[lo:hi].transpose(0, 1)[None]
            keys, values = k_pool[rows].transpose(0, 1)[None], v_pool[rows].transpose(0, 1)[None]
            seq_out = F.scaled_dot_product_attention(
                seq_q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
            out[lo:hi] = seq_out[0].transpose(0, 1).reshape(hi - lo, -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' layout: the two halves of each head are the rotated pairs."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope_tables(
    config: PretrainedConfig, head_dim: int, max_positions: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_positions, head_dim]``, computed in float32 as transformers does."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        inv_freq, scaling = 1.0 / (config.rope_parameters["rope_theta"] ** exponents), 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(device, dtype), (angles.sin() * scaling).to(device, dtype)
