"""tests/apps/views_flask.py as uWSGI loads it: the app wrapped by request_timeouts()."""

from views_flask import app

from shmwheel.contrib.uwsgi import request_timeouts

application = request_timeouts(app)
