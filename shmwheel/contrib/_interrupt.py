"""Ending a timed-out request where it runs, without ending its worker.

The driver only signals the worker; the worker's reporter thread
(:mod:`shmwheel.contrib._stacks`) finds the request in its own table and
ends it the way its kind of worker allows:

* a thread (Gunicorn's sync and gthread workers, uWSGI's threads): a
  :class:`RequestTimeout` raised in that thread at its next bytecode,
  through CPython's asynchronous-exception call.  A thread in a C call
  (``time.sleep``, a blocking ``recv``, a regular expression) sees it only
  once the call returns;
* an asyncio task: cancelled through its loop (``call_soon_threadsafe``),
  which ends whatever it awaits; a task that blocks its loop (it never
  awaits) gets :class:`RequestTimeout` in the loop thread instead, since
  the loop cannot run the cancel;
* a greenlet (gevent): :class:`RequestTimeout` thrown into it from its
  hub (``run_callback_threadsafe``), which ends a cooperative wait; one
  that is running (a CPU loop that keeps the hub) gets it in its thread.

The server adapters then answer ``504 Gateway Timeout`` if the response
has not started, and close the connection if it has.  An interrupt that
comes too late - the request ended meanwhile - is taken back before it is
raised, whenever the thread has not reached a bytecode since.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable
from typing import Any

__all__ = ["RESPONSE_BODY", "RESPONSE_STATUS", "RequestTimeout", "interrupt"]

_log = logging.getLogger("shmwheel.timeouts")

RESPONSE_STATUS = "504 Gateway Timeout"
RESPONSE_BODY = b"504 Gateway Timeout: the request took too long\n"
RESPONSE_HEADERS = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(RESPONSE_BODY)))]


class RequestTimeout(TimeoutError):
    """Raised in a request that ran past its timeout, where it runs, to end
    it (``interrupt=True``).  A ``TimeoutError``: code that retries or
    cleans up on timeouts treats it as one; code that catches every
    ``Exception`` swallows it, and the request then goes on to the kill
    stage."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("the request ran past its timeout and was interrupted by shmwheel",)))


_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
_set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
_set_async_exc.restype = ctypes.c_int


def _raise_in(thread: int, still: Callable[[], bool]) -> bool:
    """RequestTimeout in ``thread`` at its next bytecode, unless the request
    has ended (``still()``, asked right before and right after it is set);
    whether it was set.

    The two checks leave a window of a few bytecodes: a request that ends
    in it, just as it is interrupted, may raise RequestTimeout in the
    server's code after its response, where the server logs it and closes
    the connection.  Python offers no atomic check-and-raise."""
    if not still():
        return False
    if _set_async_exc(thread, RequestTimeout) != 1:
        return False  # no such thread any more
    if not still():  # ended meanwhile: take it back, unless the thread has raised it already
        _set_async_exc(thread, ctypes.py_object())  # NULL: clears a pending one
        return False
    return True


def interrupt(thread: int, task: Any, still: Callable[[], bool]) -> str:
    """End the request that runs in ``thread`` (in ``task``: an asyncio or
    trio task, a greenlet, or None); ``still()`` says whether it is still
    in progress.  Returns how, or why it could not, for the log."""
    if isinstance(task, asyncio.Future):
        return _cancel(task, thread, still)  # type: ignore[arg-type]
    if task is not None and hasattr(getattr(task, "coro", None), "cr_frame"):
        return "not interrupted: shmwheel cannot cancel a trio task from outside trio"
    if task is not None:
        return _throw(task, thread, still)
    if _raise_in(thread, still):
        return f"RequestTimeout raised in thread 0x{thread:016x}"
    return "not interrupted: it has ended"


def _cancel(task: asyncio.Task[Any], thread: int, still: Callable[[], bool]) -> str:
    if task.done():
        return "not interrupted: its task has ended"
    loop = task.get_loop()
    if asyncio.current_task(loop) is task:
        # It is in a step now and blocks its loop, which would never run a
        # cancel: the exception goes straight into the step.
        if _raise_in(thread, still):
            return f"RequestTimeout raised in task {task.get_name()}, which blocks the event loop"
        return "not interrupted: it has ended"
    try:
        loop.call_soon_threadsafe(_cancel_in_loop, task, still)
    except RuntimeError:  # the loop is closed
        return "not interrupted: its event loop is closed"
    return f"task {task.get_name()} cancelled"


def _cancel_in_loop(task: asyncio.Task[Any], still: Callable[[], bool]) -> None:
    if still() and not task.done():
        task.cancel("shmwheel: the request ran past its timeout")


def _throw(glet: Any, thread: int, still: Callable[[], bool]) -> str:
    if getattr(glet, "dead", True):
        return "not interrupted: its greenlet has ended"
    if getattr(glet, "gr_frame", None) is None:  # the one running in its thread: it keeps the hub
        if _raise_in(thread, still):
            return f"RequestTimeout raised in thread 0x{thread:016x}, where its greenlet runs"
        return "not interrupted: it has ended"
    loop = getattr(getattr(glet, "parent", None), "loop", None)
    run = getattr(loop, "run_callback_threadsafe", None)
    if run is None:  # not gevent's: eventlet's, or a bare greenlet
        return "not interrupted: only gevent's greenlets can be, from another thread"

    def throw() -> None:  # in the hub, in the greenlet's own thread
        if still() and not glet.dead:
            try:
                glet.throw(RequestTimeout)
            except RequestTimeout:  # a bare greenlet that did not catch it: its parent, the hub, gets it
                pass

    run(throw)
    return f"RequestTimeout thrown into greenlet 0x{id(glet):x}"
