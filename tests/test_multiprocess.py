"""Many processes on one wheel: add, cancel each other's timers, poll.

Every timer that was not cancelled fires exactly once, and a cancelled one
(cancel returned True) never does; cancel returns True exactly when the
timer will never fire.  Run under fork, spawn and forkserver: the Wheel
crosses into the children by pickling (spawn, forkserver) or by
inheritance (fork).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time

import pytest

import shmwheel

PRODUCERS = 4
TIMERS_EACH = 400


def producer(wheel: shmwheel.Wheel, index: int, inboxes: list, results) -> None:
    rng = random.Random(index)
    # A fifth are so short that the cancel races the poll and sometimes loses.
    delays = [rng.uniform(0, 0.004) if rng.random() < 0.2 else rng.uniform(0.02, 0.3) for _ in range(TIMERS_EACH)]
    mine = [wheel.add(d, f"{index}:{k}".encode()) for k, d in enumerate(delays)]
    # Hand our handles to the next producer and cancel half of the previous one's.
    inboxes[(index + 1) % PRODUCERS].put(mine)
    theirs = inboxes[index].get(timeout=30)
    cancelled, too_late = [], []
    for h in theirs[::2]:
        (cancelled if wheel.cancel(h) else too_late).append(h)
        if rng.random() < 0.1:
            time.sleep(0.001)
    results.put((index, os.getpid(), mine, cancelled, too_late))
    wheel.close()


@pytest.mark.parametrize("shards", [1, PRODUCERS], ids=["one shard", "a shard each"])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_producers_cancel_each_other_and_every_survivor_fires_once(make_wheel, method: str, shards: int) -> None:
    """Each producer cancels timers the others added: with a shard each,
    across shards."""
    ctx = mp.get_context(method)
    wheel = make_wheel(capacity=PRODUCERS * TIMERS_EACH * 2, shards=shards)
    inboxes = [ctx.Queue() for _ in range(PRODUCERS)]
    results = ctx.Queue()
    procs = [ctx.Process(target=producer, args=(wheel, i, inboxes, results)) for i in range(PRODUCERS)]
    for p in procs:
        p.start()

    fires: list[shmwheel.Fire] = []
    reports = []
    deadline = time.monotonic() + 60
    while len(reports) < PRODUCERS or len(wheel) > 0:
        assert time.monotonic() < deadline, "timers did not all fire or cancel in time"
        fires += wheel.poll()
        while not results.empty():
            reports.append(results.get())
        time.sleep(0.001)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0

    added = {h: (i, pid) for i, pid, mine, _, _ in reports for h in mine}
    cancelled = {h for *_, c, _ in reports for h in c}
    too_late = {h for *_, t in reports for h in t}
    fired = [f.handle for f in fires]

    assert len(added) == PRODUCERS * TIMERS_EACH
    assert len(fired) == len(set(fired)), "a timer fired twice"
    assert set(fired) == set(added) - cancelled, "lost or wrongly fired timers"
    assert not cancelled & set(fired)
    assert too_late <= set(fired), "cancel said False for a timer that never fired"
    for f in fires:
        index, pid = added[f.handle]
        assert f.owner_pid == pid
        assert f.payload.startswith(f"{index}:".encode())
        assert f.fired_at_ns >= f.deadline_ns
    st = wheel.stats()
    assert (st.added, st.cancelled, st.fired, st.pending) == (len(added), len(cancelled), len(fired), 0)


def take_and_free_every_slot(name: str, capacity: int) -> None:
    with shmwheel.attach(name) as w:
        handles = [w.add(60) for _ in range(capacity)]
        assert all(w.cancel(h) for h in handles)


@pytest.mark.parametrize("shards", [1, 4], ids=["one shard", "four shards"])
def test_slots_freed_in_another_process_lane_are_all_reachable(make_wheel, shards: int) -> None:
    """A process keeps the slots it frees in its lane's magazine; another
    process must still reach every one of them once the shared list is
    empty, and the wheel is full at exactly its capacity: with shards, each
    process's adds spill from its own into the others."""
    wheel = make_wheel(capacity=100, shards=shards)
    child = mp.get_context("spawn").Process(target=take_and_free_every_slot, args=(wheel.name, 100))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    handles = [wheel.add(60) for _ in range(100)]
    assert len(set(handles)) == 100 and len(wheel) == 100
    with pytest.raises(shmwheel.WheelFullError):
        wheel.add(60)
    assert wheel.cancel_many(handles) == 100
    assert wheel.stats().free == 100
