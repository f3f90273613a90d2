"""Every bitmask implementation against the torch reference: dtypes, shapes, row subsets, edge masks, bad input.

The Triton kernel runs through Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1); the NPU
path's host round trip runs on CPU tensors, where it needs no torch_npu.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpu_kernels import build, library, ops, packed_weights
from scheduler.server_args import ModelArgs
from triton_ops import (
    apply_token_bitmask_inplace,
    apply_token_bitmask_inplace_cpu,
    apply_token_bitmask_inplace_cpu_eager,
    apply_token_bitmask_inplace_npu,
    apply_token_bitmask_inplace_reference,
    apply_token_bitmask_inplace_triton,
    bitmask_cpu,
    load_cpu_bitmask_kernel,
)
from triton_ops.bitmask_cpu import mask_logits
from triton_ops.bitmask_format import ALL_ALLOWED, pack_bool_mask, unpack_bitmask
from triton_ops.thread_choice import RECENT_APPLIES

Kernel = Callable[..., None]
IMPLEMENTATIONS: dict[str, Kernel] = {
    "triton_interpreter": apply_token_bitmask_inplace_triton,
    "cpu_library": apply_token_bitmask_inplace_cpu,
    "cpu_eager": apply_token_bitmask_inplace_cpu_eager,
    "npu_host_round_trip": apply_token_bitmask_inplace_npu,
    "dispatcher": apply_token_bitmask_inplace,
}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True, scope="module")
def cpu_mask_library() -> None:
    """The C++ masking loop serves the CPU path from here on in this process, as in a server."""
    assert load_cpu_bitmask_kernel(ModelArgs().kernel_build_path), "the kernels should build on this machine"


@pytest.fixture(params=list(IMPLEMENTATIONS))
def kernel(request: pytest.FixtureRequest) -> Kernel:
    if request.param == "triton_interpreter":
        triton = pytest.importorskip("triton")
        if not triton.knobs.runtime.interpret:
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    return IMPLEMENTATIONS[request.param]


def make_logits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits with a NaN and a +inf planted: masking must overwrite them, keeping must not touch them."""
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    flat = logits.view(-1)
    flat[0], flat[-1] = float("nan"), float("inf")
    return logits


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual.isneginf(), expected.isneginf()), "the -inf pattern differs from the reference"
    assert torch.equal(actual.isnan(), expected.isnan())
    kept = ~expected.isnan()
    assert torch.equal(actual[kept], expected[kept]), "values that should be untouched changed"


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    vocab: int
    num_words: int | None = None  # None: ceil(vocab / 32)
    indices: tuple[int, ...] | None = None
    indices_as_tensor: bool = False
    one_dim: bool = False
    mask: str = "random"  # random | sparse (~1% allowed, like JSON) | extremes (all allowed / none / random)


CASES = [
    Case("vocab_multiple_of_32", 4, 1024),
    Case("vocab_not_multiple_of_32", 3, 4099),
    Case("small_vocab", 2, 100),
    Case("vocab_below_one_word", 2, 20),
    Case("indices_tensor", 5, 1000, indices=(3, 0), indices_as_tensor=True),
    Case("indices_list", 5, 1000, indices=(4, 1)),
    Case("indices_repeated_row", 3, 100, indices=(1, 1)),
    Case("indices_empty", 3, 1000, indices=()),
    Case("one_dim_logits", 1, 1000, one_dim=True),
    Case("bitmask_narrower_than_logits", 3, 1000, num_words=20),
    Case("bitmask_narrower_not_word_aligned", 2, 100, num_words=3),
    Case("bitmask_wider_than_logits", 2, 100, num_words=6),
    Case("all_allowed_and_all_disallowed_rows", 3, 4099, mask="extremes"),
    Case("json_like_sparse_mask", 4, 4096, mask="sparse", indices=(0, 2, 3)),
]


def make_bitmask(case: Case, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    num_words = (case.vocab + 31) // 32 if case.num_words is None else case.num_words
    if case.mask == "sparse":
        allowed = torch.rand(case.batch, num_words * 32, generator=generator) < 0.01
        return pack_bool_mask(allowed)
    bitmask = torch.randint(-(2**31), 2**31, (case.batch, num_words), dtype=torch.int32, generator=generator)
    if case.mask == "extremes":
        bitmask[0] = ALL_ALLOWED
        bitmask[1] = 0
    return bitmask


def run_case(kernel: Kernel, case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    logits = make_logits((case.vocab,) if case.one_dim else (case.batch, case.vocab), dtype, seed=len(case.name))
    bitmask = make_bitmask(case, seed=case.vocab)
    if case.one_dim:
        bitmask = bitmask[0]
    indices = None if case.indices is None else list(case.indices)
    expected = logits.clone()
    apply_token_bitmask_inplace_reference(expected, bitmask, indices)
    actual = logits.clone()
    kernel(actual, bitmask, torch.tensor(indices) if case.indices_as_tensor else indices)
    return actual, expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_matches_reference(kernel: Kernel, case: Case, dtype: torch.dtype) -> None:
    actual, expected = run_case(kernel, case, dtype)
    assert_same_logits(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_extreme_rows_are_kept_whole_or_blanked_whole(kernel: Kernel, dtype: torch.dtype) -> None:
    actual, _ = run_case(kernel, Case("extremes", 3, 4099, mask="extremes"), dtype)
    assert not actual[0].isneginf().any(), "a row of -1 words allows every token"
    assert actual[1].isneginf().all(), "a row of 0 words allows no token"


def test_rows_outside_indices_are_untouched(kernel: Kernel) -> None:
    logits = make_logits((4, 1000), torch.float32, seed=1)
    original = logits.clone()
    kernel(logits, torch.zeros(4, 32, dtype=torch.int32), [2])
    assert logits[2].isneginf().all()
    assert torch.equal(logits[[0, 1, 3]].nan_to_num(), original[[0, 1, 3]].nan_to_num())


def test_tokens_past_a_narrow_bitmask_are_disallowed(kernel: Kernel) -> None:
    logits = torch.zeros(2, 100)
    kernel(logits, torch.full((2, 2), -1, dtype=torch.int32))
    assert not logits[:, :64].isneginf().any()
    assert logits[:, 64:].isneginf().all()


@st.composite
def masking_problems(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, list[int] | None]:
    batch = draw(st.integers(1, 4))
    vocab = draw(st.integers(1, 300))
    num_words = draw(st.integers(0, (vocab + 31) // 32 + 1))
    words = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=batch * num_words, max_size=batch * num_words))
    bitmask = torch.tensor(words, dtype=torch.int32).reshape(batch, num_words)
    dtype = draw(st.sampled_from(DTYPES))
    logits = make_logits((batch, vocab), dtype, seed=draw(st.integers(0, 1000)))
    indices = draw(st.none() | st.lists(st.integers(0, batch - 1), max_size=batch + 1))
    return logits, bitmask, indices


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=masking_problems())
def test_random_bitmasks_match_reference(kernel: Kernel, problem: tuple) -> None:
    logits, bitmask, indices = problem
    expected = logits.clone()
    apply_token_bitmask_inplace_reference(expected, bitmask, indices)
    kernel(logits, bitmask, indices)
    assert_same_logits(logits, expected)


@st.composite
def large_masking_problems(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    """Batches and vocabs big enough for the parallel kernel; masks sparse, dense or random, as decoding makes them."""
    batch = draw(st.integers(1, 40))
    vocab = draw(st.integers(1, 12_000))
    num_words = max(0, (vocab + 31) // 32 + draw(st.integers(-2, 2)))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    share = draw(st.sampled_from((0.01, 0.5, 0.99)))
    bitmask = pack_bool_mask(torch.rand(batch, num_words * 32, generator=generator) < share)
    return make_logits((batch, vocab), draw(st.sampled_from(DTYPES)), seed), bitmask


@pytest.mark.parametrize("threads", ["one", "all"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(problem=large_masking_problems())
def test_each_thread_count_matches_reference(
    monkeypatch: pytest.MonkeyPatch, threads: str, problem: tuple[torch.Tensor, torch.Tensor]
) -> None:
    count = 1 if threads == "one" else torch.get_num_threads()
    monkeypatch.setattr(bitmask_cpu._THREAD_CHOICE, "threads_for", lambda num_elements, max_threads: count)
    logits, bitmask = problem
    expected = logits.clone()
    apply_token_bitmask_inplace_reference(expected, bitmask)
    apply_token_bitmask_inplace_cpu(logits, bitmask)
    assert_same_logits(logits, expected)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=200))
def test_reference_follows_the_format_definition(allowed: list[bool]) -> None:
    allowed_tensor = torch.tensor(allowed)
    bitmask = pack_bool_mask(allowed_tensor)
    assert torch.equal(unpack_bitmask(bitmask, len(allowed)), allowed_tensor)
    logits = torch.zeros(len(allowed))
    apply_token_bitmask_inplace_reference(logits, bitmask)
    assert [not bool(x) for x in logits.isneginf()] == allowed


BAD_INPUTS = [
    ("logits_int", lambda: (torch.zeros(2, 64, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32), None)),
    ("logits_float64", lambda: (torch.zeros(2, 64, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.int32), None)),
    ("logits_3d", lambda: (torch.zeros(1, 2, 64), torch.zeros(2, 2, dtype=torch.int32), None)),
    ("bitmask_int64", lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64), None)),
    ("bitmask_3d", lambda: (torch.zeros(2, 64), torch.zeros(1, 2, 2, dtype=torch.int32), None)),
    ("bitmask_rows_mismatch", lambda: (torch.zeros(2, 64), torch.zeros(3, 2, dtype=torch.int32), None)),
    ("index_out_of_range", lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), [2])),
    ("index_negative", lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([-1]))),
    ("index_float", lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0.0]))),
    ("index_2d", lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([[0]]))),
    ("index_list_of_str", lambda: (torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int32), ["0"])),
]


@pytest.mark.parametrize(("name", "make_args"), BAD_INPUTS, ids=[name for name, _ in BAD_INPUTS])
def test_malformed_input_raises_value_error(kernel: Kernel, name: str, make_args: Callable) -> None:
    logits, bitmask, indices = make_args()
    original = logits.clone()
    with pytest.raises(ValueError, match=r"logits|bitmask|indices"):
        kernel(logits, bitmask, indices)
    assert torch.equal(logits, original), "a refused call must not write"


def test_rows_strided_logits_and_bitmask_match_reference(kernel: Kernel) -> None:
    """Column slices of wider buffers, offset by one element: row strides differ from the widths."""
    for dtype in DTYPES:
        logits_buffer = make_logits((3, 1100), dtype, seed=3)
        bitmask_buffer = make_bitmask(Case("strided", 3, 1100, num_words=40), seed=3)
        logits, bitmask = logits_buffer[:, 1:1025], bitmask_buffer[:, 1:33]
        expected = logits.clone()
        apply_token_bitmask_inplace_reference(expected, bitmask)
        untouched = (logits_buffer[:, :1].clone(), logits_buffer[:, 1025:].clone())
        kernel(logits, bitmask)
        assert_same_logits(logits, expected)
        assert torch.equal(logits_buffer[:, :1].nan_to_num(), untouched[0].nan_to_num())
        assert torch.equal(logits_buffer[:, 1025:].nan_to_num(), untouched[1].nan_to_num())


def refuse_the_eager_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the eager path masked where the library should have")

    monkeypatch.setattr(bitmask_cpu, "_mask_words_eager", refuse)
    monkeypatch.setattr(bitmask_cpu, "_mask_leftover_columns", refuse)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_library_masks_every_batch_size_vocab_and_row_subset(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    refuse_the_eager_path(monkeypatch)
    # The last shape is large enough for the thread choice, repeated until it has timed both thread counts.
    for batch, vocab in ((1, 1024), (3, 4096), (17, 4099), (2, 96), (2, 5), *[(520, 4099)] * (2 * RECENT_APPLIES)):
        logits = make_logits((batch, vocab), dtype, seed=batch)
        bitmask = make_bitmask(Case("shapes", batch, vocab), seed=batch)
        for indices in (None, [0], list(range(batch)), [batch - 1, 0, batch - 1]):
            expected = logits.clone()
            apply_token_bitmask_inplace_reference(expected, bitmask, indices)
            actual = logits.clone()
            apply_token_bitmask_inplace_cpu(actual, bitmask, indices)
            assert_same_logits(actual, expected)


def test_without_a_cpp_compiler_the_eager_path_serves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def no_compiler() -> str:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(library, "_library", None)
    monkeypatch.setattr(build, "_compiler", no_compiler)
    eager_calls: list[int] = []
    mask_eagerly = bitmask_cpu._mask_words_eager

    def counted_eager(words: torch.Tensor, bitmask_words: torch.Tensor) -> None:
        eager_calls.append(words.shape[0])
        mask_eagerly(words, bitmask_words)

    monkeypatch.setattr(bitmask_cpu, "_mask_words_eager", counted_eager)
    assert not load_cpu_bitmask_kernel(tmp_path), "the library cannot be built without a compiler"
    actual, expected = run_case(apply_token_bitmask_inplace_cpu, CASES[1], torch.float16)
    assert_same_logits(actual, expected)
    assert eager_calls, "the eager path should have masked"


def test_masks_applied_beside_a_running_forward_kernel_are_exact() -> None:
    """ctypes releases the GIL, so a mask applied on one thread may meet another thread's matmul in the library's
    thread pool: each call waits its turn, and both results are exact. (Without the turns, measured: the two jobs'
    claims interleave and neither call returns.)"""
    generator = torch.Generator().manual_seed(0)
    weight = packed_weights.pack_dense(torch.randn(1536, 576, generator=generator))
    x = torch.randn(16, 576, generator=generator)
    expected_product = ops.matmul(x, weight, threads=2)
    case = Case("beside", 8, 49_152, mask="sparse")
    source = make_logits((case.batch, case.vocab), torch.float32, seed=0)
    bitmask = make_bitmask(case, seed=0)
    expected = source.clone()
    apply_token_bitmask_inplace_reference(expected, bitmask)
    expected_bits = expected.view(torch.int32)
    logits = source.clone()
    wrong_products = []

    def multiply() -> None:
        for _ in range(400):
            if not torch.equal(ops.matmul(x, weight, threads=2), expected_product):
                wrong_products.append(1)

    worker = threading.Thread(target=multiply)
    worker.start()
    wrong_masks = 0
    try:
        while worker.is_alive():
            logits.copy_(source)
            mask_logits(logits, bitmask, threads=2)
            wrong_masks += not torch.equal(logits.view(torch.int32), expected_bits)
    finally:
        worker.join(120)
    assert wrong_masks == 0 and not wrong_products, (wrong_masks, len(wrong_products))


def test_triton_on_cpu_without_the_interpreter_is_refused() -> None:
    triton = pytest.importorskip("triton")
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            apply_token_bitmask_inplace_triton(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.int32))


def test_package_works_without_triton() -> None:
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, triton_ops\n"
        "logits = torch.zeros(1, 20)\n"  # under one word: masked without compiling anything
        "triton_ops.apply_token_bitmask_inplace(logits, torch.zeros(1, 1, dtype=torch.int32))\n"
        "assert logits.isneginf().all()\n"
        "try:\n"
        "    triton_ops.apply_token_bitmask_inplace_triton(logits, torch.zeros(1, 2, dtype=torch.int32))\n"
        "except ImportError as e:\n"
        "    assert 'pip install triton' in str(e)\n"
        "else:\n"
        "    raise AssertionError('expected ImportError')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
