"""Every way a request meets the think gate, through the real scheduler on the tiny Qwen3 model and the 248k-token
Qwen3.5 vocabulary, with speculation (jump-forward and drafts) off and on: the same tokens, the same reasoning and
answers, the same finish reasons.

Two schedulers in this process over one model load (as ``tests/serving/test_speculative.py`` does): the
comparison is exact because the forward is batch-invariant.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from scheduler.batch_executor import SpeculationStats
from scheduler.client import make_request
from scheduler.io_struct import GenerateOutput
from scheduler.model.runner import ModelRunner
from scheduler.scheduler import Scheduler
from scheduler.server_args import ServerArgs
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.reasoning.conftest import MODEL_SETTINGS
from tests.serving.test_speculative import serve

pytestmark = pytest.mark.model

ANSWER = "ANSWER: (yes|no)"
QUESTION = [{"role": "user", "content": "Is 7 a prime number? Think, then answer."}]
SERVER_BUDGET = 30
"""``--thinking-budget``: for the requests that set none."""
RAW_PROMPT = "<|im_start|>user\nIs 7 a prime number?<|im_end|>\n<|im_start|>assistant\n"
"""A Qwen3 hybrid's prompt: no ``<think>`` in it, so the model may open one or answer at once."""
CASES: dict[str, dict[str, Any]] = {
    "thinks then answers": {"messages": QUESTION, "bias": {"</think>": 10.0}, "temperature": 1.0},
    "never closes: the budget forces it": {"messages": QUESTION, "bias": {"</think>": -100.0}, "budget": 6},
    "never closes: the server's budget": {"messages": QUESTION, "bias": {"</think>": -100.0}},
    "thinking off (enable_thinking=false)": {"messages": QUESTION, "template": {"enable_thinking": False}},
    "answers without opening <think>": {"text": RAW_PROMPT, "bias": {"<think>": -100.0}},
    "opens <think> itself, budget spent": {
        "text": RAW_PROMPT,
        "bias": {"<think>": 12.0},
        "temperature": 1.0,
        "budget": 4,
    },
    "free request, budget spent": {"messages": QUESTION, "budget": 5, "regex": None},
}


def request(tokenizer: Any, case: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    bias = {str(tokenizer.convert_tokens_to_ids(token)): value for token, value in case.get("bias", {}).items()}
    params = {
        "require_reasoning": True,
        "temperature": case.get("temperature", 0.0),
        "seed": seed,
        "logit_bias": bias,
        "thinking_budget": case.get("budget"),
        "max_new_tokens": 48,
    }
    if case.get("regex", ANSWER) is not None:
        params["regex"] = ANSWER
    prompt = {"messages": case["messages"]} if "messages" in case else {"text": case["text"]}
    return {
        **prompt,
        "sampling_params": params,
        "separate_reasoning": True,
        "chat_template_kwargs": case.get("template"),
    }


def run(
    runner: ModelRunner, algorithm: str, requests: list[dict[str, Any]]
) -> tuple[list[GenerateOutput], SpeculationStats]:
    runner.kv.flush()
    scheduler = Scheduler(
        ServerArgs.of(
            reasoning_parser="qwen3", thinking_budget=SERVER_BUDGET, speculative_algorithm=algorithm, **MODEL_SETTINGS
        ),
        runner,
    )
    try:
        outputs = serve(scheduler, [make_request(**r) for r in requests])
        return outputs, scheduler.executor.stats
    finally:
        scheduler.shutdown(None)


@pytest.fixture(scope="module")
def outputs(
    reasoning_runner: ModelRunner, qwen35_tokenizer: TokenizerSetup
) -> dict[str, tuple[list[GenerateOutput], SpeculationStats]]:
    """Every case, greedy and with two seeds (n = 2), in one batch; with speculation off and on."""
    tokenizer = qwen35_tokenizer.tokenizer
    requests = [request(tokenizer, case, seed) for case in CASES.values() for seed in (0, 1)]
    return {algorithm: run(reasoning_runner, algorithm, requests) for algorithm in ("none", "grammar+ngram")}


def by_case(outputs: list[GenerateOutput]) -> dict[str, list[GenerateOutput]]:
    return {name: outputs[2 * i : 2 * i + 2] for i, name in enumerate(CASES)}


def test_speculation_changes_no_reasoning_answer_or_finish(
    outputs: dict[str, tuple[list[GenerateOutput], SpeculationStats]],
) -> None:
    (plain, plain_stats), (fast, fast_stats) = outputs["none"], outputs["grammar+ngram"]
    seen = [(o.token_ids, o.reasoning_text, o.text, o.finish_reason, o.usage.reasoning_tokens) for o in plain]
    assert seen == [(o.token_ids, o.reasoning_text, o.text, o.finish_reason, o.usage.reasoning_tokens) for o in fast]
    assert fast_stats.num_output_tokens == plain_stats.num_output_tokens
    assert sum(fast_stats.drafts_accepted.values()) > 0  # drafts stood (the free request's run sets the forwards)
    # the budget's think-end token is forced, and so is the answer's "ANSWER: " after it: one jump-forward run
    assert fast_stats.num_forced_tokens >= 3 * 4
    assert fast_stats.drafts_proposed.get("grammar", 0) > 0


def test_each_way_to_meet_the_gate(outputs: dict[str, tuple[list[GenerateOutput], SpeculationStats]]) -> None:
    cases = by_case(outputs["grammar+ngram"][0])
    for name, (first, second) in cases.items():
        for output in (first, second):
            assert output.finish_reason is not None and output.finish_reason.type != "abort", (name, output)
            if name != "free request, budget spent":
                assert re.fullmatch(ANSWER, output.text), (name, output.text)
                assert output.finish_reason.type == "stop"
    thinks = cases["thinks then answers"]
    assert all(0 < o.usage.reasoning_tokens < 48 and o.reasoning_text for o in thinks)
    assert thinks[0].reasoning_text != thinks[1].reasoning_text  # n = 2: each seed thinks its own way
    for o in cases["never closes: the budget forces it"]:
        assert o.usage.reasoning_tokens == 6 + 1  # the budget, then the forced </think>
    for o in cases["never closes: the server's budget"]:
        assert o.usage.reasoning_tokens == SERVER_BUDGET + 1
    for name in ("thinking off (enable_thinking=false)", "answers without opening <think>"):
        # the answer is the answer, held by the grammar from its first token, and not reported as reasoning
        assert all(o.usage.reasoning_tokens == 0 and o.reasoning_text == "" for o in cases[name])
    for o in cases["opens <think> itself, budget spent"]:
        assert o.usage.reasoning_tokens == 1 + 4 + 1  # <think>, the budget, </think>
    for o in cases["free request, budget spent"]:
        assert o.usage.reasoning_tokens == 5 + 1 and o.finish_reason.type == "length" and o.text
