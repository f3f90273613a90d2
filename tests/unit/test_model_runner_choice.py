"""Choosing the model runner: ``--model-runner``, what ``--speculative-algorithm auto`` becomes on each, and the
layouts the llama.cpp runner refuses with a clear message."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.model.llamacpp_runner import LlamaCppModelRunner
from scheduler.server_args import ModelArgs, ServerArgs, parse_server_args
from scheduler.speculative import resolve_algorithm


def speculation(argv: list[str]) -> str:
    """The draft sources a server started with ``argv`` uses."""
    args = parse_server_args(argv)
    return resolve_algorithm(args.speculation.speculative_algorithm, args.model.model_runner)


def test_auto_speculation_is_on_for_the_exact_runner_and_off_for_llama_cpp() -> None:
    assert parse_server_args([]).model.model_runner == "exact"
    assert speculation(["--model-runner", "exact"]) == "grammar+ngram"
    assert speculation(["--model-runner", "llamacpp"]) == "none"
    chosen = speculation(["--model-runner", "llamacpp", "--speculative-algorithm", "ngram"])
    assert chosen == "ngram", "an explicit choice stands on any runner"


def test_llama_cpp_with_tensor_parallel_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="llamacpp runs the whole model on each rank"):
        ServerArgs.of(model_runner="llamacpp", tp_size=2)


def test_an_unknown_runner_is_refused() -> None:
    with pytest.raises(ValueError, match="--model-runner must be one of"):
        ModelArgs(model_runner="vllm")


def test_llama_cpp_refuses_a_model_folder(tmp_path: Path) -> None:
    """Where llama-cpp-python is missing the refusal says how to install it; where it is present, that a folder is not
    a GGUF file. Either way before anything loads."""
    with pytest.raises(ValueError, match=r"needs llama-cpp-python: pip install|runs a \.gguf file"):
        LlamaCppModelRunner(ModelArgs(model_runner="llamacpp", model_path=str(tmp_path)))
