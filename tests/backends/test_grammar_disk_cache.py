"""Compiled grammars on disk, through real backends: a restarted backend (a fresh one on the same directory) loads
the grammar instead of compiling it, and the loaded grammar masks exactly as the compiled one, step by step; the
entry's name changes with every setting and tokenizer fact that changes a grammar; a damaged entry is compiled
again and replaced; compile errors stay in memory."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from scheduler.server_args import GrammarArgs
from scheduler.shared_grammars import GrammarStore
from sglang_constrained.backends.auto import AutoGrammarBackend
from sglang_constrained.backends.base import (
    BaseGrammarObject,
    GrammarExport,
    InvalidGrammarObject,
)
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.backends.reasoner import ReasonerGrammarBackend
from sglang_constrained.backends.registry import create_grammar_backend
from sglang_constrained.backends.xgrammar.backend import XGrammarGrammarBackend
from sglang_constrained.cache.disk import GrammarDiskCache, entry_digest
from sglang_constrained.cache.vocabulary import tokenizer_vocabulary, vocabulary_fingerprint
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.backends.conftest import BackendBuilder
from tests.helpers import PERSON_SCHEMA, YES_NO_SCHEMA, compile_grammar, wait_published
from triton_ops.bitmask_format import allocate_bitmask, allowed_token_ids

NAME_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 60}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
"""A schema xgrammar takes several times longer to compile than to serialise (the length bound), so that its grammar
is worth writing (a small one is not: reading it back would be slower than compiling it)."""
CONSTRAINTS = {"xgrammar": NAME_SCHEMA, "llguidance": PERSON_SCHEMA, "outlines": PERSON_SCHEMA, "auto": PERSON_SCHEMA}
AUTO_ORDER = ("outlines", "llguidance")
"""auto's order in these tests, exact: outlines refuses ``PERSON_SCHEMA`` (it would close the object), so llguidance's
grammar is stored with the reason outlines was passed over."""
WALK_STEPS = 24


def build(setup: TokenizerSetup, directory: Path, name: str, **overrides: Any) -> GrammarPipeline:
    """A backend as the server builds it, on the grammar disk cache in ``directory``; xgrammar's compiles in threads
    (starting compile processes would take most of a test's time, and the disk cache reads and writes above either).
    Its cache writes every grammar that exports faster than it compiled, without weighing its read-back: these tests
    are about what is written, the rule of what pays to keep has its own."""
    settings = {"grammar_backend_order": AUTO_ORDER, "grammar_auto_allow_narrowing": False, **overrides}
    args = GrammarArgs(grammar_backend=name, **settings)
    disk_cache = GrammarDiskCache(directory, 1 << 30, read_margin=0.0)
    if name == "xgrammar":
        xgrammar = GrammarPipeline(
            XGrammarGrammarBackend(
                args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids, compile_in_processes=False
            )
        )
        xgrammar.use_disk_cache(disk_cache)
        return xgrammar
    backend = create_grammar_backend(
        args, setup.tokenizer, setup.vocab_size, setup.eos_token_ids, disk_cache=disk_cache
    )
    assert backend is not None
    return backend


def flush(backend: GrammarPipeline) -> GrammarDiskCache:
    """The backend's disk cache, once every write it queued is on disk."""
    assert isinstance(backend.disk_cache, GrammarDiskCache)
    backend.disk_cache.flush()
    return backend.disk_cache


def assert_masks_agree(loaded: BaseGrammarObject, compiled: BaseGrammarObject, setup: TokenizerSetup) -> None:
    """Walk both grammars through the same seeded choice of allowed tokens, comparing their whole mask rows at each
    step (stop tokens are taken only when nothing else is allowed)."""
    generator = random.Random(0)
    masks = allocate_bitmask(2, setup.vocab_size)
    for step in range(WALK_STEPS):
        loaded.fill_vocab_mask(masks, 0)
        compiled.fill_vocab_mask(masks, 1)
        assert torch.equal(masks[0], masks[1]), f"the masks differ at step {step}"
        allowed = allowed_token_ids(masks[0], setup.vocab_size).tolist()
        regular = [token for token in allowed if token not in setup.eos_token_ids]
        token = generator.choice(regular or allowed)
        loaded.accept_token(token)
        compiled.accept_token(token)
        if compiled.is_terminated():
            assert loaded.is_terminated()
            return


@pytest.mark.parametrize("name", ["xgrammar", "llguidance", "outlines", "auto"])
def test_a_restarted_backend_loads_the_grammar_and_masks_as_the_compiled_one(
    smollm2_tokenizer: TokenizerSetup, tmp_path: Path, name: str
) -> None:
    first = build(smollm2_tokenizer, tmp_path, name)
    try:
        compiled = compile_grammar(first, "json", CONSTRAINTS[name])
        assert not isinstance(compiled, InvalidGrammarObject), compiled
        assert compiled.grammar_stats is not None and not compiled.grammar_stats.is_disk_cache_hit
        assert len(flush(first).entry_paths()) == 1
    finally:
        first.shutdown()
    restarted = build(smollm2_tokenizer, tmp_path, name)
    try:
        loaded = compile_grammar(restarted, "json", CONSTRAINTS[name])
        assert loaded.grammar_stats is not None and loaded.grammar_stats.is_disk_cache_hit
        assert restarted.compile_service.num_compilations == 1  # the miss went to the slot, which read the disk
        assert type(loaded) is type(compiled)
        assert loaded.grammar_stats.chosen_backend == compiled.grammar_stats.chosen_backend
        assert loaded.grammar_stats.fallback_reasons == compiled.grammar_stats.fallback_reasons
        assert bool(loaded.grammar_stats.fallback_reasons) == (name == "auto")  # outlines passed over, and why
        assert_masks_agree(loaded, compiled.copy(), smollm2_tokenizer)
    finally:
        restarted.shutdown()


def test_an_entry_that_reads_back_slower_than_it_compiled_is_not_written(
    smollm2_tokenizer: TokenizerSetup, tmp_path: Path
) -> None:
    """The keep rule on a real export: reading xgrammar's compiled form of 200 properties back (decoding 15 MB and
    importing them) takes a tenth of a second, so a grammar recorded as compiled in 5 ms is not written, since a
    restart would get it slower than a cold compile; recorded as compiled in an hour, it is. The export is ready
    (as a compile process's is), so only the read-back decides."""
    setup = smollm2_tokenizer
    backend = build(setup, tmp_path / "compile", "xgrammar")
    try:
        names = [f"p{i}" for i in range(200)]
        schema = {"type": "object", "properties": {name: {"type": "string"} for name in names}, "required": names}
        key = make_grammar_key("json", schema)
        export = backend.export_grammar(compile_grammar(backend, "json", schema))
        identity = backend.compile_identity()
        cache = GrammarDiskCache(tmp_path / "kept", 1 << 30)
        cache.store_later(identity, key, lambda: export, 0.005, backend.import_grammar)
        cache.flush()
        assert cache.entry_paths() == [] and cache.num_skipped == 1
        cache.store_later(identity, key, lambda: export, 3600.0, backend.import_grammar)
        cache.flush()
        assert len(cache.entry_paths()) == 1 and cache.num_writes == 1
        cache.close()
    finally:
        backend.shutdown()


def test_xgrammar_keeps_its_compile_process_export_for_the_disk(smollm2_tokenizer: TokenizerSetup) -> None:
    """What a compile process sent back is written as it came, not serialised again (seconds for a large grammar)."""
    setup = smollm2_tokenizer
    backend = XGrammarGrammarBackend(GrammarArgs(), setup.tokenizer, setup.vocab_size, setup.eos_token_ids)
    try:
        assert backend.compile_processes is not None
        grammar, export_later = backend.build_exportable(make_grammar_key("json", PERSON_SCHEMA))
        export = export_later()
        assert isinstance(export.payload, str) and export.stats == grammar.grammar_stats
        assert_masks_agree(backend.import_grammar(export), grammar, setup)
    finally:
        backend.shutdown()


def test_the_default_backend_writes_xgrammars_compile_process_export(
    smollm2_tokenizer: TokenizerSetup, tmp_path: Path
) -> None:
    """Under the default backend (auto, xgrammar first, compiling in compile processes) and the default keep rule, a
    small schema xgrammar compiled is written as its compile process sent it (auto used to serialise it again, which
    took about as long as the compile, so the keep rule often left it out), and a restart reads it: same masks."""
    setup, schema = smollm2_tokenizer, YES_NO_SCHEMA

    def start() -> GrammarPipeline:
        disk_cache = GrammarDiskCache(tmp_path, 1 << 30)
        backend = create_grammar_backend(
            GrammarArgs(), setup.tokenizer, setup.vocab_size, setup.eos_token_ids, disk_cache=disk_cache
        )
        assert backend is not None and isinstance(backend.backend, AutoGrammarBackend), backend
        xgrammar = backend.backend.backends["xgrammar"].backend
        assert isinstance(xgrammar, XGrammarGrammarBackend) and xgrammar.compile_processes is not None
        backend.wait_until_ready()  # as the server does before it serves: the compile processes have started
        return backend

    first = start()
    try:
        grammar, export_later = first.backend.build_exportable(make_grammar_key("json", schema))
        assert grammar.grammar_stats is not None and grammar.grammar_stats.chosen_backend == "xgrammar"
        assert export_later().payload is export_later().payload  # kept, not serialised on each call
        compiled = compile_grammar(first, "json", schema)
        cache = flush(first)
        assert len(cache.entry_paths()) == 1 and cache.num_skipped == 0
    finally:
        first.shutdown()
    restarted = start()
    try:
        loaded = compile_grammar(restarted, "json", schema)
        assert loaded.grammar_stats is not None and loaded.grammar_stats.is_disk_cache_hit
        assert loaded.grammar_stats.chosen_backend == "xgrammar" and type(loaded) is type(compiled)
        assert_masks_agree(loaded, compiled.copy(), setup)
    finally:
        restarted.shutdown()


def test_a_reasoning_server_loads_what_a_plain_one_stored(smollm2_tokenizer: TokenizerSetup, tmp_path: Path) -> None:
    """The reasoning wrapper does not change the stored grammar (both caches hold unwrapped grammars)."""
    plain = build(smollm2_tokenizer, tmp_path, "llguidance")
    compiled = compile_grammar(plain, "json", NAME_SCHEMA)
    flush(plain)
    plain.shutdown()
    think_end = smollm2_tokenizer.eos_token_ids[0] - 1
    reasoning = ReasonerGrammarBackend(build(smollm2_tokenizer, tmp_path, "llguidance"), think_end)
    try:
        assert reasoning.compile_identity() == plain.compile_identity()
        loaded = reasoning.compile_or_load(make_grammar_key("json", NAME_SCHEMA))
        assert loaded.grammar_stats is not None and loaded.grammar_stats.is_disk_cache_hit
        assert_masks_agree(loaded, compiled.copy(), smollm2_tokenizer)
    finally:
        reasoning.shutdown()


def test_rank_0s_store_for_the_replicas_reads_the_disk_cache(smollm2_tokenizer: TokenizerSetup, tmp_path: Path) -> None:
    """With ``--dp-size``, rank 0 compiles for every replica: after a restart it publishes the grammar it read."""
    first = build(smollm2_tokenizer, tmp_path, "llguidance")
    compile_grammar(first, "json", PERSON_SCHEMA)
    flush(first)
    first.shutdown()
    restarted = build(smollm2_tokenizer, tmp_path, "llguidance")
    store = GrammarStore(restarted, GrammarArgs())
    try:
        store.prefetch(make_grammar_key("json", PERSON_SCHEMA))
        (published,) = wait_published(store)
        assert isinstance(published.outcome, GrammarExport) and published.outcome.stats is not None
        assert published.outcome.stats.is_disk_cache_hit
    finally:
        store.shutdown()
        restarted.shutdown()


def identity_digest(backend: GrammarPipeline) -> str:
    return entry_digest(backend.compile_identity(), make_grammar_key("json", PERSON_SCHEMA))


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("xgrammar", {"constrained_json_disable_any_whitespace": True}),
        ("xgrammar", {"grammar_max_spec_bytes": 4096}),
        ("llguidance", {"constrained_json_whitespace_pattern": "[ ]?"}),
        ("outlines", {"constrained_json_whitespace_pattern": "[ ]?"}),
    ],
)
def test_a_setting_that_changes_the_grammar_changes_the_entry(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup, name: str, change: dict[str, Any]
) -> None:
    assert identity_digest(build_backend(name, smollm2_tokenizer)) != identity_digest(
        build_backend(name, smollm2_tokenizer, **change)
    )


def test_the_tokenizer_backend_and_engine_version_change_the_entry(
    build_backend: BackendBuilder, smollm2_tokenizer: TokenizerSetup
) -> None:
    backends = [build_backend(name, smollm2_tokenizer) for name in ("xgrammar", "llguidance", "outlines")]
    other_stops = [build_backend(name, smollm2_tokenizer, eos_token_ids=[0]) for name in ("xgrammar", "llguidance")]
    digests = {identity_digest(backend) for backend in [*backends, *other_stops]}
    assert len(digests) == 5
    versions = {backend.compile_identity()["engine"] for backend in backends}
    assert {version.split()[0] for version in versions} == {"xgrammar", "llguidance", "outlines-core"}
    vocabulary = tokenizer_vocabulary(smollm2_tokenizer.tokenizer, smollm2_tokenizer.vocab_size, [2])
    one_token_changed = replace(vocabulary, decoded_vocab=(b"?", *vocabulary.decoded_vocab[1:]))
    padded = replace(vocabulary, model_vocab_size=vocabulary.model_vocab_size + 128)
    fingerprints = {vocabulary_fingerprint(vocab) for vocab in (vocabulary, one_token_changed, padded)}
    assert len(fingerprints) == 3


def test_auto_narrowing_and_order_change_the_entry(smollm2_tokenizer: TokenizerSetup, tmp_path: Path) -> None:
    built = [build(smollm2_tokenizer, tmp_path, "auto", grammar_auto_allow_narrowing=False)]
    built.append(build(smollm2_tokenizer, tmp_path, "auto", grammar_auto_allow_narrowing=True))
    built.append(build(smollm2_tokenizer, tmp_path, "auto", grammar_backend_order=AUTO_ORDER[::-1]))
    try:
        assert len({identity_digest(backend) for backend in built}) == 3
    finally:
        for backend in built:
            backend.shutdown()


DAMAGES = {
    "truncated": lambda data: data[: len(data) // 2],
    "a flipped byte": lambda data: data[:-100] + bytes([data[-100] ^ 0x10]) + data[-99:],
    "garbage": lambda data: bytes(random.Random(0).randbytes(len(data))),
    "empty": lambda data: b"",
}


def test_a_damaged_entry_is_compiled_again_and_replaced(smollm2_tokenizer: TokenizerSetup, tmp_path: Path) -> None:
    """Each damage in turn, on outlines-core's index: it is binary, so a bit flipped inside it would allow other
    tokens if it were ever read."""
    backend = build(smollm2_tokenizer, tmp_path, "outlines")
    key = make_grammar_key("json", PERSON_SCHEMA)
    try:
        compiled = backend.compile_or_load(key)
        (path,) = flush(backend).entry_paths()
        for damage, spoil in DAMAGES.items():
            path.write_bytes(spoil(path.read_bytes()))
            again = backend.compile_or_load(key)
            assert again.grammar_stats is not None and not again.grammar_stats.is_disk_cache_hit, damage
            assert_masks_agree(again, compiled.copy(), smollm2_tokenizer)
            flush(backend)
            loaded = backend.compile_or_load(key)  # the entry written anew
            assert loaded.grammar_stats is not None and loaded.grammar_stats.is_disk_cache_hit, damage
            assert_masks_agree(loaded, compiled.copy(), smollm2_tokenizer)
    finally:
        backend.shutdown()


def test_compile_errors_are_not_written(smollm2_tokenizer: TokenizerSetup, tmp_path: Path) -> None:
    backend = build(smollm2_tokenizer, tmp_path, "llguidance")
    try:
        invalid = compile_grammar(backend, "json", json.dumps({"type": "object", "contentEncoding": "base64"}))
        assert isinstance(invalid, InvalidGrammarObject)
        assert flush(backend).entry_paths() == []
    finally:
        backend.shutdown()
