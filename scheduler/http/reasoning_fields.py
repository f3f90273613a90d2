"""A reasoning model's request fields (``--reasoning-parser``), SGLang's and vLLM's spellings: whether the model may
think (``chat_template_kwargs.enable_thinking``), its thinking budget (vLLM's ``thinking_token_budget``, SGLang's
``custom_params.thinking_budget``), and whether the think block is reported apart (``separate_reasoning``).

On a server without a reasoning parser these fields change nothing: the scheduler gates no think block there.
"""

from __future__ import annotations

from typing import Any

from scheduler.http.protocol import ProtocolError

CUSTOM_PARAMS_REFUSAL = (
    "custom_params feeds a custom logit processor, which this server does not run; of its keys only "
    "thinking_budget (SGLang's thinking budget) is taken"
)


def enables_thinking(chat_template_kwargs: dict[str, Any] | None) -> bool:
    """False where the chat template is asked not to think (Qwen3's ``enable_thinking: false``); else True."""
    return (chat_template_kwargs or {}).get("enable_thinking") is not False


def thinking_budget(vllm_budget: int | None, custom_params: dict[str, Any] | None) -> int | None:
    """The request's thinking budget from vLLM's ``thinking_token_budget`` or SGLang's ``custom_params`` (the same
    number if both are given); None: the server's ``--thinking-budget``. Raises ``ProtocolError`` naming the field."""
    custom = dict(custom_params or {})
    sglang_budget = custom.pop("thinking_budget", None)
    if custom:
        raise ProtocolError(
            f"custom_params.{sorted(custom)[0]} is not supported: {CUSTOM_PARAMS_REFUSAL}",
            param="custom_params",
            code="unsupported_parameter",
        )
    if sglang_budget is not None and (
        not isinstance(sglang_budget, int) or isinstance(sglang_budget, bool) or sglang_budget < 0
    ):
        raise ProtocolError(
            f"custom_params.thinking_budget must be an integer >= 0, got {sglang_budget!r}", param="custom_params"
        )
    if vllm_budget is not None and sglang_budget is not None and vllm_budget != sglang_budget:
        raise ProtocolError(
            f"thinking_token_budget ({vllm_budget}) and custom_params.thinking_budget ({sglang_budget}) differ: "
            "give one",
            param="thinking_token_budget",
        )
    return vllm_budget if vllm_budget is not None else sglang_budget
