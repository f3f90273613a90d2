"""Rank 0's router for data-parallel replicas: least-loaded routing, a request's messages to the replica holding
it, cache flushes answered once for all replicas, and aborts for what a stopped replica held."""

from __future__ import annotations

from scheduler.client import make_request
from scheduler.data_parallel.replica_router import ReplicaRouter
from scheduler.io_struct import AbortReq, FlushCacheDone, FlushCacheReq, GenerateOutput, PingReq, Usage, encode

CLIENT = b"client"


def generate(rid: str, **params: object) -> tuple[bytes, bytes]:
    return CLIENT, encode(make_request(rid=rid, text="hi", sampling_params=params))


def final(rid: str) -> tuple[bytes, GenerateOutput]:
    return CLIENT, GenerateOutput(rid=rid, token_ids=[1], text="x", finished=True, usage=Usage(1, 1))


def test_new_requests_go_to_the_replica_holding_fewest() -> None:
    router = ReplicaRouter(2)
    routed, _ = router.route([generate("a"), generate("b"), generate("c")])
    assert [len(messages) for messages in routed] == [2, 1]
    assert (router.num_held(0), router.num_held(1)) == (2, 1)
    router.answers(0, [final("a"), final("c")])
    routed, _ = router.route([generate("d"), generate("e"), generate("f")])
    assert [len(messages) for messages in routed] == [2, 1], "replica 0 emptied: d, then ties go to the lower rank"


def test_aborts_and_repeated_rids_reach_the_holder_and_unknown_aborts_are_dropped() -> None:
    router = ReplicaRouter(2)
    router.route([generate("a"), generate("b")])
    abort_b = (CLIENT, encode(AbortReq(rid="b")))
    routed, _ = router.route([abort_b, generate("b"), (CLIENT, encode(AbortReq(rid="gone")))])
    assert routed == [[], [abort_b, generate("b")]]
    router.answers(1, [final("b")])  # the repeated rid is answered with an error; the first "b" still runs
    assert router.holder("b") == 1
    router.answers(1, [final("b")])
    assert router.holder("b") is None


def test_grammar_keys_of_new_requests_are_returned_for_an_early_compile() -> None:
    router = ReplicaRouter(2)
    _, keys = router.route([generate("a", regex="[ab]+"), generate("b"), generate("c", choice=["x", "y"])])
    assert [key[0] for key in keys] == ["regex", "choice"]


def test_pings_and_malformed_messages_go_to_rank_0() -> None:
    router = ReplicaRouter(3)
    router.route([generate("a"), generate("b"), generate("c")])
    ping = (CLIENT, encode(PingReq(ping_id="p")))
    routed, _ = router.route([ping, (CLIENT, b"\x93not a message")])
    assert routed[0] == [ping, (CLIENT, b"\x93not a message")] and routed[1:] == [[], []]


def test_a_cache_flush_goes_everywhere_and_is_answered_once() -> None:
    router = ReplicaRouter(2)
    flush = (CLIENT, encode(FlushCacheReq(request_id="f")))
    routed, _ = router.route([flush])
    assert routed == [[flush], [flush]]
    ok = FlushCacheDone(request_id="f", success=True, message="flushed 10 cached tokens")
    refused = FlushCacheDone(request_id="f", success=False, message="not flushed: 1 requests are running or waiting")
    assert router.answers(0, [(CLIENT, ok)]) == []
    ((client, combined),) = router.answers(1, [(CLIENT, refused)])
    assert client == CLIENT and isinstance(combined, FlushCacheDone)
    assert not combined.success and combined.message == f"{ok.message}; {refused.message}"


def test_requests_held_by_stopped_replicas_are_aborted_once() -> None:
    router = ReplicaRouter(2)
    router.route([generate("a"), generate("b")])
    aborts = router.abort_held(range(1, 2), "the server is shutting down")
    assert [(client, message.rid) for client, message in aborts] == [(CLIENT, "b")]
    (_, abort) = aborts[0]
    assert abort.finish_reason is not None and abort.finish_reason.type == "abort"
    assert router.abort_held(range(1, 2), "again") == [] and router.holder("a") == 0
