"""A small WSGI application to try request timeouts with.

    GET /             answers at once
    GET /sleep?s=N    sleeps N seconds (default 10) before answering
    GET /spin?s=N     keeps a CPU busy in Python for N seconds
    GET /stuck?s=N    sleeps N seconds and will not be stopped from Python:
                      it swallows the exception a graceful signal raises
                      (Gunicorn's SIGABRT), so there SIGKILL ends it; a
                      uWSGI worker exits on SIGTERM without raising one

Run it under Gunicorn or uWSGI with the configurations beside it (see
README.md there).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs


def _seconds(environ: dict[str, Any], default: float = 10.0) -> float:
    values = parse_qs(environ.get("QUERY_STRING", "")).get("s")
    try:
        return float(values[0]) if values else default
    except ValueError:
        return default


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


def _spin(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def _stuck(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        try:
            time.sleep(until - time.monotonic())
        except BaseException:  # noqa: BLE001 - on purpose: a request that will not stop
            continue


_ROUTES: dict[str, Callable[[float], None]] = {"/sleep": _sleep, "/spin": _spin, "/stuck": _stuck}


def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "/")
    work = _ROUTES.get(path)
    if work is None and path != "/":
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]
    if work is not None:
        work(_seconds(environ))
    body = f"done by pid {os.getpid()}\n".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
