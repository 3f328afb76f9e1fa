"""The one door between request timeouts and their C path, shmwheel._fast.

The only module that imports the extension (csrc/python/fast.c), and the
only one that decides which path serves: each adapter asks here, once, as
it is made, for the C object that takes its requests, and gets None where
its settings need Python for every request (:func:`in_c`).  The extension
is part of every build: one that cannot compile it fails at install, and
one whose parts were built from other sources fails here, at import.
What C reads back from the Python objects it is handed is named in the
Protocols of ``_fast.pyi`` (tests/test_layout.py holds the two lists
together).

A request the C path tried and gave back goes to the adapter's waiting
path, never to C again (``RequestTimer.start_declined``).

On a free-threaded CPython the extension, which relies on the GIL, turns
it back on when it is imported (CPython says so in a RuntimeWarning).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from .. import _fast
from .._binding import lib
from .._wheel import Wheel
from ._settings import TimeoutSettings

if TYPE_CHECKING:
    from .._fast import ASGIMiddleware, HooksState, SlowHook, WSGIMiddleware
    from ._worker import RequestTimer

__all__ = [
    "Active",
    "Table",
    "Clerk",
    "asgi_in_c",
    "closing_body",
    "core_of",
    "enter",
    "gunicorn_hooks",
    "here",
    "in_c",
    "leave",
    "new_table",
    "wrap_asgi_call",
    "wsgi_in_c",
]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where the built modules are
if getattr(_fast, "API_VERSION", None) != lib.SHMW_API_VERSION:
    # It would call the core's functions with another signature.
    raise ImportError(
        f"shmwheel: shmwheel._fast and shmwheel._shmwheel in {_PACKAGE} were built from different versions of the "
        "C sources; build them again together (pip install --force-reinstall shmwheel, or pip install -e . in a "
        "checkout)"
    )
if _fast.HEAD_SIZE != lib.SHMW_REQ_HEAD_SIZE:
    # It would write records this version's driver reads otherwise.
    raise ImportError(
        f"shmwheel: shmwheel._fast in {_PACKAGE} writes request records of another layout than this version's; "
        "build it again (pip install --force-reinstall shmwheel, or pip install -e . in a checkout)"
    )

from .._fast import ASGI, WSGI, Active, Body, Clerk, Core, Coroutine, Hooks, Table, enter, here, leave  # noqa: E402


def in_c(settings: TimeoutSettings, *, ends_in_call: bool = True) -> bool:
    """Whether an adapter's requests may take the C path: none of them
    needs Python of its own (a route's look-up, X-Request-Start, an
    interrupt answered in the adapter's own call: ``ends_in_call``, the
    middlewares'; Gunicorn's hooks leave that to the application's
    wrapper, and take the C path with ``interrupt`` all the same)."""
    return settings.routes is None and not settings.x_request_start and not (settings.interrupt and ends_in_call)


def new_table() -> Table:
    """A table of requests in progress, by handle, which makes nothing per request."""
    return Table()


def core_of(wheel: Wheel) -> Core | None:
    """``wheel`` as the C path calls it, or None once closed (see
    :meth:`Wheel.fast_core`)."""
    core: Core | None = wheel.fast_core(Core)
    return core


#: The body a WSGI middleware gives back, whose close() ends the request's
#: timer with no Python frame.
closing_body: Callable[[Iterable[bytes], RequestTimer, int | None], Iterable[bytes]] = Body


def wsgi_in_c(middleware: WSGIMiddleware, plain: bool) -> WSGI | None:
    """A WSGI middleware as a C callable (``_fast.WSGI``) that reaches its
    timer with no Python frame of the middleware's, or None where its own
    call serves (not ``plain``: see :func:`in_c`)."""
    return WSGI(middleware) if plain else None


def asgi_in_c(middleware: ASGIMiddleware, plain: bool) -> ASGI | None:
    """An ASGI middleware's HTTP request started in C (``_fast.ASGI``), or
    None where its own call serves."""
    return ASGI(middleware) if plain else None


def wrap_asgi_call(call: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """The ASGI middleware's ``__call__`` in C (``_fast.Coroutine``): its
    call has no coroutine of its own."""
    return Coroutine(call)


def gunicorn_hooks(state: HooksState, slow: SlowHook, header: str, plain: bool) -> Hooks | None:
    """Gunicorn's pre_request and post_request in C (``_fast.Hooks``), or
    None where the Python hooks serve."""
    return Hooks(state, slow, header) if plain else None
