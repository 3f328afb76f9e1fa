"""A view's own timeout, the way each framework's users write one:
:class:`request_timeout` as a decorator on a view of any framework, or as
a FastAPI dependency.

It acts on the request in progress, whichever server adapter timed it (the
middlewares, Gunicorn's hooks, uWSGI's), as :func:`extend` does, but from
the request's start: ``@request_timeout(120)`` gives the requests of the
view 120 s from when the worker took them, not from when the view began.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, TypeVar, cast, overload

from .._checks import check_seconds
from ._stacks import server_logger
from ._worker import in_progress_here, rearm_here, times_requests

__all__ = ["request_timeout"]

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)

# The method a class-based view of each framework runs a request through:
# Django's View and Starlette's HTTPEndpoint ``dispatch``, Flask's View
# ``dispatch_request``.
_DISPATCH = ("dispatch_request", "dispatch")

_said_untimed = False
#: Whether a request_timeout further out on this call has given the request
#: its timeout already.
_applied: ContextVar[bool] = ContextVar("shmwheel_request_timeout_applied", default=False)


class request_timeout:  # noqa: N801 - a decorator, named as one is used
    """Give a view's requests ``seconds`` from their start (None: no
    timeout).

    On a function view, sync or async (Django, Flask, FastAPI and
    Starlette endpoints)::

        @request_timeout(120)
        def export(request): ...

    on a class-based view (Django's ``View``, Flask's ``View`` and
    ``MethodView``, Starlette's ``HTTPEndpoint``), directly or through
    Django's ``method_decorator(request_timeout(120), name="dispatch")``;
    and as a FastAPI dependency of a route or a router::

        router = APIRouter(dependencies=[Depends(request_timeout(120))])

    It gives the request in progress its timeout when the view is called,
    counted from when the worker took the request; one whose time is up
    already times out at once.  A request no shmwheel adapter times runs
    unchanged, and the first such says so once in the server's log.
    """

    def __init__(self, seconds: float | None) -> None:
        self.seconds = None if seconds is None else check_seconds(seconds, "seconds", positive=True)
        # As a dependency FastAPI calls it with no argument, after reading
        # its parameters from this signature: there are none to fill in.
        self.__signature__ = inspect.Signature()

    def __repr__(self) -> str:
        return f"request_timeout({'None' if self.seconds is None else f'{self.seconds:g}'})"

    @overload
    def __call__(self) -> None: ...
    @overload
    def __call__(self, view: C) -> C: ...
    @overload
    def __call__(self, view: F) -> F: ...
    def __call__(self, view: Any = None) -> Any:
        if view is None:  # a dependency: the request in progress, now
            self.apply()
            return None
        if isinstance(view, type):
            return self._on_class(view)
        if not callable(view):
            raise TypeError(f"request_timeout() decorates a view, a function or a class, not {type(view).__name__}")
        return self._on_function(view)

    def apply(self) -> bool:
        """Give the request in progress here its timeout now; False if it
        has no timer, or has timed out already."""
        if rearm_here("request_timeout", self.seconds, from_start=True):
            return True
        if not in_progress_here():
            _say_untimed(self)
        return False

    def _on_function(self, view: F) -> F:
        # Of two that wrap one call, the outer counts: a subclass's own
        # timeout over its base class's, whose dispatch its own calls.
        if inspect.iscoroutinefunction(view):

            @functools.wraps(view)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                if _applied.get():
                    return await cast(Callable[..., Awaitable[Any]], view)(*args, **kwargs)
                token = _applied.set(True)
                try:
                    self.apply()
                    return await cast(Callable[..., Awaitable[Any]], view)(*args, **kwargs)
                finally:
                    _applied.reset(token)

            return cast(F, timed_async)

        @functools.wraps(view)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if _applied.get():
                return view(*args, **kwargs)
            token = _applied.set(True)
            try:
                self.apply()
                return view(*args, **kwargs)
            finally:
                _applied.reset(token)

        return cast(F, timed)

    def _on_class(self, view: C) -> C:
        for name in _DISPATCH:
            dispatch = getattr(view, name, None)
            if callable(dispatch):
                setattr(view, name, self._on_function(dispatch))
                return view
        raise TypeError(
            f"request_timeout() on class {view.__name__}, which has no dispatch() or dispatch_request(): decorate "
            "its handler methods instead"
        )


def _say_untimed(decorator: request_timeout) -> None:
    """Once a process: a view with a timeout of its own in a server whose
    requests no shmwheel adapter times, so it has none."""
    global _said_untimed
    if _said_untimed or times_requests():
        return
    _said_untimed = True
    server_logger().warning(
        "shmwheel: a view has %r, but no shmwheel adapter times this server's requests: it runs without a timeout; "
        "install the server's adapter (install() in Gunicorn's config, request_timeouts() under uWSGI, a "
        "TimeoutMiddleware)",
        decorator,
    )
