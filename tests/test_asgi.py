"""The ASGI middleware against a real wheel, and the driver its workers start
by themselves.  (test_servers.py runs it under real Uvicorn, Gunicorn and
Hypercorn servers.)"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shmwheel
from shmwheel.contrib import gunicorn as contrib_gunicorn
from shmwheel.contrib.asgi import TIMED, TimeoutMiddleware, own_wheel_name
from shmwheel.contrib.timeouts import PAYLOAD_SIZE, decode_request

WAIT = 30.0

Message = dict[str, Any]


def run(app: Any, scope: dict[str, Any], incoming: list[Message] | None = None) -> list[Message]:
    """Call an ASGI app as a server does; the messages it sent."""
    sent: list[Message] = []
    queue = list(incoming or [{"type": "http.request", "body": b"", "more_body": False}])

    async def receive() -> Message:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def http(path: str = "/", headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"type": "http", "method": "GET", "path": path, "headers": headers or [], "query_string": b""}


def test_a_request_is_timed_until_its_response_is_complete(make_wheel) -> None:
    """Not until the app returns: what it does after the last body (a background task) is not timed."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    pending: list[int] = []
    handles: list[object] = []

    async def app(scope: Any, receive: Any, send: Callable[[Message], Any]) -> None:
        handles.append(scope[TIMED])
        pending.append(len(wheel))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        pending.append(len(wheel))
        await send({"type": "http.response.body", "body": b"b"})
        pending.append(len(wheel))  # a background task, after the response

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    sent = run(mw, http("/café", [(b"x-request-id", b"abc-1")]))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert pending == [1, 1, 0] and isinstance(handles[0], int)
    assert wheel.stats().cancelled == 1

    # The timer carries the request, should it fire.
    async def stuck(scope: Any, receive: Any, send: Any) -> None:
        [fire] = wheel.poll(time.monotonic() + 3600)
        record = decode_request(fire.payload)
        assert record is not None and (record.method, record.path, record.request_id) == ("GET", "/café", "abc-1")
        assert record.pid == os.getpid()

    run(TimeoutMiddleware(stuck, 30.0, name=wheel.name, tracebacks=False), http("/café", [(b"x-request-id", b"abc-1")]))
    assert len(wheel) == 0 and wheel.stats().cancelled == 1  # it fired: nothing to cancel


def test_a_request_whose_app_raises_is_cancelled(make_wheel) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        assert len(wheel) == 1
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run(TimeoutMiddleware(broken, 30.0, name=wheel.name, tracebacks=False), http())
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


def test_an_app_wrapped_twice_is_timed_once_by_the_outer_middleware(make_wheel) -> None:
    outer_wheel, inner_wheel = make_wheel(payload_size=PAYLOAD_SIZE), make_wheel(payload_size=PAYLOAD_SIZE)
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(len(outer_wheel) + len(inner_wheel))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    inner = TimeoutMiddleware(app, 30.0, name=inner_wheel.name, tracebacks=False)
    run(TimeoutMiddleware(inner, 30.0, name=outer_wheel.name, tracebacks=False), http())
    assert seen == [1]
    assert (outer_wheel.stats().added, inner_wheel.stats().added) == (1, 0)


def test_websockets_are_timed_only_when_asked_and_lifespan_passes_through(make_wheel) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    seen: list[tuple[str, bool, int]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((scope["type"], TIMED in scope, len(wheel)))
        if scope["type"] == "websocket":
            await send({"type": "websocket.accept"})
            await send({"type": "websocket.close"})
            seen.append(("after close", False, len(wheel)))

    ws = {"type": "websocket", "path": "/ws", "headers": []}
    run(TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False), ws, [{"type": "websocket.connect"}])
    run(TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False, websocket=True), ws)
    run(TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False), {"type": "lifespan"})
    assert seen == [
        ("websocket", False, 0),
        ("after close", False, 0),
        ("websocket", True, 1),
        ("after close", False, 0),  # the connection is over once closed
        ("lifespan", False, 0),
    ]
    assert wheel.stats().added == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeout": 0}, ValueError, "positive"),
        ({"timeout": "5"}, TypeError, "number of seconds"),
        ({"timeout": 1, "name": "a b"}, ValueError, "invalid wheel name"),
        ({"timeout": 1, "websocket": 1}, TypeError, "websocket must be True or False"),
        ({"timeout": 1, "kill_signal": "NOPE"}, ValueError, "no signal named"),
        ({"timeout": 1, "capacity": 0}, ValueError, "capacity must be between"),
    ],
)
def test_the_middleware_refuses_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass

    with pytest.raises(error, match=match):
        TimeoutMiddleware(app, **kwargs)
    with pytest.raises(TypeError, match="ASGI application"):
        TimeoutMiddleware("app", timeout=1)  # type: ignore[arg-type]


def test_a_process_of_its_own_names_the_wheel_after_itself() -> None:
    assert own_wheel_name() == f"asgi-{os.getpid()}"


@pytest.mark.filterwarnings("ignore:The `uvicorn.workers` module is deprecated:DeprecationWarning")
def test_gunicorn_tells_how_each_worker_class_is_timed() -> None:
    from gunicorn.workers.gasgi import ASGIWorker
    from gunicorn.workers.gthread import ThreadWorker
    from gunicorn.workers.sync import SyncWorker
    from uvicorn.workers import UvicornWorker as OldUvicornWorker
    from uvicorn_worker import UvicornH11Worker, UvicornWorker

    how = contrib_gunicorn.how_timed
    assert how(SyncWorker) == how(ThreadWorker) == contrib_gunicorn.HOOKS
    assert how(UvicornWorker) == how(UvicornH11Worker) == how(OldUvicornWorker) == how(ASGIWorker)
    assert how(UvicornWorker) == contrib_gunicorn.WRAP
    assert how(object) == contrib_gunicorn.NONE


# -- the driver the workers start ------------------------------------------------------

# A server as Uvicorn and Hypercorn are: a main process that starts workers
# with multiprocessing's spawn.  Each worker wraps an app in the middleware,
# gets ready (the wheel, its driver) and says its pid and wheel; "start" on
# stdin starts one more, "stop" stops them all.
SERVER = textwrap.dedent(
    """
    import multiprocessing, sys
    from shmwheel.contrib.asgi import TimeoutMiddleware

    async def app(scope, receive, send):
        pass

    def worker(ready, stop):
        timer = TimeoutMiddleware(app, 30.0, tracebacks=False).timer
        assert timer.prepare()
        ready.put((multiprocessing.current_process().pid, timer.name))
        stop.wait()

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        ready, stop, workers = ctx.Queue(), ctx.Event(), []
        for line in sys.stdin:
            if line.strip() == "start":
                workers.append(ctx.Process(target=worker, args=(ready, stop)))
                workers[-1].start()
                print(*ready.get(), flush=True)
            else:
                stop.set()
                for w in workers:
                    w.join()
                break
    """
)


def driver_of(name: str) -> int | None:
    with shmwheel._wheel.observe(name) as wheel:
        return wheel.stats().driver_pid


def wait_until(condition: Callable[[], object], what: str) -> None:
    give_up = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < give_up, what
        time.sleep(0.02)


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def test_workers_start_one_driver_which_outlives_signals_and_removes_the_wheel_after_them(tmp_path: Path) -> None:
    """The first worker makes the wheel and starts the driver; the second
    finds it running; SIGTERM does not end a driver whose wheel is in use; a
    SIGKILLed one is replaced by the next worker to look, which takes the
    wheel over; once the workers have exited the driver removes the wheel
    and exits."""
    (tmp_path / "server.py").write_text(SERVER)
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, str(tmp_path / "server.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out
        )
    assert server.stdin is not None and server.stdout is not None
    name = f"asgi-{server.pid}"
    drivers: list[int] = []

    def start() -> tuple[int, str]:
        server.stdin.write(b"start\n")  # type: ignore[union-attr]
        server.stdin.flush()  # type: ignore[union-attr]
        pid, wheel = server.stdout.readline().split()  # type: ignore[union-attr]
        return int(pid), wheel.decode()

    def new_driver() -> int:
        wait_until(lambda: driver_of(name) not in (None, *drivers), "no new driver")
        pid = driver_of(name)
        assert pid is not None
        drivers.append(pid)
        return pid

    try:
        assert start()[1] == name  # named after the server, not the worker
        first = new_driver()
        assert start()[1] == name
        os.kill(first, signal.SIGTERM)  # as systemd sends it to every process of the service
        time.sleep(1.5)
        assert driver_of(name) == first and not gone(first)

        os.kill(first, signal.SIGKILL)
        wait_until(lambda: gone(first), "the driver outlived SIGKILL")
        assert start()[1] == name  # a worker that finds no driver starts one
        second = new_driver()
        server.communicate(b"stop\n", timeout=WAIT)
        wait_until(lambda: not Path("/dev/shm", name).exists(), "the wheel outlived its workers")
        wait_until(lambda: gone(second), "the driver of an unused wheel did not exit")
        text = log.read_text()
        assert f"driver {second}: took over wheel {name!r} from driver {first}" in text
        assert f"driver {second}: stopping: wheel {name!r} is not used any more" in text
        assert "shmwheel.contrib.timeouts:" not in text  # no second driver refused: one started at a time
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        for pid in drivers:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(shmwheel.SegmentNotFoundError):
            shmwheel.unlink(name)
