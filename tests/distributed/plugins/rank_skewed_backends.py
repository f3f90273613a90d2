"""Grammar backends that behave differently on rank 1, for the multi-rank tests.

Both are the real xgrammar backend with one twist on rank 1: ``slow-on-rank-1`` compiles JSON schemas 3 s later,
``fail-on-rank-1`` refuses JSON schemas titled ``refused-on-rank-1``. Neither shares its grammars, so that each rank
compiles its own (as a registered backend that cannot export does) and the ranks' verdicts are agreed, the path
these tests are about; rank 0 compiles for every rank otherwise. Importing this module registers the second one (the
``--import-module`` path); the first is installed through the entry-point group.
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.base_grammar_backend import (
    BaseGrammarObject,
    GrammarBackendArgs,
    InvalidGrammarObject,
    register_grammar_backend,
)

SLOW_RANK_DELAY_S = 3.0
REFUSED_TITLE = "refused-on-rank-1"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class CompiledOnEachRank(XGrammarGrammarBackend):
    @property
    def can_share_grammars(self) -> bool:
        return False


class SlowOnRank1Backend(CompiledOnEachRank):
    name = "slow-on-rank-1"

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        if _rank() == 1:
            time.sleep(SLOW_RANK_DELAY_S)
        return super().dispatch_json(key_string)


class FailOnRank1Backend(CompiledOnEachRank):
    name = "fail-on-rank-1"

    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        if _rank() == 1 and REFUSED_TITLE in key_string:
            return InvalidGrammarObject(f"rank 1 refuses schemas titled {REFUSED_TITLE!r}")
        return super().dispatch_json(key_string)


def make_slow_on_rank_1(server_args: GrammarBackendArgs, tokenizer: Any, vocab_size: int, eos: list[int]) -> Any:
    return SlowOnRank1Backend(server_args, tokenizer, vocab_size, eos)


register_grammar_backend("fail-on-rank-1", FailOnRank1Backend)
