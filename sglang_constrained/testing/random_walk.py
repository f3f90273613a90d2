"""Random walks through a grammar's own masks: soundness proven by what the mask allows, not by guessed instances.

A walk fills the mask, samples one of the tokens it allows (biased toward tokens that hold control characters,
quotes, backslashes and non-ASCII bytes, where escaping holes hide), accepts it, and repeats; after a while it is
biased toward closing (a stop token when allowed, else tokens made of closing characters, else the shortest
tokens). A finished walk's text is then judged by an independent oracle: ``json.loads`` (strict) and jsonschema for
JSON, ``re.fullmatch`` for regexes, membership for choices. Any text the mask let through that the oracle refuses
is a hole in the grammar. Every step also checks that no special token (other than a stop token) and no padding
id is ever allowed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema
import torch

from sglang_constrained.base_grammar_backend import BaseGrammarObject
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from sglang_constrained.vocabulary import tokenizer_vocabulary
from triton_ops.bitmask_format import allocate_bitmask, unpack_bitmask

CONTROL_WEIGHT = 50.0
QUOTE_WEIGHT = 20.0
BACKSLASH_WEIGHT = 20.0
NON_ASCII_WEIGHT = 5.0
CLOSING_BYTES = frozenset(b'"}]')

Judge = Callable[[str], str | None]
"""Returns why a finished walk's text is not a valid output, or None when it is."""


@dataclass(frozen=True)
class TokenTraits:
    """Per-token facts of one tokenizer the walks sample with (computed once per tokenizer)."""

    decoded: tuple[bytes, ...]
    explore_weights: torch.Tensor
    closing: torch.Tensor
    lengths: torch.Tensor


@dataclass(frozen=True)
class WalkResult:
    """``problem`` says what broke (the oracle's reason, or an invariant); ``finished`` means a stop token was taken."""

    finished: bool
    text: str | None
    num_tokens: int
    problem: str | None = None


_TRAITS: dict[tuple[str, int], TokenTraits] = {}


def token_traits(setup: TokenizerSetup) -> TokenTraits:
    """The setup's traits, computed on first use (decoding the vocabulary takes 0.5-5 s)."""
    key = (setup.name, setup.vocab_size)
    if key not in _TRAITS:
        _TRAITS[key] = _traits(setup)
    return _TRAITS[key]


def _traits(setup: TokenizerSetup) -> TokenTraits:
    decoded = tokenizer_vocabulary(setup.tokenizer, setup.vocab_size, setup.eos_token_ids).decoded_vocab
    weights, closing, lengths = [], [], []
    for token_bytes in decoded:
        weight = 1.0
        if any(byte < 0x20 for byte in token_bytes):
            weight *= CONTROL_WEIGHT
        if b'"' in token_bytes:
            weight *= QUOTE_WEIGHT
        if b"\\" in token_bytes:
            weight *= BACKSLASH_WEIGHT
        if any(byte >= 0x80 for byte in token_bytes):
            weight *= NON_ASCII_WEIGHT
        weights.append(weight)
        closing.append(bool(token_bytes) and set(token_bytes) <= CLOSING_BYTES)
        lengths.append(len(token_bytes) or 1_000)
    return TokenTraits(
        decoded=decoded,
        explore_weights=torch.tensor(weights, dtype=torch.float64),
        closing=torch.tensor(closing),
        lengths=torch.tensor(lengths),
    )


def random_walk(
    grammar: BaseGrammarObject,
    setup: TokenizerSetup,
    generator: torch.Generator,
    max_tokens: int = 160,
    explore_tokens: int = 40,
) -> WalkResult:
    """Walk ``grammar`` (which advances) until it takes a stop token or ``max_tokens`` pass; see the module doc."""
    traits = token_traits(setup)
    vocab_size = setup.vocab_size
    stops = torch.tensor(setup.eos_token_ids)
    forbidden = torch.zeros(vocab_size, dtype=torch.bool)
    forbidden[list(setup.forbidden_token_ids)] = True
    mask = allocate_bitmask(1, vocab_size)
    output = bytearray()
    for step in range(max_tokens):
        mask.fill_(0)
        grammar.fill_vocab_mask(mask, 0)
        allowed = unpack_bitmask(mask[0], vocab_size)
        if bool((allowed & forbidden).any()):
            leaked = (allowed & forbidden).nonzero().flatten()[:5].tolist()
            return WalkResult(False, None, step, f"the mask allows special or padding ids {leaked}")
        if not bool(allowed.any()):
            return WalkResult(False, None, step, "the mask allows no token: the walk cannot go on")
        token = _choose(allowed, traits, stops, step >= explore_tokens, generator)
        grammar.accept_token(token)
        if token in setup.eos_token_ids:
            return _finished(bytes(output), step)
        output += traits.decoded[token]
        if grammar.is_terminated():
            return _finished(bytes(output), step + 1)
    return WalkResult(False, None, max_tokens)


def _choose(
    allowed: torch.Tensor, traits: TokenTraits, stops: torch.Tensor, closing: bool, generator: torch.Generator
) -> int:
    if closing:
        allowed_stops = stops[allowed[stops]]
        if len(allowed_stops):
            return int(allowed_stops[0])
        closers = allowed & traits.closing
        if bool(closers.any()):
            return _sample(closers.double(), generator)
        shortest = traits.lengths.masked_fill(~allowed, 1 << 30).min()
        return _sample((allowed & (traits.lengths == shortest)).double(), generator)
    return _sample(traits.explore_weights * allowed, generator)


def _sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(weights, 1, generator=generator))


def _finished(output: bytes, num_tokens: int) -> WalkResult:
    try:
        text = output.decode("utf-8")
    except UnicodeDecodeError as e:
        return WalkResult(True, None, num_tokens, f"the output is not UTF-8: {e}")
    return WalkResult(True, text, num_tokens)


def judge_walk(result: WalkResult, judge: Judge) -> WalkResult:
    """The walk with the oracle's verdict on its text (unfinished or already broken walks are left as they are)."""
    if not result.finished or result.problem is not None or result.text is None:
        return result
    problem = judge(result.text)
    return result if problem is None else WalkResult(True, result.text, result.num_tokens, problem)


def json_judge(schema: Any) -> Judge:
    """Strict JSON (no raw control characters in strings, no NaN or Infinity) that validates against ``schema``."""
    validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)

    def judge(text: str) -> str | None:
        try:
            instance = json.loads(text, parse_constant=_refuse_constant)
        except ValueError as e:
            return f"not strict JSON: {e}"
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
        return None if error is None else f"fails the schema at {list(error.absolute_path)}: {error.message[:200]}"

    return judge


def regex_judge(pattern: str) -> Judge:
    compiled = re.compile(pattern)
    return lambda text: None if compiled.fullmatch(text) else "does not match the regex"


def choice_judge(choices: list[str]) -> Judge:
    return lambda text: None if text in choices else "is not one of the choices"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
