"""Gunicorn with Uvicorn's workers and a 2 s timeout on every request:

    gunicorn -c examples/gunicorn_asgi.conf.py --chdir examples asgi_app:routes

``install()`` wraps each worker's ASGI application in shmwheel's ASGI
middleware on the master's wheel (``asgi_app:app``, wrapped already, is
timed once, by the outer one).  ``curl 'localhost:8000/sleep?s=5'`` times
out after 2 s: the driver logs the request, the worker writes the
request's stack and is sent SIGTERM, Uvicorn's graceful stop, which waits for
the request; the SIGKILL 3 s later ends it and the master replaces it.
"""

import os

bind = os.environ.get("BIND", "127.0.0.1:8000")
workers = 2
worker_class = "uvicorn_worker.UvicornWorker"

from shmwheel.contrib import gunicorn as shmwheel_gunicorn  # noqa: E402

shmwheel_gunicorn.install(globals(), timeout=2.0, kill=True, kill_after=3.0)
