"""Gunicorn with a 2 s timeout on every request:

    gunicorn -c examples/gunicorn.conf.py --chdir examples app:application

then ``curl 'localhost:8000/sleep?s=5'`` times out after 2 s: the driver logs
the request, the worker writes the request's stack and is sent SIGABRT, and the
master replaces it.  A sync worker leaves the request at once; a gthread
worker exits when the request's thread returns, or at the SIGKILL 3 s
later (see README.md beside this file).
"""

import os

bind = os.environ.get("BIND", "127.0.0.1:8000")
workers = 2
worker_class = os.environ.get("WORKER_CLASS", "sync")  # or "gthread"
if worker_class == "gthread":
    threads = 4  # (with more than one thread, Gunicorn turns "sync" into "gthread")

from shmwheel.contrib import gunicorn as shmwheel_gunicorn  # noqa: E402

shmwheel_gunicorn.install(globals(), timeout=2.0, kill=True, kill_after=3.0)
