"""The decoder layers in one call per forward (``csrc/decoder_layer.h``): a layer's weights and RoPE tables, a
forward's token batch, and ``Decoder``, which hands them to the C++ blocks."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from cpu_kernels.library import loaded
from cpu_kernels.ops import Activation, check_rows, kv_dtype_code, rms_norm
from cpu_kernels.packed_weights import MatmulWeight
from cpu_kernels.structs import BatchRef, LayerRef, ModelShape, packed_ref


@dataclass(frozen=True)
class Rope:
    """RoPE tables ``[positions, rope_dim]`` (float32): a layer turns the first ``rope_dim`` values of each head by
    them (``rope_dim`` is the head's size but for partial rotary embeddings)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def positions(self) -> int:
        return self.cos.shape[0]


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder layer's weights: float32 norms (and Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head q/k
    norms, Gemma 3's norms of each block's output), and the four matmul weights packed; its RoPE tables (None: a
    layer without RoPE) and its sliding window (the keys a token attends to at most; None: all of them)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor  # the MLP block's input norm
    qkv: MatmulWeight  # q, k and v projections stacked
    o_proj: MatmulWeight
    gate_up: MatmulWeight  # gate and up projections stacked
    down: MatmulWeight
    rope: Rope | None
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attention_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    window: int | None = None


@dataclass(frozen=True)
class DecoderBatch:
    """A forward's tokens for the decoder blocks (int64 CPU tensors): each token's position, the KV pool row its
    K/V go to, and the rows it attends to (``key_rows[key_starts[t] : key_starts[t] + num_keys[t]]``)."""

    positions: torch.Tensor
    new_rows: torch.Tensor
    key_rows: torch.Tensor
    key_starts: torch.Tensor
    num_keys: torch.Tensor


def mask_covers(vocab_mask: torch.Tensor, vocab: int) -> bool:
    """Whether ``vocab_mask`` can tell ``Decoder.run_logits`` what its rows allow: int32 host words, dense in each
    row, a bit for each of ``vocab`` tokens (a grammar backend's vocabulary may be narrower than a padded lm_head's,
    or its masks on another device)."""
    return (
        vocab_mask.device.type == "cpu"
        and vocab_mask.dtype == torch.int32
        and vocab_mask.stride(1) == 1
        and vocab_mask.shape[1] * 32 >= vocab
    )


class Head:
    """The final RMSNorm's float32 weight and the lm_head, as ``Decoder.run_logits`` takes them (the lm_head's C++ view
    made once)."""

    def __init__(self, norm: torch.Tensor, lm_head: MatmulWeight) -> None:
        if norm.dtype != torch.float32 or not norm.is_contiguous() or norm.shape != (lm_head.in_features,):
            raise ValueError(f"the final norm takes {lm_head.in_features} contiguous float32 weights")
        self.norm = norm
        self.lm_head = lm_head
        self.ref = packed_ref(lm_head)


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class Decoder:
    """The decoder layers as the C++ blocks run them (``csrc/decoder_layer.h``): per layer an attention block (norm,
    qkv, biases or q/k norms, RoPE, the K/V written to the pool, attention over the layer's window, o_proj) and an
    MLP block (norm, gate and up, SiLU or GELU-tanh, down), each returning its output before the residual add (and
    before the norm of the block's output, where the layer has one: ``add_block``); ``run`` does every layer with the
    adds in one call.

    The same operations, in the same order, as composing ``cpu_kernels.ops``' kernels in Python: one call per forward
    instead of ~150 (the ctypes and torch overhead between them was a large share of a decode step). ``scale``
    multiplies the attention scores (``head_dim ** -0.5`` by default).
    """

    def __init__(
        self,
        layers: list[DecoderLayer],
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float | None = None,
        activation: Activation = Activation.SILU,
    ) -> None:
        hidden = layers[0].input_norm.shape[0]
        self.layers = layers  # the structs below point into these tensors
        attention_scale = head_dim**-0.5 if scale is None else scale
        self.shape = ModelShape(
            hidden, heads, kv_heads, head_dim, layers[0].down.in_features, eps, attention_scale, int(activation)
        )
        for layer in layers:
            for norm in (layer.q_norm, layer.k_norm):
                if norm is not None and norm.shape != (head_dim,):
                    raise ValueError(f"a per-head norm has {tuple(norm.shape)} weights, not ({head_dim},)")
            if layer.rope is not None and not (
                0 < layer.rope.cos.shape[1] <= head_dim and layer.rope.cos.shape[1] % 2 == 0
            ):
                raise ValueError(f"RoPE tables of {layer.rope.cos.shape[1]} values for heads of {head_dim}")
        self.max_positions = min((layer.rope.positions for layer in layers if layer.rope is not None), default=None)
        self.refs = (LayerRef * len(layers))(
            *(
                LayerRef(
                    layer.input_norm.data_ptr(),
                    layer.post_norm.data_ptr(),
                    _pointer(layer.qkv_bias),
                    _pointer(layer.q_norm),
                    _pointer(layer.k_norm),
                    _pointer(layer.attention_out_norm),
                    _pointer(layer.mlp_out_norm),
                    _pointer(None if layer.rope is None else layer.rope.cos),
                    _pointer(None if layer.rope is None else layer.rope.sin),
                    0 if layer.rope is None else layer.rope.cos.shape[1],
                    layer.window or 0,
                    packed_ref(layer.qkv),
                    packed_ref(layer.o_proj),
                    packed_ref(layer.gate_up),
                    packed_ref(layer.down),
                )
                for layer in layers
            )
        )

    def warm(self, tokens: int, head: Head | None, threads: int) -> None:
        """Before a forward of ``tokens`` new tokens (then ``head``'s lm_head, if given): the kernels' idle thread asks
        the caches for its first weights while this one prepares it (``csrc/weight_warming.h``). Nothing where many
        tokens do not stream the weights, or on one thread. It returns at once and changes no result."""
        loaded().invariant_warm_decoder(
            self.refs, len(self.layers), None if head is None else ctypes.byref(head.ref), tokens, threads
        )

    def _batch(self, batch: DecoderBatch) -> BatchRef:
        return BatchRef(
            batch.positions.shape[0],
            batch.positions.data_ptr(),
            batch.new_rows.data_ptr(),
            batch.key_rows.data_ptr(),
            batch.key_starts.data_ptr(),
            batch.num_keys.data_ptr(),
        )

    def run(
        self, hidden: torch.Tensor, batch: DecoderBatch, k_pool: torch.Tensor, v_pool: torch.Tensor, threads: int
    ) -> None:
        """Every layer over contiguous float32 ``hidden`` ``[T, hidden]``, in place; ``k_pool``, ``v_pool``
        ``[layers, rows, kv_heads, head_dim]`` of float32, bfloat16 or float16 (K and V rounded to it as written)."""
        self._check(hidden, batch)
        self.shape.kv_dtype = kv_dtype_code(k_pool, v_pool)
        loaded().invariant_decoder(
            ctypes.byref(self.shape), self.refs, len(self.layers), ctypes.byref(self._batch(batch)), hidden.data_ptr(),
            k_pool.data_ptr(), v_pool.data_ptr(), k_pool[0].numel() * k_pool.element_size(), threads,
        )  # fmt: skip

    def run_logits(
        self,
        hidden: torch.Tensor,
        batch: DecoderBatch,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        logit_rows: torch.Tensor,
        head: Head,
        threads: int,
        vocab_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``run``, then the logits ``[len(logit_rows), head's vocabulary]`` of the output rows ``logit_rows`` (int64):
        each row's RMSNorm by the head's norm times its lm_head, in the same call (a decode step's Python between
        the kernels was a share of it). Where fewer rows than tokens give logits (a prefill), the last layer
        computes those rows alone after writing every token's K and V: the same logits, and ``hidden``'s other rows
        are left at that layer's input. ``vocab_mask``: the rows' grammar masks (int32 bit words, one row per logits
        row, at least the vocabulary's bits), which the rows must be masked by afterwards: a row that allows fewer
        than a quarter of the lm_head's 16-token panels gets only those panels' logits (the same bits), -inf
        elsewhere."""
        self._check(hidden, batch)
        self.shape.kv_dtype = kv_dtype_code(k_pool, v_pool)
        if logit_rows.dtype != torch.int64 or not logit_rows.is_contiguous():
            raise ValueError("the logits' rows are a contiguous int64 tensor")
        vocab = head.lm_head.out_features
        rows = logit_rows.shape[0]
        if vocab_mask is not None and (vocab_mask.shape[0] != rows or not mask_covers(vocab_mask, vocab)):
            raise ValueError(f"a vocabulary mask is int32 CPU words [{rows}, >= {vocab} / 32], rows dense")
        logits = torch.empty(rows, vocab, dtype=torch.float32)
        masks, ldm = (vocab_mask.data_ptr(), vocab_mask.stride(0)) if vocab_mask is not None else (None, 0)
        loaded().invariant_decoder_logits(
            ctypes.byref(self.shape), self.refs, len(self.layers), ctypes.byref(self._batch(batch)), hidden.data_ptr(),
            k_pool.data_ptr(), v_pool.data_ptr(), k_pool[0].numel() * k_pool.element_size(), logit_rows.data_ptr(),
            logit_rows.shape[0], head.norm.data_ptr(), ctypes.byref(head.ref), masks, ldm, logits.data_ptr(), threads,
        )  # fmt: skip
        return logits

    def attention_block(
        self,
        index: int,
        hidden: torch.Tensor,
        batch: DecoderBatch,
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        threads: int,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layer ``index``'s attention block over ``hidden``: o_proj's output ``[T, hidden]``, before the residual;
        with ``rows`` (int64) ``[len(rows), hidden]`` for those tokens alone, every token's K and V still written
        (the same bits as those rows of the whole block)."""
        self._check(hidden, batch)
        self.shape.kv_dtype = kv_dtype_code(k_layer, v_layer)
        if rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()):
            raise ValueError("the attention block's rows are a contiguous int64 tensor")
        count = hidden.shape[0] if rows is None else rows.shape[0]
        out = torch.empty(count, hidden.shape[1], dtype=hidden.dtype)
        loaded().invariant_attention_block(
            ctypes.byref(self.shape), ctypes.byref(self.refs[index]), ctypes.byref(self._batch(batch)),
            hidden.data_ptr(), k_layer.data_ptr(), v_layer.data_ptr(), None if rows is None else rows.data_ptr(),
            count, out.data_ptr(), threads,
        )  # fmt: skip
        return out

    def add_block(self, index: int, hidden: torch.Tensor, block: torch.Tensor, attention: bool, threads: int) -> None:
        """``hidden += block`` in place, after the norm of layer ``index``'s attention (or MLP) output where it has
        one: the residual add ``run`` makes, for a block's output summed over tensor-parallel ranks."""
        layer = self.layers[index]
        norm = layer.attention_out_norm if attention else layer.mlp_out_norm
        if norm is not None:
            block = rms_norm(block, norm, self.shape.eps, threads)
        hidden += block

    def mlp_block(self, index: int, hidden: torch.Tensor, threads: int) -> torch.Tensor:
        """Layer ``index``'s MLP block over ``hidden``: down's output ``[T, hidden]``, before the residual."""
        out = torch.empty_like(hidden)
        loaded().invariant_mlp_block(
            ctypes.byref(self.shape), ctypes.byref(self.refs[index]), hidden.shape[0], hidden.data_ptr(),
            out.data_ptr(), threads,
        )  # fmt: skip
        return out

    def _check(self, hidden: torch.Tensor, batch: DecoderBatch) -> None:
        check_rows(hidden, self.shape.hidden, "the decoder")
        if not hidden.is_contiguous() or batch.positions.shape[0] != hidden.shape[0]:
            raise ValueError("the decoder takes contiguous hidden states, one row per token of the batch")
        if self.max_positions is not None and (reach := int(batch.positions.numpy().max())) >= self.max_positions:
            raise ValueError(f"positions reach {reach}, past the {self.max_positions} RoPE rows")
