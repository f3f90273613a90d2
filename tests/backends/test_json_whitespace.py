"""The default JSON whitespace on every backend (README: "JSON whitespace"): what a reader would write passes
(compact, ``json.dumps``'s separators, pretty-printing indented up to 20 columns), blank lines and longer runs do not,
so a model cannot wander off into whitespace until its token limit. outlines bounds no indentation (its index grows
with the bound). The same holds for JSON inside a structural tag, the form of tool calls beside an answer format."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import accepts_text, compile_grammar

CITY = {"name": "Paris", "sights": ["Louvre", "Orsay"]}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "sights": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "sights"],
    "additionalProperties": False,
}
TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<city>",
        "content": {"type": "json_schema", "json_schema": SCHEMA},
        "end": "</city>",
    },
}


def _indented(columns: str) -> str:
    return "{\n" + columns + '"name": "Paris",\n' + columns + '"sights": []\n}'


# text, accepted by xgrammar and llguidance, accepted by outlines
TEXTS = [
    (json.dumps(CITY, separators=(",", ":")), True, True),
    (json.dumps(CITY), True, True),
    (json.dumps(CITY, indent=2), True, True),
    (json.dumps(CITY, indent="\t").replace("\n", "\r\n"), True, True),
    (_indented(" " * 20), True, True),
    (_indented("\t" * 20), True, True),
    (_indented(" " * 21), False, True),
    (_indented(" " * 8 + "\t" * 13), False, True),
    ('{\n\n  "name": "Paris", "sights": []}', False, False),
    ('{"name": "Paris",  \n  \n"sights": []}', False, False),
    ('{\n    "name"\n\n:\n\n"Paris"\n\n, "sights": []}', False, False),
    ('{"name": "Paris", "sights": []\n\n}', False, False),
]
"""The issue's example among them: ``'{\\n    "name"\\n\\n:\\n\\n"Paris"\\n\\n}'``."""


CONSTRAINTS = [
    ("xgrammar", "json", SCHEMA),
    ("xgrammar", "structural_tag", TAG),
    ("llguidance", "json", SCHEMA),
    ("llguidance", "structural_tag", TAG),
    ("outlines", "json", SCHEMA),
]
"""Each backend's JSON constraints (outlines compiles no structural tags)."""


@pytest.mark.parametrize(("backend_name", "kind", "spec"), CONSTRAINTS, ids=lambda value: None)
@pytest.mark.parametrize(("text", "is_bounded_reader_text", "is_outlines_text"), TEXTS)
def test_default_whitespace_is_what_a_reader_writes(
    build_backend: BackendBuilder,
    smollm2_tokenizer: TokenizerSetup,
    backend_name: str,
    kind: str,
    spec: Any,
    text: str,
    is_bounded_reader_text: bool,
    is_outlines_text: bool,
) -> None:
    grammar = compile_grammar(build_backend(backend_name, smollm2_tokenizer), kind, spec)
    wrapped = f"<city>{text}</city>" if kind == "structural_tag" else text
    expected = is_outlines_text if backend_name == "outlines" else is_bounded_reader_text
    assert accepts_text(grammar, smollm2_tokenizer, wrapped) is expected
