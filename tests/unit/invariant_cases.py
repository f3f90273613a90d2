"""The kernels' test inputs: random packed weights in every format, and an attention case over a token KV pool.

Apart from ``test_invariant_cpu`` so that its cross-ISA runs, one new interpreter per instruction set, import only
torch and the kernels, not the test helpers' engines and clients.
"""

from __future__ import annotations

import torch

from cpu_kernels import ops, packed_weights
from cpu_kernels.packed_weights import PackedWeight

DENSE_FORMATS = ("float32", "bfloat16", "float16")
FORMATS = ("float32", "bfloat16", "float16", "q8_0", "q4_1", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
K_FORMATS = ("q4_k", "q5_k", "q6_k")
"""Formats in super-blocks of 256: a weight's in_features is a multiple of 256 (``fitted_width``)."""


def fitted_width(fmt: str, in_features: int) -> int:
    """``in_features``, rounded up to whole super-blocks for a k-quant."""
    unit = packed_weights.SUPER_BLOCK if fmt in K_FORMATS else 1
    return -(-in_features // unit) * unit


def random_weight(fmt: str, out_features: int, in_features: int, seed: int = 0) -> tuple[PackedWeight, torch.Tensor]:
    """A packed weight and the float64 matrix it stands for."""
    generator = torch.Generator().manual_seed(seed)
    if fmt in DENSE_FORMATS:
        dense = torch.randn(out_features, in_features, generator=generator) * 0.05
        dtype = getattr(torch, fmt)
        return packed_weights.pack_dense(dense, dtype), dense.to(dtype).double()
    blocks = in_features // packed_weights.BLOCK
    scales = (torch.rand(out_features, blocks, generator=generator) * 0.01).half()
    mins = (-torch.rand(out_features, blocks, generator=generator) * 0.08).half()
    expand = lambda t, n=packed_weights.BLOCK: t.double().repeat_interleave(n, dim=1)  # noqa: E731
    unsigned = lambda bits: torch.randint(0, 2**bits, (out_features, in_features), generator=generator).byte()  # noqa: E731
    if fmt == "q8_0":
        quants = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
        return packed_weights.pack_q8_0(scales, quants), expand(scales) * quants.double()
    if fmt in ("q4_1", "q5_1"):
        quants = unsigned(4 if fmt == "q4_1" else 5)
        return getattr(packed_weights, f"pack_{fmt}")(scales, mins, quants), expand(scales) * quants + expand(mins)
    if fmt in ("q4_0", "q5_0"):
        quants = unsigned(4 if fmt == "q4_0" else 5)
        offset = 8 if fmt == "q4_0" else 16
        return getattr(packed_weights, f"pack_{fmt}")(scales, quants), expand(scales) * (quants.double() - offset)
    supers = in_features // packed_weights.SUPER_BLOCK
    d = (torch.rand(out_features, supers, generator=generator) * 2e-4).half()
    if fmt == "q6_k":
        sub_scales = torch.randint(-128, 128, (out_features, 2 * blocks), generator=generator, dtype=torch.int8)
        quants = unsigned(6)
        exact = expand(d, packed_weights.SUPER_BLOCK) * expand(sub_scales, 16) * (quants.double() - 32)
        return packed_weights.pack_q6_k(d, sub_scales, quants), exact
    dmin = (torch.rand(out_features, supers, generator=generator) * 2e-4).half()
    sub_scales, sub_mins = torch.randint(0, 64, (2, out_features, blocks), generator=generator).byte()
    quants = unsigned(4 if fmt == "q4_k" else 5)
    exact = expand(d, packed_weights.SUPER_BLOCK) * expand(sub_scales) * quants.double()
    exact -= expand(dmin, packed_weights.SUPER_BLOCK) * expand(sub_mins)
    return getattr(packed_weights, f"pack_{fmt}")(d, dmin, sub_scales, sub_mins, quants), exact


def activations_as_multiplied(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` as the kernels multiply it by a weight of ``fmt``, in float64: dense formats take it as it is; the block
    formats quantise each 32-block to int8 (d = amax / 127, q = round-half-even(x * (127 / amax)), float32 steps)."""
    if fmt in DENSE_FORMATS:
        return x.double()
    blocks = x.reshape(x.shape[0], -1, packed_weights.BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)  # 127 / amax is reciprocal() * 127
    quants = torch.round(blocks * inverse).clamp(-127, 127)
    return (quants.double() * (amax / 127).double()).reshape(x.shape)


ATTENTION_SHAPES = {
    "smollm2": (9, 3, 64),
    "group 8, head_dim 128": (16, 2, 128),
    "group 1, head_dim 32": (4, 4, 32),
    "phi3's head_dim 96": (4, 2, 96),
    "gemma3's head_dim 256": (4, 1, 256),
}
"""(query heads, KV heads, head_dim): SmolLM2's, shapes whose tiles split their query rows differently, and Phi-3's
and Gemma 3's head sizes."""


def attention_case(
    seed: int = 0, shape: str = "smollm2", runs: bool = False, kv_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """A pool of 300 rows and 64 query tokens of four sequences: token t attends to the first ``num_keys[t]`` rows of
    its sequence. Interleaved, every token is alone in its sequence (decode steps); with ``runs``, the tokens come
    as a 37-token prefill, one decode step, an 8-token extend at position 100 and an 18-token extend at 12, each run
    of consecutive positions (runs of 12 tokens or more are the layout whose keys the kernel transposes and tiles).
    ``kv_dtype``: the pool's elements (K and V rounded to them as a 16-bit pool stores them)."""
    heads, kv_heads, head_dim = ATTENTION_SHAPES[shape]
    generator = torch.Generator().manual_seed(seed)
    k_pool, v_pool = torch.randn(2, 300, kv_heads, head_dim, generator=generator)
    lengths = (250, 37, 120, 5) if not runs else (37, 120, 108, 30)
    sequences = [torch.randperm(299, generator=generator)[:length] + 1 for length in lengths]
    key_rows = torch.cat(sequences)
    starts = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    if runs:
        owner = torch.tensor([0] * 37 + [1] + [2] * 8 + [3] * 18)
        num_keys = torch.cat([torch.arange(1, 38), torch.tensor([120]), torch.arange(101, 109), torch.arange(13, 31)])
    else:
        owner = torch.arange(64) % 4
        num_keys = torch.tensor([1 + (7 * t) % lengths[owner[t]] for t in range(64)])
    q = torch.randn(64, heads, head_dim, generator=generator)
    k_pool, v_pool = (ops.kv_store(pool.contiguous(), kv_dtype) for pool in (k_pool, v_pool))
    return {"q": q, "k": k_pool, "v": v_pool, "rows": key_rows, "starts": starts[owner], "keys": num_keys}


def run_attention(case: dict[str, torch.Tensor], tokens: slice) -> torch.Tensor:
    head_dim = case["q"].shape[-1]
    return ops.attention(
        case["q"][tokens].contiguous(),
        case["k"],
        case["v"],
        case["rows"],
        case["starts"][tokens].contiguous(),
        case["keys"][tokens].contiguous(),
        head_dim**-0.5,
    )
