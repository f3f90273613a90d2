"""The kernels one at a time, on float32 CPU tensors: matmuls over packed weights, attention over a token KV pool,
RMSNorm, the gated activations and soft-capping. Each output row is bit for bit its result alone (``cpu_kernels``).

``threads`` (every kernel takes it): at most this many threads, ``library.kernel_threads()`` by default."""

from __future__ import annotations

import ctypes
import enum

import torch

from cpu_kernels.library import kernel_threads, loaded
from cpu_kernels.packed_weights import MatmulWeight, PackedWeight
from cpu_kernels.structs import packed_ref

KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The KV pool's element types and their codes in the C++ source (``csrc/kv_element.h``'s ``KvDtype``)."""


def kv_dtype_code(k_pool: torch.Tensor, v_pool: torch.Tensor) -> int:
    """The C++ code of the pools' element type; refuses pools of other types, of two types, or not contiguous."""
    if k_pool.dtype != v_pool.dtype or k_pool.dtype not in KV_DTYPES:
        raise ValueError(f"KV pools hold float32, bfloat16 or float16 alike, not {k_pool.dtype} and {v_pool.dtype}")
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("KV pools must be contiguous")
    return KV_DTYPES[k_pool.dtype]


def kv_store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Contiguous float32 ``x`` as a KV pool of ``dtype`` stores it (``csrc/kv_element.h``: to nearest, ties to even,
    the same bits on every build)."""
    if x.dtype != torch.float32 or not x.is_contiguous() or dtype not in KV_DTYPES:
        raise ValueError(f"kv_store rounds contiguous float32 to {', '.join(map(str, KV_DTYPES))}")
    out = torch.empty(x.shape, dtype=dtype)
    loaded().invariant_kv_store(x.data_ptr(), x.numel(), KV_DTYPES[dtype], out.data_ptr())
    return out


class Activation(enum.IntEnum):
    """The MLP's activation of its gate (values shared with the C++ source)."""

    SILU = 0
    GELU_TANH = 1


def check_rows(x: torch.Tensor, width: int, what: str) -> None:
    """Refuse anything but float32 ``[rows, width]`` with unit column stride, naming ``what`` takes it."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"{what} takes float32 [rows, {width}] with unit column stride, got {x.dtype} {x.shape}")


def matmul(x: torch.Tensor, weight: MatmulWeight, threads: int | None = None) -> torch.Tensor:
    """``x @ W.T``: float32 ``[M, in_features]`` -> ``[M, out_features]``, each row independent of the others."""
    check_rows(x, weight.in_features, "matmul")
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    if x.shape[0]:
        loaded().invariant_packed_matmul(
            ctypes.byref(packed_ref(weight)),
            x.data_ptr(),
            x.shape[0],
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            threads or kernel_threads(),
        )
    return out


def attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    rows: torch.Tensor,
    row_start: torch.Tensor,
    num_keys: torch.Tensor,
    scale: float,
    threads: int | None = None,
) -> torch.Tensor:
    """Each query token over its own pool rows: ``q`` ``[T, H, D]`` float32, pools ``[R, H_kv, D]`` of float32,
    bfloat16 or float16 (read exactly as float32); token ``t`` attends to
    ``rows[row_start[t] : row_start[t] + num_keys[t]]`` (int64). Returns ``[T, H * D]``."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or not loaded().invariant_attention_supports(head_dim, heads // kv_heads):
        raise ValueError(
            f"attention runs head_dim 16, 32, 64, 96, 128 or 256 and 1 to 8 query heads per KV head; got "
            f"{head_dim} and {heads} over {kv_heads}"
        )
    if not q.is_contiguous() or q.dtype != torch.float32:
        raise ValueError(f"attention takes a contiguous float32 q, not {q.dtype} {tuple(q.shape)}")
    kv_dtype = kv_dtype_code(k_pool, v_pool)
    for index in (rows, row_start, num_keys):
        if index.dtype != torch.int64 or not index.is_contiguous():
            raise ValueError("attention's row tables are contiguous int64")
    out = torch.empty(tokens, heads * head_dim, dtype=torch.float32)
    if tokens:
        loaded().invariant_attention(
            q.data_ptr(),
            tokens,
            heads,
            head_dim,
            k_pool.data_ptr(),
            v_pool.data_ptr(),
            kv_dtype,
            kv_heads,
            rows.data_ptr(),
            row_start.data_ptr(),
            num_keys.data_ptr(),
            scale,
            out.data_ptr(),
            threads or kernel_threads(),
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int | None = None) -> torch.Tensor:
    """transformers' RMSNorm of each row of float32 ``[T, N]``."""
    width = weight.shape[0]
    check_rows(x, width, "rms_norm")
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"rms_norm takes a contiguous float32 weight, not {weight.dtype}")
    out = torch.empty(x.shape[0], width, dtype=torch.float32)
    if x.shape[0]:
        loaded().invariant_rms_norm(
            x.data_ptr(), x.shape[0], width, x.stride(0), weight.data_ptr(), eps, out.data_ptr(), width,
            threads or kernel_threads(),
        )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for contiguous float32 ``[T, 2 N]`` holding gate then up."""
    return _gated(Activation.SILU, gate_up, threads)


def gelu_tanh_mul(gate_up: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (Gemma's MLP) for contiguous float32 ``[T, 2 N]`` holding gate then
    up."""
    return _gated(Activation.GELU_TANH, gate_up, threads)


def _gated(activation: Activation, gate_up: torch.Tensor, threads: int | None) -> torch.Tensor:
    if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
        raise ValueError(
            f"{activation.name.lower()} takes contiguous float32 [rows, 2 N]; got {gate_up.dtype} "
            f"{tuple(gate_up.shape)}"
        )
    width = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], width, dtype=torch.float32)
    kernel = {Activation.SILU: "invariant_silu_mul", Activation.GELU_TANH: "invariant_gelu_tanh_mul"}[activation]
    if gate_up.shape[0]:
        getattr(loaded(), kernel)(
            gate_up.data_ptr(), gate_up.shape[0], width, out.data_ptr(), threads or kernel_threads()
        )
    return out


def q8_0_rows(
    scales: torch.Tensor, quants: torch.Tensor, ids: torch.Tensor, threads: int | None = None
) -> torch.Tensor:
    """Rows ``ids`` (int64) of a Q8_0 matrix (float16 ``scales`` ``[rows, K / 32]``, int8 ``quants`` ``[rows, K]``) as
    float32 ``[len(ids), K]``: an embedding lookup, with the bits of ``scales.float()`` repeated times
    ``quants.float()``. Raises IndexError for an id that is not a row."""
    rows, width = quants.shape
    if scales.dtype != torch.float16 or quants.dtype != torch.int8 or width % 32 or scales.shape != (rows, width // 32):
        raise ValueError("Q8_0 rows take float16 scales [rows, K / 32] and int8 quants [rows, K], K a multiple of 32")
    if not (scales.is_contiguous() and quants.is_contiguous() and ids.is_contiguous()) or ids.dtype != torch.int64:
        raise ValueError("Q8_0 rows take contiguous scales, quants and int64 ids")
    out = torch.empty(ids.shape[0], width, dtype=torch.float32)
    found = loaded().invariant_q8_0_rows(
        scales.data_ptr(), quants.data_ptr(), rows, width, ids.data_ptr(), ids.shape[0], out.data_ptr(),
        threads or kernel_threads(),
    )  # fmt: skip
    if not found:
        raise IndexError(f"an id is not one of the {rows} rows")
    return out


def packed_rows(weight: PackedWeight, ids: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """Rows ``ids`` (int64) of a packed weight (one format, not a stack) as float32 ``[len(ids), in_features]``,
    its weights as gguf's de-quantisation gives them: a tied model's embedding lookup from its head's panels, which
    then hold the matrix alone. Raises IndexError for an id that is not a row."""
    if not ids.is_contiguous() or ids.dtype != torch.int64:
        raise ValueError("packed rows take contiguous int64 ids")
    out = torch.empty(ids.shape[0], weight.in_features, dtype=torch.float32)
    if not loaded().invariant_packed_rows(
        ctypes.byref(packed_ref(weight)), ids.data_ptr(), ids.shape[0], out.data_ptr(), threads or kernel_threads()
    ):
        raise IndexError(f"an id is not one of the {weight.out_features} rows")
    return out


def softcap(x: torch.Tensor, cap: float, threads: int | None = None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` of float32 ``[T, N]`` (unit column stride), in place; returns ``x``. Gemma's
    soft-capping of the logits."""
    check_rows(x, x.shape[1] if x.dim() == 2 else -1, "softcap")
    if x.numel():
        loaded().invariant_softcap(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), cap, threads or kernel_threads())
    return x
