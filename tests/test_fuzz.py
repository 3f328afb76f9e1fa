"""Random bytes scribbled over a live segment: the C core reports, never crashes.

Hypothesis picks a wheel with timers in every region (pending, in several
levels; in flight; free), then overwrites a few bytes anywhere in the
header, buckets, heap or slab, and runs every operation on it.  Each must
return or raise one of shmwheel's own exceptions; none may crash the
process, read or write out of bounds or loop forever.  Each example runs in
a forked child, so a crash or a hang shows up as a failed example instead
of taking the test run down.

The bytes of the mutex itself are left out here: a lock word scribbled to
name a thread that never existed jams the lock, which every operation then
reports only after waiting SHMW_LOCK_TIMEOUT_NS (10 s) for it - too slow to
fuzz; test_hostile.py has that case.
"""

from __future__ import annotations

import os
import signal
import time

import hypothesis.strategies as st
from conftest import fresh_name, layout, mutex_span, put_in_flight, top
from hypothesis import HealthCheck, given, settings

import shmwheel

ALLOWED = (shmwheel.ShmwheelError, ValueError, OSError)


def populated_wheel(shards: int = 1) -> shmwheel.Wheel:
    w = shmwheel.create(fresh_name(), capacity=32, payload_size=8, wheel_size=16, shards=shards)
    now = w.stats().clock
    for k, d in enumerate([0.0, 0.001, 0.02, 0.5, 3, 60, 3600, 86400 * 30]):
        w.add_at(now + d, b"p%d" % k)
    # The due ones go in flight, as a driver's clock would put them: the
    # scribbles must meet the in-flight list too, not only the buckets.
    put_in_flight(w, 2)
    return w


def exercise(w: shmwheel.Wheel) -> None:
    """Every operation once; only shmwheel's own errors are acceptable."""
    try:
        now = w.stats().clock
    except ALLOWED:
        now = time.monotonic()
    calls = [
        lambda: w.add(0.01, b"x"),
        lambda: w.add_at(now + 100, b"y"),
        lambda: w.add_many([0.0, 1.0, 1000.0]),
        lambda: w.cancel(1 << 5 | 3),
        lambda: w.cancel_many([1, 2, 3, 1 << 40]),
        lambda: w.reset(1 << 5 | 2, 5),
        lambda: w.poll(now + 0.05),
        lambda: w.poll(now + 1e6, max_fires=3),
        lambda: len(w),
        w.stats,
        w.check,
    ]
    for call in calls:
        try:
            call()
        except ALLOWED:
            pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_scribbles_anywhere_are_reported_not_followed(data: st.DataObject) -> None:
    shards = data.draw(st.sampled_from([1, 2]), label="shards")
    w = populated_wheel(shards)
    name = w.name
    try:
        size = len(w._mm)
        lo, hi = mutex_span()
        at = layout(w)
        # Each shard's mutex is spared: a scribble there is a jammed lock,
        # which test_hostile covers.
        mutexes = [(lo + k * top(w).shard_size, hi + k * top(w).shard_size) for k in range(shards)]
        # A region, then a place in it: the heap's live entries and the
        # header's fields are small targets that uniform offsets would miss.
        regions = [
            (0, lo),
            (hi, at.buckets),
            (at.buckets, at.heap),
            (at.heap, at.heap + 64),
            (at.lists, at.slab),
            (at.slab, size),
        ]
        offsets = st.sampled_from(regions).flatmap(lambda r: st.integers(r[0], r[1] - 1))
        writes = data.draw(st.lists(st.tuples(offsets, st.binary(min_size=1, max_size=8)), min_size=1, max_size=6))
        for off, blob in writes:
            blob = blob[: size - off]
            blob = bytes(b for i, b in enumerate(blob) if not any(m <= off + i < n for m, n in mutexes))
            w._mm[off : off + len(blob)] = blob
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                signal.alarm(10)  # a hang fails the example instead of the run
                exercise(w)
                code = 0
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError(f"operations hung after writes {writes}")
            time.sleep(0.005)
        code = os.waitstatus_to_exitcode(status)
        assert code == 0, f"child ended with {code} (negative: killed by that signal) after writes {writes}"
    finally:
        w.close()
        shmwheel.unlink(name)
