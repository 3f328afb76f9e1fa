"""Request timeouts for web servers, built on shmwheel.

The core every server shares, one module a concern (their public names are
all importable from :mod:`shmwheel.contrib.timeouts`):

* :mod:`~shmwheel.contrib._record`: the request record a timer carries;
* :mod:`~shmwheel.contrib._worker`: the worker's side, a timer per request
  (:class:`~shmwheel.contrib.timeouts.RequestTimer`);
* :mod:`~shmwheel.contrib._handler`: the driver's side, what it does when
  one fires and whom it may signal (:class:`~shmwheel.contrib.timeouts.TimeoutActions`);
* :mod:`~shmwheel.contrib._supervisor`: the wheel and the driver process's
  lifetime (:class:`~shmwheel.contrib.timeouts.DriverSupervisor`);
* :mod:`shmwheel.contrib.timeouts`: the driver command, ``python -m
  shmwheel.contrib.timeouts``.

One thin adapter a server:

* :mod:`shmwheel.contrib.wsgi`: a WSGI middleware for any server;
* :mod:`shmwheel.contrib.asgi`: an ASGI middleware for any server, whose
  workers start the driver themselves under Uvicorn and Hypercorn;
* :mod:`shmwheel.contrib.gunicorn`: Gunicorn server hooks, from a config file;
* :mod:`shmwheel.contrib.uwsgi`: the same for uWSGI, the driver as a mule.

What a request's own code may use, here: :func:`extend` and
:func:`no_timeout` change the timeout of the request in progress, and
:class:`RequestTimeout` is what ends one that ran past it
(``interrupt=True``).
"""

from ._interrupt import RequestTimeout
from ._worker import extend, no_timeout

__all__ = ["RequestTimeout", "extend", "no_timeout"]
