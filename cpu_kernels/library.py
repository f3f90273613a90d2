"""The kernels' library in this process: loaded once (``load``: built first where this machine has no build yet,
``cpu_kernels.build``), with the signatures of its entry points (``csrc/cpu_kernels.cpp``) declared; and the
thread count every kernel call takes by default.

Its threads are a pool of its own (``kernel_threads()`` per call): see ``csrc/cpu_kernels.cpp``'s header for why not
OpenMP.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

from cpu_kernels import packed_weights
from cpu_kernels.build import TARGETS, build
from cpu_kernels.structs import BatchRef, LayerRef, ModelShape, PackedRef

logger = logging.getLogger(__name__)

_library: ctypes.CDLL | None = None
_kernel_threads: int | None = None


def kernel_threads() -> int:
    """The kernels' thread count: ``set_kernel_threads``'s, else torch's intra-op count."""
    return _kernel_threads or torch.get_num_threads()


def set_kernel_threads(threads: int | None) -> None:
    """Fix the kernels' thread count whatever torch's own becomes (None: follow torch's again). A serving process
    runs torch's small ops (sampling, logprobs) on one thread while the kernels use the cores, because torch's
    OpenMP team spins for a while after each of its parallel ops, on the cores the next forward needs."""
    global _kernel_threads
    if threads is not None and threads < 1:
        raise ValueError(f"the kernels need at least one thread, got {threads}")
    _kernel_threads = threads


def load(build_dir: Path, target: str = "native") -> ctypes.CDLL:
    """The kernels, built into ``build_dir`` on first use on this machine for ``target`` (one of ``TARGETS``); a
    process loads one build, and later calls return it."""
    global _library
    if target not in TARGETS:
        raise ValueError(f"unknown kernel target {target!r}; one of {sorted(TARGETS)}")
    if _library is None:
        library = ctypes.CDLL(str(build(build_dir, target)))
        _declare(library)
        logger.info("batch-invariant CPU kernels: %s build", library.invariant_isa().decode())
        packed_weights.set_group_panels(library.invariant_group_panels())  # block weights packed for this build
        _library = library
    return _library


def _declare(library: ctypes.CDLL) -> None:
    """The entry points' argument and result types (``csrc/cpu_kernels.cpp``)."""
    i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float
    library.invariant_isa.restype = ctypes.c_char_p
    library.invariant_row_tile.restype = i32
    library.invariant_weight_row_tile.argtypes = [i32]
    library.invariant_weight_row_tile.restype = i32
    library.invariant_group_panels.restype = i32
    library.invariant_attention_supports.argtypes = [i64, i64]
    library.invariant_attention_supports.restype = i32
    library.invariant_attention.argtypes = [ptr, i64, i64, i64, ptr, ptr, i32, i64, ptr, ptr, ptr, f32, ptr, i32]
    library.invariant_kv_store.argtypes = [ptr, i64, i32, ptr]
    library.invariant_kv_store.restype = i32
    library.invariant_rms_norm.argtypes = [ptr, i64, i64, i64, ptr, f32, ptr, i64, i32]
    library.invariant_silu_mul.argtypes = [ptr, i64, i64, ptr, i32]
    library.invariant_gelu_tanh_mul.argtypes = [ptr, i64, i64, ptr, i32]
    library.invariant_softcap.argtypes = [ptr, i64, i64, i64, f32, i32]
    library.invariant_q8_0_rows.argtypes = [ptr, ptr, i64, i64, ptr, i64, ptr, i32]
    library.invariant_q8_0_rows.restype = i32
    library.invariant_mask_logits.argtypes = [ptr, i32, ctypes.c_uint32, i64, i64, ptr, i64, i64, ptr, i64, i32]
    library.invariant_exponentials.argtypes = [ptr, i64, i64, ptr, i32]
    library.invariant_gumbel_race.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i32]
    library.invariant_shm_all_gather.argtypes = [ptr, i32, i32, i64, i64, ptr, i64, ptr, ptr]
    library.invariant_shm_all_gather.restype = i32
    shape, layer, batch = ctypes.POINTER(ModelShape), ctypes.POINTER(LayerRef), ctypes.POINTER(BatchRef)
    packed = ctypes.POINTER(PackedRef)
    library.invariant_packed_matmul.argtypes = [packed, ptr, i64, i64, ptr, i64, i32]
    library.invariant_packed_rows.argtypes = [packed, ptr, i64, ptr, i32]
    library.invariant_packed_rows.restype = i32
    library.invariant_attention_block.argtypes = [shape, layer, batch, ptr, ptr, ptr, ptr, i64, ptr, i32]
    library.invariant_mlp_block.argtypes = [shape, layer, i64, ptr, ptr, i32]
    decoder_args: list[Any] = [shape, layer, i32, batch, ptr, ptr, ptr, i64]
    library.invariant_decoder.argtypes = [*decoder_args, i32]
    library.invariant_decoder_logits.argtypes = [*decoder_args, ptr, i64, ptr, packed, ptr, i64, ptr, i32]
    library.invariant_warm_decoder.argtypes = [layer, i32, packed, i64, i32]
    library.invariant_warm_bytes.argtypes = []
    library.invariant_warm_bytes.restype = i64
    library.invariant_set_warm_bytes.argtypes = [i64]
    for name in (
        "invariant_packed_matmul",
        "invariant_attention",
        "invariant_rms_norm",
        "invariant_silu_mul",
        "invariant_gelu_tanh_mul",
        "invariant_softcap",
        "invariant_attention_block",
        "invariant_mlp_block",
        "invariant_decoder",
        "invariant_decoder_logits",
        "invariant_warm_decoder",
        "invariant_set_warm_bytes",
        "invariant_mask_logits",
        "invariant_exponentials",
        "invariant_gumbel_race",
    ):
        getattr(library, name).restype = None


def is_loaded() -> bool:
    """Whether this process has loaded the kernels (``load``)."""
    return _library is not None


def loaded() -> ctypes.CDLL:
    """The loaded library, for the wrappers that call its entry points."""
    if _library is None:
        raise RuntimeError("cpu_kernels.library.load(build_dir) must be called before the kernels")
    return _library


def cache_warm_bytes() -> int:
    """The most bytes of a forward's next weights the kernels ask the caches for while the memory would idle
    (``csrc/weight_warming.h``): by default half this machine's last-level cache; 0 where warming is off."""
    return int(loaded().invariant_warm_bytes())


def set_cache_warm_bytes(num_bytes: int) -> None:
    """Set ``cache_warm_bytes`` for this process (0: warm nothing). Warming asks for bytes ahead and computes
    nothing, so no output depends on it; benchmarks turn it off to compare."""
    if num_bytes < 0:
        raise ValueError(f"a byte count, not {num_bytes}")
    loaded().invariant_set_warm_bytes(num_bytes)


def isa() -> str:
    """The instruction set the loaded build uses: ``avx512-vnni``, ``avx512``, ``avx2-vnni``, ``avx2`` or
    ``scalar`` (the block formats' 8-bit dot products: VNNI, or vpmaddubsw and vpmaddwd)."""
    return str(loaded().invariant_isa().decode())


def row_tile() -> int:
    """Rows of ``x`` one pass over a weight tile multiplies together: a matmul of up to this many rows streams its
    weights as often as a one-row matmul does (decode is bound by those reads, so such rows come nearly free)."""
    return int(loaded().invariant_row_tile())


def weight_row_tile(format_code: int) -> int:
    """Rows of ``x`` one tile of a matmul over a weight of that format (``packed_weights.WeightFormat``) multiplies
    together: a row past a multiple of it starts another tile, which the block formats pay for in compute (a k = 5
    extend of Q4_1 weights cost 1.69-2.07x a decode step where k = 4 cost 1.29-1.65x, AMD EPYC Zen 3)."""
    return int(loaded().invariant_weight_row_tile(format_code))
