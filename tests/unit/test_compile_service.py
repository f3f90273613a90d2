"""The compile service on its own: one compile per key in flight, cache hits as copies, deadlines that fail the
waiters and are never cached, resets that cancel, and no compile held up by a slow one: slow compiles leave their
slot, deadlines count from the start, and a compile that could not start says it waited."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest

from sglang_constrained.compile.control import CompileControl
from sglang_constrained.compile.service import CompileService
from sglang_constrained.errors import CompileNotStartedError, CompileTimeoutError


@dataclass
class Compiled:
    key: str
    copies: int = 0
    is_cache_hit: bool | None = None


@dataclass
class Compiler:
    """Compiles a key when its gate opens (all gates open unless closed), counting compiles per key."""

    closed: set[str] = field(default_factory=set)
    gates: dict[str, threading.Event] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def __call__(self, key: str, control: CompileControl) -> Compiled:
        self.counts[key] = self.counts.get(key, 0) + 1
        if key in self.closed:
            self.gates.setdefault(key, threading.Event()).wait(10)
        if key == "broken":
            raise RuntimeError("the engine crashed")
        return Compiled(key)

    def open(self, key: str) -> None:
        self.gates.setdefault(key, threading.Event()).set()


def make_service(compiler: Compiler, timeout_s: float = 30.0, **bounds: int) -> CompileService[str, Compiled]:
    return CompileService(
        compiler,
        name="test",
        threads=2,
        timeout_s=timeout_s,
        cache_max_entries=bounds.get("entries", 8),
        cache_max_bytes=bounds.get("bytes", 1000),
        size_of=lambda value: 10,
        copy=lambda value, hit: Compiled(value.key, value.copies + 1, hit),
    )


def result(value: Compiled | Future[Compiled]) -> Compiled:
    assert isinstance(value, Future)
    return value.result(timeout=10)


def test_identical_keys_in_flight_share_one_compile_and_get_copies_of_their_own() -> None:
    compiler = Compiler(closed={"a"})
    service = make_service(compiler)
    first, hit_first = service.get("a")
    second, hit_second = service.get("a")
    assert not hit_first and not hit_second and first is not second
    compiler.open("a")
    one, two = result(first), result(second)
    assert one is not two and one.key == two.key == "a" and one.copies == 1
    assert compiler.counts == {"a": 1} and service.num_compilations == 1
    service.shutdown()


def test_a_stored_value_is_a_cache_hit_copy() -> None:
    compiler = Compiler()
    service = make_service(compiler)
    compiled = result(service.get("a")[0])
    service.store("a", compiled)
    cached, is_hit = service.get("a")
    assert is_hit and isinstance(cached, Compiled) and cached.is_cache_hit and cached is not compiled
    assert compiler.counts == {"a": 1}
    service.shutdown()


def test_a_compile_past_its_deadline_fails_every_waiter_and_is_compiled_anew_next_time() -> None:
    compiler = Compiler(closed={"slow"})
    service = make_service(compiler, timeout_s=0.2)
    waiters = [service.get("slow")[0] for _ in range(3)]
    for waiter in waiters:
        assert isinstance(waiter, Future)
        with pytest.raises(CompileTimeoutError, match=r"timed out after 0.2 s"):
            waiter.result(timeout=10)
    again, is_hit = service.get("slow")
    assert not is_hit and compiler.counts["slow"] >= 1
    compiler.open("slow")
    assert result(again).key == "slow"
    assert service.num_compilations == 2  # the timed-out compile was forgotten, not cached
    service.shutdown()


def test_a_request_that_joins_a_compile_gives_it_its_own_full_deadline() -> None:
    """The first requester left (its client disconnected); the same key asked again joins the compile, which keeps
    running past the first one's deadline and answers the second (and lands in the cache), not failing it then."""
    compiler = Compiler(closed={"slow"})
    service = make_service(compiler, timeout_s=0.6)
    service.get("slow")  # the first request, abandoned
    time.sleep(0.4)
    again, is_hit = service.get("slow")
    time.sleep(0.4)  # past the first request's deadline, within the second's
    assert isinstance(again, Future) and not again.done()
    compiler.open("slow")
    compiled = result(again)
    assert compiled.key == "slow" and compiler.counts == {"slow": 1} and not is_hit
    service.store("slow", compiled)
    assert service.get("slow")[1]
    service.shutdown()


def test_a_joined_compile_still_fails_at_the_last_requester_s_deadline() -> None:
    compiler = Compiler(closed={"slow"})
    service = make_service(compiler, timeout_s=0.3)
    first = service.get("slow")[0]
    time.sleep(0.2)
    second = service.get("slow")[0]
    started = time.monotonic()
    for waiter in (first, second):
        assert isinstance(waiter, Future)
        with pytest.raises(CompileTimeoutError):
            waiter.result(timeout=10)
    assert 0.05 < time.monotonic() - started < 2
    compiler.open("slow")
    service.shutdown()


def test_a_queued_compile_joined_later_may_start_later() -> None:
    """With every slot busy, a queued compile asked for again waits for a slot until the later request's deadline."""
    compiler = Compiler(closed={"busy1", "busy2", "queued"})
    service = make_service(compiler, timeout_s=2.0)
    service.get("busy1"), service.get("busy2")
    first_asked = time.monotonic()
    service.get("queued")
    time.sleep(1.0)
    again = service.get("queued")[0]
    # A slot frees past the first request's deadline, ~0.8 s before the later one's: times counted from the clock,
    # not from the sleeps, which a busy machine stretches (a 0.4 s sleep has taken 0.8 s in a suite run).
    time.sleep(max(0.0, first_asked + 2.2 - time.monotonic()))
    compiler.open("busy1")
    compiler.open("queued")
    assert result(again).key == "queued"
    compiler.open("busy2")
    service.shutdown()


def test_an_engine_exception_fails_the_waiters_without_killing_the_pool() -> None:
    service = make_service(Compiler())
    broken = service.get("broken")[0]
    assert isinstance(broken, Future)
    with pytest.raises(RuntimeError, match="the engine crashed"):
        broken.result(timeout=10)
    assert result(service.get("fine")[0]).key == "fine"
    service.shutdown()


def test_reset_cancels_compiles_in_flight_and_empties_the_cache() -> None:
    compiler = Compiler(closed={"a"})
    service = make_service(compiler)
    service.store("b", Compiled("b"))
    waiting = service.get("a")[0]
    service.reset()
    assert isinstance(waiting, Future) and waiting.cancelled()
    assert not service.get("b")[1]
    compiler.open("a")
    service.shutdown()


def test_forget_lets_the_next_request_compile_anew_while_waiters_still_get_theirs() -> None:
    compiler = Compiler(closed={"a"})
    service = make_service(compiler)
    waiting = service.get("a")[0]
    service.forget("a")
    fresh = service.get("a")[0]
    compiler.open("a")
    assert result(waiting).key == result(fresh).key == "a"
    assert compiler.counts["a"] == 2
    service.shutdown()


def test_the_cache_keeps_its_entry_bound() -> None:
    service = make_service(Compiler(), entries=2)
    for key in "abc":
        service.store(key, Compiled(key))
    assert [service.get(key)[1] for key in "abc"] == [False, True, True]
    service.shutdown()


def test_after_shutdown_every_request_is_refused_at_once() -> None:
    service = make_service(Compiler())
    service.shutdown()
    for _ in range(2):  # the second call must not find a compile in flight that will never run
        with pytest.raises(RuntimeError, match="after shutdown"):
            service.get("a")


def make_lanes(compiler: Compiler, timeout_s: float, slow_after_s: float | None, max_slow: int) -> CompileService:
    """One compile slot, and a slow lane of ``max_slow`` places for compiles past ``slow_after_s``."""
    return CompileService(
        compiler,
        name="test",
        threads=1,
        timeout_s=timeout_s,
        cache_max_entries=8,
        cache_max_bytes=1000,
        size_of=lambda value: 10,
        copy=lambda value, hit: value,
        slow_after_s=slow_after_s,
        max_slow=max_slow,
    )


def test_a_slow_compile_leaves_its_slot_so_a_new_one_compiles_beside_it() -> None:
    compiler = Compiler(closed={"slow"})
    service = make_lanes(compiler, timeout_s=30.0, slow_after_s=0.2, max_slow=1)
    slow = service.get("slow")[0]
    assert result(service.get("new")[0]).key == "new"
    assert isinstance(slow, Future) and not slow.done(), "the slow compile runs on in the slow lane"
    compiler.open("slow")
    assert result(slow).key == "slow"
    service.shutdown()


def test_with_the_slow_lane_full_a_slow_compile_keeps_its_slot_until_a_place_frees() -> None:
    compiler = Compiler(closed={"slow-1", "slow-2"})
    service = make_lanes(compiler, timeout_s=30.0, slow_after_s=0.1, max_slow=1)
    first, second = service.get("slow-1")[0], service.get("slow-2")[0]
    waiting = service.get("new")[0]
    time.sleep(0.5)
    assert isinstance(waiting, Future) and not waiting.done(), "slow-2 holds the only slot"
    compiler.open("slow-1")
    assert result(waiting).key == "new", "slow-2 took slow-1's place in the lane, freeing the slot"
    compiler.open("slow-2")
    assert result(second).key == "slow-2" and result(first).key == "slow-1"
    service.shutdown()


def test_a_deadline_counts_from_the_compile_start_not_from_the_queue() -> None:
    """Queued 1.5 s behind a slow compile, a 2 s compile still has its whole 3 s deadline once it starts."""
    compiler = Compiler(closed={"slow", "queued"})
    service = make_lanes(compiler, timeout_s=3.0, slow_after_s=1.5, max_slow=1)
    service.get("slow")
    queued = service.get("queued")[0]
    threading.Timer(3.5, compiler.open, args=("queued",)).start()
    assert result(queued).key == "queued"
    compiler.open("slow")
    service.shutdown()


def test_a_compile_that_cannot_start_in_time_says_it_waited() -> None:
    compiler = Compiler(closed={"slow"})
    service = make_lanes(compiler, timeout_s=0.5, slow_after_s=None, max_slow=0)
    service.get("slow")
    waited = service.get("new")[0]
    assert isinstance(waited, Future)
    with pytest.raises(
        CompileNotStartedError,
        match=r"did not start: it waited 0\.\d s for the compile slot, busy with 1 other compile",
    ):
        waited.result(timeout=10)
    compiler.open("slow")
    service.shutdown()


def test_a_compile_past_its_deadline_or_reset_is_cancelled_for_whoever_works_on_it() -> None:
    controls: dict[str, CompileControl] = {}
    gate = threading.Event()

    def compile_value(key: str, control: CompileControl) -> Compiled:
        controls[key] = control
        gate.wait(10)
        return Compiled(key)

    service = CompileService(
        compile_value,
        name="test",
        threads=2,
        timeout_s=0.3,
        cache_max_entries=8,
        cache_max_bytes=1000,
        size_of=lambda value: 10,
        copy=lambda value, hit: value,
    )
    late = service.get("late")[0]
    assert isinstance(late, Future)
    with pytest.raises(CompileTimeoutError):
        late.result(timeout=10)
    assert controls["late"].cancel_reason == "deadline"
    service.timeout_s = 30.0
    service.get("reset")
    while "reset" not in controls:
        time.sleep(0.01)
    service.reset()
    assert controls["reset"].cancel_reason == "cancelled"
    gate.set()
    service.shutdown()


def test_a_submitted_compile_is_cancelled_with_the_compile_it_works_for() -> None:
    compiler = Compiler(closed={"a", "b"})
    service = make_lanes(compiler, timeout_s=30.0, slow_after_s=None, max_slow=0)
    parent = CompileControl(30.0)
    running, queued = service.submit("a", parent), service.submit("b", parent)
    parent.cancel("another backend won")
    assert running.cancelled() and queued.cancelled()
    compiler.open("a")
    assert result(service.get("c")[0]).key == "c", "the slot freed once the cancelled compile returned"
    assert compiler.counts.get("b") is None, "the queued one never ran"
    service.shutdown()
