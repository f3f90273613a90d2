"""llama.cpp as a peer for ``bench_serving.py --peer llamacpp``: the same GGUF file, prompts and sampling.

llama-cpp-python (the ``llamacpp`` extra; it builds llama.cpp from source) serves one request at a time, so a
concurrency level's requests run one after another and its aggregate throughput is the sequential one. JSON
requests use llama.cpp's own grammar from the same JSON schema; regex has no llama.cpp equivalent and is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from sglang_constrained.tokenizer.loading import embedded_model_path

PEER_KINDS = ("free", "json")


def is_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppPeer:
    """A GGUF file (the embedded SmolLM2's by default) in llama.cpp, on the same number of threads as torch uses here,
    sampling at ``temperature`` as our side does."""

    def __init__(
        self, threads: int, schema: dict[str, Any], model_path: Path | None = None, temperature: float = 0.7
    ) -> None:
        import llama_cpp

        path = model_path or embedded_model_path()
        self._llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)
        self._temperature = temperature
        self._grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(schema), verbose=False)

    def run_kind(self, kind: str, prompts: list[str], seeds: list[int], max_new_tokens: int) -> list[dict[str, Any]]:
        """One request per prompt, in turn; each as ``{text, num_tokens, finish, ttft_s, tpot_s}``."""
        return [self._run_one(kind, prompt, seed, max_new_tokens) for prompt, seed in zip(prompts, seeds, strict=True)]

    def _run_one(self, kind: str, prompt: str, seed: int, max_new_tokens: int) -> dict[str, Any]:
        self._llm.set_seed(seed)
        start = time.perf_counter()
        first = last = None
        text, num_tokens, finish = "", 0, "none"
        # With stream=True the call returns chunks; its declared type also covers the whole-completion answer.
        stream = self._llm.create_chat_completion(
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_new_tokens,
            temperature=self._temperature,
            stream=True,
            grammar=self._grammar if kind == "json" else None,
        )
        for chunk in cast(Iterator[dict[str, Any]], stream):
            choice = chunk["choices"][0]
            piece = choice["delta"].get("content") or ""
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                num_tokens += 1
                text += piece
            finish = choice.get("finish_reason") or finish
        ttft = (first or time.perf_counter()) - start
        tpot = (last - first) / (num_tokens - 1) if first and last and num_tokens > 1 else None
        return {"text": text, "num_tokens": num_tokens, "finish": finish, "ttft_s": ttft, "tpot_s": tpot}
