"""The model's CPU kernels are batch-invariant by construction: a row's result is bit for bit its result alone, for
every row count (across the tile and row-block sizes where the kernel changes its loops, and where BLAS libraries
change kernels: 2, 4, 16, 96), every thread count this machine has, every weight format, and every instruction set
the kernel builds for. And they compute what they should: float64 references within float32 rounding (for the
block formats, of the activations quantised per block as the kernels define it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cpu_kernels import build, library, ops, packed_weights
from cpu_kernels.build import narrows_here
from scheduler.server_args import ModelArgs
from tests.helpers import THREAD_COUNTS, assert_rows_invariant
from tests.unit.invariant_cases import (
    ATTENTION_SHAPES,
    DENSE_FORMATS,
    FORMATS,
    K_FORMATS,
    activations_as_multiplied,
    attention_case,
    fitted_width,
    random_weight,
    run_attention,
)

NARROWER_TARGETS = ("scalar", "avx2", "avx2-vnni", "avx512")

MODEL_SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
"""SmolLM2-135M's decoder matmuls, (in_features, out_features)."""


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    library.load(ModelArgs().kernel_build_path)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", MODEL_SHAPES)
def test_matmul_rows_do_not_depend_on_the_batch(fmt: str, name: str) -> None:
    in_features, out_features = MODEL_SHAPES[name]
    in_features = fitted_width(fmt, in_features)
    weight, exact = random_weight(fmt, out_features, in_features)
    x = torch.randn(64, in_features, generator=torch.Generator().manual_seed(1))
    assert_rows_invariant(lambda rows: ops.matmul(rows, weight), x, 64)
    expected = activations_as_multiplied(x, fmt) @ exact.T
    assert torch.allclose(ops.matmul(x, weight).double(), expected, rtol=1e-5, atol=1e-5)


def test_matmul_rows_cross_the_row_block() -> None:
    """Past 64 rows (96 for dense weights) the kernel streams the weights again for the next block of rows, and its
    threads claim smaller shares of the columns: nothing changes for a row."""
    weight, _ = random_weight("q4_1", 100, 64)
    x = torch.randn(100, 64, generator=torch.Generator().manual_seed(2))
    assert_rows_invariant(lambda rows: ops.matmul(rows, weight), x, 100)


@settings(max_examples=25, deadline=None)
@given(
    out_features=st.integers(1, 70),
    blocks=st.integers(1, 4),
    rows=st.integers(1, 20),
    fmt=st.sampled_from(FORMATS),
    seed=st.integers(0, 2**16),
)
def test_matmul_computes_the_product_for_any_shape(
    out_features: int, blocks: int, rows: int, fmt: str, seed: int
) -> None:
    """Widths that leave part of a 16-column panel empty, and any row count, give the product of the weights the
    format stands for, and each row as it is alone."""
    in_features = blocks * (packed_weights.SUPER_BLOCK if fmt in K_FORMATS else packed_weights.BLOCK)
    weight, exact = random_weight(fmt, out_features, in_features, seed)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed))
    out = ops.matmul(x, weight)
    assert out.shape == (rows, out_features)
    assert torch.allclose(out.double(), activations_as_multiplied(x, fmt) @ exact.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[-1:], ops.matmul(x[-1:], weight))


@pytest.mark.parametrize("fmt", [fmt for fmt in FORMATS if fmt not in DENSE_FORMATS])
def test_block_formats_quantise_activations_with_little_error(fmt: str) -> None:
    """Against the exact product of float32 activations, the int8 activations of a block format cost about what
    llama.cpp's do: a relative error of ~0.5 % per output (quantisation noise of 1/254 of each block's largest value),
    and rows of zeros or of one repeated value come out exact."""
    weight, exact = random_weight(fmt, 576, 1536)
    x = torch.randn(32, 1536, generator=torch.Generator().manual_seed(8))
    error = (ops.matmul(x, weight).double() - x.double() @ exact.T).norm() / (x.double() @ exact.T).norm()
    assert 1e-4 < error < 1e-2
    constant = torch.zeros(2, 1536)
    constant[1] = -0.375  # |x| = amax everywhere: q = -127 exactly
    assert torch.allclose(ops.matmul(constant, weight).double(), constant.double() @ exact.T, atol=1e-4)


def test_block_formats_quantise_every_block_as_defined_bit_for_bit() -> None:
    """Each 32-block of x is quantised as ``activations_as_multiplied`` defines it, to the bit, wherever it lies in
    the row (the kernels take 16 blocks at once, then the rest one by one): weights that pick one quantised value
    (Q8_0, w = 1 at k = n) give d * q, and Q4_1 weights of zero quants and minimum 1 in one block give d * sum(q)."""
    blocks = 20
    width = blocks * packed_weights.BLOCK
    x = torch.randn(6, width, generator=torch.Generator().manual_seed(10)) * torch.logspace(-3, 3, 6)[:, None]
    x[1] = 0.0
    x[2, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5] * 4)  # ties: round half to even
    x[3, 40:64] = -7.25  # a block's largest value repeated, negative
    amax = x.reshape(6, blocks, -1).abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)
    q = torch.round(x.reshape(6, blocks, -1) * inverse)
    d = amax / 127
    picks = packed_weights.pack_q8_0(torch.ones(width, blocks).half(), torch.eye(width, dtype=torch.int8))
    assert torch.equal(ops.matmul(x, picks), (d * q).reshape(6, width))
    mins = torch.eye(blocks).half()  # column b: minimum 1 in block b, 0 elsewhere
    sums = packed_weights.pack_q4_1(torch.ones(blocks, blocks).half(), mins, torch.zeros(blocks, width).byte())
    assert torch.equal(ops.matmul(x, sums), (d * q.sum(dim=-1, keepdim=True)).reshape(6, blocks))


@pytest.mark.parametrize(("fmt", "offset"), [("q4_0", 8), ("q5_0", 16)])
def test_offset_formats_compute_what_q8_0_computes(fmt: str, offset: int) -> None:
    """Q4_0 and Q5_0 blocks give the bits of Q8_0 blocks holding their integers ``q - offset``: one integer sum,
    then one fma per block, so a stack of these formats with Q8_0 ones can be packed as Q8_0 without a changed bit."""
    generator = torch.Generator().manual_seed(9)
    scales = (torch.rand(50, 6, generator=generator) * 0.01).half()
    quants = torch.randint(0, 2 * offset, (50, 192), generator=generator).byte()
    x = torch.randn(5, 192, generator=generator)
    as_q8_0 = packed_weights.pack_q8_0(scales, (quants.short() - offset).to(torch.int8))
    packed = getattr(packed_weights, f"pack_{fmt}")(scales, quants)
    assert torch.equal(ops.matmul(x, packed), ops.matmul(x, as_q8_0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_weights_packed_as_they_are_compute_their_float32_bits(dtype: torch.dtype) -> None:
    """float16 and bfloat16 panels convert each weight to float32 exactly, then run the float32 fma chain."""
    weight = (torch.randn(40, 96, generator=torch.Generator().manual_seed(10)) * 0.05).to(dtype)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(11))
    as_float32 = packed_weights.pack_dense(weight.float(), torch.float32)
    assert torch.equal(ops.matmul(x, packed_weights.pack_dense(weight, dtype)), ops.matmul(x, as_float32))


F32 = torch.float32
ATTENTION_LAYOUTS = [
    ("smollm2", False, F32),
    *((shape, True, F32) for shape in ATTENTION_SHAPES),
    *(("smollm2", runs, kv) for kv in (torch.bfloat16, torch.float16) for runs in (False, True)),
]
"""(shape, runs, the KV pool's elements): every shape's tiles on a float32 pool, SmolLM2's on 16-bit pools."""


@pytest.mark.parametrize(("shape", "runs", "kv_dtype"), ATTENTION_LAYOUTS)
def test_attention_of_a_token_does_not_depend_on_the_batch(shape: str, runs: bool, kv_dtype: torch.dtype) -> None:
    """Alone, a token takes the head_dim-in-lanes path; in a run of its sequence (a prefill, an extend, cut by the
    slice at every length, so across every tile size) the keys-in-lanes tiles: the same bits, from a float32 pool or
    a 16-bit one."""
    case = attention_case(shape=shape, runs=runs, kv_dtype=kv_dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([run_attention(case, slice(t, t + 1)) for t in range(64)])
        for count in THREAD_COUNTS:
            torch.set_num_threads(count)
            for first in (0, 5):
                for tokens in range(1, 64 - first + 1):
                    together = run_attention(case, slice(first, first + tokens))
                    assert torch.equal(together, alone[first : first + tokens]), f"{tokens} tokens on {count} threads"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("shape", "runs", "kv_dtype"), ATTENTION_LAYOUTS)
def test_attention_computes_softmax_attention(shape: str, runs: bool, kv_dtype: torch.dtype) -> None:
    """Softmax attention over the pool's values (a 16-bit pool's read exactly), within float32 rounding."""
    case = attention_case(seed=3, shape=shape, runs=runs, kv_dtype=kv_dtype)
    heads, kv_heads, head_dim = ATTENTION_SHAPES[shape]
    out = run_attention(case, slice(0, 64)).view(64, heads, head_dim).double()
    for t in range(64):
        rows = case["rows"][case["starts"][t] : case["starts"][t] + case["keys"][t]]
        keys = case["k"][rows].double().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)  # [H, L, D]
        values = case["v"][rows].double().transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        scores = case["q"][t].double()[:, None, :] @ keys.transpose(1, 2) * head_dim**-0.5
        expected = (torch.softmax(scores, dim=-1) @ values)[:, 0]
        assert torch.allclose(out[t], expected, atol=2e-6), t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_kv_pool_stores_values_rounded_as_torch_rounds_them(dtype: torch.dtype) -> None:
    """To nearest, ties to even: every float16 and bfloat16 value, its neighbours and the ties around it (subnormals,
    the largest finite values, the roundings to infinity) and random bit patterns; a NaN stays a NaN."""
    every = torch.arange(2**16, dtype=torch.int32).to(torch.int16)
    bits = torch.cat([every.view(kind).float().view(torch.int32) for kind in (torch.float16, torch.bfloat16)])
    nudges = (0, 1, -1, 0xFFF, 0x1000, 0x1001, 0x7FFF, 0x8000, 0x8001)
    random = torch.randint(
        -(2**31), 2**31 - 1, (1_000_000,), dtype=torch.int32, generator=torch.Generator().manual_seed(2)
    )
    values = torch.cat([*(bits + nudge for nudge in nudges), random]).view(torch.float32)
    stored = ops.kv_store(values, dtype)
    nan = values.isnan()
    assert torch.equal(stored[~nan].view(torch.int16), values[~nan].to(dtype).view(torch.int16))
    assert stored[nan].isnan().all()


@pytest.mark.parametrize("width", [576, 99])
def test_rms_norm_and_silu_rows_do_not_depend_on_the_batch(width: int) -> None:
    """Also at a width that is not a multiple of 16 (a tensor-parallel shard's MLP slice)."""
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(64, width, generator=generator) * 3
    weight = torch.randn(width, generator=generator)
    assert_rows_invariant(lambda rows: ops.rms_norm(rows, weight, 1e-5), hidden, 64)
    expected = hidden.double() * torch.rsqrt(hidden.double().pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    assert torch.allclose(ops.rms_norm(hidden, weight, 1e-5).double(), expected, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(64, 2 * width, generator=generator) * 8
    assert_rows_invariant(lambda rows: ops.silu_mul(rows.contiguous()), gate_up, 64)
    gate, up = gate_up.double().chunk(2, dim=1)
    assert torch.allclose(ops.silu_mul(gate_up).double(), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_the_kernels_keep_their_threads_when_torch_drops_to_one() -> None:
    """A serving process sets torch to one thread after fixing the kernels' count: they still use it (and their
    results are the same bits whatever it is)."""
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(8))
    weight = random_weight("q4_1", 40, 256)[0]
    torch_threads = torch.get_num_threads()
    try:
        library.set_kernel_threads(3)
        torch.set_num_threads(1)
        assert library.kernel_threads() == 3
        assert torch.equal(ops.matmul(x, weight), ops.matmul(x, weight, threads=1))
        with pytest.raises(ValueError, match="at least one thread"):
            library.set_kernel_threads(0)
    finally:
        library.set_kernel_threads(None)
        torch.set_num_threads(torch_threads)
    assert library.kernel_threads() == torch_threads


def test_gelu_tanh_and_softcap_rows_do_not_depend_on_the_batch() -> None:
    """Gemma's MLP activation and its logits' soft-capping: row by row as alone, and within float32 rounding of torch's
    (also where exp saturates: inputs of +-100 and beyond)."""
    generator = torch.Generator().manual_seed(8)
    gate_up = torch.randn(64, 2 * 99, generator=generator) * 4
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 1e20, -1e20])
    assert_rows_invariant(lambda rows: ops.gelu_tanh_mul(rows.contiguous()), gate_up, 64)
    gate, up = gate_up.double().chunk(2, dim=1)
    expected = F.gelu(gate, approximate="tanh") * up
    assert torch.allclose(ops.gelu_tanh_mul(gate_up).double(), expected, rtol=1e-5, atol=1e-5)
    logits = torch.randn(64, 1301, generator=generator) * 40
    capped = lambda rows: ops.softcap(rows.clone(), 30.0)  # noqa: E731
    assert_rows_invariant(capped, logits, 64)
    expected = torch.tanh(logits.double() / 30) * 30
    assert torch.allclose(capped(logits).double(), expected, rtol=0, atol=1e-5)


CROSS_ISA_SCRIPT = """
import json, sys, torch
from pathlib import Path
from cpu_kernels import library, ops, packed_weights
from triton_ops.bitmask_cpu import mask_logits
from triton_ops.sampling_noise import exponentials_cpu, gumbel_race_cpu
from tests.unit.invariant_cases import ATTENTION_SHAPES, FORMATS, attention_case, random_weight, run_attention
library.load(Path(sys.argv[1]), sys.argv[2])
x = torch.randn(7, 256, generator=torch.Generator().manual_seed(5))
outs = [ops.matmul(x, random_weight(fmt, 40, 256)[0]) for fmt in FORMATS]
# rows of 20 blocks: the activations quantised 16 blocks at once, then one by one
wide_x = torch.randn(7, 640, generator=torch.Generator().manual_seed(11))
outs += [ops.matmul(wide_x, random_weight(fmt, 40, 640)[0]) for fmt in ("q8_0", "q4_1")]
# the extremes of 8-bit products (-128 and 127 weights times +-127 quants): no build's pairwise sums saturate
wide = torch.tensor([-128, 127, -128, -128, 127, 127, -128, 127], dtype=torch.int8).repeat(40, 32)
extreme, signs = wide[:, :96], torch.tensor([1.0, -1.0, -1.0, 1.0]).repeat(7, 64)
outs.append(ops.matmul(signs[:, :96], packed_weights.pack_q8_0(torch.ones(40, 3).half(), extreme)))
nibbles = (extreme.to(torch.int16) & 15).to(torch.uint8)
scales, mins = torch.ones(40, 3).half(), torch.zeros(40, 3).half()
outs.append(ops.matmul(signs[:, :96], packed_weights.pack_q4_1(scales, mins, nibbles)))
# and the other formats' largest quants (every high bit set) against zeros, with the largest sub-block scales
top = lambda bits: (wide >= 0).byte() * (2**bits - 1)
ones, sub = torch.ones(40, 8).half(), torch.full((40, 8), 63).byte()
outs.append(ops.matmul(signs, packed_weights.pack_q4_0(ones, top(4))))
outs.append(ops.matmul(signs, packed_weights.pack_q5_0(ones, top(5))))
outs.append(ops.matmul(signs, packed_weights.pack_q5_1(ones, -ones, top(5))))
outs.append(ops.matmul(signs, packed_weights.pack_q4_k(ones[:, :1], ones[:, :1], sub, sub, top(4))))
outs.append(ops.matmul(signs, packed_weights.pack_q5_k(ones[:, :1], ones[:, :1], sub, sub, top(5))))
outs.append(ops.matmul(signs, packed_weights.pack_q6_k(ones[:, :1], wide[:, :16], top(6))))
# one and two rows take wider tiles, narrow and wide weights other groupings: the same bits in every build
for fmt in FORMATS:
    outs += [ops.matmul(x[:m], random_weight(fmt, n, 256)[0]) for m in (1, 2) for n in (40, 1100)]
# attention of tokens alone (head_dim in lanes) and in runs (keys in lanes), for each shape's tiles
for shape in ATTENTION_SHAPES:
    outs += [run_attention(attention_case(shape=shape, runs=runs), slice(0, 64)) for runs in (False, True)]
# 16-bit KV pools: rounded as stored (integer arithmetic), read exactly
for kv in (torch.bfloat16, torch.float16):
    outs += [run_attention(attention_case(runs=runs, kv_dtype=kv), slice(0, 64)) for runs in (False, True)]
    specials = torch.tensor([65504.0, 65519.0, 65520.0, 6.0e-8, 2.9e-8, 3.0e-8, -1e-40, 1e39, 3.3895e38, 1 / 3])
    outs.append(ops.kv_store(torch.cat([specials, torch.randn(1000, generator=torch.Generator().manual_seed(4))]), kv))
outs.append(ops.rms_norm(x, torch.linspace(-1, 1, 256), 1e-6))
embed_scales = (torch.randn(50, 8, generator=torch.Generator().manual_seed(10)) * 1e-2).half()
embed_quants = torch.randint(-128, 128, (50, 256), dtype=torch.int8, generator=torch.Generator().manual_seed(11))
outs.append(ops.q8_0_rows(embed_scales, embed_quants, torch.tensor([3, 0, 49])))
# a tied embedding's rows from the head's panels (groups of 8 panels on AVX-512, of 1 elsewhere)
outs += [ops.packed_rows(random_weight(fmt, 300, 256)[0], torch.tensor([3, 0, 299, 130])) for fmt in FORMATS]
outs.append(ops.silu_mul(x * 10))
outs.append(ops.gelu_tanh_mul(x * 10))
outs.append(ops.softcap(x[:, :250] * 40, 30.0))
# the grammar mask: masked stores on AVX-512, a select loop elsewhere; a vocab past the last word, and a row subset
words = torch.randint(-2**31, 2**31, (3, 40), dtype=torch.int32, generator=torch.Generator().manual_seed(6))
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    logits = torch.randn(3, 1300, generator=torch.Generator().manual_seed(7)).to(dtype)
    mask_logits(logits, words, torch.tensor([2, 0]))
    outs.append(logits)
# the sampler's Exp(1) draws: integer hashing and a log series of adds, multiplies and one division
outs.append(exponentials_cpu(torch.tensor([0, -1, 2**63 - 1, 123456789]), 1301))
race_logits = torch.randn(5, 1301, generator=torch.Generator().manual_seed(9)) * 5
race_temperatures = torch.tensor([0.3, 0.7, 1.0, 1.5, 0.0])  # the last greedy
outs.append(gumbel_race_cpu(race_logits, race_temperatures, torch.tensor([1, 2, 3, 4, 5])))
bits = [o.view(torch.int32 if o.element_size() == 4 else torch.int16).flatten().tolist() for o in outs]
print(json.dumps({"isa": library.isa(), "bits": bits}))
"""


@pytest.mark.parametrize(
    ("flags", "narrower"),
    [
        ({"avx2", "fma", "f16c"}, ["scalar"]),  # AMD EPYC Zen 3: its avx2 build is its native one
        ({"avx2", "fma", "f16c", "gfni"}, ["scalar"]),  # the kernels use no GFNI: no build without it
        ({"avx2", "fma", "f16c", "avx_vnni", "gfni"}, ["scalar", "avx2"]),
        ({"avx2", "fma", "f16c", "avx_vnni", "gfni", "avx512f", "avx512bw", "avx512_vnni"}, list(NARROWER_TARGETS)),
    ],
    ids=["avx2", "avx2-gfni", "avx2-vnni-gfni", "avx512-vnni"],
)
def test_the_narrower_builds_are_those_that_turn_off_what_the_cpu_has(
    flags: set[str], narrower: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(build, "cpu_flags", lambda: frozenset(flags))
    assert [target for target in NARROWER_TARGETS if narrows_here(target)] == narrower


@pytest.mark.prepared_ahead(*(f"{target} kernels" for target in NARROWER_TARGETS))
def test_every_instruction_set_computes_the_same_bits() -> None:
    """The AVX-512 and AVX2 builds, each with and without 8-bit dot products (VNNI), and the scalar build (as many
    as this CPU runs, and that turn off something it has: another would be the native build again) give identical
    results: lanes hold different outputs, never parts of one float sum, integer sums are exact whatever instruction
    forms them, and the fixed reduction trees and exp polynomial are the same in every build; the logits mask stores
    the same -inf bits, and the sampler's draws are the same. So a model's outputs are the same on every CPU, not only
    on each."""
    targets = ["native", *filter(narrows_here, NARROWER_TARGETS)]
    runs = [  # at once: each builds its library (seconds of compiler) and imports torch
        subprocess.Popen(
            [sys.executable, "-c", CROSS_ISA_SCRIPT, str(ModelArgs().kernel_build_path), target],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
        for target in targets
    ]
    results = {}
    for target, run in zip(targets, runs, strict=True):
        stdout, stderr = run.communicate()
        assert run.returncode == 0, f"the {target} build failed:\n{stderr[-3000:]}"
        result = json.loads(stdout.strip().splitlines()[-1])
        results[f"{target} ({result['isa']})"] = result["bits"]
    reference = results.pop("scalar (scalar)")
    for name, bits in results.items():
        assert bits == reference, f"the {name} build differs from the scalar build"
