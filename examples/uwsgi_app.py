"""The demo application with a timeout on every request, for uwsgi.ini."""

from app import application as _application

from shmwheel.contrib.uwsgi import request_timeouts

application = request_timeouts(_application)
