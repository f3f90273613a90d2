"""The exact shortest ending in tokens, for grammars whose state the engine exposes (``state_key``: outlines-core's
DFA state; xgrammar's parser states and the bytes their open rules return to, ``backends.xgrammar.parser_state``).

A token moves a byte-level grammar through its bytes one by one, so the fewest tokens from a state to the grammar's
end is a shortest path over pairs (grammar state, place in the vocabulary's trie of pieces): a byte moves both at no
cost, and closing a token at a trie node that is a piece costs one and starts the next token at the trie's root.
This search runs that breadth first by token count over the states at token boundaries, each told apart by its exact
key (no state is merged with another that could end sooner), and walks the trie from each with the grammar's byte
moves, learnt once per state through the contract (the single-byte tokens its mask allows, each accepted, keyed and
rolled back). A walk stops early where every byte below a trie node keeps the grammar in its state (a string's
content): every piece there ends in that state. The first token count at which a state allows a stop token (or has
terminated) is the minimum, because every state reachable in fewer tokens was expanded before it.

It assumes what byte-level engines guarantee: a token is accepted exactly when its bytes are, one by one, and leads
to the state they lead to (checked at the end: the path returned is walked). It gives up (None) beyond
``MAX_EXPLORED_STATES`` states, ``MAX_TRIE_STEPS`` trie steps, ``MAX_SEARCH_STEPS`` grammar steps, a byte path longer
than ``MAX_PATH_BYTES`` or its caller's deadline (a safety net for slow masks, on ``cpu_seconds``), and where a state it
meets has no key. Its limits count work, not time, so that what it finds is the same on every machine.

llguidance exposes no state (``state_key`` is None), nor do xgrammar's grammars with budgets or token terminals: for
them, and wherever this search gives up, ``EndingSearch`` keeps its sound bound. xgrammar's keys merge less than a
DFA's (an open rule keeps the bytes before it: a JSON string's content, a counted run, whitespace), so its searches
give up more often: on JSON with whitespace between tokens, long counted runs, the serving bench's regex and schema.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.cache.vocabulary import TokenizerVocabulary
from triton_ops.bitmask_format import BITS_PER_WORD, allocate_bitmask

MAX_EXPLORED_STATES = 4000
"""Most byte-level states whose moves one search learns (each a walk, a mask and a step per allowed byte)."""
MAX_TRIE_STEPS = 100_000
"""Most trie steps one search takes (it runs in the scheduler's loop). The serving bench's regex needs several times
more: it gets the bound."""
MAX_PATH_BYTES = 180
"""Longest byte path from the search's start to a state it learns (outlines-core keeps 200 tokens to roll back)."""
MAX_SEARCH_STEPS = 8000
"""Most grammar steps one search takes: a state learnt costs its path's accepts, a mask, and an accept, a key and a
rollback per byte it allows (~7 us a step for xgrammar on AMD EPYC Zen 5, 13-15 on Zen 3; ~1 us for outlines-core).
The recursive EBNF of tests/backends/test_exact_ending.py needs up to ~5,000. Bounded at 50 ms before, what a search
found depended on the machine, and with it the tokens budget steering allowed: on AMD EPYC Zen 3 greedy outputs far
from their budget were steered that Zen 5 left alone. On JSON with whitespace, where xgrammar's searches always give
up, this is what a new schema's first request pays."""


def cpu_seconds() -> float:
    """The clock of the ending searches' safety nets: the searching thread's CPU time. A busy machine (other
    processes, the scheduler's other threads) does not stop a search sooner, as the wall clock did: under the test
    suite's load an exact search gave up on one run and not on the next, and servers' outputs parted."""
    return time.thread_time()


class _CollectorPause:
    """The cyclic garbage collector held off while any thread searches: the scheduler's loop and the thread of its
    start endings (``scheduler.start_endings``) search at once, and the collector's switch is the process's. It is
    switched back on when the last search ends, if it was on when the first began."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._searches = 0
        self._was_enabled = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._searches == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._searches += 1
        try:
            yield
        finally:
            with self._lock:
                self._searches -= 1
                if self._searches == 0 and self._was_enabled:
                    gc.enable()


collector_paused = _CollectorPause()
"""The collector held off meanwhile (a search: it allocates little, within its limits). A full collection runs in
the thread whose allocation triggers it, and ``cpu_seconds`` counted it: in the test suite's process (~630k objects)
one took 0.34-0.49 s of CPU, the exact search's whole half second under load, and the search gave up in one run and
not the next."""


@dataclass
class _State:
    """What one grammar state does: its byte path from the search's start, the state key after each allowed byte,
    the bytes that keep it where it is (as a 256-bit set), and how it can end."""

    path: tuple[int, ...]
    moves: dict[int, Hashable] = field(default_factory=dict)
    loop_bytes: int = 0
    stop: int | None = None
    is_terminated: bool = False


class _PieceTrie:
    """The vocabulary's pieces (special tokens left out) as a trie over bytes: per node its children, the token whose
    piece ends there (-1 if none; the first of equal pieces), the bytes anywhere below it, and a token below it; the
    token of each byte that is a piece of its own, and whether every byte of every piece is one."""

    def __init__(self, vocabulary: TokenizerVocabulary) -> None:
        self.children: list[dict[int, int]] = [{}]
        self.token: list[int] = [-1]
        for token, piece in enumerate(vocabulary.decoded_vocab):
            if not piece or token in vocabulary.special_token_ids:
                continue
            node = 0
            for byte in piece:
                child = self.children[node].get(byte)
                if child is None:
                    child = len(self.children)
                    self.children[node][byte] = child
                    self.children.append({})
                    self.token.append(-1)
                node = child
            if self.token[node] < 0:
                self.token[node] = token
        self.bytes_below = [0] * len(self.children)
        self.token_below = list(self.token)
        for node in range(len(self.children) - 1, -1, -1):  # children come after their parents
            for byte, child in self.children[node].items():
                self.bytes_below[node] |= self.bytes_below[child] | (1 << byte)
                if self.token_below[node] < 0:
                    self.token_below[node] = self.token_below[child]
        root = self.children[0]
        self.byte_token = {byte: self.token[child] for byte, child in root.items() if self.token[child] >= 0}
        self.is_walkable = all(byte in self.byte_token for node in self.children for byte in node)


_TRIES: weakref.WeakKeyDictionary[TokenizerVocabulary, _PieceTrie] = weakref.WeakKeyDictionary()
"""Per vocabulary (held weakly: a trie lives as long as its vocabulary): its trie, read only, shared by every search
over it. One takes ~0.3 s of CPU at 49k tokens and ~1.9 s at 248k (156 MB; AMD EPYC Zen 3), in the loop of a
scheduler's first request whose grammar exposes its state: the schedulers on one tokenizer (whose vocabulary
``per_tokenizer`` shares) pay it once."""


def piece_trie(vocabulary: TokenizerVocabulary) -> _PieceTrie:
    """The trie of ``vocabulary``'s pieces, built once per vocabulary (equal ones share it) in this process."""
    trie = _TRIES.get(vocabulary)
    if trie is None:
        trie = _TRIES[vocabulary] = _PieceTrie(vocabulary)
    return trie


class ExactEndingSearch:
    """Shortest endings in tokens over one vocabulary; not thread-safe (one scratch mask row). Every method leaves the
    grammar's state as it found it."""

    def __init__(self, vocabulary: TokenizerVocabulary) -> None:
        self.stop_token_ids = tuple(vocabulary.stop_token_ids)
        self._trie = piece_trie(vocabulary)
        self._byte_token = self._trie.byte_token
        self.is_walkable = self._trie.is_walkable
        """Whether every byte of every piece has a token of its own (the trie's walks need it)."""
        self._scratch = allocate_bitmask(1, vocabulary.model_vocab_size, "cpu")
        self.num_steps = 0
        """Grammar steps the last search took."""

    def shortest(self, grammar: BaseGrammarObject, deadline: float = float("inf")) -> list[int] | None:
        """The fewest tokens after which ``grammar`` has terminated (the last a stop token unless it ends by
        itself), ``[]`` if it has; None where its engine exposes no state or the search gives up (its limits, or
        ``cpu_seconds()`` past ``deadline`` when it learns a state). The state does not change."""
        start = grammar.state_key()
        if start is None or not self.is_walkable:
            return None
        states: dict[Hashable, _State] = {}
        self.num_steps = 0
        reached: dict[Hashable, tuple[Hashable, int] | None] = {start: None}  # a boundary state: (previous, token)
        level = [start]
        num_trie_steps = 0
        while level:
            learnt = [self._learn(grammar, states, key, (), deadline) for key in level]  # learnt when reached
            if None in learnt:
                return None
            ends = [(not s.is_terminated, key, s.stop) for key, s in zip(level, learnt, strict=True) if s and _ends(s)]
            if ends:  # a terminated state ends at this count, a state allowing a stop token at one more
                is_stop_needed, key, stop = min(ends, key=lambda end: end[0])
                return _tokens_to(reached, key) + ([stop] if is_stop_needed and stop is not None else [])
            next_level: list[Hashable] = []
            for key in level:
                stack = [(0, key)]
                while stack:
                    node, at = stack.pop()
                    for byte, child in self._trie.children[node].items():
                        after = states[at].moves.get(byte)
                        if after is None:
                            continue
                        num_trie_steps += 1
                        path = (*states[at].path, self._byte_token[byte])
                        state = self._learn(grammar, states, after, path, deadline)
                        if state is None or num_trie_steps > MAX_TRIE_STEPS:
                            return None
                        stays = self._trie.bytes_below[child] & ~state.loop_bytes == 0
                        token = self._trie.token_below[child] if stays else self._trie.token[child]
                        if token >= 0 and after not in reached:
                            reached[after] = (key, token)
                            next_level.append(after)
                        if not stays:
                            stack.append((child, after))
            level = next_level
        return None

    def _learn(
        self,
        grammar: BaseGrammarObject,
        states: dict[Hashable, _State],
        key: Hashable,
        path: tuple[int, ...],
        deadline: float,
    ) -> _State | None:
        """The moves of the state ``key``, reached from the start by the byte tokens ``path`` (learnt the first time
        it is met); None past the search's limits."""
        state = states.get(key)
        if state is not None:
            return state
        if len(states) >= MAX_EXPLORED_STATES or len(path) > MAX_PATH_BYTES or self.num_steps >= MAX_SEARCH_STEPS:
            return None
        if cpu_seconds() > deadline:  # a safety net for slow masks
            return None
        state = states[key] = _State(path)
        self.num_steps += 1 + len(path)
        for token in path:
            grammar.accept_token(token)
        try:
            state.is_terminated = grammar.is_terminated()
            if state.is_terminated:
                return state
            grammar.fill_vocab_mask(self._scratch, 0)
            row = self._scratch[0].tolist()
            state.stop = next((t for t in self.stop_token_ids if _is_set(row, t)), None)
            for byte, token in self._byte_token.items():
                if not _is_set(row, token):
                    continue
                self.num_steps += 1
                grammar.accept_token(token)
                try:
                    after = grammar.state_key()
                finally:
                    grammar.rollback(1)
                if after is None:  # a state the engine cannot key: merging it, or leaving it out, could miss the end
                    return None
                state.moves[byte] = after
                if after == key:
                    state.loop_bytes |= 1 << byte
            return state
        finally:
            grammar.rollback(len(path))


def _ends(state: _State) -> bool:
    return state.is_terminated or state.stop is not None


def _is_set(row: list[int], token: int) -> bool:
    return (row[token // BITS_PER_WORD] >> (token % BITS_PER_WORD)) & 1 == 1


def _tokens_to(reached: dict[Hashable, tuple[Hashable, int] | None], key: Hashable) -> list[int]:
    tokens: list[int] = []
    step = reached[key]
    while step is not None:
        key, token = step
        tokens.append(token)
        step = reached[key]
    return tokens[::-1]
