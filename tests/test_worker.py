"""The worker's timer (shmwheel.contrib._worker's RequestTimer): its timers
added and cancelled as the worker's; a wheel that is full, missing,
replaced, removed or closed under it; threads and forks.  Its start and
finish in C (shmwheel._fast's Clerk): the record its own Python path
packs, byte for byte, and the wheel's lock, held elsewhere, waited for
with the GIL released.  Its stack signal after a fork, and what it tells
a new driver."""

from __future__ import annotations

import contextvars
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _contrib import WAIT, _hold, _timer

import shmwheel
from shmwheel import _fast
from shmwheel._binding import lib
from shmwheel._fast import Clerk
from shmwheel.contrib import PAYLOAD_SIZE, RequestTimer, encode_request
from shmwheel.contrib._record import HEAD, KIND_LATE, KIND_REQUEST, MAGIC, MAX_REQUEST_ID, decode_request


def test_request_timer_adds_and_cancels_owned_by_the_worker(make_wheel) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(wheel.name, 30.0, traceback_signal=None)
    handle = timer.start("GET", "/x")
    assert handle is not None and len(wheel) == 1
    assert [pid for pid, _, _ in wheel.producers()] == [os.getpid()]
    timer.finish(handle)
    assert len(wheel) == 0
    timer.finish(None)  # a request that had no timer


def test_request_timer_without_a_wheel_lets_requests_run(name: str, caplog) -> None:
    timer = RequestTimer(name, 1.0, traceback_signal=None)
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        assert timer.start("GET", "/") is None
        assert timer.start("GET", "/") is None
    assert caplog.text.count("requests run without a timeout") == 1  # not once per request


def _a_second_later(timer: RequestTimer) -> None:
    """Make the timer's next start() its once-a-second look at the wheel."""
    timer._look_at = 0
    if timer._fast is not None:  # the C path looks when its own time comes
        timer._fast.look_at = 0


def test_request_timer_follows_its_wheel_when_it_is_replaced(name: str, caplog) -> None:
    """Removed or replaced under a worker: the next request attaches the name
    again; a request that started in the old wheel is still cancelled there."""
    old = shmwheel.create(name, capacity=16, payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(name, 30.0, traceback_signal=None)
    before = timer.start("GET", "/before")
    assert before is not None and len(old) == 1
    shmwheel.unlink(name)  # marks it removed: the next add knows at once
    new = shmwheel.create(name, capacity=16, payload_size=PAYLOAD_SIZE)
    try:
        after = timer.start("GET", "/after")
        assert after is not None and len(new) == 1
        timer.finish(before)
        timer.finish(after)
        assert (len(old), len(new)) == (0, 0), "a request's timer was left behind"
        # Removed by hand (rm in /dev/shm): nothing marks it, so the worker
        # finds out when it next looks at the name, within a second.
        os.unlink(f"/dev/shm/{name}")
        newer = shmwheel.create(name, capacity=16, payload_size=PAYLOAD_SIZE)
        try:
            _a_second_later(timer)
            assert timer.start("GET", "/later") is not None
            assert (len(new), len(newer)) == (0, 1)
            # And removed with nothing in its place: requests run without a timer, said once.
            shmwheel.unlink(name)
            with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
                assert timer.start("GET", "/orphan") is None
                assert timer.start("GET", "/orphan") is None
            assert caplog.text.count("requests run without a timeout") == 1
        finally:
            newer.close()
    finally:
        old.close()
        new.close()


def test_a_request_started_before_its_wheel_went_is_cancelled_there_even_with_no_wheel_to_follow(name: str) -> None:
    """rm /dev/shm/NAME (or systemd-logind's RemoveIPC) under a running driver:
    the worker finds nothing to attach, yet the request that ends in time must
    still be cancelled in the old wheel, which the driver still drives."""
    old = shmwheel.create(name, capacity=16, payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(name, 30.0, traceback_signal=None)
    try:
        h = timer.start("GET", "/finished-in-time")
        os.unlink(f"/dev/shm/{name}")
        _a_second_later(timer)
        assert timer.start("GET", "/other") is None  # nothing to attach to
        timer.finish(h)
        assert len(old) == 0, "the finished request's timer would still fire"
    finally:
        old.close()


def test_request_timer_threads_replacing_and_finishing_raise_nothing(name: str) -> None:
    """finish() in some threads while another replaces the wheel (what a
    thread does when its add says the wheel was removed) as fast as it can:
    no AttributeError or closed-Wheel ValueError escapes into a request."""
    shmwheel.create(name, capacity=1024, payload_size=PAYLOAD_SIZE).close()
    timer = RequestTimer(name, 30.0, traceback_signal=None)
    assert timer.prepare()
    errors: list[BaseException] = []
    stop = threading.Event()

    def finisher() -> None:
        while not stop.is_set():
            try:
                timer.finish(12345)
            except BaseException as exc:
                errors.append(exc)

    def replacer() -> None:
        while not stop.is_set():
            current = timer._wheel
            if current is not None:
                timer._replaced(current)
            timer._ready()

    threads = [threading.Thread(target=finisher) for _ in range(3)] + [threading.Thread(target=replacer)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes
    try:
        for t in threads:
            t.start()
        time.sleep(3.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(old_interval)
    assert errors == []


def test_request_timer_with_a_full_wheel_lets_requests_run(make_wheel, caplog) -> None:
    wheel = make_wheel(capacity=1, payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(wheel.name, 30.0, traceback_signal=None)
    first = timer.start("GET", "/1")
    assert first is not None
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        assert timer.start("GET", "/2") is None
    assert "a request runs without a timeout" in caplog.text
    # Finished, as a server finishes it: a request left in progress here would
    # be reported as overdue by a later test's look at this process's requests.
    timer.finish(first)


def test_request_timer_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="invalid wheel name"):
        RequestTimer("a b", 1.0)
    with pytest.raises(ValueError, match="positive"):
        RequestTimer("ok", 0)
    with pytest.raises(ValueError, match="no signal"):
        RequestTimer("ok", 1.0, traceback_signal="SIGNOPE")


def test_request_timer_in_a_forked_child_is_the_childs(make_wheel) -> None:
    """A worker forked after the timer was used adds timers of its own (cancelled if it dies)."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(wheel.name, 30.0, traceback_signal=None)
    timer.finish(timer.start("GET", "/in-the-parent"))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: add a timer and die without cancelling it
        try:
            handle = timer.start("GET", "/in-the-child")
            os.write(w, b"1" if handle is not None else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    assert len(wheel) == 1
    assert wheel.reap_dead_producers() == 1  # it was the child's, so it went with the child
    assert len(wheel) == 0


# -- its start and finish in C (shmwheel._fast's Clerk) --------------------------------------------


# method, path, request id: the plain case and every boundary the C path decides on.
CASES = [
    ("GET", "/api/v1/items/12345", "req-abc-123"),
    ("GET", "/", None),
    ("POST", "/a/b?c=d é", "abc.7"),  # a path that is not ASCII
    ("GET", "/x", "A" * MAX_REQUEST_ID),  # the longest id taken
    ("GET", "/x", "A" * (MAX_REQUEST_ID + 1)),  # too long: the record's own id stands in
    ("GET", "/x", "has space"),  # a character REQUEST_ID refuses
    ("GET", "/x", "é"),  # not ASCII
    ("GET", "/x", ""),
    ("GET", "/x", "._:@/+=-Zz09"),  # every punctuation REQUEST_ID takes
    ("GET", "/\udcff", "r"),  # surrogateescape
    ("M" * 32, "/x", "r"),  # the longest method packed in place
    ("M" * 33, "/x", "r"),  # longer: cut by encode_request
    ("GÉT", "/x", "r"),  # replaced characters: encode_request's way
    ("GET", "/" + "p" * 300, "r"),  # cut to fit
]


# A request's own timeout (a route's) and start (X-Request-Start), in ns from
# now; None: the timer's.  With warn_after=10 s, the 5 s timeout has no warn
# stage, and a start 12 s ago is past it.
TIMES = [(None, 0), (5 * 10**9, 0), (60 * 10**9, 0), (None, -2 * 10**9), (60 * 10**9, -12 * 10**9), (1, -(10**9))]


@pytest.mark.parametrize(("timeout", "since"), TIMES)
@pytest.mark.parametrize(("method", "path", "request_id"), CASES)
def test_fast_start_packs_the_record_its_own_path_packs(
    make_wheel, method: str, path: str, request_id, timeout: int | None, since: int
) -> None:
    """The C record is byte-identical to the Python one, and so is the table's entry."""
    wheel = make_wheel(payload_size=256)
    for kw, task in (({}, None), ({"warn_after": 10.0}, None), ({"warn_after": 10.0, "interrupt": True}, object())):
        timer = _timer(wheel, **kw)
        assert timer._fast is not None
        now = time.monotonic_ns()
        own = (timeout, now + since) if timeout is not None or since else ()
        fast = timer._fast.start(now, method, path, request_id, task, *own)
        slow = timer._start_slow(
            now, method, path, request_id, task, timer._timeout_ns if timeout is None else timeout, now + since
        )
        assert slow is not None
        if fast is None:  # what the C path gives back: only records to cut or replace characters in
            assert len(method) > 32 or not method.isascii() or len(timer._active[slow].payload) == 256
            timer.finish(slow)
            continue
        a, b = timer._active[fast], timer._active[slow]
        assert a.payload == b.payload
        assert a._replace(handle=0) == b._replace(handle=0)
        assert type(a) is type(b)
        assert timer.current_handle() == slow
        timer.finish(fast)
        timer.finish(slow)
        assert len(wheel) == 0 and not timer._active


def test_fast_start_and_finish_are_the_timers_path(make_wheel) -> None:
    wheel = make_wheel()
    timer = _timer(wheel)
    calls = []
    timer._start_slow = lambda *a: calls.append(a)  # type: ignore[method-assign]
    handle = timer.start("GET", "/x", "r")
    assert handle is not None and calls == []
    assert timer.current_handle() == handle and len(wheel) == 1
    record = decode_request(timer._active[handle].payload)
    assert record is not None and (record.method, record.path, record.request_id) == ("GET", "/x", "r")
    timer.finish(handle)
    assert len(wheel) == 0 and not timer._active
    timer.finish(handle)  # finished already: nothing
    assert wheel.stats().cancelled == 1


def test_fast_start_in_a_greenlet_names_it(make_wheel) -> None:
    greenlet = pytest.importorskip("greenlet")
    wheel = make_wheel()
    timer = _timer(wheel)
    assert timer._getcurrent is not None and timer._fast is not None
    got: list[tuple[object, object]] = []

    def serve() -> None:
        now = time.monotonic_ns()
        fast = timer._fast.start(now, "GET", "/g", "r", None)
        slow = timer._start_slow(now, "GET", "/g", "r", None, timer._timeout_ns, now)
        got.append((timer._active[fast], timer._active[slow]))
        timer.finish(fast)
        timer.finish(slow)

    g = greenlet.greenlet(serve)
    g.switch()
    ((a, b),) = got
    assert a.payload == b.payload and a.task is g is b.task
    record = decode_request(a.payload)
    assert record is not None and record.task == id(g) and record.task_kind == "greenlet"


@pytest.mark.parametrize("step", ["start", "finish"])
def test_a_held_lock_is_waited_for_with_the_gil_released(make_wheel, step: str) -> None:
    """The C path only tries the lock: held elsewhere, the cffi call waits
    for it, and the process's other threads run meanwhile."""
    wheel = make_wheel()
    timer = _timer(wheel)
    assert timer._fast is not None
    handle = timer.start("GET", "/x", "r") if step == "finish" else None
    held = threading.Event()
    ticks = [0]
    stop = threading.Event()
    mark: list[int] = []  # the ticks when the request's timer went for the lock

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    # The lock is let go once the ticker has ticked 20 times since the
    # timer went for it: with the GIL held through the wait, the ticker
    # (and the holder, which looks at it) could not run, and the timer
    # would wait out its lock timeout instead.  A held GIL lets the ticker
    # run only at the call's edges, a tick or two, never 20.
    holder = threading.Thread(target=_hold, args=(wheel, held, lambda: bool(mark) and ticks[0] >= mark[0] + 20))
    ticker = threading.Thread(target=tick)
    holder.start()
    held.wait()
    ticker.start()
    try:
        mark.append(ticks[0])
        if step == "start":
            handle = timer.start("GET", "/x", "r")
            assert handle is not None and handle in timer._active
        else:
            timer.finish(handle)
            assert not timer._active
        ran = ticks[0] - mark[0]
    finally:
        stop.set()
        holder.join()
        ticker.join()
    assert ran >= 20, "the other threads did not run while the request's timer waited"
    assert len(wheel) == (1 if step == "start" else 0)
    timer.finish(handle)
    assert len(wheel) == 0


def test_a_try_on_a_held_lock_gives_up_at_once(make_wheel) -> None:
    """The lock is held until both tries have returned: a try that waited for
    it would wait out its 10 s lock timeout (or the holder's WAIT) and then
    not say EBUSY."""
    wheel = make_wheel()
    h = wheel.add(30.0)
    held, tried = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold, args=(wheel, held, tried.is_set))
    holder.start()
    held.wait()
    try:
        t0 = time.monotonic()
        busy = (lib.shmw_add(wheel.core, 30.0, b"", 0, lib.SHMW_TRYLOCK), lib.shmw_try_cancel(wheel.core, h))
        gave_up = time.monotonic() - t0
    finally:
        tried.set()
        holder.join()
    assert busy == (lib.SHMW_EBUSY, lib.SHMW_EBUSY)
    assert gave_up < 5.0, f"the tries took {gave_up:.1f} s"  # half the lock timeout a wait would run into
    assert len(wheel) == 1 and wheel.cancel(h)


def test_a_closed_wheel_makes_the_fast_path_give_up(make_wheel, caplog) -> None:
    wheel = make_wheel()
    timer = _timer(wheel)
    fast, core = timer._fast, timer._wheel.fast_core(_fast.Core)  # type: ignore[union-attr]
    timer._look_at = 2**62  # not the once-a-second look, which a wheel closed under it fails (fstat)
    timer._wheel.close()  # type: ignore[union-attr]
    assert core.closed
    assert fast.start(time.monotonic_ns(), "GET", "/x", "r", None) is None
    assert timer.start("GET", "/x", "r") is None  # its own path says why
    assert "closed" in caplog.text


def test_the_core_outlives_its_wheel_object_safely(make_wheel) -> None:
    """A Core keeps the struct and the mapping alive after its Wheel object is gone."""
    wheel = make_wheel()
    attached = shmwheel.attach(wheel.name)
    core = attached.fast_core(_fast.Core)
    del attached
    gc.collect()
    active = _fast.Table()
    head = HEAD.pack(KIND_REQUEST, 0, 0, 0, os.getpid(), 0, 0, 0, 0, 0, 0, MAGIC, 30_000, 0)
    var: contextvars.ContextVar[object] = contextvars.ContextVar("request")
    timer = Clerk(core=core, head=head, due_ns=30 * 10**9, timeout_ns=30 * 10**9, size=wheel.payload_size,
                  table=active, interrupted=set(), var=var, owner=None, getcurrent=None, interrupt=False, warn_ns=0,
                  look_ns=10**9)  # fmt: skip
    timer.look_at = 2**62  # no RequestTimer here to have the first request's look
    h = timer.start(time.monotonic_ns(), "GET", "/x", None, None)
    # A plain thread's request is filed in the thread's slot, not in the context.
    assert h is not None and set(active) == {h} and _fast.here() == (None, h) and var.get(None) is None
    assert len(wheel) == 1
    assert timer.finish(h) is True and not active and len(wheel) == 0 and _fast.here() is None
    assert timer.finish(h) is None


@pytest.mark.parametrize("threads", [4])
def test_threads_starting_and_finishing_at_once_keep_the_table_and_wheel_straight(make_wheel, threads: int) -> None:
    wheel = make_wheel(capacity=4096)
    timer = _timer(wheel)
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(2000):
                h = timer.start("GET", "/x", "r")
                assert h is not None and timer.current_handle() == h
                timer.finish(h)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=hammer) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert len(wheel) == 0 and not timer._active
    st = wheel.stats()
    assert st.added == st.cancelled == threads * 2000


def test_the_fast_path_needs_its_wheel_attached_as_a_producer(make_wheel) -> None:
    """Its adds are cancel-on-exit: the process keeps its producer id for them."""
    wheel = make_wheel()
    timer = _timer(wheel)
    h = timer.start("GET", "/x", "r")
    assert h is not None
    assert [p.pid for p in wheel.producers()]
    timer.finish(h)


def test_a_timer_made_before_a_fork_leaves_the_child_to_its_own_path(make_wheel) -> None:
    wheel = make_wheel()
    timer = _timer(wheel)
    fast = timer._fast
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = fast.start(time.monotonic_ns(), "GET", "/x", None, None) is None
        ok = ok and fast.wsgi(lambda e, s: [b""], {}, lambda *a: None) is NotImplemented
        os._exit(0 if ok and len(wheel) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the parent's Clerk served a request in the child"
    handle = fast.start(time.monotonic_ns(), "GET", "/x", None, None)
    assert handle is not None  # still the parent's
    timer.finish(handle)  # as a server finishes it: a later test's look at this process's requests finds none


# -- its stack signal, and its word to a new driver ------------------------------------------------


FORK_THEN_CLOSE = textwrap.dedent(
    """
    import os, signal, sys, time
    from shmwheel.contrib import RequestTimer
    RequestTimer(sys.argv[1], 30.0).prepare()  # the stack signal's handler, and its pipe
    pid = os.fork()
    if pid == 0:  # a child that closes every descriptor (a daemon does) and reuses their numbers
        os.closerange(3, 4096)
        fds = [os.open(sys.argv[2] + str(n), os.O_WRONLY | os.O_CREAT, 0o600) for n in range(4)]
        os.kill(os.getpid(), signal.SIGURG)  # the stack signal, as a driver would send it
        time.sleep(0.2)
        for fd in fds:
            os.write(fd, b"mine")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def test_the_stack_signal_never_writes_into_a_descriptor_a_forked_child_reused(make_wheel, tmp_path: Path) -> None:
    """The signal's handler, inherited by a fork, writes to its pipe only:
    not to a file the child opened under a number the pipe once had."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    prefix = str(tmp_path / "file")
    subprocess.run([sys.executable, "-c", FORK_THEN_CLOSE, wheel.name, prefix], check=True, timeout=WAIT)
    assert [Path(prefix + str(n)).read_bytes() for n in range(4)] == [b"mine"] * 4


def test_a_worker_tells_its_late_requests_to_each_new_driver_even_after_a_gap_with_none() -> None:
    """The worker's word to a new driver (RequestTimer.tell_again), with the
    wheel's driver read as: the one that asked, none for a while (it
    stopped cleanly), another, the same again, a third with the second's
    pid.  Each new one hears of the late request once; the one that asked
    and the gap hear nothing.  (Before, a gap with no driver made the next
    one a first sighting, and it was never told.)"""
    from types import SimpleNamespace

    timer = RequestTimer("shmwheel-test-tell-again", 1.0)
    payload = encode_request(KIND_REQUEST, os.getpid(), 1, 2, "GET", "late", "/")
    drivers = iter([(100, 1), (0, 0), (200, 2), (200, 2), (200, 3)])
    told: list[tuple[int, int]] = []
    seen: list[tuple[int, int]] = []

    class Wheel:
        def raw_stats(self) -> SimpleNamespace:
            pid, start = next(drivers)
            seen.append((pid, start))
            return SimpleNamespace(driver_pid=pid, driver_start=start)

    timer._wheel = Wheel()  # type: ignore[assignment]
    timer.in_progress = lambda: {7: SimpleNamespace(payload=payload)}  # type: ignore[method-assign]
    timer._tell = lambda p, kind: told.append((kind, seen[-1][0]))  # type: ignore[method-assign]
    for _ in range(5):
        timer.tell_again({(payload, True)})
    assert told == [(KIND_LATE, 200), (KIND_LATE, 200)]  # the second: pid 200 again, but another driver
