"""Per-step sampling state of a batch: sampling parameters per logits row, their logit adjustments (bias, penalties,
``min_new_tokens``), and the grammar vocabulary masks, applied after the adjustments."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from scheduler.finish_policy import stop_token_ids
from scheduler.grammar_steps import Lookahead
from scheduler.logits_processing import RowAdjustment, adjust_logits
from scheduler.request import Req
from scheduler.sampler import SamplingRows
from sglang_constrained.backends.base import BaseGrammarObject
from triton_ops import NO_DRAFT, apply_token_bitmask_inplace
from triton_ops.bitmask_format import VocabMaskLayout, reset_rows


class SamplingBatchInfo:
    """Sampling parameters for the logits rows of one forward, and their vocabulary masks.

    A request has one row per position it samples: one, or one more than its drafts when they are verified (row
    ``j`` follows its first ``j`` drafts). One object lives as long as the scheduler: the mask buffer
    ``[max_batch_size * max_rows_per_request, words]`` is allocated once, in the grammar backend's ``mask_layout``
    (None without a backend: nothing is ever masked), and reused every step. Only rows of active grammars are
    filled; rows filled in an earlier step and not now are reset to all-allowed, so free requests and finished
    grammars never see a stale mask.
    """

    def __init__(
        self,
        vocab_size: int,
        max_batch_size: int,
        device: torch.device | str = "cpu",
        mask_layout: VocabMaskLayout | None = None,
        max_rows_per_request: int = 1,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.max_rows = max_batch_size * max_rows_per_request
        self.device = torch.device(device)
        self.mask_layout = mask_layout
        self.eos_token_ids = list(eos_token_ids)
        self.reqs: list[Req] = []
        self.drafts: list[list[int]] = []
        self.row_owners: list[int] = []
        self.rows = SamplingRows(torch.ones(0), torch.ones(0), torch.zeros(0), [], [], [], [], [])
        self.adjustments: dict[int, RowAdjustment] = {}
        self.vocab_mask: torch.Tensor | None = None
        self._mask_buffer: torch.Tensor | None = None
        self._filled_rows: set[int] = set()
        self.fill_errors: dict[int, str] = {}

    def prepare(self, reqs: list[Req], drafts: Sequence[list[int]] | None = None) -> None:
        """Point at this step's requests and their drafts: ``reqs[i]`` owns ``len(drafts[i]) + 1`` consecutive rows
        of the logits (one without drafts)."""
        drafts = [list(d) for d in drafts] if drafts is not None else [[] for _ in reqs]
        if len(reqs) > self.max_batch_size or sum(len(d) + 1 for d in drafts) > self.max_rows:
            raise ValueError(f"batch of {len(reqs)} requests exceeds the sampling buffer ({self.max_rows} rows)")
        self.reqs, self.drafts = reqs, drafts
        self.row_owners = [i for i, d in enumerate(drafts) for _ in range(len(d) + 1)]
        params = [reqs[i].sampling_params for i in self.row_owners]
        first_row = {i: self.row_owners.index(i) for i in range(len(reqs))}
        self.rows = SamplingRows(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            top_ks=[p.top_k for p in params],
            seeds=[reqs[i].sampling_seed for i in self.row_owners],
            positions=[len(reqs[i].output_ids) + row - first_row[i] for row, i in enumerate(self.row_owners)],
            draft_token_ids=[
                drafts[i][row - first_row[i]] if row - first_row[i] < len(drafts[i]) else NO_DRAFT
                for row, i in enumerate(self.row_owners)
            ],
            top_logprobs_nums=[reqs[i].top_logprobs_num for i in self.row_owners],
        )
        self.adjustments = {}
        for row, i in enumerate(self.row_owners):
            adjustment = self._row_adjustment(reqs[i], drafts[i][: row - first_row[i]])
            if adjustment is not None:
                self.adjustments[row] = adjustment

    def request_rows(self) -> list[range]:
        """Each request's rows of this step's logits, in request order."""
        rows = []
        first = 0
        for drafts in self.drafts:
            rows.append(range(first, first + len(drafts) + 1))
            first += len(drafts) + 1
        return rows

    def _row_adjustment(self, req: Req, drafts_before: list[int]) -> RowAdjustment | None:
        """How ``req``'s row after ``drafts_before`` is adjusted (None: not at all); drafts count as output."""
        params = req.sampling_params
        position = len(req.output_ids) + len(drafts_before)
        banned = []
        if position < params.min_new_tokens:
            banned = sorted(stop_token_ids(params, self.eos_token_ids))
        if not (params.logit_bias or params.has_penalties or banned):
            return None
        return RowAdjustment(
            prompt_ids=req.prompt_ids if params.repetition_penalty != 1.0 else [],
            history=req.output_ids + drafts_before if params.has_penalties else [],
            logit_bias={int(token): bias for token, bias in params.logit_bias.items()},
            repetition_penalty=params.repetition_penalty,
            frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty,
            banned_ids=banned,
        )

    def update_regex_vocab_mask(self) -> None:
        """Fill the mask rows of requests with an active grammar; ``vocab_mask`` is None when there is none.

        A request's row ``j`` is filled after its grammar accepts its first ``j`` drafts (then rolled back). A
        grammar that fails to fill gets rows that allow nothing and its error in ``fill_errors`` (keyed by its
        request's index), so that only its own request fails.
        """
        self.fill_errors = {}
        active = [i for i, req in enumerate(self.reqs) if _is_active(req.ready_grammar)]
        if not active and not self._filled_rows:
            self.vocab_mask = None
            return
        mask = self._buffer()
        active_rows: set[int] = set()
        for i in active:
            first = self.row_owners.index(i)
            rows = range(first, first + len(self.drafts[i]) + 1)
            active_rows.update(rows)
            try:
                self._fill_request_rows(mask, self.reqs[i].ready_grammar, self.drafts[i], rows)
            except Exception as e:  # an engine failure must not take the other requests down
                mask[rows.start : rows.stop].fill_(0)
                self.fill_errors[i] = str(e)
        reset_rows(mask, self._filled_rows - active_rows)
        self._filled_rows = active_rows
        self.vocab_mask = mask[: len(self.row_owners)] if active else None

    @staticmethod
    def _fill_request_rows(
        mask: torch.Tensor, grammar: BaseGrammarObject | None, drafts: list[int], rows: range
    ) -> None:
        """Row ``rows[j]`` after the first ``j`` drafts; the grammar ends where it started. Past the grammar's end
        (a draft that terminates it) rows stay all-allowed: the request finishes before they are read."""
        with Lookahead(grammar) as ahead:
            ahead.fill_vocab_mask(mask, rows[0])
            for j, draft in enumerate(drafts, start=1):
                ahead.accept(draft)
                if ahead.is_terminated:
                    reset_rows(mask, rows[j:])
                    break
                ahead.fill_vocab_mask(mask, rows[j])

    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """Adjust the rows (bias, penalties, stop-token ban), then set the logits of tokens the grammar disallows to
        -inf, in place (``logits`` is ``[rows, vocab]``). Where the ban leaves a grammar nothing (it allows only stop
        tokens: the constraint is complete), the ban is lifted: the grammar's end wins over ``min_new_tokens``."""
        before_ban = adjust_logits(logits, self.adjustments)
        if self.vocab_mask is None:
            return
        mask = self.vocab_mask.to(logits.device, non_blocking=True)
        apply_token_bitmask_inplace(logits, mask)
        emptied = [row for row in before_ban if bool(torch.isneginf(logits[row]).all())]
        if emptied:
            restored = torch.stack([before_ban[row] for row in emptied])
            apply_token_bitmask_inplace(restored, mask[emptied])
            logits[emptied] = restored

    def _buffer(self) -> torch.Tensor:
        if self._mask_buffer is None:
            if self.mask_layout is None:
                raise RuntimeError("a grammar is active but the batch was built without a grammar backend's layout")
            self._mask_buffer = self.mask_layout.allocate(self.max_rows, self.device)
        return self._mask_buffer


def _is_active(grammar: BaseGrammarObject | None) -> bool:
    return grammar is not None and not grammar.finished and not grammar.is_terminated()
