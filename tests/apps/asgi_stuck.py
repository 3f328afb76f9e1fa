"""An ASGI application (Starlette) with a request stuck each way a request
can be, for the end-to-end tests of the stacks the workers write.

    GET /              answers at once
    GET /loop-sleep    time.sleep in an async endpoint: blocks the event loop
    GET /await-sleep   awaits asyncio.sleep: the loop runs on
    GET /anyio-sleep   awaits anyio.sleep, under asyncio or trio
    GET /recv          a blocking recv on a socket with no data, in an async
                       endpoint: blocks the event loop
    GET /spin          a pure-Python loop: blocks the event loop, holds the
                       GIL in turns (and /spin/anything too)
    GET /regex?n=N     a catastrophic regex, 2**N steps in C: holds the GIL
                       throughout, and cannot be interrupted
    GET /thread-sleep  a synchronous endpoint: time.sleep in the thread
                       Starlette runs it in
    GET /stream        a streaming response of ``chunks`` chunks (default 5),
                       ``every`` seconds apart (0.3), each preceded by
                       shmwheel.contrib.extend(``extend``) (1.0)
    GET /no-timeout    shmwheel.contrib.no_timeout(), then awaits asyncio.sleep
    GET /watched       plain ASGI: a task of its own waits for the client to
                       leave and only notes it; the request awaits asyncio.sleep
    GET /keeper        plain ASGI: starts, once, a task that outlives it (a
                       library's, in this request's context), which spins
                       for 3 s, blocking the loop; the request awaits asyncio.sleep
    GET /keeper-state  that task's state: "running", "finished" or "died: ..."
    GET /cut-stream    plain ASGI: sends a first chunk, then waits for the
                       client to leave (a task of its own listens) and ends
                       its body, as a stream that stops when its client has gone
    GET /begun         plain ASGI, under asyncio or trio: sends a first chunk,
                       then sleeps (anyio) and ends its body
    GET /thread-then-await
                       plain ASGI: asyncio.to_thread(time.sleep), then awaits
                       asyncio.sleep; says on stdout when it is cancelled, and
                       whether its thread had returned then
    POST /echo         plain ASGI, under asyncio or trio: no_timeout(), then
                       answers with the request body once it is whole

Each stays stuck for ``s`` seconds (``?s=``, default 3), /regex for as long
as its match takes.  ``app`` is wrapped in the ASGI middleware with a
timeout of ``SHMWHEEL_TEST_TIMEOUT`` seconds (default 1) and no kill;
``interrupting`` is the same with ``interrupt=True`` (a request is ended at
its timeout and answered 504), and its driver's metrics served where
``SHMWHEEL_TEST_METRICS`` says, if it is set; ``nested`` is ``app`` inside a function of
its own, which ``install()`` wraps again; ``routes`` is the same
application unwrapped, for Gunicorn's ``install()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time
from collections.abc import AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from shmwheel.contrib import extend, no_timeout
from shmwheel.contrib.asgi import TimeoutMiddleware


def _number(request: Request, key: str, default: float) -> float:
    try:
        return float(request.query_params.get(key, default))
    except ValueError:
        return default


def _done() -> PlainTextResponse:
    return PlainTextResponse(f"done by pid {os.getpid()}\n")


async def index(request: Request) -> PlainTextResponse:
    return _done()


def sleep_in_the_loop(seconds: float) -> None:
    time.sleep(seconds)


async def await_sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


def recv_in_the_loop(seconds: float) -> None:
    quiet, other = socket.socketpair()
    with quiet, other:
        quiet.settimeout(seconds)  # blocking, with a deadline: nobody ever writes
        try:
            quiet.recv(1)
        except TimeoutError:
            pass


def spin(seconds: float) -> int:
    end = time.monotonic() + seconds
    turns = 0
    while time.monotonic() < end:
        turns += sum(i * i for i in range(100)) & 1
    return turns


def backtrack(n: int) -> bool:
    return re.match(r"(a+)+$", "a" * n + "b") is not None


def sleep_in_a_thread(seconds: float) -> None:
    time.sleep(seconds)


async def loop_sleep(request: Request) -> PlainTextResponse:
    sleep_in_the_loop(_number(request, "s", 3.0))
    return _done()


async def anyio_sleep(request: Request) -> PlainTextResponse:
    await anyio.sleep(_number(request, "s", 3.0))
    return _done()


async def await_sleep_endpoint(request: Request) -> PlainTextResponse:
    await await_sleep(_number(request, "s", 3.0))
    return _done()


async def recv(request: Request) -> PlainTextResponse:
    recv_in_the_loop(_number(request, "s", 3.0))
    return _done()


async def spin_endpoint(request: Request) -> PlainTextResponse:
    spin(_number(request, "s", 3.0))
    return _done()


async def regex(request: Request) -> PlainTextResponse:
    backtrack(int(_number(request, "n", 27)))
    return _done()


def thread_sleep(request: Request) -> PlainTextResponse:
    sleep_in_a_thread(_number(request, "s", 3.0))
    return _done()


SPUN = {"turns": 0}  # how far spin_in_a_thread has got, for /spun


def spin_in_a_thread(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        SPUN["turns"] += 1


def thread_spin(request: Request) -> PlainTextResponse:
    spin_in_a_thread(_number(request, "s", 3.0))
    return _done()


async def spun(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"{SPUN['turns']}\n")


async def stream(request: Request) -> StreamingResponse:
    chunks = int(_number(request, "chunks", 5))
    every = _number(request, "every", 0.3)
    seconds = _number(request, "extend", 1.0)

    async def generate() -> AsyncIterator[str]:
        for n in range(chunks):
            extended = extend(seconds)
            yield f"chunk {n}: extend() returned {extended}\n"
            await asyncio.sleep(every)
        yield f"done by pid {os.getpid()}\n"

    return StreamingResponse(generate(), media_type="text/plain")


async def exempt(request: Request) -> PlainTextResponse:
    exempted = no_timeout()
    await await_sleep(_number(request, "s", 3.0))
    return PlainTextResponse(f"no_timeout() returned {exempted}; done by pid {os.getpid()}\n")


routes = Starlette(
    routes=[
        Route("/", index),
        Route("/loop-sleep", loop_sleep),
        Route("/await-sleep", await_sleep_endpoint),
        Route("/anyio-sleep", anyio_sleep),
        Route("/recv", recv),
        Route("/spin", spin_endpoint),
        Route("/regex", regex),
        Route("/thread-sleep", thread_sleep),
        Route("/thread-spin", thread_spin),
        Route("/spun", spun),
        Route("/stream", stream),
        Route("/no-timeout", exempt),
    ]
)


async def _answer(send: Send, body: str, more: bool = False) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": body.encode(), "more_body": more})


def _seconds(scope: Scope) -> float:
    query = dict(pair.split("=", 1) for pair in scope.get("query_string", b"").decode().split("&") if "=" in pair)
    return float(query.get("s", "3"))


async def watched(scope: Scope, receive: Receive, send: Send) -> None:
    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":  # the (empty) body first
            pass
        print("asgi_stuck: /watched heard http.disconnect", flush=True)

    watcher = asyncio.ensure_future(watch())
    await asyncio.sleep(_seconds(scope))
    await watcher
    await _answer(send, f"done by pid {os.getpid()}\n")


KEEPER: dict[str, object] = {}


async def _keep() -> None:
    await asyncio.sleep(0)  # from the request's next step on
    until = time.monotonic() + 3.0
    try:
        while time.monotonic() < until:  # blocks the loop: the request times out meanwhile
            pass
    except BaseException as exc:
        KEEPER["state"] = f"died: {type(exc).__name__}"
        raise
    KEEPER["state"] = "finished"


async def keeper(scope: Scope, receive: Receive, send: Send) -> None:
    if "task" not in KEEPER:
        KEEPER["state"] = "running"
        KEEPER["task"] = asyncio.ensure_future(_keep())  # in this request's context, as a lazily made pool's
    await asyncio.sleep(_seconds(scope))
    await _answer(send, f"done by pid {os.getpid()}\n")


async def cut_stream(scope: Scope, receive: Receive, send: Send) -> None:
    await _answer(send, "first\n", more=True)
    gone = asyncio.Event()

    async def listen() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    listener = asyncio.ensure_future(listen())
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(gone.wait(), _seconds(scope))
    await listener
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def begun(scope: Scope, receive: Receive, send: Send) -> None:
    await _answer(send, "first\n", more=True)
    await anyio.sleep(_seconds(scope))
    await send({"type": "http.response.body", "body": b"rest\n", "more_body": False})


async def thread_then_await(scope: Scope, receive: Receive, send: Send) -> None:
    returned = False
    try:
        await asyncio.to_thread(time.sleep, _seconds(scope))
        returned = True
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        when = "once its thread had returned" if returned else "while its thread ran"
        print(f"asgi_stuck: /thread-then-await cancelled {when}", flush=True)
        raise
    await _answer(send, f"done by pid {os.getpid()}\n")


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    no_timeout()
    body = b""
    while (message := await receive())["type"] == "http.request":
        body += message.get("body", b"")
        if not message.get("more_body", False):
            await _answer(send, body.decode())
            return


PLAIN = {"/watched": watched, "/keeper": keeper, "/cut-stream": cut_stream, "/begun": begun, "/echo": echo,
         "/thread-then-await": thread_then_await}  # fmt: skip


async def spin_anywhere(scope: Scope, receive: Receive, send: Send) -> None:
    """``routes``, with any path under /spin/ spun as /spin, whatever it
    holds (Starlette's path parameters stop at a newline), and the plain
    ASGI endpoints."""
    path = scope.get("path", "")
    if scope["type"] == "http" and path.startswith("/spin/"):
        scope = {**scope, "path": "/spin"}
    elif scope["type"] == "http" and path in PLAIN:
        await PLAIN[path](scope, receive, send)
        return
    elif scope["type"] == "http" and path == "/keeper-state":
        await _answer(send, f"{KEEPER.get('state', 'none')}\n")
        return
    await routes(scope, receive, send)


TIMEOUT = float(os.environ.get("SHMWHEEL_TEST_TIMEOUT", "1.0"))
app = TimeoutMiddleware(spin_anywhere, timeout=TIMEOUT, kill=False)
interrupting = TimeoutMiddleware(spin_anywhere, timeout=TIMEOUT, kill=False, interrupt=True, interrupt_grace=0.5,
                                 metrics=os.environ.get("SHMWHEEL_TEST_METRICS"))  # fmt: skip


async def nested(scope: Scope, receive: Receive, send: Send) -> None:
    """``app`` inside a plain ASGI function of the application's own, as
    another middleware around it would have it."""
    await app(scope, receive, send)
