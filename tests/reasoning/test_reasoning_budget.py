"""Budget-aware constraints meet the think gate: thinking spends the token budget first, but is closed in time for
the answer's shortest ending, which then ends inside the budget with "stop" (on the tiny Qwen3 model, 248k
vocabulary)."""

from __future__ import annotations

import re

import pytest

from scheduler.client import make_request
from scheduler.model.runner import ModelRunner
from scheduler.scheduler import Scheduler
from scheduler.server_args import ServerArgs
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.reasoning.conftest import MODEL_SETTINGS
from tests.reasoning.test_reasoning_scheduler import ANSWER, QUESTION
from tests.serving.test_speculative import serve

pytestmark = pytest.mark.model


def test_endless_thinking_is_closed_in_time_for_the_answer(
    reasoning_runner: ModelRunner, qwen35_tokenizer: TokenizerSetup
) -> None:
    never_close = {str(qwen35_tokenizer.tokenizer.convert_tokens_to_ids("</think>")): -100.0}
    params = {"regex": ANSWER, "require_reasoning": True, "logit_bias": never_close, "temperature": 0.0}
    requests = [
        make_request(messages=QUESTION, sampling_params={**params, "max_new_tokens": budget}, separate_reasoning=True)
        for budget in (12, 20)
    ]
    reasoning_runner.kv.flush()
    scheduler = Scheduler(ServerArgs.of(reasoning_parser="qwen3", **MODEL_SETTINGS), reasoning_runner)
    try:
        outputs = serve(scheduler, requests)
    finally:
        scheduler.shutdown(None)
    for budget, output in zip((12, 20), outputs, strict=True):
        assert output.finish_reason is not None and output.finish_reason.type == "stop", output
        assert len(output.token_ids) <= budget
        assert re.fullmatch(ANSWER, output.text), output.text
        assert output.reasoning_text  # it thought until the answer needed the rest
