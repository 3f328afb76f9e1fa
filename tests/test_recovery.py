"""A process killed at every store of an operation: the next locker repairs.

Each sweep forks a child that runs one operation with the C core's crash
point set to its n-th store to the segment (it _exits there, holding the
lock), for n = 1, 2, ... until the operation completes.  After each crash
the parent's next lock gets EOWNERDEAD and repairs; then check() must pass,
no slot may leak, and the timers must match a reference model: a timer
whose add returned is never lost, one whose add did not return exists whole
or not at all, and nothing fires twice unless marked redelivered.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from conftest import adds_to, entry, fresh_name, handle_of, header, mutex_span, wait_for

import shmwheel
from shmwheel._binding import ffi, lib
from shmwheel._process import start_time

FAR = 1e6  # a poll at now + FAR fires everything


@dataclass
class Case:
    wheel: shmwheel.Wheel
    timers: dict[int, tuple[int, bytes]]  # handle -> (deadline_ns, payload), as set up
    target: int = 0
    extra: dict = field(default_factory=dict)


_made: list[shmwheel.Wheel] = []  # every wheel a sweep made, for its cleanup
_shards = [1]  # of the wheels make_case makes: the test's parameter


@pytest.fixture(autouse=True, params=[1, 2], ids=["one shard", "two shards"])
def shards(request: pytest.FixtureRequest) -> Iterator[int]:
    """Every sweep on a wheel of one shard, and of two, whose timers are
    spread over both: an operation crashed in one shard's lock leaves the
    other alone, and the next locker of that one repairs it."""
    _shards[0] = request.param
    yield request.param
    _shards[0] = 1


def make_case(due: int = 3, later: int = 12) -> Case:
    """A wheel with timers in several levels, `due` of them already due,
    spread over its shards (added as producers of each in turn)."""
    shards = _shards[0]
    w = shmwheel.create(fresh_name(), capacity=64, payload_size=8, wheel_size=16, shards=shards)
    _made.append(w)
    now = w.stats().clock
    timers = {}
    delays = [-0.5] * due + [0.003 * (k + 1) ** 3 for k in range(later)]
    for k, d in enumerate(delays):
        if shards > 1:  # the producer id, and so the shard, of the next add: ids go round the shards
            assert lib.shmw_producer_attach(w.core, os.getpid(), 1_000_000 + k % shards, 0) >= 0
        h = w.add_at(max(0.0, now + d), b"t%d" % k)
        timers[h] = (round(max(0.0, now + d) * 1e9), b"t%d" % k)
    if shards > 1:
        assert all(header(w, k).free_count < 32 for k in range(shards)), "the timers are not spread"
    return Case(w, timers)


def crashes_at(
    n: int, op: Callable[[], object], who: str = "child", first: Callable[[], object] = lambda: None
) -> bool:
    """Run ``first()``, then ``op()`` in a forked child that dies at store
    ``n`` (SHMW_CRASH_EXIT) if op makes that many; whether it did.  Any
    other end of the child fails the test."""
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 0
        try:
            first()
            lib.shmw_test_crash_after(n)
            op()
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    assert code in (0, lib.SHMW_CRASH_EXIT), f"the {who} failed with {code} at store {n}"
    return code == lib.SHMW_CRASH_EXIT


def sweep(op: Callable[[Case], None], verify: Callable[[Case, bool], None], setup=make_case, locks: int = 1) -> int:
    """Run op in a child crashing at store 1, 2, ...; verify after each; return the stores covered.
    ``locks``: how many locks op may hold at once, and so leave to be
    recovered (a driver's registration holds shard 0's with each other's)."""
    for n in range(1, 2000):
        try:
            case = setup()
            crashed = crashes_at(n, functools.partial(op, case))
            case.wheel.check()  # the first lock after a crash repairs
            st = case.wheel.stats()
            assert st.recoveries == int(crashed) or crashed and 1 <= st.recoveries <= min(locks, st.shards)
            assert st.pending + st.free + st.in_flight + st.retired == st.capacity, "a slot leaked"
            verify(case, crashed)
        finally:
            # Whatever setup made, even if it failed half-way.
            while _made:
                w = _made.pop()
                w.close()
                shmwheel.unlink(w.name)
        if not crashed:
            return n
    raise AssertionError("the operation never completed")


def everything(w: shmwheel.Wheel) -> dict[int, shmwheel.Fire]:
    """Fire every timer (after releasing a dead driver) and return them by handle."""
    fires = w.poll(w.stats().clock + FAR)
    handles = [f.handle for f in fires]
    assert len(handles) == len(set(handles)), "a timer fired twice"
    return {f.handle: f for f in fires}


def same(fire: shmwheel.Fire, timer: tuple[int, bytes]) -> bool:
    return (fire.deadline_ns, fire.payload) == timer


# -- producers ------------------------------------------------------------------------


def test_add_killed_at_every_store() -> None:
    def op(case: Case) -> None:
        case.wheel.add(30, b"NEW")

    def verify(case: Case, crashed: bool) -> None:
        got = everything(case.wheel)
        for h, timer in case.timers.items():
            assert h in got and same(got[h], timer), "an added timer was lost or changed"
        new = [f for h, f in got.items() if h not in case.timers]
        assert len(new) == (len(new) if crashed else 1) and len(new) <= 1
        if new:
            assert new[0].payload == b"NEW", "a half-made timer"

    assert sweep(op, verify) > 10


def test_cancel_killed_at_every_store() -> None:
    def setup() -> Case:
        case = make_case()
        case.target = sorted(case.timers)[-1]
        return case

    def op(case: Case) -> None:
        assert case.wheel.cancel(case.target)

    def verify(case: Case, crashed: bool) -> None:
        got = everything(case.wheel)
        for h, timer in case.timers.items():
            if h == case.target:
                assert not crashed and h not in got or crashed and (h not in got or same(got[h], timer))
            else:
                assert h in got and same(got[h], timer)

    assert sweep(op, verify, setup) > 5


def test_reset_killed_at_every_store() -> None:
    def setup() -> Case:
        case = make_case()
        case.target = sorted(case.timers)[-1]
        case.extra["new"] = case.wheel.stats().clock + 0.0005
        return case

    def op(case: Case) -> None:
        assert case.wheel.reset_at(case.target, case.extra["new"])

    def verify(case: Case, crashed: bool) -> None:
        got = everything(case.wheel)
        assert set(got) == set(case.timers)
        old_deadline = case.timers[case.target][0]
        new_deadline = round(case.extra["new"] * 1e9)
        assert got[case.target].deadline_ns == new_deadline or crashed and got[case.target].deadline_ns == old_deadline
        for h, timer in case.timers.items():
            if h != case.target:
                assert same(got[h], timer)

    assert sweep(op, verify, setup) > 5


# -- the driver -------------------------------------------------------------------------


def run_clock(w: shmwheel.Wheel, seconds: float) -> None:
    """This process as the driver's clock for a while (it must be registered)."""
    stop = ffi.new("int *")
    result = []
    t = threading.Thread(target=lambda: result.append(lib.shmw_driver_clock(w.core, stop, 4)))
    t.start()
    time.sleep(seconds)
    stop[0] = 1
    lib.shmw_wake(w.core)
    t.join()
    assert result == [0]


def test_driver_fire_killed_at_every_store() -> None:
    """The clock moving due timers in flight (several lock holds of 4)."""

    def op(case: Case) -> None:
        me = os.getpid()
        assert lib.shmw_driver_register(case.wheel.core, me, start_time(me), 0, 0) == 0
        run_clock(case.wheel, 0.05)

    def verify(case: Case, crashed: bool) -> None:
        # The child may have died registering, or registered and died
        # firing: poll releases a dead driver's registration and hands
        # out what it left in flight, marked redelivered.
        got = everything(case.wheel)
        assert set(got) == set(case.timers), "a timer was lost or duplicated"
        for h, timer in case.timers.items():
            assert same(got[h], timer)

    assert sweep(op, verify, lambda: make_case(due=6), locks=2) > 10


def in_flight(w: shmwheel.Wheel) -> list[int]:
    """The handles of the entries in flight, read off the slab."""
    return [handle_of(w, i, e.generation) for i, e in entries(w) if e.state == lib.SHMW_INFLIGHT]


def entries(w: shmwheel.Wheel) -> list[tuple[int, Any]]:
    """(index, struct shmw_entry *) for every slot of the slab."""
    return [(i, entry(w, i)) for i in range(w.capacity)]


def case_with_fires_sent() -> Case:
    """This process registered as the driver, with fires in flight that its
    writer has (as far as the segment knows) sent."""
    case = make_case(due=5)
    me = os.getpid()
    assert lib.shmw_driver_register(case.wheel.core, me, start_time(me), 0, 0) == 0
    run_clock(case.wheel, 0.02)
    shards = [header(case.wheel, k) for k in range(case.wheel.stats().shards)]
    case.extra["in_flight"] = sorted(in_flight(case.wheel))
    assert len(case.extra["in_flight"]) == sum(hd.inflight for hd in shards) >= 5
    for hd in shards:
        hd.inflight_unsent = lib.SHMW_NIL  # all of it taken, as shmw_driver_take marks it
    for _, e in entries(case.wheel):
        if e.state == lib.SHMW_INFLIGHT:
            e.flags |= lib.SHMW_SENT
    return case


def test_ack_killed_at_every_store() -> None:

    def op(case: Case) -> None:
        handles = case.extra["in_flight"]
        arr = ffi.new("int64_t[]", handles)
        assert lib.shmw_ack_many(case.wheel.core, arr, len(handles), 0, 0) == len(handles)

    def verify(case: Case, crashed: bool) -> None:
        w, me = case.wheel, os.getpid()
        left = w.stats().in_flight
        assert crashed or left == 0
        assert lib.shmw_driver_register(w.core, 0, 0, me, start_time(me)) == 0
        got = everything(w)
        redelivered = {h for h, f in got.items() if f.redelivered}
        assert len(redelivered) == left, "only what was still in flight comes again"
        assert redelivered <= set(case.extra["in_flight"])
        assert set(got) == set(case.timers) - (set(case.extra["in_flight"]) - redelivered)

    assert sweep(op, verify, case_with_fires_sent) > 10


def test_keep_killed_at_every_store() -> None:
    """A handler's fires kept in flight (KEEP_IN_FLIGHT), the holder killed
    at each store: each comes again to the next driver, kept or not, and
    none is lost or freed."""

    def op(case: Case) -> None:
        handles = case.extra["in_flight"]
        arr = ffi.new("int64_t[]", handles)
        assert lib.shmw_keep_many(case.wheel.core, arr, len(handles)) == len(handles)

    def verify(case: Case, crashed: bool) -> None:
        w, me = case.wheel, os.getpid()
        assert w.stats().in_flight == len(case.extra["in_flight"])
        assert lib.shmw_driver_register(w.core, 0, 0, me, start_time(me)) == 0
        got = everything(w)
        assert {h for h, f in got.items() if f.redelivered} == set(case.extra["in_flight"])
        assert crashed or all(got[h].kept for h in case.extra["in_flight"])
        assert set(got) == set(case.timers)

    assert sweep(op, verify, case_with_fires_sent) > 3  # a store each


# -- repair at scale ------------------------------------------------------------------------


@pytest.mark.parametrize("capacity", [1_000_000])
def test_repair_of_a_million_slot_segment(make_wheel, capacity: int, shards: int) -> None:
    """A holder killed mid-add on a full-sized wheel: everything survives, and
    the repair is counted (its time is measured in bench/, not here)."""
    w = make_wheel(capacity=capacity, payload_size=0, shards=shards)
    for _ in range(9):  # with two shards, five batches in one and the rest spilled into the other
        w.add_many([3600.0 + i * 0.01 for i in range(100_000)])
    pid = os.fork()
    if pid == 0:  # the child: never returns, whatever it raises
        try:
            lib.shmw_test_crash_after(5)
            w.add(1)
        finally:
            os._exit(0)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == lib.SHMW_CRASH_EXIT
    w.check()
    st = w.stats()
    assert st.recoveries == 1
    assert st.pending in (900_000, 900_001)


def test_a_producer_crash_leaves_what_the_driver_has_sent_alone() -> None:
    """Repair after a producer died must not make a live driver send its
    in-flight fires again (the unsent cursor stays where it was)."""

    def op(case: Case) -> None:
        case.wheel.add(30, b"NEW")

    def verify(case: Case, crashed: bool) -> None:
        for k in range(case.wheel.stats().shards):
            assert header(case.wheel, k).inflight_unsent == lib.SHMW_NIL, "the driver would send its fires again"
        assert sorted(in_flight(case.wheel)) == case.extra["in_flight"]
        assert case.wheel.stats().redelivered == 0
        me = os.getpid()
        assert lib.shmw_driver_register(case.wheel.core, 0, 0, me, start_time(me)) == 0

    assert sweep(op, verify, case_with_fires_sent) > 10


@pytest.mark.parametrize("shards", [2], ids=["two shards"])  # in place of the module's fixture
def test_a_process_killed_holding_one_shards_lock_leaves_the_others_alone(shards: int) -> None:
    """A process dies holding shard 0's lock, half-way through a cancel
    there: a producer of shard 1 adds and cancels meanwhile without going
    near shard 0, whose lock stays as the dead process left it until its
    next locker, which repairs shard 0 and only shard 0."""
    _shards[0] = shards
    try:
        case = make_case()
    finally:
        _shards[0] = 1
    w = case.wheel
    try:
        index_mask = (1 << lib.shmw_index_bits(w.capacity)) - 1
        target = max(h for h in case.timers if (h & index_mask) < w.capacity // 2)  # in shard 0
        adds_to(w, 1)  # this process, as a producer of shard 1
        pid = os.fork()
        if pid == 0:  # never returns
            try:
                lib.shmw_test_crash_after(3)  # every store is under the lock
                w.cancel(target)
            finally:
                os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == lib.SHMW_CRASH_EXIT
        lock_0 = ffi.cast("int32_t *", w._buf + mutex_span()[0])  # glibc's lock word: the holder's TID
        left = lock_0[0]
        assert left != 0, "the dead process's lock word is gone"
        h = w.add(60, b"shard 1")
        assert (h & index_mask) >= w.capacity // 2, "added to shard 0"
        assert w.cancel(h)
        assert w.add(60, b"stays") > 0
        assert lock_0[0] == left, "shard 0's lock was taken"
        assert (header(w, 0).recoveries, header(w, 1).recoveries) == (0, 0)
        w.check()  # locks shard 0 too: its repair
        assert (header(w, 0).recoveries, header(w, 1).recoveries) == (1, 0)
        got = everything(w)
        for h, timer in case.timers.items():
            assert h == target or (h in got and same(got[h], timer)), "a timer was lost or changed"
    finally:
        w.close()
        shmwheel.unlink(w.name)
        _made.remove(w)


def _poll_returns(w: shmwheel.Wheel, now: float) -> list[shmwheel.Fire]:
    """w.poll(now), which must come back (a livelock fails the test, not the run)."""
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(w.poll(now)), daemon=True)
    t.start()
    t.join(30)
    assert result, "poll() never came back"
    return result[0]


def _register(w: shmwheel.Wheel, registering: bool) -> None:
    """In a driver's process: register it as the wheel's driver, or release it."""
    me = os.getpid()
    if registering:
        assert lib.shmw_driver_register(w.core, me, start_time(me) or 0, 0, 0) == 0
    else:
        lib.shmw_driver_register(w.core, 0, 0, me, start_time(me) or 0)


@pytest.mark.parametrize("shards", [2], ids=["two shards"])  # in place of the module's fixture
@pytest.mark.parametrize("cut", ["registering", "releasing"])
def test_a_driver_killed_registering_or_releasing_leaves_the_wheel_to_the_next_caller(cut: str, shards: int) -> None:
    """A driver killed at each store of its registration, or of its
    release, across two shards (shard 0 is written first when it checks and
    last when it writes): the next caller, a poll, comes back, hands out
    every timer once and leaves no shard registered.  (Before, a release
    cut after shard 0 left shard 1 naming the dead driver and poll() spun
    for ever.)"""
    _shards[0] = shards
    try:
        for n in range(1, 200):
            case = make_case(due=2, later=3)
            w = case.wheel
            register, release = functools.partial(_register, w, True), functools.partial(_register, w, False)
            if cut == "releasing":
                crashed = crashes_at(n, release, "driver", first=register)
            else:
                crashed = crashes_at(n, register, "driver")
            got = _poll_returns(w, w.stats().clock + FAR)
            assert sorted(f.handle for f in got) == sorted(case.timers), f"at store {n}"
            assert [header(w, k).driver_pid for k in range(shards)] == [0] * shards
            w.check()
            w.close()
            shmwheel.unlink(w.name)
            _made.remove(w)
            if not crashed:
                break
        assert n > 5, "the crash points were not reached"
    finally:
        _shards[0] = 1


@pytest.mark.parametrize("shards", [2], ids=["two shards"])  # in place of the module's fixture
def test_after_a_dead_holders_repair_an_earlier_timer_still_wakes_the_clock(shards: int) -> None:
    """A process dies holding shard 0's lock while the clock sleeps for an
    hour; the next add there, due in 5 ms, repairs the shard and must wake
    the clock at once.  The clock's sleep cap is stretched to 60 s here, so
    that nothing else wakes it.  (Before, the repair left the shard's
    sleep_until at 0, which no add is earlier than, and the timer waited for
    the cap.)"""
    w = shmwheel.create(fresh_name(), capacity=64, payload_size=8, wheel_size=16, shards=shards)
    cap = lib.shmw_test_clock_cap(60 * 10**9)
    me, me_start = os.getpid(), start_time(os.getpid())
    stop = ffi.new("int *")
    clock = threading.Thread(target=lambda: lib.shmw_driver_clock(w.core, stop, 4))
    try:
        assert lib.shmw_driver_register(w.core, me, me_start, 0, 0) == 0
        adds_to(w, 0)
        w.add(3600, b"an hour")
        clock.start()
        wait_for(lambda: header(w, 0).sleep_until not in (0, 2**64 - 1))  # asleep on the hour
        pid = os.fork()
        if pid == 0:  # never returns
            try:
                adds_to(w, 0)  # a forked child adds to its pid's shard until it attaches
                lib.shmw_test_crash_after(3)  # half-way through an add to shard 0, its lock held
                w.add(60, b"held")
            finally:
                os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == lib.SHMW_CRASH_EXIT
        w.add(0.005, b"soon")
        wait_for(lambda: w.stats().in_flight == 1, timeout=30)  # well within the 60 s cap
        assert header(w, 0).recoveries == 1
    finally:
        stop[0] = 1
        lib.shmw_wake(w.core)
        if clock.is_alive() or clock.ident is not None:
            clock.join()
        lib.shmw_test_clock_cap(cap)
        lib.shmw_driver_register(w.core, 0, 0, me, me_start)
        w.close()
        shmwheel.unlink(w.name)
