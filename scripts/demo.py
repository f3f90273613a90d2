"""The main job: start the scheduler on the embedded SmolLM2-135M-Instruct, serve concurrent constrained requests,
check every output against its constraint, and shut down cleanly.

    python scripts/demo.py [--grammar-backend xgrammar|llguidance|outlines]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from scheduler.client import make_request
from scheduler.io_struct import GenerateOutput
from scheduler.server_args import GrammarArgs, ModelArgs
from scheduler.testing.process import SchedulerProcess
from sglang_constrained.backends.registry import create_grammar_backend
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.conformance import compile_grammar
from sglang_constrained.testing.text_acceptance import walk_tokens
from sglang_constrained.testing.tokenizer_setups import load_tokenizer_setup

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    },
    "required": ["name", "age", "city"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PETS_EBNF = 'root ::= pet ", " pet " and " pet\npet ::= "cat" | "dog" | "parrot" | "rabbit"'
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
WEATHER_TAG = {"structures": [{"begin": "<f=weather>", "schema": WEATHER, "end": "</f>"}], "triggers": ["<f="]}


@dataclass
class DemoRequest:
    label: str
    prompt: str
    params: dict[str, Any]
    check: Callable[[GenerateOutput], bool]


def build_requests(accepts: Callable[[str, Any, GenerateOutput], bool]) -> list[DemoRequest]:
    def ask(label: str, prompt: str, check: Callable[[GenerateOutput], bool], **params: Any) -> DemoRequest:
        return DemoRequest(label, prompt, {"temperature": 0, "max_new_tokens": 96, **params}, check)

    return [
        ask("json_schema", "Invent a person as JSON.", lambda o: _validates(o.text, PERSON), json_schema=PERSON),
        ask("json_schema again", "Invent a person as JSON.", lambda o: _validates(o.text, PERSON), json_schema=PERSON),
        ask("regex", "What is your phone number?", lambda o: bool(re.fullmatch(PHONE, o.text)), regex=PHONE),
        ask("ebnf", "Name three pets.", lambda o: accepts("ebnf", PETS_EBNF, o), ebnf=PETS_EBNF),
        ask("choice", "Is the sky green?", lambda o: o.text in ("yes", "no"), choice=["yes", "no"]),
        ask(
            "structural_tag",
            "Call <f=weather> for Paris.",
            lambda o: accepts("structural_tag", WEATHER_TAG, o),
            structural_tag=WEATHER_TAG,
        ),
        ask(
            "json_object",
            "Describe a cat in JSON: name, color and age only.",
            lambda o: _is_object(o.text),
            json_object=True,
        ),
        ask("free", "Tell me a fun fact about octopuses.", lambda o: bool(o.text.strip()), max_new_tokens=40),
        ask(
            "invalid schema",
            "hi",
            lambda o: (
                o.finish_reason is not None
                and (o.finish_reason.message or "").startswith("Failed to compile json grammar")
            ),
            json_schema={"type": "strin"},
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grammar-backend", default="xgrammar")
    options = parser.parse_args()
    print(f"starting the scheduler (--grammar-backend {options.grammar_backend}); the very first start converts")
    print("the embedded GGUF model and tokenizer once (about a minute), later starts take seconds ...", flush=True)
    server = SchedulerProcess("--grammar-backend", options.grammar_backend, "--max-running-requests", "16")
    try:
        status = server.wait_until_ready()
        print(f"serving {status.model} (vocab {status.vocab_size}) on {server.endpoint}\n", flush=True)
        setup = load_tokenizer_setup("smollm2", ModelArgs().cache_path)
        checker = create_grammar_backend(GrammarArgs(), setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
        assert checker is not None

        def accepts(kind: str, spec: Any, output: GenerateOutput) -> bool:
            ids = [t for t in output.token_ids if t not in setup.eos_token_ids]
            grammar = compile_grammar(checker, make_grammar_key(kind, spec))
            return walk_tokens(grammar, ids, setup.vocab_size, setup.eos_token_ids).is_accepted

        demo = build_requests(accepts)
        chats = [[{"role": "user", "content": d.prompt}] for d in demo]
        requests = [make_request(messages=chat, sampling_params=d.params) for chat, d in zip(chats, demo, strict=True)]
        start = time.perf_counter()
        with server.client() as client:
            outputs = client.generate_batch(requests[:1])  # the first compile, so that the repeat is a cache hit
            outputs += client.generate_batch(requests[1:])
        elapsed = time.perf_counter() - start
        num_valid = 0
        for item, output in zip(demo, outputs, strict=True):
            is_valid = item.check(output)
            num_valid += is_valid
            reason = output.finish_reason
            detail = reason.message if reason is not None and reason.message else reason.type if reason else "?"
            hit = " (grammar cache hit)" if output.grammar_cache_hit else ""
            print(f"{'OK ' if is_valid else 'BAD'} {item.label:<18} {detail}{hit}")
            print(f"    {output.text!r}\n")
        num_tokens = sum(o.usage.completion_tokens for o in outputs)
        print(f"{num_valid}/{len(demo)} outputs as expected; {num_tokens} tokens in {elapsed:.1f} s")
        checker.shutdown()
        return 0 if num_valid == len(demo) else 1
    finally:
        exit_code = server.stop()
        print(f"scheduler stopped (exit code {exit_code})")


def _validates(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


if __name__ == "__main__":
    sys.exit(main())
