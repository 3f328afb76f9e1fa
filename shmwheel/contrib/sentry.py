"""Timeouts in Sentry: one event per timed-out request, with the stack it
had when its time ran out, grouped by its view.

::

    import sentry_sdk
    from shmwheel.contrib.sentry import ShmwheelIntegration

    sentry_sdk.init(dsn=..., integrations=[ShmwheelIntegration()])

in each worker, as you initialise Sentry anyway.  At each request's
timeout the worker's reporter thread sends an event whose exception is a
``RequestTimeout`` (mechanism ``shmwheel``, handled: no crash) with the
request's own frames: where it was when its time ran out, not where an
interrupt later unwinds it.  Its fingerprint is the method and the view
(the innermost frame of the application's own code, by Sentry's in-app
rules, that a library such as the framework called; the path with its
ids masked where none is found), so each slow view is one issue; its
transaction is the view.  The event is made before the interrupt, and
captured and flushed after it, once a pass of the reporter thread, for at most
``_stacks.FLUSH_TIME``, before the driver is told of the requests not
interrupted: the driver's kill comes only after that, so the event is out
before the worker is, unless Sentry takes longer to accept it.

Sentry's WSGI integration (its Django and Flask integrations use it), and
its logging integration, would also send what ends a timed-out request,
as an error of the view mixed with its real errors: the ``RequestTimeout``
of an interrupt, or the ``SystemExit`` of a worker the kill stage ends.
This integration drops those, since its own event has said it.

``level`` is the events' level: ``"warning"``, as the server's log has
it, since a timeout is not a crash of the view; ``"error"`` if your
alerts count only errors.
"""

from __future__ import annotations

import contextlib
import linecache
from typing import Any, Literal, get_args

try:
    import sentry_sdk
    from sentry_sdk.integrations import Integration
    from sentry_sdk.scope import add_global_event_processor
    from sentry_sdk.types import Event, Hint
    from sentry_sdk.utils import filename_for_module, set_in_app_in_frames
except ImportError as exc:  # pragma: no cover - said in one line, with the fix
    raise ImportError(f"shmwheel.contrib.sentry needs sentry-sdk (pip install shmwheel[sentry]): {exc}") from None

from ._interrupt import RequestTimeout, ResponseBrokenOff
from ._stacks import Frame, TimedOut, add_reporter, view_of
from ._worker import say_unheard, timed_out_here

__all__ = ["ShmwheelIntegration"]

#: Lines of source around each frame's, as Sentry's own frames have.
CONTEXT_LINES = 5
Level = Literal["debug", "info", "warning", "error", "fatal"]
LEVELS: tuple[Level, ...] = get_args(Level)


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
    """The worker's reporter.  At the timeout, before the interrupt, only
    the event is made, from the frames as they were (the request's thread
    waits for the interrupt meanwhile); after the interrupt it is captured
    (Sentry's event processors, before_send, the envelope) and flushed."""

    def __init__(self) -> None:
        self._events: list[Event] = []

    def report(self, timed_out: TimedOut) -> None:
        integration = _integration()
        if integration is None:  # Sentry is off in this process, or initialised without us
            return
        self._events.append(event(timed_out, integration.level))

    def flush(self, timeout: float) -> None:
        events, self._events = self._events, []
        if not events:
            return
        for one in events:
            with sentry_sdk.isolation_scope() as scope:
                # The reporter thread's own scope gathers breadcrumbs (its
                # log lines: other requests' stacks, paths and ids): none.
                scope.clear_breadcrumbs()
                sentry_sdk.capture_event(one)
        sentry_sdk.flush(timeout)

    def __repr__(self) -> str:
        return "shmwheel.contrib.sentry"


_REPORTER = _Reporter()


def event(timed_out: TimedOut, level: Level = "warning") -> Event:
    """The Sentry event of a timed-out request."""
    request = timed_out.request
    frames = [_frame(f) for f in timed_out.frames]
    options = sentry_sdk.get_client().options or {}
    set_in_app_in_frames(
        frames, options.get("in_app_exclude"), options.get("in_app_include"), options.get("project_root")
    )
    # The view by Sentry's own idea of the application's code (in_app_include,
    # in_app_exclude, project_root: an application installed as a package
    # counts once it is included); else by shmwheel's.
    view = view_of(timed_out.frames, [f.get("in_app") for f in frames]) or timed_out.view
    route = view or timed_out.route
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
                    # handled: the request was ended on purpose; not a crash
                    # of the view (nor of the session, in release health).
                    "mechanism": {"type": "shmwheel", "handled": True},
                    **({"stacktrace": {"frames": frames}} if frames else {}),
                }
            ]
        },
        "request": {"method": request.method, "url": request.path},
        "tags": {"request_id": request.request_id} if request.request_id else {},
        "contexts": {
            "request timeout": {
                **request.as_dict(),
                "running_for": round(request.running_for(), 3),
                "view": view,
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
    stage's signal ends (Gunicorn's on SIGABRT) while its timed-out request
    is in progress here: Sentry's WSGI integration (its Django and Flask
    integrations') sends it as an unhandled error there, and its logging
    integration again, once the request has gone, as the server's "Error
    handling request": the exception is marked the first time, so the
    second is known too.  Any other SystemExit goes through."""
    exc_info = (hint or {}).get("exc_info")
    if not exc_info or _integration() is None:
        return event
    exc = exc_info[1]
    if isinstance(exc, (RequestTimeout, ResponseBrokenOff)) or getattr(exc, _TIMED_OUT, False):
        return None
    if isinstance(exc, SystemExit) and timed_out_here():
        with contextlib.suppress(AttributeError):
            setattr(exc, _TIMED_OUT, True)
        return None
    return event


_TIMED_OUT = "_shmwheel_timed_out"  # set on a SystemExit that ended a timed-out request
