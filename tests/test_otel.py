"""shmwheel.contrib.otel: a timed-out request on its OpenTelemetry span,
with the real SDK, its in-memory exporter and a real driver, in this
process (the middlewares answer 504 here, as in tests/test_stages.py)."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time
import wsgiref.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk.trace")

from _servers import (  # noqa: E402
    APPS,
    BIN,
    GATEWAY_TIMEOUT,
    WAIT,
    assert_nothing_left_of_asgi,
    auto_driver_of,
    free_port,
    get,
    serve_asgi,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind, StatusCode  # noqa: E402

from shmwheel.contrib._record import PAYLOAD_SIZE  # noqa: E402
from shmwheel.contrib._stacks import reporters  # noqa: E402
from shmwheel.contrib.asgi import TimeoutMiddleware as AsgiMiddleware  # noqa: E402
from shmwheel.contrib.otel import TimeoutSpanProcessor, instrument  # noqa: E402
from shmwheel.contrib.wsgi import TimeoutMiddleware  # noqa: E402


class Traced:
    """A TracerProvider of its own (never the global one), its spans kept here."""

    def __init__(self) -> None:
        self.provider = TracerProvider()
        self.processor = instrument(self.provider)
        self.exporter = InMemorySpanExporter()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("tests")

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def server_span(self) -> ReadableSpan:
        [span] = [s for s in self.spans() if s.kind is SpanKind.SERVER]
        return span


@pytest.fixture
def traced() -> Iterator[Traced]:
    t = Traced()
    yield t
    t.provider.shutdown()
    assert t.processor not in reporters()


@pytest.fixture
def driven(make_wheel, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """A wheel driven by the driver command, with these arguments (no --kill: this process is the worker)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> str:
        wheel = make_wheel(payload_size=PAYLOAD_SIZE)
        cmd = [sys.executable, "-m", "shmwheel.contrib.timeouts", wheel.name, "--log-to", str(tmp_path / "log"), *args]
        procs.append(subprocess.Popen(cmd))
        give_up = time.monotonic() + WAIT
        while wheel.stats().driver_pid != procs[-1].pid:
            assert time.monotonic() < give_up and procs[-1].poll() is None
            time.sleep(0.02)
        return wheel.name

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(WAIT)


def spin(seconds: float) -> None:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        pass


def call(app: Callable[..., Any], path: str) -> str:
    status: list[str] = []

    def start_response(s: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        status.append(s)

    environ: dict[str, Any] = {"REQUEST_METHOD": "GET", "PATH_INFO": path}
    wsgiref.util.setup_testing_defaults(environ)
    body = app(environ, start_response)
    try:
        b"".join(body)
    finally:
        getattr(body, "close", lambda: None)()
    return status[-1]


def assert_timed_out(span: ReadableSpan, where: str, *, interrupted: bool = True) -> None:
    """The span has the timeout: its event, with the request's own stack (``where`` it was), and its attributes."""
    [event] = [e for e in span.events if e.name == "exception"]
    assert event.attributes is not None and span.attributes is not None
    assert event.attributes["exception.type"] == "shmwheel.contrib.RequestTimeout"
    assert "ran past its timeout" in str(event.attributes["exception.message"])
    stack = str(event.attributes["exception.stacktrace"])
    assert stack.startswith("Traceback (most recent call last):\n")
    assert re.search(rf", in (\S+\.)?{where}\n", stack)  # where it was when it timed out (its qualified name)
    assert span.attributes["error.type"] == "timeout"
    assert span.status.status_code is StatusCode.ERROR
    if interrupted:
        assert span.attributes["http.response.status_code"] == 504
    else:
        assert "http.response.status_code" not in span.attributes


def assert_untouched(span: ReadableSpan) -> None:
    assert span.attributes is not None
    assert not span.events
    assert "error.type" not in span.attributes
    assert span.status.status_code is not StatusCode.ERROR


# -- WSGI ------------------------------------------------------------------------


def test_a_wsgi_request_s_own_server_span_gets_the_timeout_and_the_504(driven, traced: Traced) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with traced.tracer.start_as_current_span("GET", kind=SpanKind.SERVER):
            with traced.tracer.start_as_current_span("query"):  # a child: not the request's span
                spin(10)
        start_response("200 OK", [])
        return [b"ok"]

    assert call(TimeoutMiddleware(app, driven(), 0.3, interrupt=True), "/spin") == "504 Gateway Timeout"
    assert_timed_out(traced.server_span(), "spin")
    [child] = [s for s in traced.spans() if s.name == "query"]
    assert_untouched(child)
    assert traced.processor.open_spans() == 0


def test_the_otel_wsgi_middleware_around_shmwheel_s_gets_the_timeout(driven, traced: Traced) -> None:
    """The instrumentation outside: it sees the 504 and ends its span, which has the timeout."""
    from opentelemetry.instrumentation.wsgi import OpenTelemetryMiddleware

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ["PATH_INFO"] == "/spin":
            spin(10)
        start_response("200 OK", [])
        return [b"ok"]

    timed = TimeoutMiddleware(app, driven(), 0.3, interrupt=True)
    traced_app = OpenTelemetryMiddleware(timed, tracer_provider=traced.provider)
    assert call(traced_app, "/spin") == "504 Gateway Timeout"
    assert_timed_out(traced.server_span(), "spin")
    traced.exporter.clear()

    for _ in range(200):  # in time: nothing added, and nothing kept
        assert call(traced_app, "/") == "200 OK"
    assert len(traced.spans()) == 200
    for span in traced.spans():
        assert_untouched(span)
    assert traced.processor.open_spans() == 0


def test_the_otel_wsgi_middleware_inside_shmwheel_s_never_ends_an_interrupted_span(driven, traced: Traced) -> None:
    """opentelemetry-instrumentation-wsgi ends its span on an Exception
    only: RequestTimeout, a BaseException, leaves it open and unexported
    (what the docs say: wrap it around shmwheel's middleware).  The
    processor lets go of it at the next server span that starts in that
    thread.  In a thread of its own: the instrumentation leaves a context
    attached there."""
    from opentelemetry import context
    from opentelemetry.instrumentation.wsgi import OpenTelemetryMiddleware

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ["PATH_INFO"] == "/spin":
            spin(10)
        start_response("200 OK", [])
        return [b"ok"]

    timed = TimeoutMiddleware(
        OpenTelemetryMiddleware(app, tracer_provider=traced.provider), driven(), 0.3, interrupt=True
    )
    seen: list[object] = []

    def requests() -> None:
        seen.append(call(timed, "/spin"))
        seen.append(traced.processor.open_spans())
        seen.append(call(timed, "/"))
        with traced.tracer.start_as_current_span("GET", context.Context(), kind=SpanKind.SERVER):
            seen.append(traced.processor.open_spans())

    thread = threading.Thread(target=requests)
    thread.start()
    thread.join(WAIT)
    assert seen == ["504 Gateway Timeout", 1, "200 OK", 1]  # the interrupted one's span, then only the last one
    [after, mine] = traced.spans()  # never the interrupted request's
    assert after.kind is SpanKind.SERVER and after.parent is None  # a request of its own
    assert_untouched(after)
    assert mine.name == "GET"
    assert traced.processor.open_spans() == 0


def test_a_timeout_without_interrupt_gets_the_event_and_the_error_type_but_no_504(driven, traced: Traced) -> None:
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with traced.tracer.start_as_current_span("GET", kind=SpanKind.SERVER):
            spin(1.0)  # past its timeout, and the worker is not ended: it answers
        start_response("200 OK", [])
        return [b"ok"]

    assert call(TimeoutMiddleware(app, driven(), 0.3), "/spin") == "200 OK"
    assert_timed_out(traced.server_span(), "spin", interrupted=False)


def test_the_spans_of_other_threads_are_never_touched(driven, traced: Traced) -> None:
    """A request in time in another thread, whose span is open throughout
    the other's timeout, and a span of a thread that is no request's."""
    started, done = threading.Event(), threading.Event()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with traced.tracer.start_as_current_span(environ["PATH_INFO"], kind=SpanKind.SERVER):
            if environ["PATH_INFO"] == "/spin":
                started.set()
                spin(10)
            else:
                started.wait(WAIT)
                done.wait(WAIT)
        start_response("200 OK", [])
        return [b"ok"]

    name = driven()
    timed = TimeoutMiddleware(app, name, 0.3, interrupt=True)
    in_time: list[str] = []
    other = threading.Thread(target=lambda: in_time.append(call(TimeoutMiddleware(app, name, 5.0), "/fine")))
    other.start()

    def bystander() -> None:
        with traced.tracer.start_as_current_span("job"):  # a local root in a thread of no request
            done.wait(WAIT)

    job = threading.Thread(target=bystander)
    job.start()
    assert call(timed, "/spin") == "504 Gateway Timeout"
    done.set()
    other.join(WAIT)
    job.join(WAIT)
    assert in_time == ["200 OK"]
    spans = {s.name: s for s in traced.spans()}
    assert_timed_out(spans["/spin"], "spin")
    assert_untouched(spans["/fine"])
    assert_untouched(spans["job"])
    assert traced.processor.open_spans() == 0


def test_a_request_in_a_greenlet_is_found_by_its_greenlet(driven, traced: Traced) -> None:
    """As under gevent: the request's greenlet, not its thread, whose own
    span (open in the thread's main greenlet meanwhile) is not touched.
    Not interrupted: outside gevent's hub nothing can throw into it."""
    greenlet = pytest.importorskip("greenlet")

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with traced.tracer.start_as_current_span("request", kind=SpanKind.SERVER):
            spin(1.0)
        start_response("200 OK", [])
        return [b"ok"]

    timed = TimeoutMiddleware(app, driven(), 0.3)
    status: list[str] = []
    with traced.tracer.start_as_current_span("thread", kind=SpanKind.SERVER):
        greenlet.greenlet(lambda: status.append(call(timed, "/spin"))).switch()
    assert status == ["200 OK"]
    spans = {s.name: s for s in traced.spans()}
    assert_timed_out(spans["request"], "spin", interrupted=False)
    assert_untouched(spans["thread"])
    assert traced.processor.open_spans() == 0


# -- ASGI ------------------------------------------------------------------------


def scope(path: str) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
        "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
        "headers": [(b"host", b"testserver")], "server": ("testserver", 80), "client": ("127.0.0.1", 1234),
    }  # fmt: skip


async def one(app: Any, path: str) -> int:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    await app(scope(path), receive, send)
    return int(next(m["status"] for m in sent if m["type"] == "http.response.start"))


def starlette_app() -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def waits(request: Request) -> PlainTextResponse:
        await asyncio.sleep(10)
        return PlainTextResponse("ok")

    async def blocks(request: Request) -> PlainTextResponse:
        spin(10)
        return PlainTextResponse("ok")

    async def fine(request: Request) -> PlainTextResponse:
        await asyncio.sleep(0.6)  # open throughout the others' timeouts
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/await", waits), Route("/block", blocks), Route("/fine", fine)])


@pytest.mark.parametrize("otel_outside", [False, True], ids=["otel-inside", "otel-outside"])
def test_the_otel_asgi_middleware_s_span_gets_the_timeout(driven, traced: Traced, otel_outside: bool) -> None:
    """Starlette with opentelemetry-instrumentation-asgi, inside or around
    shmwheel's middleware: a task awaiting (cancelled) and one that blocks
    the loop (RequestTimeout); a task in time beside them is not touched."""
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    name = driven("--interrupt-grace", "2")

    def timed(timeout: float) -> Any:
        if otel_outside:
            return OpenTelemetryMiddleware(
                AsgiMiddleware(starlette_app(), timeout, name=name, interrupt=True), tracer_provider=traced.provider
            )
        inner = OpenTelemetryMiddleware(starlette_app(), tracer_provider=traced.provider)
        return AsgiMiddleware(inner, timeout, name=name, interrupt=True)

    app = timed(0.3)

    async def main() -> list[int]:
        return list(await asyncio.gather(one(app, "/await"), one(timed(5.0), "/fine")))

    assert asyncio.run(main()) == [504, 200]
    servers = {
        str(s.attributes and s.attributes.get("http.target")): s for s in traced.spans() if s.kind is SpanKind.SERVER
    }
    assert_timed_out(servers["/await"], "waits")
    assert_untouched(servers["/fine"])
    traced.exporter.clear()
    assert asyncio.run(one(app, "/block")) == 504
    assert_timed_out(traced.server_span(), "blocks")
    assert traced.processor.open_spans() == 0


def test_a_request_in_a_trio_task_is_found_by_its_task(driven, traced: Traced) -> None:
    """As under Hypercorn's trio worker; a task in time beside it is not touched."""
    trio = pytest.importorskip("trio")
    from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await trio.sleep(10 if scope["path"] == "/await" else 0.6)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    name = driven("--interrupt-grace", "2")
    statuses: dict[str, int] = {}

    async def main() -> None:
        async def request(path: str, timeout: float) -> None:
            timed = AsgiMiddleware(
                OpenTelemetryMiddleware(app, tracer_provider=traced.provider), timeout, name=name, interrupt=True
            )
            statuses[path] = await one(timed, path)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, "/await", 0.3)
            nursery.start_soon(request, "/fine", 5.0)

    trio.run(main)
    assert statuses == {"/await": 504, "/fine": 200}
    servers = {s.attributes["http.target"]: s for s in traced.spans() if s.kind is SpanKind.SERVER and s.attributes}
    assert_timed_out(servers["/await"], "app")
    assert_untouched(servers["/fine"])
    assert traced.processor.open_spans() == 0


def test_fastapi_s_own_telemetry_gets_the_event_and_the_504_and_writes_its_own_error_type(
    driven, traced: Traced
) -> None:
    """FastAPI's span, inside shmwheel's middleware: it sees the interrupt's
    exception and writes its type as error.type over "timeout" (the docs
    say so); the rest is there."""
    fastapi = pytest.importorskip("fastapi")
    pytest.importorskip("fastapi.telemetry")  # FastAPI's own spans: 0.165 and later
    app = fastapi.FastAPI(telemetry={"tracer_provider": traced.provider, "metrics": False, "logs": False})

    @app.get("/await")
    async def waits() -> str:
        await asyncio.sleep(10)
        return "ok"

    timed = AsgiMiddleware(app, 0.3, name=driven("--interrupt-grace", "2"), interrupt=True)
    assert asyncio.run(one(timed, "/await")) == 504
    span = traced.server_span()
    assert span.attributes is not None
    assert span.attributes["error.type"] == "asyncio.exceptions.CancelledError"  # FastAPI's, after ours
    [event] = [e for e in span.events if e.name == "exception"]
    assert event.attributes is not None and ".waits\n" in str(event.attributes["exception.stacktrace"])
    assert span.attributes["http.response.status_code"] == 504
    assert span.status.status_code is StatusCode.ERROR
    assert traced.processor.open_spans() == 0


# -- the processor itself --------------------------------------------------------


def test_instrument_needs_the_sdk_s_provider_once_and_shutdown_ends_the_reports() -> None:
    from opentelemetry.trace import NoOpTracerProvider

    with pytest.raises(TypeError, match="needs the OpenTelemetry SDK's TracerProvider, not NoOpTracerProvider"):
        instrument(NoOpTracerProvider())  # type: ignore[arg-type]
    processor = TimeoutSpanProcessor()
    assert processor in reporters()
    processor.shutdown()
    assert processor not in reporters()
    provider = TracerProvider()
    processor = instrument(provider)
    assert instrument(provider) is processor  # once: else each timeout twice on its span
    provider.shutdown()
    assert processor not in reporters()
    assert instrument(provider) is not processor
    provider.shutdown()


# -- under a real server ------------------------------------------------------------


def test_under_uvicorn_the_exported_server_span_says_timeout_and_504(tmp_path: Path, monkeypatch) -> None:
    """Uvicorn, OpenTelemetry's ASGI instrumentation around shmwheel's
    middleware, the SDK exporting each span as it ends: the interrupted
    request's server span has the timeout's event with its own stack,
    error.type "timeout", the 504 and status ERROR; the request in time
    before it has none of them."""
    spans_file = tmp_path / "spans.jsonl"
    monkeypatch.setenv("SPANS_FILE", str(spans_file))
    port = free_port()
    cmd = [str(BIN / "uvicorn"), "otel_asgi:app", "--app-dir", str(APPS), "--host", "127.0.0.1", "--port", str(port)]
    with serve_asgi(cmd, port, tmp_path) as server:
        driver = auto_driver_of(server)
        assert get(server.port, "/stuck", timeout=60) == GATEWAY_TIMEOUT
        give_up = time.monotonic() + WAIT
        while True:
            text = spans_file.read_text() if spans_file.exists() else ""
            whole = text[: text.rfind("\n") + 1]  # the exporter may be half-way through a line
            server_spans = [s for s in map(json.loads, whole.splitlines()) if s["kind"] == "SpanKind.SERVER"]
            if any(s["attributes"].get("http.target") == "/stuck" for s in server_spans):
                break
            assert time.monotonic() < give_up, server_spans
            time.sleep(0.05)
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left_of_asgi(server, driver)
    [quick] = [s for s in server_spans if s["attributes"].get("http.target") == "/"][-1:]
    [late] = [s for s in server_spans if s["attributes"].get("http.target") == "/stuck"]
    assert (
        quick["events"] == [] and "error.type" not in quick["attributes"] and quick["status"]["status_code"] == "UNSET"
    )
    [event] = late["events"]
    assert event["name"] == "exception"
    assert event["attributes"]["exception.type"] == "shmwheel.contrib.RequestTimeout"
    assert 'otel_asgi.py", line ' in event["attributes"]["exception.stacktrace"]
    assert ", in stuck\n" in event["attributes"]["exception.stacktrace"]  # where it was when its time ran out
    assert late["attributes"]["error.type"] == "timeout"
    assert late["attributes"]["http.status_code"] == 504  # the instrumentation's own, seeing the 504
    assert late["status"]["status_code"] == "ERROR"
