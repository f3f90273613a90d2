"""Logit bias, penalties, ``min_new_tokens`` and min-p with a real grammar and the real SmolLM2 vocabulary: each
knob does what SGLang and vLLM define, the grammar mask is applied after them (no knob re-enables a token it
disallows), and a draft row is adjusted exactly as the same position would be without drafts."""

from __future__ import annotations

import math

import pytest
import torch

from scheduler.io_struct import SamplingParams
from scheduler.request import Req
from scheduler.sampler import row_logprobs, sample
from scheduler.sampling_batch_info import SamplingBatchInfo
from sglang_constrained.backends.base import BaseGrammarObject
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.conformance import compile_grammar
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import allowed_tokens, encode_exactly

DIGITS = r"[0-9]{3}"


def batch_info(setup: TokenizerSetup, build_backend: BackendBuilder | None = None) -> SamplingBatchInfo:
    layout = build_backend("xgrammar", setup).mask_layout if build_backend is not None else None
    return SamplingBatchInfo(setup.vocab_size, 4, mask_layout=layout, max_rows_per_request=4, eos_token_ids=[0, 2])


def request(params: SamplingParams, grammar: BaseGrammarObject | None = None, output: list[int] | None = None) -> Req:
    return Req(
        rid="r",
        client_id=b"c",
        prompt_ids=[10, 11, 12],
        sampling_params=params,
        grammar=grammar,
        output_ids=list(output or []),
        top_logprobs_num=5,
    )


def random_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4


def adjusted(info: SamplingBatchInfo, reqs: list[Req], drafts: list[list[int]] | None = None) -> torch.Tensor:
    info.prepare(reqs, drafts)
    info.update_regex_vocab_mask()
    logits = random_logits(len(info.row_owners), info.vocab_size)
    info.apply_logits_bias(logits)
    return logits


def test_each_knob_follows_its_definition(smollm2_tokenizer: TokenizerSetup) -> None:
    """Bias added; repetition divides positive and multiplies negative logits of prompt and output tokens;
    frequency per occurrence and presence once, over the output only."""
    info = batch_info(smollm2_tokenizer)
    params = SamplingParams(
        logit_bias={"40": 5.0}, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25
    )
    logits = adjusted(info, [request(params, output=[30, 30, 31])])[0]
    raw = random_logits(1, info.vocab_size)[0]
    assert logits[40] == raw[40] + 5.0
    for token in (10, 11, 12):  # prompt: repetition only
        assert logits[token] == (raw[token] / 2 if raw[token] > 0 else raw[token] * 2)
    rep = lambda t: raw[t] / 2 if raw[t] > 0 else raw[t] * 2  # noqa: E731
    assert logits[30] == rep(30) - (2 * 0.5 + 0.25)
    assert logits[31] == rep(31) - (1 * 0.5 + 0.25)
    untouched = [t for t in range(100) if t not in (10, 11, 12, 30, 31, 40)]
    assert torch.equal(logits[untouched], raw[untouched])


def test_no_knob_re_enables_a_token_the_grammar_disallows(
    smollm2_tokenizer: TokenizerSetup, build_backend: BackendBuilder
) -> None:
    """The strongest bias and penalties towards letters under a digits-only grammar: every letter stays -inf, and no
    disallowed token appears among the top logprobs, which are the log-softmax over the allowed tokens."""
    setup = smollm2_tokenizer
    grammar = compile_grammar(build_backend("xgrammar", setup), make_grammar_key("regex", DIGITS))
    allowed = allowed_tokens(grammar, setup.vocab_size)
    letters = encode_exactly(setup, "abc xyz")
    params = SamplingParams(
        regex=DIGITS,
        temperature=0.7,
        logit_bias={str(t): 100.0 for t in letters},
        repetition_penalty=0.1,
        frequency_penalty=-2.0,
        presence_penalty=-2.0,
    )
    info = batch_info(setup, build_backend)
    req = request(params, grammar, output=letters)
    logits = adjusted(info, [req])
    disallowed = torch.ones(setup.vocab_size, dtype=torch.bool)
    disallowed[list(allowed)] = False
    assert torch.isneginf(logits[0][disallowed]).all()
    logprobs = row_logprobs(logits, info.rows)[0]
    assert math.isclose(float(logprobs.exp().sum()), 1.0, rel_tol=1e-5)
    top = logprobs.topk(50).indices.tolist()
    assert set(top[: len(allowed)]) <= allowed
    assert logprobs[top[0]] == torch.log_softmax(logits[0] / 0.7, dim=-1)[top[0]]


def test_min_new_tokens_bans_stop_tokens_until_then_unless_the_grammar_allows_nothing_else(
    smollm2_tokenizer: TokenizerSetup, build_backend: BackendBuilder
) -> None:
    setup = smollm2_tokenizer
    info = batch_info(setup, build_backend)
    params = SamplingParams(min_new_tokens=3, stop_token_ids=[50])
    free = adjusted(info, [request(params, output=[7])])[0]
    assert torch.isneginf(free[[0, 2, 50]]).all() and not torch.isneginf(free[3:50]).any()
    later = adjusted(info, [request(params, output=[7, 8, 9])])[0]
    assert not torch.isneginf(later[[0, 2, 50]]).any()
    no_eos = adjusted(info, [request(SamplingParams(min_new_tokens=3, ignore_eos=True), output=[7])])[0]
    assert not torch.isneginf(no_eos[[0, 2]]).any()
    # a complete constraint allows only the stop token: min_new_tokens cannot keep it going
    grammar = compile_grammar(build_backend("xgrammar", setup), make_grammar_key("regex", DIGITS))
    for token in encode_exactly(setup, "123"):
        grammar.accept_token(token)
    done = adjusted(info, [request(SamplingParams(regex=DIGITS, min_new_tokens=10), grammar, output=[1, 2])])[0]
    (stop,) = allowed_tokens(grammar, setup.vocab_size)
    assert not torch.isneginf(done[stop]) and int(torch.isfinite(done).sum()) == 1


@pytest.mark.parametrize("min_new_tokens", [0, 3])
def test_a_draft_row_is_adjusted_as_the_same_position_without_drafts(
    smollm2_tokenizer: TokenizerSetup, min_new_tokens: int
) -> None:
    """Row ``j`` after drafts ``d[:j]`` gets exactly the logits of a request whose output already holds ``d[:j]``."""
    info = batch_info(smollm2_tokenizer)
    params = SamplingParams(
        frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.3, min_new_tokens=min_new_tokens
    )
    drafts = [30, 0, 30]
    info.prepare([request(params, output=[30])], [drafts])
    logits = random_logits(1, info.vocab_size).repeat(len(drafts) + 1, 1)
    info.apply_logits_bias(logits)
    for j in range(len(drafts) + 1):
        info.prepare([request(params, output=[30, *drafts[:j]])])
        alone = random_logits(1, info.vocab_size)
        info.apply_logits_bias(alone)
        assert torch.equal(logits[j], alone[0]), f"draft row {j} differs"


def test_min_p_keeps_only_tokens_near_the_most_likely_one(smollm2_tokenizer: TokenizerSetup) -> None:
    """p = (0.6, 0.3, 0.1): min_p 0.6 keeps the first token only (0.3 < 0.36); without it, others get sampled."""
    info = batch_info(smollm2_tokenizer)
    logits = torch.full((1, info.vocab_size), float("-inf"))
    logits[0, :3] = torch.tensor([0.6, 0.3, 0.1]).log()

    def tokens(min_p: float) -> set[int | None]:
        drawn = set()
        for seed in range(40):
            info.prepare([Req("r", b"c", [1], SamplingParams(min_p=min_p, seed=seed), sampling_seed=seed)])
            drawn.update(sample(logits.clone(), info.rows))
        return drawn

    assert tokens(0.6) == {0}
    assert tokens(0.0) == {0, 1, 2}
