"""Load a Llama-style causal LM's weights, config and tokenizer for serving.

Sources: ``ModelArgs.model_path`` is ``None`` (the embedded SmolLM2-135M-Instruct GGUF), another ``.gguf``
file, or a local Hugging Face model folder. A GGUF file is converted once (tens of seconds on 2 cores) into a Hugging
Face folder (``config.json``, ``generation_config.json``, ``model.safetensors``) under ``ModelArgs.cache_path``,
so later starts read it in about a second: with ``--weight-dtype auto`` its quantised blocks as they are
(``scheduler.model.gguf_blocks``), otherwise de-quantised to float32 by ``gguf.quants``, as transformers does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from scheduler.model import architecture
from scheduler.model.architecture import SUPPORTED_MODEL_TYPES
from scheduler.model.gguf_blocks import BlockQuantized, from_parts, read_gguf_weights, split_part_name
from scheduler.model.gguf_config import read_gguf_config
from scheduler.model.gguf_file import read_gguf_file
from scheduler.model.tensor_parallel import ShardPlan
from scheduler.server_args import ModelArgs
from sglang_constrained.tokenizer.loading import (
    conversion_cache_dir,
    conversion_lock,
    embedded_model_path,
    load_tokenizer,
)

logger = logging.getLogger(__name__)

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "gemma3")
"""llama.cpp's names of the families (``scheduler.model.architecture``); Mistral's files say "llama"."""
# What the attention kernel runs (cpu_kernels.ops.attention).
ATTENTION_HEAD_DIMS = (16, 32, 64, 96, 128, 256)
MAX_QUERY_HEADS_PER_KV_HEAD = 8
BLOCKS_KIND = "blocks2"
"""The cache folders of GGUF files' blocks (``conversion_cache_dir``'s kind): since the k-quants, whose tensors the
earlier "blocks" folders hold de-quantised."""
RESOLVED_CONFIG_FILE = "resolved_config.json"
"""In a converted folder: its config with every attribute ``AutoConfig`` gives it (the model type's defaults
included), read back as a plain ``PretrainedConfig``. ``AutoConfig`` imports the model type's config module, and
with it ``torch.distributed.tensor`` and sympy: 0.9 s of CPU at every start of every rank."""
# RoPE variants whose frequencies do not depend on the current sequence length.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional", "longrope")
"""``longrope`` (Phi-3.5, Phi-4-mini) within its ``original_max_position_embeddings`` only: past them transformers
switches the whole sequence to its long factors, which would make a token's logits depend on the sequence's length."""


@dataclass(frozen=True)
class LoadedModel:
    """What the model runner needs: ``weights`` are float CPU tensors (float32, or float16 and bfloat16 as stored) or
    GGUF blocks keyed by Hugging Face names,
    each this rank's slice of the checkpoint's tensor (``shard``)."""

    config: PretrainedConfig
    shard: ShardPlan
    weights: dict[str, torch.Tensor | BlockQuantized]
    tokenizer: Any
    eos_token_ids: list[int]
    source: Path


def load_model(model_args: ModelArgs, tp_rank: int = 0, tp_size: int = 1) -> LoadedModel:
    """Load the model named by ``model_args.model_path`` (tensor-parallel rank ``tp_rank`` of ``tp_size``: only its
    shard of the weights is read); may write the de-quantised cache (see module doc)."""
    source = embedded_model_path() if model_args.model_path is None else Path(model_args.model_path)
    started = time.perf_counter()
    if source.is_dir():
        folder, how = source, "read the model folder"
    elif source.is_file() and source.suffix == ".gguf":
        keep_blocks = model_args.weight_dtype == "auto"
        folder, how = _converted_folder(source, model_args.cache_path, keep_blocks)
    else:
        raise ValueError(f"--model-path {source} is neither a .gguf file nor a Hugging Face model folder")
    config = load_config(folder)
    check_supported(config, model_args.max_seq_len)
    shard = ShardPlan.build(config, tp_rank, tp_size)
    weights = read_weights(folder, shard)
    tokenizer = load_tokenizer(source, model_args.cache_path, model_args.chat_template)
    eos_token_ids = _eos_token_ids(config, _generation_config(folder), tokenizer)
    logger.info(
        "loaded %s (%s, %d layers) in %.1f s: %s",
        source.name,
        config.model_type,
        config.num_hidden_layers,
        time.perf_counter() - started,
        how,
    )
    return LoadedModel(config, shard, weights, tokenizer, eos_token_ids, source)


def load_config(folder: Path) -> PretrainedConfig:
    """The model config of ``folder`` as ``AutoConfig`` gives it: from ``RESOLVED_CONFIG_FILE`` where a conversion
    wrote one, else by ``AutoConfig``."""
    resolved = folder / RESOLVED_CONFIG_FILE
    if resolved.is_file():
        return PretrainedConfig.from_dict(json.loads(resolved.read_text(encoding="utf-8")))
    return AutoConfig.from_pretrained(folder)


def write_resolved_config(folder: Path) -> None:
    """Write ``folder``'s config as ``AutoConfig`` resolves it into ``RESOLVED_CONFIG_FILE`` (atomically: ranks may
    write it at once, the same text)."""
    resolved = AutoConfig.from_pretrained(folder).to_json_string(use_diff=False)
    staging = folder / f"{RESOLVED_CONFIG_FILE}.tmp-{os.getpid()}"
    staging.write_text(resolved, encoding="utf-8")
    staging.rename(folder / RESOLVED_CONFIG_FILE)


def check_supported(config: PretrainedConfig, max_seq_len: int) -> None:
    """Raise ValueError naming what the model runner's forward cannot run faithfully."""
    model_type = config.model_type
    arch = architecture.of(config)
    for parameters in arch.rope_parameters.values():
        rope_type = parameters.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE type {rope_type!r} in {model_type}; one of {SUPPORTED_ROPE_TYPES}")
        original = parameters.get("original_max_position_embeddings", max_seq_len)
        if rope_type == "longrope" and max_seq_len > original:
            raise ValueError(
                f"{model_type}'s longrope RoPE changes its frequencies past {original} tokens (for the whole "
                f"sequence); set --max-seq-len {original} or lower"
            )
    if getattr(config, "attention_bias", False) and model_type == "qwen3":
        raise ValueError(f"unsupported attention_bias in {model_type}: the decoder blocks have no o_proj bias")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim not in ATTENTION_HEAD_DIMS or heads % kv_heads or heads // kv_heads > MAX_QUERY_HEADS_PER_KV_HEAD:
        raise ValueError(
            f"{model_type} has {heads} query heads of {head_dim} over {kv_heads} KV heads; the attention kernel "
            f"runs head_dim {ATTENTION_HEAD_DIMS} with 1 to {MAX_QUERY_HEADS_PER_KV_HEAD} query heads per KV head"
        )
    max_positions = getattr(config, "max_position_embeddings", max_seq_len)
    if max_seq_len > max_positions:
        raise ValueError(
            f"--max-seq-len {max_seq_len} exceeds the {max_positions} positions {model_type} was trained for"
        )


def _converted_folder(gguf_file: Path, cache_dir: Path, keep_blocks: bool) -> tuple[Path, str]:
    """The cached folder for ``gguf_file`` (its blocks, or de-quantised), converting it first if no process has yet.

    A lock file makes concurrent processes (ranks under torchrun) wait for one conversion instead of
    repeating it; the folder appears by an atomic rename, so a killed process never leaves a partial cache.
    """
    target = conversion_cache_dir(gguf_file, cache_dir, BLOCKS_KIND if keep_blocks else "weights")
    if _is_complete(target):
        if not (target / RESOLVED_CONFIG_FILE).is_file():  # converted by an earlier version
            with contextlib.suppress(OSError):  # a read-only cache: load_config falls back on AutoConfig
                write_resolved_config(target)
        return target, f"read the cached converted weights in {target}"
    with conversion_lock(target):
        if _is_complete(target):
            return target, f"another process converted into {target}"
        for leftover in target.parent.glob(f"{target.name}.tmp-*"):  # from killed processes; we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        started = time.perf_counter()
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
        try:
            _write_converted(gguf_file, staging, keep_blocks)
            write_resolved_config(staging)
            staging.chmod(0o755)  # mkdtemp makes it private; the cache is as readable as the folder it sits in
            (staging / "model.safetensors").chmod(0o644)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        what = "kept the blocks of" if keep_blocks else "de-quantised"
        return target, f"{what} {gguf_file} in {time.perf_counter() - started:.1f} s, cached in {target}"


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def _check_gguf_architecture(name: Any, gguf_file: Path) -> None:
    """Refuse an architecture the runner cannot serve, before the tensors' conversion (tens of seconds)."""
    if name not in SUPPORTED_GGUF_ARCHITECTURES + SUPPORTED_MODEL_TYPES:  # a file's name, or transformers' for it
        raise ValueError(
            f"unsupported architecture {name!r} in {gguf_file.name}; "
            f"the model runner serves these causal LM families: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )


def _write_converted(gguf_file: Path, staging: Path, keep_blocks: bool) -> None:
    """``gguf_file``'s tensors under Hugging Face names, blocks kept as blocks (or de-quantised to float32), and its
    config, at ``staging``.

    De-quantised, each tensor goes through ``gguf.quants.dequantize``, as in transformers' GGUF loader, to the same
    bits (the embedded file's 272 tensors compared), with the file's config read once instead of twice and no name
    table built per tensor: a first float32 start of the embedded model took 39 s through transformers, 28 s so
    (docs/benchmarks.md)."""
    contents = read_gguf_file(gguf_file)
    _check_gguf_architecture(contents.metadata.get("general.architecture"), gguf_file)
    what = "reading the blocks of" if keep_blocks else "de-quantising"
    logger.info("first start: %s %s (cached afterwards)", what, gguf_file.name)
    config = read_gguf_config(gguf_file, contents)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in read_gguf_weights(contents, keep_blocks).items():
        tensors |= value.tensors(name) if isinstance(value, BlockQuantized) else {name: value.contiguous()}
    save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(staging)
    GenerationConfig.from_model_config(config).save_pretrained(staging)


def read_weights(folder: Path, shard: ShardPlan) -> dict[str, torch.Tensor | BlockQuantized]:
    """The tensors of a Hugging Face folder (``*.safetensors``, else ``pytorch_model*.bin``), each sliced to
    ``shard``, as contiguous copies that own their memory (no view keeps the mapped file open): float32, or GGUF
    blocks where the folder holds them (``BlockQuantized.tensors``).

    From safetensors only the slice of a float tensor is read; ``.bin`` files are memory-mapped, then sliced.
    """
    weights: dict[str, torch.Tensor | BlockQuantized] = {}
    block_parts: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                part = split_part_name(name)
                if part is not None:
                    block_parts.setdefault(part[:2], {})[part[2]] = f.get_tensor(name)
                    continue
                where = shard.weight_slice(name)
                if where is None:
                    weights[name] = _owned(f.get_tensor(name))
                else:
                    dim, (start, stop) = where
                    sliced = f.get_slice(name)
                    weights[name] = _owned(sliced[start:stop] if dim == 0 else sliced[:, start:stop])
    for (name, fmt), parts in block_parts.items():
        weights[name] = _owned_blocks(from_parts(fmt, parts), shard.weight_slice(name), name)
    if files:
        return weights
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"{folder} holds no *.safetensors or pytorch_model*.bin weights")
    for file in files:
        for name, tensor in torch.load(file, map_location="cpu", weights_only=True, mmap=True).items():
            where = shard.weight_slice(name)
            if where is not None:
                dim, (start, stop) = where
                tensor = tensor.narrow(dim, start, stop - start)
            weights[name] = _owned(tensor)
    return weights


def _owned_blocks(blocks: BlockQuantized, where: tuple[int, tuple[int, int]] | None, name: str) -> BlockQuantized:
    if where is not None:
        dim, (start, stop) = where
        try:
            blocks = blocks.narrow(dim, start, stop)
        except ValueError as e:
            raise ValueError(
                f"this rank's slice of {name} {e}: run these tensor-parallel ranks with --weight-dtype float32"
            ) from e
    return blocks.with_parts({name: part.contiguous().clone() for name, part in blocks.parts.items()})


def _owned(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy: float32, or float16 and bfloat16 as they are (their matmul weights are packed in their own
    dtype, which the kernels convert to float32 exactly: ``cpu_kernels.packed_weights.pack_dense``)."""
    dtype = tensor.dtype if tensor.dtype in (torch.float16, torch.bfloat16) else torch.float32
    return tensor.to(dtype, memory_format=torch.contiguous_format, copy=True)


def _generation_config(folder: Path) -> GenerationConfig | None:
    try:
        return GenerationConfig.from_pretrained(folder)
    except OSError:  # the folder has no generation_config.json
        return None


def _eos_token_ids(config: PretrainedConfig, generation: GenerationConfig | None, tokenizer: Any) -> list[int]:
    """Every id that ends generation: the generation config's EOS, else the model config's, plus the tokenizer's."""
    declared = generation.eos_token_id if generation is not None else None
    if declared is None:
        declared = config.eos_token_id
    ids = [declared] if isinstance(declared, int) else list(declared or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return sorted(set(ids))
