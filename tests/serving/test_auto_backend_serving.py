"""``--grammar-backend auto`` (the default) in the scheduler on the embedded model: one batch whose constraints go to
different backends, each output valid, the choice in the log."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from scheduler.client import make_request
from scheduler.testing.process import SchedulerProcess
from tests.helpers import PERSON_SCHEMA, PRODUCT_SCHEMA

pytestmark = pytest.mark.model

PHONE_REGEX = r"\(\d{3}\) \d{3}-\d{4}"


def ask(prompt: str, **constraint: object) -> dict[str, object]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "sampling_params": {**constraint, "temperature": 0, "max_new_tokens": 96},
    }


def test_auto_serves_one_batch_across_backends(one_rank_server: SchedulerProcess) -> None:
    """The default backend (``auto``)."""
    requests = [
        ask("Describe a person as JSON with a name and an age.", json_schema=PERSON_SCHEMA),
        ask("Give a product code and its price as JSON.", json_schema=PRODUCT_SCHEMA),
        ask("What is your phone number?", regex=PHONE_REGEX),
    ]
    with one_rank_server.client() as client:
        person, product, phone = client.generate_batch([make_request(**request) for request in requests])
    status = one_rank_server.status()
    log = one_rank_server.log()
    assert status.grammar_backend == "auto"
    for output in (person, product, phone):
        assert output.finish_reason is not None and output.finish_reason.type == "stop", output
    jsonschema.validate(json.loads(person.text), PERSON_SCHEMA)
    jsonschema.validate(json.loads(product.text), PRODUCT_SCHEMA)
    assert re.fullmatch(PHONE_REGEX, phone.text)
    assert "auto chose llguidance for a json constraint because xgrammar refused: feature 'pattern together" in log
