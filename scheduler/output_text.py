"""A request's output text: detokenised as tokens arrive, cut at a stop string, safe to stream."""

from __future__ import annotations

from typing import Any

_INCOMPLETE_CHARACTER = "\ufffd"


class OutputText:
    """Detokenises a request's output ids, finds stop strings, and holds back text that may still change.

    Decoding happens only when someone needs the text before the end (streaming or stop strings).
    """

    def __init__(self, tokenizer: Any, stop: list[str], needs_live_text: bool) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.needs_live_text = needs_live_text or bool(stop)
        self.text = ""
        self.matched_stop: str | None = None

    def update(self, output_ids: list[int]) -> None:
        """Re-read the text after new tokens; sets ``matched_stop`` and cuts the text before it."""
        if not self.needs_live_text or self.matched_stop is not None:
            return
        self.text = self._decode(output_ids)
        for stop in self.stop:
            index = self.text.find(stop)
            if index != -1:
                self.matched_stop = stop
                self.text = self.text[:index]
                return

    def stable_text(self) -> str:
        """The text so far without what may still change: a partial UTF-8 character or a partial stop string."""
        text = self.text.rstrip(_INCOMPLETE_CHARACTER)
        if self.matched_stop is not None:
            return text
        held = max((n for stop in self.stop for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        return text[: len(text) - held] if held else text

    def final_text(self, output_ids: list[int]) -> str:
        if self.needs_live_text:
            return self.text
        return self._decode(output_ids)

    def _decode(self, output_ids: list[int]) -> str:
        return self.tokenizer.decode(output_ids, skip_special_tokens=True)
