"""The CPU path: an inductor-compiled kernel per logits dtype, with a vectorised eager fallback.

Both view the logits covering whole bitmask words as ``[rows, words, 32]``, so each int32 word lines up with
its 32 logits and no per-token gather is needed. The columns left over (a vocab that is not a multiple of 32,
or a bitmask narrower than the logits) are masked apart; they are fewer than 32 in the usual case.

The kernel is traced once with symbolic sizes and compiled by ``torch._inductor.standalone_compile`` rather than
``torch.compile``: one artifact per dtype then serves every batch size and vocab, and a call skips dynamo's frame
evaluation and guards, ~13 µs per call, more than masking a 49k-token row takes. With no guards, the callers here
keep the kernel's contract: contiguous logits and words, the same rows, at most ``vocab // 32`` words.
Each dtype has a one-thread kernel and a parallel one; ``ThreadChoice`` picks between them per call.

A server compiles them in the background (``start_cpu_bitmask_warm_up``): masking is exact either way, so the eager
path serves until they are ready, and start-up does not wait seconds for the compile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from triton_ops.bitmask_format import BITS_PER_WORD, allocate_bitmask
from triton_ops.bitmask_reference import normalize_bitmask_args
from triton_ops.thread_choice import ThreadChoice

logger = logging.getLogger(__name__)

# Bound on the temporaries of the eager path: freshly mapped pages cost more than the arithmetic on them.
EAGER_CHUNK_ELEMENTS = 1 << 20

_NEG_INF = float("-inf")

_MaskKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]
"""A compiled ``_mask_words_fused``."""

_TO_SIGN_BIT = (BITS_PER_WORD - 1) - torch.arange(BITS_PER_WORD, dtype=torch.int32)
"""Per lane j, the left shift that brings bit j of a word to the sign bit."""

_NEG_INF_BITS = {
    torch.float32: int(torch.tensor(_NEG_INF, dtype=torch.float32).view(torch.int32)),
    torch.float16: int(torch.tensor(_NEG_INF, dtype=torch.float16).view(torch.int16)),
    torch.bfloat16: int(torch.tensor(_NEG_INF, dtype=torch.bfloat16).view(torch.int16)),
}


def _mask_words_fused(logits: torch.Tensor, bitmask_words: torch.Tensor, to_sign_bit: torch.Tensor):
    """Mask the first ``32 * words`` columns of contiguous ``[rows, vocab]`` logits by ``[rows, words]`` words.

    ``to_sign_bit`` is ``_TO_SIGN_BIT``: bit j shifted up to the sign bit is clear exactly when the shifted word is
    non-negative, one shift and one compare per lane. Passed in rather than built in the graph, the shifts are
    loaded as a vector instead of assembled lane by lane: in one interleaved run, 3-5 % faster on one thread and
    2-13 % on two at 8-32 rows (fp32).
    Slicing inside the graph, rather than passing a strided view, lets inductor write the logits in place:
    a view with a symbolic row stride might overlap itself, so it would be masked into a buffer and copied back.
    No return annotation: tracing copies it into the graph's code as a string, which inductor cannot hash.
    """
    num_words = bitmask_words.shape[1]
    words = logits[:, : num_words * BITS_PER_WORD].unflatten(1, (num_words, BITS_PER_WORD))
    words.masked_fill_((bitmask_words.unsqueeze(-1) << to_sign_bit) >= 0, _NEG_INF)
    return ()  # a traced graph needs an output


def _compile_kernel(dtype: torch.dtype, threads: int) -> _MaskKernel:
    """``_mask_words_fused`` for logits of ``dtype`` on ``threads`` threads, compiled once for every shape."""
    from torch._inductor import config as inductor_config
    from torch._inductor import standalone_compile
    from torch.fx.experimental.proxy_tensor import make_fx

    # Rows, vocab and words all differ (and none is 0, 1 or 32), so tracing gives each its own symbol: nothing
    # is specialised that a later call could contradict, as no guard checks it.
    logits = torch.zeros(3, 5 * BITS_PER_WORD + 7, dtype=dtype)
    bitmask_words = torch.zeros(3, 5, dtype=torch.int32)
    # Inductor sizes its parallel loop by these tiny example sizes and, at its default minimum chunk, would keep
    # the loop serial whatever ``threads`` says; a minimum of 1 makes the parallel kernel parallel. (The setting
    # is part of inductor's cache key, so no serial artifact cached before can be served for it.)
    # Loading a cached kernel would otherwise cost each process ~1.1 s of CPU in subprocesses: a Python interpreter
    # per vector ISA to try a test library (vec_isa_ok: the ISA is taken from the CPU's flags, as the invariant
    # kernels' -march=native takes it), and the preprocessing of torch's headers to key a precompiled header.
    settings = {
        "cpp.threads": threads,
        "cpp.min_chunk_size": 1,
        "cpp.vec_isa_ok": True,
        "cpp_cache_precompile_headers": False,
    }
    with torch.no_grad():
        graph = make_fx(_mask_words_fused, tracing_mode="symbolic")(logits, bitmask_words, _TO_SIGN_BIT)
        with inductor_config.patch(settings):
            return standalone_compile(graph, [logits, bitmask_words, _TO_SIGN_BIT])


class _CompiledKernels:
    """The compiled kernel of each dtype and thread count, built on first use; replaced for good by the eager path
    if that fails. While a background warm-up runs, only its thread compiles: a kernel it has not finished yet is
    None for every other thread (which then masks with the eager path) rather than a second compile on the caller's
    thread."""

    def __init__(self) -> None:
        self._kernels: dict[tuple[torch.dtype, int], _MaskKernel] = {}
        self.thread_choice = ThreadChoice()
        self.is_unavailable = False
        self.warm_up_thread: threading.Thread | None = None

    def run(self, logits: torch.Tensor, bitmask_words: torch.Tensor, threads: int | None = None) -> bool:
        """Mask ``logits`` in place; False (and nothing written) if the kernel cannot be compiled here.

        With ``threads`` None, ``thread_choice`` picks the count, and the call is timed for it.
        """
        num_elements = logits.numel()
        chosen = self.thread_choice.threads_for(num_elements, torch.get_num_threads()) if threads is None else threads
        kernel = self._kernel(logits.dtype, chosen)
        if kernel is None:
            return False
        start = time.perf_counter()
        kernel(logits, bitmask_words, _TO_SIGN_BIT)
        if threads is None:
            self.thread_choice.record(chosen, num_elements, time.perf_counter() - start)
        return True

    def _kernel(self, dtype: torch.dtype, threads: int) -> _MaskKernel | None:
        if self.is_unavailable:
            return None
        key = (dtype, threads)
        kernel = self._kernels.get(key)
        if kernel is None:
            warming = self.warm_up_thread
            if warming is not None and warming.is_alive() and warming is not threading.current_thread():
                return None
            try:
                kernel = self._kernels[key] = _compile_kernel(dtype, threads)
            # ImportError: a torch without standalone_compile (< 2.8); RuntimeError: no C++ compiler, and every
            # other inductor error.
            except (ImportError, RuntimeError) as e:
                logger.warning("compiling the CPU bitmask kernel failed, using the eager path: %s", e)
                self.is_unavailable = True
                return None
        return kernel


_COMPILED = _CompiledKernels()


def _mask_words_eager(words: torch.Tensor, bitmask_words: torch.Tensor) -> None:
    """Branch-free bit arithmetic on the logits' bit patterns, in row chunks that keep temporaries small.

    ``keep`` is all ones where the token is allowed and zero where not, so ``(x & keep) | (-inf & ~keep)`` is
    ``x`` or exactly ``-inf`` whatever ``x`` holds (NaN and +inf included).
    """
    bits = words.view(torch.int32 if words.element_size() == 4 else torch.int16)
    # Shifting bit j up to the sign bit, then arithmetically back down, smears it over the whole word.
    rows_per_chunk = max(1, EAGER_CHUNK_ELEMENTS // (words.shape[1] * BITS_PER_WORD))
    for start in range(0, words.shape[0], rows_per_chunk):
        keep = (bitmask_words[start : start + rows_per_chunk].unsqueeze(-1) << _TO_SIGN_BIT) >> (BITS_PER_WORD - 1)
        keep = keep.to(bits.dtype)
        chunk = bits[start : start + rows_per_chunk]
        chunk &= keep
        chunk |= keep.bitwise_not_().bitwise_and_(_NEG_INF_BITS[words.dtype])


def _mask_leftover_columns(logits: torch.Tensor, bitmask: torch.Tensor, start: int) -> None:
    """Columns ``[start, vocab)``: the part of a last, partly used word, or all columns past the bitmask."""
    leftover = logits[:, start:]
    word = start // BITS_PER_WORD
    if word >= bitmask.shape[1]:
        leftover.fill_(_NEG_INF)
        return
    shifts = torch.arange(leftover.shape[1], dtype=torch.int32)
    leftover.masked_fill_(((bitmask[:, word : word + 1] >> shifts) & 1) == 0, _NEG_INF)


def _mask_all_rows(logits: torch.Tensor, bitmask: torch.Tensor, use_compiled: bool) -> None:
    """Every row of ``[rows, vocab]`` logits by its row of ``[rows, words]`` bitmask."""
    num_words = min(logits.shape[1] // BITS_PER_WORD, bitmask.shape[1])
    if num_words > 0:
        # Words past the logits' width are dropped (the kernel masks 32 columns per word it is given).
        bitmask_words = bitmask if num_words == bitmask.shape[1] else bitmask[:, :num_words]
        # The compiled kernel takes contiguous logits and words; other layouts are rare enough for the eager path.
        is_compiled = use_compiled and logits.is_contiguous() and _COMPILED.run(logits, bitmask_words.contiguous())
        if not is_compiled:
            words = logits[:, : num_words * BITS_PER_WORD].unflatten(1, (num_words, BITS_PER_WORD))
            _mask_words_eager(words, bitmask_words)
    if num_words * BITS_PER_WORD < logits.shape[1]:
        _mask_leftover_columns(logits, bitmask, num_words * BITS_PER_WORD)


def _apply(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None, use_compiled: bool
) -> None:
    args = normalize_bitmask_args(logits, bitmask, indices)
    if args.logits.device.type != "cpu":
        raise ValueError(
            f"the CPU path needs CPU logits, got {args.logits.device}; "
            "use triton_ops.apply_token_bitmask_inplace to dispatch by device"
        )
    logits_2d, bitmask_2d = args.logits, args.bitmask.cpu()
    if args.rows is None:
        if logits_2d.shape[0] > 0:
            _mask_all_rows(logits_2d, bitmask_2d, use_compiled)
        return
    # Row by row: copying the selected rows out and back (index_select, index_copy_) costs 5-25x more.
    for row in args.rows.tolist():
        _mask_all_rows(logits_2d[row : row + 1], bitmask_2d[row : row + 1], use_compiled)


def apply_token_bitmask_inplace_cpu(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """Set disallowed CPU logits to -inf in place with the compiled kernel (eager path if it cannot compile).

    Shapes and dtypes as ``apply_token_bitmask_inplace_reference``. The first call per logits dtype compiles
    for seconds unless ``warm_up_cpu_bitmask_kernel`` ran; later calls of any shape reuse it.
    Only the rows in ``indices`` are read or written.
    """
    _apply(logits, bitmask, indices, use_compiled=True)


def apply_token_bitmask_inplace_cpu_eager(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | list[int] | None = None
) -> None:
    """The same as ``apply_token_bitmask_inplace_cpu`` without compiling: vectorised torch ops only."""
    _apply(logits, bitmask, indices, use_compiled=False)


def warm_up_cpu_bitmask_kernel(vocab_size: int, dtype: torch.dtype = torch.float32) -> bool:
    """Compile the CPU kernels for ``dtype`` now (seconds), not on the first request.

    The one-thread kernel and the parallel one then serve every batch size and vocab, with or without ``indices``.
    Returns True if the compiled kernels are in use, False if they cannot be compiled here and the eager path will
    serve instead.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    for threads in sorted({1, torch.get_num_threads()}):
        _COMPILED.run(torch.zeros(1, BITS_PER_WORD, dtype=dtype), allocate_bitmask(1, BITS_PER_WORD), threads)
    apply_token_bitmask_inplace_cpu(torch.zeros(1, vocab_size, dtype=dtype), allocate_bitmask(1, vocab_size))
    return not _COMPILED.is_unavailable


def start_cpu_bitmask_warm_up(vocab_size: int, dtype: torch.dtype = torch.float32) -> threading.Thread:
    """``warm_up_cpu_bitmask_kernel`` on a daemon thread, returned started; until it has compiled a kernel, calls
    from other threads mask with the eager path (the same bits) instead of compiling it themselves.

    The thread count to compile for is read here: a caller may run torch ops on one thread meanwhile.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    threads = torch.get_num_threads()

    def warm_up() -> None:
        torch.set_num_threads(threads)  # a thread's own setting: what the serving thread's calls will ask for
        warm_up_cpu_bitmask_kernel(vocab_size, dtype)

    thread = threading.Thread(target=warm_up, name="cpu-bitmask-warm-up", daemon=True)
    _COMPILED.warm_up_thread = thread
    thread.start()
    return thread
