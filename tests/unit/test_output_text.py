"""A request's output text with SGLang's and vLLM's text fields, on the real SmolLM2 tokenizer: ``no_stop_trim``,
stop strings only once ``min_new_tokens`` are out, a stop token left out of the text, and special tokens shown with
``skip_special_tokens`` off (spaced as ``spaces_between_special_tokens`` asks)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.output_text import OutputText
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup


def walk(text: OutputText, ids: list[int], min_new_tokens: int = 0) -> None:
    for end in range(1, len(ids) + 1):
        text.update(ids[:end], can_stop=end >= min_new_tokens)
        if text.matched_stop is not None:
            return


def test_a_stop_string_is_cut_unless_no_stop_trim(smollm2_tokenizer: TokenizerSetup) -> None:
    ids = smollm2_tokenizer.encode("one, two. three, four.")
    trimmed = OutputText(smollm2_tokenizer.tokenizer, ["."], needs_live_text=False)
    walk(trimmed, ids)
    kept = OutputText(smollm2_tokenizer.tokenizer, ["."], needs_live_text=False, no_stop_trim=True)
    walk(kept, ids)
    assert (trimmed.final_text(ids), kept.final_text(ids)) == ("one, two", "one, two.")


def test_no_stop_string_counts_before_min_new_tokens(smollm2_tokenizer: TokenizerSetup) -> None:
    ids = smollm2_tokenizer.encode("one, two. three, four. five")
    text = OutputText(smollm2_tokenizer.tokenizer, ["."], needs_live_text=False)
    walk(text, ids, min_new_tokens=len(smollm2_tokenizer.encode("one, two. three")))
    assert text.final_text(ids) == "one, two. three, four"


def test_a_stop_token_is_left_out_unless_no_stop_trim(smollm2_tokenizer: TokenizerSetup) -> None:
    ids = smollm2_tokenizer.encode("Hello world")
    for no_stop_trim, expected in ((False, "Hello"), (True, "Hello world")):
        text = OutputText(smollm2_tokenizer.tokenizer, [], needs_live_text=False, no_stop_trim=no_stop_trim)
        assert text.final_text(ids, ends_with_stop_token=True) == expected


def test_special_tokens_are_shown_when_not_skipped(smollm2_tokenizer: TokenizerSetup) -> None:
    tokenizer = smollm2_tokenizer.tokenizer
    ids = [*smollm2_tokenizer.encode("Hi"), smollm2_tokenizer.eos_token_ids[0], *smollm2_tokenizer.encode("there")]
    eos = tokenizer.decode([smollm2_tokenizer.eos_token_ids[0]])

    def final(**options: bool) -> str:
        return OutputText(tokenizer, [], needs_live_text=False, **options).final_text(ids)

    assert final() == "Hithere"
    assert final(skip_special_tokens=False, spaces_between_special_tokens=False) == f"Hi{eos}there"
    assert final(skip_special_tokens=False) == f"Hi {eos} there"


PIECES = ["héllo", " wörld", "😀", "中文", " ", "\n", "<|im_end|>", "a", "   x", "\u200b", '{"k": [1, 2]}']


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_streamed_text_is_the_whole_outputs_text_at_every_token(tokenizer_case, skip_special_tokens, data):
    """Streaming decodes token by token; after every token the live text (which stop strings read) is the whole output
    decoded, on text and on arbitrary ids (special tokens, bytes of split characters), and when earlier tokens change
    (a jump-forward retokenised them); the finished text is the whole output decoded."""
    tokenizer = tokenizer_case.tokenizer
    if data.draw(st.booleans()):
        ids = tokenizer_case.encode("".join(data.draw(st.lists(st.sampled_from(PIECES), max_size=12))))
    else:
        ids = data.draw(st.lists(st.integers(0, tokenizer_case.vocab_size - 1), max_size=24))
    options = {"skip_special_tokens": skip_special_tokens, "spaces_between_special_tokens": False}
    text = OutputText(tokenizer, [], needs_live_text=True, **options)
    retokenised_at = data.draw(st.integers(0, len(ids)))
    for end in range(1, len(ids) + 1):
        seen = ids[:end]
        if end == retokenised_at:
            text.update([*seen[:-1], (seen[-1] + 1) % tokenizer_case.vocab_size, seen[-1]])
        text.update(seen)
        whole = tokenizer.decode(seen, skip_special_tokens=skip_special_tokens)
        assert text.text == whole, seen
    assert text.final_text(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
