"""The plain WSGI application with a timeout on every request, for uWSGI."""

from plain_stuck import app

from shmwheel.contrib.uwsgi import request_timeouts

application = request_timeouts(app)
