"""An ASGI middleware that gives every request a timeout, under any ASGI server.

    from shmwheel.contrib.asgi import TimeoutMiddleware
    app = TimeoutMiddleware(app, timeout=30.0, kill=True)

That is all it takes under Uvicorn (``--workers N`` or not) and Hypercorn:
the workers make a wheel of their own, ``asgi-<pid>`` after the server's
main process, and whichever finds no driver on it starts one (see
:class:`~shmwheel.contrib._supervisor.AutoDriver`), which removes the wheel
and exits once no worker has used it for two seconds.  Under Gunicorn with
``install()`` in its config, the middleware uses the wheel the master made
and that the master drives (it names it in the ``SHMWHEEL_WHEEL``
environment variable), and with Uvicorn's worker classes ``install()``
wraps the application itself.  With ``name=...`` the middleware only adds
and cancels timers in that wheel, and the driver is yours to run:
``shmwheel timeouts NAME --create`` under a process
manager, say.

It is a plain ASGI 3 application around yours: the timer runs from the
call of the application until the last message of its response has been
sent (``http.response.body`` without ``more_body``), or until the
application returns or raises, whichever comes first; a background task
that runs after the response is not timed.  Websocket connections are not
timed unless ``websocket=True``, and then for as long as the connection
lasts; ``lifespan`` and any other scope pass straight through.  A scope
that an outer TimeoutMiddleware has timed already carries
``"shmwheel.handle"`` (the handle, or None without a timer) and is passed
through, so wrapping an application twice times it once, by the outer one;
the inner one says so, once a process, at its first such request, since
its settings then do nothing.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from asyncio import CancelledError, Future, current_task, ensure_future, get_running_loop
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .. import _process
from .._checks import check_flag
from .._segment import segment_name
from ._autodriver import AutoDriver
from ._door import asgi_in_c, in_c, wrap_asgi_call
from ._interrupt import (
    LISTENER_GRACE,
    RESPONSE_BODY,
    RESPONSE_HEADERS,
    RequestTimeout,
    ResponseBrokenOff,
    is_trio_task,
    trio_cancel_scope,
)
from ._record import DEFAULT_TRACEBACK_SIGNAL, RequestRecord
from ._routes import Routes
from ._settings import (
    DEFAULT_CAPACITY,
    DEFAULT_INTERRUPT_GRACE,
    DEFAULT_KILL_AFTER,
    WHEEL_ENV,
    TimeoutActions,
    TimeoutSettings,
)
from ._stacks import server_logger
from ._worker import RequestTimer, say_wrapped_twice, timed_apps

__all__ = ["TIMED", "TimeoutMiddleware", "own_wheel_name"]

_log = logging.getLogger("shmwheel.timeouts")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The scope key of a timed request: its timer's handle (None if it has none).
TIMED = "shmwheel.handle"
_REQUEST_ID_HEADER = b"x-request-id"  # ASGI servers lower-case header names
_REQUEST_START_HEADER = b"x-request-start"


def own_wheel_name() -> str:
    """The wheel the workers of this server share when nothing names one:
    ``asgi-<pid>`` after the server's main process.  A worker that
    multiprocessing started (Uvicorn's and Hypercorn's workers) is named
    after its parent; a server of one process (``uvicorn app:app``) after
    itself."""
    parent = multiprocessing.parent_process()
    server = parent.pid if parent is not None and parent.pid is not None else os.getpid()
    return f"asgi-{server}"


class TimeoutMiddleware:
    """Wrap an ASGI 3 application: each HTTP request gets a timer of
    ``timeout`` seconds, cancelled once its response is complete.

    ``name``: the wheel, whose driver is run elsewhere; by default the wheel
    of the server's ``install()`` if there is one, else one of the server's
    own with a driver its workers start.  The rest says what that driver
    does on a timeout (see :class:`~shmwheel.contrib.TimeoutActions`;
    ``kill_signal`` SIGTERM: Uvicorn and Hypercorn shut a worker down
    gracefully on it) and how many requests may be in progress at once
    (``capacity``), and where it serves its metrics (``metrics``,
    ``"HOST:PORT"``); a driver run elsewhere has its own settings.

    The stages, as for the WSGI middleware: ``warn_after`` logs the
    request's stack and lets it run; with ``interrupt`` its timeout answers
    ``504 Gateway Timeout`` at once, or closes the connection if the
    response has started, tells the application its client has gone, and
    cancels its task (or raises :class:`~shmwheel.contrib.RequestTimeout`
    in it, if it blocks the event loop); ``kill`` is the last
    resort, ``interrupt_grace`` seconds after the interrupt.  ``routes``,
    ``on_timeout`` and ``x_request_start`` as for the WSGI middleware.
    """

    def __init__(
        self,
        app: ASGIApp,
        timeout: float,
        *,
        name: str | None = None,
        websocket: bool = False,
        log: bool = True,
        tracebacks: bool = True,
        traceback_signal: int | str = DEFAULT_TRACEBACK_SIGNAL,
        kill: bool = False,
        kill_signal: int | str = signal.SIGTERM,
        kill_after: float = DEFAULT_KILL_AFTER,
        capacity: int = DEFAULT_CAPACITY,
        warn_after: float | None = None,
        interrupt: bool = False,
        interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
        routes: Routes | None = None,
        on_timeout: Callable[[RequestRecord, str], object] | None = None,
        x_request_start: bool = False,
        metrics: str | None = None,
    ) -> None:
        settings = TimeoutSettings(
            timeout, warn_after=warn_after, interrupt=interrupt, routes=routes, on_timeout=on_timeout,
            x_request_start=x_request_start, traceback_signal=traceback_signal, capacity=capacity,
            actions=TimeoutActions(
                log=log, tracebacks=tracebacks, kill=kill, kill_signal=kill_signal,  # type: ignore[arg-type]
                kill_after=kill_after, interrupt_grace=interrupt_grace, metrics=metrics,
            ),
        )  # fmt: skip
        self._set_up(app, settings, name, websocket)

    @classmethod
    def of(
        cls, app: ASGIApp, settings: TimeoutSettings, *, name: str | None = None, websocket: bool = False
    ) -> TimeoutMiddleware:
        """The middleware of an adapter's ``settings``, checked when they were made."""
        middleware = cls.__new__(cls)
        middleware._set_up(app, settings, name, websocket)
        return middleware

    def _set_up(self, app: ASGIApp, settings: TimeoutSettings, name: str | None, websocket: bool) -> None:
        if not callable(app):
            raise TypeError(f"app must be an ASGI application, not {type(app).__name__}")
        check_flag(websocket, "websocket")
        if name is not None:
            segment_name(name)
        self.app = app
        self.settings = settings
        self.name = name
        self.websocket = websocket
        self.timeout = settings.timeout
        self.actions = settings.actions
        self.warn_after = settings.warn_after
        self.interrupt = settings.interrupt
        self.routes = settings.routes
        self.on_timeout = settings.on_timeout
        self.x_request_start = settings.x_request_start
        self.traceback_signal = settings.signal
        self.capacity = settings.capacity
        # An HTTP request that needs no Python of its own (no interrupt,
        # X-Request-Start or route) takes the way in C: shmwheel._fast.ASGI.
        self._in_c: Callable[[Scope, Receive, Send], Awaitable[None] | None] | None = asgi_in_c(self, in_c(settings))
        self._lock = threading.Lock()
        self._timer: RequestTimer | None = None
        self._timer_pid = 0
        self._said_inside = 0  # the process that has said an outer middleware times this one's requests
        timed_apps.add(self)

    @property
    def timer(self) -> RequestTimer:
        """This process's request timer, on the wheel it resolves to here."""
        timer, pid = self._timer, _process.pid
        if timer is not None and self._timer_pid == pid:
            return timer
        with self._lock:
            if self._timer is None or self._timer_pid != pid:  # first use in this process
                self._timer = self._resolve()
                self._timer_pid = pid
            return self._timer

    def _timer_on(self, name: str, auto: AutoDriver | None = None) -> RequestTimer:
        return RequestTimer.of(name, self.settings, auto)

    def _resolve(self) -> RequestTimer:
        name = self.name or os.environ.get(WHEEL_ENV)
        if name:
            try:
                return self._timer_on(name)
            except ValueError as exc:  # a bad name in the environment: never a failed request
                _log.error("shmwheel: %s=%r: %s; using a wheel of this server's own", WHEEL_ENV, name, exc)
        name = own_wheel_name()
        if self.actions.kill and multiprocessing.parent_process() is None:
            server_logger().warning(
                "shmwheel: this server runs in one process, which nothing restarts: with kill=True, a timed-out "
                "request ends the whole server; run it with --workers N, or under a process manager that restarts it"
            )
        auto = AutoDriver(name, self.actions, capacity=self.capacity, after_server_log=_hypercorn_worker())
        if self.actions.kill and _hypercorn_worker():
            _exit_cleanly_on(self.actions.kill_signal)
        return self._timer_on(name, auto)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # With shmwheel._fast, a C Coroutine stands for this method (see
        # below the class) and comes here only for what it does not take.
        await self._call(scope, receive, send)

    def _call(self, scope: Scope, receive: Receive, send: Send, declined: bool = False) -> Awaitable[None]:
        """Any scope: one to pass through, a websocket, an HTTP request to
        end at its timeout or to time from X-Request-Start: what to await
        for it (no coroutine of its own, the application's for a scope
        passed through).  ``declined``: the C path (shmwheel._fast's ASGI)
        tried the request and gave it back, so its timer takes the waiting
        path (RequestTimer.start_declined)."""
        kind = scope["type"]
        ours = kind == "http" or (kind == "websocket" and self.websocket)
        if TIMED in scope or not ours:
            if kind == "lifespan":
                self.timer.prepare()  # the wheel, its driver and the traceback signal before the first request
            elif ours and self._said_inside != _process.pid:
                self._say_inside()
            return self.app(scope, receive, send)
        timer = self.timer
        task = _task()
        queued_since = _header(scope, _REQUEST_START_HEADER) if self.x_request_start else None
        method, path, request_id = scope.get("method", "WEBSOCKET"), _path(scope), _header(scope, _REQUEST_ID_HEADER)
        if declined:
            handle = timer.start_declined(method, path, request_id, task)
        else:
            handle = timer.start(method, path, request_id, task, queued_since)
        return _Exchange(timer, handle, task, kind, receive, send).run(self.app, {**scope, TIMED: handle})

    def _say_inside(self) -> None:
        """Say, once a process, that another TimeoutMiddleware outside this
        one times its requests already, so that this one's settings do
        nothing."""
        self._said_inside = _process.pid
        say_wrapped_twice("shmwheel.contrib.asgi.TimeoutMiddleware", self.app, self.settings, WHEEL_ENV)


# The C way: the call of an instance goes to shmwheel._fast.Coroutine,
# which starts the timer, calls the application with the timed scope and a
# send that ends the timer after the last message, and gives back its call
# in an awaitable that ends the timer however the call ends; no coroutine
# of the middleware's own.  What it does not take (another scope, one timed
# already, a process whose RequestTimer is not made yet or was made before
# a fork, a middleware without _in_c) goes to the method above.  Servers
# still see a coroutine function: the C object has the method's __code__.
TimeoutMiddleware.__call__ = wrap_asgi_call(TimeoutMiddleware.__call__)  # type: ignore[method-assign,assignment]


class _Exchange:
    """One timed request (or websocket) between the server and the
    application: the send the application is given, which ends the timer
    after the last message, and with interrupt the answer at the timeout.

    With interrupt, the request is in ``timer.in_app`` while the
    application's code runs, not while the server sends what it gave: an
    interrupt then would cut its response short.  ``http.response.start``
    is held back until the first message of the body, so that until then a
    504 can take its place whole: the server has seen nothing of the
    application's answer.  Under trio the request's code runs in a cancel
    scope, which the interrupt cancels; the server's own sends are shielded
    from it.

    Under asyncio the request is ended at its interrupt by :meth:`end`, in
    the loop's thread: the 504 goes out at once, whatever the application
    then takes to unwind (a thread it waits for, as Django does); every
    receive() from then on says the client is gone, the end an application
    listening for it makes itself (Django's view is cancelled so); and its
    task is cancelled, at once, or where another task of the application's
    was listening, if it has not stirred LISTENER_GRACE later.  The timer runs
    until the application's call returns, so that ``kill`` still reaches a
    request that never does."""

    __slots__ = (
        "answering", "body_read", "cancel", "finished", "gated", "gone", "handle", "held", "in_app", "kind", "mark",
        "receive", "replaced", "send", "server_receive", "started", "task", "timer", "waiting",
    )  # fmt: skip

    def __init__(self, timer: RequestTimer, handle: int | None, task: Any, kind: str, receive: Receive, send: Send):
        self.timer, self.handle, self.task, self.kind = timer, handle, task, kind
        self.finished = self.started = self.replaced = False
        self.held: Message | None = None  # http.response.start, until the first message of the body
        self.answering: Awaitable[None] | None = None  # the 504 that end() sent
        self.gated = gated = timer.interrupt and handle is not None
        self.in_app = timer.in_app
        self.mark = -1 if handle is None else handle
        self.cancel = trio_cancel_scope(task) if gated and is_trio_task(task) else None
        self.send = send if self.cancel is None else _shielded(send, lambda: timer.interrupted(handle))
        self.receive: Receive = receive
        if gated and kind == "http" and self.cancel is None and isinstance(task, Future):
            self.server_receive = receive
            self.body_read = self.gone = False
            self.waiting: dict[Future[None], Any] | None = None  # receive()s woken at the interrupt: their tasks
            self.receive = self.receive_timed
            timer.enders[handle] = self  # type: ignore[index]

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.timer.finish(self.handle)

    async def _through_gate(self, message: Message) -> None:
        self.in_app.discard(self.mark)  # nor is end() called while the server sends (_cancel_in_loop's still())
        await self.send(message)
        if not self.finished:
            self.in_app.add(self.mark)

    async def send_timed(self, message: Message) -> None:
        """The send the application is given."""
        timer, handle = self.timer, self.handle
        if self.replaced:
            return  # the application's answer after its interrupt, which a 504 replaced
        if self.started and timer.interrupted(handle):
            # Its answer had begun: nothing may complete it now (the end of
            # a stream it cut short when told its client was gone, say),
            # so that the client sees the answer broken off, and the server
            # closes the connection.
            raise RequestTimeout()
        if message["type"] == "http.response.start":
            if timer.interrupted(handle):  # it answers after its interrupt (a framework's 500, say)
                self.replaced = True
                timer.answered_timeout(handle)
                await _send_504(self.send)
                self.finish()
                return
            if self.gated:
                self.held = message
                return
            self.started = True
        if not self.gated:
            await self.send(message)
        else:
            if self.held is not None:
                if timer.interrupted(handle):
                    raise RequestTimeout()  # nothing has gone out: answered 504 below
                start, self.held = self.held, None
                self.started = True
                await self._through_gate(start)
            await self._through_gate(message)
            if timer.interrupted(handle) and not _completes(message):
                raise RequestTimeout()  # it came while the server sent: the application's code ends here
        if _completes(message):
            self.finish()

    async def receive_timed(self) -> Message:
        """The receive() of a request with interrupt under asyncio, which
        says the client is gone once the request is interrupted: at once for
        a receive() after that, and for one waiting then (a task of the
        application's that listens for the client leaving), in place of the
        message it waited for.  Until the request body is whole, it is the
        server's own: a task reading the body is the request's, cancelled."""
        if self.gone:
            return dict(_DISCONNECT)
        if not self.body_read:
            message = await self.server_receive()
            if message.get("type") != "http.request" or not message.get("more_body", False):
                self.body_read = True
            return message
        theirs = ensure_future(self.server_receive())
        woken: Future[None] = get_running_loop().create_future()
        waiting = self.waiting = self.waiting or {}
        waiting[woken] = current_task()
        theirs.add_done_callback(lambda _: _wake(woken))
        try:
            await woken
        except BaseException:
            theirs.cancel()
            raise
        finally:
            del waiting[woken]
        if theirs.done():
            return theirs.result()
        theirs.cancel()
        return dict(_DISCONNECT)

    def end(self) -> bool:
        """In the loop's thread, at the interrupt (_interrupt.interrupt):
        every receive() says the client is gone from now on, and it is
        answered 504 if nothing of the response has gone out; whether the request's task is still to be cancelled.
        Not if a task other than the request's was waiting for the client in
        receive(): see _cancel_unless_woken."""
        self.gone, listened = True, False
        for woken, waiting in (self.waiting or {}).items():
            listened = listened or waiting is not self.task
            _wake(woken)
        if not (self.started or self.replaced):
            self.replaced = True
            self.timer.answered_timeout(self.handle)
            self.answering = ensure_future(_send_504(self.send))
        if listened:
            # A task of the application's heard it: the request's task is
            # cancelled only if it is still waiting on what it waited on
            # then, LISTENER_GRACE later: the application did not act on it.
            waiting = getattr(self.task, "_fut_waiter", None)
            get_running_loop().call_later(LISTENER_GRACE, self._cancel_unless_woken, waiting)
        return not listened

    def _cancel_unless_woken(self, waiting: Any) -> None:
        task = self.task
        if self.finished or self.mark not in self.in_app or task.done():
            return
        if getattr(task, "_fut_waiter", None) is waiting and not (waiting is not None and waiting.done()):
            task.cancel("shmwheel: the request ran past its timeout")

    async def run(self, app: ASGIApp, scope: Scope) -> None:
        timer, handle, gated, cancel = self.timer, self.handle, self.gated, self.cancel
        try:
            if gated:
                timer.gated = True
                self.in_app.add(self.mark)
            if cancel is None:
                await app(scope, self.receive, self.send_timed)
            else:
                with cancel as cancelled:
                    await app(scope, self.receive, self.send_timed)
                if cancelled.cancelled_caught:
                    raise RequestTimeout()  # trio's Cancelled, which ends in the scope it was raised for
            if gated:
                self.in_app.discard(self.mark)  # its code is done: what follows is the middleware's
            if self.replaced:  # a 504 went out in place of its answer
                if self.answering is not None:
                    await self.answering
            elif not self.finished and timer.interrupted(handle):
                # It returned after its interrupt without a whole answer (it
                # heard the client was gone): the 504, or the connection closed.
                raise RequestTimeout()
            elif self.held is not None:  # it sent no body: the server says what it says of that
                start, self.held = self.held, None
                self.started = True
                await self.send(start)
        except BaseException as exc:
            # replaced: the 504 has gone out in place of the framework's
            # answer (Starlette's 500, which re-raises the RequestTimeout
            # after it), and finish() may have forgotten the interrupt.
            if not (self.replaced or timer.interrupted(handle)):
                raise
            task = self.task
            if isinstance(exc, CancelledError) and hasattr(task, "uncancel"):
                task.uncancel()  # ours, which ends here: its task is not being cancelled any more
            if self.answering is not None:
                await self.answering
            if self.replaced:
                return
            if self.started or self.kind != "http":
                raise ResponseBrokenOff() from None  # the server breaks the response off
            self.replaced = True
            timer.answered_timeout(handle)
            await _send_504(self.send)
        finally:
            if gated:
                self.in_app.discard(self.mark)
                timer.enders.pop(handle, None)  # type: ignore[arg-type]
            self.finish()


async def _send_504(send: Send) -> None:
    headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in RESPONSE_HEADERS]
    await send({"type": "http.response.start", "status": 504, "headers": headers})
    await send({"type": "http.response.body", "body": RESPONSE_BODY, "more_body": False})


_DISCONNECT: Message = {"type": "http.disconnect"}


def _wake(woken: Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)


def _shielded(send: Send, interrupted: Callable[[], bool]) -> Send:
    """``send``, shielded from trio's cancellation once the request is
    ``interrupted()``: the interrupt ends the application's code, never a
    message the server is sending (the 504).  Until then the server's own
    cancellation (a client gone, a shutdown) reaches its sends as before."""
    trio = sys.modules["trio"]

    async def shielded(message: Message) -> None:
        with trio.CancelScope(shield=interrupted()):
            await send(message)

    return shielded


def _task() -> Any:
    """What runs this request: its asyncio task, or under trio (Hypercorn's
    trio worker), where asyncio has no loop, its trio task; else None."""
    try:
        return current_task()
    except RuntimeError:  # no asyncio loop runs in this thread
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        with contextlib.suppress(RuntimeError, AttributeError):
            return trio.lowlevel.current_task()
    return None


def _completes(message: Message) -> bool:
    """Whether ``message`` is the last of a response (or closes a websocket)."""
    kind = message["type"]
    if kind in ("http.response.body", "http.response.zerocopysend"):
        return not message.get("more_body", False)
    return kind in ("http.response.pathsend", "websocket.close")


def _path(scope: Scope) -> str:
    return str(scope.get("path") or "/")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return bytes(value).decode("latin-1")
    return None


def _hypercorn_worker() -> bool:
    """Whether this process is one of the workers of a Hypercorn with
    ``--workers``: multiprocessing started it, and Hypercorn's worker runs."""
    return multiprocessing.parent_process() is not None and any(
        m in sys.modules for m in ("hypercorn.asyncio.run", "hypercorn.trio.run")
    )


def _exit_cleanly_on(signum: int) -> None:
    """Make ``signum`` end this process with exit status 0.

    Hypercorn starts a new worker in place of one that exits with status 0,
    and shuts the whole server down when one ends otherwise (a signal
    included); its workers handle no signal of their own.  So the driver's
    kill_signal, which would end the worker by its default action, ends it
    with status 0 instead, from the main thread as soon as it runs Python;
    a worker that does not (stuck in C) gets the SIGKILL, and Hypercorn
    stops.
    """

    def leave(signum: int, frame: object) -> None:
        with contextlib.suppress(Exception):
            name = signal.Signals(signum).name
            print(f"shmwheel: worker {os.getpid()} exits on {name}", file=sys.stderr, flush=True)
        os._exit(0)

    try:
        signal.signal(signum, leave)
    except ValueError:  # not the main thread: left at its default action
        _log.warning("shmwheel: %s could not be set up to end this Hypercorn worker cleanly", signum)
