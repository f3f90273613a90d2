"""Server settings: ``ServerArgs`` composes five frozen parts (model, grammar, speculation, serving, parallel),
each field declaring its default and its command-line flag; ``cli`` writes the parser from those fields, and
``environment`` is the table of environment variables.

A consumer takes the part it reads (``ModelArgs`` for the model loader and runners, ``GrammarArgs`` for the grammar
library); the whole ``ServerArgs`` goes only where several parts meet (the scheduler, the launch, the HTTP app)."""

from scheduler.server_args.args import PARTS, ServerArgs
from scheduler.server_args.cli import add_server_args, parse_server_args, server_args_from
from scheduler.server_args.environment import (
    CACHE_DIR,
    ENVIRONMENT_TABLE,
    GRAMMAR_MAX_POLL_ITERATIONS,
    GRAMMAR_POLL_INTERVAL,
    WORLD_SIZE,
    ZMQ_PORT,
    EnvVar,
    available_cores,
    default_compile_timeout,
    free_port,
    zmq_port_for,
)
from scheduler.server_args.grammar import GrammarArgs
from scheduler.server_args.model import (
    EMBEDDED_MODEL_NAME,
    KV_CACHE_DTYPES,
    MODEL_RUNNERS,
    TOOL_CALL_PARSERS,
    WEIGHT_DTYPES,
    ModelArgs,
)
from scheduler.server_args.parallel import ROUTER_POLICIES, ROUTERS, ParallelArgs
from scheduler.server_args.serving import LOG_LEVELS, ServingArgs
from scheduler.server_args.speculation import MAX_DRAFT_TOKENS, SPECULATIVE_ALGORITHMS, SpeculationArgs

__all__ = [
    "CACHE_DIR",
    "EMBEDDED_MODEL_NAME",
    "ENVIRONMENT_TABLE",
    "GRAMMAR_MAX_POLL_ITERATIONS",
    "GRAMMAR_POLL_INTERVAL",
    "KV_CACHE_DTYPES",
    "LOG_LEVELS",
    "MAX_DRAFT_TOKENS",
    "MODEL_RUNNERS",
    "PARTS",
    "ROUTERS",
    "ROUTER_POLICIES",
    "SPECULATIVE_ALGORITHMS",
    "TOOL_CALL_PARSERS",
    "WEIGHT_DTYPES",
    "WORLD_SIZE",
    "ZMQ_PORT",
    "EnvVar",
    "GrammarArgs",
    "ModelArgs",
    "ParallelArgs",
    "ServerArgs",
    "ServingArgs",
    "SpeculationArgs",
    "add_server_args",
    "available_cores",
    "default_compile_timeout",
    "free_port",
    "parse_server_args",
    "server_args_from",
    "zmq_port_for",
]
