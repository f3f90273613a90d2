"""The xgrammar backend: JSON schemas, regexes, EBNF grammars and structural tags compiled by xgrammar 0.2.8.

xgrammar builds its token masks over our ``TokenizerVocabulary``, whose special and padding entries are blank,
so no special token is ever allowed; the model's EOS ids are the stop tokens, allowed where the grammar can end.
Masks are int32 bitmasks in the contract's layout; applying them is left to ``triton_ops`` (xgrammar's own CPU
apply kernel is several times slower on this machine).
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

import pydantic
import torch
import xgrammar
from xgrammar.structural_tag import StructuralTag

from sglang_constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarBackendArgs,
    TokenRejectedError,
    common_prefix_length,
)
from sglang_constrained.constraint_spec import GrammarSpecError, check_schema_is_valid
from sglang_constrained.schema_features import (
    SchemaRule,
    enum_outside_type_rule,
    iter_subschemas,
    keyword_rule,
    keywords_together_rule,
    refuse_unsupported_features,
    unknown_format_rule,
)
from sglang_constrained.vocabulary import tokenizer_vocabulary

# The string formats xgrammar 0.2.8 enforces; it accepts any string for every other format.
XGRAMMAR_SUPPORTED_FORMATS = frozenset(
    {
        "date-time", "date", "time", "duration", "email", "hostname", "ipv4", "ipv6",
        "uri", "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip

# Keywords that constrain an instance (annotations such as title, description or default do not).
_ASSERTION_KEYWORDS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",
        "maxLength", "minLength", "pattern", "format", "maxItems", "minItems", "uniqueItems", "contains",
        "maxContains", "minContains", "items", "prefixItems", "additionalItems", "unevaluatedItems",
        "maxProperties", "minProperties", "required", "dependentRequired", "dependencies", "properties",
        "patternProperties", "additionalProperties", "propertyNames", "unevaluatedProperties", "dependentSchemas",
        "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
    }
)  # fmt: skip
_OBJECT_INFERRED_FROM = ("properties", "additionalProperties", "unevaluatedProperties")
_ARRAY_INFERRED_FROM = ("items", "prefixItems")
# xgrammar enforces multipleOf on an integer bounded on both sides only when maximum - minimum is below this.
_MULTIPLE_OF_MAX_RANGE = 10_000


def _types(schema: dict[str, Any]) -> list[Any]:
    types = schema.get("type")
    return [types] if isinstance(types, str) else list(types) if isinstance(types, list) else []


def _integer_bound(schema: dict[str, Any], inclusive: str, exclusive: str, sign: int) -> int | None:
    """The tightest integer bound (``sign`` +1 for lower, -1 for upper) the schema puts on an integer."""
    candidates = []
    if isinstance(schema.get(inclusive), int | float):
        candidates.append(sign * math.ceil(sign * schema[inclusive]))
    if isinstance(schema.get(exclusive), int | float):
        candidates.append(sign * (math.floor(sign * schema[exclusive]) + 1))
    if not candidates:
        return None
    return max(candidates) if sign > 0 else min(candidates)


def _is_multiple_of_ignored(schema: dict[str, Any]) -> bool:
    step, types = schema.get("multipleOf"), _types(schema)
    if step is None:
        return False
    if "integer" not in types or "number" in types or not float(step).is_integer():
        return True
    low = _integer_bound(schema, "minimum", "exclusiveMinimum", 1)
    high = _integer_bound(schema, "maximum", "exclusiveMaximum", -1)
    if low is None and high is None:
        return False
    return low is None or high is None or high - low >= _MULTIPLE_OF_MAX_RANGE


def _with_siblings_rule(keyword: str, allowed: tuple[str, ...] = ()) -> SchemaRule:
    """``keyword`` next to other assertion keywords: xgrammar keeps one side and drops the other."""
    ignored = {keyword, *allowed}
    return SchemaRule(
        f"{keyword} together with other keywords",
        lambda s: keyword in s and any(k in _ASSERTION_KEYWORDS and k not in ignored for k in s),
    )


def _untyped_rule(keyword: str, inferred_from: tuple[str, ...] = ()) -> SchemaRule:
    """``keyword`` in a schema whose type xgrammar cannot tell: it then allows any value."""
    return SchemaRule(
        f"{keyword} without type",
        lambda s: keyword in s and "type" not in s and not any(k in s for k in inferred_from),
    )


def _has_required_outside_properties(schema: dict[str, Any]) -> bool:
    required, properties = schema.get("required"), schema.get("properties") or {}
    may_be_object = "type" not in schema or "object" in _types(schema)
    return may_be_object and isinstance(required, list) and any(name not in properties for name in required)


def _is_non_pointer_ref(schema: dict[str, Any]) -> bool:
    ref = schema.get("$ref")
    return isinstance(ref, str) and ref != "#" and not ref.startswith("#/")


# Measured on xgrammar 0.2.8 (tests/test_xgrammar_backend.py re-checks each against jsonschema): features it
# compiles without error but does not enforce. Not refused: oneOf whose branches may overlap (xgrammar falls back
# to anyOf, with a warning) and unanchored patterns (xgrammar anchors every pattern).
XGRAMMAR_UNSUPPORTED_SCHEMA_FEATURES: tuple[SchemaRule, ...] = (
    enum_outside_type_rule(),  # the enum is kept, the sibling type dropped ("a" passes type: object)
    SchemaRule("multipleOf on a non-integer or widely bounded number", _is_multiple_of_ignored),  # any number
    SchemaRule("uniqueItems", lambda s: s.get("uniqueItems") is True),  # duplicates accepted
    keyword_rule("contains"),  # any items accepted (min/maxContains only qualify contains)
    keyword_rule("if"),  # if/then/else all dropped
    keyword_rule("not"),  # anything accepted
    keyword_rule("dependentRequired"),  # dependent properties not required
    keyword_rule("dependentSchemas"),  # dependent schemas dropped
    keyword_rule("dependencies"),  # (draft 7) dropped
    keyword_rule("patternProperties"),  # matching properties rejected as unknown
    keywords_together_rule("pattern", ("minLength", "maxLength")),  # lengths dropped
    keywords_together_rule("format", ("minLength", "maxLength")),  # lengths dropped
    keywords_together_rule("format", ("pattern",)),  # pattern dropped
    unknown_format_rule(XGRAMMAR_SUPPORTED_FORMATS),  # any string accepted
    SchemaRule("allOf with several subschemas", lambda s: len(s.get("allOf") or ()) > 1),  # not intersected
    _with_siblings_rule("allOf"),  # siblings dropped
    _with_siblings_rule("anyOf"),  # siblings dropped
    _with_siblings_rule("oneOf"),  # siblings dropped
    _with_siblings_rule("$ref"),  # siblings dropped
    _with_siblings_rule("enum", allowed=("type",)),  # siblings other than type dropped
    _with_siblings_rule("const", allowed=("type",)),  # siblings other than type dropped
    SchemaRule("$ref to anything but a local JSON pointer", _is_non_pointer_ref),  # anything accepted
    keyword_rule("$dynamicRef"),  # anything accepted
    keyword_rule("$recursiveRef"),  # (2019-09) anything accepted
    SchemaRule("required property missing from properties", _has_required_outside_properties),  # not required
    _untyped_rule("minimum"),  # without a type xgrammar drops the keyword, and so for the rules below
    _untyped_rule("maximum"),  # any number
    _untyped_rule("exclusiveMinimum"),  # any number
    _untyped_rule("exclusiveMaximum"),  # any number
    _untyped_rule("minLength"),  # any string
    _untyped_rule("maxLength"),  # any string
    _untyped_rule("pattern"),  # any string
    _untyped_rule("format"),  # any string
    _untyped_rule("minItems", _ARRAY_INFERRED_FROM),  # any array, unless items/prefixItems imply the type
    _untyped_rule("maxItems", _ARRAY_INFERRED_FROM),  # any array, likewise
    _untyped_rule("minProperties", _OBJECT_INFERRED_FROM),  # any object, unless properties & co imply the type
    _untyped_rule("maxProperties", _OBJECT_INFERRED_FROM),  # any object, likewise
    _untyped_rule("propertyNames", _OBJECT_INFERRED_FROM),  # any object, likewise
)


class XGrammarGrammar(BaseGrammarObject):
    """One request's position in an xgrammar ``CompiledGrammar`` (a ``GrammarMatcher``); EOS is the stop token."""

    def __init__(self, compiled_grammar: xgrammar.CompiledGrammar, stop_token_ids: tuple[int, ...]) -> None:
        super().__init__()
        self.compiled_grammar = compiled_grammar
        self.stop_token_ids = stop_token_ids
        self.matcher = xgrammar.GrammarMatcher(compiled_grammar, override_stop_tokens=list(stop_token_ids))

    def accept_token(self, token: int) -> None:
        """Advance by ``token``; a no-op once terminated. Raises ``TokenRejectedError`` for a disallowed token."""
        if not self.matcher.accept_token(token) and not self.matcher.is_terminated():
            raise TokenRejectedError(token)

    def rollback(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"cannot roll back {k} tokens")
        try:
            self.matcher.rollback(k)
        except RuntimeError as e:
            raise ValueError(f"cannot roll back {k} tokens: {_xgrammar_message(e)}") from e

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Fill row ``idx`` of the int32 CPU bitmask; once terminated only the stop tokens are allowed."""
        try:  # no termination check up front: it would cost a tenth of a fill
            self.matcher.fill_next_token_bitmask(vocab_mask, idx)
            return
        except RuntimeError:
            if not self.matcher.is_terminated():
                raise
        vocab_mask[idx].zero_()
        for token in self.stop_token_ids:
            vocab_mask[idx, token // 32] |= torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self.compiled_grammar, self.stop_token_ids)

    def memory_size_bytes(self) -> int:
        return self.compiled_grammar.memory_size_bytes

    def validate_tokens(self, tokens: list[int]) -> int:
        """Length of the longest acceptable prefix of ``tokens``; the matcher ends where it started."""
        num_accepted = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            num_accepted += 1
        self.rollback(num_accepted)
        return num_accepted

    def try_jump_forward(self, tokenizer: Any) -> tuple[list[int], str] | None:
        """``([], text)`` where ``text`` is what every continuation starts with; the caller tokenises it."""
        if self.matcher.is_terminated():
            return None
        text = self.matcher.find_jump_forward_string()
        return ([], text) if text else None

    def jump_forward_str_state(self, helper: tuple[list[int], str]) -> tuple[str, int]:
        return helper[1], -1

    def jump_and_retokenize(self, old_output_ids: list[int], new_output_ids: list[int], next_state: int) -> None:
        """Move from ``old_output_ids`` to their retokenisation ``new_output_ids`` (which add the forced text).

        Rolls back to the common prefix and accepts the rest. If a new token is rejected the grammar is put
        back where it was and ``TokenRejectedError`` is raised.
        """
        common = common_prefix_length(old_output_ids, new_output_ids)
        self.rollback(len(old_output_ids) - common)
        for num_accepted, token in enumerate(new_output_ids[common:]):
            if not self.matcher.accept_token(token):
                self.rollback(num_accepted)
                for old_token in old_output_ids[common:]:
                    self.matcher.accept_token(old_token)
                raise TokenRejectedError(token, "the retokenised jump-forward text leaves the grammar")


class XGrammarGrammarBackend(BaseGrammarBackend):
    """Compiles constraints with one xgrammar ``GrammarCompiler`` over the tokenizer's vocabulary.

    Building the vocabulary decodes every token: about 0.5 s for 49k tokens and 5 s for 248k. xgrammar's own
    compile cache is off; the base class caches compiled grammars with a bound.
    """

    name = "xgrammar"

    def __init__(
        self, server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos_token_ids: list[int]
    ) -> None:
        if server_args.constrained_json_whitespace_pattern is not None:
            raise ValueError(
                "the xgrammar grammar backend cannot restrict JSON whitespace to a regex "
                "(--constrained-json-whitespace-pattern); use --constrained-json-disable-any-whitespace for "
                "compact JSON instead, or leave both unset to allow any whitespace"
            )
        super().__init__(server_args)
        self.vocabulary = tokenizer_vocabulary(tokenizer, vocab_size, eos_token_ids)
        self.tokenizer_info = xgrammar.TokenizerInfo.from_vocab_and_metadata(
            list(self.vocabulary.decoded_vocab), self.vocabulary.xgrammar_metadata
        )
        self.compiler = xgrammar.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self.any_whitespace = not server_args.constrained_json_disable_any_whitespace

    def check_json_schema(self, schema: dict[str, Any] | bool) -> None:
        schema = copy.deepcopy(schema)
        for _, subschema in iter_subschemas(schema):  # property names are strings, whether or not it is said
            names = subschema.get("propertyNames")
            if isinstance(names, dict) and "type" not in names:
                subschema["propertyNames"] = {"type": "string", **names}
        refuse_unsupported_features(schema, XGRAMMAR_UNSUPPORTED_SCHEMA_FEATURES, self.name)

    def dispatch_json(self, key_string: str) -> XGrammarGrammar:
        """xgrammar's strict mode, as SGLang: objects hold only the properties the schema lists.

        Every output still validates against the schema; the model just cannot invent keys (which would also
        make it likelier to run out of tokens before closing the object). Non-strict mode would accept the
        18 valid Github_trivial instances that have unlisted properties, but makes compiles up to 250x slower
        at 248k tokens (a GeoJSON schema: 0.1 s strict, 25 s not; measured).
        """
        compact = None if self.any_whitespace else (",", ":")
        return self._compile(
            "JSON schema",
            lambda: self.compiler.compile_json_schema(
                key_string, any_whitespace=self.any_whitespace, separators=compact
            ),
        )

    def dispatch_regex(self, key_string: str) -> XGrammarGrammar:
        return self._compile("regex", lambda: self.compiler.compile_regex(key_string))

    def dispatch_ebnf(self, key_string: str) -> XGrammarGrammar:
        return self._compile("EBNF grammar", lambda: self.compiler.compile_grammar(key_string, root_rule_name="root"))

    def dispatch_structural_tag(self, key_string: str) -> XGrammarGrammar:
        """Accepts xgrammar's ``{"type": "structural_tag", "format": ...}`` and the legacy ``structures`` form."""
        spec = _new_form_structural_tag(json.loads(key_string))
        try:
            structural_tag = StructuralTag.model_validate(spec)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise GrammarSpecError(f"invalid structural tag at {where}: {_bounded(first['msg'])}") from e
        self._check_structural_tag_contents(spec["format"], "/format")
        return self._compile("structural tag", lambda: self.compiler.compile_structural_tag(structural_tag))

    def _compile(self, what: str, compile_: Any) -> XGrammarGrammar:
        try:
            compiled = compile_()
        except RuntimeError as e:
            raise GrammarSpecError(f"xgrammar cannot compile the {what}: {_xgrammar_message(e)}") from e
        return XGrammarGrammar(compiled, self.vocabulary.stop_token_ids)

    def _check_structural_tag_contents(self, node: Any, pointer: str) -> None:
        """Vet the JSON schemas a structural tag embeds, and the token ids it names, as a request's own."""
        if isinstance(node, list):
            for index, item in enumerate(node):
                self._check_structural_tag_contents(item, f"{pointer}/{index}")
            return
        if not isinstance(node, dict):
            return
        if node.get("type") == "json_schema":
            try:
                check_schema_is_valid(node.get("json_schema"))
                self.check_json_schema(node["json_schema"])
            except GrammarSpecError as e:
                raise GrammarSpecError(f"in the structural tag's JSON schema at {pointer}: {e}") from e
            return
        token, decoded = node.get("token") if node.get("type") == "token" else None, self.vocabulary.decoded_vocab
        if isinstance(token, int) and (not 0 <= token < len(decoded) or decoded[token] == b""):  # blank: special
            raise GrammarSpecError(
                f"the structural tag requires token {token} at {pointer}, which is not a regular token "
                "(special, padding or out of range) and so is never allowed"
            )
        for key, value in node.items():
            self._check_structural_tag_contents(value, f"{pointer}/{key}")


def _new_form_structural_tag(spec: dict[str, Any]) -> dict[str, Any]:
    """The structural tag as xgrammar's ``StructuralTag`` JSON, converting the legacy ``structures`` form."""
    if spec.get("type", "structural_tag") != "structural_tag":
        raise GrammarSpecError(f"a structural tag has type 'structural_tag', not {str(spec['type'])[:60]!r}")
    if "format" in spec:
        return spec
    if "structures" not in spec or "triggers" not in spec:
        raise GrammarSpecError(
            "a structural tag needs 'format' (xgrammar's structural tag) or 'structures' and 'triggers' "
            "(the legacy form)"
        )
    structures = spec["structures"]
    if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
        raise GrammarSpecError("the structural tag's 'structures' must be a list of objects")
    tags = []
    for index, structure in enumerate(structures):
        missing = [field for field in ("begin", "schema", "end") if field not in structure]
        if missing:
            raise GrammarSpecError(f"structural tag structure {index} lacks {', '.join(missing)}")
        content = {"type": "json_schema", "json_schema": structure["schema"]}
        tags.append({"type": "tag", "begin": structure["begin"], "content": content, "end": structure["end"]})
    return {
        "type": "structural_tag",
        "format": {"type": "triggered_tags", "triggers": spec["triggers"], "tags": tags},
    }


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")
_MAX_MESSAGE_CHARS = 300


def _xgrammar_message(error: Exception) -> str:
    """xgrammar's error text without its log prefix (time, C++ file, failed check), first line, bounded."""
    lines = str(error).strip().splitlines()
    return _bounded(_XGRAMMAR_LOG_PREFIX.sub("", lines[0]) if lines else type(error).__name__)


def _bounded(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."
