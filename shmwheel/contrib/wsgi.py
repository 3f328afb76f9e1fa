"""A WSGI middleware that gives every request a timeout, under any server.

    from shmwheel.contrib.wsgi import TimeoutMiddleware
    application = TimeoutMiddleware(application, "myapp", timeout=30.0)

The timer runs from the call of the application until the server closes
the response, so a response body that streams slowly counts too.  A file
handed to the server's ``wsgi.file_wrapper`` stays one, which the server
sends itself (with sendfile), its timer ended when the file is closed.  The
middleware only adds and cancels timers; the wheel and its driver come from
elsewhere: :class:`shmwheel.contrib.DriverSupervisor` in the
server's master process, or ``shmwheel timeouts NAME
--create`` run beside the server (by systemd, say).  The Gunicorn and
uWSGI integrations set both up for you.

A request that an outer TimeoutMiddleware has timed already carries
``"shmwheel.handle"`` in its environ and is passed through, so wrapping an
application twice times it once, by the outer one; the inner one says so,
once a process, at its first such request, since its settings then do
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .. import _process
from .._checks import check_flag
from ._body import Environ, file_wrapper_of, is_timed_file, timed_file, timing_file_wrapper
from ._door import closing_body, in_c, wsgi_in_c
from ._interrupt import RESPONSE_BODY, RESPONSE_HEADERS, RESPONSE_STATUS, RequestTimeout
from ._record import DEFAULT_TRACEBACK_SIGNAL, RequestRecord
from ._routes import Routes
from ._settings import WHEEL_ENV, TimeoutActions, TimeoutSettings
from ._worker import RequestTimer, say_wrapped_twice, timed_apps, timer_here

__all__ = ["InterruptibleApp", "TimeoutMiddleware"]

StartResponse = Callable[..., Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]
TIMED = "shmwheel.handle"  #: the environ's key for the request's handle (None: no timer), once a middleware timed it


class TimeoutMiddleware:
    """Wrap a WSGI application: each request gets a timer of ``timeout``
    seconds in wheel ``name``, cancelled when its response is closed.

    ``warn_after``: seconds after which the driver has the worker log the
    request's stack, and lets it run.  ``interrupt``: at its timeout the
    request is ended where it runs (:class:`~shmwheel.contrib.RequestTimeout`
    in its thread or greenlet) and answered ``504 Gateway Timeout``, or its
    connection closed if its response has started.  ``routes``: timeouts by
    method and path prefix, or a function of (method, path).
    ``on_timeout(request, stack)`` is called in the worker before the
    interrupt.  ``x_request_start``: count the request's time from the
    proxy's ``X-Request-Start`` header, so that time spent queued counts.

    The request id in the timeout's log line is the client's
    ``X-Request-Id`` header if it has a sane one, else the worker's pid and
    the request's start.  The timer's handle is in the environ as ``shmwheel.handle``
    (None if the request runs without one).
    """

    def __init__(
        self,
        app: WSGIApp,
        name: str,
        timeout: float,
        *,
        traceback_signal: int | None = DEFAULT_TRACEBACK_SIGNAL,
        warn_after: float | None = None,
        interrupt: bool = False,
        routes: Routes | None = None,
        on_timeout: Callable[[RequestRecord, str], object] | None = None,
        x_request_start: bool = False,
        stacks: bool = True,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be a WSGI application, not {type(app).__name__}")
        check_flag(stacks, "stacks")
        settings = TimeoutSettings(
            timeout, warn_after=warn_after, interrupt=interrupt, routes=routes, on_timeout=on_timeout,
            x_request_start=x_request_start, traceback_signal=traceback_signal,
            actions=TimeoutActions(tracebacks=stacks),
        )  # fmt: skip
        self._set_up(app, name, settings)

    @classmethod
    def of(cls, app: WSGIApp, name: str, settings: TimeoutSettings) -> TimeoutMiddleware:
        """The middleware of an adapter's ``settings``, checked when they were made."""
        if not callable(app):
            raise TypeError(f"app must be a WSGI application, not {type(app).__name__}")
        middleware = cls.__new__(cls)
        middleware._set_up(app, name, settings)
        return middleware

    def _set_up(self, app: WSGIApp, name: str, settings: TimeoutSettings) -> None:
        self.app = app
        # Listening on its signal even with stacks=False, as it always has: an
        # operator's kill -SIGNAL never kills a worker with the default action.
        self.timer = RequestTimer.of(name, settings, always_listen=True)
        self.x_request_start = settings.x_request_start
        # Whether every request takes the whole call in C when it can
        # (shmwheel._fast's Clerk.wsgi): not with what needs Python per request.
        self._plain = in_c(settings)
        #: What times this process's requests outside the middleware (set by
        #: :meth:`stand_aside`), which then passes them through untimed.
        self.timed_outside: str | None = None
        self.settings = settings
        self._said_inside = 0  # the process that has said an outer middleware times this one's requests
        timed_apps.add(self)

    def stand_aside(self, by: str) -> None:
        """Pass every request of this process through untimed, since ``by``
        (Gunicorn's ``install()``, whose hooks time every request of its
        workers) times them outside the middleware already: one timer a
        request, as an ASGI application wrapped twice has, by the outer one.
        Two would each act at their own timeout, and ``extend()`` and
        ``no_timeout()``, which reach the innermost request only, would
        leave the other to end or kill a request its code had exempted.
        The timer's C path is let go, so that ``direct()``'s C callable,
        which keeps the one of its last request, calls the middleware."""
        self.timed_outside = by
        with self.timer._lock:
            self.timer._drop_fast()

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        if self.timed_outside is not None:
            return self.app(environ, start_response)
        fast = self.timer._fast
        if fast is not None and self._plain:
            body: Iterable[bytes] | None = fast.wsgi(self.app, environ, start_response)
            if body is not NotImplemented:
                return self._serve(environ, start_response, True) if body is None else body
        return self._serve(environ, start_response)

    def _serve(self, environ: Environ, start_response: StartResponse, declined: bool = False) -> Iterable[bytes]:
        """The request on the middleware's own path.  ``declined``: the C
        path (shmwheel._fast's Clerk.wsgi) tried it and gave it back, so its
        timer takes the waiting path (RequestTimer.start_declined); else the
        C path could not read it, or does not serve this middleware."""
        # Timed by a middleware outside this one (the C path gives these
        # back): its request in progress here, or none it times.  Not a
        # handle left in an environ a server reuses (which PEP 3333 does not
        # allow): that request has ended.
        if TIMED in environ and (environ[TIMED] is None or timer_here() is not None):
            if self._said_inside != _process.pid:
                self._said_inside = _process.pid
                say_wrapped_twice("shmwheel.contrib.wsgi.TimeoutMiddleware", self.app, self.settings, WHEEL_ENV)
            return self.app(environ, start_response)
        timer = self.timer
        method, path, request_id = environ.get("REQUEST_METHOD", "-"), _path(environ), environ.get("HTTP_X_REQUEST_ID")
        if declined:
            handle = timer.start_declined(method, path, request_id)
        else:
            queued_since = environ.get("HTTP_X_REQUEST_START") if self.x_request_start else None
            handle = timer.start(method, path, request_id, queued_since=queued_since)
        environ[TIMED] = handle
        try:
            if handle is not None:
                timing_file_wrapper(environ, timer)
            if timer.interrupt and handle is not None:
                body = _call_interruptible(self.app, environ, start_response, timer, handle)
            else:
                body = self.app(environ, start_response)
        except BaseException:
            timer.finish(handle)
            raise
        if handle is None or is_timed_file(body, timer, handle):
            return body  # nothing to end, or a file the server sends itself that ends the timer
        wrapper = file_wrapper_of(environ, body)
        if wrapper is not None and (timed := timed_file(body, wrapper, timer, handle)) is not None:
            return timed
        return closing_body(body, timer, handle)

    def direct(self) -> WSGIApp:
        """The middleware as a server best calls it: a C callable that
        reaches the timer with no Python frame of the middleware's
        (shmwheel._fast), which uWSGI's ``request_timeouts`` gives it; the
        middleware itself where that cannot serve (interrupt, routes,
        X-Request-Start)."""
        direct = wsgi_in_c(self, self._plain)
        return self if direct is None else direct


class InterruptibleApp:
    """A WSGI application whose requests a timer interrupts answered 504:
    what Gunicorn's ``install(interrupt=True)`` wraps each worker's
    application in, the timers coming from its request hooks."""

    def __init__(self, app: WSGIApp, timer: RequestTimer) -> None:
        self.app = app
        self.timer = timer

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        handle = self.timer.current_handle()
        if handle is None:
            return self.app(environ, start_response)
        return _call_interruptible(self.app, environ, start_response, self.timer, handle)


def _call_interruptible(
    app: WSGIApp, environ: Environ, start_response: StartResponse, timer: RequestTimer, handle: int
) -> Iterable[bytes]:
    """The application's answer, or 504 once the timer has interrupted the
    request.  The request is in ``timer.in_app`` while the application's
    code runs, and only there is it interrupted.

    The application's ``start_response`` is held back until its first
    chunk (:class:`_HeldResponse`), so that until then the 504 is the one
    and only ``start_response`` the server sees: one status line, one
    ``Content-Length``, whatever the application had said, on every server
    (uWSGI's takes no ``exc_info`` before its headers have gone out).  Once
    a chunk has gone to the server, an interrupt can only close the
    connection: the server sees the RequestTimeout."""
    timer.gated = True
    response = _HeldResponse(start_response)
    in_app = timer.in_app
    try:
        in_app.add(handle)
        if timer.interrupted(handle):  # while the server had it, before the application
            raise RequestTimeout()
        body = app(environ, response.start)
        in_app.discard(handle)  # in the try: an interrupt that lands here is answered too
    except RequestTimeout:
        in_app.discard(handle)
        if not timer.interrupted(handle) or not response.timed_out():
            raise
        timer.answered_timeout(handle)
        return [RESPONSE_BODY]
    except BaseException:
        in_app.discard(handle)
        raise
    if file_wrapper_of(environ, body) is not None or is_timed_file(body, timer, handle):
        # A file the server sends itself (sendfile): no code of the application's runs from here.
        if timer.interrupted(handle) and response.timed_out():
            _close(body)
            timer.answered_timeout(handle)
            return [RESPONSE_BODY]
        response.send()
        return body
    return _InterruptibleBody(body, response, timer, handle)


class _HeldResponse:
    """An interruptible request's ``start_response``, held back from the
    server until the body's first chunk (PEP 3333 lets a middleware delay
    it so), or until the application calls ``write()``."""

    __slots__ = ("_start_response", "_status", "_headers", "_write", "sent")

    def __init__(self, start_response: StartResponse) -> None:
        self._start_response = start_response
        self._status: str | None = None
        self._headers: list[tuple[str, str]] = []
        self._write: Callable[[bytes], object] | None = None
        self.sent = False  # whether the server has had a start_response

    def start(self, status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        if exc_info is not None:
            try:
                if self.sent:  # too late to change: PEP 3333 has it raised
                    raise exc_info[1].with_traceback(exc_info[2])
            finally:
                exc_info = None
        elif self._status is not None:
            raise AssertionError("start_response called a second time without exc_info")
        self._status, self._headers = status, headers
        return self.write

    def send(self) -> None:
        """The application's status and headers to the server, once."""
        if not self.sent and self._status is not None:
            self.sent = True
            self._write = self._start_response(self._status, self._headers)

    def write(self, data: bytes) -> None:
        """PEP 3333's ``write()``, for applications that still use it."""
        self.send()
        if self._write is None:
            raise AssertionError("write() before start_response")
        self._write(data)

    def timed_out(self) -> bool:
        """The 504 to the server in place of the application's answer;
        False if the server has had the application's already."""
        if self.sent:
            return False
        self.sent = True
        self._start_response(RESPONSE_STATUS, list(RESPONSE_HEADERS))
        return True


def _close(body: object) -> None:
    close = getattr(body, "close", None)
    if close is not None:
        close()


class _InterruptibleBody:
    """An interruptible request's body: the application's chunks, with its
    held ``start_response`` sent before the first; a RequestTimeout while
    the application makes a chunk (in ``timer.in_app``), or an interrupt
    that came while the server wrote the last one, answered 504 if nothing
    has gone to the server yet, else raised, and the server closes the
    connection.  A list or tuple runs no code of the application's: an
    interrupt that comes once the application has returned one ends
    nothing, and the client gets the whole response."""

    def __init__(self, body: Iterable[bytes], response: _HeldResponse, timer: RequestTimer, handle: int) -> None:
        self._body = body
        self._response = response
        self._timer = timer
        self._handle = handle

    def __iter__(self) -> Iterator[bytes]:
        timer, handle, response, in_app = self._timer, self._handle, self._response, self._timer.in_app
        body = self._body
        code = not isinstance(body, (list, tuple))  # whether a chunk runs the application's code
        chunks = iter(body)
        while True:
            try:
                in_app.add(handle)
                if code and timer.interrupted(handle):
                    raise RequestTimeout()
                chunk = next(chunks)
                in_app.discard(handle)
            except StopIteration:
                in_app.discard(handle)
                break
            except RequestTimeout:
                in_app.discard(handle)
                if not timer.interrupted(handle) or not response.timed_out():
                    raise  # the server has the application's answer: it closes the connection
                timer.answered_timeout(handle)
                yield RESPONSE_BODY
                return
            except BaseException:
                in_app.discard(handle)
                raise
            if not response.sent:
                if not chunk:
                    continue  # nothing to send yet: the 504 stays possible
                if code and timer.interrupted(handle) and response.timed_out():
                    timer.answered_timeout(handle)
                    yield RESPONSE_BODY
                    return
                response.send()
            yield chunk
        response.send()  # an empty body: the application's headers all the same

    def close(self) -> None:
        _close(self._body)


def _path(environ: Environ) -> str:
    """The request's path as the client sent it (PEP 3333 carries it as latin-1)."""
    raw = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
    if raw.isascii():  # the same either way, without two copies a request
        return str(raw)
    try:
        return str(raw.encode("latin-1").decode("utf-8"))
    except UnicodeError:
        return str(raw)
