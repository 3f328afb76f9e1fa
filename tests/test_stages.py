"""The stages of a late request, piece by piece: routes, the X-Request-Start
header, the record's stage fields, the driver's warn, interrupt and kill
stages on real worker processes, and the interrupt of a thread, an asyncio
task and a greenlet through the middlewares.  (test_interrupt.py runs the
real servers.)"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import script_processes

import shmwheel
from shmwheel.contrib import (
    KIND_CHECK,
    KIND_REQUEST,
    PAYLOAD_SIZE,
    RequestTimeout,
    RequestTimer,
    TimeoutActions,
    TimeoutHandler,
    TimeoutSettings,
    _handler,
    decode_request,
    encode_request,
    extend,
    no_timeout,
)
from shmwheel.contrib._record import rearmed
from shmwheel.contrib._routes import compile_routes
from shmwheel.contrib._stacks import report_overdue
from shmwheel.contrib._worker import queued_ns
from shmwheel.contrib.asgi import TimeoutMiddleware as AsgiMiddleware
from shmwheel.contrib.wsgi import TimeoutMiddleware

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WAIT = 30.0
S = 1_000_000_000

# -- routes and the X-Request-Start header ----------------------------------------


def test_routes_pick_the_longest_prefix_and_a_method_before_none() -> None:
    lookup = compile_routes({"/": 5, "/api/": 2, "POST /api/": 9, "/api/health": None, "GET /up": 60}, 30 * S)
    assert lookup is not None
    assert lookup("GET", "/api/x") == 2 * S
    assert lookup("POST", "/api/x") == 9 * S  # as long a prefix, with a method: it wins
    assert lookup("GET", "/api/health") is None  # no timeout
    assert lookup("GET", "/up/load") == 60 * S
    assert lookup("PUT", "/up/load") == 5 * S  # the method does not match: "/" does


def test_a_route_covers_whole_segments_and_its_method_any_case() -> None:
    """What a raw string prefix got wrong: "/report" covered "/reportage"
    and "post" never matched POST."""
    lookup = compile_routes({"/report": 6, "/api/": 2, "post /upload": 5, "/": 1}, 30 * S)
    assert lookup is not None
    assert [lookup("GET", p) for p in ("/report", "/report/", "/report/2024")] == [6 * S] * 3
    assert lookup("GET", "/reportage") == S  # not a segment of /report: "/" covers it
    assert [lookup("GET", p) for p in ("/api", "/api/", "/api/keys", "/apikeys")] == [2 * S, 2 * S, 2 * S, S]
    assert lookup("POST", "/upload") == lookup("post", "/upload/x") == 5 * S
    assert lookup("PUT", "/upload") == S
    assert compile_routes({"/x": 3}, 30 * S)("GET", "/") == 30 * S  # type: ignore[misc]
    assert compile_routes({"/api/": 2}, 30 * S)("GET", "/other") == 30 * S  # type: ignore[misc]
    assert compile_routes(lambda method, path: 3 if path == "/x" else None, 30 * S)("GET", "/x") == 3 * S  # type: ignore[misc]
    assert compile_routes(None, 30 * S) is None


@pytest.mark.parametrize(
    ("routes", "error", "match"),
    [
        ({"api/": 2}, ValueError, "is not a path, or a method and a path"),
        ({"GET  /x": 2}, ValueError, "is not a path, or a method and a path"),
        ({"//": 2}, ValueError, "is not a path, or a method and a path"),
        ({"/api//x": 2}, ValueError, "is not a path, or a method and a path"),
        ({"/report": 3, "/report/": 4}, ValueError, "'/report' and '/report/' are the same route"),
        ({"post /x": 5, "POST /x": 6}, ValueError, "'post /x' and 'POST /x' are the same route"),
        ({"/x": 0}, ValueError, "positive"),
        ({"/x": "2"}, TypeError, "number of seconds"),
        ([("/x", 2)], TypeError, "mapping of paths or a callable"),
    ],
)
def test_bad_routes_fail_when_made(routes: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        RequestTimer("w", 30.0, routes=routes)


def test_request_start_header_in_each_unit_and_insane_ones_ignored() -> None:
    now = 1_700_000_000 * S
    queued = 250_000_000  # 250 ms
    t = now - queued
    assert queued_ns(f"t={t / S:.3f}", now) == queued  # nginx: seconds with ms
    assert queued_ns(f"t={t // 1000}", now) == queued  # microseconds
    assert queued_ns(str(t // 1_000_000), now) == queued  # Heroku: milliseconds
    assert queued_ns(str(t), now) == queued  # nanoseconds
    assert queued_ns(f"t={(now + S) / S}", now) == 0  # from the future: clocks that disagree
    assert queued_ns(f"t={(now - 7200 * S) / S}", now) == 0  # two hours: the same
    for junk in ("", "t=", "abc", "t=nan", "-5", "t=inf"):
        assert queued_ns(junk, now) == 0


def test_a_request_counts_at_most_its_whole_timeout_of_queue_time() -> None:
    """A header 3000 s old (sane: under an hour) makes a 2 s request due as
    it starts, no earlier; one 0.5 s old counts its 0.5 s."""
    timer = RequestTimer("w", 2.0)
    now = time.monotonic_ns()
    wall = time.time()
    assert timer._times(now, "GET", "/", f"t={wall - 3000:.3f}") == (2 * S, now - 2 * S)
    header = f"t={wall - 0.5:.3f}"
    timeout_ns, started = timer._times(now, "GET", "/", header)  # type: ignore[misc]
    read_by = time.time()  # the header's age is counted from a moment before this one
    assert timeout_ns == 2 * S and 0.499 * S <= now - started <= (read_by - wall + 0.501) * S
    assert timer._times(now, "GET", "/", None) == (2 * S, now)


# -- the record and the arguments -------------------------------------------------


def test_a_record_carries_its_stages_and_a_rearmed_one_is_a_plain_timeout() -> None:
    payload = encode_request(KIND_REQUEST, 1, 2, 3, "GET", "r", "/x", timeout_ms=30_000, warn=True, interrupt=True)
    record = decode_request(payload)
    assert record is not None
    assert (record.timeout_ms, record.warn, record.interrupt) == (30_000, True, True)
    assert record.timeout_at() == 3 + 30_000 * 1_000_000
    again = decode_request(rearmed(payload, 45_000))
    assert again == record._replace(timeout_ms=45_000, warn=False)
    huge = decode_request(encode_request(KIND_REQUEST, 1, 2, 3, "GET", "r", "/x", timeout_ms=2**40))
    assert huge is not None and huge.timeout_ms == 2**32 - 1  # clamped, not wrapped


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warn_after": 30.0}, ValueError, r"warn_after \(30 s\) must be shorter than the timeout \(30 s\)"),
        ({"warn_after": -1}, ValueError, "positive"),
        ({"interrupt": 1}, TypeError, "interrupt must be True or False"),
        ({"on_timeout": "report"}, TypeError, "on_timeout must be a function"),
        ({"interrupt": True, "traceback_signal": None}, ValueError, "traceback_signal cannot be None"),
    ],
)
def test_bad_stages_fail_when_made(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        RequestTimer("w", 30.0, **kwargs)
    if "traceback_signal" not in kwargs:  # the ASGI middleware's way to none is tracebacks=False
        with pytest.raises(error, match=match):
            AsgiMiddleware(lambda *a: None, 30.0, **kwargs)  # type: ignore[arg-type]


def test_actions_refuse_a_bad_interrupt_grace() -> None:
    with pytest.raises(ValueError, match="interrupt_grace must be a positive number"):
        TimeoutActions(interrupt_grace=0)


# -- the driver's stages, on worker processes ----------------------------------------

# A stand-in worker: one request of GET /slow with a timeout of argv[2]
# seconds (and warn_after argv[3], if not "-"), interrupt on, stuck in a
# function to find in its stack: "spin" a Python loop, which RequestTimeout
# ends (it says so, and finishes its request); "gil" a regular expression
# that holds the GIL, which nothing ends; "swallow" a loop that catches
# every Exception, so the interrupt is lost.
STAGED = textwrap.dedent(
    """
    import re, sys, time
    from shmwheel.contrib import RequestTimeout
    from shmwheel.contrib import RequestTimer
    mode, name, timeout, warn = sys.argv[1:5]
    timer = RequestTimer(name, float(timeout), interrupt=True, warn_after=None if warn == "-" else float(warn))
    assert timer.prepare()
    handle = timer.start("GET", "/slow", "r1")
    def serving_a_slow_request():
        print("ready", flush=True)
        until = time.monotonic() + 20
        if mode == "gil":
            re.match(r"(a+)+$", "a" * 32 + "b")
        while time.monotonic() < until:
            try:
                while time.monotonic() < until:
                    pass
            except RequestTimeout:
                if mode != "swallow":
                    print("interrupted", flush=True)
                    timer.finish(handle)
                    time.sleep(20)
    serving_a_slow_request()
    """
)


@pytest.fixture
def staged(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    with script_processes(tmp_path, STAGED, "staged") as run:

        def start(mode: str, wheel: str, timeout: float, warn_after: float | None = None) -> subprocess.Popen[str]:
            return run([mode, wheel, repr(timeout), "-" if warn_after is None else repr(warn_after)])

        yield start


def drive(wheel: shmwheel.Wheel, handler: TimeoutHandler, seconds: float) -> list[int]:
    """Hand every fire to the handler for ``seconds``; the kinds of the fires, in order."""
    kinds = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        for fire in wheel.poll():
            handler(fire)
            kinds.append(fire.payload[0])
        time.sleep(0.01)
    return kinds


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "shmwheel.timeouts"]


def test_no_stage_is_reported_a_nanosecond_before_its_deadline(make_wheel) -> None:
    """A signal for another request of the worker wakes its reporter: a
    request a hair before its own deadline is left alone (no stack, no
    hook, no interrupt), and reported from the deadline on."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    hooked: list[str] = []
    timer = RequestTimer(wheel.name, 30.0, on_timeout=lambda record, stack: hooked.append(record.path))
    handle = timer.start("GET", "/almost")
    try:
        assert handle is not None
        deadline = timer.in_progress()[handle].timeout_ns
        assert report_overdue(deadline - 1) == 0
        assert hooked == []
        assert report_overdue(deadline) == 1
        assert hooked == ["/almost"]
    finally:
        timer.finish(handle)


def test_an_interrupted_request_ends_and_its_worker_is_left_alone(make_wheel, staged, caplog, monkeypatch) -> None:
    monkeypatch.setattr(_handler, "DUMP_TIME", 2.0)  # its answer before the driver's look (1 s) on a slow machine
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = staged("spin", wheel.name, 0.2)
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True, interrupt_grace=0.5))
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        drive(wheel, handler, 2.0)
    assert proc.stdout is not None and proc.stdout.readline() == "interrupted\n"
    lines = messages(caplog)
    assert re.fullmatch(
        rf"request timed out: GET /slow \(request r1, worker pid {proc.pid}, thread 0x[0-9a-f]{{16}}\), running for "
        r"0\.\d+ s; asking it to end the request \(SIGRTMIN\+\d\), then SIGTERM if it has not ended 0\.5 s later, and "
        r"SIGKILL 5 s after that",
        lines[0],
    ), lines
    assert re.fullmatch(r"GET /slow \(request r1, .*\) ended [\d.]+ s after it was interrupted", lines[1]), lines
    assert len(lines) == 2, lines
    assert proc.poll() is None  # ended the request, not the worker
    err = Path(proc.err.name).read_text()  # type: ignore[attr-defined]
    assert "shmwheel: the stack of timed-out request GET /slow" in err
    assert "in serving_a_slow_request" in err
    assert re.search(r"shmwheel: interrupting GET /slow .*: RequestTimeout to be raised in thread 0x", err), err


@pytest.mark.parametrize("mode", ["gil", "swallow"])
def test_a_request_that_does_not_end_after_its_interrupt_goes_on_to_the_kill(
    mode: str, make_wheel, staged, caplog
) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = staged(mode, wheel.name, 0.2)
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True, interrupt_grace=0.6, kill_after=1.0))
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        drive(wheel, handler, 2.0)
    lines = messages(caplog)
    assert any(
        re.fullmatch(
            r"GET /slow \(request r1, .*\) has not ended 0\.6 s after it was interrupted: it has not reached a point "
            r"where it may be interrupted \(a C call that has not returned, cleanup code, logging\), or its code "
            r"caught RequestTimeout; sending SIGTERM",
            line,
        )
        for line in lines
    ), lines
    assert proc.wait(WAIT) == -signal.SIGTERM
    if mode == "gil":  # no Python ran to answer: faulthandler's dump came first
        assert any(line.startswith(f"worker pid {proc.pid} did not write the stack") for line in lines), lines


def test_without_kill_a_request_that_does_not_end_is_logged_and_runs_on(make_wheel, staged, caplog) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = staged("swallow", wheel.name, 0.2)
    handler = TimeoutHandler(wheel.name, TimeoutActions(interrupt_grace=0.4))
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        drive(wheel, handler, 1.2)
    assert any(line.endswith("caught RequestTimeout; it runs on (kill is off)") for line in messages(caplog))
    assert proc.poll() is None


def test_warn_after_logs_the_stack_then_the_timeout_stage_follows(make_wheel, staged, caplog, monkeypatch) -> None:
    monkeypatch.setattr(_handler, "DUMP_TIME", 1.0)  # each answer before the driver's look (0.5 s) on a slow machine
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = staged("spin", wheel.name, 1.0, 0.2)
    handler = TimeoutHandler(wheel.name, TimeoutActions())
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        kinds = drive(wheel, handler, 2.2)
    lines = messages(caplog)
    assert re.fullmatch(
        r"request is slow: GET /slow \(request r1, .*\), running for 0\.[2-7]\d\d s, 0\.[2-7]\d\d s before its "
        r"timeout; asking it for the request's stack \(SIGRTMIN\+\d\)",
        lines[0],
    ), lines
    assert lines[1].startswith("request timed out: GET /slow (request r1, "), lines
    assert kinds.count(KIND_REQUEST) == 1  # one timer from the worker for both stages
    assert kinds.count(KIND_CHECK) == 2
    err = Path(proc.err.name).read_text()  # type: ignore[attr-defined]
    assert re.search(r"shmwheel: the stack of slow request GET /slow .*, running for 0\.\d+ s, 0\.\d+ s before", err)
    assert "interrupted\n" == proc.stdout.readline()  # type: ignore[union-attr]


# -- in this process: the middlewares answer 504 --------------------------------------


def call(app: Callable[..., Any], path: str) -> tuple[str, bytes]:
    status: list[str] = []

    def start_response(s: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        status.append(s)

    body = app({"REQUEST_METHOD": "GET", "PATH_INFO": path}, start_response)
    try:
        data = b"".join(body)
    finally:
        body.close()  # type: ignore[attr-defined]
    return status[-1], data


def spin(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def wsgi_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    path = environ["PATH_INFO"]
    if path == "/spin":
        try:
            spin(10)
        except Exception as exc:  # noqa: BLE001 - as a framework does: an error page
            start_response("500 Internal Server Error", [])
            return [repr(exc).encode()]
    elif path == "/raise":
        spin(10)
    elif path == "/extend":
        for _ in range(5):
            time.sleep(0.15)
            assert extend(0.4)
    elif path == "/exempt":
        assert no_timeout()
        time.sleep(0.8)
    elif path == "/late":  # it extends after its timeout: too late, and ended
        try:
            spin(10)
        except RequestTimeout:
            assert not extend(5)
            raise
    start_response("200 OK", [])
    return [b"ok"]


def test_wsgi_interrupt_answers_504_and_leaves_the_other_requests_alone(driven) -> None:
    name = driven("--interrupt-grace", "2")
    app = TimeoutMiddleware(wsgi_app, name, 0.3, interrupt=True)
    paths = ["/spin", "/raise", "/extend", "/exempt", "/late", "/"]
    answers: dict[str, tuple[str, bytes]] = {}

    def one(path: str) -> None:
        answers[path] = call(app, path)

    threads = [threading.Thread(target=one, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    timeout = ("504 Gateway Timeout", b"504 Gateway Timeout: the request took too long\n")
    # The framework's 500 for RequestTimeout is replaced; a RequestTimeout out of the app is answered.
    assert answers["/spin"] == answers["/raise"] == answers["/late"] == timeout
    assert answers["/extend"] == answers["/exempt"] == answers["/"] == ("200 OK", b"ok")
    # The driver hears of each interrupted request's end through the wheel, a moment after the client.
    give_up = time.monotonic() + WAIT
    while len(re.findall(r"ended [\d.]+ s after it was interrupted", log := driven.log.read_text())) < 3:
        assert time.monotonic() < give_up, log
        time.sleep(0.05)
    assert "/extend" not in log and "/exempt" not in log, log
    assert len(re.findall(r"ended [\d.]+ s after it was interrupted", log)) == 3, log


def test_x_request_start_counts_the_time_the_request_queued(driven) -> None:
    """A request the proxy took 0.8 s ago, with a 1 s timeout, times out
    after 0.2 s of its own; the same without the header runs its 0.5 s."""
    name = driven("--interrupt-grace", "2")

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        spin(0.5)
        start_response("200 OK", [])
        return [b"ok"]

    middleware = TimeoutMiddleware(app, name, 1.0, interrupt=True, x_request_start=True)

    def call_queued(queued: float | None) -> str:
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/q"}
        if queued is not None:
            environ["HTTP_X_REQUEST_START"] = f"t={time.time() - queued:.3f}"  # nginx's $msec
        statuses: list[str] = []
        body = middleware(environ, lambda s, h, e=None: statuses.append(s))
        b"".join(body)
        body.close()  # type: ignore[attr-defined]
        return statuses[-1]

    assert call_queued(0.8) == "504 Gateway Timeout"
    assert call_queued(None) == "200 OK"
    assert re.search(r"request timed out: GET /q \(.*\), running for 1\.\d{3} s", driven.log.read_text())


def test_an_interrupt_never_lands_in_the_servers_code_that_writes_the_response(driven) -> None:
    """The application has answered; the server spins in Python writing the
    response past the timeout: the interrupt waits for the application's
    next chunk rather than cutting the server short (without the gate the
    server's loop gets RequestTimeout)."""
    name = driven("--interrupt-grace", "2")

    def chunks() -> Iterator[bytes]:
        yield b"one"
        yield b"two"

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        start_response("200 OK", [])
        return chunks()

    middleware = TimeoutMiddleware(app, name, 0.3, interrupt=True)
    statuses: list[str] = []
    body = middleware({"REQUEST_METHOD": "GET", "PATH_INFO": "/"}, lambda s, h, e=None: statuses.append(s))
    parts = iter(body)
    assert next(parts) == b"one"
    spin(1.0)  # the server writing "one": Python, where an interrupt would land
    with pytest.raises(RequestTimeout):  # the next chunk: the application's again, where the interrupt comes
        list(parts)
    body.close()  # type: ignore[attr-defined]
    # "one" has gone out with its headers: no second header block, the server closes the connection.
    assert statuses == ["200 OK"]
    log = driven.log.read_text()
    assert "asking it to end the request" in log


def test_asgi_interrupt_cancels_an_awaiting_task_and_ends_one_that_blocks_the_loop(driven) -> None:
    name = driven("--interrupt-grace", "2")

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/await":
            await asyncio.sleep(10)
        elif scope["path"] == "/block":
            spin(10)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = AsgiMiddleware(app, 0.3, name=name, interrupt=True)  # type: ignore[arg-type]

    async def one(path: str) -> tuple[int, bytes]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request"}

        await middleware({"type": "http", "path": path, "method": "GET", "headers": []}, receive, send)
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]  # the cancel was taken back
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    async def main() -> list[tuple[int, bytes]]:
        return await asyncio.gather(one("/await"), one("/"))

    assert asyncio.run(main()) == [(504, b"504 Gateway Timeout: the request took too long\n"), (200, b"ok")]
    assert asyncio.run(one("/block"))[0] == 504


def test_on_timeout_sends_the_stack_to_sentry_before_the_interrupt(driven) -> None:
    """examples/sentry_on_timeout.py with a real Sentry client, whose
    transport keeps the events here."""
    sentry_sdk = pytest.importorskip("sentry_sdk")
    sys.path.insert(0, str(EXAMPLES))
    try:
        from sentry_on_timeout import report_to_sentry
    finally:
        sys.path.remove(str(EXAMPLES))
    events: list[dict[str, Any]] = []

    class Keep(sentry_sdk.transport.Transport):  # type: ignore[misc]
        def capture_envelope(self, envelope: Any) -> None:
            events.extend(item.payload.json for item in envelope.items if item.type == "event")

    sentry_sdk.init(dsn="https://key@sentry.invalid/1", transport=Keep, default_integrations=False)
    try:
        name = driven()
        app = TimeoutMiddleware(wsgi_app, name, 0.3, interrupt=True, on_timeout=report_to_sentry)
        assert call(app, "/spin")[0] == "504 Gateway Timeout"
        sentry_sdk.flush()
    finally:
        sentry_sdk.init(dsn=None)
    [event] = events
    assert event["message"].startswith("request timed out: GET /spin, after 0.")
    assert event["contexts"]["request timeout"]["worker_pid"] == os.getpid()
    assert "in spin" in event["extra"]["stack"]  # where it was when it timed out


# -- the same settings for uWSGI and Gunicorn -------------------------------------


def test_uwsgi_reads_the_stages_and_the_routes() -> None:
    from shmwheel.contrib.uwsgi import on_timeout_hook, read_options

    opts = {
        "shmwheel-timeout": b"30",
        "shmwheel-tracebacks": b"false",
        "shmwheel-warn-after": b"10",
        "shmwheel-interrupt": b"true",
        "shmwheel-interrupt-grace": b"2.5",
        "shmwheel-route": [b"/upload 300", b"POST /api/ 5", b"/health none"],
        "shmwheel-on-timeout": b"sentry_on_timeout:report_to_sentry",
        "shmwheel-x-request-start": True,
    }
    s = read_options(opts, 1)
    t = s.timeouts
    assert (t.warn_after, t.interrupt, t.x_request_start) == (10.0, True, True)
    assert t.routes == {"/upload": 300.0, "POST /api/": 5.0, "/health": None}
    assert t.actions == TimeoutActions(tracebacks=False, interrupt_grace=2.5, routes=tuple(t.routes))  # for the metrics
    assert t.signal == signal.SIGURG  # no stacks, but the driver still tells the worker to end a request
    assert s.on_timeout == "sentry_on_timeout:report_to_sentry"
    with pytest.raises(ValueError, match="on-timeout must be module:function"):
        on_timeout_hook("report_to_sentry")
    with pytest.raises(ValueError, match="No module named 'no_such_module'"):
        on_timeout_hook("no_such_module:f")
    with pytest.raises(ValueError, match=r"shmwheel-route '/x soon': 'soon' is not a number of seconds"):
        read_options({"shmwheel-timeout": b"1", "shmwheel-route": b"/x soon"}, 1)
    with pytest.raises(ValueError, match="shmwheel-route must be"):
        read_options({"shmwheel-timeout": b"1", "shmwheel-route": b"300"}, 1)


def test_gunicorn_install_checks_the_stages_in_the_config() -> None:
    from shmwheel.contrib import gunicorn

    with pytest.raises(ValueError, match="warn_after .* must be shorter than the timeout"):
        gunicorn.install({}, 5.0, warn_after=10.0)
    with pytest.raises(ValueError, match="is not a path, or a method and a path"):
        gunicorn.install({}, 5.0, routes={"upload": 60})
    with pytest.raises(TypeError, match="x_request_start must be True or False"):
        gunicorn.install({}, 5.0, x_request_start="yes")  # type: ignore[arg-type]


def test_gunicorn_says_at_boot_that_eventlet_requests_cannot_be_interrupted() -> None:
    """interrupt=True under the eventlet worker would do nothing: the master says so."""
    from types import SimpleNamespace

    from shmwheel.contrib import gunicorn

    class EventletWorker:  # named as Gunicorn's, which needs eventlet to import
        pass

    EventletWorker.__module__ = "gunicorn.workers.geventlet"
    EventletWorker.__qualname__ = "EventletWorker"
    said: list[str] = []
    log = SimpleNamespace(warning=lambda msg, *a: said.append(msg % a), info=lambda *a: None)
    for interrupt in (False, True):
        server = SimpleNamespace(
            log=log, worker_class=EventletWorker, cfg=SimpleNamespace(timeout=30, worker_class_str="eventlet")
        )
        timeouts = TimeoutSettings(5.0, interrupt=interrupt, traceback_signal=signal.SIGURG, capacity=10)
        settings = gunicorn._Installed(name=None, timeouts=timeouts, kill_signal_given=False)
        gunicorn._check_setup(server, settings, gunicorn.HOOKS)
    assert len(said) == 1 and said[0].startswith("shmwheel: interrupt=True cannot end a request of the eventlet")


ASKED_FIRST = """
import logging, signal, sys, time
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
import shmwheel
from shmwheel.contrib import _stacks
from shmwheel.contrib._record import DUMP_SIGNALS, signal_name
from shmwheel.contrib import PAYLOAD_SIZE, RequestTimer, decode_request
name, queued = sys.argv[1], sys.argv[2] == "queued"
if not queued:  # every real-time signal the driver could ask on is the application's
    for signum in DUMP_SIGNALS:
        signal.signal(signum, lambda *args: None)
wheel = shmwheel.create(name, capacity=100, payload_size=PAYLOAD_SIZE)
try:
    timer = RequestTimer(name, 0.05)
    assert timer.prepare()
    a = timer.start("GET", "/a", "a")
    time.sleep(0.02)
    b = timer.start("GET", "/b", "b")
    active = timer.in_progress()
    deadline = {h: active[h].deadline_ns for h in (a, b)}
    started = {h: decode_request(active[h].payload).started_ns for h in (a, b)}
    print("asked on", signal_name(decode_request(active[a].payload).stack_signal), flush=True)
    # /a asked about; /b 10 ms late, not asked yet (the driver has its fire still to handle)
    _stacks.report_overdue(now_ns=deadline[b] + 10_000_000, asked={_stacks.asked_value(started[a], True)})
    print("--- /b 60 ms late, still not asked", flush=True)
    _stacks.report_overdue(now_ns=deadline[b] + 60_000_000, asked=set())
    print("--- /b asked", flush=True)
    _stacks.report_overdue(now_ns=deadline[b] + 70_000_000, asked={_stacks.asked_value(started[b], True)})
    timer.finish(a)
    timer.finish(b)
finally:
    wheel.close()
    shmwheel.unlink(name)
"""


@pytest.mark.parametrize("queued", ["queued", "merged"])
def test_a_late_request_is_acted_on_only_once_its_driver_has_said_so(name: str, queued: str) -> None:
    """Two late requests; the driver's signal names the first one (a value
    queued with it).  The worker writes that one's stack and leaves the
    other, whose own fire the driver may not have handled yet, for its own
    ask.  The driver asks on a real-time signal, where asks queue, so the
    other waits for its own, however late ("queued"; before, it was acted
    on 50 ms late, with or without the driver's line).  Where the
    application has every real-time signal, the driver asks on SIGURG,
    where a signal that comes while another is pending merges with it and
    loses its value: there it waits ASK_WAIT (50 ms) at most ("merged")."""
    args = [sys.executable, "-c", ASKED_FIRST, name, queued]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    first, late, then = re.split("--- /b 60 ms late, still not asked\n|--- /b asked\n", out)
    on = re.search(r"^asked on (\S+)$", first, re.M)
    assert "the stack of timed-out request GET /a" in first and "GET /b" not in first, out
    if queued == "queued":
        assert on is not None and on.group(1) == "SIGRTMIN+1", out
        assert late == "" and "the stack of timed-out request GET /b" in then, out
    else:
        assert on is not None and on.group(1) == "SIGURG", out
        assert "the stack of timed-out request GET /b" in late and then == "", out


BOTH_ASKED = """
import os, signal, sys, time
import shmwheel
from shmwheel._binding import lib
from shmwheel.contrib import _stacks
from shmwheel.contrib import PAYLOAD_SIZE, RequestTimer, decode_request
name = sys.argv[1]
heard = []
report = _stacks.report_overdue
_stacks.report_overdue = lambda now_ns=None, asked=None, **more: heard.append(asked) or report(now_ns, asked, **more)
wheel = shmwheel.create(name, capacity=100, payload_size=PAYLOAD_SIZE)
try:
    timer = RequestTimer(name, 0.05, traceback_signal=signal.SIGURG)
    assert timer.prepare()
    handles = [timer.start("GET", path, path) for path in ("/a", "/b")]
    records = [decode_request(timer.in_progress()[h].payload) for h in handles]
    values = {_stacks.asked_value(record.started_ns, True) for record in records}
    time.sleep(0.1)
    ask = records[0].stack_signal
    # As when the driver asks twice before the worker runs a handler: the
    # second ask comes while the first is pending.
    signal.pthread_sigmask(signal.SIG_BLOCK, {ask})
    fd = os.pidfd_open(os.getpid())
    for value in values:
        assert lib.shmw_pidfd_sigqueue(fd, ask, value) == 0
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {ask})
    give_up = time.monotonic() + 10
    while set().union(*(h or () for h in heard)) != values and time.monotonic() < give_up:
        time.sleep(0.01)
    print("heard both" if set().union(*(h or () for h in heard)) == values else f"heard {heard}")
    for handle in handles:
        timer.finish(handle)
finally:
    wheel.close()
    shmwheel.unlink(name)
"""


def test_two_asks_that_come_together_both_reach_the_worker_with_their_values(name: str) -> None:
    """The driver's second ask comes while its first is still pending (the
    signal blocked meanwhile): on the real-time signal the worker's records
    name, both queue, and the reporter hears both values through the C
    handler.  (Before, on SIGURG, the second merged with the first and its
    value was lost.)"""
    done = subprocess.run([sys.executable, "-c", BOTH_ASKED, name], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "heard both\n", done.stdout + done.stderr
