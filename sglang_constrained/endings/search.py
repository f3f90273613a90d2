"""The shortest ending of a constrained output: a token path from a grammar's current state to its end (a stop token
accepted, or the grammar terminated), found through the grammar contract alone (``fill_vocab_mask``,
``accept_token``, ``rollback``, ``is_terminated``), so that it serves every backend (xgrammar, llguidance,
outlines-core, ``auto``, the reasoner wrapper) and every constraint kind (schemas, regexes, EBNF, Lark, structural
tags) without knowing their syntax.

How: breadth first over the vocabulary's single-byte tokens, the states after each byte told apart by the mask they
allow (two states with the same mask count as one, which can only hide a shorter ending, never make one up), ASCII
bytes first and every byte only if no ASCII ending is found. The shortest byte string found is then spelled in as
few vocabulary tokens as possible (``spell``: a shortest path over the vocabulary's pieces), checked by the grammar.

What the length means: where the engine exposes its state (``state_key``: outlines-core, xgrammar) and the exact
search (``endings.exact``) ends within its limits, the exact minimum in tokens; elsewhere (llguidance: no state to tell
two states apart, and a mask alone does not: ``\\d{3}`` allows the same digits after one digit and after two) an upper
bound, exact whenever the shortest ending in bytes is also the one spelled in fewest tokens. It is always sound: every
path returned was walked through the grammar, so a budget kept at or above its length can always be finished.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy

from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.cache.vocabulary import TokenizerVocabulary
from sglang_constrained.endings.exact import ExactEndingSearch, collector_paused, cpu_seconds
from sglang_constrained.errors import TokenRejectedError
from triton_ops.bitmask_format import BITS_PER_WORD, allocate_bitmask

MAX_ENDING_BYTES = 192
"""Longest ending searched for, in bytes; a grammar whose ending is longer gets no plan (and no steering). Below
outlines-core's 200 tokens of rollback (a path, and a candidate token before it)."""
MAX_STATES = 20_000
"""Most byte steps one search tries (each an accept, a mask and a rollback) before it gives up; ``MAX_SEARCH_SECONDS``
bounds it first wherever a mask is slow. The four bounds were chosen on MaskBench's schemas searched from their start
(docs/benchmarks.md): few searches give up, none runs past the deadline."""
MAX_SEARCH_SECONDS = 1.0
"""Most CPU time one search in the scheduler's loop spends (``cpu_seconds``; twice this from a constraint's start, on
the thread of ``scheduler.start_endings``): a step's mask costs what the grammar's mask costs, and some grammars' masks
are slow (xgrammar's string of ``maxLength`` 255, MaskBench's o58909)."""
FIRST_MOVES_SHARE = 0.25
"""Share of a full search's time the walk of first moves has at least, even where the ASCII breadth-first pass before
it used all of it. Added to the bound, not taken from the pass: whatever the pass finds is what it found before. The
bounded searches (``ascii_only``) get none, so that their step bound, the same on every machine, stays the one that
binds."""
FIRST_MOVES_MIN_MASKS = 64
"""Masks the walk of first moves of a full search may always take, however long they take: where masks are slow
(xgrammar's string of ``maxLength`` 255: 5-12 ms a mask) its time alone depended on the machine. MaskBench's o26589
(``{"name": ...}``, one such string) needs 18, o58909 32; on a quiet Intel Xeon 0.17 and 0.20 s of the 0.25 s its share
gave, and under a second test run beside it the first got no ending. The walks that need more masks (up to 190 on
xgrammar, 374 on llguidance, of MaskBench's schemas) have fast masks: their share covers them."""
MAX_PIECE_BYTES = 24
"""Longest vocabulary piece used to spell an ending."""
BEAM_WIDTH = 32
"""Most states kept at one depth, those with the least whitespace on their path first (at 16 llguidance's search lost
the path of 20 MaskBench schemas: properties in its order, numbers as ``-0``)."""
MAX_MOVES = 48
"""Most single-byte moves tried from one state: letters and digits come after the other bytes, and past this many
(a string's content) they stand for each other; whitespace comes last."""
MAX_REPEATS = 64
"""Most times the first-moves walk takes one move from states with one mask (a run of closing brackets repeats it)."""
WIDE_STATE_MOVES = 32
"""Single-byte moves from which a state is content (a string's): its moves that keep its mask go nowhere."""
MAX_SPELLED = 1024
"""Texts whose spellings ``_suffix_spellings`` keeps (least recently spelled dropped)."""
REJOIN_BYTES = 3
"""Most first moves ``rejoin`` takes before a known ending (a counted run: ``[A-Z][a-z]{1,12}`` needs two)."""
MAX_FORCED_MOVES = 64
"""Most tokens searched from a state that allows no single-byte token."""
ASCII_BYTES = range(0x80)


@dataclass(frozen=True)
class _Node:
    path: tuple[int, ...]
    """The byte tokens from the search's start to this state."""
    moves: tuple[int, ...]
    """The tokens searched from this state: the single-byte tokens its mask allows, or where it allows none (an
    engine that allows only the canonical token of a forced text) every token it allows."""
    mask_fingerprint: int
    """A hash of this state's whole mask."""
    loop_token: int | None = None
    """The token that looped into this state (it allows the moves its parent allowed), None if it was reached
    otherwise."""
    num_blank: int = 0
    """Whitespace tokens on the path (an ending with fewer is preferred: grammars allow whitespace almost
    anywhere, and paths that differ only by where they put it would fill the search)."""
    loop_run: int = 0
    """Loop steps that led here in a row (a long run is kept last: it counts towards a bound, or goes nowhere)."""


CLOSING_BYTES = b"]})>"


def _byte_kind(piece: bytes) -> str:
    """Which bytes a walk's move stands for in a wide state: ``_wide_moves``."""
    if piece.isspace():
        return "space"
    if piece.isdigit():
        return "digit"
    if piece.islower():
        return "lower"
    return "upper" if piece.isupper() else "other"


def _move_order(byte: int) -> tuple[bool, bool, bool, int]:
    """The order a state's single-byte moves are tried in: closing brackets first (states that differ only in depth
    have the same mask, and the first path to a mask stands for the others: the one that closes makes progress), then
    other punctuation, whitespace, and letters and digits last."""
    piece = bytes([byte])
    return byte not in CLOSING_BYTES, piece.isspace(), piece.isalnum(), byte


class EndingSearch:
    """Finds short endings for grammars over one tokenizer's vocabulary (``TokenizerVocabulary``).

    Not thread-safe (one scratch mask row); every method leaves the grammar's state as it found it.
    """

    def __init__(self, vocabulary: TokenizerVocabulary) -> None:
        self.stop_token_ids = tuple(vocabulary.stop_token_ids)
        self._stops = frozenset(self.stop_token_ids)
        self._pieces: dict[bytes, int] = {}
        for token, piece in enumerate(vocabulary.decoded_vocab):
            if 0 < len(piece) <= MAX_PIECE_BYTES and token not in vocabulary.special_token_ids:
                self._pieces.setdefault(piece, token)
        self._byte_token = {b: self._pieces[bytes([b])] for b in range(256) if bytes([b]) in self._pieces}
        self._byte_tokens = frozenset(self._byte_token.values())
        self._ascii_tokens = frozenset(self._byte_token[b] for b in ASCII_BYTES if b in self._byte_token)
        self._pieces_of = vocabulary.decoded_vocab
        self._vocab_size = vocabulary.model_vocab_size
        in_move_order = sorted(self._byte_token, key=_move_order)
        byte_tokens = numpy.array([self._byte_token[b] for b in in_move_order], dtype=numpy.int64)
        self._byte_token_ids = byte_tokens
        self._byte_words = byte_tokens // BITS_PER_WORD
        self._byte_shifts = (byte_tokens % BITS_PER_WORD).astype(numpy.int32)
        self._stop_words = [(t // BITS_PER_WORD, t % BITS_PER_WORD) for t in self.stop_token_ids]
        self._scratch = allocate_bitmask(1, vocabulary.model_vocab_size, "cpu")
        self._scratch_words = self._scratch[0].numpy()  # a view: the grammars write through the tensor
        self.vocabulary = vocabulary
        self._exact: ExactEndingSearch | None = None
        self._spelled: dict[bytes, Callable[[int], list[int] | None]] = {}

    def find(
        self,
        grammar: BaseGrammarObject,
        max_steps: int = MAX_STATES,
        ascii_only: bool = False,
        max_seconds: float = MAX_SEARCH_SECONDS,
        first_moves: bool = True,
    ) -> list[int] | None:
        """A short ending from ``grammar``'s state: tokens after which it has terminated (the last one a stop token
        unless the grammar ends by itself), ``[]`` if it has; None when no ending of at most ``MAX_ENDING_BYTES`` is
        found within ``max_steps`` steps (per pass: ASCII bytes, then unless ``ascii_only`` every byte; between them,
        with ``first_moves``, the walk of first moves, ``_first_moves``) and ``max_seconds`` (all of them, and in a full
        search a share more for the walk, ``FIRST_MOVES_SHARE``, and at least ``FIRST_MOVES_MIN_MASKS`` of its masks;
        the exact search before them gets half as long). A full search (not ``ascii_only``: the quick checks of the
        steering's candidates, where any ending within the budget will do) of a grammar that exposes its state gives
        the exact shortest. The state does not change. The garbage collector waits meanwhile (``collector_paused``),
        so that the deadline counts the search only."""
        with collector_paused():
            return self._find(grammar, max_steps, ascii_only, max_seconds, first_moves)

    def _find(
        self, grammar: BaseGrammarObject, max_steps: int, ascii_only: bool, max_seconds: float, first_moves: bool
    ) -> list[int] | None:
        if grammar.is_terminated():
            return []
        if not ascii_only and grammar.state_key() is not None:
            exact = self._exact_search().shortest(grammar, cpu_seconds() + max_seconds / 2)
            if exact is not None and self.finishes(grammar, exact):
                return exact
        deadline = cpu_seconds() + max_seconds
        grammar.fill_vocab_mask(self._scratch, 0)
        stop = self._allowed_stop()
        if stop is not None:
            return [stop]
        start = _Node((), self._moves(), hash(self._scratch_bytes()))
        found = self._breadth_first(grammar, start, ASCII_BYTES, max_steps, deadline)
        if found is None and first_moves:
            own_time, min_masks = (0.0, 0) if ascii_only else (max_seconds * FIRST_MOVES_SHARE, FIRST_MOVES_MIN_MASKS)
            found = self._first_moves(grammar, max(deadline, cpu_seconds() + own_time), min_masks)
        if found is None and not ascii_only:
            found = self._breadth_first(grammar, start, range(256), max_steps, deadline)
        if found is None:
            return None
        path, stop = found
        tail = [stop] if stop is not None else []
        spelled = self.spell(b"".join(self._pieces_of[t] for t in path))
        if spelled is not None and len(spelled) < len(path) and self.finishes(grammar, spelled + tail):
            return spelled + tail
        return list(path) + tail

    def replay(
        self,
        grammar: BaseGrammarObject,
        ending: Sequence[int],
        max_tokens: int,
        taken: bytes = b"",
        respell: bool = False,
    ) -> list[int] | None:
        """A suffix of ``ending`` (at most ``max_tokens`` long, the shortest first) that finishes ``grammar`` from its
        state, or None: an ending known before the last tokens often still ends the output after them (the same
        closing brackets after more of a string). Where the last token's text ``taken`` begins the ending's text
        (``"`` where the ending had ``"}``), the rest of that text, spelled anew, is tried first; where it (or that
        text without its leading whitespace) occurs further on (``aa"}`` where the ending closed the string sooner),
        the rest after it is tried after the suffixes. With ``respell``, the suffixes of the ending's text that start
        inside a token are tried last, spelled anew (``"age":0}`` after the ``",`` the ending began with). The state
        does not change."""
        tail = [ending[-1]] if ending and ending[-1] in self._stops else []
        text = b"".join(self._pieces_of[t] for t in ending[: len(ending) - len(tail)])

        def after(piece: bytes, at: int) -> list[int] | None:
            rest = self.spell(text[at + len(piece) :]) if at >= 0 else None
            if rest is not None and len(rest) + len(tail) <= max_tokens and self.finishes(grammar, rest + tail):
                return rest + tail
            return None

        if taken and text.startswith(taken) and (found := after(taken, 0)) is not None:
            return found
        for start in range(max(len(ending) - max_tokens, 0), len(ending) + 1)[::-1]:
            suffix = list(ending[start:])
            if self.finishes(grammar, suffix):
                return suffix
        for piece in dict.fromkeys(piece for piece in (taken, taken.lstrip()) if piece):
            if (found := after(piece, text.find(piece, 1 if piece == taken else 0))) is not None:
                return found
        if not respell:
            return None
        boundaries = set(itertools.accumulate(len(self._pieces_of[t]) for t in ending[: len(ending) - len(tail)]))
        spellings = self._suffix_spellings(text)
        for start in range(len(text) - 1, 0, -1):
            rest = spellings(start)
            if start in boundaries or rest is None or len(rest) + len(tail) > max_tokens:
                continue
            if self.finishes(grammar, rest + tail):
                return rest + tail
        return None

    def bridge(self, grammar: BaseGrammarObject, ending: Sequence[int]) -> list[int] | None:
        """One single-byte token followed by ``ending`` that finishes ``grammar`` from its state, or None: an ending
        known before the last token often still ends the output after one byte more (``]`` after one more ``[``).
        Tries at most ``MAX_MOVES`` bytes, in move order. The state does not change."""
        grammar.fill_vocab_mask(self._scratch, 0)
        for token in self._moves()[:MAX_MOVES]:
            if token in self._byte_tokens and self.finishes(grammar, [token, *ending]):
                return [token, *ending]
        return None

    def rejoin(self, grammar: BaseGrammarObject, ending: Sequence[int]) -> list[int] | None:
        """A few bytes followed by ``ending`` that finish ``grammar`` from its state, or None: ``bridge`` from here and
        after each of up to ``REJOIN_BYTES`` first moves (``Aa`` and the ending after a space that opened a word of
        ``[A-Z][a-z]+``). Stops at a state of ``WIDE_STATE_MOVES`` moves (a string's content), where ``bridge``
        has tried the bytes that matter. The state does not change."""
        path: list[int] = []
        try:
            while True:
                found = self.bridge(grammar, ending)
                if found is not None:
                    return path + found
                moves = [t for t in self._moves() if t in self._ascii_tokens]  # bridge filled this state's mask
                if len(path) == REJOIN_BYTES or not moves or len(moves) >= WIDE_STATE_MOVES:
                    return None
                grammar.accept_token(moves[0])
                path.append(moves[0])
                if grammar.is_terminated():
                    return path
        finally:
            grammar.rollback(len(path))

    def _exact_search(self) -> ExactEndingSearch:
        """The exact search, its trie of pieces built the first time a grammar exposes its state."""
        if self._exact is None:
            self._exact = ExactEndingSearch(self.vocabulary)
        return self._exact

    def piece(self, token: int) -> bytes:
        """The text of ``token`` (empty for special tokens)."""
        return self._pieces_of[token] if 0 <= token < len(self._pieces_of) else b""

    def finishes(self, grammar: BaseGrammarObject, tokens: Sequence[int]) -> bool:
        """Whether ``grammar`` accepts ``tokens`` from its state and has terminated after them; the state does not
        change."""
        if not tokens:
            return grammar.is_terminated()
        at_once = grammar.accepts_to_end(tokens)
        if at_once is not None:
            return at_once
        if grammar.validate_tokens(list(tokens)) != len(tokens):
            return False
        if tokens[-1] in self._stops:
            return True
        num_accepted = 0
        try:
            for token in tokens:
                grammar.accept_token(token)
                num_accepted += 1
            return grammar.is_terminated()
        except TokenRejectedError:
            return False
        finally:
            grammar.rollback(num_accepted)

    def spell(self, text: bytes) -> list[int] | None:
        """``text`` in as few vocabulary pieces as possible (None if some byte has no piece)."""
        return self._suffix_spellings(text)(0)

    def _suffix_spellings(self, text: bytes) -> Callable[[int], list[int] | None]:
        """For each start, ``text[start:]`` in as few vocabulary pieces as possible (None if some byte has no
        piece): one pass from the end, read back per start; kept for the ``MAX_SPELLED`` texts last spelled (a
        constraint's endings recur across its requests)."""
        known = self._spelled.pop(text, None)
        if known is None:
            known = self._spell_suffixes(text)
            if len(self._spelled) >= MAX_SPELLED:
                del self._spelled[next(iter(self._spelled))]
        self._spelled[text] = known
        return known

    def _spell_suffixes(self, text: bytes) -> Callable[[int], list[int] | None]:
        unreachable = len(text) + 1
        num_pieces = [unreachable] * len(text) + [0]  # fewest pieces spelling text[start:]
        first_piece = [0] * (len(text) + 1)  # the length of the first of them
        for start in range(len(text) - 1, -1, -1):
            for length in range(1, min(len(text) - start, MAX_PIECE_BYTES) + 1):
                count = num_pieces[start + length] + 1
                if count < num_pieces[start] and text[start : start + length] in self._pieces:
                    num_pieces[start], first_piece[start] = count, length

        def spelled(start: int) -> list[int] | None:
            if num_pieces[start] == unreachable:
                return None
            tokens = []
            while start < len(text):
                tokens.append(self._pieces[text[start : start + first_piece[start]]])
                start += first_piece[start]
            return tokens

        return spelled

    def _breadth_first(
        self, grammar: BaseGrammarObject, start: _Node, byte_values: range, max_steps: int, deadline: float
    ) -> tuple[tuple[int, ...], int | None] | None:
        """The token path to the nearest end (and the stop token that ends it, None where the grammar terminated by
        itself), over the single-byte tokens of bytes in ``byte_values`` (and forced tokens).

        A token after which the same moves are allowed as before loops (a string's content, whitespace, digits). The
        first such token of a state stands for all of them, and a state reached by looping tries that token alone
        (its other moves were tried where the loop began, closer to the start): a loop may count towards a bound
        that no mask shows (``\\d{3}`` over single-digit tokens, ``minItems``). States at one depth with one mask
        count as one; at most ``BEAM_WIDTH`` are kept, those with less whitespace and shorter loop runs first."""
        byte_tokens = {self._byte_token[b] for b in byte_values if b in self._byte_token}
        level = [start]
        num_steps = 0
        while level and len(level[0].path) < MAX_ENDING_BYTES:
            next_level: list[_Node] = []
            seen: set[int] = set()
            for node in level:
                if node.loop_token is not None:
                    candidates: Sequence[int] = (node.loop_token,)
                else:
                    candidates = [t for t in node.moves if t not in self._byte_tokens or t in byte_tokens]
                    candidates = candidates[:MAX_MOVES]
                has_loop = False
                for token in node.path:
                    grammar.accept_token(token)
                try:
                    for token in candidates:
                        num_steps += 1
                        if num_steps > max_steps or cpu_seconds() > deadline:
                            return None
                        try:
                            grammar.accept_token(token)
                        except TokenRejectedError:  # an engine's mask may allow more than it accepts
                            continue
                        try:
                            if grammar.is_terminated():
                                return (*node.path, token), None
                            grammar.fill_vocab_mask(self._scratch, 0)
                            stop = self._allowed_stop()
                            if stop is not None:
                                return (*node.path, token), stop
                            moves = self._moves()
                            fingerprint = hash(self._scratch_bytes())
                        finally:
                            grammar.rollback(1)
                        loop_token, loop_run = None, 0
                        if moves == node.moves and len(moves) > 1:  # a forced byte twice ("22") is no loop
                            if has_loop:
                                continue
                            has_loop, loop_token, loop_run = True, token, node.loop_run + 1
                        if fingerprint not in seen:
                            seen.add(fingerprint)
                            num_blank = node.num_blank + (self._pieces_of[token].strip() == b"")
                            path = (*node.path, token)
                            next_level.append(_Node(path, moves, fingerprint, loop_token, num_blank, loop_run))
                finally:
                    grammar.rollback(len(node.path))
            next_level.sort(key=lambda n: (n.num_blank, n.loop_run))  # stable: discovery order among equals
            level = next_level[:BEAM_WIDTH]
        return None

    def _first_moves(
        self, grammar: BaseGrammarObject, deadline: float, min_masks: int = 0
    ) -> tuple[tuple[int, ...], int | None] | None:
        """The token path that takes each state's first move (single-byte ASCII tokens in move order: closing brackets
        first, letters and digits last; or the first token of a state that allows none) to the nearest end; None past
        ``MAX_ENDING_BYTES`` or ``MAX_REPEATS`` of one move from one mask. In a state that allows ``WIDE_STATE_MOVES``
        bytes or more (a string's content) a move that leaves its mask as it was goes nowhere: the first that changes
        it is taken (of ``_wide_moves``); where none does, the first to a state the walk has not met, where the engine
        keys its states (``state_key``): the colon of ``.+:.+`` keeps the mask of the string before it, and a walk
        by masks alone never placed it. Not the shortest ending, but found where the breadth-first search runs out of
        steps (an object of many required fields, many brackets deep). Bounded by ``deadline`` once it has taken
        ``min_masks`` masks."""
        path: list[int] = []
        repeats: dict[tuple[int, int], int] = {}
        grammar.fill_vocab_mask(self._scratch, 0)
        masks = 1
        visited = {grammar.state_key()} - {None}
        try:
            while len(path) < MAX_ENDING_BYTES and (masks < min_masks or cpu_seconds() <= deadline):
                moves = [t for t in self._moves() if t not in self._byte_tokens or t in self._ascii_tokens]
                fingerprint = hash(self._scratch_bytes())
                moves = [t for t in moves if repeats.get((fingerprint, t), 0) < MAX_REPEATS]
                is_wide = len(moves) >= WIDE_STATE_MOVES
                onward = None  # in a wide state: the first move to a state not met before that keeps the mask
                for token in self._wide_moves(moves) if is_wide else moves[:1]:
                    try:
                        grammar.accept_token(token)
                    except TokenRejectedError:
                        continue
                    if grammar.is_terminated():
                        path.append(token)
                        return tuple(path), None
                    grammar.fill_vocab_mask(self._scratch, 0)
                    masks += 1
                    if not is_wide or hash(self._scratch_bytes()) != fingerprint:
                        break
                    if onward is None and visited and grammar.state_key() not in visited:
                        onward = token
                    grammar.rollback(1)
                else:
                    if onward is None:
                        return None
                    token = onward
                    grammar.accept_token(token)
                    grammar.fill_vocab_mask(self._scratch, 0)
                    masks += 1
                if visited:
                    visited.add(grammar.state_key())
                repeats[fingerprint, token] = repeats.get((fingerprint, token), 0) + 1
                path.append(token)
                stop = self._allowed_stop()
                if stop is not None:
                    return tuple(path), stop
            return None
        finally:
            grammar.rollback(len(path))

    def _wide_moves(self, moves: list[int]) -> list[int]:
        """The moves the walk tries in a wide state: the quote first (where it may close a string, closing it is the
        way out: in ``[^@]+@[^@]+\\.[a-z]+`` a ``)`` before it changed the mask and led the walk back into the string),
        then the first ``MAX_MOVES``, then the first of each kind of byte they leave out (a lowercase or uppercase
        letter, a digit, whitespace), which stands for the rest of its kind: a pattern's next part may want only
        letters (``\\.[a-z]+``) or a space (``\\S+ \\S+``), which come last."""
        quote = self._byte_token.get(ord('"'))
        if quote in moves:
            moves = [quote, *(token for token in moves if token != quote)]
        tried = moves[:MAX_MOVES]
        kinds = {_byte_kind(self._pieces_of[token]) for token in tried}
        for token in moves[MAX_MOVES:]:
            kind = _byte_kind(self._pieces_of[token])
            if kind not in kinds:
                kinds.add(kind)
                tried.append(token)
        return tried

    def _allowed_stop(self) -> int | None:
        row = self._scratch_words
        for (word, bit), token in zip(self._stop_words, self.stop_token_ids, strict=True):
            if (int(row[word]) >> bit) & 1:
                return token
        return None

    def _moves(self) -> tuple[int, ...]:
        words = self._scratch_words[self._byte_words]
        moves = tuple(self._byte_token_ids[((words >> self._byte_shifts) & 1).astype(bool)].tolist())  # in move order
        if moves:
            return moves
        bits = numpy.unpackbits(self._scratch_words.view(numpy.uint8), bitorder="little")[: self._vocab_size]
        return tuple(numpy.flatnonzero(bits)[:MAX_FORCED_MOVES].tolist())

    def _scratch_bytes(self) -> bytes:
        return self._scratch_words.tobytes()
