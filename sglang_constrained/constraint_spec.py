"""Constraint kinds and keys: the one table of kinds, how a request's constraint becomes a cache key and, at compile
time, a spec a backend compiles.

``CONSTRAINT_KIND_TABLE`` has an entry per kind: the request field that carries it and its names over HTTP, what its
spec is (``SpecForm``), how it is lowered to a kind a backend compiles (choice to regex, json_object to a JSON schema)
and the backend method that compiles it. The request messages (``scheduler.io_struct``), the HTTP frontend
(``scheduler.http.constraint_fields``) and the backends' dispatch read it, so a new kind is one entry here and its
compile method in each backend (and the typed request fields that carry it, which a unit test holds to this table).

A key is ``(kind, spec)``. JSON specs are canonicalised JSON text so that the same constraint written with other
spacing shares a cache entry; lowered kinds are lowered right before dispatch, so every backend that compiles
``regex`` and ``json`` compiles ``choice`` and ``json_object`` too. Imports nothing heavy (no torch, no engine): the
HTTP frontend reads it.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import jsonschema
import jsonschema_rs

from sglang_constrained.errors import GrammarSpecError

GrammarKey = tuple[str, str]

__all__ = [
    "CONSTRAINT_KINDS",
    "CONSTRAINT_KIND_TABLE",
    "MAX_OBJECTS_FOR_BEST_ERROR",
    "MAX_SPEC_DEPTH",
    "ConstraintKind",
    "GrammarKey",
    "GrammarSpecError",
    "Lowering",
    "SpecForm",
    "check_schema_is_valid",
    "choices_to_regex",
    "compile_method",
    "constraint_kind",
    "escape_regex_literal",
    "lower_constraint",
    "make_grammar_key",
    "nesting_depth",
]

MAX_OBJECTS_FOR_BEST_ERROR = 2_000
"""Objects in an invalid JSON schema up to which jsonschema picks the error its message names (~0.4 ms an object:
a 20,000-property schema with one bad type took ~8 s, the spec-size limit's 1 MB ~16 s, of a compile thread)."""

MAX_SPEC_DEPTH = 100
"""Deepest nesting of objects and arrays a JSON spec may have; every backend compiles 100 levels, and the schema
checks recurse about ten Python frames per level (150 levels ran out of stack)."""

_REGEX_METACHARACTERS = frozenset("\\.^$|?*+()[]{}")
_REGEX_NAMED_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


class SpecForm(enum.Enum):
    """What a kind's spec is: how it is keyed and the checks every backend shares before compiling it."""

    TEXT = "text"
    """A string in the kind's own syntax, keyed as written; refused when blank."""
    JSON_SCHEMA = "json_schema"
    """A JSON schema (an object or a boolean, or its text), keyed canonically; checked against the meta-schema and
    by the backend (``prepare_json_schema``)."""
    JSON_OBJECT = "json_object"
    """A JSON object or its text, keyed canonically."""
    STRING_LIST = "string_list"
    """A non-empty list of strings, keyed as its JSON text."""
    FLAG = "flag"
    """True or absent: the kind takes no spec (keyed as ``""``)."""

    @property
    def is_json(self) -> bool:
        """Keyed as canonical JSON text, its nesting bounded by ``MAX_SPEC_DEPTH``."""
        return self in (SpecForm.JSON_SCHEMA, SpecForm.JSON_OBJECT)


class Lowering(NamedTuple):
    """How a kind is compiled as another: ``convert`` turns its key's spec into a spec of kind ``to``."""

    to: str
    convert: Callable[[str], str]


@dataclass(frozen=True)
class ConstraintKind:
    """One kind of constraint: its names, its spec, and how it is compiled."""

    name: str
    """The key's kind (``GrammarKey[0]``); the label in metrics, logs and messages."""
    field: str
    """The ``SamplingParams`` field (SGLang's name) that carries it."""
    form: SpecForm
    noun: str
    """What its spec is called in messages (``"the JSON schema is not valid JSON"``)."""
    compile_method: str | None = None
    """The ``BaseGrammarBackend`` method that compiles its spec; None for a kind lowered to another."""
    lowering: Lowering | None = None
    http_fields: tuple[str, ...] = ()
    """Its names at the top level of an OpenAI-style body: SGLang's, and vLLM's legacy ``guided_*``."""
    structured_outputs_field: str | None = None
    """Its name in vLLM's ``structured_outputs``."""
    response_format: str | None = None
    """Its ``type`` in OpenAI's ``response_format``."""

    def is_requested(self, value: Any) -> bool:
        """Whether a request field's ``value`` asks for this kind (a flag only when true; ``json: false`` is a
        schema)."""
        return value is True if self.form is SpecForm.FLAG else value is not None

    def check_size(self, spec: str, max_spec_bytes: int) -> None:
        """The spec-size rule: a key's spec (the canonical text of a JSON spec) is at most ``max_spec_bytes`` bytes
        of UTF-8; raises ``GrammarSpecError`` without echoing the spec."""
        num_bytes = len(spec.encode("utf-8"))
        if num_bytes > max_spec_bytes:
            raise GrammarSpecError(
                f"the {self.field} constraint is {num_bytes:,} bytes, over the limit of {max_spec_bytes:,} bytes "
                "(--grammar-max-spec-bytes)"
            )


def _lower_choices(spec: str) -> str:
    return choices_to_regex(_parse_json(spec, "choice list"))


def _any_json_object(_spec: str) -> str:
    return _canonical_json({"type": "object"})


CONSTRAINT_KIND_TABLE: tuple[ConstraintKind, ...] = (
    ConstraintKind(
        "json",
        field="json_schema",
        form=SpecForm.JSON_SCHEMA,
        noun="JSON schema",
        compile_method="dispatch_json",
        http_fields=("json_schema", "guided_json"),
        structured_outputs_field="json",
        response_format="json_schema",
    ),
    ConstraintKind(
        "regex",
        field="regex",
        form=SpecForm.TEXT,
        noun="regex spec",
        compile_method="dispatch_regex",
        http_fields=("regex", "guided_regex"),
        structured_outputs_field="regex",
    ),
    ConstraintKind(
        "ebnf",
        field="ebnf",
        form=SpecForm.TEXT,
        noun="ebnf spec",
        compile_method="dispatch_ebnf",
        http_fields=("ebnf", "guided_grammar"),
        structured_outputs_field="grammar",
    ),
    ConstraintKind(
        "structural_tag",
        field="structural_tag",
        form=SpecForm.JSON_OBJECT,
        noun="structural tag",
        compile_method="dispatch_structural_tag",
        structured_outputs_field="structural_tag",
        response_format="structural_tag",
    ),
    ConstraintKind(
        "choice",
        field="choice",
        form=SpecForm.STRING_LIST,
        noun="choice list",
        lowering=Lowering("regex", _lower_choices),
        http_fields=("guided_choice",),
        structured_outputs_field="choice",
    ),
    ConstraintKind(
        "json_object",
        field="json_object",
        form=SpecForm.FLAG,
        noun="JSON object flag",
        lowering=Lowering("json", _any_json_object),
        structured_outputs_field="json_object",
        response_format="json_object",
    ),
)
"""Every constraint kind, in the order a request's fields are read (the first one set is its constraint)."""
CONSTRAINT_KINDS = tuple(kind.name for kind in CONSTRAINT_KIND_TABLE)
_KINDS_BY_NAME = {kind.name: kind for kind in CONSTRAINT_KIND_TABLE}


def constraint_kind(name: str) -> ConstraintKind:
    """The table's entry for kind ``name``; raises ``GrammarSpecError`` (a ``ValueError``) for an unknown one."""
    kind = _KINDS_BY_NAME.get(name)
    if kind is None:
        raise GrammarSpecError(f"unknown constraint kind {name!r}; expected one of {CONSTRAINT_KINDS}")
    return kind


def compile_method(kind: str) -> str:
    """The name of the ``BaseGrammarBackend`` method that compiles a spec of ``kind``, a kind ``lower_constraint``
    returns (one that is not lowered further)."""
    method = constraint_kind(kind).compile_method
    if method is None:
        raise GrammarSpecError(f"a {kind} constraint is lowered to another kind before it is compiled")
    return method


def make_grammar_key(kind: str, spec: Any) -> GrammarKey:
    """The cache key for a constraint of ``kind`` (one of ``CONSTRAINT_KINDS``).

    ``spec`` is a string, or for a JSON kind (``json``, ``structural_tag``) also a dict, for ``choice`` a list of
    strings, and ignored for ``json_object``. Text that is not valid JSON is kept as it is, so that compiling it
    reports the parse error.
    """
    form = constraint_kind(kind).form
    if form is SpecForm.FLAG:
        return kind, ""
    if form is SpecForm.STRING_LIST:
        if not isinstance(spec, list | tuple) or not all(isinstance(c, str) for c in spec):
            raise ValueError(f"a {kind} constraint is a list of strings")
        return kind, json.dumps(list(spec), ensure_ascii=False)
    if form.is_json:
        if isinstance(spec, dict | bool):
            _check_depth(kind, spec)
            return kind, _canonical_json(spec)
        if isinstance(spec, str):
            try:
                parsed = json.loads(spec)
            except json.JSONDecodeError:
                return kind, spec
            except RecursionError:
                raise GrammarSpecError(_too_deep(kind)) from None
            _check_depth(kind, parsed)
            return kind, _canonical_json(parsed)
    if not isinstance(spec, str):
        raise ValueError(f"a {kind} constraint is a string, not {type(spec).__name__}")
    return kind, spec


def lower_constraint(
    key: GrammarKey, max_spec_bytes: int, prepare_json_schema: Callable[[Any], Any]
) -> tuple[str, str]:
    """``(kind to compile, spec)`` for a key, after the checks every backend shares (the spec-size rule among them:
    ``ConstraintKind.check_size``, which the HTTP frontend applies too, before a request is sent); raises
    ``GrammarSpecError``.

    ``prepare_json_schema`` is the backend's: it refuses schema features the backend would silently ignore and
    returns the schema to compile.
    """
    kind = constraint_kind(key[0])
    spec = key[1]
    kind.check_size(spec, max_spec_bytes)
    if kind.lowering is not None:
        return kind.lowering.to, kind.lowering.convert(spec)
    if kind.form is SpecForm.JSON_SCHEMA:
        schema = _parse_json(spec, kind.noun)
        check_schema_is_valid(schema)
        return kind.name, _canonical_json(prepare_json_schema(schema))
    if kind.form is SpecForm.JSON_OBJECT:
        if not isinstance(_parse_json(spec, kind.noun), dict):
            raise GrammarSpecError(f"a {kind.noun} must be a JSON object")
    elif not spec.strip():
        raise GrammarSpecError(f"the {kind.noun} is empty")
    return kind.name, spec


def choices_to_regex(choices: Any) -> str:
    """An alternation that matches exactly one of ``choices``, each escaped for every backend's regex dialect.

    Longer options come first: outlines-core's automaton follows leftmost-first semantics, under which ``Java``
    placed before ``JavaScript`` would end the match at ``Java`` and never allow the longer option.
    """
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarSpecError("a choice constraint must be a non-empty list of strings")
    return "|".join(f"({escape_regex_literal(c)})" for c in sorted(choices, key=len, reverse=True))


def escape_regex_literal(text: str) -> str:
    """Escape ``text`` so that the xgrammar, llguidance and outlines-core regex dialects all match it literally.

    Only true metacharacters are escaped (xgrammar warns on escapes such as ``\\#``); other control
    characters become ``\\uHHHH`` (xgrammar reads every hex digit after ``\\x``: ``\\x01f`` would be U+001F); non-ASCII
    text stays literal.
    """
    pieces = []
    for char in text:
        if char in _REGEX_METACHARACTERS:
            pieces.append("\\" + char)
        elif char in _REGEX_NAMED_ESCAPES:
            pieces.append(_REGEX_NAMED_ESCAPES[char])
        elif ord(char) < 0x20 or ord(char) == 0x7F:
            pieces.append(f"\\u{ord(char):04x}")
        else:
            pieces.append(char)
    return "".join(pieces)


def check_schema_is_valid(schema: Any) -> None:
    """Refuse a schema that breaks the JSON Schema meta-schema, naming the keyword and where it is.

    The meta-schema of the draft its ``$schema`` names (2020-12 without one, or with one jsonschema does not know;
    a ``$schema`` that is not a string is checked by 2020-12's, which refuses it). jsonschema-rs checks first: it
    takes ~0.3 us a subschema where jsonschema takes ~0.4 ms (2020-12's ``$dynamicRef``s: a 20,000-property schema
    took 7-10 s of the compile thread); jsonschema decides only a schema jsonschema-rs refuses, and names its most
    relevant error (``best_match``), but for a schema of over ``MAX_OBJECTS_FOR_BEST_ERROR`` objects, whose error
    is jsonschema-rs's first.
    """
    if not isinstance(schema, dict | bool):
        raise GrammarSpecError(f"a JSON schema must be an object or a boolean, not {_json_type_name(schema)}")
    validator_class = _meta_schema_validator_class(schema)
    fast_check = _fast_meta_schema_check(validator_class)
    if fast_check is not None:
        if fast_check.is_valid(schema):
            return
        if _count_objects(schema) > MAX_OBJECTS_FOR_BEST_ERROR:
            first = next(iter(fast_check.iter_errors(schema)))
            raise GrammarSpecError(_meta_schema_error(list(first.instance_path), str(first.schema_path[-1])))
    error = jsonschema.exceptions.best_match(validator_class(validator_class.META_SCHEMA).iter_errors(schema))
    if error is not None:
        raise GrammarSpecError(_meta_schema_error(list(error.path), error.validator))


def _meta_schema_error(path: list[Any], keyword: str) -> str:
    return (
        f"invalid JSON schema at {_json_pointer(path)}: the value of {path[-1] if path else 'the schema'!r} fails "
        f"the meta-schema's {keyword!r} rule"
    )


def _meta_schema_validator_class(schema: dict[str, Any] | bool) -> Any:
    if isinstance(schema, dict) and not isinstance(schema.get("$schema", ""), str):
        return jsonschema.Draft202012Validator
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


@functools.cache
def _fast_meta_schema_check(validator_class: Any) -> Any:
    """jsonschema-rs's validator of ``validator_class``'s meta-schema, or None for a draft it does not know (3).
    Formats are not asserted, as jsonschema does not: asserted, a draft-07 ``$id`` of ``^a+$`` was refused."""
    try:
        return jsonschema_rs.validator_for(validator_class.META_SCHEMA, validate_formats=False, offline=True)
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError):
        return None


def _containers(value: Any) -> Iterator[tuple[dict[str, Any] | list[Any], int]]:
    """Every object and array in ``value``, itself included, with how deep it is (1 for ``value``); iterative, for
    any depth."""
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            yield item, level
            stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))


def _count_objects(value: Any) -> int:
    return sum(isinstance(item, dict) for item, _ in _containers(value))


def nesting_depth(value: Any) -> int:
    """How many objects and arrays deep ``value`` nests (0 for a scalar)."""
    return max((level for _, level in _containers(value)), default=0)


def _check_depth(kind: str, spec: Any) -> None:
    depth = nesting_depth(spec)
    if depth > MAX_SPEC_DEPTH:
        raise GrammarSpecError(_too_deep(kind, depth))


def _too_deep(kind: str, depth: int | None = None) -> str:
    levels = f"{depth} levels deep" if depth is not None else "too deeply to parse"
    noun = constraint_kind(kind).noun
    return f"the {noun} nests objects and arrays {levels}; at most {MAX_SPEC_DEPTH} levels are allowed"


def _json_pointer(path: Any) -> str:
    parts = [str(p).replace("~", "~0").replace("/", "~1") for p in path]
    return "/" + "/".join(parts) if parts else "/ (the root)"


def _json_type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def _parse_json(spec: str, what: str) -> Any:
    try:
        return json.loads(spec)
    except json.JSONDecodeError as e:
        raise GrammarSpecError(f"the {what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from e


def _canonical_json(value: Any) -> str:
    """Compact JSON with key order kept (the order of ``properties`` is the order of the output)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
