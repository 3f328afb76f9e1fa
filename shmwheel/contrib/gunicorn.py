"""Per-request timeouts for Gunicorn, from its config file.

Last in ``gunicorn.conf.py``::

    from shmwheel.contrib import gunicorn as shmwheel_gunicorn
    shmwheel_gunicorn.install(globals(), timeout=30.0, kill=True)

:func:`install` defines five server hooks in the config's namespace (and
calls any that were defined above it, so it must come after them):

* ``on_starting`` (master): creates the wheel ``gunicorn-<master pid>``
  and starts the driver in a process of its own, which the master's
  supervisor thread restarts if it dies.  When the master runs as root and
  the workers as ``user``/``group``, the wheel is made theirs and the
  driver runs as them too: it can signal the workers and nothing else;
* ``post_worker_init`` (each worker): attaches to the wheel and registers
  :mod:`faulthandler` on the traceback signal;
* ``pre_request`` / ``post_request`` (each worker, in the thread that runs
  the request, so sync and gthread workers alike): add the request's timer
  and cancel it;
* ``on_exit`` (master): stops the driver and removes the wheel.

When a timer fires the driver logs the request, has the worker dump its
tracebacks, and, with ``kill=True``, sends it ``kill_signal`` (SIGABRT by
default: the worker runs ``worker_abort`` and exits, as on Gunicorn's own
timeout), then SIGKILL ``kill_after`` seconds later if it is still there.
The master then starts a new worker, as for any worker that dies.

A reload (SIGHUP) runs the config again: new workers get the new
``timeout``, and the driver is restarted with the new actions.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from .._checks import check_seconds
from ._handler import DEFAULT_KILL_AFTER, TimeoutActions
from ._record import DEFAULT_TRACEBACK_SIGNAL
from ._supervisor import DEFAULT_CAPACITY, DriverSupervisor
from ._worker import RequestTimer

__all__ = ["install"]

_HOOKS = ("on_starting", "post_worker_init", "pre_request", "post_request", "on_exit")
_REQUEST_ID_HEADER = "X-REQUEST-ID"  # Gunicorn upper-cases header names
# Gunicorn's worker classes that call pre_request and post_request around
# every request (eventlet's and gevent's derive from AsyncWorker).
_HOOKED_WORKERS = frozenset(
    {
        "gunicorn.workers.sync.SyncWorker",
        "gunicorn.workers.gthread.ThreadWorker",
        "gunicorn.workers.base_async.AsyncWorker",
    }
)


@dataclass
class _Settings:
    name: str | None
    timeout: float
    actions: TimeoutActions
    capacity: int


class _State:
    """The master's supervisor and the workers' timer: one per process,
    kept across a reload, which calls install() again."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.settings: _Settings | None = None
        self.supervisor: DriverSupervisor | None = None
        self.timer: RequestTimer | None = None
        self.timers = True  # False: the worker class does not call both request hooks


_state = _State()


def install(
    config: MutableMapping[str, Any],
    timeout: float,
    *,
    name: str | None = None,
    tracebacks: bool = True,
    traceback_signal: int | str = DEFAULT_TRACEBACK_SIGNAL,
    kill: bool = False,
    kill_signal: int | str = signal.SIGABRT,
    kill_after: float = DEFAULT_KILL_AFTER,
    log: bool = True,
    capacity: int = DEFAULT_CAPACITY,
) -> None:
    """Give every request a ``timeout`` (seconds): call it with ``globals()``
    last in a Gunicorn config file.  ``name`` is the wheel's name (default
    ``gunicorn-<master pid>``); the rest are :class:`TimeoutActions`."""
    if not isinstance(config, MutableMapping):
        raise TypeError(f"install() takes the config's namespace, globals(), not {type(config).__name__}")
    settings = _Settings(
        name=name,
        timeout=check_seconds(timeout, "timeout", positive=True),
        actions=TimeoutActions(
            log=log,
            tracebacks=tracebacks,
            traceback_signal=traceback_signal,  # type: ignore[arg-type]  # a name is converted
            kill=kill,
            kill_signal=kill_signal,  # type: ignore[arg-type]
            kill_after=kill_after,
        ),
        capacity=capacity,
    )
    if name is not None:
        RequestTimer(name, settings.timeout)  # a bad name fails now
    with _state.lock:
        reload = _state.supervisor is not None
        _state.settings = settings
    if reload:
        _reconfigure(settings)

    earlier = {hook: config.get(hook) for hook in _HOOKS}

    def on_starting(server: Any) -> None:
        _start(server, settings)
        _call(earlier["on_starting"], server)

    def post_worker_init(worker: Any) -> None:
        if _state.timer is not None:
            _state.timer.prepare()
        _call(earlier["post_worker_init"], worker)

    def pre_request(worker: Any, req: Any) -> None:
        timer = _state.timer
        if timer is not None:
            req.shmwheel_timer = timer.start(req.method, req.path, _header(req, _REQUEST_ID_HEADER))
        _call(earlier["pre_request"], worker, req)

    def post_request(worker: Any, req: Any, environ: Any, resp: Any) -> None:
        try:
            _call(earlier["post_request"], worker, req, environ, resp)
        finally:
            timer = _state.timer
            if timer is not None:
                timer.finish(getattr(req, "shmwheel_timer", None))

    def on_exit(server: Any) -> None:
        try:
            _call(earlier["on_exit"], server)
        finally:
            _stop(server)

    config.update(
        on_starting=on_starting,
        post_worker_init=post_worker_init,
        pre_request=pre_request,
        post_request=post_request,
        on_exit=on_exit,
    )


def _call(hook: Any, *args: Any) -> None:
    if callable(hook):
        hook(*args)


def _header(req: Any, name: str) -> str | None:
    for key, value in req.headers:
        if key == name:
            return str(value)
    return None


def _timer(name: str, settings: _Settings) -> RequestTimer:
    signum = settings.actions.traceback_signal if settings.actions.tracebacks else None
    return RequestTimer(name, settings.timeout, traceback_signal=signum)


def _use_server_log(server: Any) -> None:
    """Send shmwheel's log lines (the supervisor's in the master, a worker's
    "running without a timeout") to Gunicorn's error log, in its format."""
    error_log = server.log.error_log
    ours = logging.getLogger("shmwheel")
    for handler in error_log.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.setLevel(error_log.level)
    ours.propagate = False


def _workers_ids(server: Any) -> tuple[int, int] | None:
    """The workers' (uid, gid) when Gunicorn drops privileges for them
    (``user``, ``group``), else None: they run as the master does."""
    uid, gid = int(server.cfg.uid), int(server.cfg.gid)
    return None if (uid, gid) == (os.geteuid(), os.getegid()) else (uid, gid)


def _calls_both_hooks(worker_class: type) -> bool:
    """Whether Gunicorn's worker class calls pre_request and post_request
    around every request: its sync, gthread and async (eventlet, gevent)
    workers and their subclasses do; tornado, gevent_pywsgi (a gevent server
    of its own) and asgi (pre_request only, so a timer would never be
    cancelled) do not."""
    ancestry = {f"{c.__module__}.{c.__qualname__}" for c in worker_class.__mro__}
    return bool(ancestry & _HOOKED_WORKERS) and getattr(worker_class, "server_class", None) is None


def _check_setup(server: Any, settings: _Settings) -> bool:
    """Log what would make timeouts silently not happen, as far as the master
    can tell; False if the workers cannot have request timers at all."""
    cfg = server.cfg
    worker_class = server.worker_class
    if not _calls_both_hooks(worker_class):
        server.log.warning(
            "shmwheel: worker class %s.%s does not call Gunicorn's pre_request and post_request hooks around "
            "each request: its requests run without a timeout; use sync, gthread, eventlet or gevent workers, "
            "or wrap a WSGI app in shmwheel.contrib.wsgi.TimeoutMiddleware",
            worker_class.__module__,
            worker_class.__qualname__,
        )
        return False
    heartbeat = float(cfg.timeout)
    kind = str(cfg.worker_class_str)
    if (kind == "sync" or kind.endswith("SyncWorker")) and 0 < heartbeat <= settings.timeout:
        # A sync worker in a request does not notify the master, which
        # kills it after Gunicorn's own timeout: before the request's timer
        # fires, with no request named and no tracebacks.
        server.log.warning(
            "shmwheel: the request timeout (%g s) is not below Gunicorn's timeout (%g s): the master kills a "
            "sync worker stuck in a request first, and the request is never reported; make it shorter than %g s",
            settings.timeout,
            heartbeat,
            heartbeat,
        )
    return True


def _start(server: Any, settings: _Settings) -> None:
    _use_server_log(server)
    timers = _check_setup(server, settings)
    name = settings.name or f"gunicorn-{server.pid}"
    owner = _workers_ids(server)
    supervisor = DriverSupervisor(name, settings.actions, capacity=settings.capacity, owner=owner)
    supervisor.start()
    with _state.lock:
        _state.supervisor = supervisor
        _state.timers = timers
        _state.timer = _timer(name, settings) if timers else None
    server.log.info(
        "shmwheel: request timeout %g s on wheel %r, driver pid %s%s%s",
        settings.timeout,
        name,
        supervisor.pid,
        ", workers are killed on timeout" if settings.actions.kill else "",
        "" if owner is None else f"; the wheel and the driver belong to the workers' uid {owner[0]}, gid {owner[1]}",
    )


def _reconfigure(settings: _Settings) -> None:
    supervisor = _state.supervisor
    assert supervisor is not None
    with _state.lock:
        _state.timer = _timer(supervisor.name, settings) if _state.timers else None
    if settings.actions != supervisor.actions:
        supervisor.restart(settings.actions)


def _stop(server: Any) -> None:
    with _state.lock:
        supervisor, _state.supervisor = _state.supervisor, None
        _state.timer = None
    if supervisor is not None:
        supervisor.stop()
        server.log.info("shmwheel: driver stopped, wheel %r removed", supervisor.name)
