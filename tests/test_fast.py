"""The worker's path that keeps the GIL (shmwheel._fast, csrc/python/fast.c):
the same record as RequestTimer's own path, byte for byte; a lock held
elsewhere waited for with the GIL released; a closed wheel given up on."""

from __future__ import annotations

import contextvars
import ctypes
import gc
import os
import threading
import time

import pytest
from conftest import mutex_span

import shmwheel
from shmwheel._binding import ffi, lib
from shmwheel._fast import Timer
from shmwheel.contrib._record import (
    DEFAULT_TRACEBACK_SIGNAL,
    GREENLET,
    HEAD,
    KIND_REQUEST,
    MAGIC,
    MAX_METHOD,
    MAX_REQUEST_ID,
    TASK,
    decode_request,
)
from shmwheel.contrib._stacks import Active
from shmwheel.contrib._worker import RequestTimer, current_handle

_libc = ctypes.CDLL(None, use_errno=True)

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


def _timer(wheel: shmwheel.Wheel, **kw: object) -> RequestTimer:
    kw.setdefault("traceback_signal", None if not kw else DEFAULT_TRACEBACK_SIGNAL)
    timer = RequestTimer(wheel.name, 30.0, **kw)  # type: ignore[arg-type]
    assert timer.prepare()
    return timer


@pytest.mark.parametrize(("method", "path", "request_id"), CASES)
def test_fast_start_packs_the_record_its_own_path_packs(make_wheel, method: str, path: str, request_id) -> None:
    """The C record is byte-identical to the Python one, and so is the table's entry."""
    wheel = make_wheel(payload_size=256)
    for kw, task in (({}, None), ({"warn_after": 10.0}, None), ({"warn_after": 10.0, "interrupt": True}, object())):
        timer = _timer(wheel, **kw)
        assert timer._fast is not None
        now = time.monotonic_ns()
        fast = timer._fast.start(now, method, path, request_id, task)
        slow = timer._start_slow(now, method, path, request_id, task, None)
        assert slow is not None
        if fast is None:  # what the C path gives back: only records to cut or replace characters in
            assert len(method) > 32 or not method.isascii() or len(timer._active[slow].payload) == 256
            timer.finish(slow)
            continue
        a, b = timer._active[fast], timer._active[slow]
        assert a.payload == b.payload
        assert a._replace(handle=0) == b._replace(handle=0)
        assert type(a) is type(b)
        assert current_handle(timer) == slow
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
    assert current_handle(timer) == handle and len(wheel) == 1
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
        slow = timer._start_slow(now, "GET", "/g", "r", None, None)
        got.append((timer._active[fast], timer._active[slow]))
        timer.finish(fast)
        timer.finish(slow)

    g = greenlet.greenlet(serve)
    g.switch()
    ((a, b),) = got
    assert a.payload == b.payload and a.task is g is b.task
    record = decode_request(a.payload)
    assert record is not None and record.task == id(g) and record.task_kind == "greenlet"


def _hold(wheel: shmwheel.Wheel, seconds: float, held: threading.Event) -> None:
    """Hold the segment's lock from this thread, as another process would, for ``seconds``."""
    mutex = ctypes.c_void_p(int(ffi.cast("uintptr_t", wheel._buf)) + mutex_span()[0])
    assert _libc.pthread_mutex_lock(mutex) == 0
    held.set()
    time.sleep(seconds)
    assert _libc.pthread_mutex_unlock(mutex) == 0


@pytest.mark.parametrize("step", ["start", "finish"])
def test_a_held_lock_is_waited_for_with_the_gil_released(make_wheel, step: str) -> None:
    """The C path only tries the lock: held elsewhere, the cffi call waits
    for it, and the process's other threads run meanwhile."""
    wheel = make_wheel()
    timer = _timer(wheel)
    assert timer._fast is not None
    handle = timer.start("GET", "/x", "r") if step == "finish" else None
    held = threading.Event()
    holder = threading.Thread(target=_hold, args=(wheel, 0.3, held))
    ticks = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    holder.start()
    held.wait()
    ticker.start()
    t0 = time.monotonic()
    try:
        if step == "start":
            handle = timer.start("GET", "/x", "r")
            assert handle is not None and handle in timer._active
        else:
            timer.finish(handle)
            assert not timer._active
        waited = time.monotonic() - t0
    finally:
        stop.set()
        holder.join()
        ticker.join()
    assert waited >= 0.2, "the lock was not held: the test proves nothing"
    assert ticks[0] >= 20, "the other threads did not run while the request's timer waited"
    assert len(wheel) == (1 if step == "start" else 0)
    timer.finish(handle)
    assert len(wheel) == 0


def test_a_try_on_a_held_lock_gives_up_at_once(make_wheel) -> None:
    wheel = make_wheel()
    h = wheel.add(30.0)
    held = threading.Event()
    holder = threading.Thread(target=_hold, args=(wheel, 0.2, held))
    holder.start()
    held.wait()
    try:
        t0 = time.monotonic()
        busy = (lib.shmw_add(wheel.core, 30.0, b"", 0, lib.SHMW_TRYLOCK), lib.shmw_try_cancel(wheel.core, h))
        gave_up = time.monotonic() - t0
    finally:
        holder.join()
    assert busy == (lib.SHMW_EBUSY, lib.SHMW_EBUSY)
    assert gave_up < 0.1
    assert len(wheel) == 1 and wheel.cancel(h)


def test_a_closed_wheel_makes_the_fast_path_give_up(make_wheel, caplog) -> None:
    wheel = make_wheel()
    timer = _timer(wheel)
    fast, core = timer._fast, timer._wheel.fast_core()  # type: ignore[union-attr]
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
    core = attached.fast_core()
    del attached
    gc.collect()
    active: dict[int, Active] = {}
    head = HEAD.pack(KIND_REQUEST, 0, 0, 0, os.getpid(), 0, 0, 0, 0, 0, 0, MAGIC, 30_000)
    var: contextvars.ContextVar[object] = contextvars.ContextVar("request")
    timer = Timer(core, head, 30.0, 30 * 10**9, 30 * 10**9, wheel.payload_size, MAX_METHOD, MAX_REQUEST_ID,
                  TASK, GREENLET, active, set(), var, None, Active, None, False)  # fmt: skip
    h = timer.start(time.monotonic_ns(), "GET", "/x", None, None)
    assert h is not None and set(active) == {h} and var.get() == (None, h)
    assert len(wheel) == 1
    assert timer.finish(h) is True and not active and len(wheel) == 0
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
                assert h is not None and current_handle(timer) == h
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
