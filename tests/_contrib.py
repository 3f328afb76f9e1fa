"""What the tests of shmwheel.contrib share: a RequestTimer on a test
wheel, the wheel's lock held as another process holds it, Gunicorn's
hooks on a request it parsed, a greenlet module that runs Python where
the C path least expects it, and the waits on a driver.  Not collected
(no test_ prefix): the test modules import it.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

from conftest import mutex_span

import shmwheel
from shmwheel._binding import ffi
from shmwheel.contrib._record import DEFAULT_TRACEBACK_SIGNAL
from shmwheel.contrib._worker import RequestTimer

WAIT = 30.0  # seconds: how long a test waits for a process, a driver or a wheel
_libc = ctypes.CDLL(None, use_errno=True)


def _timer(wheel: shmwheel.Wheel, **kw: object) -> RequestTimer:
    kw.setdefault("traceback_signal", None if not kw else DEFAULT_TRACEBACK_SIGNAL)
    timer = RequestTimer(wheel.name, 30.0, **kw)  # type: ignore[arg-type]
    assert timer.prepare()
    return timer


def _hold(wheel: shmwheel.Wheel, held: threading.Event, until: Callable[[], bool], linger: float = 0.0) -> None:
    """Hold the segment's lock from this thread, as another process would,
    until ``until()`` (looked at every millisecond) and ``linger`` seconds
    more, or for WAIT seconds at most: a test that needs the lock held while
    something happens waits for that something, not for a time a loaded
    machine may overrun."""
    mutex = ctypes.c_void_p(int(ffi.cast("uintptr_t", wheel._buf)) + mutex_span()[0])
    assert _libc.pthread_mutex_lock(mutex) == 0
    held.set()
    give_up = time.monotonic() + WAIT
    while not until() and time.monotonic() < give_up:
        time.sleep(0.001)
    time.sleep(linger)
    assert _libc.pthread_mutex_unlock(mutex) == 0


RAW_REQUESTS = [
    b"GET /api/v1/items/12345 HTTP/1.1\r\nHost: h\r\nX-Request-Id: req-abc-123\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: h\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-Request-Id: first\r\nX-Request-Id: second\r\n\r\n",  # the first, as for any header
    b"POST /a/%C3%A9?q=1 HTTP/1.1\r\nx-request-id: low.er\r\nContent-Length: 0\r\n\r\n",
    b"GET /x HTTP/1.1\r\nX-Request-Id: has space\r\n\r\n",
    b"GET /" + b"p" * 300 + b" HTTP/1.1\r\n\r\n",  # cut to fit: the Python hook's way
    b"GET /x HTTP/1.1\r\nX-Request-Id: \r\nX-Request-Id: abc\r\n\r\n",  # the first that is not empty
]


def _gunicorn_request(raw: bytes) -> object:
    from gunicorn.config import Config
    from gunicorn.http.parser import RequestParser

    return next(iter(RequestParser(Config(), [raw], ("127.0.0.1", 1))))


def _gunicorn_hooks(wheel: shmwheel.Wheel, monkeypatch, **kw: object) -> tuple[dict[str, Any], RequestTimer]:
    """install()'s hooks in a namespace, with the worker's timer on ``wheel`` as post_worker_init leaves it."""
    from shmwheel.contrib import gunicorn as contrib_gunicorn

    if kw.pop("fresh_state", True):
        monkeypatch.setattr(contrib_gunicorn, "_state", contrib_gunicorn._State())
    hooks: dict[str, Any] = dict(kw.pop("namespace", {}))  # type: ignore[call-overload]
    contrib_gunicorn.install(hooks, 30.0, name=wheel.name, tracebacks=False, **kw)  # type: ignore[arg-type]
    settings = contrib_gunicorn._state.settings
    assert settings is not None
    timer = contrib_gunicorn._state.timer = contrib_gunicorn._timer(wheel.name, settings)
    assert timer.prepare()
    return hooks, timer


def _greenlet_that_meddles(monkeypatch, meddle: Any) -> None:
    """A greenlet module whose getcurrent() runs ``meddle()`` (as a finalizer
    run by its allocation could) and then answers "the thread's own"."""

    class Current:
        parent = None

    def getcurrent() -> Current:
        meddle()
        return Current()

    monkeypatch.setitem(sys.modules, "greenlet", types.SimpleNamespace(getcurrent=getcurrent))


def _reuse_freed_memory(junk: list[str]) -> None:
    junk.extend("Z" * 40 + str(k) for k in range(2000))


def driver_pid(name: str) -> int | None:
    with shmwheel._wheel.observe(name) as w:
        return w.stats().driver_pid


def wait_until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    give_up = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < give_up, what
        time.sleep(0.02)
