"""A Django project in one file, whose views take timeouts of their own
(shmwheel.contrib.request_timeout): under Gunicorn, ``views_django:application``;
under an ASGI server, ``views_django_asgi:application``.

    GET /             answers at once
    GET /short?s=N    request_timeout(0.5): a function view, time.sleep(N)
    GET /long?s=N     request_timeout(60), through method_decorator on a class-based view
    GET /none?s=N     request_timeout(None) on a class-based view, directly

and, each with request_timeout(0.5), for Django under an ASGI server:

    GET /fifo?at=P    a sync view that reads the FIFO at P: blocked in C until something writes to it
    GET /await        an async view in asyncio.sleep(60), which says on stderr when it is cancelled
    GET /spin?at=P    an async view that spins, blocking the event loop, until there is a file at P
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import django
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View

from shmwheel.contrib import request_timeout

# django.request to the server's log, at INFO: a request that ended in an
# exception Django saw would be logged there, as "Internal Server Error".
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {"django": {"handlers": ["stderr"], "level": "INFO"}},
}
settings.configure(
    DEBUG=False, ROOT_URLCONF=__name__, ALLOWED_HOSTS=["*"], SECRET_KEY="a test project's", LOGGING=LOGGING
)
django.setup()


def _done(request: HttpRequest) -> HttpResponse:
    return HttpResponse(f"done by pid {os.getpid()}\n", content_type="text/plain")


def _seconds(request: HttpRequest) -> float:
    return float(request.GET.get("s", "0"))


@request_timeout(0.5)
def short(request: HttpRequest) -> HttpResponse:
    time.sleep(_seconds(request))
    return _done(request)


@method_decorator(request_timeout(60), name="dispatch")
class Long(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        time.sleep(_seconds(request))
        return _done(request)


@request_timeout(None)
class Untimed(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        time.sleep(_seconds(request))
        return _done(request)


@request_timeout(0.5)
def fifo(request: HttpRequest) -> HttpResponse:
    with open(request.GET["at"]) as blocked:  # open(2) of a FIFO waits for a writer
        blocked.read()
    return _done(request)


@request_timeout(0.5)
async def awaits(request: HttpRequest) -> HttpResponse:
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        print("views_django: /await was cancelled", file=sys.stderr, flush=True)
        raise
    return _done(request)


@request_timeout(0.5)
async def spin(request: HttpRequest) -> HttpResponse:
    while not os.path.exists(request.GET["at"]):
        pass
    return _done(request)


urlpatterns = [
    path("", _done),
    path("short", short),
    path("long", Long.as_view()),
    path("none", Untimed.as_view()),
    path("fifo", fifo),
    path("await", awaits),
    path("spin", spin),
]

from django.core.wsgi import get_wsgi_application  # noqa: E402 - once the settings are made

application = get_wsgi_application()
