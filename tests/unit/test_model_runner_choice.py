"""Choosing the model runner: ``--model-runner``, what ``--speculative-algorithm auto`` becomes on each, and the
layouts the llama.cpp runner refuses with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.model.llamacpp_runner import LlamaCppModelRunner
from scheduler.server_args import ServerArgs


def test_auto_speculation_is_on_for_the_exact_runner_and_off_for_llama_cpp() -> None:
    assert ServerArgs.parse([]).model_runner == "exact"
    assert ServerArgs.parse(["--model-runner", "exact"]).speculation == "grammar+ngram"
    assert ServerArgs.parse(["--model-runner", "llamacpp"]).speculation == "none"
    chosen = ServerArgs.parse(["--model-runner", "llamacpp", "--speculative-algorithm", "ngram"])
    assert chosen.speculation == "ngram", "an explicit choice stands on any runner"


def test_llama_cpp_with_tensor_parallel_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="llamacpp runs the whole model on each rank"):
        ServerArgs(model_runner="llamacpp", tp_size=2)


def test_an_unknown_runner_is_refused() -> None:
    with pytest.raises(ValueError, match="--model-runner must be one of"):
        ServerArgs(model_runner="vllm")


def test_llama_cpp_refuses_a_model_folder(tmp_path: Path) -> None:
    """Where llama-cpp-python is missing the refusal says how to install it; where it is present, that a folder is not
    a GGUF file. Either way before anything loads."""
    with pytest.raises(ValueError, match=r"needs llama-cpp-python: pip install|runs a \.gguf file"):
        LlamaCppModelRunner(ServerArgs(model_runner="llamacpp", model_path=str(tmp_path)))
