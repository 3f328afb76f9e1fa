"""The worker's path that keeps the GIL (shmwheel._fast, csrc/python/fast.c):
the same record as RequestTimer's own path, byte for byte; a lock held
elsewhere waited for with the GIL released; a closed wheel given up on."""

from __future__ import annotations

import contextvars
import ctypes
import gc
import io
import logging
import os
import subprocess
import sys
import threading
import time
import types
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import mutex_span

import shmwheel
from shmwheel import _fast
from shmwheel._binding import ffi, lib
from shmwheel._fast import Timer
from shmwheel.contrib import _body
from shmwheel.contrib._record import (
    DEFAULT_TRACEBACK_SIGNAL,
    HEAD,
    KIND_REQUEST,
    MAGIC,
    MAX_REQUEST_ID,
    decode_request,
)
from shmwheel.contrib._stacks import Active
from shmwheel.contrib._worker import RequestTimer
from shmwheel.contrib.wsgi import TimeoutMiddleware

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


def test_the_fast_module_refuses_to_load_beside_a_core_built_from_other_sources() -> None:
    # _fast calls the cffi module's functions by address: a stale build of
    # either one would call them with the wrong arguments.
    assert _fast.API_VERSION == lib.SHMW_API_VERSION
    stale = (
        "import sys, types; sys.modules['shmwheel._fast'] = types.SimpleNamespace(API_VERSION=1); "
        "import shmwheel.contrib.wsgi"
    )
    run = subprocess.run([sys.executable, "-c", stale], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1].startswith("ImportError: shmwheel: shmwheel._fast and shmwheel._shmwheel in "), (
        run.stderr
    )
    assert "were built from different versions of the C sources" in run.stderr


def _timer(wheel: shmwheel.Wheel, **kw: object) -> RequestTimer:
    kw.setdefault("traceback_signal", None if not kw else DEFAULT_TRACEBACK_SIGNAL)
    timer = RequestTimer(wheel.name, 30.0, **kw)  # type: ignore[arg-type]
    assert timer.prepare()
    return timer


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
    fast, core = timer._fast, timer._wheel.fast_core(_fast.Core)  # type: ignore[union-attr]
    timer._look_at = 2**62  # not the once-a-second look, which a wheel closed under it fails (fstat)
    timer._wheel.close()  # type: ignore[union-attr]
    assert core.closed
    assert fast.start(time.monotonic_ns(), "GET", "/x", "r", None) is None
    assert timer.start("GET", "/x", "r") is None  # its own path says why
    assert "closed" in caplog.text


def test_an_active_reads_as_the_named_tuple_it_stands_for() -> None:
    """The C Active: its fields by name, _replace(), == and repr as a NamedTuple's."""
    task = object()
    a = Active(b"\x00rec" * 20, 2**62, 2**64 - 1, task, 2**40 + 3, -5, True)
    assert type(a) is _fast.Active
    assert (a.payload, a.deadline_ns, a.thread, a.task, a.handle, a.timeout_ns, a.interrupt) == (
        b"\x00rec" * 20, 2**62, 2**64 - 1, task, 2**40 + 3, -5, True
    )  # fmt: skip
    b = a._replace(payload=b"", handle=7, interrupt=False)
    assert (b.payload, b.handle, b.interrupt, b.task, b.deadline_ns) == (b"", 7, False, task, 2**62)
    assert a == a._replace() and a != b and b._replace(payload=a.payload, handle=a.handle, interrupt=True) == a
    assert repr(b).startswith("Active(payload=b'', deadline_ns=4611686018427387904, thread=18446744073709551615")
    with pytest.raises(ValueError, match="unexpected field name 'handel'"):
        a._replace(handel=1)
    with pytest.raises(TypeError, match="keyword arguments only"):
        a._replace(b"")
    with pytest.raises(TypeError):
        Active("text", 0, 0, None, 0, 0, False)  # a record is bytes
    with pytest.raises(OverflowError):
        Active(b"", 0, -1, None, 0, 0, False)  # a thread's id is unsigned, and not cut to fit
    with pytest.raises(TypeError):
        hash(a)  # unhashable, as a table's entry that compares by value need not be hashed


def test_a_cycle_through_an_actives_task_is_collected() -> None:
    """An Active's task is visited by the collector: a task that holds its
    own table's entry (a loop dropped with its requests) is freed."""

    class Task:
        pass

    task = Task()
    task.table = {1: Active(b"r", 0, 0, task, 1, 0, False)}  # type: ignore[attr-defined]
    gone = weakref.ref(task)
    del task
    gc.collect()
    assert gone() is None


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
    timer = Timer(core=core, head=head, due_ns=30 * 10**9, timeout_ns=30 * 10**9, size=wheel.payload_size,
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


# -- the WSGI middleware's call in C (Timer.wsgi) and its Body -------------------------------------

ENVIRONS = [
    {"REQUEST_METHOD": "GET", "SCRIPT_NAME": "/app", "PATH_INFO": "/items/1", "HTTP_X_REQUEST_ID": "r-1"},
    {"REQUEST_METHOD": "DELETE", "PATH_INFO": "/x", "HTTP_X_REQUEST_ID": "no spaces please"},
    {},  # no method, no path: "-" and ""
    {"REQUEST_METHOD": "GET", "PATH_INFO": "/caf\xc3\xa9"},  # PEP 3333's latin-1: the middleware's own path
    {"REQUEST_METHOD": "POST", "PATH_INFO": "/" + "p" * 300},  # cut to fit: its own path too
]


def _count_detours(mw: TimeoutMiddleware) -> list[object]:
    """The requests that direct()'s C call hands back to the middleware
    itself from now on (by their PATH_INFO)."""
    taken: list[object] = []

    class Counting(type(mw)):  # type: ignore[misc]
        def _serve(self, environ: dict[str, Any], start_response: Any, declined: bool = False) -> Any:
            taken.append(environ.get("PATH_INFO"))
            return super()._serve(environ, start_response, declined)

    mw.__class__ = Counting
    return taken


def _recording_middleware(wheel: shmwheel.Wheel) -> tuple[TimeoutMiddleware, list[int]]:
    """A middleware around an app that answers "ok" and keeps each request's handle."""
    handles: list[int] = []

    def app(env: dict[str, object], start_response: object) -> list[bytes]:
        handles.append(env["shmwheel.timer"])  # type: ignore[arg-type]
        return [b"ok"]

    return TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None), handles


@pytest.mark.parametrize("environ", ENVIRONS)
def test_the_middlewares_call_in_c_files_what_its_own_path_files(make_wheel, environ: dict[str, str]) -> None:
    wheel = make_wheel(payload_size=256)
    mw, handles = _recording_middleware(wheel)
    assert mw.timer.prepare() and mw._plain
    own_path: list[str] = []
    start, start_declined = mw.timer.start, mw.timer.start_declined
    mw.timer.start = lambda *a, **k: own_path.append(a[1]) or start(*a, **k)  # type: ignore[method-assign]
    mw.timer.start_declined = lambda *a, **k: own_path.append(a[1]) or start_declined(*a, **k)  # type: ignore[method-assign]
    in_c = mw(dict(environ), lambda *a: None)
    taken = bool(own_path)
    # Given back having tried it (a record to cut): the waiting path, not C again.
    assert mw.timer._fast.declined == (environ is ENVIRONS[4])
    mw._plain = False  # every request the middleware's own way
    mine = mw(dict(environ), lambda *a: None)
    assert own_path, "the control did not take the middleware's own path"
    assert taken == (environ in ENVIRONS[3:]), "the C call took a request it gives back, or gave back a plain one"
    assert type(in_c) is type(mine) is _fast.Body
    a, b = (mw.timer._active[h] for h in handles)
    assert a.payload[:16] + a.payload[24:] == b.payload[:16] + b.payload[24:]  # all but the start
    assert a._replace(payload=b"", deadline_ns=0, handle=0, timeout_ns=0) == b._replace(
        payload=b"", deadline_ns=0, handle=0, timeout_ns=0
    )
    assert list(in_c) == [b"ok"] and len(wheel) == 2
    in_c.close()  # type: ignore[attr-defined]
    mine.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0 and not mw.timer._active


def test_a_bodys_close_is_the_body_itself_as_servers_look_it_up(make_wheel) -> None:
    """uWSGI looks close() up twice a request (PyObject_HasAttrString, then
    PyObject_GetAttrString) and Gunicorn once (hasattr): the body answers
    with itself, callable as close(), so that no bound method is made for
    each, and close() is still what PEP 3333 asks for."""
    wheel = make_wheel()
    timer = _timer(wheel)
    body = _fast.Body([b"x"], timer, timer.start("GET", "/x"))
    assert hasattr(body, "close") and body.close is body and callable(body.close)
    assert sys.getrefcount(body) == 2  # the lookups kept nothing
    with pytest.raises(TypeError, match="no arguments"):
        body.close(True)  # type: ignore[call-arg]
    assert len(wheel) == 1, "a refused call ended the timer"
    close = body.close  # as uWSGI calls it: looked up, then called
    close()
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


@pytest.mark.parametrize("body_type", [_fast.Body, _body.ClosingBody], ids=["c", "python"])
def test_a_body_closes_the_applications_then_ends_the_timer_whatever_happens(make_wheel, body_type) -> None:
    wheel = make_wheel()
    timer = _timer(wheel)
    order: list[str] = []

    class Closing(list):  # type: ignore[type-arg]
        def __init__(self, fail: bool) -> None:
            super().__init__([b"a", b"b"])
            self.fail = fail

        def close(self) -> None:
            order.append(f"close, {len(wheel)} pending")
            if self.fail:
                raise OSError("the client went away")

    handle = timer.start("GET", "/x")
    body = body_type(Closing(False), timer, handle)
    assert list(body) == [b"a", b"b"]
    body.close()
    assert order == ["close, 1 pending"] and len(wheel) == 0 and wheel.stats().cancelled == 1
    body.close()  # again: the body is closed again, the timer ended once
    assert len(order) == 2 and wheel.stats().cancelled == 1

    handle = timer.start("GET", "/x")
    body = body_type(Closing(True), timer, handle)
    with pytest.raises(OSError, match="went away"):
        body.close()
    assert len(wheel) == 0 and not timer._active  # ended all the same

    body = body_type(iter([b"c"]), timer, None)  # a request without a timer: no close() to call either
    assert list(body) == [b"c"]
    body.close()


@pytest.mark.parametrize("way", ["middleware", "direct"])
def test_a_body_ends_a_timer_in_the_wheel_it_started_in_after_a_replacement(name: str, way: str) -> None:
    """Also through direct(), which keeps the RequestTimer's Timer from one
    request to the next: the one the replacement retires is not used again."""
    old = shmwheel.create(name, capacity=16, payload_size=256)
    mw = TimeoutMiddleware(lambda e, s: [b"x"], name, 30.0, traceback_signal=None)
    call = mw.direct() if way == "direct" else mw
    detours = _count_detours(mw)
    try:
        assert mw.timer.prepare()
        body = call({"PATH_INFO": "/before"}, lambda *a: None)  # made in C: its close ends it through its Timer
        first = mw.timer._fast
        assert type(body) is _fast.Body and len(old) == 1 and first is not None
        shmwheel.unlink(name)
        new = shmwheel.create(name, capacity=16, payload_size=256)
        try:
            later = call({"PATH_INFO": "/after"}, lambda *a: None)  # the old wheel refuses: the own path attaches
            assert len(new) == 1 and mw.timer._fast is not None
            assert first.retired and mw.timer._fast is not first and not mw.timer._fast.retired
            again = call({"PATH_INFO": "/again"}, lambda *a: None)
            assert (len(old), len(new)) == (1, 2)
            if way == "direct":
                assert detours == ["/after"], "direct() went on calling the Timer the replacement retired"
            for each in (body, later, again):
                each.close()  # type: ignore[attr-defined]
            assert (len(old), len(new)) == (0, 0), "a request's timer was left behind"
        finally:
            new.close()
            shmwheel.unlink(name)
    finally:
        old.close()


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
    assert os.waitstatus_to_exitcode(status) == 0, "the parent's Timer served a request in the child"
    assert fast.start(time.monotonic_ns(), "GET", "/x", None, None) is not None  # still the parent's


def test_a_direct_call_used_before_a_fork_serves_the_child_with_the_childs_timer(make_wheel) -> None:
    """direct() keeps the Timer of its last request: in a forked child it is
    the parent's, which must not file the child's requests."""
    wheel = make_wheel(payload_size=256)
    mw, handles = _recording_middleware(wheel)
    direct = mw.direct()
    direct({"PATH_INFO": "/parent"}, lambda *a: None).close()  # type: ignore[attr-defined]
    parents = mw.timer._fast
    pending = direct({"PATH_INFO": "/pending"}, lambda *a: None)  # the parent's, open across the fork
    detours = _count_detours(mw)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        pending.close()  # type: ignore[attr-defined]
        ok = len(wheel) == 1  # the parent's request is the parent's to end
        for _ in range(3):  # the first takes the middleware's own path, the others the child's Timer
            body = direct({"PATH_INFO": "/child"}, lambda *a: None)
            record = decode_request(mw.timer._active[handles[-1]].payload)
            ok = ok and record is not None and record.pid == os.getpid() and len(wheel) == 2
            body.close()  # type: ignore[attr-defined]
        ok = ok and mw.timer._fast is not parents and len(wheel) == 1 and detours == ["/child"]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's requests were filed as the parent's, or it ended one"
    assert mw.timer._fast is parents and not parents.retired and len(wheel) == 1
    pending.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0


def test_the_middleware_called_directly_in_c_is_the_middleware(make_wheel) -> None:
    """direct(): the same requests and records, with the middleware's own
    Python taking what the C call gives back (a path that is not ASCII)."""
    wheel = make_wheel(payload_size=256)
    mw, handles = _recording_middleware(wheel)
    direct = mw.direct()
    assert type(direct) is _fast.WSGI and direct.middleware is mw
    assert mw.timer.prepare()
    own_path: list[object] = []
    start, start_declined = mw.timer.start, mw.timer.start_declined
    mw.timer.start = lambda *a, **k: own_path.append(a) or start(*a, **k)  # type: ignore[method-assign]
    mw.timer.start_declined = lambda *a, **k: own_path.append(a) or start_declined(*a, **k)  # type: ignore[method-assign]
    for environ in ENVIRONS:
        body = direct(dict(environ), lambda *a: None)
        assert list(body) == [b"ok"] and len(wheel) == 1
        record = decode_request(mw.timer._active[handles[-1]].payload)
        assert record is not None and record.method == environ.get("REQUEST_METHOD", "-")
        body.close()  # type: ignore[attr-defined]
        assert len(wheel) == 0
    assert len(own_path) == 2  # the two of ENVIRONS[3:]
    assert TimeoutMiddleware(mw.app, wheel.name, 30.0, interrupt=True).direct().__class__ is TimeoutMiddleware


# -- Gunicorn's hooks (install() in C: shmwheel._fast.Hooks) -----------------------------------

RAW_REQUESTS = [
    b"GET /api/v1/items/12345 HTTP/1.1\r\nHost: h\r\nX-Request-Id: req-abc-123\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-Request-Id: first\r\nX-Request-Id: second\r\n\r\n",  # the first, as for any header
    b"POST /a/%C3%A9?q=1 HTTP/1.1\r\nx-request-id: low.er\r\nContent-Length: 0\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-Request-Id: has space\r\n\r\n",
    b"GET /" + b"p" * 300 + b" HTTP/1.1\r\n\r\n",  # cut to fit: the Python hook's way
    b"GET /x HTTP/1.1\r\nX-Request-Id: \r\nX-Request-Id: abc\r\n\r\n",  # the first that is not empty
]


def _gunicorn_request(raw: bytes) -> object:
    from gunicorn.config import Config
    from gunicorn.http.parser import RequestParser

    return next(iter(RequestParser(Config(), [raw], ("127.0.0.1", 1))))


def _gunicorn_hooks(wheel: shmwheel.Wheel, monkeypatch, **kw: object) -> tuple[dict[str, Any], RequestTimer]:
    """install()'s hooks in a namespace, with the worker's timer on ``wheel`` as post_worker_init leaves it."""
    from shmwheel.contrib import gunicorn as contrib_gunicorn

    if kw.pop("fresh_state", True):
        monkeypatch.setattr(contrib_gunicorn, "_state", contrib_gunicorn._State())
    hooks: dict[str, Any] = dict(kw.pop("namespace", {}))  # type: ignore[call-overload]
    contrib_gunicorn.install(hooks, 30.0, name=wheel.name, tracebacks=False, **kw)  # type: ignore[arg-type]
    settings = contrib_gunicorn._state.settings
    assert settings is not None
    timer = contrib_gunicorn._state.timer = contrib_gunicorn._timer(wheel.name, settings)
    assert timer.prepare()
    return hooks, timer


@pytest.mark.parametrize(
    "raw", RAW_REQUESTS, ids=["id", "no-id", "two-ids", "utf8-path", "bad-id", "long-path", "empty-id"]
)
def test_gunicorns_hooks_in_c_file_what_the_python_hooks_file(make_wheel, monkeypatch, raw: bytes) -> None:
    wheel = make_wheel(payload_size=256)
    records = []
    for kw in ({}, {"x_request_start": True}):  # the second: the Python hooks
        hooks, timer = _gunicorn_hooks(wheel, monkeypatch, **kw)
        pre, post = hooks["pre_request"], hooks["post_request"]
        assert isinstance(pre, types.BuiltinMethodType) == (not kw)
        req: Any = _gunicorn_request(raw)
        pre(None, req)
        handle = req.shmwheel_timer
        assert handle is not None and timer.current_handle() == handle and len(wheel) == 1
        records.append(timer._active[handle].payload)
        post(None, req, {}, None)
        assert len(wheel) == 0 and not timer._active
        post(None, req, {}, None)  # finished already: nothing
    a, b = records
    assert a[:16] + a[24:] == b[:16] + b[24:]  # all but the start


@pytest.mark.parametrize(
    ("headers", "request_id"),
    [
        ((("X-REQUEST-ID", "abc"),), "abc"),  # a tuple
        ([["X-REQUEST-ID", "abc"]], "abc"),  # lists
        ([("X-REQUEST-ID", 12345)], "12345"),  # a value the Python hook takes the str() of
        ([(b"HOST", "h"), ("X-REQUEST-ID", "abc")], "abc"),
    ],
)
def test_gunicorns_c_hook_leaves_headers_of_another_shape_to_the_python_hook(
    make_wheel, monkeypatch, headers: object, request_id: str
) -> None:
    wheel = make_wheel()
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch)
    req: Any = types.SimpleNamespace(method="GET", path="/x", headers=headers)
    hooks["pre_request"](None, req)
    record = decode_request(timer._active[req.shmwheel_timer].payload)
    assert record is not None and record.request_id == request_id
    hooks["post_request"](None, req, {}, None)
    assert len(wheel) == 0


@pytest.mark.parametrize("kw", [{}, {"x_request_start": True}], ids=["c", "python"])
def test_gunicorns_hook_that_cannot_keep_the_handle_leaves_no_timer(make_wheel, monkeypatch, kw) -> None:
    class Req:
        __slots__ = ("method", "path", "headers")

    wheel = make_wheel()
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch, **kw)
    req = Req()
    req.method, req.path, req.headers = "GET", "/x", []
    with pytest.raises(AttributeError, match="shmwheel_timer"):
        hooks["pre_request"](None, req)
    assert len(wheel) == 0 and not timer._active
    hooks["post_request"](None, req, {}, None)  # no handle: nothing


def test_gunicorns_hooks_call_the_configs_own_and_end_the_timer_if_theirs_fails(make_wheel, monkeypatch) -> None:
    calls: list[str] = []

    def theirs_post(worker: object, req: object, environ: object, resp: object) -> None:
        calls.append("post")
        raise RuntimeError("their hook")

    namespace = {"pre_request": lambda worker, req: calls.append(f"pre {len(wheel)}"), "post_request": theirs_post}
    wheel = make_wheel()
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch, namespace=namespace)
    req: Any = _gunicorn_request(RAW_REQUESTS[0])
    hooks["pre_request"](None, req)
    with pytest.raises(RuntimeError, match="their hook"):
        hooks["post_request"](None, req, {}, None)
    assert calls == ["pre 1", "post"]  # theirs after the timer is added
    assert len(wheel) == 0 and not timer._active


def test_gunicorns_c_hooks_do_nothing_where_the_worker_has_no_timer(make_wheel, monkeypatch) -> None:
    from shmwheel.contrib import gunicorn as contrib_gunicorn

    wheel = make_wheel()
    hooks, _ = _gunicorn_hooks(wheel, monkeypatch)
    contrib_gunicorn._state.timer = None  # the master, or a worker class whose application is wrapped
    req: Any = _gunicorn_request(RAW_REQUESTS[0])
    hooks["pre_request"](None, req)
    hooks["post_request"](None, req, {}, None)
    assert not hasattr(req, "shmwheel_timer") and len(wheel) == 0
    with pytest.raises(TypeError, match=r"pre_request\(worker, req\)"):
        hooks["pre_request"](None)
    with pytest.raises(TypeError, match=r"post_request\(worker, req, environ, resp\)"):
        hooks["post_request"](None, req)


def _greenlet_that_meddles(monkeypatch, meddle: Any) -> None:
    """A greenlet module whose getcurrent() runs ``meddle()`` (as a finalizer
    run by its allocation could) and then answers "the thread's own"."""

    class Current:
        parent = None

    def getcurrent() -> Current:
        meddle()
        return Current()

    monkeypatch.setitem(sys.modules, "greenlet", types.SimpleNamespace(getcurrent=getcurrent))


def _reuse_freed_memory(junk: list[str]) -> None:
    junk.extend("Z" * 40 + str(k) for k in range(2000))


def test_gunicorns_c_hook_keeps_the_request_id_that_python_run_meanwhile_drops(make_wheel, monkeypatch) -> None:
    held: dict[str, Any] = {}
    junk: list[str] = []

    def meddle() -> None:
        if "req" in held:
            del held["req"].headers[:]  # the id's tuple and str freed, were they borrowed
            _reuse_freed_memory(junk)

    _greenlet_that_meddles(monkeypatch, meddle)
    wheel = make_wheel(payload_size=256)
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch)
    req: Any = _gunicorn_request(b"GET /x HTTP/1.1\r\nX-Request-Id: " + b"a" * 40 + b"\r\n\r\n")
    held["req"] = req
    hooks["pre_request"](None, req)
    record = decode_request(timer._active[req.shmwheel_timer].payload)
    assert record is not None and record.request_id == "a" * 40
    hooks["post_request"](None, req, {}, None)
    assert len(wheel) == 0


def test_the_middlewares_c_call_keeps_the_environs_values_that_python_run_meanwhile_drops(
    make_wheel, monkeypatch
) -> None:
    held: dict[str, Any] = {}
    junk: list[str] = []

    def meddle() -> None:
        if "environ" in held:
            held.pop("environ").clear()  # its values freed, were they borrowed
            _reuse_freed_memory(junk)

    _greenlet_that_meddles(monkeypatch, meddle)
    wheel = make_wheel(payload_size=256)
    mw, handles = _recording_middleware(wheel)
    assert mw.timer.prepare() and mw._plain
    environ = {
        "REQUEST_METHOD": "".join(["PA", "TCH"]),  # none of them interned or kept elsewhere
        "SCRIPT_NAME": "/s" + "c" * 40,
        "PATH_INFO": "/p" + "q" * 40,
        "HTTP_X_REQUEST_ID": "r" * 40,
    }
    expected = ("PATCH", "/s" + "c" * 40 + "/p" + "q" * 40, "r" * 40)
    held["environ"] = environ
    body = mw.direct()(environ, lambda *a: None)
    record = decode_request(mw.timer._active[handles[0]].payload)
    assert record is not None and (record.method, record.path, record.request_id) == expected
    body.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0


@pytest.mark.parametrize("kw", [{}, {"x_request_start": True}], ids=["c", "python"])
def test_a_second_install_in_one_config_takes_the_place_of_the_first(make_wheel, monkeypatch, kw) -> None:
    """A config that calls install() twice (a shared config and its own,
    say): one timer a request, cancelled, and the config's own hooks
    called once, whether defined before the first call or between them."""
    from shmwheel.contrib import gunicorn as contrib_gunicorn

    calls: list[str] = []
    namespace: dict[str, Any] = {"pre_request": lambda worker, req: calls.append("pre")}
    wheel = make_wheel(payload_size=256)
    monkeypatch.setattr(contrib_gunicorn, "_state", contrib_gunicorn._State())
    contrib_gunicorn.install(namespace, 5.0, name=wheel.name, tracebacks=False)
    namespace["post_request"] = lambda worker, req, environ, resp: calls.append("post")
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch, namespace=namespace, fresh_state=False, **kw)
    req: Any = _gunicorn_request(RAW_REQUESTS[0])
    hooks["pre_request"](None, req)
    assert len(wheel) == 1 and len(timer._active) == 1
    hooks["post_request"](None, req, {}, None)
    assert len(wheel) == 0 and not timer._active
    assert calls == ["pre", "post"]


class _Wrapper:
    """A server's wsgi.file_wrapper as Gunicorn's and wsgiref's keep their file."""

    def __init__(self, filelike: Any, blksize: int = 8192) -> None:
        self.filelike, self.blksize = filelike, blksize

    def __iter__(self) -> Iterator[bytes]:
        return iter(lambda: self.filelike.read(self.blksize), b"")

    def close(self) -> None:
        self.filelike.close()


class _OtherWrapper:
    """One that keeps its file under another name: not made again."""

    def __init__(self, filelike: Any, blksize: int = 8192) -> None:
        self.wrapped = _Wrapper(filelike, blksize)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.wrapped)

    def close(self) -> None:
        self.wrapped.close()


class _RefusingWrapper(_Wrapper):
    """One that makes no second wrapper: its body goes the way of any other."""

    made = 0

    def __init__(self, filelike: Any, blksize: int = 8192) -> None:
        _RefusingWrapper.made += 1
        if _RefusingWrapper.made > 1:
            raise RuntimeError("once")
        super().__init__(filelike, blksize)


class _File(io.BytesIO):
    def close(self) -> None:
        super().close()
        raise OSError("the file's close failed")


@pytest.mark.parametrize("way", ["direct", "c", "python", "interrupt"])
@pytest.mark.parametrize("wrapper", [_Wrapper, _OtherWrapper, _RefusingWrapper])
def test_a_body_of_the_servers_file_wrapper_stays_one_whose_close_ends_the_timer(make_wheel, way, wrapper) -> None:
    wheel = make_wheel(payload_size=256)
    _RefusingWrapper.made = 0

    def app(environ: dict[str, Any], start_response: object) -> Any:
        return environ["wsgi.file_wrapper"](_File(b"abc" * 5000), 4096)

    kw: dict[str, Any] = {"interrupt": True} if way == "interrupt" else {"traceback_signal": None}
    mw = TimeoutMiddleware(app, wheel.name, 30.0, **kw)
    assert mw.timer.prepare()
    mw._plain = way in ("direct", "c")
    call = mw.direct() if way == "direct" else mw
    body = call({"REQUEST_METHOD": "GET", "PATH_INFO": "/f", "wsgi.file_wrapper": wrapper}, lambda *a: None)
    assert len(wheel) == 1
    if wrapper is _Wrapper:
        assert type(body) is _Wrapper and body.blksize == 4096  # the server's own: it sends the file itself
    else:
        assert type(body) in (_fast.Body, _body.ClosingBody)
    assert b"".join(body) == b"abc" * 5000
    with pytest.raises(OSError, match="close failed"):
        body.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0 and not mw.timer._active


class _FunctionWrapperServer:
    """A server whose wsgi.file_wrapper is a function, as uWSGI's is: it
    hands back the file it is given, and sends a file itself (sendfile)
    only if the body is the object it was last given."""

    def __init__(self) -> None:
        self.given: Any = None

    def file_wrapper(self, filelike: Any, blksize: int = 8192) -> Any:
        if not hasattr(filelike, "read"):
            raise AttributeError("object has no attribute 'read'")
        self.given = filelike
        return filelike


@pytest.mark.parametrize("way", ["direct", "c", "python", "interrupt"])
def test_a_file_handed_to_a_function_file_wrapper_is_the_body_and_its_close_ends_the_timer(make_wheel, way) -> None:
    wheel = make_wheel(payload_size=256)
    server = _FunctionWrapperServer()
    files: list[_File] = []

    def app(environ: dict[str, Any], start_response: object) -> Any:
        files.append(_File(b"abc" * 5000))
        return environ["wsgi.file_wrapper"](files[-1], 4096)

    kw: dict[str, Any] = {"interrupt": True} if way == "interrupt" else {"traceback_signal": None}
    mw = TimeoutMiddleware(app, wheel.name, 30.0, **kw)
    assert mw.timer.prepare()
    mw._plain = way in ("direct", "c")
    call = mw.direct() if way == "direct" else mw
    file_wrapper = server.file_wrapper  # one object, as uWSGI's is
    for _ in range(2):  # the second through the stand-in kept for the server's wrapper
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/f", "wsgi.file_wrapper": file_wrapper}
        body = call(environ, lambda *a: None)
        assert body is server.given and type(body) is _body.TimedFile  # the server sends it itself
        assert body.read(3) == b"abc" and body.seek(0) == 0  # the file's own, as the server reads it
        assert len(wheel) == 1 and len(mw.timer._active) == 1
        with pytest.raises(OSError, match="close failed"):
            body.close()  # type: ignore[attr-defined]
        assert files[-1].closed and len(wheel) == 0 and not mw.timer._active


@pytest.mark.parametrize("way", ["direct", "c", "python"])
def test_a_file_the_application_closes_before_it_answers_leaves_the_request_its_timer(make_wheel, way) -> None:
    """What the stand-in wrapper hands out ends the timer only once it is
    the body: closed by the application before then, the rest of the
    request still has its timer."""
    wheel = make_wheel(payload_size=256)
    server = _FunctionWrapperServer()
    seen: list[int] = []

    def app(environ: dict[str, Any], start_response: object) -> Any:
        environ["wsgi.file_wrapper"](io.BytesIO(b"read here")).close()
        seen.append(len(wheel))
        return environ["wsgi.file_wrapper"](io.BytesIO(b"sent"))

    mw = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None)
    assert mw.timer.prepare()
    mw._plain = way != "python"
    call = mw.direct() if way == "direct" else mw
    body = call({"REQUEST_METHOD": "GET", "PATH_INFO": "/f", "wsgi.file_wrapper": server.file_wrapper}, lambda *a: None)
    assert seen == [1] and body is server.given and len(wheel) == 1
    body.close()
    assert len(wheel) == 0 and not mw.timer._active


@pytest.mark.parametrize("way", ["direct", "c", "python"])
def test_a_function_file_wrapper_whose_file_is_not_the_body_leaves_the_body_to_end_the_timer(make_wheel, way) -> None:
    """The application gave the wrapper a file, then answered otherwise: the
    server iterates the body, whose close() ends the timer (the file's
    second end, should it be closed too, changes nothing)."""
    wheel = make_wheel(payload_size=256)
    server = _FunctionWrapperServer()

    def app(environ: dict[str, Any], start_response: object) -> Any:
        timed = environ["wsgi.file_wrapper"](io.BytesIO(b"unused"))
        return [b"other", timed.read()]

    mw = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None)
    assert mw.timer.prepare()
    mw._plain = way != "python"
    call = mw.direct() if way == "direct" else mw
    body = call({"REQUEST_METHOD": "GET", "PATH_INFO": "/f", "wsgi.file_wrapper": server.file_wrapper}, lambda *a: None)
    assert type(body) in (_fast.Body, _body.ClosingBody) and b"".join(body) == b"otherunused"
    assert len(wheel) == 1
    body.close()
    assert len(wheel) == 0 and not mw.timer._active
    server.given.close()
    assert len(wheel) == 0


def test_a_request_without_a_timer_hands_the_server_its_file_as_it_is(make_wheel) -> None:
    wheel = make_wheel(payload_size=256)
    server = _FunctionWrapperServer()
    file = io.BytesIO(b"free")

    def app(environ: dict[str, Any], start_response: object) -> Any:
        return environ["wsgi.file_wrapper"](file)

    mw = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None, routes={"/free": None})
    assert mw.timer.prepare()
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/free", "wsgi.file_wrapper": server.file_wrapper}
    body = mw(environ, lambda *a: None)
    assert body is file is server.given and environ["wsgi.file_wrapper"] == server.file_wrapper
    assert len(wheel) == 0


# -- the table of requests in progress, and the thread's slot ------------------------


def _active(handle: int, payload: bytes = b"rec", task: object = None) -> Active:
    return Active(payload, handle // 2, 7, task, handle, handle // 3, False)


def test_the_table_is_a_mapping_of_handles_to_actives() -> None:
    """shmwheel._fast.Table against a dict, through inserts and deletes that
    wrap around its slots and move entries back over the gaps they leave:
    every entry stays found, and none comes back."""
    import random

    rng = random.Random(19)
    table, model = _fast.Table(), {}
    keys = [rng.getrandbits(64) - 2**63 for _ in range(300)] + list(range(1, 200)) + [-1, 0, 2**63 - 1, -(2**63)]
    for step in range(6000):
        key = rng.choice(keys)
        if rng.random() < 0.55:
            value = _active(key, bytes([step % 256]) * rng.randrange(0, 300))
            table[key] = value
            model[key] = value
        elif key in model:
            if rng.random() < 0.5:
                assert table.pop(key) == model.pop(key)
            else:
                del table[key]
                del model[key]
        else:
            assert key not in table and table.pop(key, None) is None and table.get(key) is None
        if step % 250 == 0:
            assert table.copy() == model and sorted(table) == sorted(model) == sorted(table.keys())
    assert len(table) == len(model) and table.copy() == model
    assert all(table[k] == v and table.get(k) == v and k in table for k, v in model.items())
    for key in list(model):
        del table[key]
    assert len(table) == 0 and not table and table.copy() == {}


def test_a_table_refuses_what_it_cannot_hold_and_finds_nothing_for_it() -> None:
    table = _fast.Table()
    table[5] = _active(5)
    for key in (None, "5", 5.0, 2**64, -(2**63) - 1):
        assert key not in table and table.get(key, "none") == "none"
        with pytest.raises(KeyError):
            table[key]
    with pytest.raises(TypeError, match="keys are handles"):
        table[2**64] = _active(1)
    with pytest.raises(TypeError, match="holds Actives, not tuple"):
        table[6] = (b"rec", 0, 0, None, 6, 0, False)  # type: ignore[assignment]
    with pytest.raises(ValueError, match="at most 65536 bytes"):
        table[6] = _active(6, b"x" * 65537)
    with pytest.raises(KeyError):
        del table[6]
    with pytest.raises(KeyError):
        table.pop(6)
    with pytest.raises(TypeError):
        _fast.Table(1)  # type: ignore[call-arg]
    assert table.copy() == {5: _active(5)}  # nothing lost


def test_a_cycle_through_a_tables_task_is_collected() -> None:
    """The table's tasks are visited by the collector: a task that holds the
    table its request is filed in (a loop dropped with its requests) is freed."""

    class Task:
        pass

    task = Task()
    task.table = _fast.Table()  # type: ignore[attr-defined]
    task.table[1] = _active(1, task=task)  # type: ignore[attr-defined]
    gone = weakref.ref(task)
    del task
    gc.collect()
    assert gone() is None


def test_an_active_read_from_the_table_is_a_copy_of_the_request_at_that_moment(make_wheel) -> None:
    """What the reporter thread reads stays as it was read: extend() files a
    new timer in the table, not in the Active handed out before."""
    wheel = make_wheel()
    timer = _timer(wheel)
    handle = timer.start("GET", "/x", "r")
    assert handle is not None
    before = timer.active()[handle]
    assert timer.rearm(handle, 60.0)
    after = timer._active[handle]
    assert before.handle == handle != after.handle and after.timeout_ns > before.timeout_ns
    assert timer.active()[handle] == after != before
    timer.finish(handle)
    assert len(wheel) == 0 and not timer._active


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _in_thread(target: Any) -> Any:
    got: list[Any] = []
    t = threading.Thread(target=lambda: got.append(target()))
    t.start()
    t.join()
    return got[0]


@pytest.mark.parametrize("way", ["c", "python"])
def test_a_plain_threads_request_is_its_threads_wherever_it_runs_there(make_wheel, way: str, monkeypatch) -> None:
    """A request that a plain thread runs is the thread's: extend() and
    no_timeout() find it anywhere in that thread (an event loop run inside
    the request included), and never from another thread, even one that
    runs in a copy of its context: there they return False, change nothing,
    and say why in the log, once.  Once it ends, it is no one's."""
    from shmwheel.contrib import _worker, extend, no_timeout

    monkeypatch.setattr(_worker, "_told_none_here", False)
    logged = _Records()
    log = _worker.server_logger()  # the server's, if a test before set one up
    log.addHandler(logged)
    monkeypatch.setattr(log, "level", logging.WARNING)
    monkeypatch.setattr(log, "disabled", False)

    wheel = make_wheel()
    timer = _timer(wheel)
    now = time.monotonic_ns()
    if way == "c":
        handle = timer.start("GET", "/x", "r")
    else:  # RequestTimer's own path, as when the lock is held elsewhere
        handle = timer._start_slow(now, "GET", "/x", "r", None, timer._timeout_ns, now)
    assert handle is not None and _fast.here() == (timer, handle)
    assert timer.current_handle() == handle

    async def in_a_loop() -> bool:
        return timer.current_handle() == handle and extend(50.0)

    import asyncio

    assert asyncio.run(in_a_loop())
    timer_now = timer._active[handle].handle
    context = contextvars.copy_context()
    assert _in_thread(lambda: context.run(timer.current_handle)) is None
    assert _in_thread(lambda: context.run(extend, 60.0)) is False
    assert _in_thread(lambda: context.run(no_timeout)) is False
    assert timer._active[handle].handle == timer_now and len(wheel) == 1  # unchanged
    log.removeHandler(logged)
    told = [r.getMessage() for r in logged.records if "runs no request" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith("shmwheel: extend() was called in thread 0x"), told
    assert f"while thread 0x{threading.get_ident():016x} runs one" in told[0]
    assert timer.current_handle() == handle and extend(40.0)
    timer.finish(handle)
    assert _fast.here() is None and timer.current_handle() is None and not extend(5.0)
    assert len(wheel) == 0 and not timer._active


def test_a_request_finished_in_another_thread_is_no_longer_its_threads(make_wheel) -> None:
    from shmwheel.contrib import extend, no_timeout

    wheel = make_wheel()
    timer = _timer(wheel)
    handle = timer.start("GET", "/x", "r")
    assert handle is not None
    _in_thread(lambda: timer.finish(handle))
    assert _fast.here() == (timer, handle)  # left in the slot until the thread's next request
    assert timer.current_handle() is None and not extend(5.0) and not no_timeout()
    assert len(wheel) == 0 and not timer._active
    again = timer.start("GET", "/y", "r")
    assert again is not None and _fast.here() == (timer, again) and timer.current_handle() == again
    timer.finish(again)


def test_a_greenlet_does_not_see_its_threads_request(make_wheel) -> None:
    """gevent's and eventlet's greenlets share their thread's slot: a request
    that the thread's own greenlet runs is not theirs, and one a greenlet
    runs is its own, in its context."""
    import greenlet

    wheel = make_wheel()
    timer = _timer(wheel)
    assert timer._getcurrent is not None
    handle = timer.start("GET", "/main", "r")
    assert handle is not None and timer.current_handle() == handle
    seen: list[object] = []

    def serve() -> None:
        seen.append(timer.current_handle())
        own = timer.start("GET", "/g", "r")
        seen.append(own)
        seen.append(timer.current_handle())
        timer.finish(own)

    greenlet.greenlet(serve).switch()
    assert seen[0] is None and seen[1] is not None and seen[2] == seen[1] != handle
    assert timer.current_handle() == handle
    timer.finish(handle)
    assert len(wheel) == 0 and not timer._active


def test_a_tasks_request_is_found_from_the_thread_its_sync_code_runs_in(make_wheel) -> None:
    """A request that an asyncio task runs is in the task's context, which a
    thread pool copies (Starlette's run_in_threadpool, asyncio.to_thread):
    extend() there acts on it."""
    import asyncio

    from shmwheel.contrib import extend

    wheel = make_wheel()
    timer = _timer(wheel)

    async def request() -> tuple[bool, int | None]:
        handle = timer.start("GET", "/x", "r", task=asyncio.current_task())
        assert handle is not None and _fast.here() is None
        try:
            return await asyncio.to_thread(extend, 60.0), await asyncio.to_thread(timer.current_handle)
        finally:
            timer.finish(handle)

    extended, found = asyncio.run(request())
    assert extended and found is not None
    assert len(wheel) == 0 and not timer._active and wheel.stats().cancelled == 2


# -- a request the C path gives back enters it once -----------------------------------------------


@pytest.mark.parametrize("way", ["wsgi-direct", "wsgi", "gunicorn", "asgi"])
def test_a_request_the_c_path_gives_back_takes_the_waiting_path_without_trying_c_again(
    make_wheel, monkeypatch, way: str
) -> None:
    """With the lock held by another process, each adapter's C path tries
    the request once and gives it back; the adapter's own path then waits
    for the lock (the GIL let go), not trying C again: the Timer declined
    one request, and the request has its timer."""
    from shmwheel.contrib import asgi as contrib_asgi

    wheel = make_wheel(payload_size=256)
    handles: list[int] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        handles.append(environ["shmwheel.timer"])
        return [b"ok"]

    if way == "gunicorn":
        hooks, timer = _gunicorn_hooks(wheel, monkeypatch)
        req: Any = _gunicorn_request(RAW_REQUESTS[0])
    elif way == "asgi":

        async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            handles.append(scope["shmwheel.timer"])

        middleware = contrib_asgi.TimeoutMiddleware(asgi_app, name=wheel.name, timeout=30.0, tracebacks=False)
        timer = middleware.timer
        assert timer.prepare() and middleware._in_c is not None
    else:
        wsgi = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None)
        timer = wsgi.timer
        assert timer.prepare()
    fast = timer._fast
    assert fast is not None and fast.declined == 0

    held = threading.Event()
    holder = threading.Thread(target=_hold, args=(wheel, 0.3, held))
    holder.start()
    held.wait()
    t0 = time.monotonic()
    try:
        if way == "gunicorn":
            hooks["pre_request"](None, req)
            handles.append(req.shmwheel_timer)
        elif way == "asgi":
            scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}

            async def receive() -> dict[str, Any]:
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                pass

            import asyncio

            asyncio.run(middleware(scope, receive, send))  # the timer ends with the call
        else:
            call = wsgi.direct() if way == "wsgi-direct" else wsgi
            body = call({"REQUEST_METHOD": "GET", "PATH_INFO": "/x"}, lambda *a: None)
        waited = time.monotonic() - t0
    finally:
        holder.join()
    assert waited >= 0.2, "the lock was not held: the test proves nothing"
    assert fast.declined == 1, f"the C path tried the request {fast.declined} times"
    assert len(handles) == 1 and handles[0] is not None, "the request took no timer"
    if way == "gunicorn":
        hooks["post_request"](None, req, {}, None)
    elif way != "asgi":
        body.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0 and not timer._active
