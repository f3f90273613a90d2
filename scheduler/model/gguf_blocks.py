"""A GGUF file's quantised weights as they are: its Q8_0 and Q4_1 blocks, never de-quantised to float.

The model runner multiplies these blocks directly (``triton_ops.invariant_cpu``), so it streams the file's ~0.6 bytes
per weight instead of a float32 copy's 4, and computes with exactly the weights transformers de-quantises to.
Tensors of other types (norms in F32, other quantisations) are read as float32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

BLOCK = 32
"""Weights per block along the input dimension; each block has its own float16 scale (and Q4_1 minimum)."""
FORMATS = ("q8_0", "q4_1")


@dataclass(frozen=True)
class BlockQuantized:
    """A ``[out_features, in_features]`` matrix in GGUF blocks of 32 along ``in_features``:
    ``w[n, 32 b + i] = scales[n, b] * quants[n, 32 b + i]`` (``+ mins[n, b]`` for Q4_1).

    ``quants`` are int8 (Q8_0) or uint8 in 0..15 (Q4_1), one per weight; ``scales`` and ``mins`` float16.
    """

    format: str
    scales: torch.Tensor
    quants: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.quants.shape[0], self.quants.shape[1]

    def dequantize(self) -> torch.Tensor:
        """float32 weights, computed as the GGUF reference does (scale times quant, plus the minimum)."""
        weights = self.scales.float().repeat_interleave(BLOCK, dim=1) * self.quants.float()
        if self.mins is not None:
            weights = weights + self.mins.float().repeat_interleave(BLOCK, dim=1)
        return weights

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """float32 rows ``indices`` (an embedding lookup), as ``dequantize()[indices]`` gives them."""
        return replace(
            self,
            scales=self.scales[indices],
            quants=self.quants[indices],
            mins=None if self.mins is None else self.mins[indices],
        ).dequantize()

    def narrow(self, dim: int, start: int, stop: int) -> BlockQuantized:
        """Rows (``dim`` 0) or whole blocks of columns (``dim`` 1) ``start:stop``."""
        if dim == 0:
            return BlockQuantized(
                self.format,
                self.scales[start:stop],
                self.quants[start:stop],
                None if self.mins is None else self.mins[start:stop],
            )
        if start % BLOCK or stop % BLOCK:
            raise ValueError(f"columns {start}:{stop} split a block of {BLOCK}")
        blocks = slice(start // BLOCK, stop // BLOCK)
        return BlockQuantized(
            self.format,
            self.scales[:, blocks],
            self.quants[:, start:stop],
            None if self.mins is None else self.mins[:, blocks],
        )

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The parts under names derived from ``name``, for a safetensors file (``from_tensors`` reads them back)."""
        parts = {f"{name}.{self.format}.quants": self.quants, f"{name}.{self.format}.scales": self.scales}
        if self.mins is not None:
            parts[f"{name}.{self.format}.mins"] = self.mins
        return parts


def split_part_name(stored: str) -> tuple[str, str, str] | None:
    """``(name, format, part)`` of a name ``BlockQuantized.tensors`` made, else None."""
    pieces = stored.rsplit(".", 2)
    if len(pieces) == 3 and pieces[1] in FORMATS and pieces[2] in ("quants", "scales", "mins"):
        return pieces[0], pieces[1], pieces[2]
    return None


def from_parts(fmt: str, parts: dict[str, torch.Tensor]) -> BlockQuantized:
    return BlockQuantized(fmt, parts["scales"], parts["quants"], parts.get("mins"))


def _hf_names(architecture: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for a Llama-style model, from the gguf package's name table."""
    import gguf

    arch = next((arch for arch, name in gguf.MODEL_ARCH_NAMES.items() if name == architecture), None)
    if arch is None:
        raise ValueError(f"the gguf package does not know the architecture {architecture!r}")
    table = gguf.get_tensor_name_map(arch, num_layers)
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
        names += [f"{p}self_attn.{x}_proj.{kind}" for x in "qkvo" for kind in ("weight", "bias")]
        names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    mapping = {}
    for hf_name in names:
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_stem = table.get_name(stem)
        if gguf_stem is not None:
            mapping[f"{gguf_stem}.{suffix}"] = hf_name
    return mapping


def read_gguf_weights(reader: Any) -> dict[str, torch.Tensor | BlockQuantized]:
    """Every tensor a ``gguf.GGUFReader`` reads, under its Hugging Face name: Q8_0 and Q4_1 as blocks, the rest
    de-quantised to float32. Llama's q and k rows are put back in Hugging Face's order (llama.cpp's converter
    interleaves the two halves of each head's rotary pairs)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    num_layers = int(reader.fields[f"{architecture}.block_count"].parts[-1][0])
    hf_names = _hf_names(architecture, num_layers)
    heads = int(reader.fields[f"{architecture}.attention.head_count"].parts[-1][0])
    kv_heads = int(reader.fields[f"{architecture}.attention.head_count_kv"].parts[-1][0])
    weights: dict[str, torch.Tensor | BlockQuantized] = {}
    for tensor in reader.tensors:
        if tensor.name not in hf_names:
            raise ValueError(f"the GGUF file holds a tensor {tensor.name!r} this model runner does not know")
        raw = np.asarray(tensor.data)
        value: torch.Tensor | BlockQuantized
        if tensor.tensor_type == GGMLQuantizationType.Q8_0:
            blocks = torch.from_numpy(raw.copy()).view(raw.shape[0], -1, 34)
            value = BlockQuantized(
                "q8_0", _halves(blocks[..., :2]), blocks[..., 2:].reshape(raw.shape[0], -1).view(torch.int8)
            )
        elif tensor.tensor_type == GGMLQuantizationType.Q4_1:
            blocks = torch.from_numpy(raw.copy()).view(raw.shape[0], -1, 20)
            packed = blocks[..., 4:]  # element i in the low nibble of byte i, element i + 16 in its high nibble
            quants = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(raw.shape[0], -1)
            value = BlockQuantized("q4_1", _halves(blocks[..., :2]), quants, _halves(blocks[..., 2:4]))
        else:
            value = torch.from_numpy(np.array(dequantize(raw, tensor.tensor_type), dtype=np.float32))
        if architecture == "llama" and tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            value = _take_rows(value, _rotary_order(value.shape[0], heads if "attn_q" in tensor.name else kv_heads))
        weights[hf_names[tensor.name]] = value
    return weights


def _halves(two_bytes: torch.Tensor) -> torch.Tensor:
    """``[N, blocks, 2]`` little-endian bytes -> float16 ``[N, blocks]``."""
    return two_bytes.contiguous().view(torch.float16).squeeze(-1)


def _rotary_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's permutation of a q or k projection (as transformers' GGUF loader)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _take_rows(value: torch.Tensor | BlockQuantized, order: torch.Tensor) -> torch.Tensor | BlockQuantized:
    if isinstance(value, torch.Tensor):
        return value[order]
    return BlockQuantized(
        value.format,
        value.scales[order],
        value.quants[order],
        None if value.mins is None else value.mins[order],
    )
