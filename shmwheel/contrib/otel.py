"""A timed-out request, on its OpenTelemetry span.

    from shmwheel.contrib.otel import instrument
    instrument(tracer_provider)  # the SDK's TracerProvider; None: the global one

At a request's timeout its server span (the one the web framework's
instrumentation, or the application, started for it) gets an
``exception`` event with the request's own stack, ``error.type`` set to
``"timeout"`` and its status set to ERROR; when the request is
interrupted, ``http.response.status_code`` is 504, the status the
middleware answers with.  The span is exported when its owner ends it, as
any other.

The worker's reporter thread, which finds the timed-out request, runs
beside the request, where the current span is not the request's: so a
span processor keeps each request's server span (or local root span) by
where it started, its asyncio or trio task, its greenlet or its thread,
the way the request's timer keeps the request, and forgets it when it ends.

What the request's instrumentation writes after the timeout wins: one that
sees the 504 in the default semantic conventions leaves ``error.type``
alone, one in the stable HTTP conventions (``OTEL_SEMCONV_STABILITY_OPT_IN
=http``), or FastAPI's own, writes its own (``"504"``, or the interrupt's
exception type).  An instrumentation that ends its span only on an
``Exception`` (opentelemetry-instrumentation-wsgi) never ends it when
:class:`~shmwheel.contrib.RequestTimeout` passes through it: wrap it
around shmwheel's middleware, not inside it, and it sees the 504.

Only this module imports opentelemetry, which shmwheel does not depend on.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
import weakref
from typing import Any

try:
    from opentelemetry import context, trace
    from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
    from opentelemetry.trace import SpanKind, StatusCode
except ImportError as exc:  # pragma: no cover - said in one line, with the fix
    raise ImportError(f"shmwheel.contrib.otel needs opentelemetry-sdk (pip install shmwheel[otel]): {exc}") from None

from .._process import after_fork
from ._stacks import TimedOut, add_reporter, real, remove_reporter

__all__ = ["TimeoutSpanProcessor", "instrument"]

#: What the span event names as the exception: the one that ends an interrupted request.
EXCEPTION_TYPE = "shmwheel.contrib.RequestTimeout"

_lock = threading.Lock()
_instrumented: weakref.WeakKeyDictionary[TracerProvider, TimeoutSpanProcessor] = weakref.WeakKeyDictionary()


@after_fork
def _new_lock() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork


def instrument(tracer_provider: TracerProvider | None = None) -> TimeoutSpanProcessor:
    """Report this process's timed-out requests on their spans of
    ``tracer_provider`` (None: the global one, which must be the SDK's).
    Returns the processor (the same one for the same provider): the
    provider's ``shutdown()`` ends it."""
    provider = trace.get_tracer_provider() if tracer_provider is None else tracer_provider
    if not isinstance(provider, TracerProvider):
        raise TypeError(
            f"shmwheel.contrib.otel needs the OpenTelemetry SDK's TracerProvider, not {type(provider).__name__}: "
            "set one up first (opentelemetry.trace.set_tracer_provider), or pass it"
        )
    with _lock:
        processor = _instrumented.get(provider)
        if processor is not None and not processor.shut_down:
            return processor  # once: a second would put each timeout on the span twice
        processor = _instrumented[provider] = TimeoutSpanProcessor()
    provider.add_span_processor(processor)
    return processor


class TimeoutSpanProcessor(SpanProcessor):
    """Keeps each request's span by where it runs, for the worker's
    reporter thread to find at the request's timeout.  Told of timeouts
    from when it is made until its ``shutdown()``.

    It keeps the server spans and the local roots (no parent, or a remote
    one), as they start and until they end; every other span costs a
    look at its kind and its parent."""

    def __init__(self) -> None:
        self._open: dict[object, list[Span]] = {}  # where they run: the spans open there, outermost first
        self._where: dict[int, object] = {}  # span id: where it runs
        self._interrupted: set[int] = set()  # span ids of requests interrupted: their owner may never end them
        self._get_ident = real("_thread", "get_ident")  # the OS thread's, as the request's timer has it
        self.shut_down = False
        add_reporter(self)

    # -- as the SDK's span processor: in the thread that starts or ends a span

    def on_start(self, span: Span, parent_context: context.Context | None = None) -> None:
        parent = span.parent
        if span.kind is not SpanKind.SERVER and parent is not None and not parent.is_remote:
            return
        where = self._where_now()
        with _lock:
            spans = self._open.setdefault(where, [])
            if self._interrupted:  # ones left open by the requests interrupted here before: not theirs any more
                for gone in [s for s in spans if s.context.span_id in self._interrupted]:
                    spans.remove(gone)
                    self._forget(gone.context.span_id)
            spans.append(span)
            self._where[span.context.span_id] = where

    def on_end(self, span: ReadableSpan) -> None:
        span_id = span.context.span_id
        if span_id not in self._where:
            return
        with _lock:
            where = self._forget(span_id)
            spans = self._open.get(where)
            if spans is None:
                return
            spans[:] = [s for s in spans if s.context.span_id != span_id]
            if not spans:
                del self._open[where]

    def _forget(self, span_id: int) -> object:
        self._interrupted.discard(span_id)
        return self._where.pop(span_id, None)

    def shutdown(self) -> None:
        self.shut_down = True
        remove_reporter(self)
        with _lock:
            self._open.clear()
            self._where.clear()
            self._interrupted.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def _where_now(self) -> object:
        """Where the code running now runs, as the request's timer names it:
        its asyncio or trio task, its greenlet, else its OS thread."""
        loop = asyncio._get_running_loop()
        if loop is not None:
            task = asyncio.current_task(loop)
            if task is not None:
                return task
        trio = sys.modules.get("trio")
        if trio is not None:
            try:
                return trio.lowlevel.current_task()
            except RuntimeError:  # not in trio's run
                pass
        greenlet = sys.modules.get("greenlet")
        if greenlet is not None:
            current = greenlet.getcurrent()
            if current.parent is not None:  # not the thread's own: a greenlet that serves a request
                return current
        return self._get_ident()

    def open_spans(self) -> int:
        """How many spans it keeps now (the requests' in progress)."""
        return len(self._where)

    # -- as shmwheel's reporter: in the worker's reporter thread

    def report(self, timed_out: TimedOut) -> None:
        """Put the timeout on the request's span, if it has one that records."""
        where = timed_out.thread if timed_out.task is None else timed_out.task
        with _lock:
            span = next((s for s in self._open.get(where, ()) if s.context.span_id not in self._interrupted), None)
            interrupt = timed_out.request.interrupt
            if span is not None and interrupt:
                self._interrupted.add(span.context.span_id)
        if span is None or not span.is_recording():
            return
        record = timed_out.request
        message = f"{record.method} {record.path} ran past its timeout, after {record.running_for():.1f} s"
        if interrupt:
            message += ", and was interrupted"
        span.add_event(
            "exception",
            {
                "exception.type": EXCEPTION_TYPE,
                "exception.message": message,
                "exception.stacktrace": _stacktrace(timed_out, message),
            },
        )
        attributes: dict[str, Any] = {"error.type": "timeout"}
        if interrupt:
            attributes["http.response.status_code"] = 504
        span.set_attributes(attributes)
        span.set_status(StatusCode.ERROR, message)

    def flush(self, timeout: float) -> None:
        """Nothing to send: the span goes out when it ends, with its exporter."""


def _stacktrace(timed_out: TimedOut, message: str) -> str:
    """The request's own stack, as Python writes an exception's: where it was when it timed out."""
    if not timed_out.frames:
        return timed_out.stack
    summary = traceback.StackSummary.from_list(
        [(f.filename, f.lineno or 0, f.function, f.line) for f in timed_out.frames]
    )
    return "Traceback (most recent call last):\n" + "".join(summary.format()) + f"{EXCEPTION_TYPE}: {message}\n"
