"""The C++ side's structs as ctypes sees them (``csrc/packed_matmul.h``'s ``PackedRef``, ``csrc/decoder_layer.h``'s
``LayerRef``, ``ModelShape`` and ``BatchRef``): field for field, in the same order."""

from __future__ import annotations

import ctypes
import itertools

from cpu_kernels.packed_weights import MatmulWeight, WeightStack


class PackedRef(ctypes.Structure):
    pass


PackedRef._fields_ = [
    ("data", ctypes.c_void_p),
    ("format", ctypes.c_int32),
    ("out_features", ctypes.c_int64),
    ("in_features", ctypes.c_int64),
    ("next", ctypes.POINTER(PackedRef)),  # the part stacked below (a WeightStack), or null
]


class LayerRef(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv_bias", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("attention_out_norm", ctypes.c_void_p),
        ("mlp_out_norm", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("rope_dim", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("qkv", PackedRef),
        ("o_proj", PackedRef),
        ("gate_up", PackedRef),
        ("down", PackedRef),
    ]


class ModelShape(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("activation", ctypes.c_int32),
        ("kv_dtype", ctypes.c_int32),
    ]


class BatchRef(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("new_rows", ctypes.c_void_p),
        ("key_rows", ctypes.c_void_p),
        ("key_starts", ctypes.c_void_p),
        ("num_keys", ctypes.c_void_p),
    ]


def packed_ref(weight: MatmulWeight) -> PackedRef:
    """The C++ view of ``weight``: a stack's parts chained through ``next`` (each ref keeps the one it points to)."""
    refs = [
        PackedRef(part.data.data_ptr(), int(part.format), part.out_features, part.in_features, None)
        for part in (weight.parts if isinstance(weight, WeightStack) else (weight,))
    ]
    for upper, lower in itertools.pairwise(refs):
        upper.next = ctypes.pointer(lower)
    return refs[0]
