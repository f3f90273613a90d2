"""GGUF blocks kept as the file stores them (``scheduler.model.gguf_blocks``): every block format's unpacking gives,
tensor by tensor, the weights of gguf's reference de-quantisation (``gguf.quants.dequantize``), on bytes of every
bit pattern and on bytes the quantizers make (gguf's own; llama.cpp's for the k-quants, where it is installed); the
kernels multiply them as those weights; and they survive the cache's safetensors names and a GGUF file."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGUFValueType
from gguf.quants import dequantize, quantize

from cpu_kernels import library, ops, packed_weights
from cpu_kernels.decoder import Decoder, DecoderBatch, DecoderLayer, Rope
from scheduler.model.gguf_blocks import (
    FORMATS,
    BlockQuantized,
    from_parts,
    read_blocks,
    read_gguf_weights,
    split_part_name,
    stack_blocks,
)
from scheduler.model.gguf_file import read_gguf_file
from scheduler.model.llama import pack_blocks, pack_weight
from scheduler.server_args import ModelArgs
from tests.unit.invariant_cases import activations_as_multiplied

K_QUANTS = ("q4_k", "q5_k", "q6_k")
FLOAT16_FIELDS = {
    "q8_0": (0,),
    "q4_0": (0,),
    "q5_0": (0,),
    "q4_1": (0, 2),
    "q5_1": (0, 2),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
}
"""Byte offsets of each stored block's float16 scales and minimums."""


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    library.load(ModelArgs().kernel_build_path)


def gguf_type(fmt: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[fmt.upper()]


def random_bytes(fmt: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Stored blocks of random bytes (every quant, scale and high-bit pattern), their float16 fields finite."""
    block_size, type_size = GGML_QUANT_SIZES[gguf_type(fmt)]
    generator = np.random.default_rng(seed)
    blocks = generator.integers(0, 256, (rows, columns // block_size, type_size), dtype=np.uint8)
    for offset in FLOAT16_FIELDS[fmt]:
        halves = (generator.uniform(-1, 1, blocks.shape[:2]) * 2e-3).astype(np.float16)
        blocks[..., offset : offset + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def llama_cpp_quantize(data: np.ndarray, fmt: str) -> np.ndarray:
    """``data`` quantised by llama.cpp's own quantizer (ggml_quantize_chunk, as llama_model_quantize calls it)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    library = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    library.ggml_quantize_chunk.restype = ctypes.c_size_t
    library.ggml_quantize_chunk.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3
    library.ggml_quantize_chunk.argtypes += [ctypes.c_void_p]
    block_size, type_size = GGML_QUANT_SIZES[gguf_type(fmt)]
    rows, columns = data.shape
    src = np.ascontiguousarray(data, dtype=np.float32)
    out = np.zeros((rows, columns // block_size * type_size), dtype=np.uint8)
    written = library.ggml_quantize_chunk(
        gguf_type(fmt).value, src.ctypes.data, out.ctypes.data, 0, rows, columns, None
    )
    assert written == out.nbytes
    return out


def quantized_bytes(fmt: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Gaussian weights quantised by gguf's quantizer, or llama.cpp's for the k-quants (gguf has none)."""
    data = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32) * 0.05
    return llama_cpp_quantize(data, fmt) if fmt in K_QUANTS else quantize(data, gguf_type(fmt))


def reference(raw: np.ndarray, fmt: str) -> torch.Tensor:
    return torch.from_numpy(np.array(dequantize(raw, gguf_type(fmt)), dtype=np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_bit_pattern_unpacks_to_ggufs_weights(fmt: str) -> None:
    raw = random_bytes(fmt, 37, 512, seed=len(fmt))
    blocks = read_blocks(raw, gguf_type(fmt))
    assert blocks is not None and blocks.format == fmt
    weights = reference(raw, fmt)
    assert torch.equal(blocks.dequantize(), weights)
    rows = torch.tensor([5, 0, 36, 5])
    assert torch.equal(blocks.rows(rows), weights[rows])
    assert torch.equal(blocks.narrow(0, 3, 20).dequantize(), weights[3:20])
    assert torch.equal(blocks.narrow(1, 256, 512).dequantize(), weights[:, 256:512])
    parts = {split_part_name(name): tensor for name, tensor in blocks.tensors("model.w.weight").items()}
    assert all(key is not None and key[:2] == ("model.w.weight", fmt) for key in parts)
    again = from_parts(fmt, {key[2]: tensor for key, tensor in parts.items() if key is not None})
    assert torch.equal(again.dequantize(), weights)


def test_q8_0_rows_are_ggufs_weights() -> None:
    """The embedding lookup from Q8_0 blocks (llama.cpp's token embeddings; one kernel call a decode step) gives
    gguf's de-quantised rows bit for bit, and refuses an id past the last row."""
    raw = random_bytes("q8_0", 37, 512, seed=8)
    blocks = read_blocks(raw, gguf_type("q8_0"))
    assert blocks is not None
    rows = torch.tensor([5, 0, 36, 5])
    assert torch.equal(ops.q8_0_rows(blocks.scales, blocks.quants, rows), reference(raw, "q8_0")[rows])
    with pytest.raises(IndexError):
        ops.q8_0_rows(blocks.scales, blocks.quants, torch.tensor([37]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantizer_blocks_multiply_as_their_weights(fmt: str) -> None:
    """The quantizers' blocks, de-quantised as gguf does, and the kernels' product with them: the product of those
    float weights with the activations quantised per block, within float32 rounding."""
    raw = quantized_bytes(fmt, 70, 768, seed=3)
    blocks = read_blocks(raw, gguf_type(fmt))
    assert blocks is not None
    weights = reference(raw, fmt)
    assert torch.equal(blocks.dequantize(), weights)
    packed = pack_blocks(blocks)
    assert packed.format.name.lower() == fmt
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(4))
    expected = activations_as_multiplied(x, fmt) @ weights.double().T
    assert torch.allclose(ops.matmul(x, packed).double(), expected, rtol=1e-5, atol=1e-5)


def test_q4_0_and_q5_0_stacked_with_q8_0_are_packed_as_q8_0() -> None:
    """A q, k, v stack whose parts llama.cpp quantised differently (SmolLM2's Q4_K_M: Q5_0 beside Q8_0) stays blocks:
    Q8_0 holds the others' weights exactly, and each part's outputs keep their bits."""
    parts = [read_blocks(quantized_bytes(fmt, 24, 256, seed=5), gguf_type(fmt)) for fmt in ("q5_0", "q8_0", "q4_0")]
    blocks = [part for part in parts if part is not None]
    stacked = pack_weight(blocks, torch.float32)
    assert stacked.format == packed_weights.WeightFormat.Q8_0
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([ops.matmul(x, pack_blocks(part)) for part in blocks], dim=1)
    assert torch.equal(ops.matmul(x, stacked), alone)


def test_other_mixed_formats_stack_each_run_of_a_format_as_its_blocks() -> None:
    """A Q4_K_M file's q and k in Q4_K beside a v in Q6_K stay blocks (they were de-quantised to float32): a stack
    of one part per run of a format, as compact as the file, each part's outputs its bits alone."""
    shapes = (("q4_k", 32), ("q4_k", 16), ("q6_k", 16))
    parts = [read_blocks(random_bytes(fmt, rows, 256, seed=rows), gguf_type(fmt)) for fmt, rows in shapes]
    blocks = [part for part in parts if part is not None]
    stacked = pack_weight(blocks, torch.float32)
    assert isinstance(stacked, packed_weights.WeightStack)
    assert [part.format for part in stacked.parts] == [
        packed_weights.WeightFormat.Q4_K,
        packed_weights.WeightFormat.Q6_K,
    ]
    assert (stacked.out_features, stacked.in_features) == (64, 256)
    assert stacked.num_weight_bytes == sum(GGML_QUANT_SIZES[gguf_type(fmt)][1] * rows for fmt, rows in shapes)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([ops.matmul(x, pack_blocks(part)) for part in blocks], dim=1)
    assert torch.equal(ops.matmul(x, stacked), alone)


def test_the_decoder_multiplies_a_stack_part_by_part_into_its_columns() -> None:
    """One layer whose q, k, v and gate, up are stacks of separately packed parts computes the bits of the same layer
    with each stacked into one weight (the C++ side's chain of parts: columns, widths, the MLP's halves)."""
    hidden, heads, kv_heads, head_dim, inter, tokens = 256, 4, 2, 64, 512, 6
    q8 = lambda rows, columns, seed: read_blocks(random_bytes("q8_0", rows, columns, seed), gguf_type("q8_0"))  # noqa: E731
    qkv = [q8(heads * head_dim, hidden, 1), q8(kv_heads * head_dim, hidden, 2), q8(kv_heads * head_dim, hidden, 3)]
    gate_up = [q8(inter, hidden, 4), q8(inter, hidden, 5)]
    angles = torch.arange(tokens)[:, None] * torch.rand(head_dim, generator=torch.Generator().manual_seed(9))
    rope = Rope(torch.cos(angles).contiguous(), torch.sin(angles).contiguous())
    norm = torch.ones(hidden)
    batch = DecoderBatch(
        torch.arange(tokens), torch.arange(tokens), torch.arange(tokens), torch.zeros(tokens, dtype=torch.int64),
        torch.arange(1, tokens + 1),
    )  # fmt: skip
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(10))
    outputs = []
    stacks = (
        lambda parts: pack_blocks(stack_blocks(parts)),
        lambda parts: packed_weights.WeightStack(tuple(pack_blocks(part) for part in parts)),
    )
    for stack in stacks:
        layer = DecoderLayer(
            input_norm=norm, post_norm=norm, qkv=stack(qkv), o_proj=pack_blocks(q8(hidden, heads * head_dim, 6)),
            gate_up=stack(gate_up), down=pack_blocks(q8(hidden, inter, 7)), rope=rope,
        )  # fmt: skip
        decoder = Decoder([layer], heads, kv_heads, head_dim, 1e-5)
        k_pool, v_pool = torch.zeros(2, 1, tokens, kv_heads, head_dim)
        out = x.clone()
        decoder.run(out, batch, k_pool, v_pool, threads=2)
        outputs.append((out, k_pool, v_pool))
    for whole, parts in zip(*outputs, strict=True):
        assert torch.equal(whole, parts)


def assert_read_as_gguf_reads_it(path: Path) -> None:
    """``read_gguf_file`` gives what ``gguf.GGUFReader`` gives: every tensor's type, dtype, shape and bytes, and
    every metadata value (a string array as its length)."""
    ours, theirs = read_gguf_file(path), GGUFReader(path)
    assert [tensor.name for tensor in ours.tensors] == [tensor.name for tensor in theirs.tensors]
    for mine, reference_tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference_tensor.tensor_type, mine.name
        assert (mine.data.dtype, mine.data.shape) == (reference_tensor.data.dtype, reference_tensor.data.shape)
        assert mine.data.tobytes() == reference_tensor.data.tobytes(), mine.name
    fields = {key: field for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert ours.metadata.keys() == fields.keys()
    for key, field in fields.items():
        strings = field.types[0] == GGUFValueType.ARRAY and field.types[-1] == GGUFValueType.STRING
        assert ours.metadata[key] == (len(field.contents()) if strings else field.contents()), key


def test_a_gguf_files_block_tensors_are_read_as_blocks(tmp_path: Path) -> None:
    """Tensors of each block format in a GGUF file, read as ``gguf.GGUFReader`` reads them (with a float32 norm and
    metadata of each kind beside them), come back under their Hugging Face names as the same blocks."""
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_token_list(["a", "b", "\u00e9t\u00e9"])  # a string array, which the reader steps over
    writer.add_array("test.ints", [3, 1, 2])
    writer.add_float32("test.eps", 1e-5)
    writer.add_bool("test.flag", True)
    stored = {
        "token_embd.weight": ("q8_0", 64),
        "blk.0.attn_output.weight": ("q5_0", 256),
        "blk.0.ffn_gate.weight": ("q5_1", 256),
        "blk.0.ffn_up.weight": ("q4_k", 256),
        "blk.0.ffn_down.weight": ("q6_k", 512),
        "output.weight": ("q5_k", 64),
    }
    raws = {}
    for name, (fmt, rows) in stored.items():
        raws[name] = random_bytes(fmt, rows, 256, seed=rows)
        writer.add_tensor(name, raws[name], raw_dtype=gguf_type(fmt))
    sixteen_bits = {"blk.0.attn_q.weight": torch.float16, "blk.0.attn_k.weight": torch.bfloat16}
    floats = {name: torch.randn(rows, 256, generator=torch.Generator().manual_seed(7)).to(dtype)
              for (name, dtype), rows in zip(sixteen_bits.items(), (64, 32), strict=True)}  # fmt: skip
    writer.add_tensor("blk.0.attn_q.weight", floats["blk.0.attn_q.weight"].numpy())
    bf16_bytes = floats["blk.0.attn_k.weight"].view(torch.uint8).numpy()
    writer.add_tensor("blk.0.attn_k.weight", bf16_bytes, raw_dtype=GGMLQuantizationType.BF16)
    writer.add_tensor("blk.0.attn_norm.weight", np.linspace(0.5, 1.5, 256, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_read_as_gguf_reads_it(path)
    weights = read_gguf_weights(read_gguf_file(path))
    hf_names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",
        "blk.0.ffn_gate.weight": "model.layers.0.mlp.gate_proj.weight",
        "blk.0.ffn_up.weight": "model.layers.0.mlp.up_proj.weight",
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
        "output.weight": "lm_head.weight",
    }
    for name, (fmt, _) in stored.items():
        value = weights[hf_names[name]]
        assert isinstance(value, BlockQuantized) and value.format == fmt
        assert torch.equal(value.dequantize(), reference(raws[name], fmt)), name
    for name, hf_name in (("blk.0.attn_q.weight", "q_proj"), ("blk.0.attn_k.weight", "k_proj")):
        # kept in their dtype, in llama.cpp's rotary order undone (a permutation of whole rows)
        value = weights[f"model.layers.0.self_attn.{hf_name}.weight"]
        assert isinstance(value, torch.Tensor) and value.dtype == sixteen_bits[name]
        assert torch.equal(value.sort(dim=0).values, floats[name].sort(dim=0).values)
        packed = pack_weight([value], torch.float32)
        assert packed.format.name == {torch.float16: "F16", torch.bfloat16: "BF16"}[value.dtype]


@pytest.mark.parametrize("fmt", [*FORMATS, "float32", "bfloat16", "float16"])
def test_packed_rows_are_ggufs_weights(fmt: str) -> None:
    """A tied model's embedding lookup from its head's panels (``ops.packed_rows``) gives, bit for bit, gguf's
    de-quantised rows of every block format (bytes of every bit pattern), the dense formats' float32 values. 300 rows
    are 19 panels, the last padded, in groups of the build's width (8 on AVX-512: the last group of 3); the dense
    rows' 100 columns end in a partial chunk. It refuses an id past the last row."""
    rows = torch.tensor([5, 0, 299, 5, 16, 143, 128])
    if fmt in FORMATS:
        raw = random_bytes(fmt, 300, 512, seed=len(fmt) + 20)
        blocks = read_blocks(raw, gguf_type(fmt))
        assert blocks is not None
        weight, weights = pack_blocks(blocks), reference(raw, fmt)
    else:
        dtype = getattr(torch, fmt)
        weights = torch.randn(300, 100, generator=torch.Generator().manual_seed(3)).to(dtype).float()
        weight = packed_weights.pack_dense(weights.to(dtype), dtype)
    assert torch.equal(ops.packed_rows(weight, rows), weights[rows])
    with pytest.raises(IndexError):
        ops.packed_rows(weight, torch.tensor([300]))
