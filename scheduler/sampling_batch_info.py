"""Per-step sampling state of a batch: sampling parameters as tensors, and the grammar vocabulary masks."""

from __future__ import annotations

import torch

from scheduler.request import Req
from sglang_constrained.base_grammar_backend import BaseGrammarObject
from triton_ops import apply_token_bitmask_inplace, warm_up_cpu_bitmask_kernel
from triton_ops.bitmask_format import VocabMaskLayout, reset_rows


class SamplingBatchInfo:
    """Sampling tensors for the requests of one forward, and their vocabulary masks.

    One object lives as long as the scheduler: the mask buffer ``[max_batch_size, words]`` is allocated once, in
    the grammar backend's ``mask_layout`` (None without a backend: nothing is ever masked), and reused every step.
    Only rows of active grammars are filled; rows filled in an earlier step and not now are reset to
    all-allowed, so free requests and finished grammars never see a stale mask.
    """

    def __init__(
        self,
        vocab_size: int,
        max_batch_size: int,
        device: torch.device | str = "cpu",
        mask_layout: VocabMaskLayout | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.device = torch.device(device)
        self.mask_layout = mask_layout
        self.reqs: list[Req] = []
        self.temperatures = torch.ones(0)
        self.top_ps = torch.ones(0)
        self.top_ks: list[int | None] = []
        self.generators: list[torch.Generator | None] = []
        self.vocab_mask: torch.Tensor | None = None
        self._mask_buffer: torch.Tensor | None = None
        self._filled_rows: set[int] = set()
        self.fill_errors: dict[int, str] = {}

    def warm_up(self) -> None:
        """Compile the CPU mask kernel now: its first use would otherwise stall the first batch for seconds."""
        if self.device.type == "cpu" and self.mask_layout is not None:
            warm_up_cpu_bitmask_kernel(self.vocab_size)

    def prepare(self, reqs: list[Req]) -> None:
        """Point at this step's requests (row ``i`` of the logits belongs to ``reqs[i]``)."""
        if len(reqs) > self.max_batch_size:
            raise ValueError(f"batch of {len(reqs)} exceeds max_batch_size {self.max_batch_size}")
        self.reqs = reqs
        params = [req.sampling_params for req in reqs]
        self.temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        self.top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        self.top_ks = [p.top_k for p in params]
        self.generators = [req.generator for req in reqs]

    def update_regex_vocab_mask(self) -> None:
        """Fill one mask row per request with an active grammar; ``vocab_mask`` is None when there is none.

        A grammar that fails to fill its row gets a row that allows nothing and its error in ``fill_errors``,
        so that only its own request fails.
        """
        self.fill_errors = {}
        active = [(row, req.ready_grammar) for row, req in enumerate(self.reqs) if _is_active(req.ready_grammar)]
        if not active and not self._filled_rows:
            self.vocab_mask = None
            return
        mask = self._buffer()
        active_rows = {row for row, _ in active}
        reset_rows(mask, self._filled_rows - active_rows)
        for row, grammar in active:
            assert grammar is not None
            try:
                grammar.fill_vocab_mask(mask, row)
            except Exception as e:  # an engine failure must not take the other requests down
                mask[row].fill_(0)
                self.fill_errors[row] = str(e)
        self._filled_rows = active_rows
        self.vocab_mask = mask[: len(self.reqs)] if active else None

    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf in place (``logits`` is ``[batch, vocab]``)."""
        if self.vocab_mask is not None:
            apply_token_bitmask_inplace(logits, self.vocab_mask.to(logits.device, non_blocking=True))

    def _buffer(self) -> torch.Tensor:
        if self._mask_buffer is None:
            if self.mask_layout is None:
                raise RuntimeError("a grammar is active but the batch was built without a grammar backend's layout")
            self._mask_buffer = self.mask_layout.allocate(self.max_batch_size, self.device)
        return self._mask_buffer


def _is_active(grammar: BaseGrammarObject | None) -> bool:
    return grammar is not None and not grammar.finished and not grammar.is_terminated()
