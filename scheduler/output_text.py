"""A request's output text: detokenised as tokens arrive, cut at a stop string, safe to stream."""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream

_INCOMPLETE_CHARACTER = "\ufffd"


class OutputText:
    """Detokenises a request's output ids, finds stop strings, and holds back text that may still change.

    Decoding happens only when someone needs the text before the end (streaming or stop strings), then token by token
    (the tokenizers library's ``DecodeStream``: the same text as decoding the whole output, less a partial UTF-8
    character at its end, at a cost per token that does not grow with the output), where the tokenizer's decode is
    its backend's alone (no clean-up of spaces, special tokens skipped or unspaced); the finished text is decoded whole.
    ``no_stop_trim`` keeps a matched stop string (or stop token) in the text. With ``skip_special_tokens`` off,
    ``spaces_between_special_tokens`` puts a space on each side of every added token's text, as Hugging Face's
    slow tokenizers define it (the fast tokenizer this server loads has no such option).
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: list[str],
        needs_live_text: bool,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        no_stop_trim: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.needs_live_text = needs_live_text or bool(stop)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.no_stop_trim = no_stop_trim
        self.text = ""
        self.matched_stop: str | None = None
        self.stop_search_from = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        streams = not getattr(tokenizer, "clean_up_tokenization_spaces", True) and (
            skip_special_tokens or not spaces_between_special_tokens
        )
        self._backend = backend if streams else None
        self._stream: DecodeStream | None = None
        self._streamed_ids: list[int] = []
        self._streamed = ""
        self._held_back = False

    def update(self, output_ids: list[int], can_stop: bool = True) -> None:
        """Re-read the text after new tokens; sets ``matched_stop`` and cuts the text after it (``no_stop_trim``) or
        before it. Until ``can_stop`` (``min_new_tokens``), no stop string counts, nor one that ends before then."""
        if not self.needs_live_text or self.matched_stop is not None:
            return
        self.text = self._live_text(output_ids)
        if not can_stop:
            self.stop_search_from = len(self.text)
            return
        for stop in self.stop:
            index = self.text.find(stop, max(0, self.stop_search_from - len(stop) + 1))
            if index != -1:
                self.matched_stop = stop
                self.text = self.text[: index + len(stop) if self.no_stop_trim else index]
                return

    def stable_text(self) -> str:
        """The text so far without what may still change: a partial UTF-8 character or a partial stop string."""
        text = self.text.rstrip(_INCOMPLETE_CHARACTER)
        if self.matched_stop is not None:
            return text
        held = max((n for stop in self.stop for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        return text[: len(text) - held] if held else text

    def final_text(self, output_ids: list[int], ends_with_stop_token: bool = False) -> str:
        """The whole text; a stop token that ended the output is left out unless ``no_stop_trim``."""
        if ends_with_stop_token and not self.no_stop_trim:
            return self._decode(output_ids[:-1])
        if self.matched_stop is not None:
            return self.text
        return self._decode(output_ids)

    def _live_text(self, output_ids: list[int]) -> str:
        """The text of ``output_ids`` so far: the stream's, fed the new tokens (anew where earlier ones changed: a
        jump-forward retokenised them); the whole output decoded where the stream holds a partial character back (as
        decoding the whole shows it) or the tokenizer does not stream."""
        if self._backend is None:
            return self._decode(output_ids)
        num_fed = len(self._streamed_ids)
        if self._stream is None or output_ids[:num_fed] != self._streamed_ids:
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
            self._streamed_ids, self._streamed, num_fed = [], "", 0
        held_back = self._held_back
        for token in output_ids[num_fed:]:
            chunk = self._stream.step(self._backend, token)
            held_back = chunk is None
            self._streamed += chunk or ""
        self._streamed_ids.extend(output_ids[num_fed:])
        self._held_back = held_back
        return self._decode(output_ids) if held_back else self._streamed

    def _decode(self, output_ids: list[int]) -> str:
        if self.skip_special_tokens or not self.spaces_between_special_tokens:
            return str(self.tokenizer.decode(output_ids, skip_special_tokens=self.skip_special_tokens))
        added = set(self.tokenizer.get_added_vocab().values())
        pieces: list[str] = []
        run: list[int] = []
        for token in output_ids:
            if token in added:
                if run:
                    pieces.append(self.tokenizer.decode(run))
                    run = []
                pieces.append(self.tokenizer.decode([token]))
            else:
                run.append(token)
        if run:
            pieces.append(self.tokenizer.decode(run))
        return " ".join(pieces)
