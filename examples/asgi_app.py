"""A small ASGI application (Starlette) to try request timeouts with.

    GET /              answers at once
    GET /sleep?s=N     awaits asyncio.sleep(N) (default 10) before answering
    GET /block?s=N     a synchronous endpoint: time.sleep(N) in the thread
                       Starlette runs it in

``app`` is wrapped in shmwheel's ASGI middleware, a 2 s timeout on every
request, killing on: under Uvicorn or Hypercorn that is all it takes.
``routes`` is the same application unwrapped, for Gunicorn, whose
``install()`` wraps it itself (see gunicorn_asgi.conf.py and README.md
beside this file).
"""

from __future__ import annotations

import asyncio
import os
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from shmwheel.contrib.asgi import TimeoutMiddleware


def _seconds(request: Request, default: float = 10.0) -> float:
    try:
        return float(request.query_params.get("s", default))
    except ValueError:
        return default


def _done() -> PlainTextResponse:
    return PlainTextResponse(f"done by pid {os.getpid()}\n")


async def index(request: Request) -> PlainTextResponse:
    return _done()


async def sleep(request: Request) -> PlainTextResponse:
    await asyncio.sleep(_seconds(request))
    return _done()


def block(request: Request) -> PlainTextResponse:
    time.sleep(_seconds(request))
    return _done()


routes = Starlette(routes=[Route("/", index), Route("/sleep", sleep), Route("/block", block)])
app = TimeoutMiddleware(routes, timeout=2.0, kill=True, kill_after=3.0)
