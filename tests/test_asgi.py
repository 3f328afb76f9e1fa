"""The ASGI middleware against a real wheel, and the driver its workers start
by themselves.  (test_servers.py runs it under real Uvicorn, Gunicorn and
Hypercorn servers.)"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shmwheel
from shmwheel.contrib import PAYLOAD_SIZE, decode_request
from shmwheel.contrib import gunicorn as contrib_gunicorn
from shmwheel.contrib._record import KIND_FINISHED
from shmwheel.contrib.asgi import TIMED, TimeoutMiddleware, own_wheel_name

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


def own_way_of(mw: TimeoutMiddleware) -> list[object]:
    """The calls that take the middleware's own (Python) way from now on."""
    calls: list[object] = []
    own = mw._call
    mw._call = lambda *a: calls.append(a) or own(*a)  # type: ignore[method-assign]
    return calls


def http(path: str = "/", headers: list[tuple[bytes, bytes]] | None = None) -> dict[str, Any]:
    return {"type": "http", "method": "GET", "path": path, "headers": headers or [], "query_string": b""}


@pytest.mark.parametrize("path", ["/cafe", "/café"], ids=["in-c", "own-path"])
def test_a_request_is_timed_until_its_response_is_complete(make_wheel, path: str) -> None:
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
    assert mw.timer.prepare()  # the timer of this process, as at lifespan: the requests may take the C way
    sent = run(mw, http(path, [(b"x-request-id", b"abc-1")]))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body", "http.response.body"]
    assert pending == [1, 1, 0] and isinstance(handles[0], int)
    assert wheel.stats().cancelled == 1

    # The timer carries the request, should it fire.
    async def stuck(scope: Any, receive: Any, send: Any) -> None:
        [fire] = wheel.poll(time.monotonic() + 3600)
        record = decode_request(fire.payload)
        assert record is not None and (record.method, record.path, record.request_id) == ("GET", path, "abc-1")
        assert record.pid == os.getpid() and record.task_kind == "task"

    stuck_mw = TimeoutMiddleware(stuck, 30.0, name=wheel.name, tracebacks=False)
    assert stuck_mw.timer.prepare()
    run(stuck_mw, http(path, [(b"x-request-id", b"abc-1")]))
    assert wheel.stats().cancelled == 1  # it fired: nothing to cancel; its driver is told it finished
    [word] = wheel.poll(time.monotonic() + 7200)
    finished = decode_request(word.payload)
    assert finished is not None and finished.kind == KIND_FINISHED and finished.request_id == "abc-1"


def test_a_request_whose_app_raises_is_cancelled(make_wheel) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        assert len(wheel) == 1
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run(TimeoutMiddleware(broken, 30.0, name=wheel.name, tracebacks=False), http())
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


def test_an_app_wrapped_twice_is_timed_once_by_the_outer_middleware(make_wheel, caplog) -> None:
    """The inner middleware passes the request through, and says once that
    its settings do nothing, naming the outer one's, which win."""
    outer_wheel, inner_wheel = make_wheel(payload_size=PAYLOAD_SIZE), make_wheel(payload_size=PAYLOAD_SIZE)
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(len(outer_wheel) + len(inner_wheel))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    inner = TimeoutMiddleware(app, 20.0, name=inner_wheel.name, tracebacks=False, interrupt=True)
    outer = TimeoutMiddleware(inner, 30.0, name=outer_wheel.name, tracebacks=False)
    with caplog.at_level(logging.WARNING, "shmwheel"):
        run(outer, http())
        run(outer, http())
    assert seen == [1, 1]
    assert (outer_wheel.stats().added, inner_wheel.stats().added) == (2, 0)
    # (Other lines may come too: after test_sentry, that the timeouts reach
    # no error tracker.)
    [said] = [r.getMessage() for r in caplog.records if "inside another" in r.getMessage()]
    assert said == (
        f"shmwheel: {__name__}.test_an_app_wrapped_twice_is_timed_once_by_the_outer_middleware.<locals>.app is "
        "wrapped in shmwheel.contrib.asgi.TimeoutMiddleware (timeout 20 s, interrupt) inside another, which times its "
        f"requests already (timeout 30 s, on wheel {outer_wheel.name!r}): the outer one's settings win, and this "
        "one's do nothing; wrap the application once"
    )


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


def test_the_c_way_files_what_the_middlewares_own_way_files(make_wheel) -> None:
    """The same record, task and table entry, and the same scope for the application."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    got: list[tuple[Any, Any, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        timer = mw.timer
        active = timer._active[scope[TIMED]]
        got.append((active._replace(payload=b"", deadline_ns=0, handle=0, timeout_ns=0), active.payload, scope))
        assert active.task is asyncio.current_task()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare()
    headers = [(b"host", b"x"), (b"x-request-id", b"r-7"), (b"x-request-id", b"second")]
    calls = own_way_of(mw)
    run(mw, http("/a/b", headers))
    assert calls == [], "the request did not take the C way"
    mw._in_c = None
    run(mw, http("/a/b", headers))
    assert len(calls) == 1
    (a, pa, sa), (b, pb, sb) = got
    assert a._replace(task=None) == b._replace(task=None) and a.task is not None and b.task is not None
    assert pa[:16] + pa[24:32] + pa[40:] == pb[:16] + pb[24:32] + pb[40:]  # all but the start and the task's id
    assert {k: v for k, v in sa.items() if k != TIMED} == {k: v for k, v in sb.items() if k != TIMED}
    assert len(wheel) == 0 and wheel.stats().cancelled == 2


def test_servers_see_a_coroutine_function_and_the_c_way_has_no_coroutine_of_the_middlewares(make_wheel) -> None:
    """Uvicorn, Hypercorn, Starlette and asgiref tell ASGI 3 from ASGI 2 by
    ``__call__`` being a coroutine function; the C ``__call__`` is one to
    them all, and an HTTP request's call gives back the C awaitable, not a
    coroutine of the middleware's own."""
    from hypercorn.utils import is_asgi

    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    done: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        done.append(scope["type"])
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    own_way = own_way_of(mw)
    for call in (mw.__call__, TimeoutMiddleware.__call__):
        assert inspect.iscoroutinefunction(call) and asyncio.iscoroutinefunction(call)
    assert is_asgi(mw)
    own_parameters = list(inspect.signature(TimeoutMiddleware._call).parameters.values())[1:4]
    assert list(inspect.signature(mw).parameters.values()) == own_parameters
    assert mw.__call__.__qualname__ == "TimeoutMiddleware.__call__"
    assert mw.timer.prepare()

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    async def main() -> None:
        call = mw(http("/x"), receive, send)
        assert type(call).__name__ == "Then", type(call)
        assert len(wheel) == 0, "the call started the request before it was awaited"
        await call
        assert own_way == [] and done == ["http"]
        await mw({"type": "lifespan"}, receive, send)  # what the C way does not take: the method's own way
        assert len(own_way) == 1 and done == ["http", "lifespan"]

    asyncio.run(main())
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


def test_a_call_closed_thrown_into_or_dropped_before_it_starts_starts_nothing(make_wheel) -> None:
    """As a coroutine that has not run its first line: closed, it ends;
    what is thrown into it is raised from it; dropped, Python warns."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    ran: list[object] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        ran.append(scope)

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare()
    call = mw(http("/x"), app, app)
    with pytest.raises(TypeError, match="just-started"):
        call.send(1)
    assert call.close() is None
    with pytest.raises(RuntimeError):
        call.send(None)  # closed: nothing to run any more
    call = mw(http("/x"), app, app)
    with pytest.raises(TypeError):
        call.throw(1)  # not an exception: refused, and the call is left as it was
    with pytest.raises(KeyError, match="thrown"):
        call.throw(KeyError("thrown"))
    with pytest.raises(RuntimeError):
        call.send(None)
    with pytest.warns(RuntimeWarning, match="coroutine 'TimeoutMiddleware.__call__' was never awaited"):
        mw(http("/x"), app, app)
        gc.collect()
    assert ran == [] and len(wheel) == 0 and wheel.stats().added == 0


def test_a_forked_child_times_its_requests_on_a_timer_of_its_own_and_the_c_way_again(make_wheel) -> None:
    """The C way keeps the RequestTimer it read; in a forked child that is
    the parent's, which serves no request there: the child's first request
    takes the Python way, which makes the child's own, and the C way reads
    that for the next."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    calls = own_way_of(mw)
    assert mw.timer.prepare()
    run(mw, http("/parent"))
    assert calls == [], "the parent's request did not take the C way"
    parent_timer = mw.timer
    pid = os.fork()
    if pid == 0:  # the child: no pytest here, an exit status
        status = 1
        try:
            run(mw, http("/child/1"))
            run(mw, http("/child/2"))
            run(mw, http("/child/3"))
            ok = len(calls) == 1 and mw.timer is not parent_timer and not mw.timer._active
            status = 0 if ok else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's requests did not take the ways they should"
    assert len(wheel) == 0 and wheel.stats().cancelled == 4


def test_a_cancelled_last_send_reaches_the_server_and_ends_the_timer(make_wheel, path: str) -> None:
    """A task cancelled while the server sends the last body: the server's
    send sees the cancellation (Then.throw), and the timer ends."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x"})

    async def main() -> None:
        mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
        assert mw.timer.prepare()
        stuck = asyncio.Event()

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body":
                stuck.set()
                try:
                    await asyncio.sleep(3600)  # a client that reads nothing
                except asyncio.CancelledError:
                    seen.append("cancelled in the server's send")
                    raise

        task = asyncio.ensure_future(mw(http("/x"), receive, send))
        await stuck.wait()
        assert len(wheel) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    asyncio.run(main())
    assert seen == ["cancelled in the server's send"]
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


def test_a_loop_run_inside_another_in_one_thread_gets_its_own_tasks_named(make_wheel) -> None:
    """The C way keeps the loop it last found running; a loop run inside
    another's task (the _set_running_loop(None) idiom of sync helpers) is
    told apart, and the request's own task is recorded, not the outer one."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    seen: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(mw.timer._active[scope[TIMED]].task is asyncio.current_task())
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare()

    async def outer() -> None:
        await mw(http("/outer"), receive, send)
        running = asyncio.events._get_running_loop()
        asyncio.events._set_running_loop(None)
        try:
            inner = asyncio.new_event_loop()
            try:
                inner.run_until_complete(mw(http("/inner"), receive, send))
            finally:
                inner.close()
        finally:
            asyncio.events._set_running_loop(running)
        await mw(http("/outer-again"), receive, send)

    asyncio.run(outer())
    assert seen == [True, True, True]
    assert len(wheel) == 0 and wheel.stats().cancelled == 3


def test_a_cancellation_reaches_the_app_through_a_send_whose_awaitable_has_no_throw(make_wheel, path: str) -> None:
    """A server's send may give back any awaitable: one whose iterator has
    no throw() gets the cancellation raised at the await, as a coroutine
    awaiting it would."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    got: list[str] = []

    class Waiting:
        def __iter__(self) -> Waiting:
            return self

        def __next__(self) -> None:
            return None  # a bare yield: the loop runs the task again at once

    class Pending:
        def __await__(self) -> Waiting:
            return Waiting()

    def send(message: Message) -> Any:
        return Pending() if message["type"] == "http.response.body" else asyncio.sleep(0)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        try:
            await send({"type": "http.response.body", "body": b"x"})
        except BaseException as exc:
            got.append(type(exc).__name__)
            raise

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def main() -> None:
        mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
        assert mw.timer.prepare()
        task = asyncio.ensure_future(mw(http("/x"), receive, send))
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(wheel) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert got == ["CancelledError"]
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


@pytest.mark.parametrize("end", ["returns", "raises", "cancelled", "closed", "not awaitable"])
def test_the_c_way_ends_the_timer_however_the_applications_call_ends(make_wheel, end: str) -> None:
    """No last message: the application returns without one, raises, is
    cancelled while it waits, is closed while it waits (its coroutine
    dropped), or is not an ASGI 3 application at all."""

    class Pause:
        value = object()

        def __await__(self) -> Any:
            yield self.value

    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    waiting = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert len(wheel) == 1
        if end == "raises":
            raise RuntimeError("boom")
        if end == "cancelled":
            waiting.set()
            await asyncio.sleep(3600)
        if end == "closed":
            await Pause()

    def asgi2(scope: Any) -> Any:  # ASGI 2: a callable that gives back the application
        return app

    mw = TimeoutMiddleware(asgi2 if end == "not awaitable" else app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare()
    mw._call = None  # type: ignore[assignment,method-assign]  # the request must take the C way

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        raise AssertionError("nothing is sent")

    async def main() -> None:
        call = mw(http("/x"), receive, send)
        if end == "closed":  # run up to its first wait, and dropped there
            assert call.send(None) is Pause.value and len(wheel) == 1
            call.close()
            return
        task = asyncio.ensure_future(call)
        if end == "cancelled":
            await waiting.wait()
            assert len(wheel) == 1
            task.cancel()
        await task

    raised = {"raises": RuntimeError, "cancelled": asyncio.CancelledError, "not awaitable": TypeError}.get(end)
    with pytest.raises(raised) if raised else contextlib.nullcontext():  # type: ignore[attr-defined]
        asyncio.run(main())
    assert len(wheel) == 0 and wheel.stats().added == 1 and wheel.stats().cancelled == 1


class _Message(dict):  # type: ignore[type-arg]
    """A message that is not exactly a dict, as a framework may send."""


@pytest.mark.parametrize(
    "message",
    [
        {"type": "http.response.body", "body": b"x"},
        {"type": "http.response.body", "body": b"x", "more_body": True},
        {"type": "http.response.body", "body": b"x", "more_body": False},
        {"type": "http.response.zerocopysend", "file": None},
        {"type": "http.response.zerocopysend", "file": None, "more_body": 1},
        {"type": "http.response.pathsend", "path": "/x"},
        {"type": "http.response.trailers", "headers": []},
        {"type": b"http.response.body", "body": b"x"},
        _Message(type="http.response.body", body=b"x"),
        _Message(type="http.response.body", body=b"x", more_body=True),
    ],
    ids=lambda m: f"{type(m).__name__}-{m['type']!s}-{m.get('more_body', '')}",
)
def test_the_timer_ends_at_the_message_that_completes_the_response(make_wheel, message: Message, path: str) -> None:
    """The C way and the middleware's own agree with asgi._completes."""
    from shmwheel.contrib.asgi import _completes

    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    pending: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send(message)
        pending.append(len(wheel))

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare()
    if path == "c":
        mw._call = None  # type: ignore[assignment,method-assign]  # the request must take the C way
    run(mw, http("/x"))
    assert pending == [0 if _completes(message) else 1]
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


def test_a_stuck_requests_stack_goes_through_the_c_way_down_to_the_application(make_wheel) -> None:
    """The C way's awaitable has no frame of its own: the stack a timeout
    logs goes through it (its cr_await) to the application's frames."""
    from shmwheel.contrib._stacks import _await_chain

    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    waiting = asyncio.Event()

    async def stuck_in_the_application(scope: Any, receive: Any, send: Any) -> None:
        waiting.set()
        await asyncio.sleep(3600)

    mw = TimeoutMiddleware(stuck_in_the_application, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare()
    mw._call = None  # type: ignore[assignment,method-assign]  # the request must take the C way

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    async def main() -> list[str]:
        call = mw(http("/x"), receive, receive)
        task = asyncio.ensure_future(call)
        await waiting.wait()
        chain = _await_chain(task.get_coro(), task)
        # What asyncio and inspect read of a task's coroutine, and the
        # refusal of a second await while the first holds it.
        assert inspect.getcoroutinestate(call) == inspect.CORO_SUSPENDED
        assert "TimeoutMiddleware.__call__" in repr(task)
        with pytest.raises(RuntimeError, match="being awaited already"):
            await call
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return chain

    chain = "\n".join(asyncio.run(main()))
    assert "in stuck_in_the_application" in chain and "in sleep" in chain and "awaiting <Future" in chain
    assert chain.count("in stuck_in_the_application") == 1
    assert len(wheel) == 0


def test_the_c_ways_call_dropped_unawaited_ends_its_timer(make_wheel) -> None:
    """As a coroutine's finally runs when it is collected."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare() and mw._in_c is not None

    async def main() -> None:
        call = mw._in_c(http("/x"), app, app)
        assert call is not None and len(wheel) == 1 and len(mw.timer._active) == 1
        with pytest.warns(RuntimeWarning, match="never awaited"):  # the application's coroutine, dropped with it
            del call
            gc.collect()

    asyncio.run(main())
    assert len(wheel) == 0 and not mw.timer._active and wheel.stats().cancelled == 1


def test_the_c_ways_call_goes_on_timed_after_an_error_that_did_not_end_it(make_wheel) -> None:
    """throw() with arguments the coroutine refuses raises before it runs:
    the application has not ended, nor has its timer."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)

    class Pause:
        def __await__(self) -> Any:
            yield None

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await Pause()

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare() and mw._in_c is not None

    async def main() -> None:
        call: Any = mw._in_c(http("/x"), app, app)
        assert call.send(None) is None  # at the pause
        with pytest.raises(TypeError):
            call.throw()
        assert len(wheel) == 1
        with pytest.raises(StopIteration):
            call.send(None)
        assert len(wheel) == 0

    asyncio.run(main())
    assert wheel.stats().cancelled == 1


@types.coroutine
def _generated_coroutine() -> Any:
    yield None


class _AwaitsACoroutine:
    def __await__(self) -> Any:
        return _generated_coroutine()


@pytest.mark.parametrize(
    ("gives", "match"),
    [("a plain generator", "generator"), ("an __await__ that returns a coroutine", "coroutine")],
)
def test_what_await_refuses_of_an_application_is_refused(make_wheel, path: str, gives: str, match: str) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)

    class Generating:
        def __call__(self, scope: Any, receive: Any, send: Any) -> Any:
            yield None

    def awaits_a_coroutine(scope: Any, receive: Any, send: Any) -> Any:
        return _AwaitsACoroutine()

    app = Generating() if gives == "a plain generator" else awaits_a_coroutine
    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare()
    with pytest.raises(TypeError, match=match):
        run(mw, http("/x"))
    assert len(wheel) == 0 and wheel.stats().added == wheel.stats().cancelled == 1


def test_a_request_on_a_loop_dropped_unclosed_is_collected_and_its_timer_ends(make_wheel, path: str) -> None:
    """The C way keeps asyncio's running-loop holder, which the GC does not
    see and which holds its loop: dropped with the middleware (whose table
    of requests holds the task), at an interpreter's exit say, the loop,
    its task and the request are collected all the same, the application's
    finally runs and the timer ends."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    log: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            log.append("finally")

    async def receive() -> Message:
        return {"type": "http.disconnect"}

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare()
    loop = asyncio.new_event_loop()
    task = loop.create_task(mw(http("/x"), receive, receive))
    loop.run_until_complete(asyncio.sleep(0.01))
    assert len(wheel) == 1
    dropped = weakref.ref(loop)
    del task, loop, mw
    gc.collect()
    assert dropped() is None and log == ["finally"]
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


class _Inner(Exception):
    pass


class _EndFailed(Exception):
    pass


@pytest.mark.parametrize("end", ["raises", "closed"])
def test_an_end_of_the_timer_that_fails_chains_as_a_finally_would(make_wheel, path: str, end: str) -> None:
    """The application raises (or its coroutine is closed) and ending the
    timer raises too, from within an except block of its own: the error
    that comes out has that block's exception, then the application's (or
    GeneratorExit), as its context, as a ``finally`` that raises has it."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)

    class Pause:
        def __await__(self) -> Any:
            yield None

    def fail_the_end() -> None:
        timer = mw.timer
        finish = type(timer).finish

        def failing(handle: int | None) -> None:
            finish(timer, handle)  # ends it, then fails
            try:
                raise _Inner("while ending")
            except _Inner:
                raise _EndFailed("ending failed")  # noqa: B904 - the chain is what is tested

        timer._fast = None  # the end goes through RequestTimer.finish
        timer.finish = failing  # type: ignore[method-assign]

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert len(wheel) == 1
        if end == "raises":
            fail_the_end()
            raise ValueError("the application's")
        await Pause()

    mw = TimeoutMiddleware(app, 30.0, name=wheel.name, tracebacks=False)
    assert mw.timer.prepare()

    async def main() -> BaseException:
        call = mw(http("/x"), app, app)
        try:
            if end == "raises":
                await call
            else:
                call.send(None)  # to the pause
                fail_the_end()
                call.close()
        except BaseException as exc:
            return exc
        raise AssertionError("nothing was raised")

    error: BaseException | None = asyncio.run(main())
    chain = []
    while error is not None:
        chain.append(type(error).__name__)
        error = error.__context__
    assert chain == ["_EndFailed", "_Inner", "ValueError" if end == "raises" else "GeneratorExit"]
    assert len(wheel) == 0 and wheel.stats().cancelled == 1
