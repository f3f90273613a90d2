"""The tokenizer's role in the server: a request's prompt (text, chat messages or token ids) as checked token ids.

The HTTP frontend tokenises its prompts with this too (in its own process, on a worker thread), so that only the
scheduler's own zmq clients have text tokenised by the scheduler; either way a prompt too long in bytes to fit the
context is refused before it is tokenised.
"""

from __future__ import annotations

import inspect
from typing import Any

import jinja2


class PromptEncoder:
    """Turns exactly one prompt source into token ids that fit the model: in range, non-empty, within the context.

    Chat messages go through the tokenizer's chat template with the generation prompt added. ``max_prompt_bytes``:
    no prompt of more UTF-8 bytes can fit the context (each token stands for at most as many bytes as its longest).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_seq_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        # A token's text in the vocabulary takes at least as many UTF-8 bytes as the text it stands for ("Ġ" is two
        # bytes for one space, "<0x0A>" six for one byte): the longest one bounds the bytes per token from above.
        longest_token_bytes = max(len(token.encode()) for token in tokenizer.get_vocab())
        self.max_prompt_bytes = (max_seq_len - 1) * longest_token_bytes

    def encode(
        self,
        text: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of exactly one prompt source; raises ValueError naming what is wrong. ``chat_template_kwargs``:
        variables the chat template of ``messages`` reads (Qwen3's ``enable_thinking``). ``continue_final_message``:
        a final assistant message is continued, as SGLang does it: the messages before it go through the template
        with the generation prompt, and its text follows, tokenised without special tokens. ``tools``: the tools the
        chat template renders (OpenAI's shape), as Hugging Face templates take them; ``documents``: the documents it
        renders (retrieval-augmented generation, as Hugging Face templates take them). A message the template refuses
        (its ``raise_exception``) is a ValueError naming the template's reason."""
        sources = (("text", text), ("messages", messages), ("input_ids", input_ids))
        given = [name for name, value in sources if value is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of text, messages or input_ids (got {given or 'none'})")
        self._check_prompt_bytes(text, messages)
        if text is not None:
            ids = list(self.tokenizer.encode(text))
        elif messages is not None and continue_final_message and messages and _role(messages[-1]) == "assistant":
            if len(messages) == 1:
                raise ValueError(
                    "continue_final_message continues a final assistant message after the messages before it: "
                    "give at least one message before it"
                )
            ids = self.chat_ids(messages[:-1], chat_template_kwargs or {}, tools, documents)
            ids += self._continued_text(messages[-1])
        elif messages is not None:
            ids = self.chat_ids(messages, chat_template_kwargs or {}, tools, documents)
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

    def encode_prediction(self, prediction: str | list[int]) -> list[int]:
        """A predicted output's token ids: text tokenised without special tokens (it stands for the answer, which
        follows the prompt), or token ids checked; raises ValueError naming ``prediction``. No output can be longer
        than the context, so neither may a prediction be."""
        if isinstance(prediction, str):
            num_bytes = len(prediction.encode(errors="replace"))
            if num_bytes > self.max_prompt_bytes:
                raise ValueError(
                    f"the prediction is {num_bytes:,} bytes, more than any output of --max-seq-len {self.max_seq_len} "
                    f"tokens can be ({self.max_prompt_bytes:,} bytes): shorten it"
                )
            ids = list(self.tokenizer.encode(prediction, add_special_tokens=False))
        else:
            ids = list(prediction)
            bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
            if bad:
                raise ValueError(f"prediction token ids must be in [0, {self.vocab_size}); got {bad[:5]}")
        if len(ids) > self.max_seq_len:
            raise ValueError(
                f"the prediction has {len(ids)} tokens, more than --max-seq-len {self.max_seq_len} lets any output "
                "have: shorten it"
            )
        return ids

    def _check_prompt_bytes(self, text: str | None, messages: list[dict[str, Any]] | None) -> None:
        if text is not None:
            num_bytes = len(text.encode(errors="replace"))
        else:
            contents = (m.get("content") for m in messages or [] if isinstance(m, dict))
            num_bytes = sum(len(c.encode(errors="replace")) for c in contents if isinstance(c, str))
        if num_bytes > self.max_prompt_bytes:
            raise ValueError(
                f"the prompt is {num_bytes:,} bytes, more than any prompt that fits --max-seq-len {self.max_seq_len} "
                f"tokens can be ({self.max_prompt_bytes:,} bytes): shorten it"
            )

    def _continued_text(self, message: dict[str, Any]) -> list[int]:
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(f"each message needs a 'role' and a 'content' string; got {message!r}"[:200])
        return list(self.tokenizer.encode(content, add_special_tokens=False))

    def chat_ids(
        self,
        messages: list[dict[str, Any]],
        template_kwargs: dict[str, Any],
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``messages`` rendered by the chat template as written (``tools``, ``documents`` and ``template_kwargs``
        passed to it) and tokenised; raises ValueError naming what is wrong, or why the template refused them."""
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
        reserved = sorted(set(template_kwargs) & set(inspect.signature(self.tokenizer.apply_chat_template).parameters))
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets it")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **template_kwargs,
            )
        except jinja2.TemplateError as e:  # the template's raise_exception, or a variable it cannot read
            raise ValueError(f"the chat template refused these messages: {e}"[:500]) from e
        return list(ids)


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None
