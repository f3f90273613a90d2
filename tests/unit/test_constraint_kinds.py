"""The table of constraint kinds drives every reader: each kind's names over HTTP and its request field reach the
scheduler as that kind, its spec reaches the backend method the table names, and its size is refused by one rule
with one message wherever it is checked."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from scheduler.http.protocol import ChatCompletionRequest, ProtocolError, parse_body
from scheduler.http.request_conversion import RequestLimits, chat_calls, checked_params
from scheduler.io_struct import GenerateReq, SamplingParams, decode_client_message, encode
from scheduler.server_args import GrammarArgs
from sglang_constrained.backends.base import BaseGrammarBackend, InvalidGrammarObject
from sglang_constrained.backends.registry import create_grammar_backend
from sglang_constrained.constraint_spec import (
    CONSTRAINT_KIND_TABLE,
    CONSTRAINT_KINDS,
    ConstraintKind,
    GrammarSpecError,
    lower_constraint,
    make_grammar_key,
)
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
TAG = {"type": "structural_tag", "format": {"type": "const_string", "value": "yes"}}
EXAMPLES: dict[str, tuple[Any, str]] = {
    "json": (SCHEMA, "dispatch_json"),
    "regex": (r"\d{3}-\d{4}", "dispatch_regex"),
    "ebnf": ('root ::= "yes" | "no"', "dispatch_ebnf"),
    "structural_tag": (TAG, "dispatch_structural_tag"),
    "choice": (["red", "green"], "dispatch_regex"),
    "json_object": (True, "dispatch_json"),
}
"""A spec of each kind as a request sends it, and the backend method that must compile it."""
LIMITS = RequestLimits(max_seq_len=100, max_spec_bytes=1 << 20)


def http_names(kind: ConstraintKind) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each way the table says an OpenAI-style body asks for ``kind``, with that body's constraint fields."""
    value = EXAMPLES[kind.name][0]
    for name in kind.http_fields:
        yield name, {name: value}
    if kind.structured_outputs_field is not None:
        yield (
            f"structured_outputs.{kind.structured_outputs_field}",
            {"structured_outputs": {kind.structured_outputs_field: value}},
        )
    if kind.response_format == "json_schema":
        yield "response_format", {"response_format": {"type": "json_schema", "json_schema": {"schema": value}}}
    elif kind.response_format == "structural_tag":
        yield "response_format", {"response_format": value}
    elif kind.response_format is not None:
        yield "response_format", {"response_format": {"type": kind.response_format}}


HTTP_CASES = [
    pytest.param(kind, fields, id=name) for kind in CONSTRAINT_KIND_TABLE for name, fields in http_names(kind)
]


def test_every_kind_has_an_example_and_a_compile_method() -> None:
    assert set(EXAMPLES) == set(CONSTRAINT_KINDS)
    for kind in CONSTRAINT_KIND_TABLE:
        compiled = (
            kind if kind.lowering is None else next(k for k in CONSTRAINT_KIND_TABLE if k.name == kind.lowering.to)
        )
        assert compiled.compile_method == EXAMPLES[kind.name][1], kind.name


@pytest.mark.parametrize(("kind", "fields"), HTTP_CASES)
def test_each_http_name_reaches_the_scheduler_as_its_kind(kind: ConstraintKind, fields: dict[str, Any]) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
    (call,) = chat_calls(parse_body(ChatCompletionRequest, json.dumps(body).encode()), "id", LIMITS)
    assert call.sampling_params.constraint_fields() == [kind.field]
    key = call.sampling_params.grammar_key()
    assert key is not None and key[0] == kind.name


@pytest.mark.parametrize("kind", CONSTRAINT_KIND_TABLE, ids=CONSTRAINT_KINDS)
def test_each_request_field_crosses_the_socket_as_its_kind(kind: ConstraintKind) -> None:
    message = GenerateReq(rid="r", text="Hi", sampling_params=SamplingParams(**{kind.field: EXAMPLES[kind.name][0]}))
    decoded = decode_client_message(encode(message))
    assert isinstance(decoded, GenerateReq)
    assert decoded.sampling_params.grammar_key() == make_grammar_key(kind.name, EXAMPLES[kind.name][0])


@pytest.fixture(scope="module")
def llguidance(smollm2_tokenizer: TokenizerSetup) -> Iterator[BaseGrammarBackend]:
    setup = smollm2_tokenizer
    pipeline = create_grammar_backend(
        GrammarArgs(grammar_backend="llguidance"), setup.tokenizer, setup.vocab_size, setup.eos_token_ids
    )
    assert pipeline is not None and isinstance(pipeline.backend, BaseGrammarBackend)
    yield pipeline.backend
    pipeline.shutdown()


@pytest.mark.parametrize("kind", CONSTRAINT_KIND_TABLE, ids=CONSTRAINT_KINDS)
def test_each_kind_compiles_through_the_method_the_table_names(
    llguidance: BaseGrammarBackend, kind: ConstraintKind, monkeypatch: pytest.MonkeyPatch
) -> None:
    called: list[str] = []

    def recording(name: str, method: Callable[[str], Any]) -> Callable[[str], Any]:
        def compile_spec(spec: str) -> Any:
            called.append(name)
            return method(spec)

        return compile_spec

    for name in {method for _, method in EXAMPLES.values()}:
        monkeypatch.setattr(llguidance, name, recording(name, getattr(llguidance, name)))
    grammar = llguidance.build_grammar(make_grammar_key(kind.name, EXAMPLES[kind.name][0]))
    assert not isinstance(grammar, InvalidGrammarObject), grammar
    assert called == [EXAMPLES[kind.name][1]]
    assert grammar.grammar_stats is not None and grammar.grammar_stats.dispatch_type == kind.name


@pytest.mark.parametrize("kind", CONSTRAINT_KIND_TABLE, ids=CONSTRAINT_KINDS)
def test_the_size_rule_gives_one_message_over_http_and_in_the_backend(kind: ConstraintKind) -> None:
    params = SamplingParams(**{kind.field: EXAMPLES[kind.name][0]})
    key = params.grammar_key()
    assert key is not None
    limit = len(key[1].encode()) - 1
    if limit < 0:  # json_object's spec is empty: no limit refuses it
        checked_params(params, replace(LIMITS, max_spec_bytes=0))
        return
    with pytest.raises(ProtocolError) as http_error:
        checked_params(params, replace(LIMITS, max_spec_bytes=limit))
    with pytest.raises(GrammarSpecError) as backend_error:
        lower_constraint(key, limit, lambda schema: schema)
    assert http_error.value.message == str(backend_error.value)
    assert http_error.value.param == kind.field and http_error.value.code == "invalid_constraint"
    assert f"the {kind.field} constraint is {limit + 1:,} bytes, over the limit of {limit:,} bytes" in str(
        backend_error.value
    )
    assert "--grammar-max-spec-bytes" in str(backend_error.value)
    lower_constraint(key, limit + 1, lambda schema: schema)


def test_a_flag_set_false_asks_for_nothing() -> None:
    assert SamplingParams(json_object=False).grammar_key() is None
    assert SamplingParams(json_object=True).constraint_fields() == ["json_object"]
