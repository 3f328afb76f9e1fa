"""A view's own timeout (shmwheel.contrib.request_timeout): as a decorator
on sync and async function views and on class-based views of Django,
Flask and Starlette, through Django's method_decorator, and as a FastAPI
dependency; counted from the request's start; said once where nothing
times the server's requests.  Then real apps of each framework under a
real server: Django under Gunicorn gthread and under Uvicorn, Flask
under uWSGI, FastAPI under Uvicorn, each interrupting its timed-out requests, which the
server's log reports as timeouts answered 504 and the framework not at
all."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _servers import (
    APPS,
    BIN,
    WAIT,
    assert_nothing_left,
    assert_nothing_left_of_asgi,
    auto_driver_of,
    free_port,
    get,
    gunicorn_app,
    serve,
    serve_asgi,
    timed_out_line,
    uwsgi_ini,
)

from shmwheel.contrib import RequestTimer, request_timeout
from shmwheel.contrib import _views as views
from shmwheel.contrib._record import PAYLOAD_SIZE

S = 1_000_000_000


def test_request_timeout_refuses_what_is_no_timeout_and_what_is_no_view() -> None:
    with pytest.raises(ValueError, match="seconds must be a positive number"):
        request_timeout(0)
    with pytest.raises(TypeError, match="seconds"):
        request_timeout("5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="decorates a view, a function or a class, not int"):
        request_timeout(5)(3)  # type: ignore[call-overload]

    class NoDispatch:
        pass

    with pytest.raises(TypeError, match="NoDispatch, which has no dispatch"):
        request_timeout(5)(NoDispatch)


def test_as_a_dependency_it_takes_no_parameter() -> None:
    """FastAPI fills a dependency's parameters from its signature: none."""
    assert inspect.signature(request_timeout(5)) == inspect.Signature()
    assert repr(request_timeout(None)) == "request_timeout(None)"


@pytest.fixture
def timer(make_wheel) -> RequestTimer:  # type: ignore[no-untyped-def]
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    return RequestTimer(wheel.name, 30.0, traceback_signal=None)


def _deadline_from_start(timer: RequestTimer, call: Callable[[], Any]) -> float | None:
    """The seconds from its start the request in progress here has once
    ``call`` has run in it (None: no timeout); the request finished after."""
    handle = timer.start("GET", "/view")
    started = timer.in_progress()[handle].deadline_ns - 30 * S
    try:
        time.sleep(0.05)  # the view begins after the request did: its time counts from the start
        call()
        active = timer.in_progress().get(handle)
        return None if active is None else (active.deadline_ns - started) / S
    finally:
        timer.finish(handle)


def test_a_decorated_function_view_gives_its_request_the_seconds_from_its_start(timer: RequestTimer) -> None:
    @request_timeout(2)
    def view(request: object) -> str:
        return f"answered {request}"

    assert view.__name__ == "view"  # functools.wraps: frameworks read the view's name and signature
    assert _deadline_from_start(timer, lambda: view("r")) == pytest.approx(2.0, abs=0.005)
    assert _deadline_from_start(timer, request_timeout(None)) is None  # a dependency: no timeout at all
    assert _deadline_from_start(timer, request_timeout(0.01)) == pytest.approx(0.05, abs=0.05)  # due at once


def test_a_decorated_async_view_stays_a_coroutine_function_and_gives_its_task_the_seconds(make_wheel) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(wheel.name, 30.0, traceback_signal=None)

    @request_timeout(7)
    async def view() -> float:
        await asyncio.sleep(0)
        task = asyncio.current_task()
        (active,) = [a for a in timer.in_progress().values() if a.task is task]
        return active.deadline_ns

    async def request() -> float:
        handle = timer.start("GET", "/async", None, asyncio.current_task())
        try:
            started = timer.in_progress()[handle].deadline_ns - 30 * S
            return (await view() - started) / S
        finally:
            timer.finish(handle)

    assert inspect.iscoroutinefunction(view)
    assert asyncio.run(request()) == pytest.approx(7.0, abs=0.005)


def test_class_based_views_of_each_framework_take_it_directly_and_through_method_decorator(
    timer: RequestTimer,
) -> None:
    from django.conf import settings

    if not settings.configured:
        settings.configure()
    from django.http import HttpResponse
    from django.test import RequestFactory
    from django.utils.decorators import method_decorator
    from django.views import View as DjangoView
    from flask import Flask
    from flask.views import MethodView
    from starlette.endpoints import HTTPEndpoint

    @request_timeout(3)
    class Direct(DjangoView):
        def get(self, request: object) -> HttpResponse:
            return HttpResponse("direct")

    @method_decorator(request_timeout(4), name="dispatch")
    class Decorated(DjangoView):
        def get(self, request: object) -> HttpResponse:
            return HttpResponse("decorated")

    @request_timeout(5)
    class FlaskView(MethodView):
        def get(self) -> str:
            return "flask"

    @request_timeout(6)
    class Endpoint(HTTPEndpoint):
        pass

    assert inspect.iscoroutinefunction(Endpoint.dispatch) and Endpoint.dispatch is not HTTPEndpoint.dispatch
    request = RequestFactory().get("/")
    app = Flask(__name__)

    def flask_view() -> None:
        with app.test_request_context("/"):
            assert FlaskView.as_view("v")() == "flask"

    @request_timeout(8)
    class Child(Direct):  # its own timeout, over its base class's 3 s, whose dispatch its own calls
        pass

    @method_decorator(request_timeout(9), name="dispatch")
    class Grandchild(Child):
        pass

    seen = [
        _deadline_from_start(timer, lambda: Direct.as_view()(request)),
        _deadline_from_start(timer, lambda: Decorated.as_view()(request)),
        _deadline_from_start(timer, flask_view),
        _deadline_from_start(timer, lambda: Child.as_view()(request)),
        _deadline_from_start(timer, lambda: Grandchild.as_view()(request)),
    ]
    assert seen == [pytest.approx(s, abs=0.005) for s in (3, 4, 5, 8, 9)]


def test_a_view_no_adapter_times_runs_unchanged_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(views, "_said_untimed", False)
    monkeypatch.setattr(views, "times_requests", lambda: False)  # no RequestTimer, no adapter in this process

    @request_timeout(5)
    def view() -> str:
        return "answered"

    results = [view() for _ in range(3)]
    thread = threading.Thread(target=view)
    thread.start()
    thread.join()
    said = [r.getMessage() for r in caplog.records if "no shmwheel adapter times" in r.getMessage()]
    assert results == ["answered"] * 3
    assert said == [
        "shmwheel: a view has request_timeout(5), but no shmwheel adapter times this server's requests: it runs "
        "without a timeout; install the server's adapter (install() in Gunicorn's config, request_timeouts() under "
        "uWSGI, a TimeoutMiddleware)"
    ]


# -- the frameworks' apps under real servers -------------------------------------------------------
#
# Each app has /short (0.5 s of its own), /long (60 s) and /none (no
# timeout) under a server timeout of 4 s, with interrupt.  /short sleeping
# 3 s is timed out and answered 504, which only its own 0.5 s can do;
# /long and /none sleeping 5 s are not, which the server's 4 s would.
#
# A timeout is reported as a timeout: one WARNING line in the server's log
# with its 504, and nothing from the framework, which never sees the
# RequestTimeout as an error of the view's (Django's "Internal Server
# Error", Flask's "Exception on /short", Uvicorn's "Exception in ASGI
# application": each logs at ERROR with a traceback what reaches it).

ANSWERED_504 = r"(?:\[WARNING\]|WARNING:).* shmwheel: GET /short \(.*\) timed out: answered 504 Gateway Timeout, after "
NO_ERROR = re.compile(r"\bERROR\b|Traceback|Internal Server Error|Exception on |Exception in |Error handling")


def _own_timeouts_hold(server: Any) -> None:
    answers: dict[str, tuple[int, str]] = {}

    def ask(path: str, seconds: float) -> None:
        answers[path] = get(server.port, f"{path}?s={seconds}", timeout=60)

    asks = [threading.Thread(target=ask, args=a) for a in (("/short", 3), ("/long", 5), ("/none", 5))]
    for t in asks:
        t.start()
    server.wait_for(timed_out_line("/short"))
    for t in asks:
        t.join()
    assert {path: status for path, (status, _) in answers.items()} == {"/short": 504, "/long": 200, "/none": 200}
    time.sleep(0.5)  # a fire the driver had yet to log
    log = server.log()
    assert not re.search(timed_out_line("/long"), log) and not re.search(timed_out_line("/none"), log), log
    assert len(re.findall(timed_out_line("/short"), log)) == 1
    assert len(re.findall(ANSWERED_504, log)) == 1, log
    assert not NO_ERROR.search(log), log


def test_django_views_under_gunicorn_gthread_keep_their_own_timeouts(tmp_path: Path) -> None:
    port = free_port()
    install, app = "timeout=4.0, interrupt=True", "views_django:application"
    cmd = gunicorn_app(tmp_path, port, "gthread", "--threads", "4", install=install, app=app)
    with serve(cmd, port, tmp_path, "gunicorn") as server:
        server.wait_for(r"driver pid \d+")
        _own_timeouts_hold(server)
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


def test_flask_views_under_uwsgi_keep_their_own_timeouts(tmp_path: Path) -> None:
    port = free_port()
    options = {"module": "views_flask_uwsgi:application", "shmwheel-timeout": "4", "shmwheel-kill": "false"}
    options["shmwheel-interrupt"] = "true"
    ini = uwsgi_ini(tmp_path, port, **options, pythonpath=str(APPS), threads="4")
    with serve([str(BIN / "uwsgi"), "--ini", str(ini)], port, tmp_path, "uwsgi") as server:
        server.wait_for(r"driver \d+: running on wheel 'uwsgi-\d+'")
        _own_timeouts_hold(server)
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left(server)


def test_fastapi_endpoints_under_uvicorn_keep_their_own_timeouts(tmp_path: Path) -> None:
    port = free_port()
    cmd = [str(BIN / "uvicorn"), "views_fastapi:app", "--app-dir", str(APPS), "--host", "127.0.0.1"]
    with serve_asgi([*cmd, "--port", str(port)], port, tmp_path) as server:
        driver = auto_driver_of(server)
        _own_timeouts_hold(server)
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left_of_asgi(server, driver)


def test_django_under_uvicorn_answers_at_the_timeout_and_ends_its_views_the_django_way(tmp_path: Path) -> None:
    """Django under an ASGI server runs each view in a task of its own and
    waits, before its handler returns, for the thread of a sync view.  The
    504 goes out at the timeout all the same, whatever the view is doing:
    a sync view blocked in C (its thread runs on until the call returns,
    then ends at its next safe point), an async view that awaits (told the
    client is gone, Django cancels it), an async view that blocks the loop
    (raised in, in Django's task).  Nothing is logged as an error: no
    orphaned task's "Task exception was never retrieved"."""
    port = free_port()
    cmd = [str(BIN / "uvicorn"), "views_django_asgi:application", "--app-dir", str(APPS), "--host", "127.0.0.1"]
    fifo, flag = tmp_path / "fifo", tmp_path / "flag"
    os.mkfifo(fifo)
    with serve_asgi([*cmd, "--port", str(port)], port, tmp_path) as server:
        driver = auto_driver_of(server)
        _own_timeouts_hold(server)
        try:
            # Each answer comes while its view is still where the test holds it.
            assert get(port, f"/fifo?at={fifo}", WAIT)[0] == 504
            assert get(port, f"/spin?at={flag}", WAIT)[0] == 504
        finally:
            flag.touch()
            with contextlib.suppress(OSError):  # ENXIO: no view is reading it
                writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the view's thread returns from open(2)
                os.close(writer)
        assert get(port, "/await", WAIT)[0] == 504
        server.wait_for(r"views_django: /await was cancelled")
        for path in ("/fifo", "/spin", "/await"):
            server.wait_for(rf"GET {path} \(request .*\) ended [\d.]+ s after it was interrupted")
        log = server.log()
        for path in ("/fifo", "/spin", "/await"):
            assert len(re.findall(ANSWERED_504.replace("/short", path), log)) == 1, log
        assert not NO_ERROR.search(log) and "never retrieved" not in log, log
        # Each stack goes on into the task Django runs the view in, down to the view.
        for path, view in (("/fifo", "fifo"), ("/spin", "spin"), ("/await", "awaits")):
            stack = re.search(rf"the stack of timed-out request GET {path} .*?(?=\n\S|\Z)", log, re.S)
            assert stack and re.search(rf'views_django\.py", line \d+, in {view}\n', stack[0]), log
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left_of_asgi(server, driver)
