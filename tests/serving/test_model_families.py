"""Every model family the runner serves beside Llama, on the exact kernels, against transformers: tiny random-weight
models built from each family's transformers config (no download), from a Hugging Face folder and from a GGUF file
written as llama.cpp lays that family out. Logits within float32 rounding of transformers', greedy tokens equal.

What each family adds is engaged: Phi-3's fused projections, partial RoPE and sliding window, and Phi-4-mini's longrope
(its factors, from a GGUF file's tensors as llama.cpp's converter stores them); SmolLM3's layers without
RoPE; Gemma 3's sliding-window layers with their own RoPE base, GELU-tanh, (1 + w) norms, norms of each block's output,
scaled embedding, and (from a folder) soft-capped logits and its own attention scale. Prompts run past the windows.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    SmolLM3Config,
)

from cpu_kernels import library
from scheduler.model.gguf_config import read_gguf_config, restore_phi3_fields
from scheduler.model.gguf_file import read_gguf_file
from scheduler.model.runner import ModelRunner
from scheduler.server_args import ServerArgs
from sglang_constrained.tokenizer.loading import load_tokenizer
from tests.tiny_models import TOKENIZER_TEXT, random_norms, tiny_tokenizer, write_gguf

VOCAB = 300
TINY: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.5,
    pad_token_id=None,
    bos_token_id=0,
    eos_token_id=0,
)
FAMILIES = {
    "phi3 (fused projections, half the head rotated, window 10)": lambda: Phi3Config(
        **TINY, sliding_window=10, partial_rotary_factor=0.5
    ),
    "smollm3 (layer 4 without RoPE)": lambda: SmolLM3Config(
        **TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e4}
    ),
    # six layers: Gemma 3's pattern of five sliding-window layers and a full one, as llama.cpp fixes it for its files
    "gemma3 (window 8 on five layers of six)": lambda: Gemma3TextConfig(
        **(TINY | {"num_hidden_layers": 6}), head_dim=16, sliding_window=8
    ),
    # Phi-4-mini's RoPE: its short factors within the original context (max_seq_len 128)
    "phi3 longrope": lambda: Phi3Config(
        **TINY,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=128,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 128,
            "short_factor": [1.0 + 0.25 * i for i in range(6)],
            "long_factor": [4.0 + i for i in range(6)],
        },
    ),
}
FOLDER_ONLY = {  # what a GGUF file does not say (llama.cpp's Gemma 3 has neither), or a family served before
    "gemma3 soft-capped logits, query scale 24": lambda: Gemma3TextConfig(
        **TINY,
        head_dim=16,
        sliding_window=8,
        sliding_window_pattern=2,
        final_logit_softcapping=2.5,
        query_pre_attn_scalar=24,
    ),
    "mistral, window 12": lambda: MistralConfig(**TINY, sliding_window=12),
}
PROMPT_LENGTHS = (70, 30)
GREEDY_STEPS = 8
TOLERANCE = 1e-4
"""Largest logit difference from transformers, relative to the largest logit (float32 summation orders differ;
measured up to 2e-5)."""


@pytest.fixture(scope="module", autouse=True)
def kernels(server_args: ServerArgs) -> None:
    library.load(server_args.model.kernel_build_path)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer(VOCAB)


def reference_model(make_config: Any) -> Any:
    """transformers' model of the config, random weights (norms too), float32."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config()).eval()
    random_norms(model, torch.Generator().manual_seed(1))
    return model


def check_against(reference: Any, runner: ModelRunner) -> None:
    """Two prompts prefilled together, then decoded together: each row within TOLERANCE of transformers' logits of
    the same tokens; then greedy decoding of the first prompt gives transformers' greedy tokens."""
    tokens = torch.randint(1, VOCAB, (max(PROMPT_LENGTHS) + 1,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = [tokens[:n] for n in PROMPT_LENGTHS]
    seqs = [runner.kv.admit(prompt, 64) for prompt in prompts]
    assert all(seq is not None for seq in seqs)
    ours = [runner.prefill(seqs, prompts), runner.decode(seqs, [tokens[n] for n in PROMPT_LENGTHS])]
    for seq in seqs:
        runner.kv.release(seq)
    with torch.inference_mode():
        full = [reference(torch.tensor([tokens[: n + 1]])).logits[0] for n in PROMPT_LENGTHS]
    expected = [torch.stack([f[n - 1] for f, n in zip(full, PROMPT_LENGTHS, strict=True)]),
                torch.stack([f[n] for f, n in zip(full, PROMPT_LENGTHS, strict=True)])]  # fmt: skip
    for got, want in zip(ours, expected, strict=True):
        assert (got - want).abs().max() <= TOLERANCE * want.abs().max()
    assert greedy(runner, prompts[0]) == reference_greedy(reference, prompts[0])


def greedy(runner: ModelRunner, prompt: list[int]) -> list[int]:
    seq = runner.kv.admit(prompt, GREEDY_STEPS)
    assert seq is not None
    out = [int(runner.prefill([seq], [prompt])[0].argmax())]
    for _ in range(GREEDY_STEPS - 1):
        out.append(int(runner.decode([seq], [out[-1]])[0].argmax()))
    runner.kv.release(seq)
    return out


def reference_greedy(reference: Any, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(GREEDY_STEPS):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def tiny_runner(server_args: ServerArgs, model_path: Path, cache: Path, weight_dtype: str) -> ModelRunner:
    return ModelRunner(
        replace(
            server_args.model,
            model_path=str(model_path),
            cache_dir=str(cache),
            max_seq_len=128,
            max_total_tokens=512,
            weight_dtype=weight_dtype,
        )
    )


@pytest.mark.parametrize("make_config", [*FAMILIES.values(), *FOLDER_ONLY.values()], ids=[*FAMILIES, *FOLDER_ONLY])
def test_a_model_folder_computes_what_transformers_computes(
    make_config: Any, tokenizer: Any, tmp_path: Path, server_args: ServerArgs
) -> None:
    reference = reference_model(make_config)
    reference.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    check_against(reference, tiny_runner(server_args, tmp_path / "model", tmp_path / "cache", "float32"))


@pytest.mark.parametrize("weight_dtype", ["auto", "float32"])
@pytest.mark.parametrize("make_config", FAMILIES.values(), ids=FAMILIES.keys())
def test_a_gguf_file_computes_what_transformers_computes(
    make_config: Any, weight_dtype: str, tokenizer: Any, tmp_path: Path, server_args: ServerArgs
) -> None:
    """Both conversions: the tensors kept as the file stores them (``auto``), and de-quantised to a float32 folder
    (by our reader, each tensor through ``gguf.quants``)."""
    reference = reference_model(make_config)
    write_gguf(reference, tokenizer, tmp_path / "tiny.gguf")
    runner = tiny_runner(server_args, tmp_path / "tiny.gguf", tmp_path / "cache", weight_dtype)
    assert runner.tokenizer.encode("fib(n)") == tokenizer.encode("fib(n)")
    check_against(reference, runner)


@pytest.mark.parametrize("make_config", [*FAMILIES.values(), lambda: LlamaConfig(**TINY)], ids=[*FAMILIES, "llama"])
def test_a_gguf_files_tokenizer_is_the_one_autotokenizer_converts(
    make_config: Any, tokenizer: Any, tmp_path: Path
) -> None:
    """Converted without the model config ``AutoTokenizer`` reads from the file first (only to choose the class; a
    parse of every vocabulary string): the same class (Gemma's own), the same tokenizer, as ``AutoTokenizer`` gives,
    or the generic one where transformers reads no config of the family (SmolLM3)."""
    write_gguf(
        reference_model(make_config), tokenizer, tmp_path / "tiny.gguf", chat_template="{{ messages[0].content }}"
    )
    ours = load_tokenizer(tmp_path / "tiny.gguf", tmp_path / "cache")
    try:
        theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    except ValueError:
        theirs = PreTrainedTokenizerFast.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    assert type(ours) is type(theirs)
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert ours.special_tokens_map == theirs.special_tokens_map and ours.chat_template == theirs.chat_template
    assert ours.encode(TOKENIZER_TEXT) == theirs.encode(TOKENIZER_TEXT)


TRANSFORMERS_READS = {name: make for name, make in FAMILIES.items() if not name.startswith("smollm3")}
"""The families whose GGUF config transformers reads (SmolLM3's is read from its keys by ``gguf_config``)."""


@pytest.mark.parametrize(
    "make_config", [*TRANSFORMERS_READS.values(), lambda: LlamaConfig(**TINY)], ids=[*TRANSFORMERS_READS, "llama"]
)
def test_a_gguf_files_config_is_the_one_transformers_reads(make_config: Any, tokenizer: Any, tmp_path: Path) -> None:
    """Mapped by transformers' own tables from ``read_gguf_file``'s values, without ``gguf.GGUFReader``'s parse of
    the vocabulary: the config ``AutoConfig`` reads from the file (with Phi-3's fields put back), but for the folder
    it names."""
    write_gguf(reference_model(make_config), tokenizer, tmp_path / "tiny.gguf")
    contents = read_gguf_file(tmp_path / "tiny.gguf")
    theirs = AutoConfig.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    if theirs.model_type == "phi3":
        restore_phi3_fields(theirs, contents)
    ignored = ("quantization_config", "_name_or_path")
    expected = {key: value for key, value in theirs.to_dict().items() if key not in ignored}
    ours = read_gguf_config(tmp_path / "tiny.gguf", contents)
    assert type(ours) is type(theirs)
    assert {key: value for key, value in ours.to_dict().items() if key not in ignored} == expected
