"""A thread's request is ended only at a safe point: the patterns that an
exception raised at an arbitrary bytecode breaks, each interrupted many
times at random moments through the reporter's own call
(:func:`shmwheel.contrib._interrupt.interrupt`), and the line tables that
decide where a point is safe.

Each pattern runs in a real thread, in a loop, until its RequestTimeout
comes; then the state it guards is checked: a lock released, a finally run
whole, a transaction rolled back, a log line written whole.
"""

from __future__ import annotations

import builtins
import dis
import gc
import inspect
import io
import logging
import os
import queue
import random
import re
import select
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from shmwheel.contrib import RequestTimeout, _safepoint
from shmwheel.contrib._interrupt import interrupt
from shmwheel.contrib._safepoint import can_arm, unsafe_at, unsafe_in_call, unsafe_lines

ROUNDS = 150


def interrupted_many_times(body: Callable[[threading.Event], object], rounds: int = ROUNDS) -> list[object]:
    """Run ``body(ready)`` in a new thread ``rounds`` times, each interrupted
    at a random moment after it has set ``ready``, for as long as the body
    runs; what each run returned, or the exception that ended it.  Every
    run must end."""

    def run(out: list[object], ready: threading.Event, done: threading.Event) -> None:
        try:
            out.append(body(ready))
        except BaseException as exc:  # noqa: BLE001 - what ended it is the result
            out.append(exc)
        finally:
            done.set()

    results: list[object] = []
    for _ in range(rounds):
        out: list[object] = []
        ready, done = threading.Event(), threading.Event()
        thread = threading.Thread(target=run, args=(out, ready, done))
        thread.start()
        assert ready.wait(10)
        time.sleep(random.uniform(0, 0.002))
        assert thread.ident is not None
        how = interrupt(thread.ident, None, lambda done=done: not done.is_set())
        thread.join(10)
        assert not thread.is_alive(), f"never interrupted ({how})"
        results.append(out[0])
    return results


def lines_of(function: Callable[..., object], *marks: str) -> set[int]:
    """The line numbers of ``function``'s lines that end with ``# mark``."""
    source, first = inspect.getsourcelines(function)
    return {first + i for i, text in enumerate(source) for mark in marks if text.rstrip().endswith(f"# {mark}")}


def test_interrupts_can_be_armed_on_this_interpreter() -> None:
    assert can_arm() == ""


def test_a_lock_acquired_before_its_try_is_always_released() -> None:
    lock = threading.Lock()

    def body(ready: threading.Event) -> None:
        ready.set()
        while True:
            lock.acquire()
            try:
                sum(range(50))
            finally:
                lock.release()

    results = interrupted_many_times(body)
    assert all(isinstance(result, RequestTimeout) for result in results)
    assert not lock.locked()


def test_a_class_based_context_manager_always_exits() -> None:
    held = []

    class Held:
        def __enter__(self) -> None:
            held.append(1)
            held.append(2)

        def __exit__(self, *exc: object) -> None:
            held.pop()
            held.pop()

    def body(ready: threading.Event) -> None:
        ready.set()
        while True:
            with Held():
                sum(range(50))

    results = interrupted_many_times(body)
    assert all(isinstance(result, RequestTimeout) for result in results)
    assert held == []


def test_a_finally_is_never_cut_between_its_steps() -> None:
    steps: list[str] = []

    def step(name: str) -> None:
        sum(range(100))
        steps.append(name)

    def body(ready: threading.Event) -> None:
        ready.set()
        while True:
            steps.append("begun")
            try:
                sum(range(50))
            finally:
                step("a")
                step("b")
                steps.clear()

    results = interrupted_many_times(body)
    assert all(isinstance(result, RequestTimeout) for result in results)
    assert steps == []


def test_a_transaction_is_always_rolled_back() -> None:
    def body(ready: threading.Event) -> object:
        connection = sqlite3.connect(":memory:", isolation_level=None)
        connection.execute("CREATE TABLE t (x)")
        ready.set()
        try:
            while True:
                connection.execute("BEGIN")
                try:
                    connection.execute("INSERT INTO t VALUES (1)")
                    connection.execute("COMMIT")
                except BaseException:
                    connection.execute("ROLLBACK")
                    raise
        except RequestTimeout:
            return connection.in_transaction

    assert interrupted_many_times(body) == [False] * ROUNDS


def test_logging_keeps_its_lock_and_its_lines_whole(capsys: pytest.CaptureFixture[str]) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s end"))
    logger = logging.getLogger("shmwheel.test.safepoint")
    logger.propagate = False
    logger.addHandler(handler)
    try:

        def body(ready: threading.Event) -> None:
            ready.set()
            while True:
                logger.warning("a line of the request's %s", "x" * 40)

        results = interrupted_many_times(body)
    finally:
        logger.removeHandler(handler)
    assert all(isinstance(result, RequestTimeout) for result in results)
    assert handler.lock is not None and handler.lock.acquire(blocking=False)
    handler.lock.release()
    assert set(stream.getvalue().splitlines()) == {f"WARNING a line of the request's {'x' * 40} end"}
    assert "Logging error" not in capsys.readouterr().err


def test_with_in_a_loop_is_caught_by_the_try_around_the_loop() -> None:
    """CPython 3.13 delivers an asynchronous exception at a loop's back-edge
    outside the try that encloses the loop (cpython #130279); raised at a
    line, it is caught there, and the with's exit runs."""
    lock = threading.Lock()

    def body(ready: threading.Event) -> str:
        ready.set()
        try:
            while True:
                for _ in range(1000):
                    with lock:
                        pass
        except RequestTimeout:
            return "caught by its try"

    assert interrupted_many_times(body) == ["caught by its try"] * ROUNDS
    assert not lock.locked()


def test_an_interrupt_swallowed_is_raised_again() -> None:
    """Caught and dropped (a library's ``except BaseException: pass``), it
    comes again at a later safe point while the request runs, as trio's
    cancellation does."""

    def body(ready: threading.Event) -> int:
        ready.set()
        swallowed = 0
        while True:
            try:
                while True:
                    sum(range(50))
            except RequestTimeout:
                if swallowed:
                    return swallowed
                swallowed += 1

    assert interrupted_many_times(body, rounds=20) == [1] * 20


def test_an_interrupt_never_lands_in_a_collections_hook() -> None:
    """gc.callbacks run in whichever thread a collection starts in, and
    Python only prints what they raise: an interrupt there would be lost."""
    verdicts: list[str | None] = []

    def hook(phase: str, info: dict[str, int]) -> None:
        verdicts.append(unsafe_at(sys._getframe()))

    gc.callbacks.append(hook)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(hook)
    assert verdicts and all(verdict is not None and "hook" in verdict for verdict in verdicts), verdicts


def test_a_request_that_has_left_is_never_interrupted() -> None:
    """The request's end is asked in its own thread, right where the
    exception would be raised: one that has left never gets it, even armed
    just before it leaves."""
    got: list[BaseException] = []

    def run(left: threading.Event) -> None:
        try:
            until = time.monotonic() + random.uniform(0, 0.002)
            while time.monotonic() < until:  # the request
                pass
            left.set()
            until = time.monotonic() + 0.01
            while time.monotonic() < until:  # the server's code after it
                pass
        except RequestTimeout as exc:
            if left.is_set():
                got.append(exc)

    for _ in range(ROUNDS):
        left = threading.Event()
        thread = threading.Thread(target=run, args=(left,))
        thread.start()
        time.sleep(random.uniform(0, 0.002))
        assert thread.ident is not None
        interrupt(thread.ident, None, lambda event=left: not event.is_set())
        thread.join(10)
    assert got == []


def test_a_thread_in_a_c_call_is_interrupted_once_it_returns() -> None:
    returned = []

    def body(ready: threading.Event) -> None:
        ready.set()
        while True:
            time.sleep(0.05)
            returned.append(1)

    results = interrupted_many_times(body, rounds=5)
    assert all(isinstance(result, RequestTimeout) for result in results)


def test_the_threads_own_trace_function_is_kept() -> None:
    """A tracer the thread had (a debugger's, coverage's) keeps getting its
    events while the thread is armed, and is the thread's again once the
    request has left."""
    seen: list[str] = []

    def tracer(frame: object, event: str, arg: object) -> object:
        seen.append(event)
        return tracer

    for _ in range(5):
        ready, left = threading.Event(), threading.Event()
        after: list[object] = []

        def step() -> int:
            return sum(range(10))

        def run(ready: threading.Event, left: threading.Event, after: list[object]) -> None:
            sys.settrace(tracer)
            ready.set()
            try:
                while True:
                    step()
            except RequestTimeout:
                left.set()
            step()  # a line after the request: the check sees it has left
            after.append(sys.gettrace())
            sys.settrace(None)

        thread = threading.Thread(target=run, args=(ready, left, after))
        thread.start()
        ready.wait()
        assert thread.ident is not None
        interrupt(thread.ident, None, lambda left=left: not left.is_set())
        thread.join(10)
        assert after == [tracer]
    assert "line" in seen


def test_two_requests_armed_in_one_thread_each_keep_their_check() -> None:
    """A pool thread may be armed for two requests that timed out together:
    the second arming keeps the first's check, and the check of the
    request whose code runs there is the one that raises."""
    from shmwheel.contrib._safepoint import arm

    looked: list[str] = []
    ready = threading.Event()
    out: list[BaseException] = []

    def other(frame: object) -> bool:  # another request's: not this thread's code, it keeps looking
        looked.append("other")
        return True

    def this(frame: object) -> bool:  # raises once, then is done
        looked.append("this")
        if looked.count("this") > 1:
            return False
        raise RequestTimeout()

    def run() -> None:
        ready.set()
        try:
            while True:
                sum(range(10))
        except RequestTimeout as exc:
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    ready.wait()
    assert thread.ident is not None
    assert arm(thread.ident, other)
    assert arm(thread.ident, this)
    thread.join(10)
    assert not thread.is_alive() and len(out) == 1
    assert "other" in looked and "this" in looked


def test_a_thread_that_ends_armed_leaves_nothing_armed_behind() -> None:
    """A pool's thread may exit while armed for a request it never runs
    again: its checks go at the next arming, and on 3.12 and later the
    LINE events of its code go once other threads have run that code for
    a while, so the code does not pay a callback a line for good."""
    from shmwheel.contrib import _safepoint

    def looking(frame: object) -> bool:
        return True

    def spins(ready: threading.Event, stop: threading.Event) -> None:
        ready.set()
        while not stop.is_set():
            pass

    ready, stop, later = threading.Event(), threading.Event(), threading.Event()
    other = threading.Thread(target=later.wait)  # alive meanwhile: a thread id of its own
    other.start()
    thread = threading.Thread(target=spins, args=(ready, stop))
    thread.start()
    ready.wait()
    assert thread.ident is not None and _safepoint.arm(thread.ident, looking)
    stop.set()
    thread.join()
    assert thread.ident in _safepoint._checks
    spins(threading.Event(), stop)  # its code, here
    if sys.version_info >= (3, 12):
        tool = sys.monitoring.get_tool  # type: ignore[attr-defined]
        assert any(tool(i) == "shmwheel" for i in range(6))
        for _ in range(_safepoint._Monitoring.PRUNE_EVERY):
            spins(threading.Event(), stop)
        events = [sys.monitoring.get_local_events(i, spins.__code__) for i in range(6) if tool(i) == "shmwheel"]
        assert events == [0]
    assert other.ident is not None and _safepoint.arm(other.ident, lambda frame: False)
    later.set()
    other.join()
    assert thread.ident not in _safepoint._checks


def test_nothing_is_raised_for_a_thread_that_is_gone() -> None:
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    assert thread.ident is not None
    assert interrupt(thread.ident, None, lambda: True) == "not interrupted: its thread has ended"


def example(lock: threading.Lock, a: Callable[..., object], b: list[int]) -> list[object]:
    lock.acquire()  # safe: before the acquire
    try:  # unsafe: after it, before the try
        a()  # safe
    finally:
        lock.release()  # unsafe: cleanup
        a()  # unsafe: cleanup
    with lock:  # unsafe: __enter__ and __exit__
        a()  # safe
    squares = [a(i) for i in b]  # safe: an inlined comprehension's clean-up moves values only
    try:  # unsafe
        a()  # safe
    except KeyError:  # unsafe: the match
        a()  # unsafe: cleanup
    return squares  # safe


def test_unsafe_lines_are_cleanup_and_try_lines() -> None:
    assert unsafe_lines(example.__code__) == lines_of(example, "unsafe", "unsafe: cleanup", "unsafe: the match",
                                                      "unsafe: after it, before the try",
                                                      "unsafe: __enter__ and __exit__")  # fmt: skip
    assert not unsafe_lines(example.__code__) & lines_of(
        example, "safe", "safe: before the acquire", "safe: an inlined comprehension's clean-up moves values only"
    )


def nested(a: Callable[[], object], manager: Callable[[], Any]) -> None:
    try:  # unsafe
        with manager():  # unsafe: __enter__ and __exit__
            try:  # unsafe
                a()  # safe: the body's last line, after which the outer try's range starts again
            except ValueError:  # unsafe: the match
                raise  # unsafe: cleanup
    finally:
        a()  # unsafe: cleanup


def test_a_call_in_a_try_in_a_with_in_a_try_is_a_safe_point() -> None:
    """try: / with: / try: work() - the way FastAPI's telemetry and many a
    Django transaction wrap a request.  The table starts the outer try's
    range again right after a NOP of work()'s line, which is no try: line:
    work() was never interrupted, nor anything it called."""
    assert unsafe_lines(nested.__code__) == lines_of(
        nested, "unsafe", "unsafe: __enter__ and __exit__", "unsafe: the match", "unsafe: cleanup"
    )
    exits: list[object] = []
    finals: list[object] = []

    class Manager:
        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc: object) -> None:
            exits.append(exc[0])

    def spin_forever() -> None:
        while True:
            sum(range(50))

    def body(ready: threading.Event) -> None:
        ready.set()
        try:
            with Manager():
                try:
                    spin_forever()
                except ValueError:
                    raise
        finally:
            finals.append(True)

    results = interrupted_many_times(body, rounds=20)
    assert all(isinstance(result, RequestTimeout) for result in results)
    assert exits == [RequestTimeout] * 20 and finals == [True] * 20  # the with exited, the finally ran: every time


def test_a_frame_below_cleanup_code_is_unsafe_too() -> None:
    verdicts: dict[str, str | None] = {}

    def look(name: str) -> None:
        verdicts[name] = unsafe_at(sys._getframe(1))

    def caller() -> None:
        try:
            look("in a try")
        finally:
            look("called from a finally")

    caller()
    assert verdicts["in a try"] is None
    assert verdicts["called from a finally"] is not None
    assert "cleanup code" in verdicts["called from a finally"]


def test_an_event_loops_own_code_is_never_a_safe_point() -> None:
    """Under trio.run: a task's code is safe, with trio's loop below it, and
    so is a function trio runs in one of its threads; but not code that
    trio's code (outcome's, here) calls from a task, nor code generated at
    run time (an attrs ``__init__``) that it calls: a raise there would
    leave the loop's state half-changed (trio.TrioInternalError)."""
    import outcome
    import trio

    verdicts: dict[str, str | None] = {}

    def look(name: str) -> None:
        verdicts[name] = unsafe_at(sys._getframe(1))

    generated: dict[str, Callable[[], None]] = {}
    exec(compile("def made():\n    look('generated, called by the loop')\n", "<attrs generated test>", "exec"),
         {"look": look}, generated)  # fmt: skip

    def in_a_thread() -> None:
        look("in one of the loop's threads")

    def called(name: str) -> None:
        look(name)

    async def main() -> None:
        look("in a task")
        outcome.capture(called, "called by the loop's code")
        outcome.capture(generated["made"])
        await trio.to_thread.run_sync(in_a_thread)

    trio.run(main)
    assert verdicts["in a task"] is None
    assert verdicts["in one of the loop's threads"] is None
    for name in ("called by the loop's code", "generated, called by the loop"):
        assert verdicts[name] is not None and "the event loop's own code" in verdicts[name], (name, verdicts)


def test_a_request_awaited_by_the_loops_own_coroutine_is_still_interruptible() -> None:
    """asyncio.wait_for awaits the request's coroutine from a coroutine of
    asyncio's (on 3.12, in the request's own task): a frame of the loop's
    code in the middle of the request's stack, which only passes on what
    it awaits.  The request's code above it is safe, as without it.
    (Before, on 3.12, a request that blocked the loop inside wait_for was
    never interrupted.)"""
    import asyncio

    async def endpoint() -> str | None:
        return unsafe_at(sys._getframe())

    async def plain() -> str | None:
        return await endpoint()

    async def in_wait_for() -> str | None:
        return await asyncio.wait_for(endpoint(), 30)

    assert asyncio.run(plain()) is None
    assert asyncio.run(in_wait_for()) is None


def test_a_signal_handler_may_raise_only_in_a_call_not_on_an_acquiring_line() -> None:
    """The main thread's wake signal raises from a handler, mid-line: only
    at a call (the C function the signal ended), and never on the line
    before a try: or a with, which may have just acquired what they release."""
    assert _safepoint._read(example.__code__)[1] == lines_of(
        example, "safe: before the acquire", "safe: an inlined comprehension's clean-up moves values only"
    )
    verdicts: dict[str, str | None] = {}

    def call_here(name: str) -> None:
        verdicts[name] = unsafe_in_call(sys._getframe(1))  # its caller is at the call to here

    lock = threading.Lock()
    call_here("in a call")
    lock.acquire()
    call_here("an acquiring line")  # the line before the try
    try:
        call_here("in the try")
    finally:
        lock.release()
    assert verdicts["in a call"] is None and verdicts["in the try"] is None
    assert "which acquires what the try or with after it releases" in str(verdicts["an acquiring line"])

    def suspended() -> Iterator[int]:
        yield 1  # at a yield, not in a call

    paused = suspended()
    next(paused)
    assert paused.gi_frame is not None
    assert "not in a call" in str(unsafe_in_call(paused.gi_frame))


MAIN_THREAD = """
import sys, threading, time
from shmwheel.contrib._interrupt import interrupt, listen_for_wake, RequestTimeout
assert listen_for_wake()
main = threading.get_ident()
left = threading.Event()

def soon(delay):
    def go():
        time.sleep(delay)
        print("how:", interrupt(main, None, lambda: not left.is_set()), file=sys.stderr, flush=True)
    threading.Thread(target=go).start()

def case(name, body):
    left.clear()
    start = time.monotonic()
    try:
        body()
        print(name, "ran to its end in", f"{time.monotonic() - start:.3f}", flush=True)
    except RequestTimeout:
        print(name, "interrupted in", f"{time.monotonic() - start:.3f}", flush=True)
    finally:
        left.set()
        time.sleep(0.1)

def sleeps():
    soon(0.2)
    time.sleep(5)

def sleeps_in_finally():
    try:
        soon(0.2)
    finally:
        time.sleep(1)

lock = threading.Lock()

def waits_for_a_lock():
    lock.acquire()
    threading.Timer(0.6, lock.release).start()
    soon(0.2)
    lock.acquire()
    try:
        time.sleep(5)
    finally:
        lock.release()

case("sleep", sleeps)
case("finally", sleeps_in_finally)
case("lock", waits_for_a_lock)
print("lock left held:", lock.locked())

# Calls whose value the code keeps: ended where the function returns plain
# data (a socket's recv, select, os.read), even called through an object's
# attribute; not where it hands over something (a queue's item): that is
# taken, and the request ended on the next line.
import os, queue, select, socket

class Client:
    def __init__(self):
        self._sock, self.peer = socket.socketpair()

def receives():
    client = Client()
    threading.Timer(2, client.peer.send, (b"x",)).start()
    soon(0.2)
    data = client._sock.recv(1)

def selects():
    r, w = os.pipe()
    soon(0.2)
    ready, _, _ = select.select([r], [], [], 2)

def reads():
    r, w = os.pipe()
    threading.Timer(2, os.write, (w, b"x")).start()
    soon(0.2)
    data = os.read(r, 1)

items = queue.SimpleQueue()

def takes():
    threading.Timer(0.6, items.put, ("item",)).start()
    soon(0.2)
    item = items.get()
    time.sleep(5)

for name, body in (("recv", receives), ("select", selects), ("read", reads), ("get", takes)):
    case(name, body)

# The wake as the acquire returns (the lock released by another thread
# just before it): at the end of the call, where CPython also runs signal
# handlers, the value is in hand and must not be dropped.
import signal
from shmwheel.contrib import _interrupt

def release_then_wake():
    def go():
        time.sleep(0.2)
        wake, _interrupt._wake = _interrupt._wake, (0, 0, 0)  # armed, not woken
        interrupt(main, None, lambda: not left.is_set())
        _interrupt._wake = wake
        lock.release()
        signal.pthread_kill(main, wake[2])
    threading.Thread(target=go).start()

class Pool:
    lock = lock
    def get(self):
        return self

def if_not_acquired():
    lock.acquire()
    release_then_wake()
    if not lock.acquire(timeout=5):
        raise KeyError
    try:
        time.sleep(1)
    finally:
        lock.release()

def acquired_over_lines():
    lock.acquire()
    release_then_wake()
    ok = (Pool()
          .get()
          .lock.acquire())
    try:
        time.sleep(1)
    finally:
        lock.release()

def on_alarm(signum, frame):
    time.sleep(0.5)  # an application's own handler, which waits

def in_another_handler():
    lock.acquire()
    def go():
        time.sleep(0.2)
        lock.release()
        signal.pthread_kill(main, signal.SIGALRM)
        time.sleep(0.2)  # the main thread waits in on_alarm, right after its acquire returned
        interrupt(main, None, lambda: not left.is_set())
    threading.Thread(target=go).start()
    lock.acquire()
    try:
        time.sleep(1)
    finally:
        lock.release()

def swallows_then_sleeps():
    soon(0.2)
    try:
        time.sleep(5)
    except BaseException:  # an old library's retry loop
        pass
    time.sleep(3)  # woken again: the wake comes every 50 ms while armed

case("swallowed", swallows_then_sleeps)

signal.signal(signal.SIGALRM, on_alarm)
for name, body in (("if-not", if_not_acquired), ("lines", acquired_over_lines), ("handler", in_another_handler)):
    case(name, body)
    print(name, "lock left held:", lock.locked(), flush=True)
    if lock.locked():
        lock.release()
"""


class _Client:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock


class _Slotted:
    __slots__ = ("_sock",)

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock


class _Ran(BaseException):
    """Application code that ran in a look-up (BaseException: no except
    Exception in the look-up hides it)."""


class _Tricky:
    @property
    def _sock(self) -> socket.socket:
        raise _Ran("a property was run")


class _Weird:
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise _Ran("__class__ was read")

    def recv(self, n: int) -> bytes:
        raise _Ran("called")


@pytest.mark.parametrize(
    ("statement", "plain"),
    [
        ("data = x.recv(1)", True),
        ("data = client._sock.recv(n - 2, socket.MSG_PEEK)", True),
        ("n = slotted._sock.recv_into(buffer, flags=0)", True),
        ("data = x.recv(len(b'ab'))", False),  # a call for an argument may have bound the name anew
        ("data = empty._sock.recv(1)", False),  # a slot not set
        ("data = weird.recv(1)", False),  # its __class__ a property: not run
        ("messages = x.recvmsg(1, 64)", False),  # it may carry descriptors
        ("status = os.waitpid(-1, 0)", False),  # a child's status, reaped once
        ("ready, _, _ = select.select([x], [], [], 1.0)", True),
        ("return os.read(3, 4096)", True),
        ("data = f'{x.recv(1)!r:>5}'", True),
        ("ok = lock.acquire()", False),
        ("item = items.get(timeout=1)", False),
        ("fd, addr = x._accept()", False),
        ("data = (x if n else client._sock).recv(1)", False),  # a jump: more than one way to the call
        ("data = tricky._sock.recv(1)", False),  # a property, not run
        ("data = (yield x).recv(1)", False),  # not an instruction read here
    ],
)
def test_the_function_a_call_calls_is_read_off_the_bytecode_without_running_code(statement: str, plain: bool) -> None:
    """What a frame paused at its last call is calling, as the wake
    signal's handler reads it: the statement run on a stack of names, then
    looked up statically.  Only functions that return plain data count."""
    from shmwheel.contrib import _calls

    sock, peer = socket.socketpair()
    with sock, peer:
        space = {
            "x": sock, "n": 3, "client": _Client(sock), "slotted": _Slotted(sock), "tricky": _Tricky(),
            "empty": _Slotted.__new__(_Slotted), "weird": _Weird(), "buffer": bytearray(4),
            "lock": threading.Lock(), "items": queue.SimpleQueue(), "os": os, "select": select, "socket": socket,
        }  # fmt: skip
        namespace: dict[str, Any] = {}
        exec(f"def f(x):\n    {statement}\n", space, namespace)  # x is a local, the rest globals
        code = namespace["f"].__code__
        last = [ins for ins in dis.get_instructions(code) if ins.opname in ("CALL", "CALL_KW")][-1]
        frame = SimpleNamespace(f_code=code, f_lasti=last.offset, f_locals={"x": sock}, f_globals=space,
                                f_builtins=vars(builtins))  # fmt: skip
        assert _calls.plain_call(frame) is plain  # type: ignore[arg-type]


def test_the_main_thread_is_woken_from_a_c_call_only_where_it_may_be() -> None:
    """In the main thread, in a fresh interpreter: a time.sleep is ended
    at once; one in a finally runs whole, and the request is ended after
    it; a lock.acquire() that waits is not ended (its line acquires what
    the try after it releases), and the request is ended in the try, which
    releases the lock.  A recv, select or os.read whose value the code
    keeps is ended at once; a queue's get is not, and the request is ended
    on the line after it, with its item.  Nor is an acquire whose value is tested, or that
    spans lines, when the wake comes as it returns; nor the request's code
    below another signal handler, which ran right after an acquire."""
    done = subprocess.run([sys.executable, "-c", MAIN_THREAD], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    took = {m[1]: float(m[2]) for m in re.finditer(r"^(\S+) interrupted in ([\d.]+)$", out, re.M)}
    # Lower bounds where a wait runs whole first; upper ones well short of
    # what the call would have waited had it not been ended (5 s, or 2 s
    # for the data that comes to recv and read), and of its 5 s sleep after.
    assert 0.2 <= took["sleep"] < 4.0, out
    assert 1.0 <= took["finally"] < 4.0, out  # its sleep of 1 s ran whole
    assert 0.6 <= took["lock"] < 4.0, out  # the acquire waited until the lock was released
    assert "lock left held: False" in out, out
    assert done.stderr.count("or in the C call it waits in (SIGRTMIN") == 8, done.stderr
    for name in ("recv", "select", "read"):
        assert 0.2 <= took[name] < 1.9, out
    assert 0.6 <= took["get"] < 4.0, out  # the item came, and was taken
    assert 0.2 <= took["swallowed"] < 2.5, out  # not the whole 3 s after what it swallowed
    for name in ("if-not", "lines", "handler"):
        assert f"{name} lock left held: False" in out, out
