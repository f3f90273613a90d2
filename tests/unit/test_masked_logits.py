"""The lm_head over a grammar mask's panels (``Decoder.run_logits`` with ``vocab_mask``): the allowed tokens' logits
are the full product's bit for bit, in every weight format, and what a row skips is -inf."""

from __future__ import annotations

import pytest
import torch

from cpu_kernels import library
from cpu_kernels.decoder import Decoder, DecoderBatch, DecoderLayer, Head, Rope
from scheduler.server_args import ModelArgs
from tests.unit.invariant_cases import FORMATS, random_weight
from triton_ops.bitmask_format import allocate_bitmask, bitmask_from_token_ids, unpack_bitmask

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, TOKENS = 256, 4, 2, 64, 512, 21
VOCAB = 16 * 70 + 9
"""70 whole panels of 16 tokens and a last one of 9."""


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    library.load(ModelArgs().kernel_build_path)


def _decoder() -> Decoder:
    weight = lambda rows, columns, seed: random_weight("q8_0", rows, columns, seed)[0]  # noqa: E731
    angles = torch.arange(TOKENS)[:, None] * torch.rand(HEAD_DIM, generator=torch.Generator().manual_seed(9))
    layer = DecoderLayer(
        input_norm=torch.ones(HIDDEN), post_norm=torch.ones(HIDDEN),
        qkv=weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, 1), o_proj=weight(HIDDEN, HEADS * HEAD_DIM, 2),
        gate_up=weight(2 * INTER, HIDDEN, 3), down=weight(HIDDEN, INTER, 4),
        rope=Rope(torch.cos(angles).contiguous(), torch.sin(angles).contiguous()),
    )  # fmt: skip
    return Decoder([layer], HEADS, KV_HEADS, HEAD_DIM, 1e-5)


def _logits(decoder: Decoder, head: Head, mask: torch.Tensor | None) -> torch.Tensor:
    batch = DecoderBatch(
        torch.arange(TOKENS), torch.arange(TOKENS), torch.arange(TOKENS), torch.zeros(TOKENS, dtype=torch.int64),
        torch.arange(1, TOKENS + 1),
    )  # fmt: skip
    hidden = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(10))
    k_pool, v_pool = torch.zeros(2, 1, TOKENS, KV_HEADS, HEAD_DIM)
    return decoder.run_logits(hidden, batch, k_pool, v_pool, torch.arange(TOKENS), head, 2, mask)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_masked_row_s_allowed_logits_are_the_full_product_s_bits(fmt: str) -> None:
    """21 rows, three of each: allowing a few tokens (in the first, a middle and the partial last panel; a run; none
    at all), a quarter of the panels less one and exactly a quarter, and every token: allowed logits equal the
    unmasked call's, the rows computed in full are equal throughout, and a sparse row is -inf outside the panels of
    its allowed tokens."""
    lm_head, _ = random_weight(fmt, VOCAB, HIDDEN, seed=5)  # HIDDEN: whole k-quant super-blocks
    decoder, head = _decoder(), Head(torch.ones(HIDDEN), lm_head)
    quarter = -(-VOCAB // 16 // 4)  # the fewest panels a row computed in full allows
    rows = [
        [0, 17, 600, VOCAB - 1],
        list(range(300, 340)),
        [],
        [16 * p for p in range(quarter - 1)] + [5],
        [16 * p + 3 for p in range(quarter)],
        list(range(VOCAB)),
        list(range(0, VOCAB, 5)),
    ]
    kinds = [i % len(rows) for i in range(TOKENS)]  # three of each: 21 rows, past the matmuls' 16-row sizes
    mask = torch.stack([bitmask_from_token_ids(rows[kind], VOCAB) for kind in kinds])
    full, masked = _logits(decoder, head, None), _logits(decoder, head, mask)
    allowed = unpack_bitmask(mask, VOCAB)
    assert torch.equal(masked[allowed], full[allowed])
    for row in (i for i, kind in enumerate(kinds) if kind >= 4):  # a quarter of the panels or more: in full
        assert torch.equal(masked[row], full[row])
    for row in (i for i, kind in enumerate(kinds) if kind < 4):
        panels = allowed[row].nonzero().flatten() // 16
        computed = torch.zeros(VOCAB, dtype=torch.bool)
        for panel in panels.tolist():
            computed[16 * panel : 16 * panel + 16] = True
        assert torch.equal(masked[row][computed], full[row][computed])
        assert bool(torch.isneginf(masked[row][~computed]).all())
    assert all(bool(torch.isneginf(masked[row]).all()) for row, kind in enumerate(kinds) if kind == 2)


def test_a_mask_too_narrow_for_the_vocabulary_is_refused() -> None:
    lm_head, _ = random_weight("q8_0", VOCAB, HIDDEN, seed=5)
    narrow = allocate_bitmask(TOKENS, VOCAB - 64, "cpu")
    with pytest.raises(ValueError, match="vocabulary mask"):
        _logits(_decoder(), Head(torch.ones(HIDDEN), lm_head), narrow)
