"""The tokenizer's role in the server: a request's prompt (text, chat messages or token ids) as checked token ids."""

from __future__ import annotations

from typing import Any


class PromptEncoder:
    """Turns exactly one prompt source into token ids that fit the model: in range, non-empty, within the context.

    Chat messages go through the tokenizer's chat template with the generation prompt added.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len

    def encode(
        self,
        text: str | None = None,
        messages: list[dict[str, str]] | None = None,
        input_ids: list[int] | None = None,
    ) -> list[int]:
        """Token ids of exactly one prompt source; raises ValueError naming what is wrong."""
        sources = (("text", text), ("messages", messages), ("input_ids", input_ids))
        given = [name for name, value in sources if value is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of text, messages or input_ids (got {given or 'none'})")
        if text is not None:
            ids = list(self.tokenizer.encode(text))
        elif messages is not None:
            ids = self._apply_chat_template(messages)
        else:
            ids = list(input_ids or [])
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
            if bad:
                raise ValueError(f"input_ids must be token ids in [0, {self.vocab_size}); got {bad[:5]}")
        if not ids:
            raise ValueError(f"the prompt ({given[0]}) is empty: give at least one token")
        if len(ids) > self.max_seq_len - 1:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but --max-seq-len {self.max_seq_len} leaves room for at most "
                f"{self.max_seq_len - 1} (one position is kept for output): shorten it or raise --max-seq-len"
            )
        return ids

    def _apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        if not messages:
            raise ValueError("messages is empty: give at least one {'role': ..., 'content': ...} message")
        for message in messages:
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ValueError(f"each message needs a 'role' and a 'content' string; got {message!r}"[:200])
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template: send text or input_ids instead")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)
