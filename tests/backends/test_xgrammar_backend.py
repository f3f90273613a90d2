"""The xgrammar backend against real tokenizers (SmolLM2 49k, Qwen3.5 248k): masks, stop tokens, whitespace,
structural tags, errors. Grammar state is ``test_xgrammar_state``; schema features ``test_xgrammar_schema_features``."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jsonschema
import pytest

from scripts.calibrate_xgrammar_export import ebnf_alternatives, tools
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.backends.xgrammar.export_cost import GrammarMeasure
from sglang_constrained.backends.xgrammar.grammar import XGrammarGrammar
from sglang_constrained.backends.xgrammar.utf8 import well_formed_utf8_grammar
from sglang_constrained.base_grammar_backend import InvalidGrammarObject, TokenRejectedError, create_grammar_backend
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import accepts_text, allowed_tokens, compile_grammar, compile_valid, encode_exactly

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
LATIN1_SCHEMA = {
    "type": "object",
    "properties": {"é9": {"type": "integer"}, "ÿa": {"enum": ["éb"]}},
    "required": ["é9", "ÿa"],
    "additionalProperties": False,
}
"""Characters U+0080..U+00FF before hex digits: xgrammar prints them as ``\\xHH``, which its parser reads on."""
NOTE_SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TAG_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
LEGACY_TAG = {"structures": [{"begin": "<f=weather>", "schema": TAG_SCHEMA, "end": "</f>"}], "triggers": ["<f="]}
NEW_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<f="],
        "tags": [
            {
                "type": "tag",
                "begin": "<f=weather>",
                "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
                "end": "</f>",
            }
        ],
    },
}
EBNF = 'root ::= "SELECT " column " FROM t"\ncolumn ::= "a" | "bb"'


@pytest.fixture(scope="module")
def backend(build_backend: BackendBuilder, tokenizer_case: TokenizerSetup) -> GrammarPipeline:
    return build_backend("xgrammar", tokenizer_case)


@pytest.fixture(scope="module")
def compact_backend(build_backend: BackendBuilder, tokenizer_case: TokenizerSetup) -> GrammarPipeline:
    return build_backend("xgrammar", tokenizer_case, constrained_json_disable_any_whitespace=True)


def never_allowed_ids(backend: GrammarPipeline) -> set[int]:
    """Special tokens other than the stop tokens, and the padding ids above the tokenizer's vocabulary."""
    vocab = backend.backend.vocabulary
    padding = range(vocab.tokenizer_vocab_size, vocab.model_vocab_size)
    return (vocab.special_token_ids - set(vocab.stop_token_ids)) | set(padding)


def walk(
    backend: XGrammarGrammarBackend, setup: TokenizerSetup, grammar: Any, text: str, can_end: Callable[[str], bool]
):
    """Accept ``text`` then EOS, checking every mask: the token is allowed, no special or padding id ever is,
    and the stop tokens are allowed exactly where ``can_end(prefix)`` says the grammar may end."""
    vocab, never = backend.backend.vocabulary, never_allowed_ids(backend)
    ids, prefix = encode_exactly(setup, text), b""
    for token in [*ids, None]:
        allowed = allowed_tokens(grammar, vocab.model_vocab_size)
        assert not allowed & never, f"a special or padding token is allowed after {prefix!r}"
        text_so_far = _decoded_or_none(prefix)
        expected_end = text_so_far is not None and can_end(text_so_far)
        assert all((stop in allowed) == expected_end for stop in vocab.stop_token_ids), prefix
        if token is None:
            break
        assert token in allowed, f"token {token} ({vocab.decoded_vocab[token]!r}) is masked after {prefix!r}"
        grammar.accept_token(token)
        prefix += vocab.decoded_vocab[token]
    grammar.accept_token(vocab.stop_token_ids[0])
    assert grammar.is_terminated()


def _decoded_or_none(prefix: bytes) -> str | None:
    try:
        return prefix.decode()
    except UnicodeDecodeError:
        return None


def json_can_end(schema: Any) -> Callable[[str], bool]:
    def can_end(text: str) -> bool:
        try:
            return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        except json.JSONDecodeError:
            return False

    return can_end


# kind, spec, a valid text, an invalid text, where the grammar may end
WALK_CASES = [
    ("json", PERSON_SCHEMA, '{"name": "Ada", "age": 36}', '{"name": "Ada"}', json_can_end(PERSON_SCHEMA)),
    ("json", {"type": "integer"}, "-120", "12a", json_can_end({"type": "integer"})),
    ("json", LATIN1_SCHEMA, '{"é9": 1, "ÿa": "éb"}', '{"\u0e99": 1, "ÿa": "éb"}', json_can_end(LATIN1_SCHEMA)),
    ("json_object", None, '{"a": [1, {"b": null}]}', "[1]", json_can_end({"type": "object"})),
    (
        "regex",
        r"user-[0-9]{3}@example\.com",
        "user-042@example.com",
        "user-42@example.com",
        lambda t: re.fullmatch(r"user-[0-9]{3}@example\.com", t) is not None,
    ),
    ("regex", r"[0-9]+", "2024", "20x4", lambda t: re.fullmatch(r"[0-9]+", t) is not None),
    ("ebnf", EBNF, "SELECT bb FROM t", "SELECT b FROM t", lambda t: t in ("SELECT a FROM t", "SELECT bb FROM t")),
    ("choice", ["yes", "no", "maybe"], "maybe", "perhaps", lambda t: t in ("yes", "no", "maybe")),
]


@pytest.mark.parametrize(("kind", "spec", "valid", "invalid", "can_end"), WALK_CASES, ids=lambda v: None)
def test_constraint_walks_valid_text_and_rejects_invalid(backend, tokenizer_case, kind, spec, valid, invalid, can_end):
    walk(backend, tokenizer_case, compile_grammar(backend, kind, spec), valid, can_end)
    grammar = compile_grammar(backend, kind, spec)
    ids = [*encode_exactly(tokenizer_case, invalid), *backend.backend.vocabulary.stop_token_ids]
    num_ok = grammar.validate_tokens(ids)
    assert num_ok < len(ids)
    for token in ids[:num_ok]:
        grammar.accept_token(token)
    assert ids[num_ok] not in allowed_tokens(grammar, tokenizer_case.vocab_size)
    with pytest.raises(TokenRejectedError):
        grammar.accept_token(ids[num_ok])


def test_special_tokens_never_allowed_inside_json_string(backend, tokenizer_case):
    grammar = compile_grammar(backend, "json", NOTE_SCHEMA)
    text = '{"text": "Hi <b>, wörld! \\"quoted\\" \\n\\t 42 <|fake|> ok"}'
    walk(backend, tokenizer_case, grammar, text, json_can_end(NOTE_SCHEMA))
    grammar = compile_grammar(backend, "json", NOTE_SCHEMA)
    for token in encode_exactly(tokenizer_case, '{"text": "in a string'):
        grammar.accept_token(token)
    for special in sorted(backend.backend.vocabulary.special_token_ids):
        with pytest.raises(TokenRejectedError):
            grammar.accept_token(special)
    assert len(backend.backend.vocabulary.special_token_ids) == {"smollm2": 17, "qwen35": 33}[tokenizer_case.name]


def test_padding_and_specials_never_allowed_in_free_text(backend, tokenizer_case):
    grammar = compile_grammar(backend, "structural_tag", NEW_TAG)
    allowed = allowed_tokens(grammar, tokenizer_case.vocab_size)
    assert not allowed & never_allowed_ids(backend)
    assert set(tokenizer_case.eos_token_ids) <= allowed
    assert len(allowed) > 0.9 * backend.backend.vocabulary.tokenizer_vocab_size  # free text allows nearly everything


def test_xgrammar_sees_the_vocabulary_bytes_unchanged(backend):
    """xgrammar must take the decoded bytes raw: re-decoding them as byte-level mangles non-ASCII tokens."""
    assert list(backend.backend.tokenizer_info.decoded_vocab) == list(backend.backend.vocabulary.decoded_vocab)
    assert backend.backend.tokenizer_info.stop_token_ids == list(backend.backend.vocabulary.stop_token_ids)


def test_builtin_registry_builds_this_backend(smollm2_tokenizer, server_args):
    case = smollm2_tokenizer
    args = replace(server_args.grammar, grammar_backend="xgrammar")
    built = create_grammar_backend(args, case.tokenizer, case.vocab_size, case.eos_token_ids)
    assert built is not None and isinstance(built.backend, XGrammarGrammarBackend) and built.name == "xgrammar"
    built.shutdown()


@pytest.mark.parametrize(
    ("text", "flexible", "compact"),
    [
        ('{"name":"Ada","age":36}', True, True),
        ('{"name": "Ada", "age": 36}', True, False),
        ('{\n  "name" : "Ada",\n  "age" : 36\n}', True, False),
        ('{"name":"Ada" ,"age":36}', True, False),
    ],
)
def test_whitespace_flexible_by_default_and_compact_on_request(
    backend, compact_backend, tokenizer_case, text, flexible, compact
):
    assert accepts_text(compile_grammar(backend, "json", PERSON_SCHEMA), tokenizer_case, text) is flexible
    assert accepts_text(compile_grammar(compact_backend, "json", PERSON_SCHEMA), tokenizer_case, text) is compact


def test_whitespace_pattern_is_refused_with_the_flag_to_use(smollm2_tokenizer, server_args):
    case = smollm2_tokenizer
    args = replace(server_args.grammar, constrained_json_whitespace_pattern=r"[ ]?")
    with pytest.raises(ValueError, match="--constrained-json-disable-any-whitespace"):
        XGrammarGrammarBackend(args, case.tokenizer, case.vocab_size, case.eos_token_ids)


def tag_can_end(text: str) -> bool:
    """Outside a tag anything may end the output; inside one (a begun but unclosed tag) it may not."""
    last_begin = text.rfind("<f=")
    return last_begin == -1 or "</f>" in text[last_begin:]


@pytest.mark.parametrize(
    "tag", [LEGACY_TAG, NEW_TAG, {**LEGACY_TAG, "type": "structural_tag"}], ids=["legacy", "new", "legacy-typed"]
)
def test_structural_tag_walks_trigger_json_and_end(backend, tokenizer_case, tag):
    text = 'Let me check. <f=weather>{"city": "Paris"}</f> Done.'
    walk(backend, tokenizer_case, compile_grammar(backend, "structural_tag", tag), text, tag_can_end)
    grammar = compile_grammar(backend, "structural_tag", tag)
    assert accepts_text(grammar, tokenizer_case, "No tool needed.")
    assert not accepts_text(grammar, tokenizer_case, 'Check <f=weather>{"town": "Paris"}</f>')
    assert not accepts_text(grammar, tokenizer_case, 'Check <f=weather>{"city": "Paris"} and more')


BAD_TRIGGER_TAG = {**NEW_TAG, "format": {**NEW_TAG["format"], "triggers": ["<g="]}}
# kind, spec, words the message must contain
MALFORMED_CASES = [
    ("regex", "user-(", ["regex", "parenthesis is not closed"]),
    ("regex", "a**", ["regex", "Two consecutive repetition modifiers"]),  # llguidance reads it as a*
    ("ebnf", 'root ::= "a" |', ["EBNF", "Expect element"]),  # llguidance takes the empty alternative
    ("ebnf", "start", ["read as Lark because no line defines a GBNF rule with '::='"]),
    ("json", {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}, ["'patternProperties'"]),
    ("json", {"type": "array", "minItems": 3, "maxItems": 1}, ["minItems is greater than maxItems"]),
    ("regex", "(?=a)b", ["regex", "Lookahead is not supported"]),
    ("ebnf", 'root ::= item\nitem ::= "a" | missing', ["EBNF", 'Rule "missing" is not defined']),
    ("ebnf", 'start ::= "a"', ["EBNF", 'root rule with name "root" is not found']),
    ("ebnf", 'root ::= "a', ["EBNF", "string literal"]),
    ("ebnf", 'start: "a" WS\n%import common.WS\n%ignore WS', ["cannot take the Lark grammar's %ignore"]),
    ("ebnf", 'start: "a"i', ["cannot take the Lark grammar's case-insensitive literal"]),
    ("ebnf", "start: /a/i", ["cannot take the Lark grammar's regex flags"]),
    ("ebnf", 'start: "a" X\n%declare X', ["cannot take the Lark grammar's %declare (X"]),
    ("ebnf", 'start: x{"a"}\nx{p}: p', ["cannot take the Lark grammar's template rule x{p}"]),
    ("ebnf", 'start: %json {"type": "integer"}', ["llguidance's extension %json", "--grammar-backend llguidance"]),
    ("ebnf", 'a: "x"', ["invalid Lark grammar", "no 'start' rule"]),
    (
        "json",
        {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array", "items": [{"type": "integer"}]},
        ["JSON schema", "items must be a boolean or an object"],
    ),
    ("json", {"$ref": "#/$defs/missing"}, ["JSON schema", "$defs"]),
    ("structural_tag", {"type": "structural_tag"}, ["needs 'format'", "'structures' and 'triggers'"]),
    ("structural_tag", {"type": "tool_calls", "format": {}}, ["type 'structural_tag'", "tool_calls"]),
    (
        "structural_tag",
        {"type": "structural_tag", "format": {"type": "nope"}},
        ["invalid structural tag at format", "nope"],
    ),
    ("structural_tag", BAD_TRIGGER_TAG, ["structural tag", "does not match any trigger"]),
    ("structural_tag", {"structures": [{"begin": "<f>", "schema": {}}], "triggers": ["<f"]}, ["structure 0 lacks end"]),
    ("structural_tag", {"structures": "x", "triggers": ["<f"]}, ["'structures' must be a list of objects"]),
    (
        "structural_tag",
        {
            **LEGACY_TAG,
            "structures": [{**LEGACY_TAG["structures"][0], "schema": {"type": "integer", "not": {"const": 3}}}],
        },
        ["structural tag's JSON schema at /format/tags/0/content", "'not'"],
    ),
    (
        "structural_tag",
        {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {"type": 5}}},
        ["structural tag's JSON schema at /format", "invalid JSON schema"],
    ),
]


@pytest.mark.parametrize(("kind", "spec", "words"), MALFORMED_CASES, ids=lambda v: None)
def test_malformed_constraints_give_invalid_grammar_with_clear_message(backend, kind, spec, words):
    grammar = backend.get_cached_or_future_value(make_grammar_key(kind, spec))[0].result()
    assert isinstance(grammar, InvalidGrammarObject)
    for word in words:
        assert word in grammar.error_message
    assert ".cc:" not in grammar.error_message and "Check failed" not in grammar.error_message
    assert "\n" not in grammar.error_message


def test_structural_tag_requiring_a_special_token_is_refused(backend, tokenizer_case):
    special = min(backend.backend.vocabulary.special_token_ids - set(tokenizer_case.eos_token_ids))
    for token in (special, tokenizer_case.vocab_size - 1):
        tag = {"type": "structural_tag", "format": {"type": "token", "token": token}}
        grammar = backend.get_cached_or_future_value(make_grammar_key("structural_tag", tag))[0].result()
        assert isinstance(grammar, InvalidGrammarObject)
        assert f"token {token}" in grammar.error_message and "not a regular token" in grammar.error_message


@pytest.mark.parametrize(
    ("kind", "spec", "what"),
    [
        ("json", {"type": "object", "properties": {f"f{i}": {"type": "string", "maxLength": 6000} for i in range(8)}},
         "the schema has 8 length bounds (up to 6,000 characters), which predict"),
        ("regex", "[a-z]{0,9000}[0-9]{0,9000}[A-Z]{0,9000}",
         "the regex has 3 length bounds (up to 9,000 characters), which predict"),
        ("json", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(20_000)}},
         "the schema has an object of 20,000 properties, which predict"),
    ],
    ids=["length-bounded-strings", "long-repetitions", "many-properties"],
)  # fmt: skip
def test_a_compile_its_length_bounds_predict_beyond_the_deadline_is_refused_at_once(
    backend: XGrammarGrammarBackend, kind: str, spec: Any, what: str
) -> None:
    """Refused before xgrammar sees it (measured at 49k tokens: one 6,000-character string takes it over 10 s, one
    9,000-character repetition over a minute, and 20,000 properties several minutes)."""
    grammar = compile_grammar(backend, kind, spec)
    assert isinstance(grammar, InvalidGrammarObject)
    assert what in grammar.error_message
    assert "beyond the compile deadline of 50 s (--grammar-compile-timeout)" in grammar.error_message


def required_strings(count: int) -> dict[str, Any]:
    names = [f"p{i}" for i in range(count)]
    return {"type": "object", "properties": {name: {"type": "string"} for name in names}, "required": names}


def test_a_grammar_whose_compiled_form_predicts_a_send_beyond_the_memory_bound_is_refused_at_once(
    backend: XGrammarGrammarBackend,
) -> None:
    """1,200 required strings compile in a fraction of a second, but xgrammar's compiled form of them serialises to
    about 400 MB, its compile process growing past 5 GiB on the way (measured at 1,000: 286 MB, 4 GiB, 17 s)."""
    grammar = compile_grammar(backend, "json", required_strings(1200))
    assert isinstance(grammar, InvalidGrammarObject)
    assert "the JSON schema has a grammar of 1,240 rules over" in grammar.error_message
    assert "over the memory bound of 4,096 MiB (--grammar-compile-max-memory)" in grammar.error_message
    assert "--grammar-backend llguidance or auto" in grammar.error_message


def test_the_predicted_compiled_size_is_near_the_serialised_size(backend: GrammarPipeline) -> None:
    """The measure behind that refusal, on a schema that compiles: near xgrammar's own size (the measure predicts the
    rules' FSMs; the token masks add more at 248k tokens than at 49k)."""
    xgrammar_backend = backend.backend
    schema = json.dumps(xgrammar_backend.prepare_json_schema(required_strings(200)))
    grammar_before_compile = well_formed_utf8_grammar(xgrammar_backend.json_schema_grammar(schema))
    predicted = GrammarMeasure.of(grammar_before_compile).predicted_export()
    grammar = compile_valid(backend, "json", required_strings(200))
    serialised = len(backend.backend.serialize_grammar(grammar))
    assert serialised / 2 < predicted.num_bytes < serialised * 1.5


LARGE_COMPILED_GRAMMARS = [
    ("structural_tag", tools(100), "the structural tag compiles to a grammar of 1,124 rules over"),
    ("ebnf", ebnf_alternatives(1000), "the EBNF grammar compiles to a grammar of 2,006 rules over"),
]


@pytest.mark.parametrize(("kind", "spec", "what"), LARGE_COMPILED_GRAMMARS, ids=["100-tools", "1000-rules"])
def test_a_tag_or_grammar_whose_compiled_form_predicts_a_send_beyond_the_memory_bound_is_refused(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, kind: str, spec: Any, what: str
) -> None:
    """Measured by the grammar xgrammar compiled (its compile merges rules), before it is serialised: a 100-tool tag
    compiles in 0.4 s but serialises to 272 MB, its process peaking near 4.2 GiB; 1,000 rules of EBNF in 0.2 s, then
    557 MB in 16 s (``scripts/calibrate_xgrammar_export.py``)."""
    grammar = compile_grammar(build_backend("xgrammar", smollm2_tokenizer), kind, spec)
    assert isinstance(grammar, InvalidGrammarObject)
    assert what in grammar.error_message
    assert "over the memory bound of 4,096 MiB (--grammar-compile-max-memory)" in grammar.error_message
    assert "--grammar-backend llguidance or auto" in grammar.error_message


@pytest.mark.parametrize(
    ("kind", "spec"), [("structural_tag", tools(10)), ("ebnf", ebnf_alternatives(200))], ids=["10-tools", "200-rules"]
)
def test_the_compiled_measure_predicts_a_tag_s_or_grammar_s_serialised_size(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, kind: str, spec: Any
) -> None:
    """Where the measure before the compile overstates it several times (xgrammar merges their rules)."""
    backend = build_backend("xgrammar", smollm2_tokenizer)
    grammar = compile_valid(backend, kind, spec)
    assert isinstance(grammar, XGrammarGrammar)
    measure = GrammarMeasure.of_compiled(grammar.compiled_grammar)
    assert measure is not None
    serialised = len(backend.backend.serialize_grammar(grammar))
    assert serialised / 2 < measure.predicted_export().num_bytes < serialised * 2


def test_strict_mode_narrowing_is_named_in_the_stats(backend: GrammarPipeline) -> None:
    grammar = backend.backend.build_grammar(make_grammar_key("json", PERSON_SCHEMA))
    assert grammar.grammar_stats is not None and grammar.grammar_stats.narrowing is not None
    assert grammar.grammar_stats.narrowing.startswith("narrows 'unlisted properties' (at /)")
    closed = backend.backend.build_grammar(make_grammar_key("json", {**PERSON_SCHEMA, "additionalProperties": False}))
    assert closed.grammar_stats is not None and closed.grammar_stats.narrowing is None
