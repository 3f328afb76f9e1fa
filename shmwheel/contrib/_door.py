"""The one door between request timeouts and their C path, shmwheel._fast.

The only module that imports the extension (csrc/python/fast.c), and the
only one that decides which path serves: each adapter asks here, once, as
it is made, for the C object that takes its requests, and gets None where
its settings need Python for every request (:func:`in_c`) or the build has
no extension.  What C reads back from the Python objects it is handed is
named in the Protocols of ``_fast.pyi`` (tests/test_layout.py holds the
two lists together).

A request the C path tried and gave back goes to the adapter's waiting
path, never to C again (``RequestTimer.start_declined``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple

from .._binding import lib
from .._wheel import Wheel
from ._body import ClosingBody

if TYPE_CHECKING:
    from types import ModuleType

    from .._fast import ASGI, WSGI, ASGIMiddleware, Core, Hooks, HooksState, SlowHook, WSGIMiddleware
    from ._worker import RequestTimer

__all__ = [
    "EXTENSION",
    "Active",
    "Table",
    "closing_body",
    "core_of",
    "enter",
    "here",
    "in_c",
    "leave",
    "new_table",
    "Timer",
    "wrap_asgi_call",
    "wsgi_in_c",
    "asgi_in_c",
    "gunicorn_hooks",
]

EXTENSION: ModuleType | None
try:  # built beside the cffi module by setup.py
    from .. import _fast as EXTENSION  # noqa: N812 - the module, named for what it is here
except ImportError:  # pragma: no cover - a build without it: every request on the cffi path
    EXTENSION = None

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the built modules are
if EXTENSION is not None and getattr(EXTENSION, "API_VERSION", None) != lib.SHMW_API_VERSION:
    # It would call the core's functions with another signature.
    raise ImportError(
        f"shmwheel: shmwheel._fast and shmwheel._shmwheel in {_PACKAGE} were built "
        "from different versions of the C sources; build them again together (pip install --force-reinstall "
        "shmwheel, or pip install -e . in a checkout)"
    )
if EXTENSION is not None and EXTENSION.HEAD_SIZE != lib.SHMW_REQ_HEAD_SIZE:
    # It would write records this version's driver reads otherwise.
    raise ImportError(
        f"shmwheel: shmwheel._fast in {_PACKAGE} writes request records of another "
        "layout than this version's; build it again (pip install --force-reinstall shmwheel, or pip install -e . "
        "in a checkout)"
    )


if TYPE_CHECKING or EXTENSION is not None:
    from .._fast import Active, Table, Timer
else:  # pragma: no cover - a build without shmwheel._fast

    class Active(NamedTuple):
        """A request in progress, as its worker's table holds it: with
        shmwheel._fast, its ``Active``, the same fields in one object."""

        payload: bytes  #: its timer's record
        deadline_ns: int  #: time.monotonic_ns() when its timer fires: at its warn_after stage, or its timeout
        thread: int  #: its OS thread, as _thread.get_ident() names it before any monkey-patching
        task: Any  #: its asyncio or trio task, or its greenlet, or None
        handle: int  #: its timer (extend() gives it a new one)
        timeout_ns: int  #: time.monotonic_ns() when it times out
        interrupt: bool  #: whether it is ended at its timeout

    Table = dict
    Timer = None


def in_c(*, routes: object, x_request_start: bool, interrupt: bool = False) -> bool:
    """Whether an adapter's requests may take the C path: none of them
    needs Python of its own (a route's look-up, X-Request-Start, an
    interrupt in the middleware's own call), and the build has it."""
    return EXTENSION is not None and routes is None and not x_request_start and not interrupt


def new_table() -> dict[int, Active] | Table:
    """A table of requests in progress, by handle: the extension's, which
    makes nothing per request, or a dict."""
    return {} if EXTENSION is None else EXTENSION.Table()


def core_of(wheel: Wheel) -> Core | None:
    """``wheel`` as the C path calls it (a ``_fast.Core``), or None without
    the extension or once closed (see :meth:`Wheel.fast_core`)."""
    return None if EXTENSION is None else wheel.fast_core(EXTENSION.Core)


#: The request a plain thread runs, in the extension's thread-local slot,
#: as (RequestTimer, handle), or None; and filing one there and taking it
#: out.  Without the extension, every request is in its context alone.
here: Callable[[], tuple[Any, int] | None] | None = None if EXTENSION is None else EXTENSION.here
enter: Callable[..., Any] | None = None if EXTENSION is None else EXTENSION.enter
leave: Callable[..., Any] | None = None if EXTENSION is None else EXTENSION.leave

#: The body a WSGI middleware gives back, whose close() ends the request's
#: timer: the extension's Body (no Python frame), or the same in Python.
closing_body: Callable[[Any, RequestTimer, int | None], Iterable[bytes]] = (
    ClosingBody if EXTENSION is None else EXTENSION.Body
)


def wsgi_in_c(middleware: WSGIMiddleware, plain: bool) -> WSGI | None:
    """A WSGI middleware as a C callable (``_fast.WSGI``) that reaches its
    timer with no Python frame of the middleware's, or None where its own
    call serves (not ``plain``: see :func:`in_c`)."""
    return EXTENSION.WSGI(middleware) if plain and EXTENSION is not None else None


def asgi_in_c(middleware: ASGIMiddleware, plain: bool) -> ASGI | None:
    """An ASGI middleware's HTTP request started in C (``_fast.ASGI``), or
    None where its own call serves."""
    return EXTENSION.ASGI(middleware) if plain and EXTENSION is not None else None


def wrap_asgi_call(call: Callable[..., Any]) -> Callable[..., Any]:
    """The ASGI middleware's ``__call__``, in C where the extension is
    built (``_fast.Coroutine``): its call has no coroutine of its own."""
    return call if EXTENSION is None else EXTENSION.Coroutine(call)


def gunicorn_hooks(state: HooksState, slow: SlowHook, header: str, plain: bool) -> Hooks | None:
    """Gunicorn's pre_request and post_request in C (``_fast.Hooks``), or
    None where the Python hooks serve."""
    return EXTENSION.Hooks(state, slow, header) if plain and EXTENSION is not None else None
