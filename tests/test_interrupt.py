"""End to end: the stages of a late request, under real servers.

With ``interrupt=True`` a request that runs past its timeout is ended where
it runs and answered ``504 Gateway Timeout``, and its worker carries on:
the sibling requests it serves meanwhile are answered, and the same worker
(the pid in the app's "done by pid N") answers before and after.  Each
way a worker serves a request is tried with the request it can be stuck
in: a pure-Python CPU loop in a Gunicorn gthread worker's thread, in a
gevent greenlet (which keeps the hub, so its sibling is served once it is
ended) and in a uWSGI thread; a cooperative ``time.sleep`` under gevent; an
``await asyncio.sleep`` (its task is cancelled) and a CPU loop (which
blocks the event loop: the exception is raised in it) under Uvicorn; the
same, a ``time.sleep`` and a synchronous endpoint under Hypercorn's trio
worker, where a trio task's cancel scope is cancelled.  The 504 is in the
server's access log.

A request stuck in a C call that holds the GIL (a catastrophic regular
expression) cannot be interrupted: the driver says so once
``interrupt_grace`` has passed, and goes on to the kill.  ``warn_after``
logs a slow request's stack and lets it finish; ``extend()`` keeps a
streaming response alive past its first deadline (Flask and Starlette),
also once its warn_after stage has fired, while the same stream extended
too little is cut off; ``no_timeout()`` exempts a request (Flask and
Starlette).

Each server is started once for the tests that use it, with a 1 s timeout
(0.5 s for the kill), from the apps in ``tests/apps``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest
from _servers import (
    APPS,
    BIN,
    GATEWAY_TIMEOUT,
    HOSTILE_PATH,
    STUCK_FOR,
    WAIT,
    Server,
    assert_client_text_is_data,
    assert_nothing_left_of_asgi,
    auto_driver_of,
    booted,
    free_port,
    get,
    gunicorn_app,
    pid_of,
    serve,
    serve_asgi,
    stopped_cleanly,
    uwsgi_ini,
)

from shmwheel._wheel import observe
from shmwheel.contrib import KIND_REQUEST

TIMEOUT = 1.0  # s: every server's, but the kill test's
THREAD = r"thread 0x[0-9a-f]{16}(?:, (?:task|greenlet) 0x[0-9a-f]+)?"
# How the worker says it ends a request: a thread armed, a task that blocks its loop; in the main thread, woken too.
ARMED_THREAD = r"RequestTimeout to be raised in thread 0x[0-9a-f]{16} at its next safe point"
ARMED_LOOP = r"RequestTimeout to be raised in task Task-\d+, which blocks the event loop, at its next safe point"
WOKEN = r", or in the C call it waits in \(SIGRTMIN\+\d\)"
ARMED_GREENLET = ARMED_THREAD.replace(" at its", ", where its greenlet runs, at its")


class Answer:
    """A request sent in the background: its status, body, and when it was answered."""

    def __init__(self, pool: ThreadPoolExecutor, port: int, path: str, request_id: str) -> None:
        self.path = path
        self.request_id = request_id
        self.sent = time.monotonic()
        self._future: Future[tuple[int, str, float]] = pool.submit(self._get, port)

    def _get(self, port: int) -> tuple[int, str, float]:
        status, body = get(port, self.path, WAIT, self.request_id)
        return status, body, time.monotonic()

    def result(self) -> tuple[int, str]:
        status, body, _ = self._future.result()
        return status, body

    @property
    def took(self) -> float:
        return self._future.result()[2] - self.sent


def route(path: str) -> str:
    return re.escape(path.split("?")[0])


def timed_out(path: str, request_id: str, pid: int | str = r"\d+") -> str:
    """The driver's line for a request it asks its worker to end."""
    return (
        rf"request timed out: GET {route(path)} \(request {re.escape(request_id)}, worker pid {pid}, {THREAD}\), "
        r"running for [\d.]+ s; asking it to end the request \(SIGRTMIN\+\d\)"
    )


def interrupting(path: str, request_id: str, pid: int, how: str) -> str:
    """The worker's line as it ends a request: ``how`` (a pattern)."""
    return (
        rf"shmwheel: interrupting GET {route(path)} \(request {re.escape(request_id)}, worker pid {pid}, "
        rf"{THREAD}\): {how}$"
    )


def driver_pid(server: Server, path: str, request_id: str) -> int:
    """The worker pid of the one timed-out line of a request."""
    server.wait_for(timed_out(path, request_id))
    found = re.findall(timed_out(path, request_id, r"(\d+)"), server.log())
    assert len(found) == 1, found
    return int(found[0])


def never_timed_out(server: Server, path: str, request_id: str, slow: bool = False) -> None:
    """The request did not time out; unless it may be ``slow``, no stage of it fired at all."""
    log = server.log()
    request = rf"GET {route(path)} \(request {re.escape(request_id)},"
    assert not re.search(rf"request timed out: {request}", log), log[-4000:]
    if not slow:
        assert not re.search(rf"request is slow: {request}", log), log[-4000:]


def sibling_carries_on(
    server: Server, name: str, *, stuck: str, sibling: str, delay: float, how: str, access: str
) -> int:
    """A stuck request (request id ``name``-stuck) and, ``delay`` s later, a
    sibling of it (``name``-sibling) on the same (only) worker: the stuck one
    is answered 504 after its timeout, long before its 30 s are up, which
    the worker says it interrupted (``how``) and the access log shows (``access``,
    with {path}, or {route}: the path without its query); the sibling is
    answered 200 by the same worker, which still answers afterwards.
    Returns the worker's pid."""
    before = pid_of(get(server.port, "/"))
    with ThreadPoolExecutor(2) as pool:
        hung = Answer(pool, server.port, stuck, f"{name}-stuck")
        time.sleep(delay)
        other = Answer(pool, server.port, sibling, f"{name}-sibling")
        assert hung.result() == GATEWAY_TIMEOUT, server.log()[-4000:]
        assert TIMEOUT <= hung.took < STUCK_FOR / 2  # ended, not run out: its handler would take 30 s
        assert pid_of(other.result()) == before
    pid = driver_pid(server, stuck, hung.request_id)
    assert pid == before
    server.wait_for(interrupting(stuck, hung.request_id, pid, how))
    server.wait_for(access.format(path=re.escape(stuck), route=route(stuck)))
    never_timed_out(server, sibling, other.request_id, slow=True)
    # Past interrupt_grace: the kill never came, the worker is the same.
    time.sleep(max(0.0, hung.sent + TIMEOUT + 1.0 - time.monotonic()))
    assert "after it was interrupted: it is in a C call" not in server.log(), server.log()[-5000:]
    assert pid_of(get(server.port, "/")) == pid
    return pid


def stream_is_cut_when_extend_is_too_short(server: Server, request_id: str) -> None:
    """The control of the extend() tests: a stream that extends itself by
    less than it waits between chunks times out, is interrupted, and its
    connection closed half-way (the status has gone out: no 504 can)."""
    status, body = get(server.port, "/stream?chunks=6&every=0.4&extend=0.2", WAIT, request_id)
    assert status == 0 and "IncompleteRead" in body, (status, body)
    pid = driver_pid(server, "/stream", request_id)
    server.wait_for(interrupting("/stream", request_id, pid, ".*"))


GUNICORN_ACCESS = r'"GET {path} HTTP/1\.1" 504 '
UWSGI_ACCESS = r"GET {path} => generated \d+ bytes in \d+ msecs \(HTTP/1\.1 504\)"
UVICORN_ACCESS = r'"GET {path} HTTP/1\.1" 504'
HYPERCORN_ACCESS = r'"GET {route} 1\.1" 504 '  # the path without its query
STAGES = f"timeout={TIMEOUT}, interrupt=True, interrupt_grace=0.5, kill=True, kill_after=2.0"


# -- Gunicorn sync: one worker, the request in its main thread -------------------


def test_sync_worker_cpu_loop_is_answered_504_and_the_worker_serves_on(tmp_path: Path) -> None:
    """The sync worker runs its one request in its main thread: RequestTimeout
    there, a 504, and the request queued behind it is served by the same
    worker, which Gunicorn did not replace."""
    port = free_port()
    cmd = gunicorn_app(tmp_path, port, "sync", "--workers", "1", "--access-logfile", "-", install=STAGES)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        sibling_carries_on(
            server,
            "sync-spin",
            stuck=f"/spin?s={STUCK_FOR}",
            sibling="/sleep?s=0.1",
            delay=0.1,
            how=ARMED_THREAD + WOKEN,
            access=GUNICORN_ACCESS,
        )
        assert booted(server) == 1


@pytest.mark.parametrize("stuck", ["/sleep", "/recv", "/upstream"])
def test_sync_worker_in_a_c_call_is_ended_at_its_deadline_and_serves_on(stuck: str, tmp_path: Path) -> None:
    """The sync worker's request waits in time.sleep or a blocking recv
    (whose data the code keeps, in /upstream): C calls, which no line start
    reaches.  The main thread is where CPython
    runs signal handlers, so the worker wakes it with a real-time signal
    of its own: the wait ends, the handler raises at the call, a 504 goes
    out at the deadline, and the same worker serves on.  (Before, the
    request slept on; interrupt_grace later the driver sent SIGABRT, and
    Gunicorn replaced the worker.)"""
    port = free_port()
    cmd = gunicorn_app(tmp_path, port, "sync", "--workers", "1", "--access-logfile", "-", install=STAGES)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        before = pid_of(get(port, "/"))
        assert get(port, f"{stuck}?s={STUCK_FOR}", WAIT, "in-c") == GATEWAY_TIMEOUT
        server.wait_for(interrupting(stuck, "in-c", before, ARMED_THREAD + WOKEN))
        server.wait_for(rf"GET {stuck} \(request in-c, worker pid {before}, .*\) ended [\d.]+ s after it was "
                        r"interrupted$")  # fmt: skip
        assert pid_of(get(port, "/")) == before
        assert "has not ended 0.5 s after it was interrupted" not in server.log() and booted(server) == 1


# -- Gunicorn gthread: one worker, four threads -----------------------------------


@pytest.fixture(scope="module")
def gthread(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """warn_after 0.5 s, interrupt at 1 s, and kill on if a request outlives interrupt_grace."""
    tmp_path, port = tmp_path_factory.mktemp("gthread"), free_port()
    options = ("--workers", "1", "--threads", "4", "--access-logfile", "-")
    cmd = gunicorn_app(tmp_path, port, "gthread", *options, install=f"{STAGES}, warn_after=0.5")
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        yield server


def test_gthread_cpu_loop_is_answered_504_and_its_worker_serves_on(gthread: Server) -> None:
    """A thread in a Python loop gets RequestTimeout at its timeout; the
    request beside it in another thread finishes, and no worker is replaced."""
    pid = sibling_carries_on(
        gthread,
        "gthread-spin",
        stuck=f"/spin?s={STUCK_FOR}",
        sibling="/sleep?s=0.8",
        delay=0.1,
        how=ARMED_THREAD,
        access=GUNICORN_ACCESS,
    )
    gthread.wait_for(rf"GET /spin \(request gthread-spin-stuck, worker pid {pid}, .*\) ended [\d.]+ s after "
                     r"it was interrupted$")  # fmt: skip
    assert booted(gthread) == 1


def test_gthread_a_thread_in_a_c_call_runs_on_past_its_grace_and_its_end_is_logged(tmp_path: Path) -> None:
    """With kill off, a request thread in time.sleep (a C call, in a thread
    that no signal wakes) has not ended when the interrupt's grace is over,
    and runs on; once the sleep returns, RequestTimeout ends it at its next
    safe point, the client gets its 504, and the driver says, once, that it
    ended and how long after its interrupt.  (Before, the driver had
    forgotten it once it said it ran on, and said nothing of its end.)"""
    port = free_port()
    stages = f"timeout={TIMEOUT}, interrupt=True, interrupt_grace=0.5, kill=False"
    options = ("--workers", "1", "--threads", "2", "--access-logfile", "-")
    cmd = gunicorn_app(tmp_path, port, "gthread", *options, install=stages)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        before = pid_of(get(port, "/"))
        assert get(port, "/sleep?s=2.5", WAIT, "ran-on") == GATEWAY_TIMEOUT
        request = rf"GET /sleep \(request ran-on, worker pid {before}, {THREAD}\)"
        server.wait_for(rf"{request} has not ended 0\.5 s after it was interrupted: .*; it runs on \(kill is off\)$")
        ended = rf"{request} ended ([\d.]+) s after it was interrupted$"
        assert float(server.wait_for(ended).group(1)) >= 0.5  # it had not ended at the grace's end
        time.sleep(0.3)  # a second line would be there by now
        assert len(re.findall(ended, server.log(), re.M)) == 1, server.log()[-4000:]
        assert pid_of(get(port, "/")) == before and booted(server) == 1


def test_warn_after_logs_a_slow_requests_stack_and_lets_it_finish(gthread: Server) -> None:
    """At warn_after the driver says the request is slow and its worker
    writes its stack; the request finishes in time, answered 200."""
    status, body = get(gthread.port, "/sleep?s=0.8", WAIT, "slow")
    pid = pid_of((status, body))
    request = rf"GET /sleep \(request slow, worker pid {pid}, {THREAD}\)"
    gthread.wait_for(
        rf"request is slow: {request}, running for 0\.[5-9]\d* s, 0\.[0-5]\d* s before its timeout; asking it for "
        r"the request's stack \(SIGRTMIN\+\d\)$"
    )
    gthread.wait_for(
        rf"shmwheel: the stack of slow request {request}, running for [\d.]+ s, [\d.]+ s before its timeout \(most "
        r'recent call last\):\n(?:  .*\n)*?  File ".*/tests/apps/flask_stuck\.py", line \d+, in stuck_in_sleep\n'
    )
    gthread.wait_for(rf"{request} finished, 0\.[89]\d* s after it started$")
    assert "request timed out: GET /sleep (request slow," not in gthread.log()


def test_extend_keeps_a_streaming_response_alive_past_its_timeout(gthread: Server) -> None:
    """A Flask generator that calls extend(1 s) before each chunk streams for
    2.4 s, past its 1 s timeout: every chunk arrives, and no stage fires.
    The same stream with extend(0.2 s), too little for its 0.4 s between
    chunks, times out and is cut off: its response has started, so its
    connection is closed."""
    stream_is_cut_when_extend_is_too_short(gthread, "stream-short")
    start = time.monotonic()
    status, body = get(gthread.port, "/stream?chunks=6&every=0.4&extend=1.0", WAIT, "stream")
    assert time.monotonic() - start >= 2.4
    chunks = [f"chunk {n}: extend() returned True\n" for n in range(6)]
    assert status == 200 and body.startswith("".join(chunks)), (status, body)
    pid_of((status, body.removeprefix("".join(chunks))))
    gthread.wait_for(r'"GET /stream\?chunks=6&every=0\.4&extend=1\.0 HTTP/1\.1" 200 ')
    never_timed_out(gthread, "/stream", "stream")


def test_extend_after_the_warn_after_stage_drops_the_timeout_the_driver_holds(gthread: Server) -> None:
    """A stream whose first extend() comes at 0.7 s, after its warn_after
    stage (0.5 s) has fired and the driver holds its timeout stage (1 s):
    the worker tells the driver, which drops it, and the stream runs to
    its end, 1.9 s, with no timeout."""
    status, body = get(gthread.port, "/stream?chunks=3&every=0.4&extend=1.0&first=0.7", WAIT, "late-extend")
    chunks = "".join(f"chunk {n}: extend() returned True\n" for n in range(3))
    assert status == 200 and body.startswith(chunks), (status, body)
    pid = pid_of((status, body.removeprefix(chunks)))
    gthread.wait_for(rf"request is slow: GET /stream \(request late-extend, worker pid {pid}, ")
    time.sleep(0.2)
    never_timed_out(gthread, "/stream", "late-extend", slow=True)
    assert "interrupting GET /stream (request late-extend," not in gthread.log()


def exempted(server: Server, request_id: str) -> None:
    """A request that calls no_timeout() sleeps past its timeout and is
    answered 200, with no stage of it logged."""
    start = time.monotonic()
    status, body = get(server.port, "/no-timeout?s=1.5", WAIT, request_id)
    assert time.monotonic() - start >= 1.5
    assert body.startswith("no_timeout() returned True; "), (status, body)
    pid_of((status, body))
    time.sleep(0.2)  # a timer that fired anyway would be logged by now
    never_timed_out(server, "/no-timeout", request_id)


def test_no_timeout_exempts_a_request(gthread: Server) -> None:
    """no_timeout() in a Flask view, in a gthread worker's thread."""
    exempted(gthread, "exempt")


def test_a_request_in_a_c_call_that_holds_the_gil_goes_on_to_the_kill(tmp_path: Path) -> None:
    """A regular expression that holds the GIL for seconds: no Python runs
    in the worker, so it can neither write the stack nor be interrupted.
    interrupt_grace later the driver says it has not ended and sends
    SIGABRT, which a worker stuck in C cannot act on: SIGKILL ends it, and
    Gunicorn replaces it."""
    port = free_port()
    install = "timeout=0.5, interrupt=True, interrupt_grace=0.5, kill=True, kill_after=1.0"
    cmd = gunicorn_app(tmp_path, port, "gthread", "--workers", "1", "--threads", "4", install=install)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        before = pid_of(get(port, "/"))
        # The thread that answered has its post_request hook yet to run, which
        # ends its request: once the regex holds the GIL, it never would.
        with observe(server.wheel) as wheel:
            give_up = time.monotonic() + WAIT
            while any(t.payload[:1] == bytes([KIND_REQUEST]) for t in wheel.timers()):
                assert time.monotonic() < give_up
                time.sleep(0.05)
        assert get(port, "/regex?n=27", WAIT, "regex")[0] == 0  # 2**27 steps: ended under the request
        pid = driver_pid(server, "/regex", "regex")
        assert pid == before
        request = rf"GET /regex \(request regex, worker pid {pid}, {THREAD}\)"
        server.wait_for(timed_out("/regex", "regex") + r", then SIGABRT if it has not ended 0\.5 s later, and "
                        r"SIGKILL 1 s after that$")  # fmt: skip
        server.wait_for(rf"worker pid {pid} did not write the stack of {request} within [\d.]+ s: no Python runs")
        server.wait_for(
            rf"{request} has not ended 0\.5 s after it was interrupted: it has not reached a point where it may be "
            r"interrupted \(a C call that has not returned, cleanup code, logging\), or its code caught "
            r"RequestTimeout; sending SIGABRT$"
        )
        server.wait_for(
            rf"killed worker pid {pid} with SIGKILL: it was still there 1 s after SIGABRT, which it handles: .* "
            rf"\({request} had run for [\d.]+ s\)$"
        )
        server.wait_for(rf"Worker \(pid:{pid}\) was sent SIGKILL")
        server.wait_for(rf"Booting worker with pid: (?!{pid}\b)\d+")
        give_up = time.monotonic() + WAIT
        while (answer := get(port, "/"))[0] != 200:  # the new worker, once it serves
            assert time.monotonic() < give_up, answer
            time.sleep(0.1)
        assert pid_of(answer) != pid
        assert "interrupting GET /regex" not in server.log()  # no Python ran to do it
        assert len(re.findall(r"request timed out: ", server.log())) == 1


def get_queued(port: int, path: str, request_id: str, queued: float) -> tuple[int, str]:
    """GET with the X-Request-Start a proxy (or a client that forges it) sets: ``queued`` s ago, nginx's form."""
    return get(port, path, WAIT, request_id, headers={"X-Request-Start": f"t={time.time() - queued:.3f}"})


def test_a_forged_x_request_start_never_gets_a_worker_killed(tmp_path: Path) -> None:
    """A client that claims its request queued 3000 s has it due as it
    starts (queue time counts up to the whole timeout) and ended at its
    first safe point, after a 0.8 s time.sleep: a 504.  The kill stage
    waits for the request's own timeout plus the grace, 1.3 s after its
    worker took it, by when the request has ended: the worker is left
    alone, and still serves.  (Before, interrupt_grace after the header's
    deadline, 0.3 s in, the worker got SIGABRT.)"""
    port = free_port()
    install = "timeout=1.0, interrupt=True, interrupt_grace=0.3, kill=True, kill_after=1.0, x_request_start=True"
    cmd = gunicorn_app(tmp_path, port, "gthread", "--workers", "1", "--threads", "4", install=install)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        before = pid_of(get(port, "/"))
        assert get_queued(port, "/sleep?s=0.8", "forged", 3000.0) == GATEWAY_TIMEOUT
        request = rf"GET /sleep \(request forged, worker pid {before}, {THREAD}\)"
        server.wait_for(rf"request timed out: {request}, running for 1\.\d{{3}} s, 1\.000 s of it queued by its "
                        r"X-Request-Start; asking it to end the request")  # fmt: skip
        server.wait_for(rf"{request} has not ended 0\.3 s after it was interrupted: .*; SIGABRT waits [\d.]+ s more, "
                        r"until it is as late counted from when its worker took it \(it had queued 1 s by its "
                        r"X-Request-Start\)$")  # fmt: skip
        server.wait_for(rf"{request} has finished since it timed out: worker pid {before} is left alone$")
        assert pid_of(get(port, "/")) == before
        assert "sending SIGABRT" not in server.log() and booted(server) == 1
        # The same request, really stuck: killed all the same, at its own time.
        sent = time.monotonic()
        assert get_queued(port, "/sleep?s=30", "stuck", 3000.0)[0] in (0, 500)
        assert time.monotonic() - sent >= 1.3
        server.wait_for(rf"Booting worker with pid: (?!{before}\b)\d+")


@pytest.mark.parametrize("when", ["in the grace", "before the SIGKILL", "in the grace, twice", "before a late SIGKILL"])
def test_a_driver_killed_mid_stages_is_replaced_and_the_stuck_worker_still_ended(when: str, tmp_path: Path) -> None:
    """A gthread request in time.sleep (a C call no thread but the main one
    can be woken from) is interrupted, to no effect.  The driver is
    SIGKILLed in its interrupt grace, or after it sent SIGABRT and before
    the SIGKILL due kill_after later.  The supervisor starts another within
    a second, which carries on the stages the dead one began: the worker is
    still ended, and Gunicorn replaces it.  (Before, the new driver refused
    the dead one's follow-ups, and the worker was never signalled.)

    Twice: the driver that replaced it is SIGKILLed too, before the first
    one's follow-ups come due, which the third then refuses (they are two
    deaths back).  The worker tells the new driver that its request runs
    past its timeout (or the second had begun the stages again, and the
    third carries its stack check on), and the stages begin again.
    (Before, nothing ended the worker.)

    Before a late SIGKILL (kill_after 5 s): the new driver carries the
    SIGKILL on, and the worker's word that its request is late waits until
    the dead driver's follow-ups are all due, so no second SIGABRT goes out
    before the SIGKILL.  (Before, the worker's word began the stage again,
    and a second SIGABRT came 1 s after the new driver started.)"""
    port = free_port()
    grace = 3.0 if when == "in the grace, twice" else 1.0  # the first driver's follow-up comes after the third starts
    kill_after = 5.0 if when == "before a late SIGKILL" else 1.0
    install = f"timeout=1.0, interrupt=True, interrupt_grace={grace}, kill=True, kill_after={kill_after}"
    cmd = gunicorn_app(tmp_path, port, "gthread", "--workers", "1", "--threads", "4", install=install)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        before = pid_of(get(port, "/"))
        first = int(server.wait_for(r"driver running, pid (\d+)").group(1))
        with ThreadPoolExecutor(1) as pool:
            stuck = Answer(pool, port, f"/sleep?s={STUCK_FOR}", "stuck")
            if when.startswith("in the grace"):
                server.wait_for(interrupting("/sleep", "stuck", before, ".*"))
            else:
                server.wait_for(r"GET /sleep \(request stuck, .*\) has not ended 1 s after it was interrupted: .*; "
                                r"sending SIGABRT$")  # fmt: skip
            os.kill(first, signal.SIGKILL)
            second = int(server.wait_for(rf"driver running, pid (?!{first}\b)(\d+)").group(1))
            if when == "in the grace, twice":
                os.kill(second, signal.SIGKILL)
                third = int(server.wait_for(rf"driver running, pid (?!(?:{first}|{second})\b)(\d+)").group(1))
            assert stuck.result()[0] in (0, 500)  # its worker ended under it
        server.wait_for(rf"Booting worker with pid: (?!{before}\b)\d+")
        assert pid_of(get(port, "/")) != before
        log = server.log()
        if when == "in the grace, twice":
            # The third driver begins the stages again: on the worker's word
            # or, where the second lived long enough to begin them itself, on
            # carrying on the stack check it added.  Which one depends on how
            # far the second got in its first milliseconds.
            again = rf"\[{third}\] \[WARNING\] shmwheel: request timed out: GET /sleep \(request stuck,"
            assert re.search(again, log), log[-4000:]
            return
        assert "but is not acted on" not in log, log[-4000:]
        if when == "in the grace":
            carried = r"GET /sleep \(request stuck, .*\): carrying on its (?:stack|interrupt) check, which driver "
            assert len(re.findall(carried + rf"{first} added before it died", log)) == 1, log[-4000:]
            assert len(re.findall(r"request timed out: GET /sleep \(request stuck,", log)) == 2  # its own, then again
        else:
            after = f"{kill_after:g} s after SIGABRT"
            assert re.search(rf"killed worker pid {before} with SIGKILL: it was still there {after}", log), log[-4000:]
            sent = r"GET /sleep \(request stuck, .*\) has not ended 1 s after it was interrupted: .*; sending SIGABRT$"
            assert len(re.findall(sent, log, re.M)) == 1, log[-4000:]


def test_a_worker_in_which_no_python_runs_is_killed_though_its_driver_dies_twice(tmp_path: Path) -> None:
    """A gthread request in a regex that holds the GIL: its worker can
    neither write the stack asked for nor say that its request is late.
    The driver is SIGKILLed once it has asked for faulthandler's dump, and
    the one that replaced it is SIGKILLed at once, before the first one's
    interrupt check comes due, which the third then refuses (two deaths
    back).  The request's own fire, which each driver keeps in flight
    while its stages run, is handed to the third, kept: the stages begin
    again once the dead drivers' follow-ups would all have been due, and
    the worker is killed.  (Before, nothing ended it: its regex ran on.)"""
    port = free_port()
    install = "timeout=1.0, interrupt=True, interrupt_grace=3.0, kill=True, kill_after=1.0"
    options = ("--workers", "1", "--threads", "4", "--timeout", "300")  # Gunicorn's own heartbeat: not before us
    cmd = gunicorn_app(tmp_path, port, "gthread", *options, install=install)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        before = pid_of(get(port, "/"))
        first = int(server.wait_for(r"driver running, pid (\d+)").group(1))
        with ThreadPoolExecutor(1) as pool:
            stuck = Answer(pool, port, "/regex?n=34", "no-python")  # 2**34 steps: minutes
            server.wait_for(rf"\[{first}\] \[WARNING\] shmwheel: worker pid {before} did not write the stack of "
                            r"GET /regex \(request no-python, ")  # fmt: skip
            os.kill(first, signal.SIGKILL)
            second = int(server.wait_for(rf"driver running, pid (?!{first}\b)(\d+)").group(1))
            os.kill(second, signal.SIGKILL)
            third = int(server.wait_for(rf"driver running, pid (?!(?:{first}|{second})\b)(\d+)").group(1))
            server.wait_for(rf"\[{third}\] \[ERROR\] shmwheel: killed worker pid {before} with SIGKILL", timeout=60)
            assert stuck.result()[0] in (0, 500)  # its worker ended under it
        server.wait_for(rf"Booting worker with pid: (?!{before}\b)\d+")
        assert pid_of(get(port, "/")) != before
        log = server.log()
        # Begun again by the third: on its kept fire (or, where the second
        # lived long enough to carry the first's follow-ups on, on carrying
        # the second's on).
        again = rf"\[{third}\] \[WARNING\] shmwheel: request timed out: GET /regex \(request no-python,"
        assert re.search(again, log), log[-4000:]
        assert "not by the worker it names" not in log, log[-4000:]  # the second's word that waited is the third's


# -- Gunicorn gevent: one worker, greenlets ----------------------------------------


@pytest.fixture(scope="module")
def gevent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp_path, port = tmp_path_factory.mktemp("gevent"), free_port()
    cmd = gunicorn_app(tmp_path, port, "gevent", "--workers", "1", "--access-logfile", "-", install=STAGES)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        yield server


def test_gevent_cpu_loop_is_answered_504_and_then_its_sibling_is_served(gevent: Server) -> None:
    """A greenlet in a Python loop keeps the hub: the sibling sent meanwhile
    waits, and is served, by the same worker, once RequestTimeout has ended
    the loop in the greenlet's thread."""
    sibling_carries_on(
        gevent,
        "gevent-spin",
        stuck=f"/spin?s={STUCK_FOR}",
        sibling="/sleep?s=0.2",
        delay=0.3,
        how=ARMED_GREENLET + WOKEN,
        access=GUNICORN_ACCESS,
    )
    # The sibling's request came in only once the hub ran again: after the interrupt.
    log = gevent.log()
    interrupted = re.search(r"shmwheel: interrupting GET /spin ", log)
    served = re.search(r'"GET /sleep\?s=0\.2 HTTP/1\.1" 200 ', log)
    assert interrupted is not None and served is not None and interrupted.start() < served.start(), log[-4000:]
    assert booted(gevent) == 1


def test_gevent_greenlet_in_a_c_call_that_keeps_the_hub_is_ended_and_its_sibling_served(gevent: Server) -> None:
    """A greenlet in CPython's own time.sleep, which gevent did not patch,
    keeps the hub in a C call where no line starts: gevent's worker runs in
    the main thread, so the wake signal ends the sleep and RequestTimeout
    is raised there.  (Before, the worker slept on for all 30 s, and its
    sibling with it.)"""
    sibling_carries_on(
        gevent,
        "gevent-c-sleep",
        stuck=f"/c-sleep?s={STUCK_FOR}",
        sibling="/sleep?s=0.2",
        delay=0.3,
        how=ARMED_GREENLET + WOKEN,
        access=GUNICORN_ACCESS,
    )
    assert booted(gevent) == 1


def test_gevent_cooperative_sleep_is_answered_504(gevent: Server) -> None:
    """A greenlet in time.sleep (gevent.sleep under monkey-patching) waits
    in the hub: RequestTimeout is thrown into it there, and the worker goes on."""
    sibling_carries_on(
        gevent,
        "gevent-sleep",
        stuck=f"/sleep?s={STUCK_FOR}",
        sibling="/sleep?s=0.5",
        delay=0.3,
        how=r"RequestTimeout to be thrown into greenlet 0x[0-9a-f]+ at its next safe point",
        access=GUNICORN_ACCESS,
    )
    assert booted(gevent) == 1


# -- uWSGI: one process, four threads ----------------------------------------------


@pytest.fixture(scope="module")
def uwsgi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp_path, port = tmp_path_factory.mktemp("uwsgi"), free_port()
    options = {
        "module": "flask_stuck_uwsgi:application",
        "pythonpath": str(APPS),
        "processes": "1",
        "threads": "4",
        "shmwheel-timeout": str(TIMEOUT),
        "shmwheel-interrupt": "true",
        "shmwheel-interrupt-grace": "0.5",
        "shmwheel-kill": "true",
        "shmwheel-kill-after": "2",
    }
    cmd = [str(BIN / "uwsgi"), "--ini", str(uwsgi_ini(tmp_path, port, **options))]
    with serve(cmd, port, tmp_path, "uwsgi") as server:
        server.wait_for(r"driver \d+: running on wheel 'uwsgi-\d+'")
        with stopped_cleanly(server, signal.SIGINT):
            yield server
            time.sleep(0.3)  # past the close of the last response, in C (see test_servers' group shutdown)


def test_uwsgi_thread_in_a_cpu_loop_is_answered_504_and_its_worker_serves_on(uwsgi: Server) -> None:
    """``shmwheel-interrupt = true``: a thread in a Python loop gets
    RequestTimeout; the request in the worker's other thread finishes, and
    uWSGI respawns nothing."""
    sibling_carries_on(
        uwsgi,
        "uwsgi-spin",
        stuck=f"/spin?s={STUCK_FOR}",
        sibling="/sleep?s=0.8",
        delay=0.1,
        # uWSGI's main thread serves requests too (core 0), and is woken there as well.
        how=ARMED_THREAD + f"(?:{WOKEN})?",
        access=UWSGI_ACCESS,
    )
    assert "Respawned uWSGI worker" not in uwsgi.log()


# -- Uvicorn: the ASGI middleware ---------------------------------------------------


@pytest.fixture(scope="module")
def uvicorn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """``--workers 1``, which is one process, the app wrapped in
    TimeoutMiddleware(interrupt=True): every request is served by the same
    event loop.  (SIGINT stops it with status 0; on SIGTERM Uvicorn ends by
    the signal once it has shut down.)"""
    tmp_path, port = tmp_path_factory.mktemp("uvicorn"), free_port()
    cmd = [str(BIN / "uvicorn"), "asgi_stuck:interrupting", "--app-dir", str(APPS), "--host", "127.0.0.1",
           "--port", str(port), "--workers", "1"]  # fmt: skip
    with serve_asgi(cmd, port, tmp_path) as server:
        driver = auto_driver_of(server)
        yield server
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left_of_asgi(server, driver)


def test_uvicorn_awaiting_task_is_cancelled_and_answered_504(uvicorn: Server) -> None:
    """A task in ``await asyncio.sleep`` is cancelled through its loop; a
    sibling task that awaits on the same loop finishes."""
    sibling_carries_on(
        uvicorn,
        "asgi-await",
        stuck=f"/await-sleep?s={STUCK_FOR}",
        sibling="/await-sleep?s=0.6",
        delay=0.5,
        how=r"task Task-\d+ cancelled.*",
        access=UVICORN_ACCESS,
    )


def test_uvicorn_cpu_loop_in_an_async_endpoint_is_answered_504(uvicorn: Server) -> None:
    """A CPU loop in an async endpoint blocks the loop, which could never run
    a cancel: RequestTimeout is raised in the loop thread, inside the task's
    step; the sibling, which waited for the loop, is served after it, and
    the RequestTimeout goes no further than the middleware."""
    mark = len(uvicorn.log())
    sibling_carries_on(
        uvicorn,
        "asgi-spin",
        stuck=f"/spin?s={STUCK_FOR}",
        sibling="/await-sleep?s=0.2",
        delay=0.3,
        how=ARMED_LOOP + WOKEN,
        access=UVICORN_ACCESS,
    )
    # Starlette answers the RequestTimeout 500, which the 504 replaced, and
    # raises it again: the middleware ends it there, not the server.
    assert "Exception in ASGI application" not in uvicorn.log()[mark:], uvicorn.log()[mark:]


def test_uvicorn_time_sleep_in_an_async_endpoint_is_answered_504(uvicorn: Server) -> None:
    """A time.sleep in an async endpoint blocks the loop in a C call, where
    no line start comes: the loop's thread is Uvicorn's main thread, so the
    wake signal ends the sleep and RequestTimeout is raised there, in the
    task's step.  (Before, the loop slept on for all 30 s.)"""
    sibling_carries_on(
        uvicorn,
        "asgi-loop-sleep",
        stuck=f"/loop-sleep?s={STUCK_FOR}",
        sibling="/await-sleep?s=0.2",
        delay=0.3,
        how=ARMED_LOOP + WOKEN,
        access=UVICORN_ACCESS,
    )


def test_uvicorn_sync_endpoint_in_the_thread_pool_is_ended_and_its_thread_stops(uvicorn: Server) -> None:
    """A ``def`` endpoint, which Starlette runs in a worker thread of
    anyio's: the task's cancel cannot reach it, so the thread that runs it
    raises RequestTimeout itself at a safe point.  The client gets its 504,
    the thread stops spinning, and the driver hears the request end."""
    status, body = get(uvicorn.port, f"/thread-spin?s={STUCK_FOR}", WAIT, "asgi-thread")
    assert (status, body) == GATEWAY_TIMEOUT
    pid = driver_pid(uvicorn, "/thread-spin", "asgi-thread")
    uvicorn.wait_for(interrupting("/thread-spin", "asgi-thread", pid, r"task Task-\d+ cancelled .*, and the thread .*"))
    uvicorn.wait_for(r"GET /thread-spin \(request asgi-thread, .*\) ended [\d.]+ s after it was interrupted$")
    turns = get(uvicorn.port, "/spun")
    time.sleep(0.3)
    assert get(uvicorn.port, "/spun") == turns  # no thread spins on


def test_uvicorn_a_task_waiting_for_its_thread_runs_on_with_its_timer_until_the_thread_is_back(
    uvicorn: Server,
) -> None:
    """A task that awaits a function run in a thread (``asyncio.to_thread``,
    a sync endpoint) is not cancelled while that thread runs: the cancel
    would leave the thread running and end the request's timer with the
    task, and then nothing would end it, or kill its worker, if it never
    returned.  The client gets its 504 at the timeout; the request has not
    ended when the interrupt's grace is over (with kill on, the kill comes
    here); once the thread is back, the task is cancelled at its next
    await, and the driver says that the request ended.  (Before, the task
    was cancelled at once and the driver heard the request end while its
    thread slept on; then, the driver forgot the request once it had said
    that it ran on, and never said that it ended.)"""
    status, body = get(uvicorn.port, "/thread-then-await?s=2.5", WAIT, "asgi-to-thread")
    assert (status, body) == GATEWAY_TIMEOUT
    pid = driver_pid(uvicorn, "/thread-then-await", "asgi-to-thread")
    how = r"task Task-\d+ cancelled once told its client is gone .*, but not before the thread it waits for is back, .*"
    uvicorn.wait_for(interrupting("/thread-then-await", "asgi-to-thread", pid, how))
    uvicorn.wait_for(
        r"GET /thread-then-await \(request asgi-to-thread, .*\) has not ended 0\.5 s after it was interrupted: "
        r".*; it runs on \(kill is off\)$"
    )
    uvicorn.wait_for("asgi_stuck: /thread-then-await cancelled once its thread had returned")
    uvicorn.wait_for(r"GET /thread-then-await \(request asgi-to-thread, .*\) ended [\d.]+ s after it was interrupted$")
    assert "cancelled while its thread ran" not in uvicorn.log()


def test_uvicorn_hostile_path_is_data_in_the_log(uvicorn: Server) -> None:
    """Uvicorn decodes the path into the scope: shmwheel's lines about the
    request show its newline, ESC and override escaped.  (Before, a forged
    CRITICAL line and a raw escape sequence went into the log.)"""
    assert get(uvicorn.port, HOSTILE_PATH + "?s=30", WAIT, "hostile-uvicorn") == GATEWAY_TIMEOUT
    assert_client_text_is_data(uvicorn, "hostile-uvicorn")


def test_uvicorn_extend_keeps_a_streaming_response_alive_past_its_timeout(uvicorn: Server) -> None:
    """Starlette's StreamingResponse of an async generator that calls
    extend(1 s) per chunk, for 2.4 s; with extend(0.2 s) it is cut off."""
    stream_is_cut_when_extend_is_too_short(uvicorn, "asgi-stream-short")
    start = time.monotonic()
    status, body = get(uvicorn.port, "/stream?chunks=6&every=0.4&extend=1.0", WAIT, "asgi-stream")
    assert time.monotonic() - start >= 2.4
    chunks = "".join(f"chunk {n}: extend() returned True\n" for n in range(6))
    assert status == 200 and body.startswith(chunks), (status, body)
    pid_of((status, body.removeprefix(chunks)))
    never_timed_out(uvicorn, "/stream", "asgi-stream")


def test_uvicorn_no_timeout_exempts_a_request(uvicorn: Server) -> None:
    """no_timeout() in an async endpoint, which then awaits past its timeout."""
    exempted(uvicorn, "asgi-exempt")


# -- Hypercorn's trio worker: a trio task, cancelled through its own run --------------

ARMED_TRIO = (
    r"RequestTimeout to be raised in trio task hypercorn\.trio\.task_group\._handle, which blocks trio's loop, "
    r"at its next safe point"
)


def test_uvicorn_a_task_that_only_notes_its_client_leaving_does_not_keep_the_request_running(
    uvicorn: Server,
) -> None:
    """At the interrupt a task of the application's that waits in receive()
    hears that the client has gone; one that only notes it, as this one
    does, leaves the request's task as it was, which is then cancelled all
    the same: the request ends within the grace, never "has not ended"."""
    assert get(uvicorn.port, "/watched?s=60", WAIT, "asgi-watched") == GATEWAY_TIMEOUT
    uvicorn.wait_for(r"asgi_stuck: /watched heard http.disconnect")
    uvicorn.wait_for(r"GET /watched \(request asgi-watched, .*\) ended [\d.]+ s after it was interrupted$")
    assert not re.search(r"GET /watched \(request asgi-watched, .*\) has not ended", uvicorn.log())


def test_uvicorn_a_task_the_request_started_but_does_not_wait_for_is_never_interrupted(uvicorn: Server) -> None:
    """A task made during a request copies its context (a pool's keeper that
    a library starts at its first use): while it blocks the loop when the
    request is interrupted, the loop's thread is not armed against it, as it
    is against a task the request waits for.  It runs its 3 s to the end,
    and the request is answered when the loop is free again."""
    assert get(uvicorn.port, "/keeper?s=60", WAIT, "asgi-keeper") == GATEWAY_TIMEOUT
    give_up = time.monotonic() + WAIT
    while (state := get(uvicorn.port, "/keeper-state")) == (200, "running\n"):
        assert time.monotonic() < give_up
        time.sleep(0.1)
    assert state == (200, "finished\n")


def test_uvicorn_a_response_that_had_begun_is_never_completed_after_its_interrupt(uvicorn: Server) -> None:
    """A stream that had sent its first chunk hears at the interrupt that its
    client has gone, and ends its body as if it had: the server must not
    send that end (a chunked response complete, a 200 a proxy would cache)
    but close the connection with the response broken off."""
    with socket.create_connection(("127.0.0.1", uvicorn.port), timeout=WAIT) as conn:
        conn.sendall(b"GET /cut-stream?s=60 HTTP/1.1\r\nHost: x\r\nX-Request-Id: asgi-cut\r\n\r\n")
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and b"first\n" in got, got
    assert not got.endswith(b"0\r\n\r\n"), got
    uvicorn.wait_for(r"GET /cut-stream \(request asgi-cut, .*\) ended [\d.]+ s after it was interrupted$")


def hypercorn(tmp_path_factory: pytest.TempPathFactory, worker: str) -> Iterator[Server]:
    """Hypercorn ``-k worker`` with one worker process, the app wrapped in
    TimeoutMiddleware(interrupt=True)."""
    tmp_path, port = tmp_path_factory.mktemp(f"hypercorn-{worker}"), free_port()
    cmd = [str(BIN / "hypercorn"), "-k", worker, f"{APPS / 'asgi_stuck'}:interrupting", "--bind",
           f"127.0.0.1:{port}", "--access-logfile", "-"]  # fmt: skip
    with serve_asgi(cmd, port, tmp_path) as server:
        driver = auto_driver_of(server)
        yield server
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left_of_asgi(server, driver)


@pytest.fixture(scope="module")
def hypercorn_trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """trio runs every request, and no asyncio loop runs at all."""
    yield from hypercorn(tmp_path_factory, "trio")


def test_hypercorn_trio_awaiting_task_is_cancelled_and_answered_504(hypercorn_trio: Server) -> None:
    """A trio task in ``await anyio.sleep`` is cancelled through its run's
    token, at its checkpoint; a sibling task on the same run finishes.
    (Before, a trio task was never interrupted: the client waited 30 s.)"""
    sibling_carries_on(
        hypercorn_trio,
        "trio-await",
        stuck=f"/anyio-sleep?s={STUCK_FOR}",
        sibling="/anyio-sleep?s=0.6",
        delay=0.5,
        how=r"trio task hypercorn\.trio\.task_group\._handle cancelled.*",
        access=HYPERCORN_ACCESS,
    )


def test_hypercorn_trio_cpu_loop_and_time_sleep_in_an_async_endpoint_are_answered_504(
    hypercorn_trio: Server,
) -> None:
    """A CPU loop, and a time.sleep, in an async endpoint block trio's loop,
    which could never run a cancel: RequestTimeout is raised in the task's
    step, never in trio's own code between two steps (where it would end
    the whole run: TrioInternalError); the sibling is served after."""
    for name, stuck, how in (
        ("trio-spin", f"/spin?s={STUCK_FOR}", ARMED_TRIO + WOKEN),
        ("trio-loop-sleep", f"/loop-sleep?s={STUCK_FOR}", ARMED_TRIO + WOKEN),
    ):
        sibling_carries_on(
            hypercorn_trio, name, stuck=stuck, sibling="/anyio-sleep?s=0.2", delay=0.3, how=how, access=HYPERCORN_ACCESS
        )
    assert "TrioInternalError" not in hypercorn_trio.log()


def test_hypercorn_trio_hostile_path_is_data_in_the_log(hypercorn_trio: Server) -> None:
    """The same under Hypercorn, whose logger is the driver's and the
    worker's too.  (Hypercorn's own access log writes the decoded path as
    it is, newline and escape sequence included: that line is its own.)"""
    assert get(hypercorn_trio.port, HOSTILE_PATH + "?s=30", WAIT, "hostile-trio") == GATEWAY_TIMEOUT
    its_access_line = r'\[INFO\] 127\.0\.0\.1:\d+ - - \[[^]]*\] "GET /spin/x\n.*? 1\.1" 504 '
    assert_client_text_is_data(hypercorn_trio, "hostile-trio", its_access_line)


def test_hypercorn_trio_sync_endpoint_in_a_worker_thread_is_ended_and_its_thread_stops(hypercorn_trio: Server) -> None:
    """A ``def`` endpoint runs in one of trio's cached threads (anyio's
    to_thread under trio), below trio's and outcome's frames: that thread
    raises RequestTimeout itself, the client gets its 504, the thread stops
    spinning and the driver hears the request end."""
    status, body = get(hypercorn_trio.port, f"/thread-spin?s={STUCK_FOR}", WAIT, "trio-thread")
    assert (status, body) == GATEWAY_TIMEOUT
    pid = driver_pid(hypercorn_trio, "/thread-spin", "trio-thread")
    how = r"trio task .* cancelled, and the thread .*"
    hypercorn_trio.wait_for(interrupting("/thread-spin", "trio-thread", pid, how))
    hypercorn_trio.wait_for(r"GET /thread-spin \(request trio-thread, .*\) ended [\d.]+ s after it was interrupted$")
    turns = get(hypercorn_trio.port, "/spun")
    time.sleep(0.3)
    assert get(hypercorn_trio.port, "/spun") == turns  # no thread spins on


# -- Hypercorn over HTTP/2: one connection, many requests ------------------------------


@pytest.fixture(scope="module")
def hypercorn_asyncio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from hypercorn(tmp_path_factory, "asyncio")


class Stream:
    """What came on one HTTP/2 stream."""

    def __init__(self) -> None:
        self.status: int | None = None
        self.body = b""
        self.ended = self.reset = False


class H2:
    """An HTTP/2 connection to a server (cleartext, with prior knowledge),
    read frame by frame."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.streams: dict[int, Stream] = {}
        self.closed = False
        self._flush()

    def request(self, method: str, path: str, request_id: str, end: bool = True) -> Stream:
        sid = self.conn.get_next_available_stream_id()
        headers = [(":method", method), (":path", path), (":scheme", "http"), (":authority", "test"),
                   ("x-request-id", request_id)]  # fmt: skip
        self.conn.send_headers(sid, headers, end_stream=end)
        self.streams[sid] = Stream()
        self._flush()
        return self.streams[sid]

    def send(self, stream: Stream, data: bytes, end: bool) -> None:
        sid = next(sid for sid, s in self.streams.items() if s is stream)
        self.conn.send_data(sid, data, end_stream=end)
        self._flush()

    def read_until(self, done: Callable[[], bool]) -> None:
        """Reads until ``done()``, or the server closes the connection (a
        timeout of WAIT s fails the test)."""
        while not done() and not self.closed:
            data = self.sock.recv(65536)
            if not data:
                self.closed = True
            for event in self.conn.receive_data(data) if data else ():
                stream = self.streams.get(getattr(event, "stream_id", 0))
                if isinstance(event, h2.events.ResponseReceived) and stream is not None:
                    stream.status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived) and stream is not None:
                    stream.body += event.data
                    self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded) and stream is not None:
                    stream.ended = True
                elif isinstance(event, h2.events.StreamReset) and stream is not None:
                    stream.reset = True
                elif isinstance(event, h2.events.ConnectionTerminated):
                    self.closed = True
            self._flush()

    def _flush(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(self.conn.data_to_send())

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("worker", ["asyncio", "trio"])
def test_hypercorn_a_response_broken_off_at_its_interrupt_ends_only_its_own_http2_stream(
    worker: str, request: pytest.FixtureRequest
) -> None:
    """A response that had begun when its request was interrupted is broken
    off (its stream never ends), and nothing else: a request on another
    stream of the same HTTP/2 connection is answered, the connection serves
    on, and so does the worker.  Hypercorn runs a connection's streams in
    one task group, and under trio its connections in one nursery: the
    exception that breaks the response off must be an Exception, which
    Hypercorn logs.  (Before, RequestTimeout, a BaseException, went up the
    task group: the other streams of the connection were answered 500, and
    under trio the worker process died and the server stopped serving.)"""
    server: Server = request.getfixturevalue(f"hypercorn_{worker}")
    client = H2(server.port)
    try:
        begun = client.request("GET", "/begun?s=60", f"h2-begun-{worker}")
        # no_timeout(): answered once its body is whole, after the interrupt
        echo = client.request("POST", "/echo", f"h2-echo-{worker}", end=False)
        client.send(echo, b"half, ", end=False)
        client.read_until(lambda: begun.body == b"first\n")
        server.wait_for(rf"GET /begun \(request h2-begun-{worker}, .*\) ended [\d.]+ s after it was interrupted$")
        client.send(echo, b"whole", end=True)
        client.read_until(lambda: echo.ended or echo.reset)
        assert (echo.status, echo.body, echo.ended) == (200, b"half, whole", True)
        after = client.request("GET", "/", f"h2-after-{worker}")
        client.read_until(lambda: after.ended or after.reset)
        assert (after.status, after.ended) == (200, True)
        assert (begun.status, begun.body, begun.ended) == (200, b"first\n", False)
        assert not client.closed
    finally:
        client.close()
    assert get(server.port, "/")[0] == 200  # a new connection: the worker serves on
    log = server.log()
    assert "ResponseBrokenOff: the request ran past its timeout after its response had begun" in log
    assert "client_connected_cb" not in log and "SpawnProcess" not in log
