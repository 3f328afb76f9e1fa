"""The WSGI response body of a timed request: the application's body with
its timer ended on close(), and a file the server sends itself (PEP 3333's
``wsgi.file_wrapper``) kept one, its timer ended when the server closes it.
Below the worker's timer (:mod:`~shmwheel.contrib._worker`), which hands
the C path these same helpers, and the WSGI middleware, which uses them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._worker import RequestTimer

__all__ = [
    "ClosingBody",
    "Environ",
    "TimedFile",
    "TimingFileWrapper",
    "file_wrapper_for",
    "file_wrapper_of",
    "is_timed_file",
    "timed_file",
    "timing_file_wrapper",
]

Environ = dict[str, Any]


class ClosingBody:
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


class TimedFile(ClosingBody):
    """A file that the server sends itself: the file's own fileno(),
    read(), seek() and mode, and a close() that ends the request's timer
    after the file's own close().  One made for the application, by a
    :class:`TimingFileWrapper`, ends nothing until the middleware has it
    back as the body (``_for`` is its request's handle until then): closed
    by the application before, it would leave the rest of the request
    without a timer."""

    __slots__ = ("_for",)

    def __init__(self, body: Any, timer: RequestTimer, handle: int | None, for_handle: int | None = None) -> None:
        super().__init__(body, timer, handle)
        self._for = for_handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._body, name)


def file_wrapper_of(environ: Environ, body: object) -> type | None:
    """The server's ``wsgi.file_wrapper`` if ``body`` is one it made, else None."""
    wrapper = environ.get("wsgi.file_wrapper")
    return wrapper if isinstance(wrapper, type) and type(body) is wrapper else None


class TimingFileWrapper:
    """A server's ``wsgi.file_wrapper`` that is a function, uWSGI's, as the
    middleware hands it to the application: the file goes to the server in
    a :class:`TimedFile`.  uWSGI sends the file itself (sendfile) only if
    the body is the very object its wrapper was last given, so the file
    cannot be made a timed one afterwards, as a wrapper that is a class is
    made again (:func:`timed_file`).  A request without a timer hands the
    server its file as it is."""

    __slots__ = ("wrapper", "timer")

    #: The type of what it hands the server; shmwheel._fast's Clerk.wsgi reads it.
    file_type = TimedFile

    def __init__(self, wrapper: Callable[..., Any], timer: RequestTimer) -> None:
        self.wrapper = wrapper
        self.timer = timer

    def __call__(self, filelike: Any, *args: Any, **kwargs: Any) -> Any:
        handle = self.timer.current_handle()
        if handle is not None:
            filelike = TimedFile(filelike, self.timer, None, handle)
        return self.wrapper(filelike, *args, **kwargs)


def timing_file_wrapper(environ: Environ, timer: RequestTimer) -> None:
    """Put in ``environ`` the :class:`TimingFileWrapper` of the server's
    ``wsgi.file_wrapper`` if that is a function (a class is left, its
    bodies made again afterwards by :func:`timed_file`)."""
    wrapper = environ.get("wsgi.file_wrapper")
    if wrapper is not None:
        timing = timer._timing_file_wrapper(wrapper)
        if timing is not None:
            environ["wsgi.file_wrapper"] = timing


def file_wrapper_for(wrapper: object, timer: RequestTimer) -> TimingFileWrapper | None:
    """The :class:`TimingFileWrapper` that stands for ``wrapper``, or None
    where the server's wrapper is left as it is."""
    if isinstance(wrapper, TimingFileWrapper):  # the environ has been through this middleware
        return wrapper if wrapper.timer is timer else None
    if isinstance(wrapper, type) or not callable(wrapper):
        return None
    return TimingFileWrapper(wrapper, timer)


def is_timed_file(body: object, timer: RequestTimer, handle: int) -> bool:
    """Whether ``body`` is the file a :class:`TimingFileWrapper` handed the
    server for this request: then the server sends it itself, and from here
    its close() ends the timer."""
    if type(body) is not TimedFile or body._timer is not timer or body._for != handle:
        return False
    body._handle = handle
    return True


def timed_file(body: Any, wrapper: type, timer: RequestTimer, handle: int | None) -> Iterable[bytes] | None:
    """``body``, made by the server's ``wsgi.file_wrapper`` (PEP 3333's way
    for a server to send a file itself, with sendfile), made again around
    the same file in a :class:`TimedFile`: the server still sends it
    itself, and its close() ends the timer.  None where the wrapper keeps
    its file other than as Gunicorn's and wsgiref's do (``filelike``,
    ``blksize``), or will not make another: the body then goes the way of
    any other, iterated by the server."""
    filelike = getattr(body, "filelike", None)
    blksize = getattr(body, "blksize", None)
    if filelike is None or type(blksize) is not int:
        return None
    try:
        timed: Iterable[bytes] = wrapper(TimedFile(filelike, timer, handle), blksize)
    except Exception:  # noqa: BLE001 - the server's; its own body serves as well, iterated
        return None
    return timed
