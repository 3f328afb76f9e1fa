"""A WSGI middleware that gives every request a timeout, under any server.

    from shmwheel.contrib.wsgi import TimeoutMiddleware
    application = TimeoutMiddleware(application, "myapp", timeout=30.0)

The timer runs from the call of the application until the server closes
the response, so a response body that streams slowly counts too.  A file
handed to the server's ``wsgi.file_wrapper`` stays one, which the server
sends itself (with sendfile), its timer ended when the file is closed.  The
middleware only adds and cancels timers; the wheel and its driver come from
elsewhere: :class:`shmwheel.contrib.timeouts.DriverSupervisor` in the
server's master process, or ``python -m shmwheel.contrib.timeouts NAME
--create`` run beside the server (by systemd, say).  The Gunicorn and
uWSGI integrations set both up for you.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .._checks import check_flag
from .._wheel import _fast_ext
from ._interrupt import RESPONSE_BODY, RESPONSE_HEADERS, RESPONSE_STATUS, RequestTimeout
from ._record import DEFAULT_TRACEBACK_SIGNAL, RequestRecord
from ._routes import Routes
from ._worker import RequestTimer, current_handle, timed_apps

__all__ = ["InterruptibleApp", "TimeoutMiddleware"]

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


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
    the request's start.  The timer's handle is in the environ as ``shmwheel.timer``
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
        check_flag(x_request_start, "x_request_start")
        self.app = app
        self.timer = RequestTimer(
            name, timeout, traceback_signal=traceback_signal, warn_after=warn_after, interrupt=interrupt,
            routes=routes, on_timeout=on_timeout, stacks=stacks,
        )  # fmt: skip
        self.x_request_start = x_request_start
        # Whether every request takes the whole call in C when it can
        # (shmwheel._fast's Timer.wsgi): not with what needs Python per request.
        self._plain = not (interrupt or routes is not None or x_request_start)
        timed_apps.add(self)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        timer = self.timer
        fast = timer._fast
        if fast is not None and self._plain:
            body: Iterable[bytes] = fast.wsgi(self.app, environ, start_response)
            if body is not NotImplemented:
                return body
        handle = timer.start(
            environ.get("REQUEST_METHOD", "-"),
            _path(environ),
            environ.get("HTTP_X_REQUEST_ID"),
            request_start=environ.get("HTTP_X_REQUEST_START") if self.x_request_start else None,
        )
        environ["shmwheel.timer"] = handle
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
        if handle is None or _is_timed_file(body, timer, handle):
            return body  # nothing to end, or a file the server sends itself that ends the timer
        wrapper = _file_wrapper_of(environ, body)
        if wrapper is not None and (timed := timed_file(body, wrapper, timer, handle)) is not None:
            return timed
        return _closing_body(body, timer, handle)

    def direct(self) -> WSGIApp:
        """The middleware as a server best calls it: a C callable that
        reaches the timer with no Python frame of the middleware's
        (shmwheel._fast), which uWSGI's ``request_timeouts`` gives it; the
        middleware itself where that cannot serve (interrupt, routes,
        X-Request-Start, a build without the extension)."""
        return self if _fast_ext is None or not self._plain else _fast_ext.WSGI(self)


class InterruptibleApp:
    """A WSGI application whose requests a timer interrupts answered 504:
    what Gunicorn's ``install(interrupt=True)`` wraps each worker's
    application in, the timers coming from its request hooks."""

    def __init__(self, app: WSGIApp, timer: RequestTimer) -> None:
        self.app = app
        self.timer = timer

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        handle = current_handle(self.timer)
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
        return [RESPONSE_BODY]
    except BaseException:
        in_app.discard(handle)
        raise
    if _file_wrapper_of(environ, body) is not None or _is_timed_file(body, timer, handle):
        # A file the server sends itself (sendfile): no code of the application's runs from here.
        if timer.interrupted(handle) and response.timed_out():
            _close(body)
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
                yield RESPONSE_BODY
                return
            except BaseException:
                in_app.discard(handle)
                raise
            if not response.sent:
                if not chunk:
                    continue  # nothing to send yet: the 504 stays possible
                if code and timer.interrupted(handle) and response.timed_out():
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


class _ClosingBody:
    """The application's response body, with the timer cancelled on close()
    (shmwheel._fast's Body where that is built).

    The server calls close() once it has sent the body or given up on it
    (PEP 3333), whatever happened; the body's own close() runs first.
    """

    __slots__ = ("_body", "_timer", "_handle")

    def __init__(self, body: Iterable[bytes], timer: RequestTimer, handle: int | None) -> None:
        self._body = body
        self._timer = timer
        self._handle = handle

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._body)

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            handle, self._handle = self._handle, None
            self._timer.finish(handle)


class _TimedFile(_ClosingBody):
    """A file that the server sends itself: the file's own fileno(),
    read(), seek() and mode, and a close() that ends the request's timer
    after the file's own close().  One made for the application, by a
    :class:`_TimingFileWrapper`, ends nothing until the middleware has it
    back as the body (``_for`` is its request's handle until then): closed
    by the application before, it would leave the rest of the request
    without a timer."""

    __slots__ = ("_for",)

    def __init__(self, body: Any, timer: RequestTimer, handle: int | None, for_handle: int | None = None) -> None:
        super().__init__(body, timer, handle)
        self._for = for_handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._body, name)


def _file_wrapper_of(environ: Environ, body: object) -> type | None:
    """The server's ``wsgi.file_wrapper`` if ``body`` is one it made, else None."""
    wrapper = environ.get("wsgi.file_wrapper")
    return wrapper if isinstance(wrapper, type) and type(body) is wrapper else None


class _TimingFileWrapper:
    """A server's ``wsgi.file_wrapper`` that is a function, uWSGI's, as the
    middleware hands it to the application: the file goes to the server in
    a :class:`_TimedFile`.  uWSGI sends the file itself (sendfile) only if
    the body is the very object its wrapper was last given, so the file
    cannot be made a timed one afterwards, as a wrapper that is a class is
    made again (:func:`timed_file`).  A request without a timer hands the
    server its file as it is."""

    __slots__ = ("wrapper", "timer")

    #: The type of what it hands the server; shmwheel._fast's Timer.wsgi reads it.
    file_type = _TimedFile

    def __init__(self, wrapper: Callable[..., Any], timer: RequestTimer) -> None:
        self.wrapper = wrapper
        self.timer = timer

    def __call__(self, filelike: Any, *args: Any, **kwargs: Any) -> Any:
        handle = current_handle(self.timer)
        if handle is not None:
            filelike = _TimedFile(filelike, self.timer, None, handle)
        return self.wrapper(filelike, *args, **kwargs)


def timing_file_wrapper(environ: Environ, timer: RequestTimer) -> None:
    """Put in ``environ`` the :class:`_TimingFileWrapper` of the server's
    ``wsgi.file_wrapper`` if that is a function (a class is left, its
    bodies made again afterwards by :func:`timed_file`)."""
    wrapper = environ.get("wsgi.file_wrapper")
    if wrapper is not None:
        timing = timer._timing_file_wrapper(wrapper)
        if timing is not None:
            environ["wsgi.file_wrapper"] = timing


def file_wrapper_for(wrapper: object, timer: RequestTimer) -> _TimingFileWrapper | None:
    """The :class:`_TimingFileWrapper` that stands for ``wrapper``, or None
    where the server's wrapper is left as it is."""
    if isinstance(wrapper, _TimingFileWrapper):  # the environ has been through this middleware
        return wrapper if wrapper.timer is timer else None
    if isinstance(wrapper, type) or not callable(wrapper):
        return None
    return _TimingFileWrapper(wrapper, timer)


def _is_timed_file(body: object, timer: RequestTimer, handle: int) -> bool:
    """Whether ``body`` is the file a :class:`_TimingFileWrapper` handed the
    server for this request: then the server sends it itself, and from here
    its close() ends the timer."""
    if type(body) is not _TimedFile or body._timer is not timer or body._for != handle:
        return False
    body._handle = handle
    return True


def timed_file(body: Any, wrapper: type, timer: RequestTimer, handle: int | None) -> Iterable[bytes] | None:
    """``body``, made by the server's ``wsgi.file_wrapper`` (PEP 3333's way
    for a server to send a file itself, with sendfile), made again around
    the same file in a :class:`_TimedFile`: the server still sends it
    itself, and its close() ends the timer.  None where the wrapper keeps
    its file other than as Gunicorn's and wsgiref's do (``filelike``,
    ``blksize``), or will not make another: the body then goes the way of
    any other, iterated by the server."""
    filelike = getattr(body, "filelike", None)
    blksize = getattr(body, "blksize", None)
    if filelike is None or type(blksize) is not int:
        return None
    try:
        timed: Iterable[bytes] = wrapper(_TimedFile(filelike, timer, handle), blksize)
    except Exception:  # noqa: BLE001 - the server's; its own body serves as well, iterated
        return None
    return timed


#: The body the middleware gives back: shmwheel._fast's Body, the same in C
#: (its close() ends the timer without a Python frame), where it is built.
_closing_body: Callable[[Iterable[bytes], RequestTimer, int | None], Iterable[bytes]] = (
    _ClosingBody if _fast_ext is None else _fast_ext.Body
)
