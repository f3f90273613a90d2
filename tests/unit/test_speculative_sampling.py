"""Sampling with draft verification: every implementation against the reference, and the reference against the
distribution it must keep (total-variation distance over many draws).

The Triton kernel runs through Triton's interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1); the NPU path
runs its host round trip on CPU tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from triton_ops import NO_DRAFT, sample_and_verify, sample_and_verify_npu, sample_and_verify_reference

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]
NUM_DRAWS = 200_000
MAX_TOTAL_VARIATION = 0.01


@pytest.fixture(params=["reference", "dispatch", "npu", "triton_interpreter"])
def kernel(request: pytest.FixtureRequest) -> Kernel:
    if request.param == "triton_interpreter":
        triton = pytest.importorskip("triton")
        if not triton.knobs.runtime.interpret:
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
        from triton_ops.speculative_sampling_triton import sample_and_verify_triton

        return sample_and_verify_triton
    return {"reference": sample_and_verify_reference, "dispatch": sample_and_verify, "npu": sample_and_verify_npu}[
        request.param
    ]


def random_problem(rows: int, vocab: int, seed: int, with_draft_probs: bool) -> dict[str, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    probs = torch.rand(rows, vocab, generator=generator) ** 4  # peaked rows, like softmax outputs
    probs[:, ::7] = 0.0  # masked tokens
    drafts = torch.randint(0, vocab, (rows,), generator=generator)
    drafts[::3] = NO_DRAFT
    draft_probs = uniforms = None
    if with_draft_probs:
        draft_probs = torch.softmax(torch.randn(rows, vocab, generator=generator), dim=-1)
        uniforms = torch.rand(rows, generator=generator)
    exponentials = torch.empty(rows, vocab).exponential_(generator=generator)
    return {
        "probs": probs,
        "exponentials": exponentials,
        "draft_token_ids": drafts,
        "draft_probs": draft_probs,
        "uniforms": uniforms,
    }


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["deterministic drafts", "draft distribution"])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 5), (17, 1000), (6, 3000)])
def test_every_implementation_matches_the_reference(
    kernel: Kernel, rows: int, vocab: int, with_draft_probs: bool
) -> None:
    problem = random_problem(rows, vocab, seed=rows * vocab, with_draft_probs=with_draft_probs)
    accepted, tokens = kernel(**problem)
    expected_accepted, expected_tokens = sample_and_verify_reference(**problem)
    assert torch.equal(accepted, expected_accepted) and torch.equal(tokens, expected_tokens)
    assert not accepted[problem["draft_token_ids"] == NO_DRAFT].any()  # type: ignore[operator]


def test_a_deterministic_draft_is_accepted_exactly_when_plain_sampling_draws_it(kernel: Kernel) -> None:
    problem = random_problem(64, 300, seed=3, with_draft_probs=False)
    accepted, tokens = kernel(**problem)
    plain = (problem["probs"] / problem["exponentials"]).argmax(dim=-1)  # type: ignore[operator]
    assert torch.equal(tokens, plain)  # speculation on or off: the same token at every position
    drafts = problem["draft_token_ids"]
    assert torch.equal(accepted, (drafts >= 0) & (plain == drafts))  # type: ignore[operator]


def test_malformed_input_is_refused() -> None:
    probs = torch.rand(2, 4)
    with pytest.raises(ValueError, match="exponentials"):
        sample_and_verify(probs, torch.rand(2, 3), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="draft token ids"):
        sample_and_verify(probs, torch.rand(2, 4), torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="go together"):
        sample_and_verify(probs, torch.rand(2, 4), torch.tensor([0, 1]), draft_probs=torch.rand(2, 4))


def total_variation(counts: torch.Tensor, target: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - target / target.sum()).abs().sum().item()


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["deterministic drafts", "draft distribution"])
def test_rejection_sampling_keeps_the_target_distribution(with_draft_probs: bool) -> None:
    """Over 200k draws on an 8-token vocabulary, the verified tokens follow ``p`` (not the drafts' ``q``), and a
    draft stands with probability ``sum min(p, q)`` (``p(d)`` for a fixed draft)."""
    generator = torch.Generator().manual_seed(11)
    vocab = 8
    target = torch.tensor([0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.12, 0.08]) * 3.0  # unnormalised on purpose
    probs = target.expand(NUM_DRAWS, vocab)
    exponentials = torch.empty(NUM_DRAWS, vocab).exponential_(generator=generator)
    if with_draft_probs:
        q = torch.tensor([0.05, 0.40, 0.05, 0.0, 0.30, 0.05, 0.10, 0.05])
        drafts = torch.multinomial(q, NUM_DRAWS, replacement=True, generator=generator)
        draft_probs, uniforms = q.expand(NUM_DRAWS, vocab), torch.rand(NUM_DRAWS, generator=generator)
        expected_acceptance = torch.minimum(target / target.sum(), q).sum().item()
    else:
        drafts = torch.full((NUM_DRAWS,), 2)
        draft_probs = uniforms = None
        expected_acceptance = (target[2] / target.sum()).item()
    accepted, tokens = sample_and_verify(probs, exponentials, drafts, draft_probs, uniforms)
    counts = torch.bincount(tokens, minlength=vocab).float()
    assert total_variation(counts, target) < MAX_TOTAL_VARIATION
    assert counts[3] == 0  # a zero-probability (masked) token is never produced
    assert abs(accepted.float().mean().item() - expected_acceptance) < 0.01
