"""Request timeouts for web servers, built on shmwheel.

* :mod:`shmwheel.contrib.timeouts`: the parts every server shares: the
  per-request timer a worker runs (:class:`~shmwheel.contrib.timeouts.RequestTimer`),
  what the driver does when one fires (:class:`~shmwheel.contrib.timeouts.TimeoutActions`),
  and a supervised driver process (:class:`~shmwheel.contrib.timeouts.DriverSupervisor`);
* :mod:`shmwheel.contrib.wsgi`: a WSGI middleware for any server;
* :mod:`shmwheel.contrib.gunicorn`: Gunicorn server hooks, from a config file;
* :mod:`shmwheel.contrib.uwsgi`: the same for uWSGI, the driver as a mule.
"""
