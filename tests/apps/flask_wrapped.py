"""The Flask application wrapped by hand in the WSGI middleware, with a
timeout of 30 s, on the wheel that Gunicorn's ``install()`` names to its
workers: an application wrapped both by hand and by ``install()``."""

import os

from flask_stuck import app

from shmwheel.contrib.wsgi import TimeoutMiddleware

application = TimeoutMiddleware(app, os.environ["SHMWHEEL_WHEEL"], timeout=30.0)
