"""Ending a timed-out request where it runs, without ending its worker.

The driver only signals the worker; the worker's reporter thread
(:mod:`shmwheel.contrib._stacks`) finds the request in its own table and
ends it the way its kind of worker allows:

* a thread (Gunicorn's sync and gthread workers, uWSGI's threads): the
  thread is armed (:mod:`shmwheel.contrib._safepoint`) to raise
  :class:`RequestTimeout` itself at its next safe point - never in cleanup
  code, never between an acquire and the ``try`` that releases it, never
  in ``logging`` - and only while the request is still the application's.
  A thread in a C call (``time.sleep``, a blocking ``recv``, a regular
  expression) gets there only once the call returns - but for the main
  thread (a sync worker's), where CPython runs signal handlers: a
  real-time signal with a Python handler ends a wait in an interruptible
  system call (a sleep, a socket, a select), and the handler raises there
  under the same rule, and only there (see :func:`listen_for_wake`);
* an asyncio task: cancelled through its loop (``call_soon_threadsafe``),
  which ends whatever it awaits; a task that blocks its loop (it never
  awaits) has the loop's thread armed instead, since the loop cannot run
  the cancel;
* a trio task (Hypercorn's trio worker): the request runs inside a cancel
  scope of the middleware's (:func:`trio_cancel_scope`), cancelled through
  the run's token (``run_sync_soon``); trio raises ``Cancelled`` at the
  task's next checkpoint, and the middleware answers 504.  A task that
  blocks trio's loop has the loop's thread armed, as for asyncio;
* a greenlet (gevent): :class:`RequestTimeout` thrown into it from its
  hub (``run_callback_threadsafe``) once its frames are at a safe point,
  which ends a cooperative wait; one that is running (a CPU loop that
  keeps the hub, or a C call that does not yield to it) has its thread
  armed, and in the main thread woken as above.

The server adapters then answer ``504 Gateway Timeout`` if the response
has not started, and close the connection if it has.  Whether the request
is still the application's is asked where the exception would be raised,
in the request's own thread or loop, so a request that has left is never
interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from .._binding import lib
from ._record import DUMP_SIGNALS, SHOWN_MAX, shown, signal_name
from ._safepoint import arm, armed, can_arm, check_from_signal, unsafe_at
from ._stacks import holds, real, waits_for_thread

__all__ = [
    "RESPONSE_BODY",
    "RESPONSE_STATUS",
    "RequestTimeout",
    "ResponseBrokenOff",
    "interrupt",
    "listen_for_wake",
    "trio_cancel_scope",
]

_log = logging.getLogger("shmwheel.timeouts")

RESPONSE_STATUS = "504 Gateway Timeout"
RESPONSE_BODY = b"504 Gateway Timeout: the request took too long\n"
RESPONSE_HEADERS = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(RESPONSE_BODY)))]


class RequestTimeout(BaseException):
    """Raised in a request that ran past its timeout, where it runs, to end
    it (``interrupt=True``).

    A ``BaseException``, as asyncio's ``CancelledError`` is since Python
    3.8 and for the same reason: it ends the request, it is not an error of
    the request's, so ``except Exception`` - in the application, in a
    framework's handler that would answer 500 and log "Internal Server
    Error", in an error tracker's integration - lets it through to the
    middleware, which answers 504.  ``finally`` blocks and ``with`` exits
    run as for any exception.  Code that must tell it apart catches it by
    name."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("the request ran past its timeout and was interrupted by shmwheel",)))


class ResponseBrokenOff(Exception):
    """What the ASGI middleware raises to its server for a request
    interrupted after its response had begun (or a WebSocket's), which no
    504 can replace: the server breaks the response off (closes an
    HTTP/1.1 connection, leaves an HTTP/2 stream unfinished), so that no
    client or proxy takes it for whole, and logs it as any error of an
    application's.

    An ``Exception``, where :class:`RequestTimeout` is a ``BaseException``:
    the application's code is done by then, and servers run many requests
    in one task group - Hypercorn each HTTP/2 connection's streams, and
    under trio each connection in the worker's nursery - which a
    ``BaseException`` would end whole: every stream of the connection, or
    the worker itself."""

    def __init__(self, *args: object) -> None:
        super().__init__(
            *(args or ("the request ran past its timeout after its response had begun: broken off by shmwheel",))
        )


#: How long an ASGI application that listens for its client leaving (another
#: of its tasks waits in receive()) has, once told at the interrupt, to act
#: on it before its request's task is cancelled all the same.  Django's acts
#: within a few turns of the loop.
LISTENER_GRACE = 0.1

#: How soon a RequestTimeout is raised again in a request that is still in
#: progress after the last one (it was lost or swallowed).
RERAISE_INTERVAL = 0.01


def _raise_in(
    thread: int,
    still: Callable[[], bool],
    running: Callable[[], bool] | None = None,
    elsewhere: Callable[[], object] | None = None,
) -> bool:
    """Arm ``thread`` to raise RequestTimeout itself at its next safe point,
    if the request is still in progress (``still()``, asked there, in the
    thread, right before it raises); whether it was armed.

    Raised, it is raised again at the next safe point, no sooner than
    ``RERAISE_INTERVAL`` after, for as long as the request is still in
    progress, as trio's cancellation is: one that was lost (raised in a
    finalizer or a ``gc.callbacks`` hook, which Python only prints) or
    swallowed (``except BaseException: pass``) does not leave the request
    running.

    For a task or a greenlet that was running in the thread, ``running()``
    says whether it still is: once another runs there instead, the check
    calls ``elsewhere()`` (a cancel through the loop, a throw from the hub)
    and stops, so that another request never gets the exception."""
    if not still():
        return False
    raised = [-RERAISE_INTERVAL]  # time.monotonic() of the last raise

    def check(frame: FrameType) -> bool:
        if not still():
            return False  # it has left: nothing to end
        if running is not None and not running():
            if elsewhere is not None:
                with contextlib.suppress(Exception):  # shmwheel's own: never the request's thread's
                    elsewhere()
            return False
        if unsafe_at(frame) is not None:
            return True  # not here: at a later line
        now = time.monotonic()
        if now - raised[0] < RERAISE_INTERVAL:
            return True
        raised[0] = now
        raise RequestTimeout()

    return arm(thread, check)


def _armed(where: str) -> str:
    return f"RequestTimeout to be raised in {where} at its next safe point"


# The wake signal: a real-time signal with a Python handler, which the
# reporter sends the main thread when it arms it.  (pid, main thread, signal)
# of the process that set it up; none where no thread was the main one.
_wake: tuple[int, int, int] = (0, 0, 0)


def listen_for_wake() -> int:
    """From the main thread: a handler for the first free real-time signal
    of DUMP_SIGNALS, which :func:`interrupt` sends the main thread when it
    arms it.  The main thread is the only one in which CPython runs signal
    handlers, and a signal with a Python handler (set without SA_RESTART)
    ends a wait in an interruptible system call - ``time.sleep``, a socket,
    ``select`` - with EINTR, upon which the C function runs the handler.
    The handler raises RequestTimeout there only where a line start would
    (:func:`~shmwheel.contrib._safepoint.unsafe_at`), only inside a call,
    and never on a line that acquires what the ``try`` or ``with`` after it
    releases; elsewhere it returns, and the call goes on (PEP 475).
    Returns the signal, 0 if none (not the main thread, none free)."""
    global _wake
    _, _, mine = _wake
    if not (mine and signal.getsignal(mine) is _on_wake):  # inherited across fork, or none yet
        mine = next((signum for signum in DUMP_SIGNALS if lib.shmw_signal_owner(signum) == 0), 0)
    if not mine:
        return 0
    try:
        signal.signal(mine, _on_wake)  # again, if it is there: that tells the main thread
    except ValueError:  # not the main thread: only it may set a handler, and only it runs them
        return 0
    _wake = (os.getpid(), real("_thread", "get_ident")(), mine)
    return mine


def _on_wake(signum: int, frame: FrameType | None) -> None:
    if frame is not None:
        check_from_signal(frame)


#: How often the wake signal is sent again to a main thread that is still
#: armed: a call it ended may have been declined (in cleanup code, say) and
#: retried, or its RequestTimeout swallowed.
WAKE_AGAIN = 0.05


def _wake_up(thread: int) -> str:
    """Send the wake signal to ``thread`` if it is the main thread it was
    set up in, and again every WAKE_AGAIN for as long as it stays armed;
    what it adds to the log's "how"."""
    pid, main, signum = _wake
    if not signum or pid != os.getpid() or thread != main:
        return ""
    try:
        signal.pthread_kill(thread, signum)
    except OSError:
        return ""
    if (pid, thread) not in _waking:  # one resender a thread, for all its checks
        _waking.add((pid, thread))
        real("_thread", "start_new_thread")(_wake_again, (thread, signum, pid))
    return f", or in the C call it waits in ({signal_name(signum)})"


_waking: set[tuple[int, int]] = set()  # (process, thread) that a _wake_again runs for


def _wake_again(thread: int, signum: int, pid: int) -> None:
    sleep = real("time", "sleep")
    try:
        while True:
            sleep(WAKE_AGAIN)
            if os.getpid() != pid or not armed(thread):
                return
            try:
                signal.pthread_kill(thread, signum)
            except OSError:  # it has ended
                return
    finally:
        _waking.discard((pid, thread))


def _not_armed(still: Callable[[], bool]) -> str:
    if not still():
        return "not interrupted: it has ended"
    return f"not interrupted: {can_arm() or 'its thread has ended'}"


def interrupt(
    thread: int,
    task: Any,
    still: Callable[[], bool],
    mine: Callable[[], bool] | None = None,
    end: Callable[[], bool] | None = None,
) -> str:
    """End the request that runs in ``thread`` (in ``task``: an asyncio or
    trio task, a greenlet, or None); ``still()`` says whether it is still
    in progress.  For a task, ``mine()`` says, in any thread, whether the
    code running there is the request's (a synchronous endpoint that a
    thread pool runs in a copy of the task's context, a task the request
    waits for).  For an asyncio task, ``end()`` is the ASGI middleware's, run
    in the loop's thread before the cancel: it answers and tells the
    application the client is gone, and says whether the task is still to
    be cancelled.  Returns how, or why it could not, for the log."""
    if isinstance(task, asyncio.Future):
        return _cancel(task, thread, still, mine, end)  # type: ignore[arg-type]
    if task is not None and is_trio_task(task):
        return _cancel_trio(task, thread, still, mine)
    if task is not None:
        return _throw(task, thread, still)
    if _raise_in(thread, still):
        return _armed(f"thread 0x{thread:016x}") + _wake_up(thread)
    return _not_armed(still)


def _cancel(
    task: asyncio.Task[Any],
    thread: int,
    still: Callable[[], bool],
    mine: Callable[[], bool] | None,
    end: Callable[[], bool] | None,
) -> str:
    if task.done():
        return "not interrupted: its task has ended"
    loop = task.get_loop()
    ended = [False]

    def in_loop() -> None:  # in the loop's thread, once
        if not ended[0]:
            ended[0] = True
            _cancel_in_loop(task, still, end)

    def elsewhere() -> None:  # in the loop's thread: the request's code is not running there now
        loop.call_soon(in_loop)

    running_task = asyncio.current_task(loop)
    if running_task is task:
        # It is in a step now and blocks its loop, which would never run a
        # cancel: the loop's thread is armed, for as long as the step lasts.
        def running() -> bool:
            return asyncio.current_task(loop) is task

        if _raise_in(thread, still, running, elsewhere):
            return _armed(f"task {shown(task.get_name(), SHOWN_MAX)}, which blocks the event loop,") + _wake_up(thread)
        return _not_armed(still)
    # Another task may be blocking the loop that the request waits for (a
    # view Django runs in a task of its own): the loop's thread, armed,
    # raises in it, for as long as its step lasts, and then leaves the
    # cancel to the loop.  Never in a task the request does not hold, which
    # may only have copied its context (a library's, started during it).
    blocking = False
    if running_task is not None and mine is not None and _held(task, running_task):

        def running_held() -> bool:
            return asyncio.current_task(loop) is running_task and mine()

        blocking = _raise_in(thread, still, running_held, elsewhere)
    try:
        loop.call_soon_threadsafe(in_loop)
    except RuntimeError:  # the loop is closed
        return "not interrupted: its event loop is closed"
    how = f"task {shown(task.get_name(), SHOWN_MAX)} cancelled"
    if end is not None:
        how += (
            " once told its client is gone (if another of its tasks listens for that: only if the request has"
            f" not stirred {LISTENER_GRACE:g} s later)"
        )
    if _waits_for_thread(task):  # as it is now: the loop's thread looks again (_cancel_in_loop)
        how += ", but not before the thread it waits for is back"
    if blocking:
        how += (
            f", and the event loop's thread, where task {shown(running_task.get_name(), SHOWN_MAX)},"  # type: ignore[union-attr]
            " which the request waits for, runs now, armed to raise in that task at its next safe point"
        )
    if mine is not None and _arm_pool(thread, mine):
        how += ", and the thread that runs its synchronous code, if one does, armed to raise at its next safe point"
    return how


def _held(task: asyncio.Task[Any], other: asyncio.Task[Any]) -> bool:
    try:
        return holds(task, other)
    except RuntimeError:  # a list or set of its changed as it was read: the loop's thread is not stopped
        return False


def _arm_pool(loop_thread: int, mine: Callable[[], bool]) -> int:
    """Arm every thread but the loop's and this one to raise RequestTimeout
    at a safe point while it runs the request's own code (``mine()``):
    a synchronous endpoint in a thread pool (Starlette's
    ``run_in_threadpool``, ``asyncio.to_thread``), which the task's cancel
    cannot reach, and which the task may wait for or leave running.
    Which thread runs it is not known from here, but each knows for itself,
    by the context it runs in; the others stop looking at their first
    line.  The code being the request's is the whole condition: the task
    may have ended already (the cancel left the thread behind), and the
    thread must stop all the same.  Returns how many were armed."""
    here = real("_thread", "get_ident")()
    armed = 0
    for ident in sys._current_frames():
        if ident not in (loop_thread, here) and _raise_in(ident, _always, mine):
            armed += 1
    return armed


def is_trio_task(task: Any) -> bool:
    """Whether ``task`` is a trio task (asyncio's have no ``coro`` attribute)."""
    return hasattr(getattr(task, "coro", None), "cr_frame")


# The cancel scopes of the requests that run in trio tasks, by the task's
# id: (trio, the run's token, the scope).  trio has no way to cancel a task
# from outside it; a scope around the request's code, cancelled from its
# own run, is the way.  Set and cleared in the task, read by the reporter.
_trio_scopes: dict[int, tuple[Any, Any, Any]] = {}


@contextlib.contextmanager
def trio_cancel_scope(task: Any) -> Iterator[Any]:
    """In the trio task ``task``: a cancel scope around the request's code,
    which :func:`interrupt` can cancel from any thread while it is entered.
    Trio then raises ``Cancelled`` at the task's next checkpoint, and goes
    on raising it at every later one in the scope (level-triggered), until
    the code has left it; ``cancelled_caught`` says whether it ended so."""
    trio = sys.modules["trio"]
    scope = trio.CancelScope()
    key = id(task)
    _trio_scopes[key] = (trio, trio.lowlevel.current_trio_token(), scope)
    try:
        with scope:
            yield scope
    finally:
        del _trio_scopes[key]


def _cancel_trio(task: Any, thread: int, still: Callable[[], bool], mine: Callable[[], bool] | None) -> str:
    entry = _trio_scopes.get(id(task))
    if entry is None:
        return "not interrupted: its task has ended"
    trio, token, scope = entry

    def cancel() -> None:  # in trio's thread, between two steps of its tasks
        if still():
            scope.cancel()

    def cancel_soon() -> None:
        with contextlib.suppress(trio.RunFinishedError):
            token.run_sync_soon(cancel)

    if task.coro.cr_running:
        # In a step now, which blocks trio's loop: the loop's thread is
        # armed, for as long as the step lasts; then the scope is cancelled.
        def running() -> bool:  # its coroutine is being sent to: trio's loop is in the task's step
            return bool(task.coro.cr_running)

        if _raise_in(thread, still, running, cancel_soon):
            return _armed(f"trio task {shown(task.name, SHOWN_MAX)}, which blocks trio's loop,") + _wake_up(thread)
        return _not_armed(still)
    try:
        token.run_sync_soon(cancel)
    except trio.RunFinishedError:
        return "not interrupted: its trio run has finished"
    how = f"trio task {shown(task.name, SHOWN_MAX)} cancelled"
    if mine is not None and _arm_pool(thread, mine):
        how += ", and the thread that runs its synchronous code, if one does, armed to raise at its next safe point"
    return how


def _always() -> bool:
    return True


def _cancel_in_loop(task: asyncio.Task[Any], still: Callable[[], bool], end: Callable[[], bool] | None = None) -> None:
    if not (still() and not task.done() and (end is None or end())):
        return
    waiter = getattr(task, "_fut_waiter", None)
    if waiter is not None and not waiter.done() and _waits_for_thread(task):
        # It waits for its synchronous code, run in a thread: the cancel
        # would not stop that thread but leave it running, the request's
        # timer gone with the task, and nothing to end it or kill its worker
        # if it never returns (a C call).  The thread is armed
        # (_arm_pool); the task is cancelled once the thread has given it
        # back, if it still runs then, after its own wake-up.
        waiter.add_done_callback(lambda _: _cancel_in_loop(task, still))
        return
    task.cancel("shmwheel: the request ran past its timeout")


def _waits_for_thread(task: asyncio.Task[Any]) -> bool:
    try:
        return waits_for_thread(task)
    except RuntimeError:  # a coroutine's state changed as it was read: take it as not
        return False


#: How often a greenlet that waits where it may not be interrupted (in a
#: ``finally``, say) is looked at again from its hub.
GREENLET_RETRY = 0.01


def _throw(glet: Any, thread: int, still: Callable[[], bool]) -> str:
    if getattr(glet, "dead", True):
        return "not interrupted: its greenlet has ended"
    loop: Any = getattr(getattr(glet, "parent", None), "loop", None)
    run = getattr(loop, "run_callback_threadsafe", None)
    if run is None:  # not gevent's: eventlet's, or a bare greenlet
        return "not interrupted: only gevent's greenlets can be, from another thread"

    def throw() -> None:  # in the hub, in the greenlet's own thread, while it waits
        if not still() or glet.dead:
            return
        if unsafe_at(glet.gr_frame) is not None:  # waits in cleanup code: look again later
            loop.timer(GREENLET_RETRY).start(throw)
            return
        try:
            glet.throw(RequestTimeout)
        except RequestTimeout:  # a bare greenlet that did not catch it: its parent, the hub, gets it
            pass

    if getattr(glet, "gr_frame", None) is None:  # the one running in its thread: it keeps the hub
        getcurrent = sys.modules["greenlet"].getcurrent
        if _raise_in(thread, still, lambda: getcurrent() is glet, lambda: run(throw)):
            # Gevent's workers run in the main thread: a greenlet blocked in
            # a C call that does not yield (a sleep or a socket gevent did
            # not patch) is woken there like a sync worker's request.
            return _armed(f"thread 0x{thread:016x}, where its greenlet runs,") + _wake_up(thread)
        return _not_armed(still)
    run(throw)
    return f"RequestTimeout to be thrown into greenlet 0x{id(glet):x} at its next safe point"
