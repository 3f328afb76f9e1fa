"""A plain WSGI application, no framework, for the 504 on the wire.

    GET /                  answers at once: "done by pid N"
    GET /early?s=N         start_response with a Content-Length of its own
                           first, then a generator that spins N s before its
                           one chunk: a timeout between the two must go out
                           as one whole 504, not the application's headers
                           and the 504's together
    GET /spin?s=N          spins N s in the call, then answers (and so does
                           any path that starts with /spin)
    GET /list              answers at once with a list body of two chunks

Gunicorn's ``install()`` wraps it; plain_stuck_uwsgi.py has it for uWSGI.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import parse_qs


def _spin(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def _late_chunk(seconds: float) -> Iterator[bytes]:
    _spin(seconds)
    yield b"late!\n"


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "/")
    seconds = float(parse_qs(environ.get("QUERY_STRING", "")).get("s", ["10"])[0])
    if path == "/early":
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "6")])
        return _late_chunk(seconds)
    if path.startswith("/spin"):
        _spin(seconds)
    if path == "/list":
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "12")])
        return [b"first\n", b"last!\n"]
    body = f"done by pid {os.getpid()}\n".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
