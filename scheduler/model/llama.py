"""A Llama forward in plain torch, shaped for serving: packed new tokens of several sequences over a KV pool.

It computes what transformers' ``LlamaForCausalLM`` computes (RMSNorm, RoPE from the config's rope
parameters, grouped-query attention, SwiGLU, tied or separate lm_head; Qwen2's q/k/v biases), but takes a
flat batch of new tokens, writes their K/V into the rows of a token pool, attends over each sequence's rows, and
returns logits for the last new token of each sequence (or, for verifying drafts, after every new token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from scheduler.model.kv_pool import PADDING_ROW, TokenKVPool


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
    # Decode (one new token per sequence): every sequence's rows padded to the longest, [S, L], and
    # [S, 1, 1, L] True where a position may be attended. Otherwise each sequence's rows and its causal mask
    # [n_i, starts[i] + n_i] (None where plain is_causal suffices).
    decode_rows: torch.Tensor | None
    decode_mask: torch.Tensor | None
    extend_rows: list[torch.Tensor]
    extend_masks: list[torch.Tensor | None]

    @classmethod
    def build(
        cls,
        rows: Sequence[Sequence[int]],
        starts: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        device: torch.device,
        all_logits: bool = False,
    ) -> ForwardBatch:
        """``all_logits``: logits after every new token (speculative verification), not only each sequence's last."""
        offsets = [0]
        for tokens in token_lists:
            offsets.append(offsets[-1] + len(tokens))
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        positions = [start + j for start, tokens in zip(starts, token_lists, strict=True) for j in range(len(tokens))]
        new_rows = [row for seq_rows, start in zip(rows, starts, strict=True) for row in seq_rows[start:]]
        decode_rows = decode_mask = None
        extend_rows: list[torch.Tensor] = []
        extend_masks: list[torch.Tensor | None] = []
        if all(len(tokens) == 1 for tokens in token_lists):
            width = max(len(seq_rows) for seq_rows in rows)
            padded = [list(seq_rows) + [PADDING_ROW] * (width - len(seq_rows)) for seq_rows in rows]
            decode_rows = as_tensor(padded)
            lengths = as_tensor([len(seq_rows) for seq_rows in rows])
            decode_mask = (torch.arange(width, device=device)[None, :] < lengths[:, None])[:, None, None, :]
        else:
            for seq_rows, start, tokens in zip(rows, starts, token_lists, strict=True):
                extend_rows.append(as_tensor(list(seq_rows)))
                query_positions = torch.arange(start, start + len(tokens), device=device)
                key_positions = torch.arange(start + len(tokens), device=device)
                extend_masks.append(None if start == 0 else key_positions[None, :] <= query_positions[:, None])
        logit_indices = range(offsets[-1]) if all_logits else [end - 1 for end in offsets[1:]]
        return cls(
            input_ids=as_tensor([token for tokens in token_lists for token in tokens]),
            positions=as_tensor(positions),
            new_rows=as_tensor(new_rows),
            logit_indices=as_tensor(list(logit_indices)),
            offsets=offsets,
            starts=list(starts),
            decode_rows=decode_rows,
            decode_mask=decode_mask,
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
    ) -> None:
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_dim: int = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
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

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: TokenKVPool) -> torch.Tensor:
        """Write the batch's K/V into ``pool`` and return float32 logits ``[len(batch.logit_indices), vocab]``.

        Row ``j`` holds the next-token logits after packed token ``batch.logit_indices[j]``.
        """
        num_tokens = batch.input_ids.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        cos = self.cos[batch.positions][:, None, :]
        sin = self.sin[batch.positions][:, None, :]
        hidden = F.embedding(batch.input_ids, self.embed)
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
            if batch.decode_rows is not None and batch.decode_mask is not None:
                attention = self._decode_attention(q, pool.k[i], pool.v[i], batch.decode_rows, batch.decode_mask)
            else:
                attention = self._extend_attention(q, pool.k[i], pool.v[i], batch)
            hidden = hidden + self._matmul(attention, layer.o_proj)
            x = F.rms_norm(hidden, hidden.shape[-1:], layer.post_norm, self.eps)
            gate, up = self._matmul(x, layer.gate_up).chunk(2, dim=-1)
            hidden = hidden + self._matmul(F.silu(gate) * up, layer.down)
        selected = F.rms_norm(hidden[batch.logit_indices], hidden.shape[-1:], self.norm, self.eps)
        return F.linear(selected, self.lm_head).float()

    def _matmul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` in the weight's dtype, returned in the activations' dtype."""
        if weight.dtype == x.dtype:
            return F.linear(x, weight)
        return F.linear(x.to(weight.dtype), weight).to(x.dtype)

    def _decode_attention(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """One query token per sequence: ``q`` [S, H, D] -> [S, H * D], over each sequence's gathered rows."""
        num_seqs = rows.shape[0]
        # The group of query heads sharing one KV head acts as that head's queries: no K/V repetition.
        grouped = q.view(num_seqs, self.num_kv_heads, -1, self.head_dim)
        keys = k_pool[rows].transpose(1, 2)  # [S, H_kv, L, D]
        values = v_pool[rows].transpose(1, 2)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
        return out.reshape(num_seqs, -1)

    def _extend_attention(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Several new tokens per sequence: ``q`` [T, H, D] -> [T, H * D], causal over each sequence's rows."""
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        for rows, lo, hi, mask in zip(
            batch.extend_rows, batch.offsets[:-1], batch.offsets[1:], batch.extend_masks, strict=True
        ):
            seq_q = q[lo:hi].transpose(0, 1)[None]
            keys, values = k_pool[rows].transpose(0, 1)[None], v_pool[rows].transpose(0, 1)[None]
            seq_out = F.scaled_dot_product_attention(
                seq_q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
            out[lo:hi] = seq_out[0].transpose(0, 1).reshape(hi - lo, -1)
        return out


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
