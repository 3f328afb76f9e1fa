"""The table of a process's requests in progress (shmwheel._fast's Table,
of Actives) against a dict, and where a request is found: in its
thread's slot, in its asyncio task's context, in its greenlet."""

from __future__ import annotations

import contextvars
import gc
import logging
import threading
import time
import weakref
from typing import Any

import pytest
from _contrib import _timer

from shmwheel import _fast
from shmwheel.contrib._stacks import Active


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
    before = timer.in_progress()[handle]
    assert timer.rearm(handle, 60.0)
    after = timer._active[handle]
    assert before.handle == handle != after.handle and after.timeout_ns > before.timeout_ns
    assert timer.in_progress()[handle] == after != before
    timer.finish(handle)
    assert len(wheel) == 0 and not timer._active


# -- the thread's slot, the task's context ---------------------------------------------------------


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
