"""The sampler's ``Exp(1)`` draws, one row per sampling position keyed by an int64 alone, and the race over them.

The generator (``cpu_kernels/csrc/sampling_noise.h`` spells it out) is counter-based: SplitMix64 at counter ``c``
from the row's key gives the 32-bit words of tokens ``2c`` and ``2c + 1``, and each word becomes ``-log u`` by integer
operations and IEEE float adds, multiplies and one division. So a row costs one pass over the vocabulary, with no
generator object per row (docs/benchmarks.md), and any token's draw can be made alone. The race ``gumbel_race``
samples a row's softmax from its logits and draws in logarithms. The C++ kernels are compiled into the model's kernel
library (``cpu_kernels``), whose thread pool they share (``exponentials_cpu``, ``gumbel_race_cpu``); the torch
references below serve where it is not loaded and give the very same bits and tokens.
"""

from __future__ import annotations

import torch

from cpu_kernels import library

_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_SERIES_HEX = (  # 1/17, 1/15, ..., 1/3, each rounded to float32 as the C++ spells them
    "0x1.e1e1e2p-5",
    "0x1.111112p-4",
    "0x1.3b13b2p-4",
    "0x1.745d18p-4",
    "0x1.c71c72p-4",
    "0x1.24924ap-3",
    "0x1.99999ap-3",
    "0x1.555556p-2",
)
_SERIES = tuple(map(float.fromhex, _SERIES_HEX))
_LN2_HI, _LN2_LO = float.fromhex("0x1.63p-1"), float.fromhex("-0x1.bd0106p-13")
_SQRT2_BITS = 0x3FB504F3


def gumbel_race(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Each row's sample of ``softmax(logits / temperature)`` by the race over its key's draws, its first largest logit
    at temperature 0 (-1 where every logit is -inf): the C++ kernel where this process has loaded it, else the torch
    reference (the same tokens)."""
    if library.is_loaded() and logits.device.type == "cpu":
        return gumbel_race_cpu(logits.float().contiguous(), temperatures, keys)
    return gumbel_race_reference(logits, temperatures, keys)


def gumbel_race_reference(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The race in torch operations: ``argmax (l - max l) / t - log E``, the first on ties; ``argmax l`` at t = 0."""
    logits = logits.float()
    peaks = logits.max(dim=-1, keepdim=True).values
    draws = exponentials_reference(keys.cpu(), logits.shape[1]).to(logits.device)
    temperatures = temperatures.to(logits)
    scores = (logits - peaks) / temperatures.unsqueeze(-1) - _log_positive(draws)
    picked = torch.where(temperatures > 0, scores.argmax(dim=-1), logits.argmax(dim=-1))
    return torch.where(torch.isneginf(peaks.squeeze(-1)), -1, picked)


def exponentials(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[len(keys), vocab]`` float32 ``Exp(1)`` draws, row ``r`` a function of ``keys[r]`` (int64) alone: the C++
    kernel where this process has loaded it, else the torch reference (the same bits)."""
    if library.is_loaded():
        return exponentials_cpu(keys, vocab)
    return exponentials_reference(keys, vocab)


def exponentials_cpu(keys: torch.Tensor, vocab: int, threads: int | None = None) -> torch.Tensor:
    """``Exp(1)`` draws ``[len(keys), vocab]`` float32: row ``r`` a function of ``keys[r]`` (int64, read as 64 bits)
    alone, the same bits whatever the build, the thread count or the other rows (the library's kernel)."""
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise ValueError(f"exponentials takes int64 keys [rows], got {keys.dtype} {tuple(keys.shape)}")
    keys = keys.contiguous()
    out = torch.empty(keys.numel(), vocab, dtype=torch.float32)
    if out.numel():
        library.loaded().invariant_exponentials(
            keys.data_ptr(), keys.numel(), vocab, out.data_ptr(), threads or library.kernel_threads()
        )
    return out


def gumbel_race_cpu(logits: torch.Tensor, temperatures: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Per row, ``argmax (logits - max) / temperature - log E`` over the draws ``E`` of the row's key (the first on
    ties; ``argmax logits`` at temperature 0; -1 where every logit is -inf): a sample of
    ``softmax(logits / temperature)`` (the library's kernel).
    ``logits``: float32 ``[rows, vocab]``, unit column stride; ``temperatures`` float32, ``keys`` int64 ``[rows]``."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"gumbel_race takes float32 [rows, vocab] logits with unit column stride, got {logits.dtype}")
    temperatures = temperatures.to(torch.float32).contiguous()
    keys = keys.to(torch.int64).contiguous()
    if temperatures.shape != (logits.shape[0],) or keys.shape != (logits.shape[0],):
        raise ValueError("gumbel_race takes one temperature and one key per row")
    tokens = torch.empty(logits.shape[0], dtype=torch.int64)
    if logits.shape[0]:
        library.loaded().invariant_gumbel_race(
            logits.data_ptr(),
            logits.stride(0),
            logits.shape[0],
            logits.shape[1],
            temperatures.data_ptr(),
            keys.data_ptr(),
            tokens.data_ptr(),
            library.kernel_threads(),
        )
    return tokens


def exponentials_reference(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """The generator in torch operations, element for element the C++ kernel's."""
    pairs = (vocab + 1) // 2
    counters = torch.arange(1, pairs + 1, dtype=torch.int64)
    z = keys.to(torch.int64).unsqueeze(-1) + counters * _signed(_GAMMA)  # int64 arithmetic wraps as uint64's
    z = (z ^ _shift_right(z, 30)) * _signed(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MIX2)
    z = z ^ _shift_right(z, 31)
    words = torch.stack((z & 0xFFFFFFFF, _shift_right(z, 32)), dim=-1).reshape(len(keys), 2 * pairs)
    return _exponential_of_words(words[:, :vocab])


def _exponential_of_words(words: torch.Tensor) -> torch.Tensor:
    upper = words >= 2**31  # u = t, else u = 1 - t
    k = torch.where(upper, ~words & 0x7FFFFFFF, words).to(torch.int32)
    t = (k.to(torch.float32) + 0.5) * 2.0**-32
    e, m_less_1 = _split_positive(t)
    y = torch.where(upper, m_less_1, -t)
    return -_log_of_parts(e * upper.to(torch.float32), y)


def _log_positive(x: torch.Tensor) -> torch.Tensor:
    return _log_of_parts(*_split_positive(x))


def _split_positive(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x = 2^e m``, ``m`` in ``[sqrt(1/2), sqrt(2))``: ``e`` and ``m - 1`` (exact), from the float's bits."""
    bits = x.view(torch.int32)
    mantissa_bits = (bits & 0x007FFFFF) | 0x3F800000
    halve = mantissa_bits > _SQRT2_BITS
    mantissa_bits = torch.where(halve, mantissa_bits - 0x00800000, mantissa_bits)
    exponent = (bits >> 23) - 127 + halve.to(torch.int32)
    return exponent.to(torch.float32), mantissa_bits.view(torch.float32) - 1.0


def _log_of_parts(e: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``e ln2 + log1p(y)``, the series and the order of the C++ ``log_of_parts``."""
    s = y / (y + 2.0)
    w = s * s
    r = torch.full_like(s, _SERIES[0])
    for coefficient in _SERIES[1:]:
        r = r * w + coefficient
    two_s = s + s
    log1p_y = two_s + two_s * (r * w)
    return e * _LN2_HI + (e * _LN2_LO + log1p_y)


def _signed(value: int) -> int:
    return value - 2**64 if value >= 2**63 else value


def _shift_right(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)
