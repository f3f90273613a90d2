"""What a weight format and a KV cache type do to the model's answers: each ``--weight-dtype`` (with its default
``--kv-cache-dtype``), and each KV cache type beside ``auto``'s and float32's weights, against float32 weights with a
float32 KV cache (transformers' own de-quantised weights), on the embedded model or the GGUF file ``--model-path``
(e.g. one of ``scripts/quantize_model.py``'s).

    python scripts/model_quality.py [--model-path FILE] [--steps 48] [--llamacpp] [--output PATH]

Prints, per format: perplexity on a fixed English text; the mean KL divergence of its next-token distribution from
float32's over that text's positions, and the largest logit difference; and, for the demo's prompts as chats, in how
many greedy steps it picks float32's token (the first step where they part, if any). ``--llamacpp`` (the
``llamacpp`` extra) adds llama.cpp on the same GGUF file, whose matmuls quantise activations to 8 bits as ``auto``
does: the yardstick for what that costs. Writes JSON (default: results/model_quality.json).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from cpu_kernels.cpu_info import describe_cpu
from scheduler.model import llamacpp_runner
from scheduler.model.runner import ModelRunner, kv_cache_dtype
from scheduler.model.runner_contract import BaseModelRunner
from scheduler.prompt_encoder import PromptEncoder
from scheduler.server_args import KV_CACHE_DTYPES, WEIGHT_DTYPES, ModelArgs
from scheduler.testing.runner_greedy import greedy_tokens

BASELINE = "float32"
KV_VARIANTS = tuple(
    (f"{weights}, KV {kv}", weights, kv)
    for weights, default in (("auto", kv_cache_dtype("auto", True)), ("float32", torch.float32))
    for kv in KV_CACHE_DTYPES
    if kv != "auto" and kv_cache_dtype(kv, True) != default
)
"""(label, --weight-dtype, --kv-cache-dtype): each KV type other than the default on the quantised weights, and
alone on float32's."""
DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "model_quality.json"
TEXT = (
    "The river rose slowly through the spring, and by the first week of May the lower fields were under water. "
    "Farmers moved their animals to the hills, and the school in the valley closed for a month. When the water went "
    "down, it left a layer of fine grey silt over everything: roads, gardens, the floors of houses. Some people "
    "said the flood was the worst in forty years; others remembered a worse one, when the bridge had been carried "
    "away. In the autumn the harvest was better than anyone expected, because the silt had made the soil rich. "
    "The council voted to build a higher wall along the river, and to plant trees on the banks to hold the earth."
)
PROMPTS = (
    "Invent a person as JSON.",
    "What is your phone number?",
    "Describe a cat in JSON: name, color and age only.",
    "Tell me a fun fact about octopuses.",
    "Write a JSON object for a book with a title, an author and a year.",
    "List three pets.",
)
"""The demo's questions, and two more."""


def text_logits(runner: BaseModelRunner, tokens: list[int]) -> torch.Tensor:
    """Next-token logits after each token of ``tokens`` but the last, from one prefill."""
    seq = runner.kv.admit(tokens, 1)
    assert seq is not None
    first = runner.prefill([seq], [tokens[:1]])
    rest = runner.extend(seq, tokens[1:-1], all_logits=True)
    runner.kv.release(seq)
    return torch.cat([first, rest])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", help="a GGUF file (default: the embedded model)")
    parser.add_argument("--steps", type=int, default=48, help="greedy steps per prompt")
    parser.add_argument("--llamacpp", action="store_true", help="also llama.cpp on the GGUF file")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    args = parser.parse_args()

    base = ModelArgs(
        model_path=args.model_path,
        max_running_requests=1,
        max_seq_len=512,
        max_total_tokens=1024,
        disable_radix_cache=True,
    )
    runners: dict[str, BaseModelRunner] = {
        dtype: ModelRunner(replace(base, weight_dtype=dtype)) for dtype in (BASELINE, *WEIGHT_DTYPES)
    }
    for label, weights, kv in KV_VARIANTS:
        runners[label] = ModelRunner(replace(base, weight_dtype=weights, kv_cache_dtype=kv))
    if args.llamacpp:
        if not llamacpp_runner.is_available():
            parser.error("--llamacpp needs llama-cpp-python: pip install -e '.[llamacpp]'")
        runners["llamacpp"] = llamacpp_runner.LlamaCppModelRunner(replace(base, model_runner="llamacpp"))
    print(f"CPU {describe_cpu()}")
    reference = runners[BASELINE]
    tokens = reference.tokenizer.encode(TEXT)
    targets = torch.tensor(tokens[1:])
    encoder = PromptEncoder(reference.tokenizer, reference.vocab_size, base.max_seq_len)
    prompts = [encoder.encode(messages=[{"role": "user", "content": question}]) for question in PROMPTS]
    expected_logits = text_logits(reference, tokens).log_softmax(-1)
    expected_tokens = [greedy_tokens(reference, prompt, args.steps) for prompt in prompts]
    report = {}
    for dtype, runner in runners.items():
        logits = text_logits(runner, tokens)
        logprobs = logits.log_softmax(-1)
        perplexity = float(torch.exp(-logprobs[torch.arange(len(targets)), targets].mean()))
        kl = float((expected_logits.exp() * (expected_logits - logprobs)).sum(-1).mean())
        max_difference = float((logprobs - expected_logits).abs().max())
        parted = []
        for prompt, expected in zip(prompts, expected_tokens, strict=True):
            chosen = greedy_tokens(runner, prompt, args.steps)
            parted.append(
                next((i for i, pair in enumerate(zip(chosen, expected, strict=True)) if pair[0] != pair[1]), None)
            )
        same = sum(args.steps if step is None else step for step in parted)
        report[dtype] = {
            "perplexity": perplexity,
            "mean_kl": kl,
            "max_logprob_difference": max_difference,
            "parted_at": parted,
        }
        print(
            f"{dtype:>18}: perplexity {perplexity:.3f}, mean KL from float32 {kl:.2e}, largest log-prob difference "
            f"{max_difference:.2e}; greedy: float32's token in {same} of {args.steps * len(prompts)} steps "
            f"(first difference per prompt: {parted})"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"cpu": describe_cpu(), "formats": report}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
