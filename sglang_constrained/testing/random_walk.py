"""Random walks through a grammar's own masks: soundness proven by what the mask allows, not by guessed instances.

A walk fills the mask, samples one of the tokens it allows (biased toward tokens that hold control characters,
quotes, backslashes and non-ASCII bytes, where escaping holes hide, and most of all toward byte-fallback tokens,
which are not UTF-8 on their own and so can spell malformed UTF-8), accepts it, and repeats; after a while it is
biased toward closing (a stop token when allowed, else tokens made of closing characters, else the shortest
tokens). A finished walk's raw bytes are then judged: first strictly as UTF-8 (RFC 3629: no surrogates, overlong
forms or code points above U+10FFFF), then by an independent oracle on the text: ``json.loads`` (strict) and
jsonschema for JSON, ``re.fullmatch`` for regexes, membership for choices. Any output the mask let through that
either refuses is a hole in the grammar. Every step also checks that no special token (other than a stop token)
and no padding id is ever allowed.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import numpy
import regex
import torch

from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.cache.vocabulary import tokenizer_vocabulary
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from triton_ops.bitmask_format import allocate_bitmask, bitmask_from_token_ids, unpack_bitmask

CONTROL_WEIGHT = 50.0
QUOTE_WEIGHT = 20.0
BACKSLASH_WEIGHT = 20.0
NON_ASCII_WEIGHT = 5.0
BYTE_FALLBACK_WEIGHT = 40.0
CLOSING_BYTES = frozenset(b'"}]')
SAMPLE_BLOCK = 1024
SPARSE_FRACTION = 16
"""A step whose mask allows at most one token in this many draws among the allowed ids alone (``_choose_among``)."""
EXACT_FLOAT64_INTEGERS = 2**53
WALK_THREADS = 2
WALK_SEED_STRIDE = 1_000_003
"""Walk ``i`` of a batch seeded ``s`` draws from a generator seeded ``s * WALK_SEED_STRIDE + i``."""

Judge = Callable[[str], str | None]
"""Returns why a finished walk's text is not a valid output, or None when it is. A text may hold lone surrogates
(U+DC80-U+DCFF) standing for bytes that are not UTF-8, where the output is free text (``judge_walk``)."""


@dataclass(frozen=True)
class TokenTraits:
    """Per-token facts of one tokenizer the walks sample with (computed once per tokenizer): the exploring weights
    (whole numbers, see ``_sample``), which tokens close, token lengths, and as mask rows the ids no mask may allow
    (special and padding ids) and the ids a mask row can hold (its bits past the vocabulary do not count)."""

    decoded: tuple[bytes, ...]
    explore_weights: torch.Tensor
    closing: torch.Tensor
    lengths: torch.Tensor
    forbidden_words: torch.Tensor
    vocab_words: torch.Tensor


@dataclass(frozen=True)
class WalkResult:
    """``problem`` says what broke (the judges' reason, or an invariant); ``finished`` means a stop token was taken.

    ``steps`` are the tokens taken before the stop token, each with the bytes it stands for.
    """

    finished: bool
    steps: tuple[tuple[int, bytes], ...]
    problem: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.steps)

    @property
    def output(self) -> bytes:
        """The raw bytes of the output, as a client receives them."""
        return b"".join(token_bytes for _, token_bytes in self.steps)

    @property
    def text(self) -> str:
        """The output for reading: bytes that are not UTF-8 shown as ``\\xNN``."""
        return self.output.decode("utf-8", errors="backslashreplace")


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
        if not is_utf8(token_bytes):
            weight *= BYTE_FALLBACK_WEIGHT
        weights.append(weight)
        closing.append(bool(token_bytes) and set(token_bytes) <= CLOSING_BYTES)
        lengths.append(len(token_bytes) or 1_000)
    explore_weights = torch.tensor(weights, dtype=torch.float64)
    if not torch.equal(explore_weights, explore_weights.round()) or explore_weights.sum() >= EXACT_FLOAT64_INTEGERS:
        raise ValueError("the exploring weights must be whole numbers whose total float64 holds exactly")
    return TokenTraits(
        decoded=decoded,
        explore_weights=explore_weights,
        closing=torch.tensor(closing),
        lengths=torch.tensor(lengths),
        forbidden_words=bitmask_from_token_ids(setup.forbidden_token_ids, setup.vocab_size),
        vocab_words=bitmask_from_token_ids(range(setup.vocab_size), setup.vocab_size),
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
    mask = allocate_bitmask(1, vocab_size)
    steps: list[tuple[int, bytes]] = []
    for step in range(max_tokens):
        mask.fill_(0)
        grammar.fill_vocab_mask(mask, 0)
        leaked_words = mask[0] & traits.forbidden_words
        if bool(leaked_words.any()):
            leaked = unpack_bitmask(leaked_words, vocab_size).nonzero().flatten()[:5].tolist()
            return WalkResult(False, tuple(steps), f"the mask allows special or padding ids {leaked}")
        if not bool((mask[0] & traits.vocab_words).any()):
            return WalkResult(False, tuple(steps), "the mask allows no token: the walk cannot go on")
        allowed = unpack_bitmask(mask[0], vocab_size)
        token = _choose(allowed, traits, stops, step >= explore_tokens, generator)
        grammar.accept_token(token)
        if token in setup.eos_token_ids:
            return WalkResult(True, tuple(steps))
        steps.append((token, traits.decoded[token]))
        if grammar.is_terminated():
            return WalkResult(True, tuple(steps))
    return WalkResult(False, tuple(steps))


def _choose(
    allowed: torch.Tensor, traits: TokenTraits, stops: torch.Tensor, closing: bool, generator: torch.Generator
) -> int:
    if closing:
        allowed_stops = stops[allowed[stops]]
        if len(allowed_stops):
            return int(allowed_stops[0])
    as_numpy = allowed.numpy()  # numpy counts and finds a vector's True entries 4-18x faster than torch (248k)
    if numpy.count_nonzero(as_numpy) <= len(as_numpy) // SPARSE_FRACTION:
        return _choose_among(numpy.flatnonzero(as_numpy), traits, closing, generator)
    if closing:
        closers = allowed & traits.closing
        if bool(closers.any()):
            return _sample(closers.double(), generator)
        shortest = traits.lengths.masked_fill(~allowed, 1 << 30).min()
        return _sample((allowed & (traits.lengths == shortest)).double(), generator)
    # as bytes: torch multiplies float64 by uint8 about twice as fast as by bool (measured at 248k tokens)
    return _sample(traits.explore_weights * allowed.view(torch.uint8), generator)


def _choose_among(ids: numpy.ndarray, traits: TokenTraits, closing: bool, generator: torch.Generator) -> int:
    """``_choose`` over the allowed ``ids`` (ascending) alone, past its stop tokens, in numpy: the token the
    vocabulary-wide vectors draw (``_sample_among``), without their passes over every token (at 248k tokens, a few
    allowed: a closing step 2.2 ms -> ~0.2)."""
    if closing:
        candidates = ids[traits.closing.numpy()[ids]]  # the closers, else the shortest
        if len(candidates) == 0:
            lengths = traits.lengths.numpy()[ids]
            candidates = ids[lengths == lengths.min()]
        return _sample_among(candidates, numpy.ones(len(candidates)), generator)
    return _sample_among(ids, traits.explore_weights.numpy()[ids], generator)


def _sample_among(ids: numpy.ndarray, weights: numpy.ndarray, generator: torch.Generator) -> int:
    """What ``_sample`` draws from a vector of ``weights`` (float64) at ``ids`` (ascending) and zero elsewhere, with the
    same one draw of ``generator`` and the same float64 operations: a zero weight moves no partial sum, so the first
    partial sum past the target is at the same id in both."""
    cdf = weights.cumsum()
    return int(ids[numpy.searchsorted(cdf, _target(float(cdf[-1]), generator), side="right")])


def _target(total: float, generator: torch.Generator) -> float:
    """The inverse CDF's target for partial sums up to ``total``: one float64 draw of ``generator`` times ``total``,
    kept below ``total`` (a draw that rounds up to it would pass every partial sum)."""
    return min(float(torch.rand(1, generator=generator, dtype=torch.float64)) * total, math.nextafter(total, 0.0))


def _sample(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn in proportion to ``weights`` (float64 whole numbers totalling under 2**53), by inverse CDF in
    two levels: the block of ``SAMPLE_BLOCK`` whose running total first passes the target, then the index inside it.

    Every partial sum of such weights is exact, in any order, so this is the index one cumsum over the whole vector
    finds, without its sequential pass over every token (``torch.multinomial`` is 20x slower at 248k)."""
    num_full = len(weights) // SAMPLE_BLOCK
    block_totals = torch.cat(
        [
            weights[: num_full * SAMPLE_BLOCK].view(num_full, SAMPLE_BLOCK).sum(1),
            weights[num_full * SAMPLE_BLOCK :].sum(0, True),
        ]
    )
    running = block_totals.cumsum(0)
    target = _target(float(running[-1]), generator)
    block = int(torch.searchsorted(running, target, right=True))
    start = block * SAMPLE_BLOCK
    inside = weights[start : start + SAMPLE_BLOCK].cumsum(0) + (running[block - 1] if block else 0.0)
    return start + int(torch.searchsorted(inside, target, right=True))


def is_utf8(data: bytes) -> bool:
    """Whether ``data`` is well-formed UTF-8 (RFC 3629), as Python's strict decoder holds."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def utf8_problem(steps: tuple[tuple[int, bytes], ...]) -> str | None:
    """Why the bytes of ``steps`` are not well-formed UTF-8 (where, and the tokens that spelled it), or None."""
    output = b"".join(token_bytes for _, token_bytes in steps)
    try:
        output.decode("utf-8")
    except UnicodeDecodeError as e:
        first, last = max(e.start - 3, 0), e.end + 2
        spelled_by, position = [], 0
        for token, token_bytes in steps:
            if position < last and position + len(token_bytes) > first:
                spelled_by.append(f"{token} {token_bytes!r}")
            position += len(token_bytes)
        return f"not UTF-8: {e.reason} at byte {e.start} ({output[first:last]!r}, tokens {', '.join(spelled_by)})"
    return None


def judge_walk(result: WalkResult, judge: Judge, free_text: bool = False) -> WalkResult:
    """The walk with the verdicts on its raw bytes (unfinished or already broken walks are left as they are).

    The bytes must be well-formed UTF-8 before the judge sees their text, unless ``free_text`` (a structural tag's
    text outside its tags is free, as unconstrained decoding is): then bytes that are not UTF-8 reach the judge as
    lone surrogates (``surrogateescape``), which it must refuse inside the tags' bodies (``json_judge`` does).
    """
    if not result.finished or result.problem is not None:
        return result
    if free_text:
        problem = judge(result.output.decode("utf-8", errors="surrogateescape"))
    else:
        problem = utf8_problem(result.steps) or judge(result.output.decode("utf-8"))
    return result if problem is None else WalkResult(True, result.steps, problem)


@dataclass
class WalkTally:
    """What a batch of walks came to: how many finished, and what was wrong with each invalid output."""

    num_walks: int = 0
    num_finished: int = 0
    invalid_outputs: list[str] = field(default_factory=list)


def walk_and_judge(
    grammar: BaseGrammarObject,
    setup: TokenizerSetup,
    judge: Judge,
    num_walks: int,
    seed: int,
    free_text: bool = False,
) -> WalkTally:
    """``num_walks`` walks from fresh copies of ``grammar``, each judged (``judge_walk``); an invalid output is named
    by its walk's index and seed.

    Walk ``i`` draws from its own generator, seeded with ``seed`` and ``i``, so that its path does not depend on the
    other walks; they run ``WALK_THREADS`` at a time (filling a mask and torch's ops leave the GIL)."""
    token_traits(setup)  # computed once, before the threads
    copies = [grammar.copy() for _ in range(num_walks)]

    def walk(index: int) -> WalkResult:
        generator = torch.Generator().manual_seed(seed * WALK_SEED_STRIDE + index)
        return judge_walk(random_walk(copies[index], setup, generator), judge, free_text)

    with ThreadPoolExecutor(WALK_THREADS) as pool:
        results = list(pool.map(walk, range(num_walks)))
    tally = WalkTally(num_walks=num_walks)
    for index, result in enumerate(results):
        tally.num_finished += result.finished
        if result.problem is not None:
            tally.invalid_outputs.append(f"walk {index} (seed {seed}): {result.text!r:.200}: {result.problem}")
    return tally


def json_judge(schema: Any) -> Judge:
    """Strict JSON (no raw control characters in strings, no NaN or Infinity) that validates against ``schema``.

    Formats are checked (``jsonschema[format-nongpl]``), and patterns with ECMA-262's meaning, as JSON Schema
    says: ``\\d`` and ``\\w`` are ASCII, ``.`` stops at every line terminator.
    """
    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator_class = jsonschema.validators.extend(
        base, {"pattern": _ecma_pattern, "patternProperties": _ecma_pattern_properties}
    )
    validator = validator_class(schema, format_checker=base.FORMAT_CHECKER)

    def judge(text: str) -> str | None:
        if not is_utf8(text.encode("utf-8", errors="surrogateescape")):
            return "not UTF-8: the JSON text holds bytes that are not well-formed UTF-8"
        try:
            instance = json.loads(text, parse_constant=_refuse_constant)
        except ValueError as e:
            return f"not strict JSON: {e}"
        error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
        return None if error is None else f"fails the schema at {list(error.absolute_path)}: {error.message[:200]}"

    return judge


_ECMA_SPACE = "\\t\\n\\v\\f\\r \\u00a0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000\\ufeff"
_ECMA_ESCAPES = {"d": "0-9", "w": "A-Za-z0-9_", "s": _ECMA_SPACE}


@functools.cache
def ecma_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` (ECMA-262) as a Python regex of the same meaning for what schemas use: ASCII ``\\d``/``\\w``
    and their negations, ECMA's whitespace for ``\\s``/``\\S``, and ``.`` that stops at line terminators."""
    pieces, index, in_class = [], 0, False
    while index < len(pattern):
        char = pattern[index]
        if char == "\\" and index + 1 < len(pattern):
            escaped = pattern[index + 1]
            if escaped.lower() in _ECMA_ESCAPES and not in_class:
                negation = "^" if escaped.isupper() else ""
                pieces.append(f"[{negation}{_ECMA_ESCAPES[escaped.lower()]}]")
            elif escaped in _ECMA_ESCAPES and in_class:
                pieces.append(_ECMA_ESCAPES[escaped])
            else:
                pieces.append(pattern[index : index + 2])
            index += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        elif char == "." and not in_class:
            char = "[^\\n\\r\\u2028\\u2029]"
        pieces.append(char)
        index += 1
    return re.compile("".join(pieces))


def _ecma_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    if validator.is_type(instance, "string") and not ecma_regex(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _ecma_pattern_properties(validator: Any, pattern_properties: Any, instance: Any, schema: Any) -> Any:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for name, value in instance.items():
            if ecma_regex(pattern).search(name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def regex_judge(pattern: str) -> Judge:
    """A regex constraint is in the engines' own dialect, whose classes are Unicode-aware as Python's are, but of
    Unicode 16, as the engines': ``regex``'s database, not ``re``'s (Python 3.11's is Unicode 14, which has no
    U+1CCF6, a digit to llguidance's ``\\d``)."""
    compiled = regex.compile(pattern)
    return lambda text: None if compiled.fullmatch(text) else "does not match the regex"


def choice_judge(choices: list[str]) -> Judge:
    return lambda text: None if text in choices else "is not one of the choices"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
