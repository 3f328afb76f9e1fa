"""Request timeouts for web servers, built on shmwheel.

Every public name of the request-timeout core is importable from here;
each is loaded with its module on first use, so that a worker that uses
only its server's adapter never loads the driver's side.  The modules, by
floor, each importing only from the floors below it (``python
tools/imports.py`` checks it):

1. what both sides share: the request record a timer carries
   (:mod:`~shmwheel.contrib._record`), the settings
   (:mod:`~shmwheel.contrib._settings`: :class:`TimeoutSettings`, with
   :class:`TimeoutActions`), the
   routes, the server's log as a driver writes to it, the calls a wake
   may end;
2. the worker's side: stacks and the reporter thread
   (:mod:`~shmwheel.contrib._stacks`), safe points and interrupts, the
   WSGI body, the driver a worker starts itself
   (:mod:`~shmwheel.contrib._autodriver`), a timer per request
   (:mod:`~shmwheel.contrib._worker`: :class:`RequestTimer`) and a view's
   own timeout (:mod:`~shmwheel.contrib._views`: :class:`request_timeout`);
3. the driver's side, which no worker loads: what it does when a timer
   fires and whom it may signal (:mod:`~shmwheel.contrib._handler`:
   :class:`TimeoutHandler`), and the wheel and the driver process's
   lifetime (:mod:`~shmwheel.contrib._supervisor`: :class:`DriverSupervisor`);
4. one thin adapter a server: :mod:`shmwheel.contrib.wsgi` and
   :mod:`shmwheel.contrib.asgi` (middlewares for any server; under Uvicorn
   and Hypercorn the ASGI one's workers start the driver themselves),
   :mod:`shmwheel.contrib.uwsgi` (the driver as a mule),
   :mod:`shmwheel.contrib.gunicorn` (server hooks, from a config file),
   the driver command, ``shmwheel timeouts NAME`` (the same as ``python -m
   shmwheel.contrib.timeouts NAME``), and a timeout on the request's
   OpenTelemetry span (:mod:`shmwheel.contrib.otel`, imported by hand: the
   one module that imports opentelemetry).

What a request's own code may use: :class:`request_timeout` gives a view
a timeout of its own (a decorator on a view of any framework, or a
FastAPI dependency), :func:`extend` and :func:`no_timeout` change the
timeout of the request in progress, and :class:`RequestTimeout` is what
ends one that ran past it (``interrupt=True``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers; at run time __getattr__ loads each name's module on first use
    from ._handler import DUMP_TIME as DUMP_TIME
    from ._handler import TimeoutHandler as TimeoutHandler
    from ._handler import signal_process as signal_process
    from ._interrupt import RequestTimeout as RequestTimeout
    from ._interrupt import ResponseBrokenOff as ResponseBrokenOff
    from ._record import DEFAULT_TRACEBACK_SIGNAL as DEFAULT_TRACEBACK_SIGNAL
    from ._record import DUMP_SIGNAL as DUMP_SIGNAL
    from ._record import KIND_ANSWER as KIND_ANSWER
    from ._record import KIND_CHECK as KIND_CHECK
    from ._record import KIND_GRACEFUL as KIND_GRACEFUL
    from ._record import KIND_KILL as KIND_KILL
    from ._record import KIND_REQUEST as KIND_REQUEST
    from ._record import PAYLOAD_SIZE as PAYLOAD_SIZE
    from ._record import RequestRecord as RequestRecord
    from ._record import decode_request as decode_request
    from ._record import encode_request as encode_request
    from ._settings import DEFAULT_CAPACITY as DEFAULT_CAPACITY
    from ._settings import DEFAULT_INTERRUPT_GRACE as DEFAULT_INTERRUPT_GRACE
    from ._settings import DEFAULT_KILL_AFTER as DEFAULT_KILL_AFTER
    from ._settings import TimeoutActions as TimeoutActions
    from ._settings import TimeoutSettings as TimeoutSettings
    from ._supervisor import DriverSupervisor as DriverSupervisor
    from ._supervisor import create_wheel as create_wheel
    from ._views import request_timeout as request_timeout
    from ._worker import RequestTimer as RequestTimer
    from ._worker import extend as extend
    from ._worker import no_timeout as no_timeout

#: Each public name, and the module it lives in (the same as the imports
#: above: tests/test_layout.py holds them together).
_HOMES = {
    **dict.fromkeys(("DUMP_TIME", "TimeoutHandler", "signal_process"), "_handler"),
    **dict.fromkeys(("RequestTimeout", "ResponseBrokenOff"), "_interrupt"),
    **dict.fromkeys(
        (
            "DEFAULT_TRACEBACK_SIGNAL",
            "DUMP_SIGNAL",
            "KIND_ANSWER",
            "KIND_CHECK",
            "KIND_GRACEFUL",
            "KIND_KILL",
            "KIND_REQUEST",
            "PAYLOAD_SIZE",
            "RequestRecord",
            "decode_request",
            "encode_request",
        ),
        "_record",
    ),
    **dict.fromkeys(
        ("DEFAULT_CAPACITY", "DEFAULT_INTERRUPT_GRACE", "DEFAULT_KILL_AFTER", "TimeoutActions", "TimeoutSettings"),
        "_settings",
    ),
    **dict.fromkeys(("DriverSupervisor", "create_wheel"), "_supervisor"),
    "request_timeout": "_views",
    **dict.fromkeys(("RequestTimer", "extend", "no_timeout"), "_worker"),
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})
