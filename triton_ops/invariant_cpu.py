"""Batch-invariant CPU kernels for the model forward: matmuls over packed weights, attention over a token KV pool,
RMSNorm and SiLU-and-multiply (``csrc/invariant_cpu.cpp``, whose header states the mechanism); and the grammar's
token mask on the logits (``mask_logits``, which ``triton_ops.bitmask_cpu`` serves with).

Why our own kernels: a BLAS picks its kernel per shape, CPU and thread count, and a float32 row's rounding changes
with it (MKL on an Intel Xeon takes another kernel from 16 rows on; on an AMD EPYC rows 1 and 2-3 differ). Here
every output element is one fixed chain of fused multiply-adds whatever shares the call, so a token's logits are
bit for bit the same alone, in any batch, beside drafts or a long prompt, on any thread count, and the AVX-512,
AVX2 and scalar builds agree with each other too.

The source is compiled once per machine with the C++ compiler at hand (``-O3 -march=native``, a few seconds)
into a build directory keyed by the source, the compiler and the CPU, then loaded with ctypes. Its threads are a
pool of its own (``kernel_threads()`` per call): see the source's header for why not OpenMP.
"""

from __future__ import annotations

import ctypes
import enum
import fcntl
import hashlib
import itertools
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from triton_ops.cpu_info import cpu_flags, cpu_model

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "invariant_cpu.cpp"
HEADERS = tuple(
    SOURCE.with_name(name)
    for name in ("int8_blocks.h", "kquant_blocks.h", "attention.h", "sampling_noise.h", "decoder_layer.h")
)
"""What SOURCE includes: part of the build's key."""
COMPILE_FLAGS = ("-O3", "-march=native", "-std=c++17", "-pthread", "-ffp-contract=off", "-shared", "-fPIC")
"""``-ffp-contract=off``: the compiler may not fuse a multiply and an add the source keeps apart (nor split an fma)."""
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


class Activation(enum.IntEnum):
    """The MLP's activation of its gate (values shared with the C++ source)."""

    SILU = 0
    GELU_TANH = 1


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
    data: torch.Tensor  # uint8, [panels, panel_bytes]
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


def _compiler() -> str:
    for name in (os.environ.get("CXX", ""), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    raise RuntimeError(
        "the batch-invariant CPU kernels need a C++ compiler (g++ or clang++, or $CXX) to build once per machine; "
        "install one (Debian: apt-get install g++)"
    )


TARGETS = {
    "native": (),
    "avx512": ("-mno-avx512vnni", "-mno-avxvnni"),
    "avx2-vnni": ("-mno-avx512f",),
    "avx2": ("-mno-avx512f", "-mno-avxvnni"),
    "scalar": ("-mno-avx", "-mno-avx2", "-mno-fma", "-mno-f16c"),
}
"""Builds: the CPU at hand, or a narrower instruction set (to show that every build computes the same bits): AVX-512
and AVX2 without their 8-bit dot products (VNNI), and AVX2 with AVX-VNNI's."""
TARGET_NEEDS = {"avx512": "avx512bw", "avx2-vnni": "avx_vnni", "avx2": "avx2"}
"""The CPU flag (as /proc/cpuinfo names it) each narrower build needs to run; the scalar build runs anywhere."""


def runs_here(target: str) -> bool:
    """Whether this CPU runs the ``target`` build (the native one always)."""
    needed = TARGET_NEEDS.get(target)
    return needed is None or needed in cpu_flags()


def _build(build_dir: Path, target: str) -> Path:
    """The compiled library for this source, compiler, CPU and target, building it first if no process has yet."""
    compiler = _compiler()
    flags = (*COMPILE_FLAGS, *TARGETS[target])
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            x.encode()
            for x in (
                SOURCE.read_text(),
                *(header.read_text() for header in HEADERS),
                version,
                " ".join(flags),
                cpu_model(),
                *sorted(cpu_flags()),
            )
        )
    ).hexdigest()[:16]
    library = build_dir / f"invariant_cpu-{target}-{key}.so"
    if library.is_file():
        return library
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / f"{library.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # ranks starting together build once
        if library.is_file():
            return library
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=build_dir) as staging:
            staged = Path(staging) / library.name
            result = subprocess.run([compiler, *flags, str(SOURCE), "-o", str(staged)], capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"building {SOURCE.name} with {compiler} failed:\n{result.stderr[-4000:]}")
            staged.rename(library)  # atomic: no process ever loads half a library
        logger.info("built the batch-invariant CPU kernels in %.1f s: %s", time.perf_counter() - started, library)
    return library


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
        library = ctypes.CDLL(str(_build(build_dir, target)))
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float
        library.invariant_isa.restype = ctypes.c_char_p
        library.invariant_row_tile.restype = i32
        library.invariant_attention_supports.argtypes = [i64, i64]
        library.invariant_attention_supports.restype = i32
        library.invariant_attention.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr, ptr, f32, ptr, i32]
        library.invariant_rms_norm.argtypes = [ptr, i64, i64, i64, ptr, f32, ptr, i64, i32]
        library.invariant_silu_mul.argtypes = [ptr, i64, i64, ptr, i32]
        library.invariant_gelu_tanh_mul.argtypes = [ptr, i64, i64, ptr, i32]
        library.invariant_softcap.argtypes = [ptr, i64, i64, i64, f32, i32]
        library.invariant_mask_logits.argtypes = [ptr, i32, ctypes.c_uint32, i64, i64, ptr, i64, i64, ptr, i64, i32]
        library.invariant_exponentials.argtypes = [ptr, i64, i64, ptr, i32]
        library.invariant_gumbel_race.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i32]
        shape, layer, batch = ctypes.POINTER(_ModelShape), ctypes.POINTER(_LayerRef), ctypes.POINTER(_BatchRef)
        library.invariant_packed_matmul.argtypes = [ctypes.POINTER(_PackedRef), ptr, i64, i64, ptr, i64, i32]
        library.invariant_attention_block.argtypes = [shape, layer, batch, ptr, ptr, ptr, ptr, i32]
        library.invariant_mlp_block.argtypes = [shape, layer, i64, ptr, ptr, i32]
        library.invariant_decoder.argtypes = [shape, layer, i32, batch, ptr, ptr, ptr, i64, i32]
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
            "invariant_mask_logits",
            "invariant_exponentials",
            "invariant_gumbel_race",
        ):
            getattr(library, name).restype = None
        logger.info("batch-invariant CPU kernels: %s build", library.invariant_isa().decode())
        _library = library
    return _library


def is_loaded() -> bool:
    """Whether this process has loaded the kernels (``load``)."""
    return _library is not None


def _loaded() -> ctypes.CDLL:
    if _library is None:
        raise RuntimeError("triton_ops.invariant_cpu.load(build_dir) must be called before the kernels")
    return _library


def isa() -> str:
    """The instruction set the loaded build uses: ``avx512-vnni``, ``avx512``, ``avx2-vnni``, ``avx2`` or
    ``scalar`` (the block formats' 8-bit dot products: VNNI, or vpmaddubsw and vpmaddwd)."""
    return str(_loaded().invariant_isa().decode())


def row_tile() -> int:
    """Rows of ``x`` one pass over a weight tile multiplies together: a matmul of up to this many rows streams its
    weights as often as a one-row matmul does (decode is bound by those reads, so such rows come nearly free)."""
    return int(_loaded().invariant_row_tile())


def _panels(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K, ...]`` -> ``[ceil(N / 16), K, 16, ...]``: columns grouped by 16 (zero past N), k-major in a panel."""
    out_features = weight.shape[0]
    padded = -(-out_features // LANES) * LANES
    if padded != out_features:
        weight = torch.cat([weight, weight.new_zeros(padded - out_features, *weight.shape[1:])])
    return weight.reshape(padded // LANES, LANES, *weight.shape[1:]).transpose(1, 2)


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
    data = torch.cat([q, d], dim=2).reshape(q.shape[0], -1)
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
    data = torch.cat([nibbles, d, m], dim=2).reshape(nibbles.shape[0], -1)
    return PackedWeight(WeightFormat.Q4_1, data, out_features, in_features)


def _lanes(values: torch.Tensor, blocks: int) -> torch.Tensor:
    """Per-block values ``[N, blocks, ...]`` -> ``[P, blocks, bytes]``: a block's 16 columns' values in lane order."""
    lanes = _panels(values.reshape(values.shape[0], blocks, -1)).transpose(2, 3).contiguous()  # [P, blocks, v, 16]
    return lanes.view(torch.uint8).reshape(lanes.shape[0], blocks, -1)


def _quant_vectors(quants: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit quants ``[N, K]`` -> ``[P, K / 32, bytes]``: per 32-block the nibbles as pack_q4_1 lays
    them out, then the planes of the bits above them (kquant_blocks.h)."""
    out_features, in_features = quants.shape
    blocks = in_features // BLOCK
    q = _panels(quants.reshape(out_features, blocks, 2, BLOCK // 8, 4))  # [P, blocks, 16 lanes, halves, 4 quads, 4]
    q = q.permute(0, 1, 4, 3, 2, 5).reshape(q.shape[0], blocks, 8, 4 * LANES)  # [P, blocks, combination 2i + h, 64]
    parts = [((q[:, :, 0::2] & 15) | ((q[:, :, 1::2] & 15) << 4)).reshape(q.shape[0], blocks, -1)]
    high = q >> 4
    if bits == 5:
        parts.append(_bit_fields([high[:, :, c] & 1 for c in range(8)], 1))
    elif bits == 6:
        parts += [_bit_fields([high[:, :, 4 * plane + c] & 3 for c in range(4)], 2) for plane in range(2)]
    return torch.cat(parts, dim=2)


def _bit_fields(fields: list[torch.Tensor], width: int) -> torch.Tensor:
    """Bytes holding ``fields[i]`` (each below ``2 ** width``) in bits ``width * i`` on."""
    out = torch.zeros_like(fields[0])
    for i, field in enumerate(fields):
        out |= field << (width * i)
    return out


def _block_bytes(quants: torch.Tensor, bits: int, per_block: list[torch.Tensor]) -> torch.Tensor:
    """``[P, K / 32, bytes]``: per 32-block its quant vectors, then the 16 columns' values of each of ``per_block``."""
    blocks = quants.shape[1] // BLOCK
    return torch.cat([_quant_vectors(quants, bits), *(_lanes(values, blocks) for values in per_block)], dim=2)


def _pack_blocks(fmt: WeightFormat, quants: torch.Tensor, bits: int, *per_block: torch.Tensor) -> PackedWeight:
    """A 32-block format: its blocks as ``_block_bytes`` lays them out, one after another."""
    data = _block_bytes(quants, bits, list(per_block))
    return PackedWeight(fmt, data.reshape(data.shape[0], -1), *quants.shape)


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
    data = torch.cat([*(_lanes(values.to(torch.float16), supers) for values in head), body], dim=2)
    return PackedWeight(fmt, data.reshape(data.shape[0], -1), *quants.shape)


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


def _check_rows(x: torch.Tensor, width: int, what: str) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        raise ValueError(f"{what} takes float32 [rows, {width}] with unit column stride, got {x.dtype} {x.shape}")


def matmul(x: torch.Tensor, weight: MatmulWeight, threads: int | None = None) -> torch.Tensor:
    """``x @ W.T``: float32 ``[M, in_features]`` -> ``[M, out_features]``, each row independent of the others.

    ``threads`` (every kernel takes it): at most this many threads, ``kernel_threads()`` by default."""
    _check_rows(x, weight.in_features, "matmul")
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    if x.shape[0]:
        _loaded().invariant_packed_matmul(
            ctypes.byref(_packed_ref(weight)),
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
    """Each query token over its own pool rows: ``q`` ``[T, H, D]``, pools ``[R, H_kv, D]``; token ``t`` attends to
    ``rows[row_start[t] : row_start[t] + num_keys[t]]`` (int64). Returns ``[T, H * D]``."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_pool.shape[1]
    if heads % kv_heads or not _loaded().invariant_attention_supports(head_dim, heads // kv_heads):
        raise ValueError(
            f"attention runs head_dim 16, 32, 64, 96, 128 or 256 and 1 to 8 query heads per KV head; got "
            f"{head_dim} and {heads} over {kv_heads}"
        )
    if not (q.is_contiguous() and k_pool.is_contiguous()):
        raise ValueError(f"attention takes contiguous q {tuple(q.shape)} and pools")
    if not (v_pool.is_contiguous() and q.dtype == k_pool.dtype == v_pool.dtype == torch.float32):
        raise ValueError("attention takes contiguous float32 q, k and v")
    for index in (rows, row_start, num_keys):
        if index.dtype != torch.int64 or not index.is_contiguous():
            raise ValueError("attention's row tables are contiguous int64")
    out = torch.empty(tokens, heads * head_dim, dtype=torch.float32)
    if tokens:
        _loaded().invariant_attention(
            q.data_ptr(),
            tokens,
            heads,
            head_dim,
            k_pool.data_ptr(),
            v_pool.data_ptr(),
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
    _check_rows(x, width, "rms_norm")
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"rms_norm takes a contiguous float32 weight, not {weight.dtype}")
    out = torch.empty(x.shape[0], width, dtype=torch.float32)
    if x.shape[0]:
        _loaded().invariant_rms_norm(
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
        getattr(_loaded(), kernel)(
            gate_up.data_ptr(), gate_up.shape[0], width, out.data_ptr(), threads or kernel_threads()
        )
    return out


def softcap(x: torch.Tensor, cap: float, threads: int | None = None) -> torch.Tensor:
    """``cap * tanh(x / cap)`` of float32 ``[T, N]`` (unit column stride), in place; returns ``x``. Gemma's
    soft-capping of the logits."""
    _check_rows(x, x.shape[1] if x.dim() == 2 else -1, "softcap")
    if x.numel():
        _loaded().invariant_softcap(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), cap, threads or kernel_threads())
    return x


class _PackedRef(ctypes.Structure):
    pass


_PackedRef._fields_ = [
    ("data", ctypes.c_void_p),
    ("format", ctypes.c_int32),
    ("out_features", ctypes.c_int64),
    ("in_features", ctypes.c_int64),
    ("next", ctypes.POINTER(_PackedRef)),  # the part stacked below (a WeightStack), or null
]


class _LayerRef(ctypes.Structure):
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
        ("qkv", _PackedRef),
        ("o_proj", _PackedRef),
        ("gate_up", _PackedRef),
        ("down", _PackedRef),
    ]


class _ModelShape(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("activation", ctypes.c_int32),
    ]


class _BatchRef(ctypes.Structure):
    _fields_ = [
        ("tokens", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("new_rows", ctypes.c_void_p),
        ("key_rows", ctypes.c_void_p),
        ("key_starts", ctypes.c_void_p),
        ("num_keys", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class Rope:
    """RoPE tables ``[positions, rope_dim]`` (float32): a layer turns the first ``rope_dim`` values of each head by
    them (``rope_dim`` is the head's size but for partial rotary embeddings)."""

    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def positions(self) -> int:
        return self.cos.shape[0]


@dataclass(frozen=True)
class DecoderLayer:
    """One decoder layer's weights: float32 norms (and Qwen2's q/k/v biases, Qwen3's and Gemma 3's per-head q/k
    norms, Gemma 3's norms of each block's output), and the four matmul weights packed; its RoPE tables (None: a
    layer without RoPE) and its sliding window (the keys a token attends to at most; None: all of them)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor  # the MLP block's input norm
    qkv: MatmulWeight  # q, k and v projections stacked
    o_proj: MatmulWeight
    gate_up: MatmulWeight  # gate and up projections stacked
    down: MatmulWeight
    rope: Rope | None
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attention_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    window: int | None = None


@dataclass(frozen=True)
class DecoderBatch:
    """A forward's tokens for the decoder blocks (int64 CPU tensors): each token's position, the KV pool row its
    K/V go to, and the rows it attends to (``key_rows[key_starts[t] : key_starts[t] + num_keys[t]]``)."""

    positions: torch.Tensor
    new_rows: torch.Tensor
    key_rows: torch.Tensor
    key_starts: torch.Tensor
    num_keys: torch.Tensor


NEG_INF_BITS = {
    torch.float32: int(torch.tensor(float("-inf"), dtype=torch.float32).view(torch.int32)),
    torch.float16: int(torch.tensor(float("-inf"), dtype=torch.float16).view(torch.int16)),
    torch.bfloat16: int(torch.tensor(float("-inf"), dtype=torch.bfloat16).view(torch.int16)),
}
"""-inf's bit pattern per logits dtype, as the signed integer of the same width (what a view of the logits holds)."""


def mask_logits(
    logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor | None = None, threads: int | None = None
) -> None:
    """Set ``logits[r, c] = -inf`` in place where bit ``c % 32`` of ``words[r, c // 32]`` is clear or ``c`` lies past
    the last word, for every row ``r`` (or those in ``rows``: int64 ids, which the caller has range-checked).

    ``logits``: float32, float16 or bfloat16 ``[batch, vocab]``; ``words``: int32 ``[batch, num_words]``; both
    with unit column stride. The bits written are -inf's or the logit's own, whatever the build or thread count.
    """
    if logits.dtype not in NEG_INF_BITS or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"mask_logits takes float [rows, vocab] logits with unit column stride, got {logits.dtype}")
    if words.dtype != torch.int32 or words.dim() != 2 or words.stride(1) != 1 or words.shape[0] != logits.shape[0]:
        raise ValueError(f"mask_logits takes int32 [rows, words] with unit column stride, got {words.dtype}")
    if rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()):
        raise ValueError("mask_logits takes contiguous int64 row ids")
    num_rows = logits.shape[0] if rows is None else rows.numel()
    if num_rows == 0 or logits.shape[1] == 0:
        return
    _loaded().invariant_mask_logits(
        logits.data_ptr(),
        logits.element_size(),
        NEG_INF_BITS[logits.dtype] & 0xFFFFFFFF,  # the kernel stores its low 16 bits for 16-bit logits
        logits.shape[1],
        logits.stride(0),
        words.data_ptr(),
        words.shape[1],
        words.stride(0),
        None if rows is None else rows.data_ptr(),
        num_rows,
        threads or kernel_threads(),
    )


def exponentials(keys: torch.Tensor, vocab: int, threads: int | None = None) -> torch.Tensor:
    """``Exp(1)`` draws ``[len(keys), vocab]`` float32: row ``r`` a function of ``keys[r]`` (int64, read as 64 bits)
    alone, the same bits whatever the build, the thread count or the other rows (``csrc/sampling_noise.h``)."""
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"exponentials takes int64 keys [rows], got {keys.dtype} {tuple(keys.shape)}")
    keys = keys.contiguous()
    out = torch.empty(keys.numel(), vocab, dtype=torch.float32)
    if out.numel():
        _loaded().invariant_exponentials(
            keys.data_ptr(), keys.numel(), vocab, out.data_ptr(), threads or kernel_threads()
        )
    return out


def gumbel_race(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row, ``argmax (logits - max) / temperature - log E`` over the draws ``E`` of the row's key (the first on
    ties; ``argmax logits`` at temperature 0; -1 where every logit is -inf): a sample of
    ``softmax(logits / temperature)`` (``csrc/sampling_noise.h``).
    ``logits``: float32 ``[rows, vocab]``, unit column stride; ``temperatures`` float32, ``keys`` int64 ``[rows]``."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"gumbel_race takes float32 [rows, vocab] logits with unit column stride, got {logits.dtype}")
    temperatures = temperatures.to(torch.float32).contiguous()
    keys = keys.to(torch.int64).contiguous()
    if temperatures.shape != (logits.shape[0],) or keys.shape != (logits.shape[0],):
        raise ValueError("gumbel_race takes one temperature and one key per row")
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        _loaded().invariant_gumbel_race(
            logits.data_ptr(),
            logits.stride(0),
            logits.shape[0],
            logits.shape[1],
            temperatures.data_ptr(),
            keys.data_ptr(),
            tokens.data_ptr(),
            kernel_threads(),
        )
    return tokens


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _packed_ref(weight: MatmulWeight) -> _PackedRef:
    """The C++ view of ``weight``: a stack's parts chained through ``next`` (each ref keeps the one it points to)."""
    refs = [
        _PackedRef(part.data.data_ptr(), int(part.format), part.out_features, part.in_features, None)
        for part in (weight.parts if isinstance(weight, WeightStack) else (weight,))
    ]
    for upper, lower in itertools.pairwise(refs):
        upper.next = ctypes.pointer(lower)
    return refs[0]


class Decoder:
    """The decoder layers as the C++ blocks run them (``csrc/decoder_layer.h``): per layer an attention block (norm,
    qkv, biases or q/k norms, RoPE, the K/V written to the pool, attention over the layer's window, o_proj) and an
    MLP block (norm, gate and up, SiLU or GELU-tanh, down), each returning its output before the residual add (and
    before the norm of the block's output, where the layer has one: ``add_block``); ``run`` does every layer with the
    adds in one call.

    The same operations, in the same order, as composing this module's kernels in Python: one call per forward
    instead of ~150 (the ctypes and torch overhead between them was ~2 ms a decode step). ``scale`` multiplies the
    attention scores (``head_dim ** -0.5`` by default).
    """

    def __init__(
        self,
        layers: list[DecoderLayer],
        heads: int,
        kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float | None = None,
        activation: Activation = Activation.SILU,
    ) -> None:
        hidden = layers[0].input_norm.shape[0]
        self.layers = layers  # the structs below point into these tensors
        attention_scale = head_dim**-0.5 if scale is None else scale
        self.shape = _ModelShape(
            hidden, heads, kv_heads, head_dim, layers[0].down.in_features, eps, attention_scale, int(activation)
        )
        for layer in layers:
            for norm in (layer.q_norm, layer.k_norm):
                if norm is not None and norm.shape != (head_dim,):
                    raise ValueError(f"a per-head norm has {tuple(norm.shape)} weights, not ({head_dim},)")
            if layer.rope is not None and not (
                0 < layer.rope.cos.shape[1] <= head_dim and layer.rope.cos.shape[1] % 2 == 0
            ):
                raise ValueError(f"RoPE tables of {layer.rope.cos.shape[1]} values for heads of {head_dim}")
        self.max_positions = min((layer.rope.positions for layer in layers if layer.rope is not None), default=None)
        self.refs = (_LayerRef * len(layers))(
            *(
                _LayerRef(
                    layer.input_norm.data_ptr(),
                    layer.post_norm.data_ptr(),
                    _pointer(layer.qkv_bias),
                    _pointer(layer.q_norm),
                    _pointer(layer.k_norm),
                    _pointer(layer.attention_out_norm),
                    _pointer(layer.mlp_out_norm),
                    _pointer(None if layer.rope is None else layer.rope.cos),
                    _pointer(None if layer.rope is None else layer.rope.sin),
                    0 if layer.rope is None else layer.rope.cos.shape[1],
                    layer.window or 0,
                    _packed_ref(layer.qkv),
                    _packed_ref(layer.o_proj),
                    _packed_ref(layer.gate_up),
                    _packed_ref(layer.down),
                )
                for layer in layers
            )
        )

    def _batch(self, batch: DecoderBatch) -> _BatchRef:
        return _BatchRef(
            batch.positions.shape[0],
            batch.positions.data_ptr(),
            batch.new_rows.data_ptr(),
            batch.key_rows.data_ptr(),
            batch.key_starts.data_ptr(),
            batch.num_keys.data_ptr(),
        )

    def run(
        self, hidden: torch.Tensor, batch: DecoderBatch, k_pool: torch.Tensor, v_pool: torch.Tensor, threads: int
    ) -> None:
        """Every layer over contiguous float32 ``hidden`` ``[T, hidden]``, in place; ``k_pool``, ``v_pool``
        ``[layers, rows, kv_heads, head_dim]``."""
        self._check(hidden, batch)
        _loaded().invariant_decoder(
            ctypes.byref(self.shape), self.refs, len(self.layers), ctypes.byref(self._batch(batch)), hidden.data_ptr(),
            k_pool.data_ptr(), v_pool.data_ptr(), k_pool[0].numel(), threads,
        )  # fmt: skip

    def attention_block(
        self,
        index: int,
        hidden: torch.Tensor,
        batch: DecoderBatch,
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        threads: int,
    ) -> torch.Tensor:
        """Layer ``index``'s attention block over ``hidden``: o_proj's output ``[T, hidden]``, before the residual."""
        self._check(hidden, batch)
        out = torch.empty_like(hidden)
        _loaded().invariant_attention_block(
            ctypes.byref(self.shape), ctypes.byref(self.refs[index]), ctypes.byref(self._batch(batch)),
            hidden.data_ptr(), k_layer.data_ptr(), v_layer.data_ptr(), out.data_ptr(), threads,
        )  # fmt: skip
        return out

    def add_block(self, index: int, hidden: torch.Tensor, block: torch.Tensor, attention: bool, threads: int) -> None:
        """``hidden += block`` in place, after the norm of layer ``index``'s attention (or MLP) output where it has
        one: the residual add ``run`` makes, for a block's output summed over tensor-parallel ranks."""
        layer = self.layers[index]
        norm = layer.attention_out_norm if attention else layer.mlp_out_norm
        if norm is not None:
            block = rms_norm(block, norm, self.shape.eps, threads)
        hidden += block

    def mlp_block(self, index: int, hidden: torch.Tensor, threads: int) -> torch.Tensor:
        """Layer ``index``'s MLP block over ``hidden``: down's output ``[T, hidden]``, before the residual."""
        out = torch.empty_like(hidden)
        _loaded().invariant_mlp_block(
            ctypes.byref(self.shape), ctypes.byref(self.refs[index]), hidden.shape[0], hidden.data_ptr(),
            out.data_ptr(), threads,
        )  # fmt: skip
        return out

    def _check(self, hidden: torch.Tensor, batch: DecoderBatch) -> None:
        _check_rows(hidden, self.shape.hidden, "the decoder")
        if not hidden.is_contiguous() or batch.positions.shape[0] != hidden.shape[0]:
            raise ValueError("the decoder takes contiguous hidden states, one row per token of the batch")
        if self.max_positions is not None and int(batch.positions.max()) >= self.max_positions:
            raise ValueError(f"positions reach {int(batch.positions.max())}, past the {self.max_positions} RoPE rows")
