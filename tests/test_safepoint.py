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

import inspect
import io
import logging
import random
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from types import FunctionType

import pytest

from shmwheel.contrib import RequestTimeout
from shmwheel.contrib._interrupt import interrupt
from shmwheel.contrib._safepoint import can_arm, unsafe_at, unsafe_lines

ROUNDS = 150


def interrupted_many_times(body: Callable[[threading.Event], object], rounds: int = ROUNDS) -> list[object]:
    """Run ``body(ready)`` in a new thread ``rounds`` times, each interrupted
    at a random moment after it has set ``ready``; what each run returned,
    or the exception that ended it.  Every run must end."""

    def run(out: list[object], ready: threading.Event) -> None:
        try:
            out.append(body(ready))
        except BaseException as exc:  # noqa: BLE001 - what ended it is the result
            out.append(exc)

    results: list[object] = []
    for _ in range(rounds):
        out: list[object] = []
        ready = threading.Event()
        thread = threading.Thread(target=run, args=(out, ready))
        thread.start()
        assert ready.wait(10)
        time.sleep(random.uniform(0, 0.002))
        assert thread.ident is not None
        how = interrupt(thread.ident, None, lambda: True)
        thread.join(10)
        assert not thread.is_alive(), f"never interrupted ({how})"
        results.append(out[0])
    return results


def lines_of(function: FunctionType, *marks: str) -> set[int]:
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
    seen: list[str] = []

    def tracer(frame: object, event: str, arg: object) -> object:
        seen.append(event)
        return tracer

    after: list[object] = []

    def step() -> int:
        return sum(range(10))

    def body(ready: threading.Event) -> None:
        sys.settrace(tracer)
        ready.set()
        try:
            while True:
                step()
        except RequestTimeout:
            after.append(sys.gettrace())
            raise
        finally:
            sys.settrace(None)

    interrupted_many_times(body, rounds=5)
    assert after == [tracer] * 5
    assert "line" in seen


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
