"""``oneOf`` is refused unless its branches are provably disjoint: engines that read it as ``anyOf`` would accept
values valid under several branches. The rule must never call overlapping branches disjoint."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from sglang_constrained.schema.features import one_of_overlap_rule

DEFS = {"$defs": {"int": {"type": "integer"}, "str": {"type": "string"}, "num": {"type": "number"}}}
CIRCLE = {"type": "object", "properties": {"k": {"const": "circle"}}, "required": ["k"]}
SQUARE = {"type": "object", "properties": {"k": {"const": "square"}}, "required": ["k"]}

# schema, whether the rule refuses it, a value valid under two branches (None where the rule refuses branches it
# cannot prove disjoint: it is conservative, never the other way)
CASES: list[tuple[dict[str, Any], bool, Any]] = [
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, False, None),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, True, 1),
    ({"oneOf": [{"type": ["string", "null"]}, {"type": "null"}]}, True, None),
    ({"oneOf": [{"const": 1}, {"const": 1.0}]}, True, 1),
    ({"oneOf": [{"enum": ["a", "b"]}, {"const": "c"}]}, False, None),
    ({**DEFS, "oneOf": [{"$ref": "#/$defs/int"}, {"$ref": "#/$defs/str"}]}, False, None),
    ({**DEFS, "oneOf": [{"$ref": "#/$defs/int"}, {"$ref": "#/$defs/num"}]}, True, 2),
    ({"oneOf": [CIRCLE, SQUARE]}, False, None),
    ({"oneOf": [CIRCLE, {**SQUARE, "required": []}]}, True, None),  # disjoint, but not provably so here
    ({"oneOf": [{"properties": CIRCLE["properties"], "required": ["k"]}, SQUARE]}, True, None),  # likewise
    ({"oneOf": [{"minLength": 1}, {"maxLength": 3}]}, True, "ab"),
    ({"oneOf": [{"type": "string"}]}, False, None),
]


@pytest.mark.parametrize(("schema", "refused", "shared_value"), CASES)
def test_one_of_overlap(schema: dict[str, Any], refused: bool, shared_value: Any) -> None:
    assert one_of_overlap_rule(schema).applies(schema) is refused
    if refused and shared_value is not None:
        validator = jsonschema.Draft202012Validator(schema)
        rest = {key: value for key, value in schema.items() if key != "oneOf"}
        branches = [{**rest, **branch} for branch in schema["oneOf"]]
        assert sum(jsonschema.Draft202012Validator(b).is_valid(shared_value) for b in branches) >= 2
        assert not validator.is_valid(shared_value)
