"""A Starlette app traced by OpenTelemetry's ASGI instrumentation, around
shmwheel's middleware (0.5 s, interrupt), its spans written one JSON a
line to ``$SPANS_FILE``: under Uvicorn, ``otel_asgi:app``.

    GET /        answers at once
    GET /stuck   await asyncio.sleep(30)
"""

from __future__ import annotations

import asyncio
import os

from opentelemetry.instrumentation.asgi import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from shmwheel.contrib import otel
from shmwheel.contrib.asgi import TimeoutMiddleware


def _one_line(span: ReadableSpan) -> str:
    return span.to_json(indent=None) + "\n"


provider = TracerProvider()
spans = open(os.environ["SPANS_FILE"], "a", buffering=1)  # noqa: SIM115 - the process's, to its end
provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=spans, formatter=_one_line)))
otel.instrument(provider)


async def root(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"done by pid {os.getpid()}\n")


async def stuck(request: Request) -> PlainTextResponse:
    await asyncio.sleep(30)
    return PlainTextResponse("never")


api = Starlette(routes=[Route("/", root), Route("/stuck", stuck)])
app = OpenTelemetryMiddleware(TimeoutMiddleware(api, 0.5, interrupt=True), tracer_provider=provider)
