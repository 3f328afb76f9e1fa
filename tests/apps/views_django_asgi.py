"""The Django project of ``views_django`` as an ASGI application, wrapped
in the ASGI middleware with a 4 s timeout and interrupt: under Uvicorn,
``views_django_asgi:application``."""

from __future__ import annotations

from django.core.asgi import get_asgi_application
from views_django import urlpatterns  # noqa: F401 - the project: its settings, made at import

from shmwheel.contrib.asgi import TimeoutMiddleware

application = TimeoutMiddleware(get_asgi_application(), 4.0, interrupt=True)
