"""The hello-world WSGI application of ``_servers_app.py`` in shmwheel's uWSGI
request timeouts (uWSGI looks its callable up in the module's dictionary, so
it cannot be built on first use there)."""

from _servers_app import application as _application

from shmwheel.contrib.uwsgi import request_timeouts

application = request_timeouts(_application)
