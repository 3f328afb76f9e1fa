"""The one door to the C path (shmwheel.contrib._door): the extension
refused beside a core built from other sources, and a request that the
C path gives back taken by each adapter's waiting path, never by C
again."""

from __future__ import annotations

import subprocess
import sys
import threading
import types
from typing import Any

import pytest
from _contrib import RAW_REQUESTS, _gunicorn_hooks, _gunicorn_request, _hold

from shmwheel import _fast
from shmwheel._binding import lib
from shmwheel.contrib.wsgi import TimeoutMiddleware


def test_the_fast_module_refuses_to_load_beside_a_core_built_from_other_sources() -> None:
    # _fast calls the cffi module's functions by address: a stale build of
    # either one would call them with the wrong arguments.
    assert _fast.API_VERSION == lib.SHMW_API_VERSION
    stale = (
        "import sys, types; sys.modules['shmwheel._fast'] = types.SimpleNamespace(API_VERSION=1); "
        "import shmwheel.contrib.wsgi"
    )
    run = subprocess.run([sys.executable, "-c", stale], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1].startswith("ImportError: shmwheel: shmwheel._fast and shmwheel._shmwheel in "), (
        run.stderr
    )
    assert "were built from different versions of the C sources" in run.stderr


@pytest.mark.parametrize("way", ["wsgi-direct", "wsgi", "gunicorn", "asgi"])
def test_a_request_the_c_path_gives_back_takes_the_waiting_path_without_trying_c_again(
    make_wheel, monkeypatch, way: str
) -> None:
    """With the lock held by another process, each adapter's C path tries
    the request once and gives it back; the adapter's own path then waits
    for the lock (the GIL let go), not trying C again: the Clerk declined
    one request, and the request has its timer."""
    from shmwheel.contrib import asgi as contrib_asgi

    wheel = make_wheel(payload_size=256)
    handles: list[int] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        handles.append(environ["shmwheel.handle"])
        return [b"ok"]

    if way == "gunicorn":
        hooks, timer = _gunicorn_hooks(wheel, monkeypatch)
        req: Any = _gunicorn_request(RAW_REQUESTS[0])
    elif way == "asgi":

        async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            handles.append(scope["shmwheel.handle"])

        middleware = contrib_asgi.TimeoutMiddleware(asgi_app, name=wheel.name, timeout=30.0, tracebacks=False)
        timer = middleware.timer
        assert timer.prepare() and middleware._in_c is not None
    else:
        wsgi = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None)
        timer = wsgi.timer
        assert timer.prepare()
    fast = timer._fast
    assert fast is not None and fast.declined == 0

    # Held until the C path has given the request back, and 0.2 s more for
    # the adapter's own path to wait in.
    held = threading.Event()
    holder = threading.Thread(target=_hold, args=(wheel, held, lambda: fast.declined > 0, 0.2))
    holder.start()
    held.wait()
    try:
        if way == "gunicorn":
            hooks["pre_request"](None, req)
            handles.append(req.shmwheel_handle)
        elif way == "asgi":
            scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}

            async def receive() -> dict[str, Any]:
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                pass

            import asyncio

            asyncio.run(middleware(scope, receive, send))  # the timer ends with the call
        else:
            call = wsgi.direct() if way == "wsgi-direct" else wsgi
            body = call({"REQUEST_METHOD": "GET", "PATH_INFO": "/x"}, lambda *a: None)
    finally:
        holder.join()
    assert fast.declined == 1, f"the C path tried the request {fast.declined} times"
    assert len(handles) == 1 and handles[0] is not None, "the request took no timer"
    if way == "gunicorn":
        hooks["post_request"](None, req, {}, None)
    elif way != "asgi":
        body.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0 and not timer._active


def test_every_adapter_takes_the_c_path_only_as_the_door_says(make_wheel, monkeypatch, path: str) -> None:
    """Each adapter asks the door (in_c) once, as it is made, whether its
    requests may take the C path: the ``path`` fixture, which answers
    there, decides the way of the WSGI middleware and its direct() call,
    of the ASGI middleware and of Gunicorn's hooks alike."""
    from shmwheel.contrib import asgi as contrib_asgi

    wheel = make_wheel(payload_size=256)
    in_c = path == "c"
    wsgi = TimeoutMiddleware(lambda e, s: [b""], wheel.name, 30.0, traceback_signal=None)
    assert wsgi._plain is in_c and (type(wsgi.direct()) is _fast.WSGI) is in_c

    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass

    asgi = contrib_asgi.TimeoutMiddleware(app, name=wheel.name, timeout=30.0, tracebacks=False)
    assert (type(asgi._in_c) is _fast.ASGI) is in_c
    hooks, _ = _gunicorn_hooks(wheel, monkeypatch)
    assert isinstance(hooks["pre_request"], types.BuiltinMethodType) is in_c
