"""A GGUF file's metadata and tensors as ``gguf.GGUFReader`` reads them, without its parse of the vocabulary.

``gguf.GGUFReader`` builds numpy views for every string of every metadata array: the embedded model's 49,152 tokens
and 48,900 merges took 3.2 s of its first start (Intel Xeon, docs/benchmarks.md), and a 151k-token vocabulary three
times that. The model runner reads no string array (the tokenizer is transformers' to convert), so here they are
stepped over and stand as their length, as in transformers' own GGUF metadata reader; every other value is a Python
value, and every tensor is the view of the mapped file ``gguf.GGUFReader`` gives it (the same dtype and shape:
elements for the plain types, bytes per row for the block formats).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
"""GGUF's fixed-size metadata value types, as ``struct`` formats."""
_STRING, _ARRAY = 8, 9
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
"""Tensor types stored as elements; the others (the block formats, BF16) are bytes."""
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray


@dataclass(frozen=True)
class GgufFile:
    metadata: dict[str, Any]
    tensors: list[GgufTensor]


def read_gguf_file(path: Path) -> GgufFile:
    """``path``'s metadata (string arrays as their length) and tensors (read-only views of the mapped file)."""
    with open(path, "rb") as file:
        blob = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    if blob[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic bytes)")
    version, tensor_count, metadata_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
    cursor = _Cursor(blob, 24)
    metadata = {}
    for _ in range(metadata_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("I"))
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.unpack("Q") for _ in range(cursor.unpack("I"))]
        table.append((name, dims, GGMLQuantizationType(cursor.unpack("I")), cursor.unpack("Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cursor.at // alignment) * alignment
    return GgufFile(metadata, [_tensor(blob, data_start, *entry) for entry in table])


def _tensor(
    blob: mmap.mmap, data_start: int, name: str, dims: list[int], kind: GGMLQuantizationType, offset: int
) -> GgufTensor:
    shape = tuple(reversed(dims))  # GGUF lists the fastest-moving dimension first
    elements = int(np.prod(dims))
    if kind in _ELEMENT_DTYPES:
        dtype, count = _ELEMENT_DTYPES[kind], elements
    else:
        block_size, type_size = GGML_QUANT_SIZES[kind]
        dtype, count, shape = np.uint8, elements * type_size // block_size, quant_shape_to_byte_shape(shape, kind)
    data = np.frombuffer(blob, dtype=dtype, count=count, offset=data_start + offset).reshape(shape)
    return GgufTensor(name, kind, data)


class _Cursor:
    """Little-endian values read one after another from ``blob``."""

    def __init__(self, blob: mmap.mmap, at: int) -> None:
        self.blob, self.at = blob, at

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(f"<{fmt}", self.blob, self.at)
        self.at += struct.calcsize(f"<{fmt}")
        return value

    def string(self) -> str:
        length = self.unpack("Q")
        self.at += length
        return self.blob[self.at - length : self.at].decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"a GGUF metadata value of unknown type {kind}")
        element_kind, count = self.unpack("I"), self.unpack("Q")
        if element_kind in _SCALAR_FORMATS:
            fmt = f"<{count}{_SCALAR_FORMATS[element_kind]}"
            values = list(struct.unpack_from(fmt, self.blob, self.at))
            self.at += struct.calcsize(fmt)
            return values
        if element_kind != _STRING:
            raise ValueError(f"a GGUF metadata array of type {element_kind}")
        for _ in range(count):
            self.at += 8 + struct.unpack_from("<Q", self.blob, self.at)[0]
        return count
