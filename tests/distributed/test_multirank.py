"""Two scheduler ranks under torchrun (real torch.distributed over gloo): same outputs, agreed verdicts.

The rank-skewed backends live in ``tests/distributed/plugins``: one is installed through the entry-point group (a
``.dist-info`` folder put on the path), the other through ``--import-module``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from scheduler.client import make_request
from scheduler.io_struct import GenerateReq
from scheduler.session_priority import autogroup_nice
from scheduler.testing.process import SchedulerProcess, process_tree
from sglang_constrained.backends.registry import ENTRY_POINT_GROUP
from tests.helpers import flush_prefix_cache, launch_scheduler

PLUGINS = Path(__file__).parent / "plugins"
PLUGIN_SITE = Path(__file__).parent / "plugin_site"
"""A folder holding an installed distribution that declares ``slow-on-rank-1`` in the backends' entry-point group
(``sglang_constrained.backends.registry.ENTRY_POINT_GROUP``)."""
SLOW_ON_RANK_1 = ("--grammar-backend", "slow-on-rank-1", "--import-module", "rank_skewed_backends")
pytestmark = [
    pytest.mark.model,
    pytest.mark.multirank,
    pytest.mark.launches(*SLOW_ON_RANK_1, ranks=2, extra_paths=(PLUGIN_SITE, PLUGINS)),
]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
PHONE_REGEX = r"\(\d{3}\) \d{3}-\d{4}"


def seeded_requests() -> list[GenerateReq]:
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    return [
        make_request(
            rid="free", text="The best things about summer are", sampling_params={"max_new_tokens": 24, "seed": 1}
        ),
        make_request(
            rid="json", messages=ask, sampling_params={"json_schema": PERSON_SCHEMA, "temperature": 0.8, "seed": 2}
        ),
        make_request(
            rid="regex", text="Call me at", sampling_params={"regex": PHONE_REGEX, "temperature": 0.8, "seed": 3}
        ),
        make_request(rid="choice", text="Pick one:", sampling_params={"choice": ["yes", "no", "maybe"], "seed": 4}),
    ]


def test_the_plugin_site_declares_slow_on_rank_1_in_the_backends_entry_point_group() -> None:
    entry_points = (PLUGIN_SITE / "rank_skewed_plugins-0.1.dist-info" / "entry_points.txt").read_text().splitlines()
    assert entry_points[0] == f"[{ENTRY_POINT_GROUP}]" and entry_points[1].startswith("slow-on-rank-1 = ")


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[SchedulerProcess]:
    """Two ranks whose backend compiles 3 s later on rank 1 (found by its entry point); the module registering
    fail-on-rank-1 is imported too."""
    with launch_scheduler(*SLOW_ON_RANK_1, ranks=2, extra_paths=(PLUGIN_SITE, PLUGINS)) as launched:
        yield launched


@pytest.mark.launches("--speculative-algorithm", "none")
def test_two_ranks_give_the_same_outputs_as_one(two_ranks: SchedulerProcess, one_rank_server: SchedulerProcess) -> None:
    """Two ranks (rank 0's drafts and tokens broadcast) give one rank's outputs, which are plain decoding's."""
    with two_ranks.client() as client:
        two = client.generate_batch(seeded_requests())
    flush_prefix_cache(one_rank_server)
    with one_rank_server.client() as client:
        one = client.generate_batch(seeded_requests())
    with launch_scheduler("--speculative-algorithm", "none") as plain, plain.client() as client:
        one_plain = client.generate_batch(seeded_requests())
    assert [o.token_ids for o in two] == [o.token_ids for o in one] == [o.token_ids for o in one_plain]
    assert [o.text for o in two] == [o.text for o in one]
    free, person, phone, choice = two
    assert free.text.strip()
    jsonschema.validate(json.loads(person.text), PERSON_SCHEMA)
    assert re.fullmatch(PHONE_REGEX, phone.text) and choice.text in ("yes", "no", "maybe")


def test_a_grammar_slower_on_one_rank_waits_on_every_rank(two_ranks: SchedulerProcess) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    with two_ranks.client() as client:
        output = client.generate(rid="slow-grammar", text="JSON:", sampling_params={"json_schema": schema})
    assert json.loads(output.text)["ok"] in (True, False)
    waits = {
        int(rank): float(seconds)
        for rank, seconds in re.findall(
            r"\[rank (\d)\] \S+: rid=slow-grammar constraint=\S+ grammar_ready_after_s=([\d.]+)", two_ranks.log()
        )
    }
    assert set(waits) == {0, 1}, "every rank admits the request"
    assert waits[0] >= 2.5, "rank 0 compiled at once but must wait for rank 1's 3 s compile"
    assert "ranks ran different batches" not in two_ranks.log()


FAIL_ON_RANK_1 = ("--grammar-backend", "fail-on-rank-1", "--import-module", "rank_skewed_backends")


@pytest.mark.launches(*FAIL_ON_RANK_1, ranks=2, extra_paths=(PLUGINS,))
def test_a_compile_failure_on_one_rank_fails_the_request_once_and_a_killed_rank_stops_the_launcher() -> None:
    """Rank 1 refuses one schema: that request alone fails, with its message; then rank 1 is killed and the launcher
    stops with a clear message."""
    refused = {"title": "refused-on-rank-1", "type": "object", "properties": {"a": {"type": "integer"}}}
    accepted = {"title": "fine", "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with launch_scheduler(*FAIL_ON_RANK_1, ranks=2, extra_paths=(PLUGINS,), check_clean_stop=False) as launched:
        with launched.client() as client:
            failed = client.generate(text="JSON:", sampling_params={"json_schema": refused})
            served = client.generate(text="JSON:", sampling_params={"json_schema": accepted, "max_new_tokens": 32})
            free = client.generate(text="Hello", sampling_params={"max_new_tokens": 4})
        os.kill(launched.rank_pids()[1], signal.SIGKILL)
        start = time.monotonic()
        exit_code = launched.process.wait(timeout=60)
        elapsed = time.monotonic() - start
        log = launched.log()
    assert failed.finish_reason is not None and failed.finish_reason.type == "abort"
    assert failed.finish_reason.message == (
        "Failed to compile json grammar: rank 1 refuses schemas titled 'refused-on-rank-1'"
    )
    assert isinstance(json.loads(served.text)["a"], int)
    assert free.finish_reason is not None and free.finish_reason.type == "length"
    assert exit_code != 0 and elapsed < 30
    assert "[rank 0] scheduler.launch: rank 0: a peer rank stopped answering" in log
    assert "local_rank: 1" in log and "exitcode: -9" in log


def test_an_abort_sent_to_rank_0_removes_the_request_on_every_rank(two_ranks: SchedulerProcess) -> None:
    request = {
        "text": "Once upon a time, there was a dragon who",
        "sampling_params": {"max_new_tokens": 400, "temperature": 0},
    }
    with two_ranks.client() as client:
        chunks = client.generate_stream(rid="to-abort", **request)
        next(chunks)
        client.abort("to-abort")
        final = list(chunks)[-1]
    assert final.finish_reason is not None and final.finish_reason.type == "abort"
    assert two_ranks.status().num_running_requests == 0
    log = two_ranks.log()
    for rank in (0, 1):
        assert f"[rank {rank}] scheduler.scheduler: request to-abort aborted by the client" in log


def test_ranks_run_at_the_normal_priority_once_a_test_has_their_group(two_ranks: SchedulerProcess) -> None:
    """A group started ahead at idle priority (``tests/launch_ahead.py``) has it back when taken: every thread at
    the normal policy and each rank's session of its own (torchrun's) at nice 0, so that the ranks' turns keep
    pace with the tests' requests. A group started by its test never left it."""
    processes = process_tree(two_ranks.process.pid)
    session_leaders = [process.pid for process in processes if os.getsid(process.pid) == process.pid]
    assert len(session_leaders) == 2
    assert [autogroup_nice(pid) for pid in session_leaders] in ([0, 0], [None, None])
    assert {os.sched_getscheduler(thread.id) for process in processes for thread in process.threads()} == {
        os.SCHED_OTHER
    }
