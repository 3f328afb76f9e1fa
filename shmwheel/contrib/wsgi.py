"""A WSGI middleware that gives every request a timeout, under any server.

    from shmwheel.contrib.wsgi import TimeoutMiddleware
    application = TimeoutMiddleware(application, "myapp", timeout=30.0)

The timer runs from the call of the application until the server closes
the response, so a response body that streams slowly counts too.  The
middleware only adds and cancels timers; the wheel and its driver come from
elsewhere: :class:`shmwheel.contrib.timeouts.DriverSupervisor` in the
server's master process, or ``python -m shmwheel.contrib.timeouts NAME
--create`` run beside the server (by systemd, say).  The Gunicorn and
uWSGI integrations set both up for you.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ._record import DEFAULT_TRACEBACK_SIGNAL
from ._worker import RequestTimer, timed_apps

__all__ = ["TimeoutMiddleware"]

Environ = dict[str, Any]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


class TimeoutMiddleware:
    """Wrap a WSGI application: each request gets a timer of ``timeout``
    seconds in wheel ``name``, cancelled when its response is closed.

    The request id in the timeout's log line is the client's
    ``X-Request-Id`` header if it has a sane one, else the worker's pid and
    a counter.  The timer's handle is in the environ as ``shmwheel.timer``
    (None if the request runs without one).
    """

    def __init__(
        self,
        app: WSGIApp,
        name: str,
        timeout: float,
        *,
        traceback_signal: int | None = DEFAULT_TRACEBACK_SIGNAL,
    ) -> None:
        if not callable(app):
            raise TypeError(f"app must be a WSGI application, not {type(app).__name__}")
        self.app = app
        self.timer = RequestTimer(name, timeout, traceback_signal=traceback_signal)
        timed_apps.add(self)

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        timer = self.timer
        handle = timer.start(
            environ.get("REQUEST_METHOD", "-"),
            _path(environ),
            environ.get("HTTP_X_REQUEST_ID"),
        )
        environ["shmwheel.timer"] = handle
        try:
            body = self.app(environ, start_response)
        except BaseException:
            timer.finish(handle)
            raise
        return _ClosingBody(body, timer, handle)


def _path(environ: Environ) -> str:
    """The request's path as the client sent it (PEP 3333 carries it as latin-1)."""
    raw = environ.get("SCRIPT_NAME", "") + environ.get("PATH_INFO", "")
    try:
        return str(raw.encode("latin-1").decode("utf-8"))
    except UnicodeError:
        return str(raw)


class _ClosingBody:
    """The application's response body, with the timer cancelled on close().

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
