"""What this server does with each field of OpenAI's chat-completions and completions request bodies: every field is
honoured, accepted and ignored as bookkeeping (it cannot change a local answer), or refused with a 400 naming it
(ignoring it would change what the user gets). Names OpenAI does not know stay a 400 (``protocol.Body`` forbids
them), so a typo is never mistaken for bookkeeping.

``tests/serving/test_openai_fields.py`` derives OpenAI's current fields from the installed ``openai`` package's
request types and fails on any field this module and ``protocol`` do not account for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduler.http.constraint_fields import WHITESPACE_PATTERN_REFUSAL
from scheduler.http.protocol import Body, ProtocolError

BOOKKEEPING_FIELDS: dict[str, str] = {
    "store": "nothing is stored: there is no distillation or evals product here",
    "metadata": "tags for OpenAI's dashboard",
    "service_tier": "a billing and latency tier; every request is served alike",
    "prompt_cache_key": "a cache-routing hint; the prefix cache reuses any shared prompt prefix by itself",
    "prompt_cache_options": "cache breakpoints and lifetime; the prefix cache keeps prefixes while memory allows",
    "prompt_cache_retention": "the same, deprecated",
    "user": "an end-user id for abuse monitoring",
    "safety_identifier": "the newer name of user",
    "reasoning_effort": "a setting of OpenAI's reasoning models; the served model's chat template takes none",
    "verbosity": "a setting of OpenAI's reasoning models; the served model's chat template takes none",
    "stream_options.include_obfuscation": "random padding against a network side channel; none is added",
}
"""Accepted and ignored, with the reason each cannot change a local answer (README: "Fields per API")."""

REFUSED_FIELDS: dict[str, str] = {
    "functions": "the deprecated form of tools: send tools",
    "function_call": "the deprecated form of tool_choice: send tools and tool_choice",
    "audio": "audio output is not implemented",
    "modalities": 'only ["text"] output is implemented',
    "moderation": "moderation of input and output is not implemented",
    "web_search_options": "web search is not implemented",
    "echo": "prompt logprobs and echoing the prompt are not implemented",
    "suffix": "inserting text before a suffix is not implemented",
    "best_of": "use n",
    "guided_whitespace_pattern": WHITESPACE_PATTERN_REFUSAL,
    "return_hidden_states": "the model's hidden states are not returned by this server (SGLang's field)",
}
"""Refused when set to anything but their neutral value, because ignoring them would change the answer."""

_NEUTRAL_VALUES: dict[str, list[Any]] = {
    "modalities": [["text"]],
    "audio": [],
    "moderation": [],
    "web_search_options": [],
}
"""The values a refused field may carry besides null, where they are not ``is_neutral``'s: ``["text"]`` asks for
what the server does anyway, and an empty ``web_search_options`` already turns web search on."""


def refuse_unimplemented(request: Body, refused: Mapping[str, str] = REFUSED_FIELDS) -> None:
    """Raise ``ProtocolError`` (400, ``unsupported_parameter``) for the first field of ``refused`` (name: reason)
    the request sets to anything but its neutral value."""
    for name, reason in refused.items():
        value = getattr(request, name, None)
        neutral_values = _NEUTRAL_VALUES.get(name)
        if not (value is None or (is_neutral(value) if neutral_values is None else value in neutral_values)):
            raise ProtocolError(
                f"{name} is not supported by this server: {reason}", param=name, code="unsupported_parameter"
            )


def is_neutral(value: Any) -> bool:
    """Whether a field's value asks for nothing (unset, false, zero, ``"none"`` or empty)."""
    return value is None or value is False or value == 0 or value == "none" or value == [] or value == {}
