"""shmwheel.contrib.sentry with the real Sentry SDK, whose transport keeps
the events here: one event per timed-out request, with its own frames and
grouped by its view, none twice; and the view a request's frames show
(shmwheel.contrib._stacks.view_of)."""

from __future__ import annotations

import asyncio
import gzip
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sentry_sdk
from _servers import WAIT, assert_nothing_left, free_port, get, gunicorn_app, pid_of, serve
from fastapi import FastAPI
from flask import Flask
from sentry_sdk.integrations.flask import FlaskIntegration
from sentry_sdk.integrations.starlette import StarletteIntegration

from shmwheel.contrib import DUMP_TIME, RequestTimer, TimeoutActions, TimeoutSettings, _stacks
from shmwheel.contrib._record import PAYLOAD_SIZE, RequestRecord
from shmwheel.contrib._stacks import Frame, TimedOut, masked_path, view_of
from shmwheel.contrib.asgi import TimeoutMiddleware as AsgiMiddleware
from shmwheel.contrib.sentry import ShmwheelIntegration
from shmwheel.contrib.sentry import event as sentry_event
from shmwheel.contrib.wsgi import TimeoutMiddleware


@pytest.fixture
def sentry() -> Iterator[Callable[..., list[dict[str, Any]]]]:
    """Sentry initialised with these integrations; the events it sent."""
    events: list[dict[str, Any]] = []

    class Keep(sentry_sdk.transport.Transport):  # type: ignore[misc]
        def capture_envelope(self, envelope: Any) -> None:
            events.extend(item.payload.json for item in envelope.items if item.type == "event")

    def init(*integrations: Any) -> list[dict[str, Any]]:
        sentry_sdk.init(
            dsn="https://key@sentry.invalid/1", transport=Keep, default_integrations=False, integrations=integrations
        )
        return events

    yield init
    sentry_sdk.init(dsn=None)


def spin(seconds: float, until_in: list[Any] | None = None) -> None:
    """A Python loop for ``seconds``, or until ``until_in`` has something (no call in it: its frame is innermost)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until and not until_in:
        pass


def flask_app() -> Flask:
    app = Flask(__name__)

    @app.route("/items/<int:item>")
    def item(item: int) -> str:
        spin(10)  # Python that runs: the interrupt ends it at once
        return "never"

    @app.route("/quick")
    def quick() -> str:
        return "quick"

    return app


def wsgi_get(app: Callable[..., Any], path: str) -> str:
    status: list[str] = []
    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": path,
        "SERVER_NAME": "localhost",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": None,
    }
    body = app(environ, lambda s, headers, exc_info=None: status.append(s))
    try:
        b"".join(body)
    finally:
        body.close()
    return status[-1]


def test_each_timed_out_request_is_one_event_with_its_own_frames_grouped_by_its_view(driven, sentry) -> None:
    """Two paths of one Flask view, interrupted: two events of one
    fingerprint, whose frames end where the view was when its time ran
    out.  Sentry's own Flask integration would send the RequestTimeout that
    ends each of them as well, as an unhandled error of the view: dropped."""
    events = sentry(FlaskIntegration(), ShmwheelIntegration())
    app = TimeoutMiddleware(flask_app(), driven(), 0.3, interrupt=True)
    assert [wsgi_get(app, p) for p in ("/items/1", "/items/2", "/quick")] == [
        "504 Gateway Timeout",
        "504 Gateway Timeout",
        "200 OK",
    ]
    sentry_sdk.flush()
    assert len(events) == 2, [e.get("exception") for e in events]
    view = f"{__name__}.flask_app.<locals>.item"
    for event, path in zip(events, ("/items/1", "/items/2"), strict=True):
        [exc] = event["exception"]["values"]
        assert (exc["type"], exc["value"]) == ("RequestTimeout", f"GET {view} ran past its timeout")
        assert exc["mechanism"] == {"type": "shmwheel", "handled": True}  # no crash, in release health
        frames = exc["stacktrace"]["frames"]
        assert [f["function"] for f in frames[-2:]] == ["flask_app.<locals>.item", "spin"]
        body = ("until = time.monotonic() + seconds", "while time.monotonic() < until and not until_in:", "pass")
        assert frames[-1]["context_line"].strip() in body  # with the source around it
        assert any(line.startswith("def spin(") for line in frames[-1]["pre_context"])
        assert frames[-1]["in_app"] is True  # by Sentry's own rule (the project's root)
        ours = [f["in_app"] for f in frames if f["module"].startswith("shmwheel.")]
        assert ours and not any(ours)  # the middleware's, though it runs from the project's root here
        assert event["fingerprint"] == ["shmwheel-timeout", "GET", view]
        assert event["transaction"] == view and event["level"] == "warning"
        assert event["request"]["url"] == path
        assert event["contexts"]["request timeout"]["worker_pid"] == os.getpid()
        assert "in spin" in event["extra"]["stack"]


def test_without_interrupt_the_event_is_sent_and_the_request_runs_on(driven, sentry) -> None:
    events = sentry(ShmwheelIntegration(level="error"))

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        spin(WAIT, events)  # until its event is out, however slow the machine
        start_response("200 OK", [])
        return [b"late"]

    assert wsgi_get(TimeoutMiddleware(app, driven(), 0.3), "/late") == "200 OK"
    sentry_sdk.flush()
    [event] = events
    assert event["level"] == "error"
    assert event["exception"]["values"][0]["stacktrace"]["frames"][-1]["function"] == "spin"
    assert event["fingerprint"] == [
        "shmwheel-timeout",
        "GET",
        f"{__name__}.{test_without_interrupt_the_event_is_sent_and_the_request_runs_on.__name__}.<locals>.app",
    ]


def test_an_async_endpoint_is_reported_from_its_task(driven, sentry) -> None:
    """A FastAPI endpoint that blocks the event loop: its frames are the loop thread's."""
    events = sentry(StarletteIntegration(), ShmwheelIntegration())
    api = FastAPI()

    @api.get("/block")
    async def block() -> str:
        spin(10)
        return "never"

    middleware = AsgiMiddleware(api, 0.3, name=driven(), interrupt=True)

    async def one(path: str) -> int:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        scope = {"type": "http", "path": path, "method": "GET", "headers": [], "query_string": b""}
        await middleware(scope, receive, send)
        return int(sent[0]["status"])

    assert asyncio.run(one("/block")) == 504
    sentry_sdk.flush()
    [event] = events
    view = f"{__name__}.test_an_async_endpoint_is_reported_from_its_task.<locals>.block"
    assert event["fingerprint"] == ["shmwheel-timeout", "GET", view]
    assert event["exception"]["values"][0]["stacktrace"]["frames"][-1]["function"] == "spin"


def test_sentry_without_the_integration_gets_nothing_of_ours(driven, sentry) -> None:
    """Once registered in a process, the reporter sends only while the
    client in use has the integration."""
    sentry(ShmwheelIntegration())
    events = sentry()  # initialised again, without it
    app = TimeoutMiddleware(flask_app(), driven(), 0.3, interrupt=True)
    assert wsgi_get(app, "/items/1") == "504 Gateway Timeout"
    sentry_sdk.flush()
    assert events == []


def test_the_level_is_checked() -> None:
    with pytest.raises(ValueError, match="level must be one of debug, info, warning, error, fatal, not 'loud'"):
        ShmwheelIntegration(level="loud")  # type: ignore[arg-type]


# -- the view a request's frames show -----------------------------------------------


def _frames(*where: tuple[str, str]) -> list[Frame]:
    """Frames of (file, "module.function")."""
    frames = []
    for filename, name in where:
        module, function = name.split(".", 1)
        frames.append(Frame(filename, 1, function, module, ""))
    return frames


def test_the_view_is_the_innermost_application_frame_a_library_called() -> None:
    lib = _stacks._INSTALLED[0] + "django/core/handlers/base.py"
    std = _stacks._STDLIB[0] + "contextlib.py"
    app = "/srv/project/app/views.py"
    mw = "/srv/project/app/middleware.py"
    own = _stacks._OWN_PACKAGE[0] + "contrib/_views.py"
    # a project middleware, then the framework again, then the view, then what it calls
    chain = _frames(
        (lib, "base.handler"),
        (mw, "mw.__call__"),
        (lib, "base.get_response"),
        (own, "_views.timed"),
        (app, "views.export"),
    )
    assert view_of([*chain, *_frames((app, "views.helper"), (std, "contextlib.inner"))]) == "views.export"
    # the standard library between passes a library's call through; the application's own does not
    assert view_of(_frames((lib, "base.run"), (std, "thread.run"), (app, "views.report"))) == "views.report"
    assert view_of(_frames((app, "views.a"), (std, "json.dumps"), (app, "views.default"))) is None
    assert view_of(_frames((lib, "base.handler"), (lib, "base.more"))) is None
    assert view_of(_frames(("<frozen runpy>", "runpy.run"), (app, "views.main"))) is None


# -- under a real server, to a real endpoint --------------------------------------------


class Catcher(http.server.ThreadingHTTPServer):
    """Sentry's endpoint, on this machine: the events its envelopes carry."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        catcher = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
                data = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    data = gzip.decompress(data)
                lines = data.split(b"\n")
                for header, payload in zip(lines[1::2], lines[2::2], strict=False):  # after the envelope's own header
                    if json.loads(header).get("type") == "event":
                        catcher.events.append(json.loads(payload))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_under_gunicorn_the_event_is_out_before_the_driver_kills_the_worker(tmp_path: Path) -> None:
    """kill=True and no interrupt: the driver kills the worker as soon as
    it has written the stack; the event has reached Sentry's endpoint by
    then, since the worker flushes it first."""
    catcher = Catcher()
    port = free_port()
    cmd = gunicorn_app(
        tmp_path, port, "sync", "--workers", "1", install="timeout=0.5, kill=True", app="sentry_flask:app"
    )
    config = tmp_path / "gunicorn.conf.py"
    dsn = f"http://key@127.0.0.1:{catcher.server_address[1]}/1"
    config.write_text(f"import os\nos.environ['SENTRY_DSN'] = {dsn!r}\n" + config.read_text())
    try:
        with serve(cmd, port, tmp_path, "gunicorn") as server:
            server.wait_for(r"driver pid \d+")
            pid = pid_of(get(server.port, "/"))
            assert get(server.port, "/report/7?s=30", timeout=60)[0] in (0, 500)  # its worker killed
            server.wait_for(rf"Worker exiting \(pid: {pid}\)|Worker \(pid:{pid}\) (?:exited|was sent)")
            assert len(catcher.events) == 1, [e.get("exception") for e in catcher.events]
            [event] = catcher.events
            assert event["fingerprint"] == ["shmwheel-timeout", "GET", "sentry_flask.report"]
            assert event["contexts"]["request timeout"]["worker_pid"] == pid
            assert event["exception"]["values"][0]["stacktrace"]["frames"][-1]["function"] == "report"
            assert server.stop(signal.SIGTERM) == 0
            assert_nothing_left(server)
    finally:
        catcher.shutdown()
        catcher.server_close()


# -- when a reporter is told ---------------------------------------------------------


def test_a_reporter_is_told_before_the_interrupt_and_flushed_after_it(driven) -> None:
    """report() while the request still runs, flush() once it is
    interrupted; and one that fails neither stops the interrupt nor the
    next reporter."""
    told: list[tuple[str, bool]] = []
    timer: list[Any] = []

    class Failing:
        def report(self, timed_out: Any) -> None:
            raise RuntimeError("a reporter's bug")

        def flush(self, timeout: float) -> None:
            raise RuntimeError("a reporter's bug")

    class Keep:
        handle = -1

        def report(self, timed_out: Any) -> None:
            assert timed_out.frames[-1].function == "spin"
            [self.handle] = timer[0].in_progress()
            told.append(("report", timer[0].interrupted(self.handle)))

        def flush(self, timeout: float) -> None:  # interrupted, or ended by the interrupt already (it spins 10 s else)
            assert 0 <= timeout <= _stacks.FLUSH_TIME  # what is left of it when the pass is done
            ended = self.handle not in timer[0].in_progress()
            told.append(("flush", timer[0].interrupted(self.handle) or ended))

    failing, keep = Failing(), Keep()
    _stacks.add_reporter(failing)
    _stacks.add_reporter(keep)
    try:

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
            spin(10)
            return []

        middleware = TimeoutMiddleware(app, driven(), 0.3, interrupt=True)
        timer.append(middleware.timer)
        assert wsgi_get(middleware, "/spin") == "504 Gateway Timeout"
        give_up = time.monotonic() + 30
        while len(told) < 2 and time.monotonic() < give_up:  # the reporter thread flushes once the 504 may be out
            time.sleep(0.01)
    finally:
        _stacks._reporters[:] = [r for r in _stacks._reporters if r not in (failing, keep)]
    assert told == [("report", False), ("flush", True)]
    assert _stacks.FLUSH_TIME <= DUMP_TIME / 2  # answered before the driver takes the worker for a wedged one


def test_a_timer_whose_driver_never_asks_the_worker_says_no_tracker_hears_of_it(make_wheel, caplog, sentry) -> None:
    """No stacks and no stage: the driver logs a timeout and asks the
    worker nothing, so Sentry would never hear of one.  Said once, at the
    timer's first use in the process, or as the integration comes after."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    quiet = TimeoutSettings(0.3, actions=TimeoutActions(tracebacks=False))
    said = "its timeouts reach no error tracker (shmwheel.contrib.sentry): with no stacks and no stage"
    timer = RequestTimer.of(wheel.name, quiet)
    sentry(ShmwheelIntegration())  # a reporter added after the timer was made
    timer.prepare()  # its first use here
    timer.prepare()
    assert sum(said in r.getMessage() for r in caplog.records) == 1
    told = RequestTimer.of(wheel.name, TimeoutSettings(0.3))  # stacks: its driver asks
    told.prepare()
    assert sum(said in r.getMessage() for r in caplog.records) == 1


def test_a_request_whose_frames_are_gone_is_an_event_without_a_stacktrace() -> None:
    """Its thread ended between the timeout and the look: no empty
    stacktrace, grouped by its path with its ids masked."""
    record = RequestRecord(1, os.getpid(), 0, time.monotonic_ns(), "POST", "", "/upload/9", False)
    [exc] = sentry_event(TimedOut(record, "the log's text", (), None))["exception"]["values"]
    assert "stacktrace" not in exc and exc["value"] == "POST /upload/* ran past its timeout"
    assert sentry_event(TimedOut(record, "", (), None))["fingerprint"] == ["shmwheel-timeout", "POST", "/upload/*"]


@pytest.mark.parametrize(
    ("module", "sdk", "extra"),
    [
        ("sentry", "sentry_sdk", "sentry-sdk (pip install shmwheel[sentry])"),
        ("otel", "opentelemetry", "opentelemetry-sdk (pip install shmwheel[otel])"),
    ],
)
def test_an_integration_without_its_sdk_says_what_to_install(module: str, sdk: str, extra: str) -> None:
    code = f"import sys; sys.modules[{sdk!r}] = None; import shmwheel.contrib.{module}"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"ImportError: shmwheel.contrib.{module} needs {extra}: " in proc.stderr.splitlines()[-1]


def test_a_path_s_ids_are_masked_so_that_its_route_groups_as_one() -> None:
    assert masked_path("/items/12/parts/7f3a9c2e1b4d5f6a") == "/items/*/parts/*"
    assert masked_path("/users/123e4567-e89b-12d3-a456-426614174000/") == "/users/*/"
    assert masked_path("/v2/reports/2024-01-05") == "/v2/reports/*"
    assert masked_path("/api/v1/health") == "/api/v1/health"  # versions and words stay
    assert masked_path("/") == "/"


def test_an_application_installed_as_a_package_has_its_view_by_sentry_s_in_app_include() -> None:
    """Its frames are in site-packages, as the framework's are: Sentry's
    in_app_include says which are the application's."""
    site = _stacks._INSTALLED[0]
    frames = (
        Frame(site + "django/core/handlers/base.py", 197, "BaseHandler._get_response", "django.core.handlers.base", ""),
        Frame(site + "myshop/views.py", 12, "export", "myshop.views", ""),
        Frame(site + "myshop/reports.py", 40, "build", "myshop.reports", ""),
    )
    record = RequestRecord(1, os.getpid(), 0, time.monotonic_ns(), "GET", "", "/export/2024", False)
    sentry_sdk.init(dsn=None, in_app_include=["myshop"])
    try:
        assert sentry_event(TimedOut(record, "", frames, None))["fingerprint"][2] == "myshop.views.export"
        sentry_sdk.init(dsn=None)
        assert sentry_event(TimedOut(record, "", frames, None))["fingerprint"][2] == "/export/*"  # not told: the path
    finally:
        sentry_sdk.init(dsn=None)


def test_an_exit_of_the_application_s_own_after_a_timeout_is_still_sent(driven, sentry) -> None:
    """Only what ends a timed-out request is dropped: a later SystemExit in
    the same thread, in a request in time, is the application's."""
    events = sentry(FlaskIntegration(), ShmwheelIntegration())
    app = flask_app()

    @app.route("/exit")
    def leave() -> str:
        raise SystemExit(3)

    middleware = TimeoutMiddleware(app, driven(), 0.3, interrupt=True)
    assert wsgi_get(middleware, "/items/1") == "504 Gateway Timeout"
    with pytest.raises(SystemExit):
        wsgi_get(middleware, "/exit")
    sentry_sdk.flush()
    assert [e["exception"]["values"][-1]["type"] for e in events] == ["RequestTimeout", "SystemExit"]


def test_a_timer_s_first_use_speaks_for_itself_only(make_wheel, caplog, sentry) -> None:
    """Another timer's first use in the process says nothing of a quiet
    timer not used yet: a test's child process inherited one and logged it
    as its own (test_privileges)."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    said = "its timeouts reach no error tracker (shmwheel.contrib.sentry): with no stacks and no stage"
    sentry(ShmwheelIntegration())
    quiet = RequestTimer.of(wheel.name, TimeoutSettings(0.3, actions=TimeoutActions(tracebacks=False)))
    RequestTimer.of(wheel.name, TimeoutSettings(0.3)).prepare()
    assert not any(said in r.getMessage() for r in caplog.records)
    quiet.prepare()
    assert sum(said in r.getMessage() for r in caplog.records) == 1
