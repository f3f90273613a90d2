"""Server settings: one frozen dataclass holds every default; argparse and the environment table feed it."""

from __future__ import annotations

import argparse
import importlib
import os
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Generic, TypeVar

from sglang_constrained.backends.reasoning_formats import REASONING_FORMATS
from sglang_constrained.backends.registry import available_grammar_backends, check_grammar_backend_order
from sglang_constrained.tokenizer.chat_template import read_chat_template

T = TypeVar("T")

LOG_LEVELS = ("debug", "info", "warning", "error")
WEIGHT_DTYPES = ("auto", "float32", "bfloat16")
MODEL_RUNNERS = ("exact", "llamacpp")
"""Engines behind the model-runner contract: exact (the default: our batch-invariant CPU kernels, ``cpu_kernels``;
outputs exact whatever the batch, prefix reuse) or llama.cpp (the ``llamacpp`` extra: the GGUF's quantised weights,
faster on CPU, no prefix reuse, and a multi-token forward's logits differ from one-token steps)."""
MAX_DRAFT_TOKENS = 16
ROUTERS = ("sglang",)
ROUTER_POLICIES = ("cache_aware", "round_robin", "power_of_two", "random")
"""SGLang's router's policies (``sglang_router.launch_router --policy``) for ``--router sglang``."""
SPECULATIVE_ALGORITHMS = ("auto", "none", "ngram", "grammar", "grammar+ngram")
"""Draft sources: none (one forward per token, no jump-forward), n-gram lookup (in the prompt and output, then in the
n-gram cache of earlier outputs, ``--speculative-ngram-capacity``), the grammar's forced continuation (with
jump-forward over forced tokens), or both. auto: both on the exact runner, none on llama.cpp's, whose k-token
forward costs nearly k one-token forwards on this CPU (so verifying drafts loses time there). A request's predicted
output drafts under every algorithm but none: none verifies no drafts at all, so a prediction is then only counted
(usage), as a latency hint that cannot help may be."""
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One environment variable the project reads, with its type and default."""

    name: str
    default: T
    parse: Callable[[str], T]
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"environment variable {self.name}={raw!r} is not valid: {e}") from e


GRAMMAR_POLL_INTERVAL = EnvVar(
    "SGLANG_GRAMMAR_POLL_INTERVAL", 0.005, float, "seconds the idle loop waits for messages while grammars compile"
)
GRAMMAR_MAX_POLL_ITERATIONS = EnvVar(
    "SGLANG_GRAMMAR_MAX_POLL_ITERATIONS",
    10000,
    int,
    "poll intervals a grammar may take to compile; times the interval, the default compile deadline",
)
CACHE_DIR = EnvVar(
    "SGLANG_CONSTRAINED_CACHE_DIR",
    Path.home() / ".cache" / "sglang_constrained",
    Path,
    "where converted tokenizers, de-quantised weights and compiled grammars are cached",
)
WORLD_SIZE = EnvVar("WORLD_SIZE", 1, int, "number of ranks (set by torchrun; 1 when launched directly)")
ENVIRONMENT_TABLE: tuple[EnvVar, ...] = (GRAMMAR_POLL_INTERVAL, GRAMMAR_MAX_POLL_ITERATIONS, CACHE_DIR, WORLD_SIZE)


def available_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_compile_timeout() -> float:
    """SGLang's deadline: ``SGLANG_GRAMMAR_MAX_POLL_ITERATIONS`` x ``SGLANG_GRAMMAR_POLL_INTERVAL`` seconds."""
    return GRAMMAR_MAX_POLL_ITERATIONS.get() * GRAMMAR_POLL_INTERVAL.get()


ZMQ_PORT = 30010
"""The scheduler's request socket, where the Python client finds it."""


def free_port(host: str) -> int:
    """A port the kernel has free on ``host`` now (the process binding it moments later may rarely find it taken)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def zmq_port_for(host: str, serves_http: bool) -> int:
    """``--zmq-port`` left out: ``ZMQ_PORT``; but a lone server with an HTTP port whose ``ZMQ_PORT`` another server
    on this machine holds takes a free port instead, so that ``--port A`` and ``--port B`` start two servers (their
    clients come over HTTP; the frontend is told the port)."""
    if not serves_http or WORLD_SIZE.get() != 1:
        return ZMQ_PORT
    try:
        with socket.socket() as probe:
            probe.bind((host, ZMQ_PORT))
        return ZMQ_PORT
    except OSError:
        return free_port(host)


TOOL_CALL_PARSERS = (
    "hermes",
    "qwen25",
    "qwen3_coder",
    "llama3",
    "mistral",
    "deepseekv3",
    "kimi_k2",
    "pythonic",
    "gpt-oss",
)
"""``--tool-call-parser`` names: the syntaxes of ``scheduler.http.tool_syntaxes``."""


@dataclass(frozen=True)
class ServerArgs:
    """Every server setting and its default. ``model_path=None`` means the embedded SmolLM2-135M-Instruct."""

    model_path: str | None = None
    grammar_backend: str = "auto"
    grammar_backend_order: tuple[str, ...] = ("xgrammar", "llguidance", "outlines")
    constrained_json_whitespace_pattern: str | None = None
    constrained_json_disable_any_whitespace: bool = False
    reasoning_parser: str | None = None
    thinking_budget: int | None = None
    tool_call_parser: str | None = None
    chat_template: str | None = None
    max_running_requests: int = 32
    max_seq_len: int = 2048
    max_total_tokens: int = 65536
    disable_radix_cache: bool = False
    disable_budget_aware_constraints: bool = False
    weight_dtype: str = "auto"
    model_runner: str = "exact"
    tp_size: int = 1
    speculative_algorithm: str = "auto"
    speculative_num_draft_tokens: int = 8
    speculative_num_prediction_tokens: int = MAX_DRAFT_TOKENS
    speculative_ngram_capacity: int = 65536
    grammar_compile_timeout: float | None = None
    grammar_compile_threads: int = max(1, available_cores() - 1)
    grammar_compile_slow_after: float = 1.0
    grammar_max_slow_compiles: int = 2 * max(1, available_cores() - 1)
    grammar_compile_max_memory: int | None = 4096
    grammar_auto_allow_narrowing: bool = True
    grammar_cache_max_entries: int = 1024
    grammar_cache_max_bytes: int = 512 * 1024 * 1024
    grammar_max_spec_bytes: int = 1024 * 1024
    grammar_cache_dir: str | None = None
    disable_grammar_disk_cache: bool = False
    grammar_disk_cache_max_bytes: int = 2 * 1024 * 1024 * 1024
    host: str = "127.0.0.1"
    port: int | None = None
    zmq_port: int = ZMQ_PORT
    seed: int = 0
    dp_size: int = 1
    router: str | None = None
    router_policy: str = "cache_aware"
    router_health_check_interval: int = 5
    worker_urls: tuple[str, ...] = ()
    log_level: str = "info"
    poll_interval: float | None = None
    cache_dir: str | None = None
    import_modules: tuple[str, ...] = ()

    @property
    def zmq_endpoint(self) -> str:
        """The address the scheduler's request socket binds and clients connect to."""
        return f"tcp://{self.host}:{self.zmq_port}"

    @property
    def model_name(self) -> str:
        """The name clients see: the model file or folder name."""
        return Path(self.model_path).name if self.model_path else EMBEDDED_MODEL_NAME

    @property
    def speculation(self) -> str:
        """The draft sources in use: ``--speculative-algorithm`` with auto resolved for the model runner."""
        if self.speculative_algorithm != "auto":
            return self.speculative_algorithm
        return "none" if self.model_runner == "llamacpp" else "grammar+ngram"

    @property
    def max_drafts_per_request(self) -> int:
        """The most drafts one request verifies in a forward, from any source."""
        return max(self.speculative_num_draft_tokens, self.speculative_num_prediction_tokens)

    @property
    def compile_timeout_s(self) -> float:
        return default_compile_timeout() if self.grammar_compile_timeout is None else self.grammar_compile_timeout

    @property
    def poll_interval_s(self) -> float:
        return GRAMMAR_POLL_INTERVAL.get() if self.poll_interval is None else self.poll_interval

    @property
    def cache_path(self) -> Path:
        return CACHE_DIR.get() if self.cache_dir is None else Path(self.cache_dir)

    @property
    def grammar_disk_cache_path(self) -> Path | None:
        """Where compiled grammars are kept across restarts (``grammar_disk_cache``); None when that is off."""
        if self.disable_grammar_disk_cache:
            return None
        return self.cache_path / "grammars" if self.grammar_cache_dir is None else Path(self.grammar_cache_dir)

    @property
    def vocabulary_cache_path(self) -> Path:
        """Where decoded tokenizer vocabularies are kept across restarts (``vocabulary_disk_cache``)."""
        return self.cache_path / "vocabularies"

    @property
    def kernel_build_path(self) -> Path:
        """Where the model's CPU kernels are compiled, once per machine (``cpu_kernels.build``)."""
        return self.cache_path / "kernels"

    def __post_init__(self) -> None:
        if self.grammar_backend not in available_grammar_backends():
            raise ValueError(
                f"unknown grammar backend {self.grammar_backend!r}; choose one of {available_grammar_backends()}"
            )
        check_grammar_backend_order(self.grammar_backend_order)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_FORMATS:
            raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_FORMATS)}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {TOOL_CALL_PARSERS}")
        if self.chat_template is not None:
            read_chat_template(self.chat_template)  # a template that does not parse stops the start-up here
        if self.thinking_budget is not None and self.thinking_budget < 0:
            raise ValueError("--thinking-budget must be 0 or more")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {LOG_LEVELS}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"--weight-dtype must be one of {WEIGHT_DTYPES}")
        if self.model_runner not in MODEL_RUNNERS:
            raise ValueError(f"--model-runner must be one of {MODEL_RUNNERS}")
        if self.model_runner == "llamacpp" and self.tp_size > 1:
            raise ValueError("--model-runner llamacpp runs the whole model on each rank: use --tp-size 1")
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {SPECULATIVE_ALGORITHMS}")
        if not 0 <= self.speculative_num_draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-draft-tokens must be in [0, {MAX_DRAFT_TOKENS}]")
        if not 0 <= self.speculative_num_prediction_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--speculative-num-prediction-tokens must be in [0, {MAX_DRAFT_TOKENS}]")
        if self.speculative_ngram_capacity < 0:
            raise ValueError("--speculative-ngram-capacity must be 0 (no cache) or more")
        for name in (
            "max_running_requests",
            "max_seq_len",
            "max_total_tokens",
            "grammar_compile_threads",
            "grammar_max_spec_bytes",
            "tp_size",
            "dp_size",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.grammar_compile_timeout is not None and self.grammar_compile_timeout <= 0:
            raise ValueError("--grammar-compile-timeout must be positive")
        if self.grammar_compile_slow_after <= 0:
            raise ValueError("--grammar-compile-slow-after must be positive")
        if self.grammar_max_slow_compiles < 0:
            raise ValueError("--grammar-max-slow-compiles must be 0 (compiles keep their slot) or more")
        if self.grammar_disk_cache_max_bytes < 0:
            raise ValueError("--grammar-disk-cache-max-bytes must be 0 (nothing kept) or more")
        if self.grammar_compile_max_memory is not None and self.grammar_compile_max_memory <= 0:
            raise ValueError("--grammar-compile-max-memory must be positive (MiB)")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError("--port must be in [0, 65535]")
        if self.router is not None and self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {ROUTERS}")
        if self.router is not None and self.port is None:
            raise ValueError("--router sglang serves on --port: give it")
        if self.router is None and self.worker_urls:
            raise ValueError("--worker-urls are servers for the router to join: give --router sglang")
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"--router-policy must be one of {ROUTER_POLICIES}")
        if self.router_health_check_interval <= 0:
            raise ValueError("--router-health-check-interval must be positive (seconds)")

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError unless the ranks launched fit the parallel layout: ``--tp-size N`` needs N ranks, each
        holding a shard of the model; ``--dp-size N`` needs N ranks, each a whole-model replica; the two do not combine
        yet. With both 1, any number of ranks each run the whole model in lockstep. With ``--router`` the launcher
        is one process starting ``--dp-size`` servers of its own (``scheduler.replicas``)."""
        if self.router is not None:
            if world_size != 1:
                raise ValueError(
                    f"--router {self.router} starts --dp-size independent servers itself: run it as one process, not "
                    f"under torchrun ({world_size} ranks were launched)"
                )
            if self.tp_size > 1:
                raise ValueError("--router with --tp-size: each replica would be a rank group; not supported yet")
            return
        if self.tp_size > 1 and self.dp_size > 1:
            raise ValueError(
                f"--tp-size {self.tp_size} with --dp-size {self.dp_size}: tensor and data parallelism do not combine "
                "yet; choose one"
            )
        if self.tp_size > 1 and self.tp_size != world_size:
            raise ValueError(
                f"--tp-size {self.tp_size} needs {self.tp_size} ranks, but {world_size} were launched: run "
                f"torchrun --nproc-per-node {self.tp_size} -m scheduler.launch --tp-size {self.tp_size} ..."
            )
        if self.dp_size > 1 and self.dp_size != world_size:
            raise ValueError(
                f"--dp-size {self.dp_size} needs exactly {self.dp_size} ranks (torchrun --nproc-per-node "
                f"{self.dp_size}), not {world_size}: each rank is one whole-model replica"
            )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        d = cls()
        parser.add_argument(
            "--model-path",
            default=d.model_path,
            help="GGUF file or HF model folder (default: embedded SmolLM2-135M-Instruct)",
        )
        parser.add_argument(
            "--grammar-backend",
            default=d.grammar_backend,
            help=f"one of {available_grammar_backends()} or a registered name",
        )
        parser.add_argument(
            "--grammar-backend-order",
            type=_comma_separated,
            default=d.grammar_backend_order,
            help="the backends --grammar-backend auto asks for each constraint, in turn (comma-separated; "
            f"default: {','.join(d.grammar_backend_order)}); the first that enforces it exactly compiles it",
        )
        parser.add_argument(
            "--constrained-json-whitespace-pattern",
            default=d.constrained_json_whitespace_pattern,
            help="regex for the whitespace allowed between JSON tokens",
        )
        parser.add_argument(
            "--constrained-json-disable-any-whitespace",
            action="store_true",
            help="compact JSON: no whitespace between tokens",
        )
        parser.add_argument(
            "--reasoning-parser",
            default=d.reasoning_parser,
            choices=sorted(REASONING_FORMATS),
            help="the model thinks in <think>...</think>: answers report it apart (reasoning_content), and a "
            "constraint applies from the think-end token on",
        )
        parser.add_argument(
            "--tool-call-parser",
            default=d.tool_call_parser,
            choices=TOOL_CALL_PARSERS,
            help="the syntax tool calls are written in (SGLang's names); left out, the one the chat template's markers "
            "name unambiguously, else hermes",
        )
        parser.add_argument(
            "--chat-template",
            default=d.chat_template,
            help="the chat template for chat messages instead of the model's (a GGUF file's tokenizer.chat_template, "
            "a folder's tokenizer_config.json, chat_template.jinja or chat_template.json): a file (Jinja, or JSON "
            "with a chat_template string) or the Jinja text itself",
        )
        parser.add_argument(
            "--thinking-budget",
            type=int,
            default=d.thinking_budget,
            help="with --reasoning-parser: the most reasoning tokens a request may think before the think-end token "
            "is forced, unless the request sets its own (default: no limit)",
        )
        parser.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
        parser.add_argument(
            "--max-seq-len", type=int, default=d.max_seq_len, help="prompt plus output tokens per request"
        )
        parser.add_argument(
            "--max-total-tokens",
            type=int,
            default=d.max_total_tokens,
            help="tokens the KV cache holds in all (running requests and cached prefixes); memory grows to it as used",
        )
        parser.add_argument(
            "--disable-radix-cache", action="store_true", help="do not reuse the KV of prefixes requests share"
        )
        parser.add_argument(
            "--disable-budget-aware-constraints",
            action="store_true",
            help="cut constrained outputs at max_tokens as they stand (by default they are steered, near the budget, "
            "to end inside it in a state the constraint accepts, and a budget below the constraint's shortest output "
            "is refused)",
        )
        parser.add_argument(
            "--weight-dtype",
            default=d.weight_dtype,
            choices=WEIGHT_DTYPES,
            help="the matmul weights: auto keeps a GGUF file's own Q8_0/Q4_1 blocks, multiplied by activations "
            "quantised to int8 per 32-block as llama.cpp does (a model folder's weights stay float32); float32 "
            "de-quantises them once, to exactly the weights transformers computes with, and keeps float32 "
            "activations; bfloat16 halves float32's bytes but rounds the weights",
        )
        parser.add_argument(
            "--model-runner",
            default=d.model_runner,
            choices=MODEL_RUNNERS,
            help="the engine that computes logits: exact (our batch-invariant CPU kernels: outputs exact whatever "
            "the batch, prefix reuse) or llamacpp (needs the llamacpp extra: the GGUF's quantised weights on "
            "llama.cpp's CPU kernels, several times faster per token; no prefix reuse, and a multi-token forward's "
            "logits differ slightly from one-token steps, so speculation is off there by default)",
        )
        parser.add_argument(
            "--tp-size",
            type=int,
            default=d.tp_size,
            help="tensor parallel: split the model over this many ranks (torchrun --nproc-per-node N), each holding "
            "its share of the attention heads, MLP columns and vocabulary; 1 runs the whole model on every rank",
        )
        parser.add_argument(
            "--speculative-algorithm",
            default=d.speculative_algorithm,
            choices=SPECULATIVE_ALGORITHMS,
            help="draft tokens verified in one forward, and jump-forward over tokens the grammar forces; on the exact "
            "runner outputs are the same as without (greedy and seeded): none decodes one forward per token; auto is "
            "grammar+ngram on the exact runner and none on llamacpp; a request's predicted output (prediction) "
            "drafts under every algorithm but none",
        )
        parser.add_argument(
            "--speculative-num-draft-tokens",
            type=int,
            default=d.speculative_num_draft_tokens,
            help=f"the most drafts per request and forward (0 to {MAX_DRAFT_TOKENS}; fewer as the batch grows; 0 "
            "turns drafts off, predictions' included)",
        )
        parser.add_argument(
            "--speculative-num-prediction-tokens",
            type=int,
            default=d.speculative_num_prediction_tokens,
            help=f"the most drafts per forward of a request with a predicted output (prediction), taken from it (0 to "
            f"{MAX_DRAFT_TOKENS}; they stand far more often than the other sources')",
        )
        parser.add_argument(
            "--speculative-ngram-capacity",
            type=int,
            default=d.speculative_ngram_capacity,
            help="n-grams of earlier outputs kept to draft from, across requests (least recently used evicted; "
            "used by the ngram algorithms where prompt lookup finds less); 0 keeps none",
        )
        parser.add_argument(
            "--grammar-compile-timeout",
            type=float,
            default=d.grammar_compile_timeout,
            help="seconds (default: poll interval x max poll iterations)",
        )
        parser.add_argument(
            "--grammar-compile-threads",
            type=int,
            default=d.grammar_compile_threads,
            help="grammars compiled at once, each on one core at low CPU priority (xgrammar's in a compile process "
            "each); default: the cores less one, left to the loop",
        )
        parser.add_argument(
            "--grammar-compile-slow-after",
            type=float,
            default=d.grammar_compile_slow_after,
            help="seconds after which a running compile is slow: it leaves its compile thread's slot to the next "
            "compile (an xgrammar compile process drops to the lowest CPU priority), and auto starts the next "
            "backend of its order beside it",
        )
        parser.add_argument(
            "--grammar-max-slow-compiles",
            type=int,
            default=d.grammar_max_slow_compiles,
            help="slow compiles that may run beside the compile threads at once (default: twice the threads; each "
            "xgrammar one holds a compile process); 0: a slow compile keeps its slot",
        )
        parser.add_argument(
            "--grammar-compile-max-memory",
            type=int,
            default=d.grammar_compile_max_memory,
            help="MiB an xgrammar compile process may hold: past it the compile is killed and its request told so",
        )
        parser.add_argument(
            "--grammar-auto-allow-narrowing",
            action=argparse.BooleanOptionalAction,
            default=d.grammar_auto_allow_narrowing,
            help="let auto choose a backend that would narrow a JSON schema (xgrammar's strict mode: objects admit "
            "only the listed properties) when it compiles it first, as xgrammar alone does (the default: a model "
            "does not invent keys); the grammar's stats name the narrowing. --no-grammar-auto-allow-narrowing: "
            "only backends that enforce the schema exactly",
        )
        parser.add_argument("--grammar-cache-max-entries", type=int, default=d.grammar_cache_max_entries)
        parser.add_argument("--grammar-cache-max-bytes", type=int, default=d.grammar_cache_max_bytes)
        parser.add_argument(
            "--grammar-cache-dir",
            default=d.grammar_cache_dir,
            help="where compiled grammars are kept for the next start and the other ranks and replicas to load instead "
            "of compiling (default: grammars/ in the cache dir); entries are named by the backend, its engine's "
            "version, the tokenizer, the flags that change a grammar and the constraint, so a stale one is never read",
        )
        parser.add_argument(
            "--disable-grammar-disk-cache",
            action="store_true",
            help="keep compiled grammars in memory only: every start compiles them anew",
        )
        parser.add_argument(
            "--grammar-disk-cache-max-bytes",
            type=int,
            default=d.grammar_disk_cache_max_bytes,
            help="bytes the grammar cache dir may hold; past it the least recently used grammars are removed",
        )
        parser.add_argument(
            "--grammar-max-spec-bytes",
            type=int,
            default=d.grammar_max_spec_bytes,
            help="larger constraint specs are refused",
        )
        parser.add_argument(
            "--host", default=d.host, help="address the zmq socket and the HTTP server bind (loopback by default)"
        )
        parser.add_argument(
            "--port",
            type=int,
            default=d.port,
            help="serve the OpenAI-compatible HTTP API on this port (default: no HTTP server)",
        )
        parser.add_argument(
            "--zmq-port",
            type=int,
            default=None,
            help=f"the scheduler's request socket (default {ZMQ_PORT}; with --port, a free one if {ZMQ_PORT} is taken)",
        )
        parser.add_argument(
            "--import-module",
            dest="import_modules",
            action="append",
            default=list(d.import_modules),
            help="import this module first (repeatable), e.g. one that calls register_grammar_backend",
        )
        parser.add_argument("--seed", type=int, default=d.seed)
        parser.add_argument(
            "--dp-size",
            type=int,
            default=d.dp_size,
            help="data-parallel replicas, one per rank under torchrun (the world size must equal it): each a whole "
            "model running its own batches; rank 0 routes each request to the least-loaded replica and compiles "
            "each grammar once for all. 1: every rank runs the same batch in lockstep. With --router: that many "
            "independent server processes behind the router",
        )
        parser.add_argument(
            "--router",
            default=d.router,
            choices=ROUTERS,
            help="start --dp-size independent servers (each its own process: one that dies does not stop the others, "
            "and is restarted) and SGLang's router in front of them on --port (the router extra: "
            'pip install -e ".[router]")',
        )
        parser.add_argument("--router-policy", default=d.router_policy, choices=ROUTER_POLICIES)
        parser.add_argument(
            "--router-health-check-interval",
            type=int,
            default=d.router_health_check_interval,
            help="seconds between the router's health checks of each server (SGLang's router defaults to 60)",
        )
        parser.add_argument(
            "--worker-urls",
            nargs="+",
            default=list(d.worker_urls),
            help="with --router: servers started elsewhere (other machines) that the router sends requests to as well",
        )
        parser.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS)
        parser.add_argument(
            "--cache-dir", default=d.cache_dir, help=f"default: ${CACHE_DIR.name} or {CACHE_DIR.default}"
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        """Import every ``--import-module`` first, so that the backends they register are valid choices."""
        for module in args.import_modules:
            importlib.import_module(module)
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["import_modules"] = tuple(args.import_modules)
        values["worker_urls"] = tuple(args.worker_urls)
        if values["zmq_port"] is None:
            values["zmq_port"] = zmq_port_for(args.host, args.port is not None)
        return cls(**values)

    @classmethod
    def parse(cls, argv: Sequence[str] | None = None) -> ServerArgs:
        parser = argparse.ArgumentParser(prog="python -m scheduler.launch", description=__doc__)
        cls.add_cli_args(parser)
        return cls.from_cli_args(parser.parse_args(argv))

    def with_overrides(self, **changes: object) -> ServerArgs:
        return replace(self, **changes)  # type: ignore[arg-type]


def _comma_separated(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())
