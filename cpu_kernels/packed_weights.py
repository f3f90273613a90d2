"""Weights as the kernels multiply them: packed in panels of 16 output columns, in their stored format (float32,
bfloat16, float16, or a GGUF block format multiplied as stored: ``csrc/dense_matmul.h``, ``csrc/int8_blocks.h`` and
``csrc/kquant_blocks.h`` state each layout); and stacks of parts in different formats."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

LANES = 16
"""Columns per packed panel; also the partial sums of a row reduction."""
BLOCK = 32
"""The GGUF block formats' k values per scale."""
SUPER_BLOCK = 256
"""The k-quants' (Q4_K, Q5_K, Q6_K) k values per super-block: its float16 scale (and minimum) times each 32-block's
(Q6_K: 16-block's) integer scale."""


class WeightFormat(enum.IntEnum):
    """Packed weight formats (values shared with the C++ source)."""

    F32 = 0
    BF16 = 1
    Q8_0 = 2
    Q4_1 = 3
    Q4_0 = 4
    Q5_0 = 5
    Q5_1 = 6
    Q4_K = 7
    Q5_K = 8
    Q6_K = 9
    F16 = 10

    @property
    def is_block(self) -> bool:
        """A GGUF block format: multiplied as integer dot products with activations quantised per 32-block."""
        return self not in (WeightFormat.F32, WeightFormat.BF16, WeightFormat.F16)


BYTES_PER_BLOCK = {
    WeightFormat.F32: 128,
    WeightFormat.BF16: 64,
    WeightFormat.Q8_0: 34,
    WeightFormat.Q4_1: 20,
    WeightFormat.Q4_0: 18,
    WeightFormat.Q5_0: 22,
    WeightFormat.Q5_1: 24,
    WeightFormat.Q4_K: 144 / 8,
    WeightFormat.Q5_K: 176 / 8,
    WeightFormat.Q6_K: 210 / 8,
    WeightFormat.F16: 64,
}
"""Bytes of 32 weights in each format as GGUF stores them (their scales and minimums included; a k-quant's
super-block of 256 shared by 8 blocks)."""


@dataclass(frozen=True)
class PackedWeight:
    """A ``[out_features, in_features]`` weight in panels of 16 output columns (layout: the C++ source)."""

    format: WeightFormat
    data: torch.Tensor  # uint8, [panels, panel_bytes]; block formats' panels grouped (_grouped)
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """The packed bytes, padding to whole panels included: what a pass over the weight reads."""
        return self.data.numel()

    @property
    def num_weight_bytes(self) -> int:
        """The bytes of the ``out_features x in_features`` weights themselves in this format (no padding)."""
        return int(self.out_features * self.in_features * BYTES_PER_BLOCK[self.format] // BLOCK)


@dataclass(frozen=True)
class WeightStack:
    """Weights stacked by rows whose formats differ, each part packed in its own format (a k-quant file's q and k
    projections beside a v of more bits): multiplied part by part into consecutive output columns, each part's
    products those of the part alone."""

    parts: tuple[PackedWeight, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len({part.in_features for part in self.parts}) != 1:
            raise ValueError("a weight stack takes two or more parts of one in_features")

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    @property
    def num_weight_bytes(self) -> int:
        return sum(part.num_weight_bytes for part in self.parts)


MatmulWeight = PackedWeight | WeightStack
"""A matmul's weight: one packed weight, or a stack of parts in different formats."""


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K, ...]`` -> ``[ceil(N / 16), K, 16, ...]``: columns grouped by 16 (zero past N), k-major in a panel."""
    out_features = weight.shape[0]
    padded = -(-out_features // LANES) * LANES
    if padded != out_features:
        weight = torch.cat([weight, weight.new_zeros(padded - out_features, *weight.shape[1:])])
    return weight.reshape(padded // LANES, LANES, *weight.shape[1:]).transpose(1, 2)


_group_panels: int | None = None


def set_group_panels(panels: int) -> None:
    """The loaded build's group width, which ``cpu_kernels.library.load`` sets: block weights are packed for the
    build that multiplies them (``_grouped``)."""
    global _group_panels
    _group_panels = panels


def _grouped(units: torch.Tensor, head_bytes: int, blocks_per_unit: int = 1) -> torch.Tensor:
    """Per-panel units ``[P, units, unit_bytes]`` (a unit: a ``head_bytes`` head, then ``blocks_per_unit`` blocks of
    one size) -> ``[P, panel_bytes]`` with the panels in groups of the loaded build's width (the last holding the
    rest), block by block: per unit the group's heads side by side, then per block the group's blocks side by side.
    A one-row product over a group then reads one sequential stream (``csrc/int8_blocks.h``)."""
    if _group_panels is None:
        raise RuntimeError("cpu_kernels.library.load(build_dir) must be called before packing block weights")
    panels, num_units, unit_bytes = units.shape
    if _group_panels == 1:
        return units.reshape(panels, -1)
    block_bytes = (unit_bytes - head_bytes) // blocks_per_unit
    whole = panels // _group_panels * _group_panels
    out = torch.empty(panels, num_units * unit_bytes, dtype=torch.uint8)  # filled part by part: no copy beside it
    for first, last in ((0, whole), (whole, panels)):
        if first == last:
            continue
        width = min(_group_panels, last - first)
        part = units[first:last].reshape(-1, width, num_units, unit_bytes)  # [groups, width, units, bytes]
        target = out[first:last].view(part.shape[0], num_units, width * unit_bytes)
        heads = target[..., : width * head_bytes].unflatten(-1, (width, head_bytes))
        heads.copy_(part[..., :head_bytes].permute(0, 2, 1, 3))
        blocks = target[..., width * head_bytes :].unflatten(-1, (blocks_per_unit, width, block_bytes))
        blocks.copy_(part[..., head_bytes:].unflatten(-1, (blocks_per_unit, block_bytes)).permute(0, 2, 3, 1, 4))
    return out


def pack_dense(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> PackedWeight:
    """Pack a float ``[out_features, in_features]`` weight as float32, bfloat16 or float16 panels (the kernel
    converts 16-bit weights to float32 exactly: a float16 or bfloat16 weight packed in its own dtype gives the bits
    of its float32 packing)."""
    formats = {torch.float32: WeightFormat.F32, torch.bfloat16: WeightFormat.BF16, torch.float16: WeightFormat.F16}
    if dtype not in formats:
        raise ValueError(f"dense weights are packed as float32, bfloat16 or float16, not {dtype}")
    out_features, in_features = weight.shape
    panels = _panels(weight.detach().to("cpu", dtype)).contiguous()
    data = panels.view(torch.uint8).reshape(panels.shape[0], -1)
    return PackedWeight(formats[dtype], data, out_features, in_features)


def pack_q8_0(scales: torch.Tensor, quants: torch.Tensor) -> PackedWeight:
    """Pack GGUF Q8_0 blocks, ``w[n, 32 b + i] = scales[n, b] * quants[n, 32 b + i]``.

    ``scales``: float16 ``[N, K / 32]``; ``quants``: int8 ``[N, K]``.
    """
    out_features, in_features = quants.shape
    blocks = in_features // BLOCK
    q = _panels(quants.reshape(out_features, blocks, BLOCK // 4, 4))  # [P, blocks, 16 lanes, 8 quads, 4]
    q = q.permute(0, 1, 3, 2, 4).contiguous().view(torch.uint8).reshape(q.shape[0], blocks, -1)  # [.., 8, 16, 4]
    d = _panels(scales.to(torch.float16)).contiguous().view(torch.uint8)  # [P, blocks, 16 x 2 bytes]
    d = d.reshape(q.shape[0], blocks, -1)
    data = _grouped(torch.cat([q, d], dim=2), 0)
    return PackedWeight(WeightFormat.Q8_0, data, out_features, in_features)


def pack_q4_1(scales: torch.Tensor, mins: torch.Tensor, quants: torch.Tensor) -> PackedWeight:
    """Pack GGUF Q4_1 blocks, ``w[n, 32 b + i] = scales[n, b] * quants[n, 32 b + i] + mins[n, b]``.

    ``scales``, ``mins``: float16 ``[N, K / 32]``; ``quants``: uint8 ``[N, K]`` holding 0..15.
    """
    out_features, in_features = quants.shape
    blocks = in_features // BLOCK
    q = _panels(quants.reshape(out_features, blocks, 2, BLOCK // 8, 4))  # [P, blocks, 16 lanes, halves, 4 quads, 4]
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 1, 3, 2, 4).contiguous()  # [P, blocks, 4, 16, 4]
    nibbles = nibbles.reshape(nibbles.shape[0], blocks, -1)
    d = _panels(scales.to(torch.float16)).contiguous().view(torch.uint8).reshape(nibbles.shape[0], blocks, -1)
    m = _panels(mins.to(torch.float16)).contiguous().view(torch.uint8).reshape(nibbles.shape[0], blocks, -1)
    data = _grouped(torch.cat([nibbles, d, m], dim=2), 0)
    return PackedWeight(WeightFormat.Q4_1, data, out_features, in_features)


def _lanes(values: torch.Tensor, blocks: int) -> torch.Tensor:
    """Per-block values ``[N, blocks, ...]`` -> ``[P, blocks, bytes]``: a block's 16 columns' values in lane order."""
    lanes = _panels(values.reshape(values.shape[0], blocks, -1)).transpose(2, 3).contiguous()  # [P, blocks, v, 16]
    return lanes.view(torch.uint8).reshape(lanes.shape[0], blocks, -1)


def _quant_vectors(quants: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit quants ``[N, K]`` -> ``[P, K / 32, bytes]``: per 32-block the 4-bit formats' nibbles as
    pack_q4_1 lays them out, the 5- and 6-bit formats' vectors of ``_wide_quant_vectors`` (kquant_blocks.h)."""
    out_features, in_features = quants.shape
    blocks = in_features // BLOCK
    q = _panels(quants.reshape(out_features, blocks, 2, BLOCK // 8, 4))  # [P, blocks, 16 lanes, halves, 4 quads, 4]
    q = q.permute(0, 1, 4, 3, 2, 5).reshape(q.shape[0], blocks, 8, 4 * LANES)  # [P, blocks, combination 2i + h, 64]
    if bits > 4:
        return _wide_quant_vectors(q, bits).reshape(q.shape[0], blocks, -1)
    return ((q[:, :, 0::2] & 15) | ((q[:, :, 1::2] & 15) << 4)).reshape(q.shape[0], blocks, -1)


_WIDE_QUANT_READS = {
    5: (
        (5, ((0, 0x0707, 5), (1, 0x1818, 2))),
        (6, ((2, 0x0707, 5), (3, 0x1818, 2))),
        (7, ((4, 0x0707, 5), (3, 0x0808, 4), (1, 0x1010, 3))),
    ),
    6: (
        (6, ((0, 0x0303, 6), (1, 0x0C0C, 4), (2, 0x3030, 2))),
        (7, ((3, 0x0303, 6), (4, 0x0C0C, 4), (5, 0x3030, 2))),
    ),
}
"""How kquant_blocks.h's join_wide reads the combinations that no vector holds in its low bits: per 16-bit word, the
xor of ``r[a] >> shift`` over the combination's terms ``(a, pivots, shift)``, and'ed with the quants' mask (0x1F1F,
0x3F3F). ``pivots``: the result's bits set by r[a]'s bits above its own quants (each at ``pivots << shift``)."""


def _wide_quant_vectors(q: torch.Tensor, bits: int) -> torch.Tensor:
    """A block's 8 combinations of 64 ``bits``-bit quants (5 or 6) ``[..., 8, 64]`` -> its ``bits`` vectors of 64
    bytes ``[..., bits, 64]``.

    Vector j holds combination j in the low ``bits`` bits of each byte (one ``and`` to read). Their bits above carry
    the other combinations, each read as a xor of shifted 16-bit words (``_WIDE_QUANT_READS``): 19 (18) vector
    operations for the 8 combinations, where nibbles and planes of the bits above them took 36 on AVX2. The shifts
    move bits across the bytes of a word, so each combination's bits are solved in turn: every bit it reads is
    already set, apart from its pivots, which are set to give its value. (That order exists: no combination reads
    the pivots of one after it.)"""
    mask = np.uint16(((1 << bits) - 1) * 0x0101)
    words = q.contiguous().numpy().view("<u2")  # [..., 8, 32]: the 16-bit words of bytes 2w, 2w + 1
    vectors = words[..., :bits, :].copy()
    for combination, terms in _WIDE_QUANT_READS[bits]:
        read = np.zeros_like(words[..., 0, :])
        for register, _, shift in terms:
            read ^= vectors[..., register, :] >> shift
        missing = (words[..., combination, :] ^ read) & mask
        for register, pivots, shift in terms:
            vectors[..., register, :] |= (missing & pivots) << shift
    return torch.from_numpy(vectors.view(np.uint8))


def _block_bytes(quants: torch.Tensor, bits: int, per_block: list[torch.Tensor]) -> torch.Tensor:
    """``[P, K / 32, bytes]``: per 32-block its quant vectors, then the 16 columns' values of each of ``per_block``."""
    blocks = quants.shape[1] // BLOCK
    return torch.cat([_quant_vectors(quants, bits), *(_lanes(values, blocks) for values in per_block)], dim=2)


def _pack_blocks(fmt: WeightFormat, quants: torch.Tensor, bits: int, *per_block: torch.Tensor) -> PackedWeight:
    """A 32-block format: its blocks as ``_block_bytes`` lays them out, one after another."""
    return PackedWeight(fmt, _grouped(_block_bytes(quants, bits, list(per_block)), 0), *quants.shape)


def pack_q4_0(scales: torch.Tensor, quants: torch.Tensor) -> PackedWeight:
    """Pack GGUF Q4_0 blocks, ``w[n, 32 b + i] = scales[n, b] * (quants[n, 32 b + i] - 8)``.

    ``scales``: float16 ``[N, K / 32]``; ``quants``: uint8 ``[N, K]`` holding 0..15.
    """
    return _pack_blocks(WeightFormat.Q4_0, quants, 4, scales.to(torch.float16))


def pack_q5_0(scales: torch.Tensor, quants: torch.Tensor) -> PackedWeight:
    """Pack GGUF Q5_0 blocks, ``w[n, 32 b + i] = scales[n, b] * (quants[n, 32 b + i] - 16)``; quants uint8 0..31."""
    return _pack_blocks(WeightFormat.Q5_0, quants, 5, scales.to(torch.float16))


def pack_q5_1(scales: torch.Tensor, mins: torch.Tensor, quants: torch.Tensor) -> PackedWeight:
    """Pack GGUF Q5_1 blocks, ``w[n, 32 b + i] = scales[n, b] * quants[n, 32 b + i] + mins[n, b]``; quants 0..31."""
    return _pack_blocks(WeightFormat.Q5_1, quants, 5, scales.to(torch.float16), mins.to(torch.float16))


def _pack_super_blocks(
    fmt: WeightFormat, quants: torch.Tensor, bits: int, head: list[torch.Tensor], per_block: list[torch.Tensor]
) -> PackedWeight:
    """A k-quant: per super-block of 256 its head (``head``: float16 ``[N, K / 256]`` each, in lane order), then
    its 8 blocks as ``_block_bytes`` lays them out."""
    supers = quants.shape[1] // SUPER_BLOCK
    body = _block_bytes(quants, bits, per_block)
    body = body.reshape(body.shape[0], supers, -1)
    heads = [_lanes(values.to(torch.float16), supers) for values in head]
    data = torch.cat([*heads, body], dim=2)
    return PackedWeight(fmt, _grouped(data, sum(h.shape[2] for h in heads), SUPER_BLOCK // BLOCK), *quants.shape)


def pack_q4_k(
    d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, quants: torch.Tensor
) -> PackedWeight:
    """Pack GGUF Q4_K super-blocks, ``w[n, 32 j + i] = d[n, j // 8] * scales[n, j] * quants[n, 32 j + i]
    - dmin[n, j // 8] * mins[n, j]``.

    ``d``, ``dmin``: float16 ``[N, K / 256]``; ``scales``, ``mins``: uint8 ``[N, K / 32]`` holding 0..63;
    ``quants``: uint8 ``[N, K]`` holding 0..15.
    """
    return _pack_super_blocks(WeightFormat.Q4_K, quants, 4, [d, dmin], [scales, mins])


def pack_q5_k(
    d: torch.Tensor, dmin: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, quants: torch.Tensor
) -> PackedWeight:
    """Pack GGUF Q5_K super-blocks: as ``pack_q4_k`` with quants 0..31."""
    return _pack_super_blocks(WeightFormat.Q5_K, quants, 5, [d, dmin], [scales, mins])


def pack_q6_k(d: torch.Tensor, scales: torch.Tensor, quants: torch.Tensor) -> PackedWeight:
    """Pack GGUF Q6_K super-blocks, ``w[n, 16 j + i] = d[n, j // 16] * scales[n, j] * (quants[n, 16 j + i] - 32)``.

    ``d``: float16 ``[N, K / 256]``; ``scales``: int8 ``[N, K / 16]``; ``quants``: uint8 ``[N, K]`` holding 0..63.
    """
    return _pack_super_blocks(WeightFormat.Q6_K, quants, 6, [d], [scales.to(torch.int8)])
