"""The public API: lifetime, timers, the fake-clock poll, bad input, errors."""

from __future__ import annotations

import errno
import json
import math
import os
import pickle
import random
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import posix_ipc
import pytest
from conftest import TESTING_CORE_MISSING, entry, fresh_name, handle_of, header, top

import shmwheel
from shmwheel._binding import ffi, lib


def to_ns(seconds: float) -> int:
    """The C core's conversion of a time in seconds to nanoseconds."""
    out = ffi.new("int64_t *")
    assert lib.shmw_seconds_to_ns(seconds, out) == 0
    return int(out[0])


def seconds_below(ns: int) -> float:
    """The largest float time that converts to fewer than ``ns`` nanoseconds.

    At a long uptime a float of seconds cannot name every nanosecond; these
    two helpers keep the boundary tests exact whatever the uptime.
    """
    x = ns / 1e9
    while to_ns(x) >= ns:
        x = math.nextafter(x, 0)
    while to_ns(math.nextafter(x, math.inf)) < ns:
        x = math.nextafter(x, math.inf)
    return x


def seconds_at_least(ns: int) -> float:
    """The smallest float time that converts to ``ns`` nanoseconds or more."""
    return math.nextafter(seconds_below(ns), math.inf)


def clock(w: shmwheel.Wheel) -> float:
    """The wheel clock: a fake "now" that fires nothing new."""
    return w.stats().clock


# -- lifetime -----------------------------------------------------------------


def test_create_attach_share_one_segment(make_wheel) -> None:
    w = make_wheel(capacity=10)
    other = shmwheel.attach(w.name)
    try:
        h = w.add(60)
        assert len(other) == 1
        assert other.cancel(h) is True
        assert len(w) == 0
    finally:
        other.close()


def test_create_over_existing_name_raises_and_keeps_segment(make_wheel) -> None:
    w = make_wheel(capacity=10)
    w.add(60)
    with pytest.raises(shmwheel.SegmentExistsError) as info:
        shmwheel.create(w.name, capacity=10)
    assert isinstance(info.value, FileExistsError) and info.value.errno == errno.EEXIST
    assert info.value.filename == "/" + w.name
    assert len(w) == 1


def test_attach_and_unlink_missing_raise_not_found(name: str) -> None:
    for missing in (shmwheel.attach, shmwheel.unlink):
        with pytest.raises(shmwheel.SegmentNotFoundError) as info:
            missing(name)
        exc = info.value
        # What code that knows only the builtin looks at, as it would for open().
        assert isinstance(exc, FileNotFoundError) and exc.errno == errno.ENOENT
        assert exc.filename == "/" + name
        assert str(exc) == f"no shmwheel segment named {name!r}"
        back = pickle.loads(pickle.dumps(exc))
        assert (back.errno, back.filename, str(back)) == (exc.errno, exc.filename, str(exc))


def test_leading_slash_names_the_same_wheel(make_wheel) -> None:
    w = make_wheel(capacity=10)
    with shmwheel.attach("/" + w.name) as other:
        assert other.capacity == 10


@pytest.mark.parametrize("bad", ["", "/", "a/b", "..", ".", "sp ace", "x" * 201, "ünï", "tab\t", "//x"])
def test_invalid_names_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid wheel name"):
        shmwheel.create(bad, capacity=1)
    with pytest.raises(ValueError, match="invalid wheel name"):
        shmwheel.attach(bad)


def test_name_must_be_str() -> None:
    with pytest.raises(TypeError):
        shmwheel.create(b"abc", capacity=1)  # type: ignore[arg-type]


def test_longest_name_is_accepted(make_wheel) -> None:
    n = (fresh_name() + "x" * 200)[:200]
    w = make_wheel(capacity=1, name=n)
    assert w.name == n


@pytest.mark.parametrize(
    "kw, exc",
    [
        ({"capacity": 0}, ValueError),
        ({"capacity": -1}, ValueError),
        ({"capacity": 2**31}, ValueError),
        ({"capacity": "10"}, TypeError),
        ({"capacity": True}, TypeError),
        ({"capacity": 10, "tick": 0}, ValueError),
        ({"capacity": 10, "tick": math.nan}, ValueError),
        ({"capacity": 10, "tick": 1e-7}, ValueError),
        ({"capacity": 10, "tick": 61}, ValueError),
        ({"capacity": 10, "tick": "1ms"}, TypeError),
        ({"capacity": 10, "payload_size": -1}, ValueError),
        ({"capacity": 10, "payload_size": 65537}, ValueError),
        ({"capacity": 10, "wheel_size": 100}, ValueError),
        ({"capacity": 10, "wheel_size": 8}, ValueError),
        ({"capacity": 10, "wheel_size": 8192}, ValueError),
        ({"capacity": 10, "mode": 0o1777}, ValueError),
    ],
)
def test_create_rejects_bad_parameters_and_leaves_nothing(name: str, kw: dict, exc: type) -> None:
    with pytest.raises(exc):
        shmwheel.create(name, **kw)
    assert not Path("/dev/shm", name).exists()


def test_mode_is_applied_whatever_the_umask(make_wheel) -> None:
    old = os.umask(0o077)
    try:
        w1 = make_wheel(capacity=1, mode=0o640)
    finally:
        os.umask(old)
    old = os.umask(0)
    try:
        w2 = make_wheel(capacity=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(f"/dev/shm/{w1.name}").st_mode) == 0o640
    assert stat.S_IMODE(os.stat(f"/dev/shm/{w2.name}").st_mode) == 0o600


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a segment away")
def test_owner_is_given_the_segment(make_wheel) -> None:
    """owner=(uid, gid) for a creator that will drop privileges; -1 leaves one as it is."""
    w1 = make_wheel(capacity=1, owner=(65534, 65534))
    w2 = make_wheel(capacity=1, owner=(-1, 65534))
    s1, s2 = os.stat(f"/dev/shm/{w1.name}"), os.stat(f"/dev/shm/{w2.name}")
    assert (s1.st_uid, s1.st_gid) == (65534, 65534)
    assert (s2.st_uid, s2.st_gid) == (0, 65534)


def test_attach_refuses_a_foreign_segment(name: str) -> None:
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=4096)
    os.write(shm.fd, b"definitely not a wheel")
    shm.close_fd()
    with pytest.raises(shmwheel.IncompatibleSegmentError, match="not a shmwheel segment"):
        shmwheel.attach(name)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_attach_refuses_what_is_not_a_regular_file(name: str, kind: str) -> None:
    """shm_open opens whatever /dev/shm holds under the name; posix_ipc's own
    error for a directory is a bare "Invalid parameter(s)"."""
    path = Path("/dev/shm", name)
    {"directory": os.mkdir, "fifo": os.mkfifo, "symlink": lambda p: os.symlink("/etc/hostname", p)}[kind](path)
    try:
        with pytest.raises(shmwheel.IncompatibleSegmentError, match="is not a shmwheel segment: not a regular file"):
            shmwheel.attach(name)
        with pytest.raises(shmwheel.SegmentExistsError):
            shmwheel.create(name, capacity=4)
    finally:
        (os.rmdir if kind == "directory" else os.unlink)(path)


def test_attach_gives_up_on_a_segment_that_never_gets_initialised(name: str) -> None:
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=4096)
    shm.close_fd()
    with pytest.raises(shmwheel.IncompatibleSegmentError, match="not an initialised"):
        shmwheel.attach(name)


@pytest.mark.parametrize("field, match", [("version", "layout version"), ("entry_size", "struct sizes")])
def test_attach_refuses_another_version_or_abi(make_wheel, field: str, match: str) -> None:
    w = make_wheel(capacity=4)
    h = header(w)
    t = top(w)  # the version is the segment's, in its first bytes; the struct sizes each shard's too
    if field == "version":
        t.version += 1
    else:
        ffi.cast("uint32_t *", ffi.addressof(h, "version"))[2] += 8  # version, header_size, entry_size
    try:
        with pytest.raises(shmwheel.IncompatibleSegmentError, match=match):
            shmwheel.attach(w.name)
    finally:
        if field == "version":
            t.version -= 1
        else:
            ffi.cast("uint32_t *", ffi.addressof(h, "version"))[2] -= 8


def test_close_is_idempotent_and_later_calls_fail_clearly(make_wheel) -> None:
    w = make_wheel(capacity=4)
    with w:
        h = w.add(60)
    assert w.closed
    w.close()
    for call in (lambda: w.add(1), lambda: w.cancel(h), lambda: len(w), lambda: w.poll(), w.stats, w.check):
        with pytest.raises(ValueError, match="closed"):
            call()
    with shmwheel.attach(w.name) as again:
        assert again.cancel(h) is True


def test_wheel_pickles_by_name_and_reattaches(make_wheel) -> None:
    w = make_wheel(capacity=4)
    w.add(60)
    copy = pickle.loads(pickle.dumps(w))
    try:
        assert copy is not w and copy.name == w.name
        assert len(copy) == 1
    finally:
        copy.close()


def test_unlink_keeps_open_mappings_working_and_refuses_new_timers(make_wheel) -> None:
    """The timers in a removed wheel can still be cancelled; a new one is
    refused, so that its adder attaches the name again instead of adding
    to a wheel that nothing will drive."""
    w = make_wheel(capacity=4)
    h = w.add(60)
    w.unlink()
    assert not Path("/dev/shm", w.name).exists()
    assert w.stats().removed
    with pytest.raises(shmwheel.SegmentRemovedError, match="attach the name again"):
        w.add(60)
    with pytest.raises(shmwheel.SegmentRemovedError):
        w.add_many([60, 60])
    assert len(w) == 1
    assert w.cancel(h)
    w.check()


def test_a_wheel_dropped_without_close_leaves_no_file_descriptor(make_wheel) -> None:
    """A worker lets a replaced wheel go rather than close it under another
    thread: collecting it must give back everything it held."""
    w = make_wheel(capacity=4)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        shmwheel.attach(w.name)  # dropped at once
    assert len(os.listdir("/proc/self/fd")) <= before + 1


def test_wheel_cannot_be_constructed_directly() -> None:
    with pytest.raises(TypeError, match="create"):
        shmwheel.Wheel()


# -- exceptions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "cls, builtin",
    [
        (shmwheel.SegmentExistsError, FileExistsError),
        (shmwheel.SegmentNotFoundError, FileNotFoundError),
        (shmwheel.IncompatibleSegmentError, None),
        (shmwheel.CorruptSegmentError, None),
        (shmwheel.WheelFullError, None),
    ],
)
def test_exceptions_pickle_and_inherit(cls: type, builtin: type | None) -> None:
    exc = cls("segment 'x': something")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and back.args == exc.args
    assert isinstance(back, shmwheel.ShmwheelError)
    if builtin is not None:
        assert isinstance(back, builtin)


# -- adding, cancelling, handles ---------------------------------------------------


def test_add_cancel_counts(wheel: shmwheel.Wheel) -> None:
    handles = [wheel.add(60 + i) for i in range(10)]
    assert len(set(handles)) == 10 and all(h > 0 for h in handles)
    assert len(wheel) == 10
    assert sum(wheel.cancel(h) for h in handles[:4]) == 4
    st = wheel.stats()
    assert (st.pending, st.added, st.cancelled, st.fired) == (6, 10, 4, 0)
    assert sum(st.level_pending) == 6


def test_cancel_is_true_once(wheel: shmwheel.Wheel) -> None:
    h = wheel.add(60)
    assert wheel.cancel(h) is True
    assert wheel.cancel(h) is False


def test_stale_handle_never_touches_the_slot_reuser(make_wheel) -> None:
    w = make_wheel(capacity=1)
    old = w.add(60)
    assert w.cancel(old)
    new = w.add(60)
    assert new != old
    assert w.cancel(old) is False
    assert w.reset(old, 1) is False
    assert len(w) == 1
    assert w.cancel(new) is True


def test_a_handle_of_another_wheel_cancels_nothing_here(make_wheel) -> None:
    """Two fresh wheels hand out the same slots in the same order: without a
    key of its own in each handle, B's first handle named A's first timer."""
    a, b = make_wheel(capacity=8), make_wheel(capacity=8)
    mine = [a.add(60) for _ in range(4)]
    theirs = [b.add(60) for _ in range(4)]
    for h in theirs:
        assert a.cancel(h) is False
        assert a.reset(h, 1) is False
    assert a.cancel_many(theirs) == 0
    assert len(a) == 4 and len(b) == 4
    assert a.cancel_many(mine) == 4 and b.cancel_many(theirs) == 4


def test_handles_are_never_reused(make_wheel) -> None:
    w = make_wheel(capacity=2)
    seen = set()
    for _ in range(2000):
        h = w.add(60)
        assert h not in seen
        seen.add(h)
        w.cancel(h)


def test_fired_handle_cannot_be_cancelled(wheel: shmwheel.Wheel) -> None:
    now = clock(wheel)
    h = wheel.add_at(now + 0.0005)
    assert [f.handle for f in wheel.poll(now + 0.002)] == [h]
    assert wheel.cancel(h) is False


def test_handle_that_names_no_slot_is_not_pending(make_wheel) -> None:
    w = make_wheel(capacity=3)
    assert w.cancel(0) is False
    assert w.cancel(3) is False  # slot 3 of a 3-slot wheel
    assert w.cancel(2**63 - 1) is False


@pytest.mark.parametrize(
    "bad, exc",
    [("1", TypeError), (1.0, TypeError), (None, TypeError), (-1, ValueError), (2**63, ValueError), (2**64, ValueError)],
)
def test_bad_handles_raise(wheel: shmwheel.Wheel, bad: object, exc: type) -> None:
    h = wheel.add(60)
    for call in (wheel.cancel, lambda x: wheel.reset(x, 1), lambda x: wheel.cancel_many([h, x])):
        with pytest.raises(exc):
            call(bad)
    assert len(wheel) == 1 and wheel.stats().cancelled == 0


@pytest.mark.parametrize("bad", [-1, -1e-9, math.nan, math.inf, -math.inf])
def test_bad_delays_raise_and_change_nothing(wheel: shmwheel.Wheel, bad: float) -> None:
    h = wheel.add(60)
    before = wheel.stats()
    for call in (wheel.add, wheel.add_at, lambda d: wheel.reset(h, d), lambda d: wheel.reset_at(h, d)):
        with pytest.raises(ValueError, match="finite, non-negative"):
            call(bad)
    with pytest.raises(ValueError):
        wheel.add_many([1, 2, bad])
    assert wheel.stats() == before


def test_delay_beyond_the_maximum_names_it(wheel: shmwheel.Wheel) -> None:
    with pytest.raises(ValueError, match=r"maximum delay of 4611686018 s"):
        wheel.add(shmwheel.MAX_DELAY * 1.001)
    with pytest.raises(ValueError, match="maximum"):
        wheel.add_at(time.monotonic() + shmwheel.MAX_DELAY * 1.001)
    assert len(wheel) == 0


def test_an_add_in_nanoseconds_checks_its_deadline_and_keeps_it_to_the_nanosecond(wheel: shmwheel.Wheel) -> None:
    # shmw_add_at_ns is the worker's path's add (shmwheel._fast): no Python
    # wrapper checks its argument, so the core must.
    now_ns = to_ns(clock(wheel))
    assert lib.shmw_add_at_ns(wheel._w, -1, ffi.NULL, 0, 0) == lib.SHMW_ETIME
    assert lib.shmw_add_at_ns(wheel._w, -(2**63), ffi.NULL, 0, 0) == lib.SHMW_ETIME
    # Too far ahead is judged on the real clock, as shmw_add_at judges it.
    far = time.monotonic_ns() + lib.SHMW_MAX_DELAY_NS + 10**9
    assert lib.shmw_add_at_ns(wheel._w, far, ffi.NULL, 0, 0) == lib.SHMW_ERANGE
    assert lib.shmw_add_at_ns(wheel._w, 2**63 - 1, ffi.NULL, 0, 0) == lib.SHMW_ERANGE
    assert lib.shmw_add_at_ns(wheel._w, now_ns + 1, b"x" * 100_000, 100_000, 0) == lib.SHMW_EPAYLOAD
    assert lib.shmw_add_at_ns(wheel._w, now_ns + 1, ffi.NULL, 0, 1 << 30) == lib.SHMW_EINVAL
    assert len(wheel) == 0
    furthest = lib.shmw_add_at_ns(wheel._w, time.monotonic_ns() + lib.SHMW_MAX_DELAY_NS, ffi.NULL, 0, 0)
    assert furthest > 0 and wheel.cancel(furthest)
    # Exact where seconds in a double are not: 2**60 ns is 36 years, and a
    # double of that many seconds is good to about 240 ns.
    for deadline_ns in (now_ns + 123_456_789, now_ns + 2**60 + 1):
        h = lib.shmw_add_at_ns(wheel._w, deadline_ns, b"ns", 2, 0)
        assert h > 0
        (f,) = wheel.poll(seconds_at_least(deadline_ns + 10**9))
        assert (f.handle, f.deadline_ns, f.payload) == (h, deadline_ns, b"ns")


@pytest.mark.parametrize(
    "huge, words",
    [(2**1024, "maximum delay of 4611686018 s"), (10**400, "maximum"), (-(2**1024), "non-negative")],
    ids=["2**1024", "10**400", "-2**1024"],
)
def test_a_number_too_big_for_a_double_is_out_of_range(wheel: shmwheel.Wheel, huge: int, words: str) -> None:
    """An int past the range of a double: the same ValueError as any delay out of range, not an OverflowError."""
    h = wheel.add(60)
    calls = (wheel.add, wheel.add_at, lambda d: wheel.reset(h, d), lambda d: wheel.reset_at(h, d))
    for call in (*calls, lambda d: wheel.add_many([1, d])):
        with pytest.raises(ValueError, match=words):
            call(huge)
    assert len(wheel) == 1


def test_ten_years_and_the_maximum_are_accepted(wheel: shmwheel.Wheel) -> None:
    ten_years = 10 * 365.25 * 86400
    h1 = wheel.add(ten_years)
    h2 = wheel.add(shmwheel.MAX_DELAY)
    assert len(wheel) == 2
    assert wheel.poll(clock(wheel) + ten_years - 1) == []
    assert [f.handle for f in wheel.poll(clock(wheel) + 2)] == [h1]
    assert wheel.cancel(h2)


@pytest.mark.parametrize("bad", ["1", None, b"1", [1]])
def test_delay_of_wrong_type_raises_type_error(wheel: shmwheel.Wheel, bad: object) -> None:
    with pytest.raises(TypeError, match="number of seconds"):
        wheel.add(bad)  # type: ignore[arg-type]
    assert len(wheel) == 0


def test_payload_limits(make_wheel) -> None:
    w = make_wheel(capacity=4, payload_size=8)
    w.add(60, b"12345678")
    with pytest.raises(ValueError, match="payload_size of 8 bytes"):
        w.add(60, b"123456789")
    with pytest.raises(ValueError, match="payload_size"):
        w.add_many([60, 60], [b"", b"123456789"])
    with pytest.raises(TypeError, match="payload must be bytes"):
        w.add(60, "text")  # type: ignore[arg-type]
    assert len(w) == 1


def test_payload_accepts_bytes_like(wheel: shmwheel.Wheel) -> None:
    now = clock(wheel)
    wheel.add_at(now, bytearray(b"ab"))
    wheel.add_at(now, memoryview(b"cd"))
    assert sorted(f.payload for f in wheel.poll(now)) == [b"ab", b"cd"]


def test_full_wheel_raises_keeps_timers_and_recovers(make_wheel) -> None:
    w = make_wheel(capacity=3)
    hs = [w.add(60, b"%d" % i) for i in range(3)]
    with pytest.raises(shmwheel.WheelFullError, match="all 3 slots"):
        w.add(1)
    with pytest.raises(shmwheel.WheelFullError):
        w.add_many([1])
    assert len(w) == 3
    assert w.cancel(hs[1])
    h = w.add(60)
    assert len(w) == 3 and h not in hs
    w.check()


def test_a_producer_that_floods_a_tick_holds_up_another_producers_timer_by_one_turn_of_the_lanes(make_wheel) -> None:
    """5,000 timers of this process and then one of another, all due at the
    same moment: the clock takes a due bucket's lanes in turn, so the other
    producer's timer comes out among the first few, not after the flood
    (before: 5,001st).  What keeps a forger's flood from delaying the
    real request timeouts due with it (bench/flood.py)."""
    w = make_wheel(capacity=8192)
    at = time.monotonic() + 600  # a wheel driven alone: polled at that moment below, not waited for
    for _ in range(5000):
        w.add_at(at, b"flood")
    other = "import shmwheel, sys; shmwheel.attach(sys.argv[1]).add_at(float(sys.argv[2]), b'other')"
    subprocess.run([sys.executable, "-c", other, w.name, repr(at)], check=True, timeout=30)
    fires: list[bytes] = []
    while len(fires) < 5001:
        fires += [fire.payload for fire in w.poll(now=at + 0.01)]
    assert fires.index(b"other") < 2 * lib.SHMW_LANES, fires.index(b"other")


def test_a_reserve_is_left_to_reserved_adds(make_wheel) -> None:
    """The last free slots go only to adds that ask for them: not to other
    adds, not to a batch; a reserved add takes them and then finds the
    wheel full too."""
    w = make_wheel(capacity=10, reserve=3)
    assert (w.reserve, w.stats().reserve) == (3, 3)
    w.add_many([60] * 5)
    with pytest.raises(shmwheel.WheelFullError, match="fewer than 3 .* free \\(besides the 3 kept in reserve\\)"):
        w.add_many([60] * 3)
    w.add(60)
    w.add(60, cancel_on_exit=True)
    with pytest.raises(shmwheel.WheelFullError, match="in use or kept in reserve \\(the last 3 free ones go only to"):
        w.add(60)
    mine = [w.add(60, b"r", reserved=True), w.add_at(time.monotonic() + 60, reserved=True), w.add(60, reserved=True)]
    with pytest.raises(shmwheel.WheelFullError):
        w.add(60, reserved=True)
    assert len(w) == 10 and w.stats().free == 0
    assert w.cancel(mine[0])
    with pytest.raises(shmwheel.WheelFullError):
        w.add(60)  # the one free slot is the reserve's
    w.check()
    with pytest.raises(ValueError, match="reserve must be between 0 and 9, not 10"):
        make_wheel(capacity=10, reserve=10)


def test_add_many_is_all_or_nothing(make_wheel) -> None:
    w = make_wheel(capacity=10)
    w.add_many([60] * 7)
    with pytest.raises(shmwheel.WheelFullError, match="fewer than 4 of the wheel's 10 slots are free; none was added"):
        w.add_many([60] * 4)
    assert len(w) == 7
    with pytest.raises(ValueError, match="3 delays but 2 payloads"):
        w.add_many([1, 2, 3], [b"", b""])
    with pytest.raises(TypeError):
        w.add_many([1, "2"])
    assert len(w) == 7


def test_add_many_beyond_the_capacity_checks_its_arguments_first(make_wheel) -> None:
    w = make_wheel(capacity=4)
    # A wrong argument is a TypeError whatever the batch's size ...
    with pytest.raises(TypeError, match="delay must be a number of seconds, not str"):
        w.add_many([1, 1, 1, 1, "x"])
    with pytest.raises(TypeError, match="payload must be bytes"):
        w.add_many([1] * 5, [b""] * 4 + [3])
    # ... and a right one that cannot fit says so, not that the slots are in use.
    with pytest.raises(shmwheel.WheelFullError, match="add_many of 5 timers: the wheel holds at most 4"):
        w.add_many([1] * 5)
    assert len(w) == 0


def test_a_bool_is_a_number_on_every_path(make_wheel) -> None:
    # True is 1 to the call into C; the checks that name a bad argument
    # after a refused call must agree, or they blame the wrong one.
    w = make_wheel(capacity=4)
    before = time.monotonic()
    h = w.add(True, b"one second")
    after = time.monotonic()
    with pytest.raises(TypeError, match="payload must be bytes"):
        w.add(True, 123)  # type: ignore[arg-type]
    (fire,) = w.poll(before + 5)
    assert fire.handle == h and before + 1.0 <= fire.deadline <= after + 1.0
    assert w.cancel(True) is False and len(w) == 0


def test_add_many_and_cancel_many(wheel: shmwheel.Wheel) -> None:
    now = clock(wheel)
    hs = wheel.add_many([0.0, 0.0, 60.0, 60.0], [b"a", b"bb", b"ccc", b""])
    assert len(hs) == 4 and len(set(hs)) == 4
    assert wheel.add_many([]) == [] and wheel.cancel_many([]) == 0
    assert wheel.cancel_many([hs[2], hs[2], hs[3]]) == 2
    fired = wheel.poll(now + 1)
    assert sorted(f.payload for f in fired) == [b"a", b"bb"]
    assert wheel.cancel_many(hs) == 0
    assert wheel.add_many(iter([60.0])) and len(wheel) == 1


# -- the clock: never early, at most one tick late ------------------------------


@pytest.mark.parametrize("tick", [0.001, 0.0005, 0.01])
@pytest.mark.parametrize("offset_ns", [0, 1, 499_999, 500_000, 999_999, 1_000_000, 1_000_001, 7_654_321])
def test_fires_at_first_tick_boundary_at_or_after_deadline(make_wheel, tick: float, offset_ns: int) -> None:
    w = make_wheel(capacity=4, tick=tick)
    tick_ns = round(tick * 1e9)
    deadline = seconds_at_least(round(clock(w) * 1e9) + 3_000_000 + offset_ns)
    deadline_ns = to_ns(deadline)
    boundary_ns = -(-deadline_ns // tick_ns) * tick_ns
    h = w.add_at(deadline, b"p")
    assert w.poll(seconds_below(deadline_ns)) == []
    assert w.poll(seconds_below(boundary_ns)) == []
    at = seconds_at_least(boundary_ns)
    (fire,) = w.poll(at)
    assert fire.handle == h
    assert fire.deadline_ns == deadline_ns
    assert fire.fired_at_ns == to_ns(at)
    assert 0 <= fire.fired_at_ns - boundary_ns < tick_ns
    assert fire.payload == b"p" and fire.owner_pid == os.getpid()


def test_fire_fields(wheel: shmwheel.Wheel) -> None:
    now = clock(wheel)
    deadline = now + 0.123456789
    h = wheel.add_at(deadline, b"\x00payload\x00\x00")
    (f,) = wheel.poll(now + 1)
    assert f.handle == h
    assert f.deadline_ns == to_ns(deadline) == round(deadline * 1e9)
    assert abs(f.deadline - deadline) <= max(1e-9, 2 * math.ulp(deadline))
    assert f.fired_at_ns == to_ns(now + 1)
    assert f.lateness == pytest.approx(now + 1 - deadline)
    assert f.payload == b"\x00payload\x00\x00"
    assert f.owner_pid == os.getpid()


def test_poll_returns_in_tick_order_across_levels(make_wheel) -> None:
    w = make_wheel(capacity=5000, wheel_size=16)
    now = clock(w)
    rng = random.Random(7)
    delays = [
        rng.choice([rng.random() * 0.05, rng.random() * 5, rng.random() * 500, 16**k * 0.001 + rng.random()])
        for k in range(6)
        for _ in range(400)
    ]
    hs = set(w.add_many(delays))
    fires = []
    t = now
    # Advance in uneven steps, including big jumps, collecting everything.
    for step in [0.0007, 0.013, 0.25, 3, 0.5, 40, 700, 20000, 1e6]:
        t += step
        batch = w.poll(t)
        assert all(f.deadline_ns <= round(t * 1e9) + 1 for f in batch)
        fires += batch
    assert {f.handle for f in fires} == hs
    assert len(fires) == len(hs)
    tick_ns = 1_000_000
    ticks = [-(-f.deadline_ns // tick_ns) for f in fires]
    assert ticks == sorted(ticks)


def test_poll_with_max_fires_leaves_the_rest_due(wheel: shmwheel.Wheel) -> None:
    now = clock(wheel)
    hs = wheel.add_many([0.0] * 10 + [0.002] * 10)
    first = wheel.poll(now + 1, max_fires=7)
    assert len(first) == 7
    assert wheel.poll(now + 1, max_fires=0) == []
    rest = wheel.poll(now + 1)
    assert len(rest) == 13
    assert {f.handle for f in first + rest} == set(hs)


def test_poll_in_the_past_fires_nothing_and_clock_never_goes_back(wheel: shmwheel.Wheel) -> None:
    now = clock(wheel)
    wheel.add_at(now + 0.5)
    wheel.poll(now + 0.1)
    c = clock(wheel)
    assert wheel.poll(now) == []
    assert clock(wheel) == c
    assert len(wheel.poll(now + 0.5)) == 1


def test_deadline_in_the_past_fires_at_the_next_poll(wheel: shmwheel.Wheel) -> None:
    now = clock(wheel)
    wheel.poll(now + 10)
    h = wheel.add_at(now)  # ten seconds behind the wheel clock
    (f,) = wheel.poll(now + 10)
    assert f.handle == h and f.deadline_ns == round(now * 1e9)


def test_poll_default_now_is_the_monotonic_clock(wheel: shmwheel.Wheel) -> None:
    h = wheel.add(0)
    time.sleep(2 * wheel.tick)  # it fires at the first tick boundary after now
    before = time.monotonic()
    (f,) = wheel.poll()
    assert f.handle == h
    assert before - 0.001 <= f.fired_at <= time.monotonic() + 0.001


@pytest.mark.parametrize(
    "now, max_fires, exc",
    [
        (math.nan, None, ValueError),
        (-1, None, ValueError),
        ("x", None, TypeError),
        (None, -1, ValueError),
        (None, 1.5, TypeError),
    ],
)
def test_poll_rejects_bad_arguments(wheel: shmwheel.Wheel, now: object, max_fires: object, exc: type) -> None:
    wheel.add(0)
    with pytest.raises(exc):
        wheel.poll(now, max_fires)  # type: ignore[arg-type]
    assert len(wheel) == 1


def test_reset_moves_a_timer_both_ways(wheel: shmwheel.Wheel) -> None:
    now = clock(wheel)
    a = wheel.add_at(now + 100)
    b = wheel.add_at(now + 0.010)
    assert wheel.reset_at(a, now + 0.005)
    assert wheel.reset_at(b, now + 5000)
    (f,) = wheel.poll(now + 0.006)
    assert f.handle == a and f.deadline_ns == round((now + 0.005) * 1e9)
    assert wheel.poll(now + 4999) == []
    (g,) = wheel.poll(now + 5000)
    assert g.handle == b
    assert wheel.reset(a, 1) is False
    assert wheel.stats().resets == 2


def test_reset_within_the_same_bucket(wheel: shmwheel.Wheel) -> None:
    now = clock(wheel)
    h = wheel.add_at(now + 0.0101)
    assert wheel.reset_at(h, now + 0.0102)
    wheel.check()
    (f,) = wheel.poll(now + 0.011)
    assert f.deadline_ns == round((now + 0.0102) * 1e9)


def test_timeout_context_manager_cancels_on_exit(wheel: shmwheel.Wheel) -> None:
    with wheel.timeout(30, b"req") as h:
        assert len(wheel) == 1 and isinstance(h, int)
    assert len(wheel) == 0
    with pytest.raises(RuntimeError):
        with wheel.timeout(30):
            raise RuntimeError("boom")
    assert len(wheel) == 0 and wheel.stats().cancelled == 2


def test_retired_slot_is_never_handed_out_again(make_wheel) -> None:
    """A slot whose generation would wrap is retired instead of reused."""
    w = make_wheel(capacity=2)
    max_gen = (1 << (63 - 1)) - 1  # capacity 2: one slot bit
    entry(w, 0).generation = max_gen - 1  # handed out once more, at max_gen
    h = w.add(60)
    assert h == handle_of(w, 0, max_gen)
    assert w.cancel(h)
    st = w.stats()
    assert (st.retired, st.free) == (1, 1)
    w.check()
    h2 = w.add(60)
    assert h2 & 1 == 1
    with pytest.raises(shmwheel.WheelFullError):
        w.add(60)
    assert w.cancel(h) is False


# -- stats, check, threads -----------------------------------------------------------


def test_stats_describe_the_wheel(make_wheel) -> None:
    w = make_wheel(capacity=100, tick=0.002, payload_size=16, wheel_size=64)
    st = w.stats()
    assert (st.capacity, st.tick, st.payload_size, st.wheel_size) == (100, 0.002, 16, 64)
    assert st.levels == w.levels == len(st.level_pending)
    assert st.next_expiry is None
    w.add(0.5)
    w.add(100)
    st = w.stats()
    assert st.level_pending[0] == 0 and sum(st.level_pending) == 2
    assert st.next_expiry is not None and st.next_expiry >= st.clock
    assert st.as_dict()["pending"] == 2


def test_check_names_the_broken_invariant(wheel: shmwheel.Wheel) -> None:
    wheel.add(60)
    h = header(wheel)
    free = wheel.capacity - 1
    h.free_count += 1
    try:
        with pytest.raises(shmwheel.CorruptSegmentError, match=f"counters: free_count is {free + 1} but {free} "):
            wheel.check()
    finally:
        h.free_count -= 1
    wheel.check()


def test_damaged_segment_is_refused_until_repaired(wheel: shmwheel.Wheel) -> None:
    """The flag a lock holder's death leaves behind stops every operation but
    a look (stats, the producers: what a driver needs to open it and repair)."""
    h = wheel.add(60)
    header(wheel).flags |= lib.SHMW_F_DAMAGED
    try:
        for call in (lambda: wheel.add(1), lambda: wheel.cancel(h), wheel.poll, lambda: len(wheel)):
            with pytest.raises(shmwheel.CorruptSegmentError):
                call()
        with pytest.raises(shmwheel.CorruptSegmentError, match="died holding the lock"):
            wheel.check()
        assert wheel.stats().pending == 1 and len(wheel.producers()) == 1
    finally:
        header(wheel).flags &= ~lib.SHMW_F_DAMAGED
    assert wheel.cancel(h)


def _count_until(stop: threading.Event, ticks: list[float]) -> None:
    while not stop.is_set():
        ticks.append(time.monotonic())


def test_threads_share_a_wheel_and_the_gil_is_released(make_wheel) -> None:
    w = make_wheel(capacity=400_000)
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            for _ in range(5000):
                hs = [w.add(30) for _ in range(4)]
                assert all(w.cancel(h) for h in hs)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = w.stats()
    assert st.pending == 0 and st.added == st.cancelled == 4 * 5000 * 4

    # While one thread is inside a long C call, another runs Python.  The
    # arguments are built first, so that the window is the call into C and
    # nothing else.  A held GIL lets the counter's thread run at most at
    # the call's edges (at a check of the eval loop just before the call,
    # or just after it, before its end is read: a switch interval for it to
    # be asked to drop the GIL, one for it to run), never in its middle; a
    # released one lets it run through the call, once the kernel wakes it
    # (8 ms here, on a busy machine).  So the call is made long - about 2
    # million adds, tens of milliseconds - and the counter must have run in
    # it more than three switch intervals from either end, in one of five
    # tries.
    big = make_wheel(capacity=2_000_000)
    n = 1_950_000
    delays, handles = ffi.new("double[]", [60.0] * n), ffi.new("int64_t[]", n)
    switch = sys.getswitchinterval()
    late: list[float] = []
    for _ in range(5):
        ticks: list[float] = []
        stop = threading.Event()
        t = threading.Thread(target=_count_until, args=(stop, ticks))
        t.start()
        time.sleep(0.01)
        start = time.monotonic()
        rc = lib.shmw_add_many(big.core, delays, n, ffi.NULL, ffi.NULL, handles)
        end = time.monotonic()
        stop.set()
        t.join()
        assert rc == 0 and len(big) == n
        assert big.cancel_many(ffi.unpack(handles, n)) == n
        late = [x for x in ticks if start + 3 * switch < x < end - 3 * switch]
        if late:
            break
    assert late, f"no Python ran in a {end - start:.4f} s call into C, {3 * switch:g} s from its ends, 5 times"


def test_the_shipped_core_has_no_test_entry_points() -> None:
    """The suite runs on the core built with the test hooks (conftest.py);
    the module the package ships is the same sources without them, and
    without the segment's structs in its cdef."""
    if TESTING_CORE_MISSING is not None:
        pytest.skip(f"needs shmwheel._shmwheel_testing: {TESTING_CORE_MISSING}")
    probe = (
        "import json\n"
        "from shmwheel import _shmwheel as shipped, _shmwheel_testing as testing\n"
        "def names(m): return sorted(n for n in dir(m.lib) if n.startswith(('shmw_', 'SHMW_')))\n"
        "def structs(m): return sorted(n for n in m.ffi.list_types()[1] if n.startswith('shmw_'))\n"
        "print(json.dumps([names(shipped), names(testing), structs(shipped), structs(testing)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    shipped, testing, shipped_structs, testing_structs = json.loads(out)
    hooks = {
        "shmw_test_crash_after",
        "shmw_test_stop_after",
        "shmw_test_clock_cap",
        "shmw_test_layout",
        "SHMW_CRASH_EXIT",
        "SHMW_TEST_CLOCK_CAP_MAX_NS",
    }
    assert hooks <= set(testing), "the tests' core lost a hook"
    assert not hooks & set(shipped), "a test hook ships"
    assert set(shipped) < set(testing), "the tests' core lacks something the shipped one has"
    assert shipped_structs == ["shmw_fire", "shmw_params", "shmw_stats"]
    assert {"shmw_header", "shmw_entry", "shmw_bucket"} <= set(testing_structs)
    assert hasattr(lib, "shmw_test_crash_after"), "this process should run on the tests' core"
