"""``--grammar-backend auto``: the first backend of the order that compiles a constraint exactly wins, and says why.

Checked on both real tokenizers: the choice and its reasons (stats, log, counters), the error when every backend
refuses, one cache for the whole order, registered backends in the order, a batch whose rows come from three
backends, random walks through a fallback grammar's masks, the reasoner around ``auto``, every constraint kind
(the choice fixes among them), exactness (open objects stay open, narrowing only when allowed and then named), a
slow first choice handed over, MaskBench cases judged against what the other backends' records imply, and
``auto``'s coverage of the vendored MaskBench set against each backend's alone.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler.distributed import DistributedContext
from scheduler.io_struct import SamplingParams
from scheduler.request import Req
from scheduler.sampling_batch_info import SamplingBatchInfo
from scheduler.server_args import GrammarArgs, parse_server_args
from scheduler.turn_transport import LockstepRanks
from scripts.calibrate_xgrammar_export import ebnf_alternatives
from sglang_constrained.backends.auto import MAX_REFUSED_BY_ALL_CHARS, STILL_COMPILING, AutoGrammarBackend
from sglang_constrained.backends.llguidance.backend import GuidanceBackend
from sglang_constrained.backends.llguidance.grammar import GuidanceGrammar
from sglang_constrained.backends.outlines.backend import OutlinesGrammar
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.reasoner import (
    ReasonerGrammarBackend,
    ReasonerGrammarObject,
    think_end_token_id,
)
from sglang_constrained.backends.xgrammar.grammar import XGrammarGrammar
from sglang_constrained.base_grammar_backend import (
    BaseGrammarObject,
    InvalidGrammarObject,
    create_grammar_backend,
    register_grammar_backend,
)
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.errors import GrammarSpecError
from sglang_constrained.schema.strict_mode import closing_is_exact, strict_mode_narrowing
from sglang_constrained.testing.conformance import (
    KnownOutcomes,
    MaskBenchSweep,
    check_constraint,
    exact_mode_narrowings,
)
from sglang_constrained.testing.maskbench import MaskBenchCase, load_case
from sglang_constrained.testing.random_walk import json_judge, walk_and_judge
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import (
    PERSON_SCHEMA,
    PRODUCT_SCHEMA,
    accepts_text,
    allowed_tokens,
    compile_grammar,
    compile_valid,
    encode_exactly,
)
from triton_ops.bitmask_format import allowed_token_ids

XGRAMMAR_REFUSAL = "pattern together with minLength/maxLength"
REFUSED_BY_ALL_SCHEMA = {"type": "integer", "not": {"const": 3}}
MASKBENCH_ROOT = Path(__file__).parents[1] / "data" / "maskbench"
RECORDED = KnownOutcomes.load(MASKBENCH_ROOT)
VENDORED_CASES = [load_case(path) for path in sorted(MASKBENCH_ROOT.glob("*/*.json"))]
MASKBENCH_CASES = {
    "Github_trivial---o10018": "xgrammar refuses a pattern with a length bound; llguidance compiles it",
    "Github_easy---o63476": "xgrammar refuses patternProperties; llguidance compiles it",
    "Github_trivial---o41773": "xgrammar refuses a non-integer multipleOf; llguidance compiles it",
    "Handwritten---pnmp1": "every backend refuses 'not'",
    "Github_trivial---o9500": "xgrammar compiles its open objects exactly (its strict mode alone would close them)",
    "Github_trivial---o25189": "xgrammar's strict mode would close an array without items; llguidance compiles it",
}
NO_HANDOVER_S = 600.0
OPEN_PERSON = {**PERSON_SCHEMA, "properties": {**PERSON_SCHEMA["properties"], "tags": {"type": "array", "maxItems": 3}}}
"""An object open to unlisted properties, holding an array open to any items (up to three)."""

KIND_CASES = [
    ("regex", r"\(\d{3}\) \d{3}-\d{4}", ["(555) 123-4567"], ["555-123-4567"]),
    ("ebnf", 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+', ["1+22+333"], ["1++2", "+1"]),
    ("choice", ["Java", "JavaScript", "a\u0001f"], ["JavaScript", "Java", "a\u0001f"], ["Jav", "JavaScripts", "af"]),
    ("json_object", None, ['{"a": [1, {"b": null}]}', "{}"], ["[1, 2]", '"text"']),
    (
        "structural_tag",
        {"structures": [{"begin": "<f=w>", "schema": PERSON_SCHEMA, "end": "</f>"}], "triggers": ["<f="]},
        ['Here: <f=w>{"name": "Ada", "age": 36}</f> done.'],
        ['<f=w>{"name": "Ada"}</f>'],
    ),
]


def build_auto(setup: TokenizerSetup, **changes: Any) -> GrammarPipeline:
    """``auto`` ready to compile, its choices made by the order alone: no test compile runs long enough on a busy
    machine to be handed over (``test_a_slow_first_choice_hands_over...`` builds one with the default budget).
    Exact (no narrowing), what these tests are about, unless ``changes`` say otherwise."""
    args = GrammarArgs(
        grammar_backend="auto",
        **{"grammar_compile_slow_after": NO_HANDOVER_S, "grammar_auto_allow_narrowing": False, **changes},
    )
    backend = create_grammar_backend(args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    assert backend is not None
    backend.wait_until_ready()
    return backend


@pytest.fixture(scope="module")
def auto(tokenizer_case: TokenizerSetup) -> Iterator[GrammarPipeline]:
    backend = build_auto(tokenizer_case)
    assert isinstance(backend.backend, AutoGrammarBackend)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def known(auto: GrammarPipeline) -> KnownOutcomes:
    """The records, with what ``auto`` must do (its backends' narrowings of the vendored schemas taken into account)."""
    return RECORDED.with_auto(tuple(auto.backend.backends), exact_mode_narrowings(auto.backend, VENDORED_CASES))


def test_auto_takes_xgrammar_when_it_compiles(auto: GrammarPipeline) -> None:
    grammar = compile_valid(auto, "json", PERSON_SCHEMA)
    assert isinstance(grammar, XGrammarGrammar)
    assert grammar.grammar_stats is not None
    assert (grammar.grammar_stats.chosen_backend, grammar.grammar_stats.fallback_reasons) == ("xgrammar", ())


def test_auto_falls_back_to_llguidance_and_says_why(
    auto: GrammarPipeline, tokenizer_case: TokenizerSetup, caplog: pytest.LogCaptureFixture
) -> None:
    before = auto.backend.choice_counts()
    with caplog.at_level(logging.INFO, logger="sglang_constrained.backends.auto"):
        grammar = auto.backend.build_grammar(make_grammar_key("json", PRODUCT_SCHEMA))
    assert isinstance(grammar, GuidanceGrammar)
    stats = grammar.grammar_stats
    assert stats is not None and stats.chosen_backend == "llguidance"
    [(refused_by, message)] = stats.fallback_reasons
    assert refused_by == "xgrammar" and XGRAMMAR_REFUSAL in message
    assert f"auto chose llguidance for a json constraint because xgrammar refused: feature '{XGRAMMAR_REFUSAL}'" in (
        caplog.text
    )
    after = auto.backend.choice_counts()
    assert after.num_chosen.get("llguidance", 0) == before.num_chosen.get("llguidance", 0) + 1
    assert after.num_refused.get("xgrammar", 0) == before.num_refused.get("xgrammar", 0) + 1
    assert accepts_text(grammar, tokenizer_case, '{"code": "abc", "price": 2.5}')
    assert not accepts_text(grammar.copy(), tokenizer_case, '{"code": "abcdef", "price": 2.5}')
    assert not accepts_text(grammar.copy(), tokenizer_case, '{"code": "abc", "price": 2.25}')


def test_a_schema_too_large_for_xgrammar_s_compile_process_goes_to_llguidance_at_once(
    auto: GrammarPipeline, tokenizer_case: TokenizerSetup
) -> None:
    """xgrammar's refusal by its predicted memory (``xgrammar_export_cost``) hands the schema on, without waiting
    for the hand-over time (none here) or a compile process killed at the bound."""
    names = [f"p{i}" for i in range(1200)]
    schema = {"type": "object", "properties": {name: {"type": "string"} for name in names}, "required": names}
    grammar = compile_valid(auto, "json", schema)
    assert isinstance(grammar, GuidanceGrammar)
    assert grammar.grammar_stats is not None and grammar.grammar_stats.chosen_backend == "llguidance"
    [(refused_by, message)] = grammar.grammar_stats.fallback_reasons
    assert refused_by == "xgrammar" and "over the memory bound of 4,096 MiB" in message
    instance = json.dumps(dict.fromkeys(names, "x"))
    assert accepts_text(grammar, tokenizer_case, instance)


def test_a_grammar_too_large_for_xgrammar_s_compile_process_goes_to_llguidance(
    auto: GrammarPipeline, tokenizer_case: TokenizerSetup
) -> None:
    """The same for EBNF (and structural tags), judged by the grammar xgrammar compiled, before it is serialised: the
    compile process answers with the refusal in a fraction of a second instead of growing to the bound."""
    grammar = compile_valid(auto, "ebnf", ebnf_alternatives(1000))
    assert isinstance(grammar, GuidanceGrammar)
    assert grammar.grammar_stats is not None and grammar.grammar_stats.chosen_backend == "llguidance"
    [(refused_by, message)] = grammar.grammar_stats.fallback_reasons
    assert refused_by == "xgrammar" and "compiles to a grammar of" in message
    assert "over the memory bound of 4,096 MiB" in message
    assert accepts_text(grammar, tokenizer_case, "key7=abc 12,key999=z 345")


def test_when_every_backend_refuses_the_error_names_each_reason(auto: GrammarPipeline) -> None:
    before = auto.backend.choice_counts().num_refused_by_all
    grammar = auto.backend.build_grammar(make_grammar_key("json", REFUSED_BY_ALL_SCHEMA))
    assert isinstance(grammar, InvalidGrammarObject)
    message = grammar.error_message
    assert message.startswith("no grammar backend of --grammar-backend-order compiles this json constraint")
    assert "xgrammar, outlines refused: feature 'not' (at /)" in message
    assert 'llguidance refused: invalid JSON schema: Unimplemented keys: ["not"]' in message
    assert message.endswith(  # the first backend's whole message after the short reasons
        "; xgrammar: the xgrammar grammar backend does not support the JSON schema feature 'not' (at /); it would "
        "be ignored, so the schema is refused"
    )
    assert len(message) <= MAX_REFUSED_BY_ALL_CHARS
    assert grammar.grammar_stats is not None and grammar.grammar_stats.chosen_backend is None
    assert [name for name, _ in grammar.grammar_stats.fallback_reasons] == ["xgrammar", "llguidance", "outlines"]
    assert auto.backend.choice_counts().num_refused_by_all == before + 1


def test_one_cache_keyed_by_the_constraint_holds_the_chosen_grammar(tokenizer_case: TokenizerSetup) -> None:
    backend = build_auto(tokenizer_case, grammar_backend_order=("xgrammar", "llguidance"))
    assert isinstance(backend.backend, AutoGrammarBackend)
    key = make_grammar_key("json", PRODUCT_SCHEMA)
    future, is_hit = backend.get_cached_or_future_value(key)
    assert not is_hit and isinstance(future, Future)
    first = future.result(timeout=120)
    backend.set_cache(key, first)
    second, is_hit = backend.get_cached_or_future_value(key)
    assert is_hit and isinstance(first, GuidanceGrammar) and isinstance(second, GuidanceGrammar)
    assert second.grammar_stats is not None and second.grammar_stats.is_cache_hit
    assert second.grammar_stats.chosen_backend == "llguidance"
    assert backend.compile_service.num_compilations == 1
    assert [len(b.compile_service.cache) for b in backend.backend.backends.values()] == [0, 0]
    backend.shutdown()


class JsonRefusingBackend(GuidanceBackend):
    """llguidance, refusing every JSON schema: a registered backend that ``auto`` asks first."""

    name = "no-json"

    def check_json_schema(self, schema: dict[str, Any] | bool) -> None:
        raise GrammarSpecError("the no-json backend refuses JSON schemas")


def test_a_registered_backend_takes_part_in_the_order(clean_registry: None, smollm2_tokenizer: TokenizerSetup) -> None:
    register_grammar_backend("no-json", JsonRefusingBackend)
    backend = build_auto(smollm2_tokenizer, grammar_backend_order=("no-json", "xgrammar"))
    assert isinstance(backend.backend, AutoGrammarBackend)
    regex = compile_valid(backend, "regex", "[0-9]{3}")
    schema = compile_valid(backend, "json", PERSON_SCHEMA)
    assert regex.grammar_stats is not None and regex.grammar_stats.chosen_backend == "no-json"
    assert schema.grammar_stats is not None and schema.grammar_stats.chosen_backend == "xgrammar"
    assert schema.grammar_stats.fallback_reasons == (("no-json", "the no-json backend refuses JSON schemas"),)
    backend.shutdown()


class SlowRegexBackend(GuidanceBackend):
    """llguidance, compiling each regex a second late: a first choice that ``auto`` hands over."""

    name = "slow-regex"

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        time.sleep(1.0)
        return super().dispatch_regex(key_string)


class UnsharedSlowRegexBackend(SlowRegexBackend):
    """``slow-regex`` that cannot export its grammars: ranks in lockstep each compile their own with it."""

    name = "unshared-slow-regex"

    @property
    def can_share_grammars(self) -> bool:
        return False


def test_choosing_in_order_waits_for_the_first_choice_however_slow(
    clean_registry: None, smollm2_tokenizer: TokenizerSetup
) -> None:
    """Ranks in lockstep (``LockstepRanks``, built as rank 0 of two): where every backend of the order exports, rank 0
    compiles for them and its ``auto`` keeps the hand-over; where one cannot, each rank compiles its own and ``auto``
    chooses in order, a choice that does not depend on how long a compile took on that rank."""
    register_grammar_backend("slow-regex", SlowRegexBackend)
    register_grammar_backend("unshared-slow-regex", UnsharedSlowRegexBackend)
    chosen = []
    for first in ("slow-regex", "unshared-slow-regex"):
        backend = build_auto(
            smollm2_tokenizer, grammar_backend_order=(first, "xgrammar"), grammar_compile_slow_after=0.1
        )
        assert isinstance(backend.backend, AutoGrammarBackend)
        transport = LockstepRanks(DistributedContext(rank=0, world_size=2, group=None), backend, GrammarArgs())
        assert (transport.shared_grammars is not None) == (first == "slow-regex")
        grammar = backend.compile_or_load(make_grammar_key("regex", "[0-9]{3}"))  # what rank 0's store compiles
        assert grammar.grammar_stats is not None
        chosen.append(grammar.grammar_stats.chosen_backend)
        transport.shutdown(None, "the test is over")
        backend.shutdown()
    assert chosen == ["xgrammar", "unshared-slow-regex"]


@pytest.mark.parametrize(
    ("order", "error"),
    [
        ("", "names no backend"),
        ("xgrammar,auto", "cannot hold ['auto']"),
        ("xgrammar,none", "cannot hold ['none']"),
        ("xgrammar,nope", "cannot hold ['nope']; choose among ['llguidance', 'outlines', 'xgrammar']"),
        ("llguidance,xgrammar,llguidance", "names ['llguidance'] more than once"),
    ],
)
def test_a_bad_order_is_refused_with_a_clear_error(order: str, error: str) -> None:
    with pytest.raises(ValueError, match=f"--grammar-backend-order {error}".replace("[", r"\[").replace("]", r"\]")):
        parse_server_args(["--grammar-backend", "auto", "--grammar-backend-order", order])


def test_the_order_comes_from_the_command_line() -> None:
    args = parse_server_args(["--grammar-backend", "auto", "--grammar-backend-order", "llguidance, outlines"]).grammar
    assert args.grammar_backend_order == ("llguidance", "outlines")
    assert parse_server_args([]).grammar.grammar_backend_order == ("xgrammar", "llguidance", "outlines")


def test_a_backend_the_settings_rule_out_is_named(smollm2_tokenizer: TokenizerSetup) -> None:
    with pytest.raises(ValueError, match=r"auto cannot build xgrammar .* leave it out of the order"):
        build_auto(smollm2_tokenizer, constrained_json_whitespace_pattern="[ ]?")
    build_auto(
        smollm2_tokenizer, constrained_json_whitespace_pattern="[ ]?", grammar_backend_order=("llguidance",)
    ).shutdown()


def test_one_batch_mixes_the_masks_of_three_backends(tokenizer_case: TokenizerSetup) -> None:
    """Rows from outlines, xgrammar and llguidance grammars in one mask: each row is what its grammar fills alone,
    and applying the batch's mask leaves each request's allowed tokens and nothing else."""
    backend = build_auto(tokenizer_case, grammar_backend_order=("outlines", "xgrammar", "llguidance"))
    grammars = [
        compile_valid(backend, "regex", "[0-9]{3}"),
        compile_valid(backend, "ebnf", 'root ::= "yes" | "no"'),
        compile_valid(backend, "json", PRODUCT_SCHEMA),
    ]
    assert [type(g) for g in grammars] == [OutlinesGrammar, XGrammarGrammar, GuidanceGrammar]
    reqs = [
        Req(rid=str(row), client_id=b"", prompt_ids=[0], sampling_params=SamplingParams(), grammar=grammar)
        for row, grammar in enumerate(grammars)
    ]
    batch = SamplingBatchInfo(tokenizer_case.vocab_size, max_batch_size=4, mask_layout=backend.mask_layout)

    def assert_each_row_is_its_own() -> None:
        batch.prepare(reqs)
        batch.update_regex_vocab_mask()
        assert batch.vocab_mask is not None and batch.fill_errors == {}
        logits = torch.zeros(len(reqs), tokenizer_case.vocab_size)
        batch.apply_logits_bias(logits)
        for row, grammar in enumerate(grammars):
            alone = allowed_tokens(grammar, tokenizer_case.vocab_size)
            assert alone and set(allowed_token_ids(batch.vocab_mask[row], tokenizer_case.vocab_size).tolist()) == alone
            assert set(logits[row].isfinite().nonzero().flatten().tolist()) == alone

    assert_each_row_is_its_own()
    for grammar, text in zip(grammars, ("1", "ye", '{"code": "ab'), strict=True):
        for token in encode_exactly(tokenizer_case, text):
            grammar.accept_token(token)
    assert_each_row_is_its_own()
    backend.shutdown()


def test_walks_through_a_fallback_grammar_validate(auto: GrammarPipeline, tokenizer_case: TokenizerSetup) -> None:
    grammar = compile_valid(auto, "json", PRODUCT_SCHEMA)
    assert isinstance(grammar, GuidanceGrammar)
    tally = walk_and_judge(grammar, tokenizer_case, json_judge(PRODUCT_SCHEMA), num_walks=6, seed=5)
    assert tally.invalid_outputs == []
    assert tally.num_finished >= 3


def test_the_reasoner_wraps_auto(qwen35_tokenizer: TokenizerSetup) -> None:
    setup = qwen35_tokenizer
    think_end = think_end_token_id(setup.tokenizer, "qwen3")
    assert think_end is not None
    args = GrammarArgs(grammar_backend="auto", reasoning_parser="qwen3")
    backend = create_grammar_backend(args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids, think_end)
    assert isinstance(backend, ReasonerGrammarBackend) and backend.name == "auto"
    grammar = compile_valid(backend, "json", PRODUCT_SCHEMA)
    assert isinstance(grammar, ReasonerGrammarObject) and isinstance(grammar.grammar, GuidanceGrammar)
    assert grammar.grammar_stats is not None and grammar.grammar_stats.chosen_backend == "llguidance"
    grammar.maybe_init_reasoning(True)
    thought = [*encode_exactly(setup, "Let me think."), think_end]
    answer = [*thought, *encode_exactly(setup, '{"code": "ok", "price": 1}'), setup.eos_token_ids[0]]
    off_step = [*thought, *encode_exactly(setup, '{"code": "ok", "price": 1.25}')]
    assert grammar.validate_tokens(answer) == len(answer)
    assert grammar.validate_tokens(off_step) < len(off_step)
    backend.shutdown()


@pytest.mark.parametrize(("kind", "spec", "valid", "invalid"), KIND_CASES, ids=[case[0] for case in KIND_CASES])
def test_every_constraint_kind_holds_through_auto(
    auto: GrammarPipeline,
    tokenizer_case: TokenizerSetup,
    kind: str,
    spec: Any,
    valid: list[str],
    invalid: list[str],
) -> None:
    """The choice fixes among them: an option that is a prefix of another, and a control character."""
    result = check_constraint(auto, tokenizer_case, kind, make_grammar_key(kind, spec), valid, invalid)
    assert (result.compile_error, result.wrongly_rejected, result.wrongly_accepted) == (None, [], [])
    assert result.chosen_backend == "xgrammar"


def test_a_lark_grammar_goes_first_to_the_backend_that_takes_it_as_written(
    auto: GrammarPipeline, tokenizer_case: TokenizerSetup
) -> None:
    """llguidance compiles Lark itself, so it is asked before xgrammar (the order's first), which would convert it;
    the same grammar in GBNF stays with xgrammar."""
    lark = compile_valid(auto, "ebnf", 'start: term ("+" term)*\nterm: /[0-9]+/')
    gbnf = compile_valid(auto, "ebnf", 'root ::= term ("+" term)*\nterm ::= [0-9]+')
    for grammar, backend_name in ((lark, "llguidance"), (gbnf, "xgrammar")):
        assert grammar.grammar_stats is not None
        assert (grammar.grammar_stats.chosen_backend, grammar.grammar_stats.fallback_reasons) == (backend_name, ())
        assert accepts_text(grammar, tokenizer_case, "1+22") and not accepts_text(grammar, tokenizer_case, "1++2")


@pytest.mark.parametrize("name", list(MASKBENCH_CASES))
def test_maskbench_cases_match_what_the_records_imply(
    auto: GrammarPipeline, known: KnownOutcomes, tokenizer_case: TokenizerSetup, name: str
) -> None:
    [path] = MASKBENCH_ROOT.glob(f"*/{name}.json")
    case = load_case(path)
    result = MaskBenchSweep(auto, tokenizer_case, [case], num_walks=2).check(case)
    assert known.problems("auto", tokenizer_case.name, result) == []


def coverage(known: KnownOutcomes, backend: str, tokenizer: str, cases: list[MaskBenchCase]) -> int:
    """Cases the records have ``backend`` enforce exactly at ``tokenizer``: compiled, no valid instance rejected
    (the conformance tests hold every backend to its records, and ``auto`` to what they imply)."""
    return sum(
        known.refusal(backend, case.name) is None and known.deviation(backend, tokenizer, case.name) is None
        for case in cases
    )


def test_auto_covers_at_least_what_each_backend_covers_alone(
    auto: GrammarPipeline, known: KnownOutcomes, tokenizer_case: TokenizerSetup
) -> None:
    """Per MaskBench folder of the vendored set: ``auto`` enforces exactly at least as many schemas as any single
    backend of its order (issue: ``auto`` fell below llguidance alone by counting narrowing as exact)."""
    for folder in sorted({case.folder for case in VENDORED_CASES}):
        cases = [case for case in VENDORED_CASES if case.folder == folder]
        alone = {name: coverage(known, name, tokenizer_case.name, cases) for name in auto.backend.backends}
        assert coverage(known, "auto", tokenizer_case.name, cases) >= max(alone.values()), (folder, alone)


def test_open_objects_stay_open_and_arrays_strict_mode_would_close_go_on(
    auto: GrammarPipeline, tokenizer_case: TokenizerSetup
) -> None:
    grammar = auto.backend.build_grammar(make_grammar_key("json", PERSON_SCHEMA))
    assert isinstance(grammar, XGrammarGrammar) and grammar.grammar_stats is not None
    assert grammar.grammar_stats.narrowing is None
    assert accepts_text(grammar, tokenizer_case, '{"name": "Ada", "age": 36, "city": "London"}')
    with_array = auto.backend.build_grammar(make_grammar_key("json", OPEN_PERSON))
    assert isinstance(with_array, GuidanceGrammar) and with_array.grammar_stats is not None
    [(passed, reason)] = with_array.grammar_stats.fallback_reasons
    assert passed == "xgrammar" and "narrows 'array items' (at /properties/tags)" in reason
    assert accepts_text(with_array, tokenizer_case, '{"name": "Ada", "age": 36, "tags": [1, "b"], "x": null}')


def test_narrowing_when_allowed_is_named_in_the_stats(smollm2_tokenizer: TokenizerSetup) -> None:
    backend = build_auto(smollm2_tokenizer, grammar_auto_allow_narrowing=True)
    grammar = backend.backend.build_grammar(make_grammar_key("json", OPEN_PERSON))
    assert isinstance(grammar, XGrammarGrammar) and grammar.grammar_stats is not None
    assert grammar.grammar_stats.narrowing is not None
    assert grammar.grammar_stats.narrowing.startswith("narrows 'unlisted properties' (at /)")
    assert not accepts_text(grammar, smollm2_tokenizer, '{"name": "Ada", "age": 36, "city": "London"}')
    backend.shutdown()


NARROWED_SAMPLE = [
    case for case in VENDORED_CASES if strict_mode_narrowing(case.schema) is not None and closing_is_exact(case.schema)
][::4]
"""Every fourth vendored MaskBench schema that xgrammar's strict mode narrows where the closing can be written out."""
UNCLOSABLE = [
    (
        {
            "type": "object",
            "anyOf": [
                {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ],
        },
        ['{"a": 1}', '{"b": "x", "z": null}', '{"a": 1, "b": 2}'],
        ['{"z": 1}'],
    ),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
        ['{"a": 1, "b": [true]}', '{"a": 1, "b": 2, "c": 3}'],
        ['{"a": 1}'],
    ),
]
"""Schemas whose closing JSON Schema cannot say (closed at the top, ``additionalProperties`` would refuse the
branches' properties; closed, a required property left unlisted could never be written), with instances the schema
as written accepts and refuses."""


def test_narrowing_closes_a_schema_alike_whichever_backend_compiles_it(
    smollm2_tokenizer: TokenizerSetup, build_backend: BackendBuilder
) -> None:
    """With narrowing allowed, ``auto``'s backends close each schema as strict mode would before compiling it, so
    that a slow xgrammar compile handed over to llguidance serves the same language: each instance of the sample is
    accepted by llguidance's grammar there exactly where xgrammar's strict mode accepts it (llguidance alone, the
    schema as written, accepts more: the open language a hand-over served before)."""
    closing = build_auto(smollm2_tokenizer, grammar_auto_allow_narrowing=True, grammar_backend_order=("llguidance",))
    strict, as_written = build_backend("xgrammar", smollm2_tokenizer), build_backend("llguidance", smollm2_tokenizer)
    compared = widened = 0
    for case in NARROWED_SAMPLE:
        reference, closed = compile_grammar(strict, "json", case.schema), compile_grammar(closing, "json", case.schema)
        if isinstance(reference, InvalidGrammarObject) or isinstance(closed, InvalidGrammarObject):
            continue
        assert closed.grammar_stats is not None and closed.grammar_stats.narrowing == strict_mode_narrowing(case.schema)
        open_grammar = compile_grammar(as_written, "json", case.schema)
        for text in [*case.valid_instances, *case.invalid_instances]:
            accepted = accepts_text(reference, smollm2_tokenizer, text)
            assert accepts_text(closed, smollm2_tokenizer, text) == accepted, (case.name, text)
            widened += not accepted and accepts_text(open_grammar, smollm2_tokenizer, text)
            compared += 1
    closing.shutdown()
    assert compared >= 120 and widened >= 3, (compared, widened)


@pytest.mark.parametrize(("schema", "accepted", "refused"), UNCLOSABLE)
def test_a_schema_whose_closing_cannot_be_written_out_is_taken_as_written(
    smollm2_tokenizer: TokenizerSetup, schema: dict[str, Any], accepted: list[str], refused: list[str]
) -> None:
    """Narrowing allowed, no backend of ``auto`` closes it (nor, xgrammar, narrows it): one language whichever
    compiles it, the schema's own."""
    auto = build_auto(smollm2_tokenizer, grammar_auto_allow_narrowing=True)
    grammar = compile_valid(auto, "json", schema)
    assert grammar.grammar_stats is not None and grammar.grammar_stats.narrowing is None
    for text in accepted:
        assert accepts_text(grammar, smollm2_tokenizer, text), text
    for text in refused:
        assert not accepts_text(grammar, smollm2_tokenizer, text), text
    auto.shutdown()


def test_a_slow_first_choice_hands_over_and_its_compile_is_stopped(smollm2_tokenizer: TokenizerSetup) -> None:
    """xgrammar compiles four 3,000-character strings for tens of seconds (not predicted beyond the deadline, so it
    starts); llguidance, started beside it after a second, wins with the object closed as xgrammar's strict mode
    would have closed it (the defaults: narrowing allowed), and xgrammar's compile process is killed."""
    defaults = GrammarArgs()
    auto = build_auto(
        smollm2_tokenizer,
        grammar_compile_slow_after=defaults.grammar_compile_slow_after,
        grammar_auto_allow_narrowing=defaults.grammar_auto_allow_narrowing,
    )
    assert isinstance(auto.backend, AutoGrammarBackend)
    schema = {"type": "object", "properties": {f"f{i}": {"type": "string", "maxLength": 3000} for i in range(4)}}
    grammar = auto.backend.build_grammar(make_grammar_key("json", schema))
    assert isinstance(grammar, GuidanceGrammar) and grammar.grammar_stats is not None
    reasons = dict(grammar.grammar_stats.fallback_reasons)  # outlines too, if llguidance took over a second
    assert reasons["xgrammar"].startswith(STILL_COMPILING)
    assert grammar.grammar_stats.narrowing == strict_mode_narrowing(schema)
    assert accepts_text(grammar, smollm2_tokenizer, '{"f0": "a"}')
    assert not accepts_text(grammar, smollm2_tokenizer, '{"f0": "a", "x": 1}')
    xgrammar_service = auto.backend.backends["xgrammar"].compile_service
    for _ in range(100):
        if xgrammar_service.num_running == 0:
            break
        time.sleep(0.1)
    assert xgrammar_service.num_running == 0, "the compile left behind was stopped"
    auto.shutdown()
