"""Timeouts in Sentry: one event per timed-out request, with the stack it
had when its time ran out, grouped by its view.

::

    import sentry_sdk
    from shmwheel.contrib.sentry import ShmwheelIntegration

    sentry_sdk.init(dsn=..., integrations=[ShmwheelIntegration()])

in each worker, as you initialise Sentry anyway.  At each request's
timeout the worker's reporter thread sends an event whose exception is a
``RequestTimeout`` (unhandled, mechanism ``shmwheel``) with the request's
own frames: where it was when its time ran out, not where an interrupt
later unwinds it.  Its fingerprint is the method and the view (the
function of the application's own code that the framework called; the
path where none is found), so each slow view is one issue, whatever the
ids in its paths; its transaction is the view.  The event is queued
before the interrupt and flushed after it, before the driver is told
(for at most a quarter of a second: a slow endpoint must not make the
worker look wedged to the driver): with no interrupt the driver's kill
comes only after that, so the event is out before the worker is, unless
Sentry takes longer than that to take it.

Sentry's WSGI integration (Django's and Flask's use it) would also send
what ends a timed-out request, as an unhandled error of the view mixed
with its real errors: the ``RequestTimeout`` of an interrupt, or the
``SystemExit`` of a worker the kill stage ends.  This integration drops
those, since its own event has said it.

``level`` is the events' level: ``"warning"``, as the server's log has
it, since a timeout is not a crash of the view; ``"error"`` if your
alerts count only errors.
"""

from __future__ import annotations

import linecache
import threading
from typing import Any, Literal, get_args

try:
    import sentry_sdk
    from sentry_sdk.integrations import Integration
    from sentry_sdk.scope import add_global_event_processor
    from sentry_sdk.types import Event, Hint
    from sentry_sdk.utils import filename_for_module
except ImportError as exc:  # pragma: no cover - said in one line, with the fix
    raise ImportError(f"shmwheel.contrib.sentry needs sentry-sdk (pip install shmwheel[sentry]): {exc}") from None

from ._interrupt import RequestTimeout
from ._stacks import Frame, TimedOut, add_reporter
from ._worker import say_unheard

__all__ = ["ShmwheelIntegration"]

#: Lines of source around each frame's, as Sentry's own frames have.
CONTEXT_LINES = 5
Level = Literal["debug", "info", "warning", "error", "fatal"]
LEVELS: tuple[Level, ...] = get_args(Level)
MAX_THREADS = 1024


class ShmwheelIntegration(Integration):
    """Each timed-out request of this process, as one Sentry event."""

    identifier = "shmwheel"

    def __init__(self, level: Level = "warning") -> None:
        if level not in LEVELS:
            raise ValueError(f"level must be one of {', '.join(LEVELS)}, not {level!r}")
        self.level = level

    @staticmethod
    def setup_once() -> None:
        add_reporter(_REPORTER)
        add_global_event_processor(_not_twice)
        say_unheard()


def _integration() -> ShmwheelIntegration | None:
    return sentry_sdk.get_client().get_integration(ShmwheelIntegration)


class _Reporter:
    """The worker's reporter: events queued at the timeout, flushed after the interrupt."""

    def __init__(self) -> None:
        self._queued = False
        #: The threads whose requests have timed out (a worker's are few, and it is killed or serves on).
        self.threads: set[int] = set()

    def report(self, timed_out: TimedOut) -> None:
        integration = _integration()
        if integration is None:  # Sentry is off in this process, or initialised without us
            return
        sentry_sdk.capture_event(event(timed_out, integration.level))
        self._queued = True
        if len(self.threads) >= MAX_THREADS:
            self.threads.clear()
        self.threads.add(timed_out.request.thread)

    def flush(self, timeout: float) -> None:
        if self._queued:
            self._queued = False
            sentry_sdk.flush(timeout)

    def __repr__(self) -> str:
        return "shmwheel.contrib.sentry"


_REPORTER = _Reporter()


def event(timed_out: TimedOut, level: Level = "warning") -> Event:
    """The Sentry event of a timed-out request."""
    request, route = timed_out.request, timed_out.route
    return {
        "level": level,
        "logger": "shmwheel",
        "transaction": route,
        "fingerprint": ["shmwheel-timeout", request.method, route],
        "exception": {
            "values": [
                {
                    "type": RequestTimeout.__name__,
                    "module": "shmwheel.contrib",
                    "value": f"{request.method} {route} ran past its timeout",
                    "mechanism": {"type": "shmwheel", "handled": False},
                    **({"stacktrace": {"frames": [_frame(f) for f in timed_out.frames]}} if timed_out.frames else {}),
                }
            ]
        },
        "request": {"method": request.method, "url": request.path},
        "tags": {"request_id": request.request_id} if request.request_id else {},
        "contexts": {
            "request timeout": {
                **request.as_dict(),
                "running_for": round(request.running_for(), 3),
                "view": timed_out.view,
            }
        },
        "extra": {"stack": timed_out.stack},
    }


def _frame(frame: Frame) -> dict[str, Any]:
    out: dict[str, Any] = {
        "filename": filename_for_module(frame.module, frame.filename),
        "abs_path": frame.filename,
        "function": frame.function,
        "module": frame.module,
        "lineno": frame.lineno,
    }
    if frame.module and frame.module.split(".")[0] == "shmwheel":
        out["in_app"] = False  # ours, wherever it is installed; the rest as Sentry's own rules say
    if frame.lineno:
        lines = linecache.getlines(frame.filename)
        at = frame.lineno - 1
        if 0 <= at < len(lines):
            out["pre_context"] = [line.rstrip("\n") for line in lines[max(0, at - CONTEXT_LINES) : at]]
            out["context_line"] = lines[at].rstrip("\n")
            out["post_context"] = [line.rstrip("\n") for line in lines[at + 1 : at + 1 + CONTEXT_LINES]]
    return out


def _not_twice(event: Event, hint: Hint | None) -> Event | None:
    """What ends a request past its timeout, which another integration
    caught on its way out of the request: dropped, since this
    integration's own event, sent before, has said it.  That is the
    interrupt's RequestTimeout, or the SystemExit of a worker that the kill
    stage's signal ends (Gunicorn's on SIGABRT), raised in the thread of a
    request that timed out: Sentry's WSGI integration sends it as an
    unhandled error, its logging integration as the server's "Error
    handling request"."""
    exc_info = (hint or {}).get("exc_info")
    if not exc_info or _integration() is None:
        return event
    if isinstance(exc_info[1], RequestTimeout):
        return None
    if isinstance(exc_info[1], SystemExit) and threading.get_ident() in _REPORTER.threads:
        return None
    return event
