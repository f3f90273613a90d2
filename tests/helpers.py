"""What many tests share: compiling a constraint on a backend, reading a grammar's mask, a real scheduler process
that must stop cleanly when the test is done, and a live HTTP server with the constraints its tests ask for."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import psutil
import pytest
import torch
from openai.types.chat import ChatCompletionMessageParam
from safetensors.torch import save_file
from transformers import PretrainedConfig

from scheduler.client import AsyncSchedulerClient
from scheduler.server_args import EMBEDDED_MODEL_NAME
from scheduler.shared_grammars import GrammarStore, SharedGrammar
from scheduler.testing.preloaded import PreloadedLauncher
from scheduler.testing.process import REPO_ROOT, SchedulerProcess, free_port
from sglang_constrained.backends.base import BaseGrammarObject, InvalidGrammarObject
from sglang_constrained.backends.pipeline import GrammarPipeline
from sglang_constrained.constraint_spec import make_grammar_key
from sglang_constrained.testing.tokenizer_setups import TokenizerSetup
from tests.launch_ahead import Launch, LaunchAhead
from triton_ops.bitmask_format import ALL_ALLOWED, allocate_bitmask, allowed_token_ids, unpack_bitmask

PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
"""A small schema every backend enforces; ``{**PERSON_SCHEMA, "additionalProperties": False}`` closes it."""
PRODUCT_SCHEMA = {
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 5},
        "price": {"type": "number", "multipleOf": 0.5},
    },
    "required": ["code", "price"],
    "additionalProperties": False,
}
"""xgrammar refuses a pattern with a length bound (it would drop the bound), llguidance enforces both: ``auto`` gives
it to llguidance."""

COLD_GRAMMARS = ("--disable-grammar-disk-cache",)
"""Test servers compile every grammar they serve, as the tests expect (an auto choice in the log, a compile's time),
whatever an earlier run left in the grammar disk cache; ``tests/backends/test_grammar_disk_cache.py`` tests it.
``launch_scheduler(..., warm_grammars=True)`` keeps the cache, for a server whose tests check none of that."""
TEST_SERVER_LIMITS = ("--max-running-requests", "48", "--max-seq-len", "640")
"""Enough slots for the concurrency tests, a KV cache small enough to start in seconds."""
TEST_SERVER_FLAGS = (*TEST_SERVER_LIMITS, *COLD_GRAMMARS)

COMPILE_TIMEOUT_S = 300.0


THREAD_COUNTS = sorted({1, os.cpu_count() or 1})
"""One thread, and every thread this machine has: a kernel's rows must not depend on how many share the work."""


def assert_rows_invariant(compute: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor, max_rows: int) -> None:
    """Every row of ``compute(inputs[:m])``, for m = 1..max_rows and each of ``THREAD_COUNTS``, equals that row
    computed alone, bit for bit."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([compute(inputs[i : i + 1]) for i in range(max_rows)])
        for count in THREAD_COUNTS:
            torch.set_num_threads(count)
            for rows in range(1, max_rows + 1):
                together = compute(inputs[:rows])
                differing = (together != alone[:rows]).any(dim=1).nonzero().flatten().tolist()
                assert not differing, f"{rows} rows on {count} threads: rows {differing} differ from alone"
    finally:
        torch.set_num_threads(threads)


def item_parameters(item: pytest.Item) -> dict[str, Any]:
    """A collected test's parameters by name (none for a test that is not parametrized)."""
    callspec = getattr(item, "callspec", None)
    return callspec.params if callspec is not None else {}


def compile_grammar(backend: GrammarPipeline, kind: str, spec: Any) -> BaseGrammarObject:
    """A fresh grammar object at the start state for a constraint (invalid ones included).

    Compiled once per backend: the compile enters the backend's cache as the scheduler's would, and later calls
    get copies of it.
    """
    key = make_grammar_key(kind, spec)
    value, is_cache_hit = backend.get_cached_or_future_value(key)
    if is_cache_hit:
        assert isinstance(value, BaseGrammarObject)
        return value
    assert not isinstance(value, BaseGrammarObject)
    grammar = value.result(timeout=COMPILE_TIMEOUT_S)
    backend.set_cache(key, grammar.copy())
    return grammar


def compile_valid(backend: GrammarPipeline, kind: str, spec: Any) -> BaseGrammarObject:
    """``compile_grammar``, asserting that the constraint compiled."""
    grammar = compile_grammar(backend, kind, spec)
    assert not isinstance(grammar, InvalidGrammarObject), grammar
    return grammar


def wait_published(store: GrammarStore, timeout_s: float = 120) -> list[SharedGrammar]:
    """What rank 0's store (``--dp-size``, ``--tp-size``) publishes next, waiting for it."""
    deadline = time.monotonic() + timeout_s
    while not (published := store.take_published()):
        assert time.monotonic() < deadline, "the store published nothing"
        time.sleep(0.01)
    return published


def encode_exactly(setup: TokenizerSetup, text: str) -> list[int]:
    """The token ids of ``text`` (no special tokens), checked to decode back to exactly ``text``."""
    ids = setup.encode(text)
    assert setup.tokenizer.decode(ids) == text, f"{text!r} does not round-trip through the tokenizer"
    return ids


def accepts_text(grammar: BaseGrammarObject, setup: TokenizerSetup, text: str) -> bool:
    """Whether the grammar takes all of ``text`` and then a stop token; its state does not change."""
    ids = [*encode_exactly(setup, text), setup.eos_token_ids[0]]
    return grammar.validate_tokens(ids) == len(ids)


def allowed_tokens(grammar: BaseGrammarObject, vocab_size: int) -> set[int]:
    """The token ids the grammar allows now, read from a fresh mask; the grammar's state does not change.

    Fills row 1 of a two-row all-allowed mask and checks the fill's contract on the way: the other row is
    untouched, and no bit past the vocabulary is set.
    """
    mask = allocate_bitmask(2, vocab_size)
    grammar.fill_vocab_mask(mask, 1)
    assert (mask[0] == ALL_ALLOWED).all(), "a fill must touch only its own row"
    allowed = unpack_bitmask(mask[1], 32 * mask.shape[1])
    assert not allowed[vocab_size:].any(), "a bit past the vocabulary is set"
    return set(allowed_token_ids(mask[1], vocab_size).tolist())


# --- the HTTP API: a live server and the constraints the HTTP tests ask for ---------------------------------------

MODEL = EMBEDDED_MODEL_NAME
HTTP_MAX_SEQ_LEN = 384
HTTP_SERVER_FLAGS = ("--max-running-requests", "32", "--max-seq-len", str(HTTP_MAX_SEQ_LEN), *COLD_GRAMMARS)
"""Slots for every concurrent test request at once; a KV cache small enough to start in seconds."""

YES_NO_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
PHONE_REGEX = r"[0-9]{3}-[0-9]{4}"
COLORS = ["red", "green", "blue"]
YES_NO_EBNF = 'root ::= answer " " answer\nanswer ::= "yes" | "no"'
YES_NO_EBNF_LANGUAGE = r"(yes|no) (yes|no)"
ANSWER_TAG = {
    "type": "structural_tag",
    "format": {
        "type": "tag",
        "begin": "<answer>",
        "content": {"type": "regex", "pattern": "yes|no"},
        "end": "</answer>",
    },
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": YES_NO_SCHEMA, "strict": True}}
SO = "structured_outputs"
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Is the sky blue?"}]
FEW_SHOT_JSON: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Give me a JSON object with key a set to 1."},
    {"role": "assistant", "content": '{"a": 1}'},
    {"role": "user", "content": "Now with key b set to 2."},
]


def is_yes_no_json(text: str) -> None:
    jsonschema.validate(json.loads(text), YES_NO_SCHEMA)


def is_json_object(text: str) -> None:
    assert isinstance(json.loads(text), dict), text


def matches(pattern: str) -> Callable[[str], None]:
    def check(text: str) -> None:
        assert re.fullmatch(pattern, text), f"{text!r} does not match {pattern!r}"

    return check


def is_color(text: str) -> None:
    assert text in COLORS, text


PRELOADED_LAUNCHER = PreloadedLauncher(REPO_ROOT)
"""The session's one-rank schedulers are forked from it, their imports done (``scheduler.testing.preloaded``)."""


class HttpServer(SchedulerProcess):
    """The launcher with ``--port`` (the package's test launcher, plus the HTTP side)."""

    def __init__(self, *flags: str, idle_priority: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            "--port",
            str(self.port),
            *HTTP_SERVER_FLAGS,
            *flags,
            idle_priority=idle_priority,
            launcher=PRELOADED_LAUNCHER,
        )
        # One client for the tests' requests: httpx.post makes a client, and its TLS context (20 ms of CPU), each.
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def stop(self, timeout_s: float = 60.0) -> int:
        self.http.close()
        return super().stop(timeout_s)

    def wait_until_healthy(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(httpx.TransportError):
                if self.http.get("/health", timeout=10).status_code == 200:
                    return
            assert self.process.poll() is None, f"the launcher exited at start-up; log:\n{self.log()[-4000:]}"
            assert time.monotonic() < deadline, f"not healthy within {timeout_s:g} s; log:\n{self.log()[-4000:]}"
            time.sleep(0.5)

    def health(self) -> dict[str, Any]:
        response = self.http.get("/health", timeout=30)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def frontend_pid(self) -> int:
        (child,) = psutil.Process(self.process.pid).children()
        return child.pid

    def openai_client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=600)


def http_server(*flags: str) -> HttpServer:
    """An ``HttpServer`` with these flags: one started ahead (``launch_ahead``), else a new one."""
    started = LAUNCH_AHEAD.take_or_start(Launch(flags, http=True))
    assert isinstance(started, HttpServer)
    return started


FREE_PORT = "<a free port>"
"""A flag value that ``launch_scheduler`` replaces by a free port as it starts the server (``flag_value`` reads it)."""


def start_launch(launch: Launch, idle_priority: bool = False) -> SchedulerProcess:
    """Start what ``launch`` names as ``launch_scheduler`` or ``http_server`` would, without waiting for it."""
    flags = tuple(str(free_port()) if flag == FREE_PORT else flag for flag in launch.flags)
    if launch.http:
        return HttpServer(*flags, idle_priority=idle_priority)
    test_flags = TEST_SERVER_LIMITS if launch.warm_grammars else TEST_SERVER_FLAGS
    return SchedulerProcess(
        *test_flags,
        *flags,
        ranks=launch.ranks,
        extra_paths=launch.extra_paths,
        idle_priority=idle_priority,
        launcher=PRELOADED_LAUNCHER,
    )


def flag_value(process: SchedulerProcess, flag: str) -> str:
    """The value ``process`` was started with for ``flag``."""
    return process.command[process.command.index(flag) + 1]


LAUNCH_AHEAD = LaunchAhead(start_launch, {"one_rank_server": Launch(()), "server": Launch((), http=True)})
"""The session's servers started ahead: ``one_rank_server`` (``tests/conftest.py``) and the HTTP tests' ``server``
(``tests/serving/conftest.py``) by their fixtures' names, the rest by their tests' ``launches`` marks."""


@contextlib.contextmanager
def serving(*servers: HttpServer) -> Iterator[None]:
    """Wait until every server is healthy (their start-ups overlap); stop them all afterwards."""
    try:
        for server in servers:
            server.wait_until_healthy()
        yield
    finally:
        for server in servers:
            server.stop()
            server.log_path.unlink(missing_ok=True)


@contextlib.contextmanager
def launch_scheduler(
    *flags: str,
    ranks: int = 1,
    extra_paths: tuple[Path, ...] = (),
    warm_grammars: bool = False,
    check_clean_stop: bool = True,
) -> Iterator[SchedulerProcess]:
    """A scheduler with the test flags (``warm_grammars``: all but ``COLD_GRAMMARS``); on exit it gets SIGTERM and
    (unless the test stopped it otherwise) every rank must have stopped cleanly: exit code 0, or under torchrun each
    rank's own "stopped" line."""
    launched = LAUNCH_AHEAD.take_or_start(Launch(flags, ranks, extra_paths, warm_grammars=warm_grammars))
    try:
        launched.wait_until_ready()
        yield launched
    finally:
        exit_code = launched.stop()
        log = launched.log()
        if check_clean_stop and ranks == 1:
            assert exit_code == 0, f"the scheduler exited with {exit_code}; log:\n{log[-3000:]}"
        elif check_clean_stop:  # torchrun reports the SIGTERM it got; what matters is each rank's clean stop
            for rank in range(ranks):
                assert f"[rank {rank}] scheduler.launch: stopped" in log, f"rank {rank} did not stop:\n{log[-3000:]}"
        launched.log_path.unlink(missing_ok=True)


def flush_prefix_cache(process: SchedulerProcess) -> None:
    """Drop the scheduler's prefix cache, so that its next prompts are computed as on a fresh server."""

    async def flush() -> None:
        client = AsyncSchedulerClient(process.endpoint)
        try:
            done = await client.flush_cache()
        finally:
            await client.close()
        assert done.success, done.message

    asyncio.run(flush())


LLAMA3_ROPE_PARAMETERS = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
"""Llama 3's RoPE scaling as the tests' tiny models use it (an original context of 64 positions)."""


def write_random_model(config: PretrainedConfig, folder: Path, lm_head_scale: float = 0.1) -> None:
    """A Hugging Face folder with random weights of ``config``'s shapes (q/k/v biases for Qwen2; for Qwen3 an RMSNorm
    weight of each query and key head). A small untied
    ``lm_head_scale`` gives nearly even logits, which a request's ``logit_bias`` then steers."""
    generator = torch.Generator().manual_seed(0)
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def random(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    weights = {"model.embed_tokens.weight": random(vocab, hidden, scale=1.0), "model.norm.weight": 1 + random(hidden)}
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = random(vocab, hidden, scale=lm_head_scale)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        weights |= {
            f"{p}input_layernorm.weight": 1 + random(hidden),
            f"{p}post_attention_layernorm.weight": 1 + random(hidden),
            f"{p}self_attn.q_proj.weight": random(q_size, hidden),
            f"{p}self_attn.k_proj.weight": random(kv_size, hidden),
            f"{p}self_attn.v_proj.weight": random(kv_size, hidden),
            f"{p}self_attn.o_proj.weight": random(hidden, q_size),
            f"{p}mlp.gate_proj.weight": random(inter, hidden),
            f"{p}mlp.up_proj.weight": random(inter, hidden),
            f"{p}mlp.down_proj.weight": random(hidden, inter),
        }
        if config.model_type == "qwen2":
            for name, size in (("q", q_size), ("k", kv_size), ("v", kv_size)):
                weights[f"{p}self_attn.{name}_proj.bias"] = random(size)
        if config.model_type == "qwen3":
            weights[f"{p}self_attn.q_norm.weight"] = 1 + random(head_dim, scale=0.5)
            weights[f"{p}self_attn.k_norm.weight"] = 1 + random(head_dim, scale=0.5)
    config.save_pretrained(folder)
    save_file(weights, folder / "model.safetensors")
