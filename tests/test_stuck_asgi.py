"""End to end: the stack of a request stuck each way an ASGI request can be,
under Uvicorn, Hypercorn and Gunicorn's Uvicorn worker, each with two workers.

The application is ``tests/apps/asgi_stuck.py`` behind the ASGI middleware
(a 1 s timeout, no kill): each stuck request times out once in the driver's
log, with its path, request ID, worker pid, thread and task, and its worker
writes the request's own stack to the server's error log down to the
function it is stuck in: the await chain of a task that awaits, the loop
thread's frames when the task blocks the event loop, the pool's thread for
a synchronous endpoint.  A regex that holds the GIL lets no Python run: the
driver says so, and faulthandler's dump of every thread follows.  The
requests go one at a time: one that blocks its worker's loop is done before
the next is sent, so no report shows another request's doing.  Last, without a
server, the middleware and the stacks of a trio task (Hypercorn's trio
worker, where asyncio runs no loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import signal
import sys
import threading
from collections.abc import Coroutine, Generator
from pathlib import Path
from typing import Any

import pytest
from _servers import (
    BIN,
    DRIVER_TIMED_OUT,
    WAIT,
    Server,
    assert_nothing_left,
    assert_nothing_left_of_asgi,
    auto_driver_of,
    free_port,
    get,
    serve,
    serve_asgi,
)

from shmwheel.contrib import _stacks, asgi

APPS = Path(__file__).resolve().parent / "apps"

# Each way a request is stuck: its path, how its worker reports it, and the
# function of the app it is stuck in.  "blocks": the task blocks the event
# loop, whose thread's frames are the stack; "awaits": the task is
# suspended, its await chain is the stack; "thread": the task waits for a
# thread of Starlette's pool, whose frames follow; "gil": no Python runs.
STUCK = (
    ("/loop-sleep?s=3", "blocks", "sleep_in_the_loop"),
    ("/await-sleep?s=3", "awaits", "await_sleep"),
    ("/recv?s=3", "blocks", "recv_in_the_loop"),
    ("/spin?s=3", "blocks", "spin"),
    ("/thread-sleep?s=3", "thread", "sleep_in_a_thread"),
    ("/regex?n=27", "gil", "backtrack"),  # 2**27 steps: 3 s or more here (2**26, 1.5 s idle, raced the dump at 1.5 s)
)

# The lines of a stack, and the frame of the app's function that ends it.
ANY_LINES = r"(?:  .*\n)*?"


def app_frame(function: str) -> str:
    return rf'  File ".*/tests/apps/asgi_stuck\.py", line \d+, in {function}\n'


def stuck_requests_write_their_own_stacks(server: Server, errors: Server, prefix: str) -> None:
    """Fast requests never time out; each stuck one does once, and its stack
    is in ``errors`` (the server's error log), each line of the report's
    header after ``prefix`` (the server's format, with {pid})."""
    for _ in range(20):
        assert get(server.port, "/")[0] == 200
    for n, (path, way, function) in enumerate(STUCK):
        request_id = f"stuck-{n}"
        status, body = get(server.port, path, WAIT, request_id)
        assert status == 200 and body.startswith("done by pid "), (path, status, body)
        route = re.escape(path.split("?")[0])
        driver_line = (
            "^" + prefix.format(pid=r"\d+") + rf"shmwheel: request timed out: GET {route} \(request {request_id}, "
            r"worker pid (\d+), "
            r"thread (0x[0-9a-f]{16}), task (0x[0-9a-f]+)\), running for [\d.]+ s; asking it for the request's "
            r"stack \(SIGRTMIN\+\d\)$"
        )
        found = re.findall(driver_line, errors.log(), re.MULTILINE)
        assert len(found) == 1, f"{path}: {found}\n{errors.log()[-6000:]}"
        pid, thread, task = found[0]
        assert body == f"done by pid {pid}\n"
        header = (
            "^" + prefix.format(pid=pid) + rf"shmwheel: the stack of timed-out request GET {route} \(request "
            rf"{request_id}, worker pid {pid}, thread {thread}, task {task}\), running for [\d.]+ s \(most recent "
            r"call last\):\n"
        )
        if way == "blocks":
            errors.wait_for(
                header + r"  task Task-\d+, which blocks the event loop:\n" + ANY_LINES + app_frame(function)
            )
        elif way == "awaits":
            errors.wait_for(
                header + r"  task Task-\d+, awaiting:\n" + ANY_LINES + app_frame(function) + r"    await asyncio\.sleep"
                r".*\n  File \".*/asyncio/tasks\.py\", line \d+, in sleep\n    return await future\n"
                r"(?!  meanwhile)"
            )
        elif way == "thread":
            errors.wait_for(
                header
                + r"  task Task-\d+, awaiting:\n"
                + ANY_LINES
                + r"  File .*, in run_in_threadpool\n"
                + ANY_LINES
                + r"  it waits for a thread; this worker's busy pool threads \(1\):\n"
                + r"  thread 0x[0-9a-f]{16}:\n"
                + ANY_LINES
                + app_frame(function)
            )
        else:  # no Python runs in the worker: the driver says so, and faulthandler dumps every thread
            errors.wait_for(
                rf"worker pid {pid} did not write the stack of GET {route} \(request {request_id}, .*\) within "
                r"[\d.]+ s: no Python runs in it \(a C call that holds the GIL\?\); asking it for faulthandler's "
                r"dump of every thread on SIGRTMIN, to its stderr, which it writes where it can tell that no Python "
                rf"runs; the request's is thread {thread}$"
            )
            server.wait_for(
                rf"^Current thread {thread} \(most recent call first\):\n"
                rf'(?:  .*\n)*?  File ".*/tests/apps/asgi_stuck\.py", line \d+ in {function}\n'
            )
    # The fast requests never timed out; the stuck ones once each.
    assert len(re.findall(DRIVER_TIMED_OUT, errors.log())) == len(STUCK)


def with_error_log(server: Server, path: Path) -> Server:
    """The server, its log read from its error log file."""
    return dataclasses.replace(server, log_path=path)


# The report's prefix in the server's error log: Uvicorn's default format,
# and Hypercorn's and Gunicorn's (the time in brackets with its offset).
UVICORN_PREFIX = r"WARNING:  "
LOGGING_PREFIX = r"\[\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{{4}}\] \[{pid}\] \[WARNING\] "


@pytest.fixture
def on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers find the app in tests/apps."""
    monkeypatch.setenv("PYTHONPATH", str(APPS))
    monkeypatch.delenv("SHMWHEEL_TEST_TIMEOUT", raising=False)


@pytest.mark.usefixtures("on_path")
def test_uvicorn_writes_the_stack_of_each_stuck_request_to_its_error_output(tmp_path: Path) -> None:
    port = free_port()
    # Uvicorn's supervisor ends a worker that does not answer its health
    # check (5 s by default), which one stuck in the regex cannot.
    cmd = [str(BIN / "uvicorn"), "asgi_stuck:app", "--host", "127.0.0.1", "--port", str(port), "--workers", "2"]
    with serve_asgi([*cmd, "--timeout-worker-healthcheck", "30"], port, tmp_path) as server:
        driver = auto_driver_of(server)
        stuck_requests_write_their_own_stacks(server, server, UVICORN_PREFIX)
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left_of_asgi(server, driver)


@pytest.mark.long  # 20 s; the same stuck requests as under Uvicorn, which runs by default
@pytest.mark.usefixtures("on_path")
def test_hypercorn_writes_the_stack_of_each_stuck_request_to_its_error_log(tmp_path: Path) -> None:
    port = free_port()
    error_log = tmp_path / "error.log"
    cmd = [str(BIN / "hypercorn"), "asgi_stuck:app", "--bind", f"127.0.0.1:{port}", "--workers", "2"]
    with serve_asgi([*cmd, "--error-logfile", str(error_log)], port, tmp_path) as server:
        errors = with_error_log(server, error_log)
        driver = auto_driver_of(errors)  # its lines in the error log too, in Hypercorn's format
        stuck_requests_write_their_own_stacks(server, errors, LOGGING_PREFIX)
        assert "request timed out" not in server.log()  # the driver's lines and the reports: in the error log only
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left_of_asgi(errors, driver)


GUNICORN_CONFIG = """
workers = 2
worker_class = "uvicorn_worker.UvicornWorker"
from shmwheel.contrib import gunicorn as shmwheel_gunicorn
shmwheel_gunicorn.install(globals(), timeout=1.0, kill=False)
"""


@pytest.mark.long  # 20 s; the same stuck requests as under Uvicorn, which runs by default
@pytest.mark.usefixtures("on_path")
def test_gunicorn_with_uvicorn_workers_writes_the_stack_of_each_stuck_request_to_its_error_log(
    tmp_path: Path,
) -> None:
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(GUNICORN_CONFIG)
    error_log = tmp_path / "error.log"
    port = free_port()
    cmd = [str(BIN / "gunicorn"), "-c", str(config), "--bind", f"127.0.0.1:{port}", "--error-logfile", str(error_log)]
    with serve([*cmd, "--no-control-socket", "asgi_stuck:routes"], port, tmp_path, "gunicorn") as server:
        errors = with_error_log(server, error_log)
        errors.wait_for(r"worker class uvicorn_worker\._workers\.UvicornWorker calls no request hook: each worker")
        stuck_requests_write_their_own_stacks(server, errors, LOGGING_PREFIX)
        assert "request timed out" not in server.log()
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


# -- trio: Hypercorn's trio worker runs no asyncio loop --------------------------


class TrioTask:
    """What the middleware finds under trio: a task with its coroutine and its name."""

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.name = "handle"


class Trap:
    def __await__(self) -> Generator[str, None, None]:
        yield "rescheduled"  # as trio's wait_task_rescheduled does


async def waits_in_trio() -> None:
    await Trap()


async def blocks_trio(me: list[TrioTask], report: list[list[str]]) -> None:
    active = _stacks.Active(b"", 0, threading.get_ident(), me[0], 0, 0, False)
    report.append(_stacks._stack_of(active, sys._current_frames()))


def test_a_request_outside_asyncio_has_no_asyncio_task_and_is_served() -> None:
    """Under trio asyncio.current_task() raises: the middleware passes no task
    (or trio's) rather than fail every request."""
    assert asgi._task() is None
    assert asyncio.run(_current()) is not None


async def _current() -> Any:
    return asgi._task()


def test_a_trio_tasks_stack_is_its_await_chain_or_its_threads_frames() -> None:
    suspended = waits_in_trio()
    assert suspended.send(None) == "rescheduled"
    try:
        lines = _stacks._stack_of(
            _stacks.Active(b"", 0, threading.get_ident(), TrioTask(suspended), 0, 0, False), sys._current_frames()
        )
    finally:
        suspended.close()
    assert lines[0] == "  task handle, awaiting:"
    assert any(line.endswith(", in waits_in_trio") for line in "\n".join(lines).splitlines())
    assert "blocks the event loop" not in "\n".join(lines)

    me: list[TrioTask] = []
    report: list[list[str]] = []
    running = blocks_trio(me, report)
    me.append(TrioTask(running))
    with contextlib.suppress(StopIteration):
        running.send(None)
    assert report[0][0] == "  task handle, which blocks the event loop:"
    assert ", in blocks_trio" in "\n".join(report[0])

    ended = TrioTask(waits_in_trio())
    ended.coro.close()
    assert _stacks._stack_of(_stacks.Active(b"", 0, 0, ended, 0, 0, False), {}) == ["  (its task handle has ended)"]
