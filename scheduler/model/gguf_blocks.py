"""A GGUF file's quantised weights as they are: its Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 blocks and Q4_K, Q5_K, Q6_K
super-blocks, never de-quantised to float.

The model runner multiplies these blocks directly (``cpu_kernels``), so it streams the file's 0.56-1.06
bytes per weight instead of a float32 copy's 4, and computes with exactly the weights gguf (and transformers, through
it) de-quantises to. F16 and BF16 tensors stay 16-bit floats; tensors of other types (norms in F32, other
quantisations) are read as float32.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from scheduler.model.gguf_config import ROPE_FACTOR_TENSORS
from scheduler.model.gguf_file import GgufFile

FORMATS = ("q8_0", "q4_1", "q4_0", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
OFFSETS = {"q4_0": 8, "q5_0": 16, "q6_k": 32}
"""What comes off a stored (unsigned) quant before its scale multiplies it."""
PARTS = ("quants", "scales", "mins", "super_scales", "super_mins")


@dataclass(frozen=True)
class BlockQuantized:
    """A ``[out_features, in_features]`` matrix in GGUF blocks along ``in_features``, as its file stores it:
    ``w[n, k] = scale * (quants[n, k] - offset) + min``, with per block (of ``in_features / scales.shape[1]``)
    ``scale = scales[n, b]`` and ``min = mins[n, b]`` (0 without mins); for a k-quant ``scale = super_scales[n, s] *
    scales[n, b]`` and ``min = -super_mins[n, s] * mins[n, b]`` for its super-block ``s`` (of 256 weights).

    ``quants`` are int8 (Q8_0) or the stored unsigned integers (uint8), one per weight; ``offset`` is
    ``OFFSETS[format]`` or 0. ``scales`` and ``mins`` are float16, except a k-quant's integers (uint8 6-bit scales
    and mins per 32 for Q4_K and Q5_K, int8 scales per 16 for Q6_K); ``super_scales`` and ``super_mins`` float16.
    """

    format: str
    scales: torch.Tensor
    quants: torch.Tensor
    mins: torch.Tensor | None = None
    super_scales: torch.Tensor | None = None
    super_mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.quants.shape[0], self.quants.shape[1]

    @property
    def parts(self) -> dict[str, torch.Tensor]:
        """The tensors that hold the matrix, by name (``PARTS``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def with_parts(self, parts: dict[str, torch.Tensor]) -> BlockQuantized:
        """This matrix with ``parts`` in place of its own of the same names."""
        return from_parts(self.format, {**self.parts, **parts})

    def dequantize(self) -> torch.Tensor:
        """float32 weights, computed in the order and rounding of ``gguf.quants.dequantize``."""
        in_features = self.shape[1]
        offset = OFFSETS.get(self.format, 0)
        quants = (self.quants.to(torch.int16) - offset).float() if offset else self.quants.float()
        scales = _times_super(self.super_scales, self.scales)
        weights = scales.repeat_interleave(in_features // scales.shape[1], dim=1) * quants
        if self.mins is not None:
            mins = -_times_super(self.super_mins, self.mins) if self.super_mins is not None else self.mins.float()
            weights = weights + mins.repeat_interleave(in_features // mins.shape[1], dim=1)
        return weights

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """float32 rows ``indices`` (an embedding lookup), as ``dequantize()[indices]`` gives them."""
        return self.with_parts({name: part[indices] for name, part in self.parts.items()}).dequantize()

    def narrow(self, dim: int, start: int, stop: int) -> BlockQuantized:
        """Rows (``dim`` 0) or whole (super-)blocks of columns (``dim`` 1) ``start:stop``."""
        if dim == 0:
            return self.with_parts({name: part[start:stop] for name, part in self.parts.items()})
        narrowed = {}
        for name, part in self.parts.items():
            unit = self.shape[1] // part.shape[1]
            if start % unit or stop % unit:
                raise ValueError(f"columns {start}:{stop} split a block of {unit}")
            narrowed[name] = part[:, start // unit : stop // unit]
        return self.with_parts(narrowed)

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The parts under names derived from ``name``, for a safetensors file (``from_parts`` reads them back)."""
        return {f"{name}.{self.format}.{part}": tensor for part, tensor in self.parts.items()}


def _times_super(supers: torch.Tensor | None, subs: torch.Tensor) -> torch.Tensor:
    """Per block, float32 ``supers`` (of the block's super-block) times ``subs``, or ``subs`` alone."""
    if supers is None:
        return subs.float()
    return supers.float().repeat_interleave(subs.shape[1] // supers.shape[1], dim=1) * subs.float()


def stack_blocks(blocks: list[BlockQuantized]) -> BlockQuantized:
    """Matrices of one format stacked by rows."""
    names = blocks[0].parts
    return blocks[0].with_parts({name: torch.cat([b.parts[name] for b in blocks]) for name in names})


AS_Q8_0 = ("q8_0", "q4_0", "q5_0")
"""The formats whose weights Q8_0 holds exactly (same scale, the integers ``q - offset``)."""


def as_q8_0(blocks: BlockQuantized) -> BlockQuantized:
    """Q4_0 or Q5_0 blocks as the Q8_0 blocks of the same weights."""
    if blocks.format == "q8_0":
        return blocks
    if blocks.format not in AS_Q8_0:
        raise ValueError(f"{blocks.format} blocks are not Q8_0 blocks of the same weights")
    quants = (blocks.quants.to(torch.int16) - OFFSETS[blocks.format]).to(torch.int8)
    return BlockQuantized("q8_0", blocks.scales, quants)


def split_part_name(stored: str) -> tuple[str, str, str] | None:
    """``(name, format, part)`` of a name ``BlockQuantized.tensors`` made, else None."""
    pieces = stored.rsplit(".", 2)
    if len(pieces) == 3 and pieces[1] in FORMATS and pieces[2] in PARTS:
        return pieces[0], pieces[1], pieces[2]
    return None


def from_parts(fmt: str, parts: dict[str, torch.Tensor]) -> BlockQuantized:
    get = parts.get
    return BlockQuantized(fmt, parts["scales"], parts["quants"], get("mins"), get("super_scales"), get("super_mins"))


ROTARY_PERMUTED = ("llama", "smollm3")
"""Architectures whose q and k rows llama.cpp's converter interleaves (its Llama converter and those built on it)."""
NORM_SHIFTED = ("gemma3",)
"""Architectures whose RMSNorm weights llama.cpp stores as ``1 + w`` (Gemma's norms multiply by that)."""


def _hf_names(architecture: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for the families of ``scheduler.model.architecture``, from the gguf
    package's name table (Phi-3's projections fused, Gemma 3's four norms a layer)."""
    import gguf

    arch = next((arch for arch, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ValueError(f"the gguf package does not know the architecture {architecture!r}")
    table = gguf.get_tensor_name_map(arch, num_layers)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    fused = architecture == "phi3"  # its gate_up_proj and Llama's up_proj are both ffn_up
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names += [f"{p}{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm")]
        names += [f"{p}{norm}.weight" for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm")]
        names += [f"{p}self_attn.{x}_norm.weight" for x in "qk"]
        if fused:
            names += [f"{p}self_attn.qkv_proj.weight", f"{p}mlp.gate_up_proj.weight"]
        else:
            names += [f"{p}self_attn.{x}_proj.{kind}" for x in "qkv" for kind in ("weight", "bias")]
            names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up")]
        names += [f"{p}self_attn.o_proj.{kind}" for kind in ("weight", "bias")] + [f"{p}mlp.down_proj.weight"]
    mapping: dict[str, str] = {}
    for hf_name in names:  # the first name wins: Llama's MLP norm is ffn_norm, which Gemma names pre_feedforward
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_stem = table.get_name(stem)
        if gguf_stem is not None:
            mapping.setdefault(f"{gguf_stem}.{suffix}", hf_name)
    return mapping


def read_gguf_weights(contents: GgufFile, keep_blocks: bool = True) -> dict[str, torch.Tensor | BlockQuantized]:
    """Every tensor of a GGUF file (``contents``, as ``read_gguf_file`` read it), under its Hugging Face name: the
    block formats (``FORMATS``) as blocks, F16 and BF16 as float16 and bfloat16 tensors (packed as they are: the same
    bits as float32, half the bytes), the rest de-quantised to float32; without ``keep_blocks``, every tensor
    de-quantised to float32 by ``gguf.quants.dequantize`` itself (the reference the blocks are checked against).
    Llama's (and SmolLM3's) q and k rows are put back in Hugging Face's order (llama.cpp's converter interleaves the
    two halves of each head's rotary pairs); Gemma's norms back from ``1 + w`` to ``w``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    metadata = contents.metadata
    architecture = metadata["general.architecture"]
    hf_names = _hf_names(architecture, int(metadata[f"{architecture}.block_count"]))
    heads = int(metadata[f"{architecture}.attention.head_count"])
    kv_heads = int(metadata[f"{architecture}.attention.head_count_kv"])
    weights: dict[str, torch.Tensor | BlockQuantized] = {}
    for tensor in contents.tensors:
        if tensor.name in ROPE_FACTOR_TENSORS.values():  # part of the config (``gguf_config``)
            continue
        if tensor.name not in hf_names:
            raise ValueError(f"the GGUF file holds a tensor {tensor.name!r} this model runner does not know")
        raw = np.asarray(tensor.data)
        blocks = read_blocks(raw, tensor.tensor_type) if keep_blocks else None
        value: torch.Tensor | BlockQuantized
        if blocks is not None:
            value = blocks
        elif keep_blocks and tensor.tensor_type in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
            value = _sixteen_bits(raw, tensor.tensor_type == GGMLQuantizationType.BF16)
        else:
            value = torch.from_numpy(np.array(dequantize(raw, tensor.tensor_type), dtype=np.float32))
        if architecture in ROTARY_PERMUTED and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            value = _take_rows(value, _rotary_order(value.shape[0], heads if "attn_q" in tensor.name else kv_heads))
        if architecture in NORM_SHIFTED and tensor.name.endswith("norm.weight") and isinstance(value, torch.Tensor):
            value = value - 1  # as transformers' GGUF loader: the Hugging Face weight, to which the forward adds 1
        weights[hf_names[tensor.name]] = value
    return weights


BLOCK_BYTES = {"q8_0": 34, "q4_1": 20, "q4_0": 18, "q5_0": 22, "q5_1": 24, "q4_k": 144, "q5_k": 176, "q6_k": 210}
"""Bytes of one stored block (a k-quant: one super-block of 256)."""


def read_blocks(raw: np.ndarray, tensor_type: int) -> BlockQuantized | None:
    """A GGUF tensor's bytes ``[N, row bytes]`` of a block format as ``BlockQuantized`` (None for other types),
    unpacked as ``gguf.quants`` de-quantises them."""
    from gguf import GGMLQuantizationType

    fmt = GGMLQuantizationType(tensor_type).name.lower()
    if fmt not in FORMATS:
        return None
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(rows, -1, BLOCK_BYTES[fmt])  # a copy of the map
    flat = lambda t: t.reshape(rows, -1)  # noqa: E731
    if fmt == "q8_0":
        return BlockQuantized(fmt, _halves(blocks[..., :2]), flat(blocks[..., 2:]).view(torch.int8))
    if fmt in ("q4_0", "q4_1", "q5_0", "q5_1"):
        head = {"q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8}[fmt]
        quants = _nibbles(blocks[..., head:])  # element i in the low nibble of byte i, element i + 16 in its high
        if fmt.startswith("q5"):
            quants |= _bits(blocks[..., head - 4 : head], 32) << 4
        mins = _halves(blocks[..., 2:4]) if fmt.endswith("_1") else None
        return BlockQuantized(fmt, _halves(blocks[..., :2]), flat(quants), mins)
    if fmt in ("q4_k", "q5_k"):
        from gguf.quants import Q4_K

        sc, m = (torch.from_numpy(part) for part in Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12).numpy()))
        # 4 chunks of 32 bytes: sub-block 2c in the low nibbles of chunk c, 2c + 1 in the high ones
        low = blocks[..., -128:].reshape(rows, -1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
        quants = (low & 15).reshape(rows, -1, 8, 32)
        if fmt == "q5_k":  # bit j of byte i: element i of sub-block j
            high = blocks[..., 16:48].reshape(rows, -1, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(8, 1)
            quants = quants | ((high & 1) << 4)
        return BlockQuantized(
            fmt,
            sc.reshape(rows, -1),
            flat(quants),
            m.reshape(rows, -1),
            _halves(blocks[..., :2]),
            _halves(blocks[..., 2:4]),
        )
    # q6_k: low nibbles of 2 x 128 elements in 2 x 64 bytes (low then high nibbles), their 2 high bits in 2 x 32
    low = blocks[..., :128].reshape(rows, -1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    quants = (low & 15).reshape(rows, -1, 256) | ((high & 3) << 4).reshape(rows, -1, 256)
    scales = flat(blocks[..., 192:208]).view(torch.int8)
    return BlockQuantized(fmt, scales, flat(quants), super_scales=_halves(blocks[..., 208:210]))


def _sixteen_bits(raw: np.ndarray, bfloat16: bool) -> torch.Tensor:
    """An F16 tensor (float16 values) or a BF16 one (its bytes) as a float16 or bfloat16 tensor of its own memory."""
    copy = torch.from_numpy(np.array(raw))
    return copy.view(torch.bfloat16) if bfloat16 else copy


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[N, blocks, 16]`` bytes -> ``[N, blocks, 32]``: the low nibbles, then the high ones."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def _bits(little_endian: torch.Tensor, count: int) -> torch.Tensor:
    """``[N, blocks, count / 8]`` bytes -> uint8 ``[N, blocks, count]``: bit i of the little-endian integer."""
    bits = little_endian.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)  # [.., byte, bit]
    return (bits & 1).reshape(*little_endian.shape[:-1], count)


def _halves(two_bytes: torch.Tensor) -> torch.Tensor:
    """``[N, blocks, 2]`` little-endian bytes -> float16 ``[N, blocks]``."""
    return two_bytes.contiguous().view(torch.float16).squeeze(-1)


def _rotary_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's permutation of a q or k projection (as transformers' GGUF loader)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _take_rows(value: torch.Tensor | BlockQuantized, order: torch.Tensor) -> torch.Tensor | BlockQuantized:
    if isinstance(value, torch.Tensor):
        return value[order]
    return value.with_parts({name: part[order] for name, part in value.parts.items()})
