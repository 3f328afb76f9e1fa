"""A timed-out request, reported to Sentry from the worker that ran it.

In a Gunicorn config::

    from shmwheel.contrib import gunicorn as shmwheel_gunicorn
    from sentry_on_timeout import report_to_sentry
    shmwheel_gunicorn.install(globals(), timeout=30.0, interrupt=True, on_timeout=report_to_sentry)

or ``TimeoutMiddleware(app, ..., on_timeout=report_to_sentry)``, or
``shmwheel-on-timeout = sentry_on_timeout:report_to_sentry`` for uWSGI.
shmwheel calls it in the worker, in its reporter thread, with the request
record and the request's own stack, before it ends the request: the event
carries the stack of the moment it timed out, not the stack of wherever
the interrupt unwinds it.  Initialise ``sentry_sdk`` in the worker as you
would anyway (``sentry_sdk.init(dsn=...)``).
"""

from __future__ import annotations

import sentry_sdk

from shmwheel.contrib import RequestRecord


def report_to_sentry(request: RequestRecord, stack: str) -> None:
    """One Sentry event per timed-out request, grouped by method and path."""
    with sentry_sdk.new_scope() as scope:
        scope.set_tag("request_id", request.request_id)
        scope.set_context("request timeout", request.as_dict())
        scope.set_extra("stack", stack)
        scope.fingerprint = ["shmwheel-timeout", request.method, request.path]
        sentry_sdk.capture_message(
            f"request timed out: {request.method} {request.path}, after {request.running_for():.1f} s",
            level="error",
        )
