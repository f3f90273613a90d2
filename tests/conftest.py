"""Shared fixtures: the two real tokenizers every grammar test runs against, server arguments, and the one-rank
scheduler that the scheduler tests use and the multi-rank tests compare against."""

from __future__ import annotations

import os
from collections.abc import Iterator

# The Triton kernels run on the CPU through Triton's interpreter; it must be chosen before triton is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from xdist.remote import Producer

from scheduler.server_args import ServerArgs
from scheduler.server_args.environment import cache_path
from scheduler.testing.process import SchedulerProcess
from sglang_constrained.backends.registry import GRAMMAR_BACKEND_REGISTRY
from sglang_constrained.backends.xgrammar.fork_server import XGRAMMAR_COMPILE_PRELOAD
from sglang_constrained.compile.processes import start_fork_server
from sglang_constrained.testing.tokenizer_setups import TOKENIZER_SETUPS, TokenizerSetup, load_tokenizer_setup
from tests.helpers import LAUNCH_AHEAD, PRELOADED_LAUNCHER, launch_scheduler
from tests.lanes import BACKGROUND, LaneScheduling, in_worker, lane_of, lanes_under, lower_priority
from tests.prepare_ahead import PrepareAhead

PREPARE_AHEAD = PrepareAhead()

# The session's servers, ranks and compile processes each import the same modules. Where the environment turns
# bytecode writes off (PYTHONDONTWRITEBYTECODE, set on the machines this suite has run on) each compiled them from
# source again: ~0.5 s of CPU a process (AMD EPYC Zen 3), in a session that starts a few hundred. They keep the
# bytecode in the cache instead, not in the tree.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
os.environ.setdefault("PYTHONPYCACHEPREFIX", str(cache_path(None) / "bytecode"))


@pytest.fixture(scope="session")
def server_args() -> ServerArgs:
    return ServerArgs()


@pytest.fixture(scope="session")
def smollm2_tokenizer(server_args: ServerArgs) -> TokenizerSetup:
    return load_tokenizer_setup("smollm2", server_args.model.cache_path)


@pytest.fixture(scope="session")
def qwen35_tokenizer(server_args: ServerArgs) -> TokenizerSetup:
    return load_tokenizer_setup("qwen35", server_args.model.cache_path)


@pytest.fixture(scope="session", params=TOKENIZER_SETUPS)
def tokenizer_case(request: pytest.FixtureRequest) -> TokenizerSetup:
    return request.getfixturevalue(f"{request.param}_tokenizer")


@pytest.fixture(scope="session")
def one_rank_server() -> Iterator[SchedulerProcess]:
    """A scheduler with the test flags and nothing else, started once for the session.

    A test that compares outputs with it calls ``flush_prefix_cache`` first: the prefixes earlier tests left would
    change where its prompts' prefills start, and so their rounding.
    """
    with launch_scheduler() as launched:
        yield launched


@pytest.fixture
def clean_registry() -> Iterator[None]:
    """The backend registry as it was before the test, whatever the test registered."""
    saved = dict(GRAMMAR_BACKEND_REGISTRY)
    yield
    GRAMMAR_BACKEND_REGISTRY.clear()
    GRAMMAR_BACKEND_REGISTRY.update(saved)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """A run of one lane's tests in one process (``tests/lanes.py``)."""
    if getattr(config.option, "numprocesses", None) == 2 and len(lanes_under(config.args, config.rootpath)) < 2:
        config.option.numprocesses = 0


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LaneScheduling | None:
    return LaneScheduling(config, log) if config.getoption("dist") == "load" else None


def _plan(items: list[pytest.Item]) -> None:
    """Before this process's tests: the compile processes' fork server, then the launches and preparations ahead.

    The fork server is started first so that its children (every compile process, and torch's ranks started by
    ``forkserver``) find xgrammar, torch and transformers imported whichever test starts the first of them. Started by
    a test of ranks (``test_tensor_parallel_forward``), it imported nothing, and each later compile process imported
    them all again: ~2.5 s of CPU each, 192 s in 76 processes over a run whose foreground lane (``tests/lanes.py``)
    ran the distributed tests before any compile process (AMD EPYC Zen 5). A new interpreter, not a fork of this
    one: a fork would hold the test process's memory (counted in each compile process's bound) and its open files."""
    start_fork_server(XGRAMMAR_COMPILE_PRELOAD, fork_this_process=False)
    LAUNCH_AHEAD.plan(items)
    PREPARE_AHEAD.start(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not in_worker():
        _plan(session.items)


_lane: str | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A worker learns its lane from its first test: it plans that lane's launches and preparations, and the
    background lane takes the lowest priority (``tests/lanes.py``)."""
    global _lane
    if in_worker() and _lane is None:
        _lane = lane_of(item.nodeid)
        if _lane == BACKGROUND:
            lower_priority()
        _plan([other for other in item.session.items if lane_of(other.nodeid) == _lane])
    LAUNCH_AHEAD.look_ahead(item)


def pytest_sessionfinish(session: pytest.Session) -> None:
    LAUNCH_AHEAD.stop_all()
    PRELOADED_LAUNCHER.stop()
    PREPARE_AHEAD.stop_all()
