"""The llguidance grammar backend: JSON schema, regex, EBNF (GBNF or Lark) and structural tags.

One ``LLTokenizer`` is built per backend (seconds at 248k tokens) with the model's vocab size as its
width, so padding ids past the tokenizer's end are never allowed, and with the model's stop ids as its EOS tokens
(llguidance takes a list). llguidance never allows a special token unless a Lark grammar names it, and the
grammars built here never do: special tokens other than the stop tokens are never allowed, and the stop tokens
only where the grammar may end. Each compiled grammar keeps a template matcher at the start state that is never
advanced; ``copy()`` deep-copies it (far cheaper than building a matcher from the grammar text). The grammar
object is ``grammar.GuidanceGrammar``.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, StructTag
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.hf import from_tokenizer

from sglang_constrained.backends.base import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarBackendArgs,
)
from sglang_constrained.backends.llguidance.grammar import GuidanceGrammar, clean_message
from sglang_constrained.backends.llguidance.structural_tag_lark import structural_tag_to_lark
from sglang_constrained.cache.identity import engine_version, tokens_fingerprint
from sglang_constrained.cache.per_tokenizer import per_tokenizer
from sglang_constrained.constraint_spec import GrammarKey, check_schema_is_valid
from sglang_constrained.errors import GrammarSpecError
from sglang_constrained.schema.features import SchemaRule, keyword_rule, refuse_unsupported_features
from sglang_constrained.schema.lark import is_lark_grammar
from sglang_constrained.schema.whitespace import json_whitespace_pattern
from triton_ops.bitmask_format import clear_token_bits, lowest_allowed_token, token_word_bits

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict that exists only in llguidance's stub

logger = logging.getLogger(__name__)

LLGUIDANCE_UNSUPPORTED_SCHEMA_FEATURES: tuple[SchemaRule, ...] = (
    keyword_rule("contentEncoding"),
    keyword_rule("contentMediaType"),
    keyword_rule("contentSchema"),
)
"""Schema keywords llguidance 1.9.1 compiles but ignores (measured: a string that is not base64 passes
``"contentEncoding": "base64"``). It refuses the other unsupported keywords itself (``uniqueItems``, ``contains``,
``not``, ``if``, ``dependent*``, ``propertyNames``, ``unevaluated*``, unknown formats, look-around patterns) and
enforces ``multipleOf``, ``pattern``/``format`` with length bounds, ``patternProperties`` and
``min/maxProperties``. ``format`` on numbers (``int32``) is ignored as JSON Schema itself ignores it."""

# Errors never dump the parser state or the grammar (which would echo the whole schema). The lexer's per-step
# fuel is 10x llguidance's default: with Qwen3.5's 248k tokens, a key pattern like "[A-Za-z0-9-_.:]{1,255}"
# exhausts the default fuel mid-mask ("too many expressions constructed") and the mask comes back empty.
_LIMITS = LLParserLimits(verbose_errors=False, step_lexer_fuel=2_000_000)
# Forced on every schema: "lenient" in a schema's "x-guidance" would make llguidance ignore unknown keywords.
_STRICT_JSON: JsonCompileOptions = {"lenient": False}
_COMPACT_JSON: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_GBNF_RULE = re.compile(r"(?m)^\s*([A-Za-z_][\w.-]*)\s*::=")
_GBNF_COMMENT = re.compile(r"#[^\n]*")
_PROBE_STEPS = 8
_NO_EXTENSION_MEANING = (
    "it can produce nothing after its first tokens (a rule or $ref with no finite derivation, such as one that "
    "refers only to itself; llguidance: NoExtensionBias)"
)
"""Tokens ``_probe_start`` walks from a new grammar's start: llguidance builds lexer and parser states lazily and
reports some grammars' errors (a rule with no finite derivation, ``a{1000000}``, ``$ref`` to ``#``) only there."""
_EBNF_HINT = "(an ebnf grammar is GBNF with a 'root ::= ...' rule, or Lark with a 'start: ...' rule)"


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> LLTokenizer:
    """llguidance's tokenizer of a Hugging Face fast tokenizer, as ``llguidance.hf.from_tokenizer`` builds it.

    ``from_tokenizer`` first copies the Rust tokenizer (to switch its padding and truncation off without touching the
    caller's): a JSON round trip of the whole vocabulary, seconds at 248k tokens. A tokenizer with neither switched on
    is serialised as it is instead."""
    rust_tokenizer = getattr(tokenizer, "backend_tokenizer", None)
    if rust_tokenizer is None or rust_tokenizer.padding is not None or rust_tokenizer.truncation is not None:
        return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
    return LLTokenizer(rust_tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))


class GuidanceBackend(BaseGrammarBackend):
    """Compiles constraints with llguidance over one ``LLTokenizer`` shared by every grammar.

    JSON whitespace (``json_whitespace``): what a reader would write by default, none with
    ``constrained_json_disable_any_whitespace``, or ``constrained_json_whitespace_pattern``; a schema's own
    ``x-guidance`` options override these.
    """

    name = "llguidance"

    def __init__(self, server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]):
        if not eos_token_ids:
            raise ValueError("the llguidance backend needs at least one stop token id")
        if vocab_size < len(tokenizer):
            raise ValueError(f"the model's vocab size {vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
        if any(not 0 <= t < vocab_size for t in eos_token_ids):
            raise ValueError(f"stop token ids {eos_token_ids} must lie within the vocab size {vocab_size}")
        self.json_options = _json_options(server_args)
        super().__init__(server_args, vocab_size)
        self.ll_tokenizer = per_tokenizer(
            tokenizer,
            ("llguidance", vocab_size, tuple(eos_token_ids)),
            lambda: ll_tokenizer(tokenizer, vocab_size, eos_token_ids),
        )

    def check_json_schema(self, schema: dict[str, Any] | bool) -> None:
        refuse_unsupported_features(schema, LLGUIDANCE_UNSUPPORTED_SCHEMA_FEATURES, self.name)

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        grammar = LLMatcher.grammar_from_json_schema(key_string, defaults=self.json_options, overrides=_STRICT_JSON)
        return self._build(grammar, "JSON schema")

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        if (len(key_string) - len(key_string.rstrip("\\"))) % 2:  # llguidance drops a dangling escape silently
            raise GrammarSpecError("invalid regex: it ends in an unfinished escape sequence (a lone '\\')")
        return self._build(LLMatcher.grammar_from_regex(key_string), "regex")

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        """Lark (rule ``start``) as written, or GBNF (root rule ``root``) converted, told apart as vLLM does."""
        return self._build(LLMatcher.grammar_from_lark(self._lark(key_string)), "ebnf grammar", hint=_EBNF_HINT)

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        """xgrammar's ``format`` form (``structural_tag_lark``) or the ``{"structures": [{"begin", "schema", "end"}],
        "triggers": [...]}`` form, where each structure takes the longest trigger its ``begin`` starts with.
        Triggers are matched as text, so a trigger spelled like a special token (``<tool_call>``) is produced from
        ordinary tokens, never the special one."""
        spec = json.loads(key_string)
        if "format" in spec:
            lark = structural_tag_to_lark(spec, self._tag_schema, self._lark)
        else:
            lark = StructTag.to_grammar(_struct_tags(spec, self._tag_schema), assume_special=False)
        grammar = lark if lark.startswith("{") else LLMatcher.grammar_from_lark(lark)  # JSON: nested grammars
        return self._build(grammar, "structural tag")

    def takes_as_written(self, key: GrammarKey) -> bool:
        return key[0] == "ebnf" and is_lark_grammar(key[1])

    def _lark(self, grammar: str) -> str:
        """A grammar's Lark: itself, or its GBNF converted."""
        if is_lark_grammar(grammar):
            return grammar
        _check_gbnf_rules(grammar)
        try:
            return gbnf_to_lark(grammar)
        except Exception as e:  # the converter raises bare Exceptions for grammar errors
            raise GrammarSpecError(f"cannot convert the GBNF grammar: {clean_message(str(e))}") from e

    def _tag_schema(self, schema: Any) -> dict[str, Any]:
        """A structure's schema, checked like a JSON constraint, carrying this backend's JSON options."""
        if not isinstance(schema, dict):
            raise GrammarSpecError("its schema must be a JSON object")
        check_schema_is_valid(schema)
        schema = self.prepare_json_schema(schema)
        own = schema.get("x-guidance")
        options = {**self.json_options, **(own if isinstance(own, dict) else {}), **_STRICT_JSON}
        return {**schema, "x-guidance": options}

    @property
    def can_share_grammars(self) -> bool:
        return True

    def compile_identity(self) -> dict[str, Any]:
        return {**super().compile_identity(), "engine": engine_version("llguidance"), "tokenizer": self._fingerprint}

    @functools.cached_property
    def _fingerprint(self) -> str:
        """The bytes, special flags and stop ids of the ``LLTokenizer`` grammars are built over."""
        ll_tokenizer, ids = self.ll_tokenizer, range(self.ll_tokenizer.vocab_size)
        special = [token for token in ids if ll_tokenizer.is_special_token(token)]
        token_bytes = (ll_tokenizer.decode_bytes([token]) for token in ids)
        return tokens_fingerprint(token_bytes, special, list(ll_tokenizer.eos_tokens), ll_tokenizer.vocab_size)

    def serialize_grammar(self, grammar: BaseGrammarObject) -> str:
        """The validated llguidance grammar text. llguidance has no compiled form to ship: its lexer and parser
        states are built lazily as masks are computed, and a matcher builds from the text quickly. What the
        importer skips is the lowering (schema to grammar), the validation and the start probe."""
        if not isinstance(grammar, GuidanceGrammar):
            raise TypeError(f"not an llguidance grammar: {type(grammar).__name__}")
        return grammar.grammar_text

    def deserialize_grammar(self, payload: bytes | str) -> GuidanceGrammar:
        text = payload.decode() if isinstance(payload, bytes) else payload
        template = LLMatcher(self.ll_tokenizer, text, log_level=0, limits=_LIMITS)
        if template.is_error():
            raise ValueError(f"llguidance cannot build an exported grammar: {clean_message(template.get_error())}")
        return GuidanceGrammar(self.ll_tokenizer, text, template)

    def _build(self, grammar: str, what: str, hint: str = "") -> GuidanceGrammar:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer, limits=_LIMITS)
        if is_error:
            raise GrammarSpecError(f"invalid {what}: {clean_message(messages[0])} {hint}".rstrip())
        for warning in messages:
            logger.debug("llguidance warning for a %s: %s", what, clean_message(warning))
        template = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=_LIMITS)
        if template.is_error():
            raise GrammarSpecError(f"invalid {what}: {clean_message(template.get_error())}")
        _probe_start(template, self.ll_tokenizer, what)
        return GuidanceGrammar(self.ll_tokenizer, grammar, template)


def _probe_start(template: LLMatcher, ll_tokenizer: LLTokenizer, what: str) -> None:
    """Walk up to ``_PROBE_STEPS`` tokens from the start (each the lowest allowed id that is not a stop token) on a
    copy of ``template``; raises ``GrammarSpecError`` with llguidance's message if a mask or a step fails."""
    probe = template.deep_copy()
    stop_bits = token_word_bits(ll_tokenizer.eos_tokens)
    for _ in range(_PROBE_STEPS):
        if probe.is_stopped():
            return
        mask = torch.frombuffer(bytearray(probe.compute_bitmask()), dtype=torch.int32)
        if not probe.is_error():
            clear_token_bits(mask, stop_bits)
            token = lowest_allowed_token(mask, ll_tokenizer.vocab_size)
            if token is None:
                return
            probe.consume_token(token)
        if probe.is_error():
            message = clean_message(probe.get_error())
            raise GrammarSpecError(
                f"invalid {what}: {_NO_EXTENSION_MEANING if message == 'NoExtensionBias' else message}"
            )


def _check_gbnf_rules(grammar: str) -> None:
    """Refuse what llguidance's GBNF converter lets through: a rule defined twice (it keeps the last silently) and a
    rule with nothing after ``::=`` (it reads it as the empty string); xgrammar refuses both."""
    heads = list(_GBNF_RULE.finditer(grammar))
    first_lines: dict[str, int] = {}
    for index, head in enumerate(heads):
        name, line = head.group(1), grammar.count("\n", 0, head.start(1)) + 1
        if name in first_lines:
            raise GrammarSpecError(
                f"invalid ebnf grammar: rule {name!r} is defined twice (lines {first_lines[name]} and {line})"
            )
        first_lines[name] = line
        body_end = heads[index + 1].start() if index + 1 < len(heads) else len(grammar)
        if not _GBNF_COMMENT.sub("", grammar[head.end() : body_end]).strip():
            raise GrammarSpecError(
                f"invalid ebnf grammar: rule {name!r} (line {line}) has nothing after '::=' "
                '(write "" for the empty string)'
            )


def _json_options(server_args: GrammarBackendArgs) -> JsonCompileOptions:
    """llguidance JSON options for the server's whitespace flags (``json_whitespace``); raises ValueError for a
    conflict or a bad regex."""
    pattern = json_whitespace_pattern(
        server_args.constrained_json_whitespace_pattern, server_args.constrained_json_disable_any_whitespace
    )
    if not pattern:
        return _COMPACT_JSON.copy()
    error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema({}, defaults={"whitespace_pattern": pattern}))
    if error:
        raise ValueError(f"--constrained-json-whitespace-pattern is not a valid regex: {clean_message(error)}")
    return {"whitespace_pattern": pattern}


def _struct_tags(spec: dict[str, Any], tag_schema: Callable[[Any], dict[str, Any]]) -> list[StructTag]:
    """StructTags for a structures/triggers spec (``tag_schema`` checks each schema); raises GrammarSpecError."""
    if spec.get("type", "structural_tag") != "structural_tag":
        raise GrammarSpecError(f"a structural tag's type must be 'structural_tag', not {str(spec['type'])[:40]!r}")
    structures, triggers = spec.get("structures"), spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise GrammarSpecError("a structural tag needs a non-empty 'structures' list")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarSpecError("a structural tag needs a non-empty 'triggers' list of non-empty strings")
    tags = []
    for i, structure in enumerate(structures):
        where = f"structures[{i}]"
        if not isinstance(structure, dict) or not all(isinstance(structure.get(k), str) for k in ("begin", "end")):
            raise GrammarSpecError(f"{where} must be an object with string 'begin' and 'end' and a 'schema'")
        begin = structure["begin"]
        trigger = max((t for t in triggers if begin.startswith(t)), key=len, default=None)
        if trigger is None:
            raise GrammarSpecError(f"{where}: its begin {begin[:60]!r} starts with none of the triggers")
        try:
            schema = tag_schema(structure.get("schema"))
        except GrammarSpecError as e:
            raise GrammarSpecError(f"{where}: {e}") from e
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=schema, end=structure["end"]))
    return tags
