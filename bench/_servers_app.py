"""The hello-world applications ``servers.py`` runs under real servers.

Each answers every request at once with ``hello`` and an ``X-Pid`` header,
the pid of the worker that served it, which is how the benchmark counts
the requests each worker got.  The timed variants are built on first use
(``module:name`` lookups go through :func:`__getattr__`), so that a server
that runs the plain one imports nothing of shmwheel's (uWSGI looks in the
module's dictionary: its timed application is ``_servers_uwsgi:application``):

- ``application``: WSGI, for Gunicorn and uWSGI;
- ``setitimer_application``: the same between a ``setitimer`` pair, for
  uWSGI, which has no hooks to put the pair in;
- ``asgi_app``: ASGI, for Uvicorn, with the lifespan protocol;
- ``asgi_timed``: the same in ``shmwheel.contrib.asgi.TimeoutMiddleware``;
- ``asgi_asyncio_timeout``: the same in ``asyncio.timeout``, asyncio's
  own per-request timer (a ``call_at`` handle on the worker's loop).
"""

from __future__ import annotations

import asyncio
import asyncio.base_events
import os
import signal
import socket
from collections.abc import Callable, Iterable
from typing import Any

# Uvicorn --workers hands its workers a listening socket made with proto 0,
# and asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP:
# then every response after the first on a keep-alive connection waits about
# 40 ms for the client's delayed ACK (Nagle), and the server idles.  The
# benchmark turns Nagle off for every variant of the server alike
# (SHMWHEEL_BENCH_NODELAY=1), as asyncio means to.
if os.environ.get("SHMWHEEL_BENCH_NODELAY") == "1":

    def _set_nodelay(sock: socket.socket) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    asyncio.base_events._set_nodelay = _set_nodelay  # type: ignore[attr-defined]

TIMEOUT = float(os.environ.get("SHMWHEEL_BENCH_TIMEOUT", "30"))  # s: never reached by a hello
BODY = b"hello\n"


def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    start_response(
        "200 OK",
        [("Content-Type", "text/plain"), ("Content-Length", str(len(BODY))), ("X-Pid", str(os.getpid()))],
    )
    return [BODY]


def setitimer_application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    """``application`` between ``setitimer(ITIMER_REAL, TIMEOUT)`` and
    ``setitimer(ITIMER_REAL, 0)``: the cheapest in-process timer, and one a
    process, so only a cost figure under threads (a thread's call replaces
    another's timer)."""
    signal.setitimer(signal.ITIMER_REAL, TIMEOUT)
    try:
        return application(environ, start_response)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


async def asgi_app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    headers = [
        (b"content-type", b"text/plain"),
        (b"content-length", str(len(BODY)).encode()),
        (b"x-pid", str(os.getpid()).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": BODY})


def _asyncio_timeout(app: Any) -> Any:
    async def timed(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            return await app(scope, receive, send)
        async with asyncio.timeout(TIMEOUT):
            await app(scope, receive, send)

    return timed


def __getattr__(name: str) -> Any:
    if name == "asgi_timed":
        from shmwheel.contrib.asgi import TimeoutMiddleware

        value: Any = TimeoutMiddleware(asgi_app, timeout=TIMEOUT)
    elif name == "asgi_asyncio_timeout":
        value = _asyncio_timeout(asgi_app)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
