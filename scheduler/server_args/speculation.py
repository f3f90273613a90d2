"""The speculation part of the settings: where drafts come from and how many a forward verifies."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.server_args.options import option

MAX_DRAFT_TOKENS = 16
SPECULATIVE_ALGORITHMS = ("auto", "none", "ngram", "grammar", "grammar+ngram")
"""Draft sources: none (one forward per token, no jump-forward), n-gram lookup (in the prompt and output, then in the
n-gram cache of earlier outputs, ``--speculative-ngram-capacity``), the grammar's forced continuation (with
jump-forward over forced tokens), or both. auto leaves the choice to the model runner
(``scheduler.speculative.resolve_algorithm``). A request's predicted output drafts under every algorithm but none:
none verifies no drafts at all, so a prediction is then only counted (usage), as a latency hint that cannot help
may be."""


@dataclass(frozen=True)
class SpeculationArgs:
    """The user's choice of draft sources (``auto`` stays auto here) and the draft limits."""

    speculative_algorithm: str = option(
        "auto",
        "draft tokens verified in one forward, and jump-forward over tokens the grammar forces; on the exact runner "
        "outputs are the same as without (greedy and seeded): none decodes one forward per token; auto is "
        "grammar+ngram on the exact runner and none on llamacpp; a request's predicted output (prediction) drafts "
        "under every algorithm but none",
        choices=SPECULATIVE_ALGORITHMS,
    )
    speculative_num_draft_tokens: int = option(
        8,
        f"the most drafts per request and forward (0 to {MAX_DRAFT_TOKENS}; fewer as the batch grows; 0 turns "
        "drafts off, predictions' included)",
    )
    speculative_num_prediction_tokens: int = option(
        MAX_DRAFT_TOKENS,
        "the most drafts per forward of a request with a predicted output (prediction), taken from it (0 to "
        f"{MAX_DRAFT_TOKENS}; they stand far more often than the other sources')",
    )
    speculative_ngram_capacity: int = option(
        65536,
        "n-grams of earlier outputs kept to draft from, across requests (least recently used evicted; used by the "
        "ngram algorithms where prompt lookup finds less); 0 keeps none",
    )

    @property
    def max_drafts_per_request(self) -> int:
        """The most drafts one request verifies in a forward, from any source."""
        return max(self.speculative_num_draft_tokens, self.speculative_num_prediction_tokens)

    def __post_init__(self) -> None:
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {SPECULATIVE_ALGORITHMS}")
        if not 0 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-draft-tokens must be in [0, {MAX_DRAFT_TOKENS}]")
        if not 0 <= self.speculative_num_prediction_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-prediction-tokens must be in [0, {MAX_DRAFT_TOKENS}]")
        if self.speculative_ngram_capacity < 0:
            raise ValueError("--speculative-ngram-capacity must be 0 (no cache) or more")
