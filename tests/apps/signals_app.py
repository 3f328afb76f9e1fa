"""A plain WSGI application that has signal handlers of its own, as some do:
shmwheel's must work beside them and take nothing from them.

At import (before shmwheel listens in the worker): its own SIGURG handler,
which counts, and a faulthandler registration of SIGRTMIN that writes to
the file named by ``SIGNALS_APP_DUMP``.

    GET /                  answers at once: "done by pid N"
    GET /count             how many SIGURGs its handler has seen: "N SIGURG"
    GET /retake            signal.signal(SIGURG) again, now after shmwheel's
    GET /spin?s=N          spins N s in Python, then answers
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs

_seen: list[int] = []
_dump = open(os.environ["SIGNALS_APP_DUMP"], "w")  # noqa: SIM115 - for the life of the worker


def _count(signum: int, frame: object) -> None:
    _seen.append(signum)


signal.signal(signal.SIGURG, _count)
faulthandler.register(signal.SIGRTMIN, file=_dump, all_threads=True)


def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    path = environ.get("PATH_INFO", "/")
    seconds = float(parse_qs(environ.get("QUERY_STRING", "")).get("s", ["10"])[0])
    if path == "/count":
        body = f"{len(_seen)} SIGURG\n".encode()
    else:
        if path == "/retake":
            signal.signal(signal.SIGURG, _count)
        elif path == "/spin":
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                pass
        body = f"done by pid {os.getpid()}\n".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
