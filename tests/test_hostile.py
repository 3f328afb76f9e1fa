"""A scribbled segment, a dying producer, a wall-clock step: the C core reports
instead of crashing, the driver recovers instead of stalling."""

from __future__ import annotations

import collections
import errno
import functools
import inspect
import itertools
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import adds_to, entry, header, layout, mutex_span, put_in_flight, top, top_size, wait_for

import shmwheel
from shmwheel._binding import ffi, lib
from shmwheel._process import alive, start_time


def heap(w: shmwheel.Wheel):
    return ffi.cast("uint32_t *", w._buf + layout(w).heap)


# -- process identity -----------------------------------------------------------------


def test_start_time_identifies_a_process() -> None:
    me = start_time(os.getpid())
    assert me is not None and alive(os.getpid(), me)
    assert not alive(os.getpid(), me + 1), "another start time is another process"
    assert start_time(0) is None and start_time(-1) is None


def test_a_zombie_or_reaped_process_is_not_alive() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 5
        while start_time(pid) is not None:  # a zombie until reaped: counts as gone
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        os.waitpid(pid, 0)
    assert start_time(pid) is None


# -- corruption -----------------------------------------------------------------------


def test_scribbled_heap_entry_is_reported_not_followed(make_wheel) -> None:
    """A bucket index far out of bounds in the heap: cancel and check report it."""
    w = make_wheel(capacity=16)
    hs = [w.add(d) for d in (1, 100, 10_000, 1_000_000)]  # four buckets, four heap entries
    heap(w)[1] = 0x7FFFFFF0
    with pytest.raises(shmwheel.CorruptSegmentError):
        w.cancel(hs[0])
    with pytest.raises(shmwheel.CorruptSegmentError, match="delay-heap|bucket"):
        w.check()
    # Found half-way through a removal, it leaves the segment inconsistent:
    # this wheel is for the bin (the fixture skips a segment that is gone).
    w.close()
    shmwheel.unlink(w.name)


def test_scribbled_bucket_expiry_fails_an_add_without_changing_anything(make_wheel) -> None:
    w = make_wheel(capacity=16)
    w.add(60)
    st = w.stats()
    # The bucket the first timer went to: the one with a lane in use.
    buckets = ffi.cast("struct shmw_bucket *", w._buf + layout(w).buckets)
    used = next(i for i in range(w.levels * w.wheel_size) if buckets[i].lane_mask)
    buckets[used].expires += 1
    try:
        with pytest.raises(shmwheel.CorruptSegmentError):
            w.add(60)  # lands in the same bucket, whose expiry no longer matches
    finally:
        buckets[used].expires -= 1
    assert w.stats() == st, "a failed add changed the segment"
    w.check()


def my_lane(w: shmwheel.Wheel):
    """This process's magazine of free slots."""
    return header(w).magazines[w._producer % lib.SHMW_LANES]


def test_a_scribbled_magazine_count_is_reported_before_the_checker_walks_it(make_wheel) -> None:
    """A huge magazine count over a list that loops: a free list has no back
    links, so only the count bounds the walk, and it is checked first."""
    w = make_wheel(capacity=16)
    w.cancel(w.add(60))  # this process's magazine now holds every slot
    mag = my_lane(w)
    count, first = mag.free_count, mag.free_head
    link = entry(w, first).next
    mag.free_count, entry(w, first).next = 0xFFFFFFFF, first
    try:
        with pytest.raises(shmwheel.CorruptSegmentError, match=r"magazine \d+: count 4294967295, over 63"):
            w.check()
    finally:
        mag.free_count, entry(w, first).next = count, link
    w.check()


def test_scribbled_lane_bits_fail_a_cancel_without_changing_anything(make_wheel) -> None:
    """Bits above the lanes in a bucket's mask: emptying its last list would
    leave the bucket in the heap with nothing in it, so the cancel refuses."""
    w = make_wheel(capacity=16)
    h = w.add(60)
    buckets = ffi.cast("struct shmw_bucket *", w._buf + layout(w).buckets)
    used = next(i for i in range(w.levels * w.wheel_size) if buckets[i].lane_mask)
    buckets[used].lane_mask |= 1 << lib.SHMW_LANES
    try:
        with pytest.raises(shmwheel.CorruptSegmentError):
            w.cancel(h)
    finally:
        buckets[used].lane_mask &= ~(1 << lib.SHMW_LANES)
    assert w.cancel(h), "the failed cancel changed the timer"
    assert header(w).heap_len == 0, "the emptied bucket stayed in the delay-heap"


def test_a_scribbled_producer_fails_a_cancel_without_touching_another_lane(make_wheel) -> None:
    """The producer field picks the lane list a cancel unlinks from.  Scribbled
    to name another lane of the same bucket, the entry's neighbours still
    agree with each other, and the unlink would take down the other list's
    count (cutting its entries off once it reached 0); it is refused."""
    w = make_wheel(capacity=16)
    other = shmwheel.attach(w.name)
    fake_start = 12345  # a second slot for this pid: a second lane
    at = time.monotonic() + 60
    mine = [w.add_at(at) for _ in range(3)]
    slot = lib.shmw_producer_attach(other.core, os.getpid(), fake_start, 0)
    try:
        assert slot >= 0 and slot % lib.SHMW_LANES != w._producer % lib.SHMW_LANES
        theirs = [other.add_at(at) for _ in range(2)]
        middle = entry(w, mine[1] & ((1 << lib.shmw_index_bits(w.capacity)) - 1))
        real = middle.producer
        middle.producer = slot
        st = w.stats()
        try:
            with pytest.raises(shmwheel.CorruptSegmentError):
                w.cancel(mine[1])
            assert w.stats() == st, "the failed cancel changed the segment"
        finally:
            middle.producer = real
        w.check()
        assert w.cancel_many(mine + theirs) == 5
    finally:
        lib.shmw_producer_release(other.core, slot, os.getpid(), fake_start)
        other.close()


def test_a_scribbled_link_in_the_shared_free_list_fails_an_add_without_changing_anything(make_wheel) -> None:
    """A refill walks the slots it takes, and the link it leaves behind,
    before it moves any: a link out of bounds is reported, not stored."""
    w = make_wheel(capacity=128)
    for _ in range(lib.SHMW_MAGAZINE):  # the first refill's slots, all taken: the magazine is empty
        w.add(60)
    assert my_lane(w).free_count == 0
    i = header(w).free_head
    for _ in range(4):  # the fifth slot on the shared list
        i = entry(w, i).next
    link = entry(w, i).next
    entry(w, i).next = 0x7FFFFFF0
    st = w.stats()
    try:
        with pytest.raises(shmwheel.CorruptSegmentError):
            w.add(60)
        assert w.stats() == st, "the failed add changed the segment"
    finally:
        entry(w, i).next = link
    w.add(60)
    w.check()


def test_in_flight_walk_is_bounded_by_capacity(make_wheel) -> None:
    # A cycle in the in-flight list, and a count that says four billion:
    # register's walk must stop after capacity steps and call it corrupt.
    # Unbounded, it would still end in ECORRUPT, but after 2**32 steps under
    # the lock, and the child's time limit is what tells the two apart: the
    # cycle runs through 64 Ki slots of about a kilobyte, so that each step
    # misses the caches and 2**32 of them take minutes, where the bounded
    # walk takes milliseconds.
    n = 1 << 16
    w = make_wheel(capacity=n, payload_size=1024)
    w.add_many([0] * n)
    put_in_flight(w, n)
    hd = header(w)
    first, last = hd.inflight_head, hd.inflight_tail
    assert first != last
    entry(w, last).next = first
    hd.inflight = 0xFFFFFFFF
    try:
        code = (
            "import os, shmwheel\n"
            "from shmwheel._binding import lib\n"
            f"w = shmwheel.attach({w.name!r})\n"
            "print(lib.shmw_driver_register(w.core, os.getpid(), 1, 0, 0))\n"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
        assert int(done.stdout) == lib.SHMW_ECORRUPT, done.stderr
    finally:
        entry(w, last).next = lib.SHMW_NIL
        hd.inflight = n
    assert w.stats().driver_pid is None


@pytest.mark.parametrize("link", ["next", "prev"])
@pytest.mark.parametrize("to", ["beyond the slab", "a free slot"])
def test_a_scribbled_in_flight_link_is_reported_not_followed(make_wheel, link: str, to: str) -> None:
    w = make_wheel(capacity=8)
    w.add_many([0, 0, 0])
    put_in_flight(w, 3)
    hd = header(w)
    middle = entry(w, hd.inflight_head).next
    free = next(i for i in range(8) if entry(w, i).state == lib.SHMW_FREE)
    was = getattr(entry(w, middle), link)
    setattr(entry(w, middle), link, 0x7FFF0000 if to == "beyond the slab" else free)
    try:
        # poll hands out what a dead driver left in flight, unlinking each.
        # With `next` scribbled the head goes first, and is returned; the
        # middle entry fails the poll after it.
        first = w.poll() if link == "next" else []
        assert len(first) == (1 if link == "next" else 0)
        with pytest.raises(shmwheel.CorruptSegmentError):
            w.poll()
    finally:
        setattr(entry(w, middle), link, was)
    # Mended, the list gives up the rest: nothing was followed into the
    # free slot or beyond the slab, and nothing was lost.
    rest = w.poll()
    assert len(first) + len(rest) == 3 and w.stats().in_flight == 0


def test_scribbled_in_flight_tail_stops_the_clock_cleanly(make_wheel) -> None:
    w = make_wheel(capacity=8)
    me = os.getpid()
    assert lib.shmw_driver_register(w.core, me, start_time(me), 0, 0) == 0
    try:
        w.add(0)
        time.sleep(0.005)
        hd = header(w)
        hd.inflight_tail = 0x20000000
        stop = ffi.new("int *")
        try:
            assert lib.shmw_driver_clock(w.core, stop, 16) == lib.SHMW_ECORRUPT
        finally:
            hd.inflight_tail = lib.SHMW_NIL
        assert len(w) == 1 and w.stats().in_flight == 0, "the timer left its bucket"
    finally:
        assert lib.shmw_driver_register(w.core, 0, 0, me, start_time(me)) == 0


# -- bounded lock holds ---------------------------------------------------------------


def test_a_big_cascade_is_done_in_bounded_steps_and_poll_still_returns_everything_due(make_wheel) -> None:
    """10,000 timers share one level-2 bucket; a poll just past its start must
    cascade them all (in several lock holds) and return exactly the due ones."""
    w = make_wheel(capacity=20_000, payload_size=0, wheel_size=16)
    now = w.stats().clock
    g2 = 16**2 * 0.001  # a level-2 bucket spans 256 ticks
    start = (int(now / g2) + 4) * g2  # a level-2 bucket boundary well ahead
    due = set(w.add_many([start - time.monotonic() + 0.0001 + 0.00002 * i for i in range(10)]))
    w.add_many([start - time.monotonic() + 0.05 + (i % 200) * 0.001 for i in range(10_000)])
    fires = w.poll(start + 0.001)
    assert {f.handle for f in fires} == due
    assert len(w) == 10_000
    w.check()
    assert len(w.poll(start + 1)) == 10_000


# -- the driver's wake-up ---------------------------------------------------------------


def test_clock_recovers_from_a_producer_that_died_before_its_wake(make_wheel, tmp_path) -> None:
    """A producer lowered sleep_until and bumped the wake word, then died before
    FUTEX_WAKE: the clock still wakes, at its sleep cap, for the timer behind."""
    # What the README promises, written here, against the cap the core is
    # built with: changing either alone fails the test.
    assert lib.SHMW_MAX_SLEEP_NS == 100_000_000 == lib.shmw_test_clock_cap(0)
    w = make_wheel(capacity=10)
    w.add(3600)
    d = shmwheel.start_driver(w.name)
    try:
        time.sleep(0.3)  # asleep until the 1 h timer
        hd, passed = header(w), top(w)
        # Meanwhile the clock wakes at its cap, each time noting when: never
        # sooner after the last (the kernel does not end a sleep early), and
        # later by a wake-up's delay.  Of the passes seen in 1.5 s, two are
        # less than 0.5 s apart unless a busy machine delays every one of
        # them by 0.4 s; a cap of that much or more keeps them all further.
        passes = [passed.passed_ns]
        until = time.monotonic() + 1.5
        while time.monotonic() < until:
            if passed.passed_ns != passes[-1]:
                passes.append(passed.passed_ns)
            time.sleep(0.001)
        gaps = [b - a for a, b in itertools.pairwise(passes)]
        assert gaps and 100_000_000 <= min(gaps) < 500_000_000, gaps
        for _ in range(8):  # at eight phases of the clock's capped sleep
            time.sleep(random.uniform(0, 0.1))
            # What the dead producer left: sleep_until lowered (here to 0,
            # as low as it goes) and the word bumped, but no FUTEX_WAKE.
            # The add below is due after sleep_until, so it skips the wake.
            hd.sleep_until = 0
            passed.wake_word += 1
            added = time.monotonic()
            h = w.add(0.02)
            # Only the cap wakes the clock: within a few seconds however
            # busy the machine, where without it the clock sleeps the hour.
            while len(w) > 1 and time.monotonic() < added + 10:
                time.sleep(0.001)
            assert len(w) == 1, "the clock did not wake for a due timer"
            assert w.cancel(h) is False
    finally:
        assert d.stop() == 0


def test_run_exits_cleanly_when_on_ready_raises(make_wheel) -> None:
    """The C threads are stopped and joined before the wheel is unmapped."""
    w = make_wheel(capacity=10)
    driver = shmwheel.Driver(w.name)

    def boom() -> None:
        raise RuntimeError("on_ready failed")

    with pytest.raises(RuntimeError, match="on_ready failed"):
        driver.run(on_ready=boom)
    assert not any(t.name.startswith("shmwheel-") for t in threading.enumerate())
    st = w.stats()
    assert (st.driver_pid, st.driver_state) == (None, "none")


def test_fifo_driver_stops_while_waiting_for_a_reader(make_wheel, tmp_path) -> None:
    w = make_wheel(capacity=10)
    fifo = tmp_path / "f"
    os.mkfifo(fifo)
    driver = shmwheel.Driver(w.name, fifo=fifo)
    t = threading.Thread(target=driver.run)
    t.start()
    time.sleep(0.2)
    driver.stop()
    t.join(timeout=5)
    assert not t.is_alive()
    assert w.stats().driver_pid is None


def test_signal_handler_can_stop_a_driver(make_wheel) -> None:
    w = make_wheel(capacity=10)
    driver = shmwheel.Driver(w.name)
    old = signal.signal(signal.SIGUSR1, lambda *_: driver.stop())
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        driver.run()
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert w.stats().driver_pid is None


# -- the environment ------------------------------------------------------------------


def test_a_segment_too_big_for_dev_shm_fails_at_create_and_leaves_nothing(name: str) -> None:
    """The memory is reserved with posix_fallocate, so a full /dev/shm fails now, not with SIGBUS later."""
    free = os.statvfs("/dev/shm")
    too_many = (free.f_blocks * free.f_frsize) // (40 + 64) + 1_000  # more slots than /dev/shm can hold
    with pytest.raises(OSError, match="no room in /dev/shm") as info:
        shmwheel.create(name, capacity=min(too_many, lib.SHMW_MAX_CAPACITY), payload_size=64)
    assert info.value.errno == errno.ENOSPC
    assert not os.path.exists(f"/dev/shm/{name}")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another uid")
def test_another_user_cannot_attach(make_wheel) -> None:
    w = make_wheel(capacity=4)
    pid = os.fork()
    if pid == 0:  # the child: becomes nobody, then tries
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                shmwheel.attach(w.name)
            except PermissionError:
                code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "another user attached"


def _race_create(name: str, barrier, results) -> None:
    barrier.wait()
    try:
        w = shmwheel.create(name, capacity=16)
        w.close()
        results.put("created")
    except shmwheel.SegmentExistsError:
        results.put("exists")


def test_racing_creates_of_one_name_have_one_winner(name: str) -> None:
    ctx = multiprocessing.get_context("fork")
    for _ in range(10):
        barrier, results = ctx.Barrier(6), ctx.Queue()
        procs = [ctx.Process(target=_race_create, args=(name, barrier, results)) for _ in range(6)]
        for p in procs:
            p.start()
        outcomes = sorted(results.get(timeout=30) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        assert outcomes == ["created"] + ["exists"] * 5
        with shmwheel.attach(name) as w:
            w.check()
        shmwheel.unlink(name)


def test_a_jammed_lock_word_is_reported_not_waited_on_forever(make_wheel) -> None:
    """A lock word naming a thread that never existed: no release will come."""
    w = make_wheel(capacity=4)
    jammed = shmwheel.attach(w.name, lock_timeout=0.5)
    word = ffi.cast("int32_t *", w._buf + mutex_span()[0])  # the mutex's lock word
    assert word[0] == 0
    word[0] = 0x3FFFFFF0  # "held by" a tid above pid_max, so never cleaned up by the kernel
    try:
        started = time.monotonic()
        with pytest.raises(
            shmwheel.LockTimeoutError, match="not released in 0.5 s: it names thread 1073741808, which does not exist"
        ) as caught:
            jammed.add(1)
        took = time.monotonic() - started
        assert 0.5 <= took < 5.0, f"reported after {took:.2f} s"  # half the default 10 s it would wait otherwise
        assert isinstance(caught.value, TimeoutError) and caught.value.holder_pid is None
    finally:
        word[0] = 0
        jammed.close()
    w.check()
    # "Reported after 10 s" by default, as the README says: the figure is
    # written here, not read from the constant, so that changing the
    # constant without the README fails this test.
    for call in (shmwheel.attach, shmwheel.create):
        assert inspect.signature(call).parameters["lock_timeout"].default == 10.0


def test_a_stopped_lock_holder_is_named_not_blamed_on_the_segment(make_wheel) -> None:
    """A process stopped (SIGSTOP, a debugger, a frozen cgroup) while it holds
    the lock: the others' calls time out naming it and its state, and the
    segment is fine once it is resumed."""
    w = make_wheel(capacity=4)
    pid = os.fork()
    if pid == 0:  # the holder: stops itself half-way through an add, lock held
        child = shmwheel.attach(w.name)
        lib.shmw_test_stop_after(3)
        code = 0 if child.add(60, b"held") >= 0 else 1
        os._exit(code)
    try:
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        with pytest.raises(shmwheel.LockTimeoutError, match=f"held by process {pid}, which is stopped") as caught:
            shmwheel.attach(w.name, lock_timeout=0.3)  # attaching takes the lock too
        assert caught.value.holder_pid == pid
    finally:
        os.kill(pid, signal.SIGCONT)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the add went on once the holder was resumed"
    w.check()
    assert len(w) == 1


def test_a_holder_stopped_in_one_shards_lock_holds_up_that_shard_alone(make_wheel, tmp_path) -> None:
    """A process stopped while it holds shard 0's lock, with a timer of
    shard 0 due meanwhile: the driver's clock and dispatcher look at shard
    0 again later and later, and serve shard 1 all the while.  Once the
    holder goes on, shard 0's timer fires too.  (Before, the clock waited
    on shard 0's lock, for the whole lock timeout, with every shard.)"""
    w = make_wheel(capacity=64, payload_size=8, shards=2)
    out = tmp_path / "fires.txt"
    out.touch()
    index_mask = (1 << lib.shmw_index_bits(w.capacity)) - 1

    driver = shmwheel.start_driver(w.name, functools.partial(_record_fire, str(out)))
    try:
        adds_to(w, 0)
        first = w.add(0.3, b"shard 0")
        assert (first & index_mask) < w.capacity // 2
        pid = os.fork()
        if pid == 0:  # the holder: stops itself half-way through an add to shard 0, lock held
            adds_to(w, 0)  # a forked child adds to its pid's shard until it attaches
            lib.shmw_test_stop_after(3)
            code = 0 if w.add(60, b"held") >= 0 else 1
            os._exit(code)
        try:
            _, status = os.waitpid(pid, os.WUNTRACED)
            assert os.WIFSTOPPED(status)
            adds_to(w, 1)
            second = w.add(0.5, b"shard 1")
            assert (second & index_mask) >= w.capacity // 2
            # Shard 0's timer comes due at 0.3 s, while its lock is held: the
            # clock goes on to shard 1's at 0.5 s, in far less than the
            # driver's 10 s lock timeout.
            wait_for(lambda: str(second) in out.read_text(), timeout=8.0)  # within the lock timeout, 10 s
            assert str(first) not in out.read_text()
        finally:
            os.kill(pid, signal.SIGCONT)
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        wait_for(lambda: str(first) in out.read_text())
    finally:
        assert driver.stop() == 0
    w.check()


def _record_fire(path: str, fire: shmwheel.Fire) -> None:  # runs in the driver
    with open(path, "a") as f:
        f.write(f"{fire.handle} {fire.payload.hex()} {int(fire.redelivered)}\n")


@pytest.mark.parametrize("shards", [1, 2], ids=["one shard", "two shards"])
def test_live_scribbles_never_stop_the_driver_and_spare_the_healthy_timers(make_wheel, tmp_path, shards: int) -> None:
    """Random bytes scribbled all over a segment while a driver fires and a
    producer adds: no crash, no hang; every timer whose slot was never hit is
    delivered exactly once; a damaged one at most once or twice.  With two
    shards, the adds go to each in turn.

    Spared: the parameters (which no repair can rewrite: every process has
    its own copies, and a new attacher refuses the segment), each shard's
    mutex (a jammed lock is test_a_jammed_lock_word...'s case), the driver's
    registration (scribbled, it reads as another driver taking over, which
    stops this one on purpose) and the removed mark (it is meant to stick).
    """
    w = make_wheel(capacity=2048, payload_size=8, shards=shards)
    out = tmp_path / "fires.txt"
    driver = shmwheel.start_driver(w.name, functools.partial(_record_fire, str(out)), audit_interval=0.2)
    hd = header(w)
    lay = layout(w)
    shard_size, shard_capacity = top(w).shard_size, w.capacity // shards

    def field(name: str, k: int) -> int:  # shard k's header's, from the segment's first byte
        return top_size() + k * shard_size + ffi.offsetof("struct shmw_header", name)

    spared = [(0, ffi.offsetof("struct shmw_top", "producers"))]
    for k in range(shards):
        spared += [(field("magic", k), field("elapsed", k)), (field("removed", k), field("removed", k) + 4)]
        spared += [(field("driver_pid", k), field("sleep_until", k))]
        spared += [(lo + k * shard_size, hi + k * shard_size) for lo, hi in [mutex_span()]]
    size = top_size() + shards * shard_size
    hit_slots: set[int] = set()
    rng = random.Random(15)
    stop = threading.Event()

    def scribble() -> None:
        while not stop.wait(0.002):
            off = rng.randrange(size)
            if any(lo <= off < hi for lo, hi in spared):
                continue
            k, in_shard = divmod(off - top_size(), shard_size)
            if off >= top_size() and in_shard >= lay.slab - top_size():
                hit_slots.add(k * shard_capacity + (in_shard - (lay.slab - top_size())) // hd.stride)
            w._buf[off] = bytes([rng.randrange(256)])

    def spread(seq: int) -> None:
        """This process's next adds to the next shard: as a producer of
        another start time, whose id falls in that shard (ids go round the
        shards in blocks of 8).  The driver reaps those ids as of a process
        that is gone, and attach then takes another."""
        if shards == 1 or seq % 200:
            return
        want = seq // 200 % shards
        start = starts.get(want, 4_000_000 + seq)
        for _ in range(4 * shards):
            if (got := lib.shmw_producer_attach(w.core, os.getpid(), start, 0)) < 0:
                return
            if got // 8 % shards == want:
                starts[want] = start
                return
            start += 1

    starts: dict[int, int] = {}  # shard: the start time of this process's id there
    added: dict[int, bytes] = {}
    scribbler = threading.Thread(target=scribble)
    try:
        scribbler.start()
        until = time.monotonic() + 2.0
        seq = 0
        while time.monotonic() < until:
            payload = seq.to_bytes(8, "little")
            spread(seq)
            seq += 1
            try:
                added[w.add(rng.uniform(0, 0.3), payload)] = payload
            except (shmwheel.CorruptSegmentError, shmwheel.WheelFullError):
                time.sleep(0.005)  # an add that met a scribble adds nothing; the driver repairs
            if seq % 20 == 0:
                time.sleep(0.002)
    finally:
        stop.set()
        scribbler.join()
    slot_mask = (1 << (w.capacity - 1).bit_length()) - 1
    healthy = {h for h in added if h & slot_mask not in hit_slots}
    assert len(healthy) > 1000, "too few timers came through to tell"
    assert {(h & slot_mask) // shard_capacity for h in healthy} == set(range(shards)), "the adds were not spread"

    def fires() -> list[tuple[int, bytes]]:
        text = out.read_text() if out.exists() else ""
        text = text[: text.rfind("\n") + 1]  # whole lines: the handler may be half-way through one
        return [(int(h), bytes.fromhex(p)) for h, p, _ in (line.split(" ") for line in text.splitlines())]

    try:
        wait_for(lambda: healthy <= {h for h, _ in fires()}, timeout=30)
    except AssertionError:
        missing = healthy - {h for h, _ in fires()}
        raise AssertionError(f"{len(missing)} healthy timers never fired; driver alive: {driver.is_alive()}") from None
    time.sleep(0.5)  # an audit or two more: room for a duplicate to show up
    got = fires()
    counts = collections.Counter(h for h, _ in got)
    assert all(counts[h] == 1 for h in healthy), "a healthy timer was delivered twice"
    assert all(added[h] == p for h, p in got if h in healthy)
    assert max(counts.values()) <= 2
    assert driver.is_alive(), "the driver stopped"
    assert driver.stop() == 0
    st = w.stats()
    assert st.repairs > 0, "no scribble was ever found: the test did not test"
    w.repair()  # what the last scribbles may have left: the make_wheel fixture checks it


def test_a_full_producer_table_fails_a_cancel_on_exit_add_in_one_lock_hold(make_wheel) -> None:
    """The 1,025th attached process: its cancel_on_exit add fails at once
    with WheelFullError.  It does not sweep the table for the dead itself
    (a read of /proc for each of 1,024 processes, 17 ms): the driver does
    that once a second, off every producer's path."""
    w = make_wheel(capacity=16)  # this process: slot 0
    other = shmwheel._wheel.observe(w.name)
    gone = [(1 << 22) + k for k in range(lib.SHMW_MAX_PRODUCERS - 1)]  # above any pid_max: never alive
    try:
        for pid in gone:
            assert lib.shmw_producer_attach(other.core, pid, 1, 0) >= 0
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                late = shmwheel.attach(w.name)
                try:
                    late.add(60, cancel_on_exit=True)
                except shmwheel.WheelFullError as exc:
                    code = 0 if "records 1024 attached processes" in str(exc) else 2
            finally:
                os._exit(code)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
        assert len(w.producers()) == lib.SHMW_MAX_PRODUCERS, "the add swept the table itself"
        assert w.reap_dead_producers() == 0 and len(w.producers()) == 1  # as the driver does
    finally:
        other.close()


def test_a_file_shrunk_under_an_attached_process_is_reported_not_touched(name: str) -> None:
    """Past its end the mapping is SIGBUS (as with LMDB, beyond what any
    process survives); check() and repair() look at the file's size first."""
    w = shmwheel.create(name, capacity=1000)
    try:
        size = os.fstat(w._fd.fd).st_size
        os.truncate(f"/dev/shm/{name}", size // 2)
        for call in (w.check, w.repair):
            with pytest.raises(shmwheel.CorruptSegmentError, match=f"shrunk to {size // 2} of its {size} bytes"):
                call()
        os.truncate(f"/dev/shm/{name}", size)  # what is gone reads as zeroes: a fresh slab it is not
    finally:
        w.close()


def test_a_scribbled_reserve_is_refused_at_open_and_changes_nothing_for_those_open() -> None:
    """Each process copies the reserve at open, checked to be below the
    capacity: one scribbled after that changes nothing for it, and a
    process that opens the segment then is refused, not made to refuse
    every add."""
    name = f"shmwheel-test-reserve-{os.getpid()}"
    w = shmwheel.create(name, capacity=10, reserve=2)
    try:
        header(w).reserve = 0xFFFFFFFF
        w.add_many([60] * 8)
        with pytest.raises(shmwheel.WheelFullError):
            w.add(60)
        assert w.add(60, reserved=True) >= 0
        with pytest.raises(shmwheel.CorruptSegmentError):
            shmwheel.attach(name)
        header(w).reserve = 2
        with shmwheel.attach(name) as again:
            assert again.reserve == 2
    finally:
        w.close()
        shmwheel.unlink(name)
