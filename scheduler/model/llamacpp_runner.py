"""The model runner on llama.cpp (``--model-runner llamacpp``): the GGUF file's own quantised weights and llama.cpp's
CPU kernels, behind the same contract as the exact runner (``scheduler.model.runner_contract``).

An optional extra (``pip install -e '.[llamacpp]'`` builds llama.cpp from source). The scheduler, grammars, masks,
sampling and speculation stay ours; llama.cpp only turns tokens into logits. Each running request is one llama.cpp
sequence id with a KV stream of its own (``--max-seq-len`` cells; llama.cpp allocates them all at start, for
``--max-running-requests`` sequences); our ``KVCacheManager`` keeps the token accounting (admission by the
``--max-total-tokens`` budget, rollback) and tells llama.cpp what to drop.
There is no prefix reuse: llama.cpp's cells cannot be shared by our prefix tree.

Greedy decoding one request at a time gives llama-cpp-python's own tokens, and with a KV stream per sequence a
decode step's logits did not change with the other sequences in its forward (measured: up to 16 sequences, prompts
of 7 to 600 tokens). But a multi-token forward is not one-token steps: logits after a 4-token extend differed from
stepwise ones by up to 0.75 at some prompt lengths. So speculation and jump-forward would change greedy outputs here
(``--speculative-algorithm auto`` leaves them off on this runner, where they are slower anyway); the exact runner
keeps them exact.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cpu_kernels.cpu_info import cpu_flags
from scheduler.model.kv_cache import KVCacheManager, KVSequence
from scheduler.model.kv_pool import TokenKVPool
from scheduler.model.runner_contract import BaseModelRunner
from scheduler.server_args import ModelArgs, available_cores
from sglang_constrained.tokenizer.loading import embedded_model_path, load_tokenizer

logger = logging.getLogger(__name__)

BATCH_TOKENS = 512
"""Tokens per ``llama_decode`` call (a longer forward is split): llama.cpp's default batch."""
_GGML_LOG_LEVEL_ERROR = 4
FLASH_ATTENTION_DISABLED = 0


def is_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _log_llama_cpp(level: int, text: bytes | None, _: Any) -> None:
    """llama.cpp's own log: errors to ours, the rest (hundreds of lines per model load) dropped."""
    if level == _GGML_LOG_LEVEL_ERROR and text:
        logger.error("llama.cpp: %s", text.decode(errors="replace").rstrip())


class LlamaCppKV(KVCacheManager):
    """Our token accounting plus a llama.cpp sequence id per admitted sequence: a rollback or a release drops the
    sequence's cells in llama.cpp too. Admission also waits for a free sequence id."""

    def __init__(self, llama_cpp: Any, memory: Any, capacity: int, num_seq_ids: int) -> None:
        # Rows are only counted here (llama.cpp holds the K/V), so the pool's tensors are one float per row.
        super().__init__(TokenKVPool(1, capacity, 1, 1, torch.float32, "cpu"), use_radix_cache=False)
        self._llama_cpp = llama_cpp
        self._memory = memory
        self._free_seq_ids = list(range(num_seq_ids - 1, -1, -1))
        self.seq_ids: dict[KVSequence, int] = {}

    def admit(self, prompt_ids: list[int], max_new_tokens: int) -> KVSequence | None:
        if not self._free_seq_ids:
            return None
        seq = super().admit(prompt_ids, max_new_tokens)
        if seq is not None:
            self.seq_ids[seq] = self._free_seq_ids.pop()
        return seq

    def truncate(self, seq: KVSequence, length: int) -> None:
        super().truncate(seq, length)
        self._llama_cpp.llama_memory_seq_rm(self._memory, self.seq_ids[seq], length, -1)

    def release(self, seq: KVSequence) -> None:
        super().release(seq)
        seq_id = self.seq_ids.pop(seq)
        self._llama_cpp.llama_memory_seq_rm(self._memory, seq_id, -1, -1)
        self._free_seq_ids.append(seq_id)


def _model_params(llama_cpp: Any) -> Any:
    """llama.cpp's defaults, but on a CPU with AMX without the extra weight buffers (AMX tiles, repacked Q4
    blocks, what llama.cpp's ``--no-repack`` turns off): with them the first forward crashed (SIGSEGV) on an Intel
    Xeon with AMX-INT8 in llama.cpp 0.3.36 builds; without them the same build ran."""
    params = llama_cpp.llama_model_default_params()
    amx = sorted(flag for flag in cpu_flags() if flag.startswith("amx"))
    if amx:
        params.use_extra_bufts = False
        logger.info("llama.cpp: extra weight buffers (AMX, repacking) off on this CPU (%s)", " ".join(amx))
    return params


class LlamaCppModelRunner(BaseModelRunner):
    """The embedded GGUF (or ``--model-path`` to another ``.gguf``) in llama.cpp on this machine's cores."""

    kv: LlamaCppKV

    def __init__(self, model_args: ModelArgs) -> None:
        if not is_available():
            raise ValueError("--model-runner llamacpp needs llama-cpp-python: pip install -e '.[llamacpp]'")
        import llama_cpp

        source = embedded_model_path() if model_args.model_path is None else Path(model_args.model_path)
        if source.suffix != ".gguf" or not source.is_file():
            raise ValueError(f"--model-runner llamacpp runs a .gguf file; --model-path {source} is not one")
        self._llama_cpp = llama_cpp
        self._log_callback = llama_cpp.llama_log_callback(_log_llama_cpp)  # kept: llama.cpp holds a raw pointer
        llama_cpp.llama_log_set(self._log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self._model = llama_cpp.llama_model_load_from_file(str(source).encode(), _model_params(llama_cpp))
        if not self._model:
            raise ValueError(f"llama.cpp could not load {source}")
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        trained_positions = llama_cpp.llama_model_n_ctx_train(self._model)
        if model_args.max_seq_len > trained_positions:
            raise ValueError(
                f"--max-seq-len {model_args.max_seq_len} exceeds the {trained_positions} positions {source.name} "
                "was trained for"
            )
        threads = available_cores()
        params = llama_cpp.llama_context_default_params()
        # A KV stream of --max-seq-len cells per sequence: in a unified cache every token's attention spans the
        # cells of every sequence (one decode step several times slower beside thousands of other cells).
        params.n_ctx = model_args.max_running_requests * model_args.max_seq_len
        params.n_batch = params.n_ubatch = BATCH_TOKENS
        params.n_seq_max = model_args.max_running_requests
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = False
        # Off: this build's flash-attention path changes greedy tokens from the first one on (measured against the
        # exact runner and llama-cpp-python's own generation, which agree), and is no faster here.
        params.flash_attn_type = FLASH_ATTENTION_DISABLED
        params.no_perf = True
        self._context = llama_cpp.llama_init_from_model(self._model, params)
        if not self._context:
            raise ValueError(
                f"llama.cpp could not create a KV cache of {model_args.max_seq_len} tokens for each of "
                f"{model_args.max_running_requests} sequences: lower --max-seq-len or --max-running-requests"
            )
        self._batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, 1)
        self.tokenizer = load_tokenizer(source, model_args.cache_path, model_args.chat_template)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(vocab)
        self.eos_token_ids = [t for t in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        self.max_seq_len = model_args.max_seq_len
        self.device = torch.device("cpu")
        memory = llama_cpp.llama_get_memory(self._context)
        self.kv = LlamaCppKV(llama_cpp, memory, model_args.max_total_tokens, model_args.max_running_requests)
        logger.info(
            "model runner on llama.cpp (%s, %d threads): KV cache of %d tokens, one stream per sequence for %d "
            "sequences, no prefix reuse; end-of-generation tokens %s",
            source.name,
            threads,
            llama_cpp.llama_n_ctx(self._context),
            model_args.max_running_requests,
            self.eos_token_ids,
        )

    def _run(
        self,
        seqs: Sequence[KVSequence],
        starts: Sequence[int],
        token_lists: Sequence[Sequence[int]],
        num_logits: Sequence[int],
        vocab_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """llama.cpp computes every logit (``vocab_mask`` is not read)."""
        entries = [
            (token, start + j, self.kv.seq_ids[seq], j >= len(tokens) - count)
            for seq, start, tokens, count in zip(seqs, starts, token_lists, num_logits, strict=True)
            for j, token in enumerate(tokens)
        ]
        logits = torch.empty(sum(num_logits), self.vocab_size)
        filled = 0
        for first in range(0, len(entries), BATCH_TOKENS):
            filled += self._decode(entries[first : first + BATCH_TOKENS], logits[filled:])
        return logits

    def _decode(self, entries: list[tuple[int, int, int, bool]], out: torch.Tensor) -> int:
        """One ``llama_decode`` of ``(token, position, sequence id, wants logits)`` entries; their logits go to the
        first rows of ``out``, whose count it returns."""
        batch = self._batch
        batch.n_tokens = len(entries)
        for i, (token, position, seq_id, wants_logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = position
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = wants_logits
        status = self._llama_cpp.llama_decode(self._context, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} on a batch of {len(entries)} tokens")
        num_outputs = sum(wants_logits for *_, wants_logits in entries)
        if num_outputs:
            # llama.cpp's output rows, in batch order, viewed without a copy; they are overwritten by the next decode.
            rows = ctypes.c_float * (num_outputs * self.vocab_size)
            produced = rows.from_address(ctypes.addressof(self._llama_cpp.llama_get_logits(self._context).contents))
            out[:num_outputs].copy_(torch.frombuffer(produced, dtype=torch.float32).view(num_outputs, self.vocab_size))
        return num_outputs
