"""A Flask application with a route stuck each way a request can be.

    GET /                answers at once
    GET /sleep?s=N       time.sleep(N)
    GET /recv?s=N        a blocking recv on a socket no data comes to, N s
    GET /spin?s=N        a pure-Python CPU loop, N s
    GET /c-sleep?s=N     CPython's own time.sleep(N), which does not yield
                         to gevent's hub even under its monkey-patching
    GET /regex?n=N       a catastrophic regular expression: 2**N steps in C
                         with the GIL held (N = 26: a few seconds), which
                         nothing can interrupt
    GET /stream?chunks=N&every=S&extend=E&first=F
                         a streaming response of N chunks, S s apart, each
                         preceded by shmwheel.contrib.extend(E), the first
                         F s after the response starts (default 0)
    GET /no-timeout?s=N  shmwheel.contrib.no_timeout(), then time.sleep(N)

Under gevent's monkey-patching the first two yield to the hub; a spin,
a C sleep and a regular expression keep it.  Each way is a function of its own, which a timed-out
request's stack names.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from collections.abc import Iterator

from flask import Flask, Response, request

from shmwheel.contrib import extend, no_timeout

app = Flask(__name__)


def _seconds(default: float = 10.0) -> float:
    return float(request.args.get("s", default))


def stuck_in_sleep(seconds: float) -> None:
    time.sleep(seconds)


def stuck_in_recv(seconds: float) -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.settimeout(seconds)
        try:
            ours.recv(1)
        except TimeoutError:
            pass


class Upstream:
    """A client of another service that keeps what it reads, as a cache's
    or a database's client does."""

    def __init__(self, seconds: float) -> None:
        self._sock, self._peer = socket.socketpair()
        self._sock.settimeout(seconds)

    def read_reply(self) -> bytes:
        try:
            reply = self._sock.recv(1)
        except TimeoutError:
            reply = b""
        finally:
            self._sock.close()
            self._peer.close()
        return reply


def stuck_in_c_sleep(seconds: float) -> None:
    monkey = sys.modules.get("gevent.monkey")
    sleep = time.sleep if monkey is None else monkey.get_original("time", "sleep")
    sleep(seconds)


def stuck_in_spin(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def stuck_in_regex(n: int) -> None:
    re.match(r"(a+)+$", "a" * n + "b")


def _done() -> Response:
    return Response(f"done by pid {os.getpid()}\n", mimetype="text/plain")


@app.route("/")
def fast() -> Response:
    return _done()


@app.route("/sleep")
def sleep() -> Response:
    stuck_in_sleep(_seconds())
    return _done()


@app.route("/recv")
def recv() -> Response:
    stuck_in_recv(_seconds())
    return _done()


@app.route("/upstream")
def upstream() -> Response:
    Upstream(_seconds()).read_reply()
    return _done()


@app.route("/c-sleep")
def c_sleep() -> Response:
    stuck_in_c_sleep(_seconds())
    return _done()


@app.route("/spin")
def spin() -> Response:
    stuck_in_spin(_seconds())
    return _done()


@app.route("/regex")
def regex() -> Response:
    stuck_in_regex(int(request.args.get("n", 26)))
    return _done()


@app.route("/stream")
def stream() -> Response:
    chunks = int(request.args.get("chunks", 5))
    every = float(request.args.get("every", 0.3))
    seconds = float(request.args.get("extend", 1.0))
    first = float(request.args.get("first", 0.0))

    def generate() -> Iterator[str]:
        time.sleep(first)
        for n in range(chunks):
            extended = extend(seconds)
            yield f"chunk {n}: extend() returned {extended}\n"
            time.sleep(every)
        yield f"done by pid {os.getpid()}\n"

    return Response(generate(), mimetype="text/plain")


@app.route("/no-timeout")
def exempt() -> Response:
    exempted = no_timeout()
    stuck_in_sleep(_seconds())
    return Response(f"no_timeout() returned {exempted}; done by pid {os.getpid()}\n", mimetype="text/plain")
