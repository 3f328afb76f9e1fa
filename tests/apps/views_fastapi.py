"""A FastAPI application whose endpoints take timeouts of their own
(shmwheel.contrib.request_timeout), wrapped in the ASGI middleware with a
4 s timeout and interrupt: under Uvicorn, ``views_fastapi:app``.

    GET /             answers at once
    GET /short?s=N    request_timeout(0.5) as a route's dependency, a sync endpoint in time.sleep(N)
    GET /long?s=N     request_timeout(60) on an async endpoint, asyncio.sleep(N)
    GET /none?s=N     request_timeout(None) as a router's dependency, a sync endpoint
"""

from __future__ import annotations

import asyncio
import os
import time

from fastapi import APIRouter, Depends, FastAPI

from shmwheel.contrib import request_timeout
from shmwheel.contrib.asgi import TimeoutMiddleware


def _done() -> str:
    return f"done by pid {os.getpid()}\n"


api = FastAPI()
untimed = APIRouter(dependencies=[Depends(request_timeout(None))])


@api.get("/")
def root() -> str:
    return _done()


@api.get("/short", dependencies=[Depends(request_timeout(0.5))])
def short(s: float = 0) -> str:
    time.sleep(s)
    return _done()


@api.get("/long")
@request_timeout(60)
async def long(s: float = 0) -> str:
    await asyncio.sleep(s)
    return _done()


@untimed.get("/none")
def none(s: float = 0) -> str:
    time.sleep(s)
    return _done()


api.include_router(untimed)
app = TimeoutMiddleware(api, float(os.environ.get("VIEWS_TIMEOUT", "4")), interrupt=True)
