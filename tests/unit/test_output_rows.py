"""A forward whose logits are asked of fewer rows than it has tokens (a prefill: one row a sequence) runs its last
layer for those rows alone (``decoder_layer.h``'s ``output_rows_layer``): their logits must be the bits the whole
layer gives them, and every token's K and V must still be written, since later tokens attend to them."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import library
from cpu_kernels.decoder import Decoder, DecoderBatch, DecoderLayer, Head, Rope
from scheduler.server_args import ModelArgs
from tests.unit.invariant_cases import random_weight

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, POSITIONS = 256, 4, 2, 64, 512, 300, 64
SEQUENCES = ((0, 20), (30, 5), (12, 1), (0, 13))
"""(tokens already in the pool, new tokens) of each sequence: a prefill of 20 (its attention in the tiled layout of
runs of 12 tokens or more), an extend of 5 after 30 (token by token), a decode step, and a prefill of 13."""


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    library.load(ModelArgs().kernel_build_path)


def _layer(fmt: str, seed: int, window: int | None, per_head_norms: bool, rope: bool) -> DecoderLayer:
    weight = lambda rows, columns, offset: random_weight(fmt, rows, columns, seed + offset)[0]  # noqa: E731
    generator = torch.Generator().manual_seed(seed)
    angles = torch.arange(POSITIONS)[:, None] * torch.rand(HEAD_DIM // 2, generator=generator).repeat(2)
    norm = lambda size: 1 + 0.1 * torch.randn(size, generator=generator)  # noqa: E731
    return DecoderLayer(
        input_norm=norm(HIDDEN), post_norm=norm(HIDDEN),
        qkv=weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, 1), o_proj=weight(HIDDEN, HEADS * HEAD_DIM, 2),
        gate_up=weight(2 * INTER, HIDDEN, 3), down=weight(HIDDEN, INTER, 4),
        rope=Rope(torch.cos(angles).contiguous(), torch.sin(angles).contiguous()) if rope else None,
        q_norm=norm(HEAD_DIM) if per_head_norms else None, k_norm=norm(HEAD_DIM) if per_head_norms else None,
        attention_out_norm=norm(HIDDEN) if per_head_norms else None,
        mlp_out_norm=norm(HIDDEN) if per_head_norms else None, window=window,
    )  # fmt: skip


def _batch() -> DecoderBatch:
    """The sequences of SEQUENCES side by side in one pool, each token attending to its sequence's rows so far."""
    positions: list[int] = []
    new_rows: list[int] = []
    key_rows: list[int] = []
    key_starts: list[int] = []
    num_keys: list[int] = []
    next_row = 0
    for before, new in SEQUENCES:
        rows = list(range(next_row, next_row + before + new))
        next_row += before + new
        start = len(key_rows)
        key_rows += rows
        for i in range(new):
            positions.append(before + i)
            new_rows.append(rows[before + i])
            key_starts.append(start)
            num_keys.append(before + i + 1)
    return DecoderBatch(*(torch.tensor(values, dtype=torch.int64) for values in (positions, new_rows, key_rows,
                                                                                 key_starts, num_keys)))  # fmt: skip


def _forward(
    decoder: Decoder, head: Head, batch: DecoderBatch, pools: torch.Tensor, rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``rows`` and the pools after the forward (from a copy of ``pools``)."""
    hidden = torch.randn(batch.positions.shape[0], HIDDEN, generator=torch.Generator().manual_seed(7))
    k_pool, v_pool = pools.clone()
    logits = decoder.run_logits(hidden, batch, k_pool, v_pool, torch.tensor(rows, dtype=torch.int64), head, 2)
    return logits, torch.stack([k_pool, v_pool])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_k", "float32"])
def test_the_output_rows_alone_get_the_whole_last_layers_logits_and_every_token_its_kv(
    fmt: str, kv_dtype: torch.dtype
) -> None:
    """Three layers (RoPE with per-head norms, block-output norms and a sliding window of 8; without RoPE; plain),
    each of them last in turn (the layer run for the output rows alone): the logits of each sequence's last token, of
    a few tokens of one run, and of all but one token, asked alone, equal the same rows of the forward that asks every
    row's, bit for bit; the K/V pools after both are equal."""
    kinds = [
        _layer(fmt, 10, window=8, per_head_norms=True, rope=True),
        _layer(fmt, 20, window=None, per_head_norms=False, rope=False),
        _layer(fmt, 30, window=None, per_head_norms=False, rope=True),
    ]
    head = Head(torch.ones(HIDDEN), random_weight(fmt, VOCAB, HIDDEN, seed=40)[0])
    batch = _batch()
    tokens = batch.positions.shape[0]
    pool_rows = sum(before + new for before, new in SEQUENCES)
    pools = torch.randn(2, len(kinds), pool_rows, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(8))
    pools = pools.to(kv_dtype)
    last_rows = (torch.cumsum(torch.tensor([new for _, new in SEQUENCES]), 0) - 1).tolist()
    for last in range(len(kinds)):
        decoder = Decoder(kinds[last + 1 :] + kinds[: last + 1], HEADS, KV_HEADS, HEAD_DIM, 1e-5)
        every_row, every_pool = _forward(decoder, head, batch, pools, list(range(tokens)))
        for rows in (last_rows, [0, 7, 11, 19], [r for r in range(tokens) if r != 3]):
            logits, pool = _forward(decoder, head, batch, pools, rows)
            assert torch.equal(logits, every_row[torch.tensor(rows)]), (last, rows)
            assert torch.equal(pool, every_pool), (last, rows)
