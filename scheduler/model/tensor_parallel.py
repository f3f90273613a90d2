"""Tensor parallelism for the Llama forward: which slice of each weight a rank holds, and the collectives it runs.

Attention is split by KV groups: a rank holds whole KV heads and the query heads that read them (column-parallel
q/k/v), so attention needs no communication and the KV pool of a rank holds only its KV heads. The MLP's gate and
up projections are column-parallel over the intermediate size. o_proj and down are row-parallel (each rank holds the
input columns matching its heads or intermediate slice) and their partial outputs are summed with ``all_reduce``.
The embedding and the lm_head are split over the vocabulary: a rank looks up only the ids of its slice (zeros
elsewhere, summed by ``all_reduce``) and computes the logits of its slice, gathered so that every rank holds the
full row. Norms are replicated. Counts that do not divide are split as evenly as possible, lower ranks taking one
more (SmolLM2's 3 KV heads over 2 ranks: 2 and 1).

Partial sums of o_proj and down reduce in another order than one full matmul, so logits differ from one rank's by
rounding (with GGUF block weights, by what that rounding moves across the next layer's int8 activation steps:
greedy outputs may part where one rank's top two are near a tie); every rank of the group gets the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

from scheduler.model.shm_gather import SharedMemoryGather

Span = tuple[int, int]
"""``[start, stop)`` of one dimension."""


def split_evenly(total: int, parts: int) -> list[Span]:
    """``total`` items in ``parts`` contiguous spans whose sizes differ by at most one, larger spans first."""
    base, extra = divmod(total, parts)
    spans, start = [], 0
    for part in range(parts):
        stop = start + base + (part < extra)
        spans.append((start, stop))
        start = stop
    return spans


@dataclass(frozen=True)
class ShardPlan:
    """What tensor-parallel rank ``rank`` of ``size`` holds: spans of KV heads, query heads, intermediate columns and
    vocabulary rows. ``vocab_spans`` lists every rank's vocabulary span (the gather needs their widths)."""

    rank: int
    size: int
    head_dim: int
    kv_heads: Span
    heads: Span
    intermediate: Span
    vocab: Span
    vocab_spans: tuple[Span, ...]

    @classmethod
    def build(cls, config: PretrainedConfig, rank: int = 0, size: int = 1) -> ShardPlan:
        """The plan for ``rank`` of ``size``; raises ValueError where the model cannot be split that many ways."""
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is not in [0, {size})")
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads do not group evenly over {num_kv_heads} KV heads")
        if size > num_kv_heads:
            raise ValueError(
                f"--tp-size {size} exceeds the model's {num_kv_heads} KV heads: each rank holds whole KV heads "
                f"(and the query heads of their groups), so use --tp-size {num_kv_heads} or less"
            )
        group = num_heads // num_kv_heads
        kv_start, kv_stop = split_evenly(num_kv_heads, size)[rank]
        vocab_spans = tuple(split_evenly(config.vocab_size, size))
        return cls(
            rank=rank,
            size=size,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
            kv_heads=(kv_start, kv_stop),
            heads=(kv_start * group, kv_stop * group),
            intermediate=split_evenly(config.intermediate_size, size)[rank],
            vocab=vocab_spans[rank],
            vocab_spans=vocab_spans,
        )

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def vocab_widths(self) -> list[int]:
        return [stop - start for start, stop in self.vocab_spans]

    def weight_slice(self, name: str) -> tuple[int, Span] | None:
        """The dimension and span of checkpoint tensor ``name`` (Hugging Face Llama names) this rank holds; None
        when it holds all of it (norms, and everything on a single rank)."""
        if self.size == 1:
            return None
        heads = (self.heads[0] * self.head_dim, self.heads[1] * self.head_dim)
        kv_heads = (self.kv_heads[0] * self.head_dim, self.kv_heads[1] * self.head_dim)
        suffixes = (
            ((".q_proj.weight", ".q_proj.bias"), 0, heads),
            ((".k_proj.weight", ".k_proj.bias", ".v_proj.weight", ".v_proj.bias"), 0, kv_heads),
            ((".o_proj.weight",), 1, heads),
            ((".gate_proj.weight", ".up_proj.weight"), 0, self.intermediate),
            ((".down_proj.weight",), 1, self.intermediate),
            (("embed_tokens.weight", "lm_head.weight"), 0, self.vocab),
        )
        for names, dim, span in suffixes:
            if name.endswith(names):
                return dim, span
        return None


class TensorParallelGroup:
    """The collectives of one tensor-parallel group; with ``size`` 1 (no ``group``) they return their input.

    Every rank of the group must call them in the same order with tensors of the same shapes: the lockstep
    scheduler runs the same batches on every rank, so every rank runs the same forwards.
    """

    def __init__(
        self, rank: int = 0, size: int = 1, group: Any = None, shared: SharedMemoryGather | None = None
    ) -> None:
        if size > 1 and group is None:
            raise ValueError("a tensor-parallel group of several ranks needs a process group")
        self.rank = rank
        self.size = size
        self.group = group
        self.shared = shared

    @classmethod
    def joined(cls, rank: int, size: int, group: Any) -> TensorParallelGroup:
        """The group of ``group``'s ranks, gathering through a shared mapping where they all run on this machine
        (``SharedMemoryGather``), else over ``group``. Collective: every rank calls it."""
        return cls(rank, size, group, SharedMemoryGather.open(rank, size, group))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x`` (same shape on each), added in rank order.

        Not ``dist.all_reduce``: its ring splits a tensor into chunks by its size, so with three ranks or more an
        element's order of addition (and its rounding) would depend on how many tokens share the forward.
        """
        if self.size == 1:
            return x
        pieces = self._all_gather(x)
        total = pieces[0]
        for piece in pieces[1:]:
            total += piece
        return total

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's ``x`` ``[rows, widths[rank]]`` side by side in rank order: ``[rows, sum(widths)]``."""
        if self.size == 1:
            return x
        padded = max(widths)
        local = x if x.shape[1] == padded else torch.cat([x, x.new_zeros(x.shape[0], padded - x.shape[1])], dim=1)
        pieces = self._all_gather(local)
        return torch.cat([piece[:, :width] for piece, width in zip(pieces, widths, strict=True)], dim=1)

    def _all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` in rank order: through the shared mapping where it has one and ``x`` fits a slot."""
        gathered = self.shared.all_gather(x) if self.shared is not None else None
        if gathered is not None:
            return list(gathered.unbind(0))
        pieces = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(pieces, x.contiguous(), group=self.group)
        return pieces
