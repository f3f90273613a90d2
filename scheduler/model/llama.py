"""A Llama forward for serving: packed new tokens of several sequences over a KV pool, on the CPU.

It computes what transformers' ``LlamaForCausalLM`` computes (RMSNorm, RoPE from the config's rope
parameters, grouped-query attention, SwiGLU, tied or separate lm_head; Qwen2's q/k/v biases; Qwen3's RMSNorm of
each query and key head before RoPE), and what the other families add (``scheduler.model.architecture``: Phi-3,
SmolLM3, Gemma 3), but takes a
flat batch of new tokens, writes their K/V into the rows of a token pool, attends over each sequence's rows, and
returns logits for the last new token of each sequence (or, for verifying drafts, after every new token).

The forward is batch-invariant by construction: its matmuls, attention, RMSNorm and SiLU run on
``cpu_kernels``, whose every output element is one fixed sequence of float operations over its own
inputs, and the rest (embedding, RoPE, residual adds, biases) are elementwise. So a token's logits are bit for bit
the same whatever else shares its forward (other sequences, their lengths, the drafts after it, a long prompt),
however many threads run it, on any CPU, and whether its prompt was computed in one piece or resumed after a cached
prefix: batching, prefix reuse and speculative decoding never change a greedy output.

Under tensor parallelism (``scheduler.model.tensor_parallel``) a model holds one rank's shard: its KV groups, its
slice of the MLP and of the vocabulary. Each shard's operations keep the properties above, and the collectives add
the ranks' partial sums in rank order; every rank of the group must run the same batches.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy
import torch
import torch.nn.functional as F
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from cpu_kernels import library, ops, packed_weights
from cpu_kernels.decoder import Decoder, DecoderBatch, DecoderLayer, Head, Rope, mask_covers
from cpu_kernels.packed_weights import MatmulWeight, PackedWeight, WeightStack
from scheduler.model import architecture
from scheduler.model.gguf_blocks import AS_Q8_0, BlockQuantized, as_q8_0, stack_blocks
from scheduler.model.kv_pool import TokenKVPool
from scheduler.model.tensor_parallel import ShardPlan, TensorParallelGroup


@dataclass(frozen=True)
class ForwardBatch:
    """New tokens of several sequences, packed: sequence ``i`` owns ``input_ids[offsets[i]:offsets[i + 1]]``.

    Sequence ``i`` has ``starts[i]`` tokens cached before these; its KV pool rows, cached and new, are
    ``key_rows[row_starts[i]:row_starts[i] + starts[i] + n_i]`` (the new ones' K/V are written there). A new token
    at position ``p`` attends to the first ``p + 1`` of its sequence's rows. Tensors are int64 on the CPU.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    new_rows: torch.Tensor  # [T]: the pool row each new token's K/V goes to
    logit_indices: torch.Tensor  # packed positions whose next-token logits are returned
    key_rows: torch.Tensor  # every sequence's rows, one after another
    key_starts: torch.Tensor  # [T]: where each token's sequence begins in key_rows
    num_keys: torch.Tensor  # [T]: the rows each token attends to (its position + 1)
    offsets: list[int]  # S + 1 entries
    starts: list[int]

    @classmethod
    def build(
        cls,
        rows: Sequence[Sequence[int] | torch.Tensor],
        starts: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        num_logits: Sequence[int] | None = None,
    ) -> ForwardBatch:
        """``rows[i]``: sequence ``i``'s pool rows, cached and new (a list, or an int64 tensor the caller keeps between
        forwards: ``KVSequence.row_tensor``); ``num_logits[i]``: how many of its last new tokens get next-token logits
        (default 1; more to verify drafts)."""
        offsets = [0]
        for tokens in token_lists:
            offsets.append(offsets[-1] + len(tokens))
        row_starts = [0]
        for seq_rows in rows:
            row_starts.append(row_starts[-1] + len(seq_rows))
        token_positions = [
            start + j for start, tokens in zip(starts, token_lists, strict=True) for j in range(len(tokens))
        ]
        counts = num_logits if num_logits is not None else [1] * len(token_lists)
        columns = (
            [token for tokens in token_lists for token in tokens],
            token_positions,
            [i for end, count in zip(offsets[1:], counts, strict=True) for i in range(end - count, end)],
            [row_starts[i] for i, tokens in enumerate(token_lists) for _ in tokens],
            [position + 1 for position in token_positions],
        )
        # NumPy from the lists to the kernels, torch only wrapping its arrays: after a decode step has streamed the
        # weights through the caches, each torch op on these few values cost 10-30 µs (with the kept rows' copy,
        # 0.38 -> 0.24 ms of a ~6 ms step on a Q4_K_M file; AMD EPYC)
        flat = numpy.array(list(itertools.chain.from_iterable(columns)), dtype=numpy.int64)
        ends = itertools.accumulate(len(column) for column in columns)
        ids, positions, logit_indices, key_starts, num_keys = (
            flat[end - len(column) : end] for end, column in zip(ends, columns, strict=True)
        )
        # a sequence's kept row tensor as it is, several joined once in C (a long list's conversion every step
        # cost ~0.1 ms at 1,600 rows); a new token's row is its sequence's at its position
        if not rows:
            key_rows = torch.empty(0, dtype=torch.long)
        elif len(rows) == 1:
            key_rows = torch.as_tensor(rows[0], dtype=torch.long)
        else:
            key_rows = torch.cat([torch.as_tensor(seq_rows, dtype=torch.long) for seq_rows in rows])
        new_rows = key_rows.numpy()[key_starts + positions]
        wrap = torch.from_numpy
        return cls(
            wrap(ids), wrap(positions), wrap(new_rows), wrap(logit_indices), key_rows, wrap(key_starts), wrap(num_keys),
            offsets, list(starts),
        )  # fmt: skip


class LlamaModel:
    """Llama-style decoder weights, run by ``forward`` over a ``TokenKVPool`` on the CPU.

    ``weights`` hold the slices ``shard`` names (all of each tensor on a single rank); ``num_heads`` and
    ``num_kv_heads`` count this rank's heads, the pool it runs over holds only those KV heads. ``tp`` runs the
    collectives that join the shards (none on a single rank).

    Activations, norms, attention, the KV pool and the logits are float32. The matmul weights (decoder layers and
    lm_head, nearly all the bytes a decode step streams) are packed as they come: GGUF blocks as blocks (Q8_0,
    Q4_1: about 0.6 bytes a weight), float tensors in ``matmul_dtype`` (float32 or bfloat16); decode is bound by
    memory bandwidth, so fewer bytes make it faster. A tied embedding (the lm_head's weights) is looked up from the
    lm_head's panels, so that the matrix is held once; another block-quantised one from its blocks.
    The kernels (``cpu_kernels.library.load``) must be loaded first.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        weights: Mapping[str, torch.Tensor | BlockQuantized],
        max_positions: int,
        matmul_dtype: torch.dtype = torch.float32,
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
        self.matmul_dtype = matmul_dtype
        self.architecture = arch = architecture.of(config)
        weights = unfused(weights, config, self.shard)

        def stored(name: str) -> torch.Tensor | BlockQuantized:
            if name not in weights:
                raise ValueError(f"the checkpoint lacks {name!r}; is it a {arch.model_type} causal LM?")
            return weights[name]

        def weight(name: str) -> torch.Tensor:
            value = stored(name)
            return value.dequantize() if isinstance(value, BlockQuantized) else value.to(torch.float32).contiguous()

        def norm(name: str) -> torch.Tensor:  # Gemma's 1 + w, in float32 as transformers adds it
            return weight(name) + arch.norm_offset if arch.norm_offset else weight(name)

        def packed(*names: str, dtype: torch.dtype = matmul_dtype) -> MatmulWeight:
            return pack_weight([stored(name) for name in names], dtype)

        self.norm = norm("model.norm.weight")
        lm_head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        # float32 logits from float32 weights: bfloat16's rounding would tie logits that float32 keeps apart
        self.lm_head = packed(lm_head, dtype=torch.float32)
        # A tied embedding is looked up from the head's panels (ops.packed_rows): held once.
        self.embed: torch.Tensor | BlockQuantized | None = None
        embed_rows = self.lm_head.out_features
        if not (config.tie_word_embeddings and isinstance(self.lm_head, PackedWeight)):
            embed = stored("model.embed_tokens.weight")
            self.embed = embed if isinstance(embed, BlockQuantized) else weight("model.embed_tokens.weight")
            embed_rows = self.embed.shape[0]
        if embed_rows != self.shard.vocab[1] - self.shard.vocab[0]:
            raise ValueError(f"the embedding has {embed_rows} rows, not those of the shard {self.shard}")
        ropes = {
            key: Rope(*_rope_tables(config, self.head_dim, max_positions, None if key == "default" else key))
            for key in {plan.rope for plan in arch.layers if plan.rope is not None}
        }
        # Gemma 3 names its MLP's input norm pre_feedforward_layernorm, and its attention output's norm
        # post_attention_layernorm (Llama's name for the MLP's input norm)
        mlp_norm = "pre_feedforward_layernorm" if arch.block_out_norms else "post_attention_layernorm"
        self.layers = []
        for i, plan in enumerate(arch.layers):
            p = f"model.layers.{i}."
            bias_names = [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
            if f"{p}self_attn.o_proj.bias" in weights:
                raise ValueError("the checkpoint has an o_proj bias (attention_bias), which the decoder blocks lack")
            optional = lambda name: norm(name) if name in weights else None  # noqa: E731
            self.layers.append(
                DecoderLayer(
                    input_norm=norm(f"{p}input_layernorm.weight"),
                    qkv=packed(*(f"{p}self_attn.{x}_proj.weight" for x in "qkv")),
                    qkv_bias=torch.cat([weight(name) for name in bias_names]) if bias_names[0] in weights else None,
                    q_norm=optional(f"{p}self_attn.q_norm.weight"),
                    k_norm=optional(f"{p}self_attn.k_norm.weight"),
                    o_proj=packed(f"{p}self_attn.o_proj.weight"),
                    post_norm=norm(f"{p}{mlp_norm}.weight"),
                    gate_up=packed(f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"),
                    down=packed(f"{p}mlp.down_proj.weight"),
                    rope=None if plan.rope is None else ropes[plan.rope],
                    attention_out_norm=norm(f"{p}post_attention_layernorm.weight") if arch.block_out_norms else None,
                    mlp_out_norm=norm(f"{p}post_feedforward_layernorm.weight") if arch.block_out_norms else None,
                    window=plan.window,
                )
            )
        self.decoder = Decoder(
            self.layers,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            scale=arch.attention_scale,
            activation=arch.activation,
        )
        self.head = Head(self.norm, self.lm_head)
        self.embed_scale = None if arch.embed_scale is None else torch.tensor(arch.embed_scale, dtype=torch.float32)

    @property
    def num_weight_bytes(self) -> int:
        """Bytes of the weights this rank holds in their formats (matmul weights, embedding, norms, biases)."""
        embed = self.embed
        tensors = [self.norm] + [t for layer in self.layers for t in (layer.input_norm, layer.post_norm)]
        optional = [
            t
            for layer in self.layers
            for t in (layer.qkv_bias, layer.q_norm, layer.k_norm, layer.attention_out_norm, layer.mlp_out_norm)
        ]
        tensors += [t for t in optional if t is not None]
        if isinstance(embed, BlockQuantized):
            tensors += list(embed.parts.values())
        elif embed is not None:  # None: looked up from the head's panels, counted with the matmul weights
            tensors.append(embed)
        matmuls = sum(w.num_weight_bytes for w in self._packed_weights())
        return matmuls + sum(t.numel() * t.element_size() for t in tensors)

    @property
    def num_streamed_bytes(self) -> int:
        """Bytes one decode step reads: every packed matmul weight once (the embedding only by row)."""
        return sum(w.nbytes for w in self._packed_weights())

    @property
    def has_block_weights(self) -> bool:
        """Whether a matmul weight is in a GGUF block format: unpacking its blocks costs compute per row, so a
        forward's extra rows are not free, as they are when dense weights' reads bound it."""
        return any(w.format.is_block for w in self._packed_weights())

    @property
    def weight_formats(self) -> str:
        """The packed matmul weights' formats, counted: what the runner logs."""
        counts = collections.Counter(w.format.name.lower() for w in self._packed_weights())
        return ", ".join(f"{count} {fmt}" for fmt, count in sorted(counts.items()))

    @property
    def row_tile(self) -> int:
        """Rows a forward multiplies in one tile of every matmul weight: a row past a multiple of it starts another
        tile of some weight (``library.weight_row_tile``)."""
        return min(library.weight_row_tile(w.format) for w in self._packed_weights())

    def _packed_weights(self) -> list[PackedWeight]:
        """Every packed weight, a stack's parts each."""
        layers = [w for layer in self.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
        return [part for w in (self.lm_head, *layers) for part in (w.parts if isinstance(w, WeightStack) else (w,))]

    def warm_weights(self, tokens: int) -> None:
        """Ask the caches for the first weights of a forward of ``tokens`` new tokens to come, on the kernels' idle
        thread while this one prepares it (``Decoder.warm``)."""
        self.decoder.warm(tokens, self.head, library.kernel_threads())

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: TokenKVPool, vocab_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Write the batch's K/V into ``pool`` and return float32 logits ``[len(batch.logit_indices), vocab]``.

        Row ``j`` holds the next-token logits after packed token ``batch.logit_indices[j]``. The kernels run on
        ``library.kernel_threads()`` threads; the small torch ops between them on one (a torch op's thread team
        waits for all its threads, and on a busy machine one of them is often descheduled). ``vocab_mask``: the
        rows' grammar masks, which the caller applies to the logits afterwards; on one rank the lm_head skips what
        they disallow where that is most of it (``Decoder.run_logits``), on several it is not read.
        """
        threads = library.kernel_threads()
        with one_torch_thread():
            return self._forward(batch, pool, threads, vocab_mask)

    def _forward(
        self, batch: ForwardBatch, pool: TokenKVPool, threads: int, vocab_mask: torch.Tensor | None
    ) -> torch.Tensor:
        hidden = self._embed(batch.input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        hidden = hidden.contiguous()
        tokens = DecoderBatch(batch.positions, batch.new_rows, batch.key_rows, batch.key_starts, batch.num_keys)
        if self.tp.size == 1:
            if vocab_mask is not None and not mask_covers(vocab_mask, self.head.lm_head.out_features):
                vocab_mask = None  # not host words over the lm_head's vocabulary: every column computed
            logits = self.decoder.run_logits(
                hidden, tokens, pool.k, pool.v, batch.logit_indices, self.head, threads, vocab_mask
            )
        else:  # the ranks sum each block's output before the residual add
            # with fewer logit rows than tokens (a prefill), the last layer's blocks run for those rows alone, as
            # Decoder.run_logits runs them on one rank
            output_rows = batch.logit_indices if batch.logit_indices.shape[0] < hidden.shape[0] else None
            for i in range(self.num_layers):
                rows = output_rows if i == self.num_layers - 1 else None
                attention = self.decoder.attention_block(i, hidden, tokens, pool.k[i], pool.v[i], threads, rows)
                if rows is not None:
                    hidden = hidden[rows]
                self.decoder.add_block(i, hidden, self.tp.all_reduce(attention), True, threads)
                self.decoder.add_block(
                    i, hidden, self.tp.all_reduce(self.decoder.mlp_block(i, hidden, threads)), False, threads
                )
            selected = hidden if output_rows is not None else hidden[batch.logit_indices]
            selected = ops.rms_norm(selected, self.norm, self.eps, threads)
            logits = self.tp.gather_columns(ops.matmul(selected, self.lm_head, threads), self.shard.vocab_widths)
        if self.architecture.final_softcap is not None:
            ops.softcap(logits, self.architecture.final_softcap, threads)
        return logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``input_ids`` ``[T, hidden]``: on several ranks each looks up the ids of its vocabulary
        slice, zeros for the others, and the sum over ranks (exact: one term is not zero) is every row."""
        if self.tp.size == 1:
            return self._lookup(input_ids)
        start, stop = self.shard.vocab
        is_local = (input_ids >= start) & (input_ids < stop)
        hidden = self._lookup(torch.where(is_local, input_ids - start, 0))
        return self.tp.all_reduce(hidden.masked_fill_(~is_local[:, None], 0.0))

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is None:
            assert isinstance(self.lm_head, PackedWeight)
            return ops.packed_rows(self.lm_head, ids)
        if isinstance(self.embed, BlockQuantized):
            if self.embed.format == "q8_0":  # llama.cpp's token embeddings: one kernel call, the same bits
                return ops.q8_0_rows(self.embed.scales, self.embed.quants, ids)
            return self.embed.rows(ids)
        return F.embedding(ids, self.embed)


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's ops on one thread meanwhile: for copies and small ops a thread team only adds its fork-join, and on a
    busy machine, where one of its threads is often descheduled, that wait dominates (packing the embedded model's
    weights took over ten times as long on two threads as on one under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def pack_weight(parts: Sequence[torch.Tensor | BlockQuantized], dtype: torch.dtype) -> MatmulWeight:
    """Matrices stacked by rows, packed for the kernels: GGUF blocks of one format as those blocks, of Q8_0, Q4_0 and
    Q5_0 mixed as Q8_0 (the same weights and the same bits: kquant_blocks.h), of other mixed formats as a stack of
    runs of one format each (``WeightStack``: a Q4_K_M file's Q4_K q and k beside a Q6_K v), float16 or bfloat16
    tensors where float32 is asked in their own dtype (the same bits), anything else as float ``dtype`` panels."""
    formats = {part.format if isinstance(part, BlockQuantized) else None for part in parts}
    blocks = [part for part in parts if isinstance(part, BlockQuantized)]
    if len(formats) == 1 and None not in formats:
        return pack_blocks(stack_blocks(blocks))
    if None not in formats and formats <= set(AS_Q8_0):
        return pack_blocks(stack_blocks([as_q8_0(part) for part in blocks]))
    if None not in formats:
        runs = [list(run) for _, run in itertools.groupby(blocks, key=lambda part: part.format)]
        return WeightStack(tuple(pack_blocks(stack_blocks(run)) for run in runs))
    tensors = [part for part in parts if isinstance(part, torch.Tensor)]
    dtypes = {tensor.dtype for tensor in tensors}
    if not blocks and dtype == torch.float32 and dtypes in ({torch.float16}, {torch.bfloat16}):
        return packed_weights.pack_dense(torch.cat(tensors), dtypes.pop())  # the float32 bits in half the bytes
    dense = [part.dequantize() if isinstance(part, BlockQuantized) else part.to(torch.float32) for part in parts]
    return packed_weights.pack_dense(torch.cat(dense), dtype)


def pack_blocks(blocks: BlockQuantized) -> PackedWeight:
    """GGUF blocks packed for the kernels in their own format."""
    b, parts = blocks, blocks.parts
    if b.format in ("q8_0", "q4_0", "q5_0"):
        pack = {"q8_0": packed_weights.pack_q8_0, "q4_0": packed_weights.pack_q4_0, "q5_0": packed_weights.pack_q5_0}
        return pack[b.format](b.scales, b.quants)
    if b.format in ("q4_1", "q5_1") and "mins" in parts:
        pack_with_mins = packed_weights.pack_q4_1 if b.format == "q4_1" else packed_weights.pack_q5_1
        return pack_with_mins(b.scales, parts["mins"], b.quants)
    if b.format in ("q4_k", "q5_k") and {"mins", "super_scales", "super_mins"} <= parts.keys():
        pack_k = packed_weights.pack_q4_k if b.format == "q4_k" else packed_weights.pack_q5_k
        return pack_k(parts["super_scales"], parts["super_mins"], b.scales, parts["mins"], b.quants)
    if b.format == "q6_k" and "super_scales" in parts:
        return packed_weights.pack_q6_k(parts["super_scales"], b.scales, b.quants)
    raise ValueError(f"{b.format} blocks without the parts of their format: {sorted(parts)}")


def _rope_tables(
    config: PretrainedConfig, head_dim: int, max_positions: int, layer_type: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_positions, rope_dim]``, computed in float32 as transformers does: of the config's RoPE, or
    of the one of ``layer_type`` where the config has one per layer type (Gemma 3). ``rope_dim`` is ``head_dim``, or
    its ``partial_rotary_factor`` (Phi-3)."""
    parameters = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    rope_type = parameters.get("rope_type", "default")
    if rope_type == "default":
        rope_dim = int(head_dim * parameters.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
        inv_freq, scaling = 1.0 / (parameters["rope_theta"] ** exponents), 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).contiguous(), (angles.sin() * scaling).contiguous()


FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
"""Phi-3's fused projections and the parts they stack by rows."""


def unfused(
    weights: Mapping[str, torch.Tensor | BlockQuantized], config: PretrainedConfig, shard: ShardPlan
) -> Mapping[str, torch.Tensor | BlockQuantized]:
    """``weights`` with Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` (read whole on every rank) as their parts
    under Llama's names, each this rank's rows of it; the same matrices the runner packs stacked again."""
    if not any(name.endswith(f"{fused}.weight") for name in weights for fused in FUSED):
        return weights
    head_dim, heads, kv_heads = shard.head_dim, config.num_attention_heads, config.num_key_value_heads
    q_size, kv_size, inter = heads * head_dim, kv_heads * head_dim, config.intermediate_size
    local_heads = (shard.heads[0] * head_dim, shard.heads[1] * head_dim)
    local_kv = (shard.kv_heads[0] * head_dim, shard.kv_heads[1] * head_dim)
    rows = {  # each part's rows of the fused matrix this rank holds
        "q": local_heads,
        "k": (q_size + local_kv[0], q_size + local_kv[1]),
        "v": (q_size + kv_size + local_kv[0], q_size + kv_size + local_kv[1]),
        "gate": shard.intermediate,
        "up": (inter + shard.intermediate[0], inter + shard.intermediate[1]),
    }
    split: dict[str, torch.Tensor | BlockQuantized] = {}
    for name, value in weights.items():
        stem = next((f for f in FUSED if name.endswith(f"{f}.weight")), None)
        if stem is None:
            split[name] = value
            continue
        prefix = name[: -len(f"{stem}.weight")]
        for part in FUSED[stem]:
            start, stop = rows[part]
            part_name = f"{prefix}{stem.split('.')[0]}.{part}_proj.weight"
            split[part_name] = value.narrow(0, start, stop) if isinstance(value, BlockQuantized) else value[start:stop]
    return split
