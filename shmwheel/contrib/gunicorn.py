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
* ``post_worker_init`` (each worker): attaches to the wheel and sets up
  the signal on which it writes a timed-out request's stack.  With an ASGI worker class
  (Uvicorn's ``uvicorn_worker.UvicornWorker`` or the older
  ``uvicorn.workers.UvicornWorker``, Gunicorn's ``asgi``) it wraps the
  application in :class:`shmwheel.contrib.asgi.TimeoutMiddleware` on the
  master's wheel (an application that is the middleware already is not
  wrapped again, and the worker says that its settings win); with the
  classes that call the request hooks, a WSGI middleware the application
  made passes its requests through untimed, and the worker says so; with
  another class that calls no request hooks, it logs an ERROR unless the
  application is wrapped in one of the middlewares;
* ``pre_request`` / ``post_request`` (each worker, in the thread that runs
  the request, so sync, gthread, eventlet and gevent workers alike): add
  the request's timer and cancel it;
* ``on_exit`` (master): stops the driver and removes the wheel.

The master names the wheel to its workers in the ``SHMWHEEL_WHEEL``
environment variable, so that a middleware without a name uses it.

When a timer fires the driver logs the request, has the worker write the
request's own stack, and, with ``kill=True``, sends it ``kill_signal`` (by default
SIGABRT for Gunicorn's own workers: the worker runs ``worker_abort`` and
exits, as on Gunicorn's own timeout; SIGTERM for Uvicorn's, which set
SIGABRT back to its default action, a core dump, and shut down gracefully
on SIGTERM), then SIGKILL ``kill_after`` seconds later if it is still there.
The master then starts a new worker, as for any worker that dies.

A reload (SIGHUP) runs the config again: new workers get the new
``timeout``, and the driver is restarted with the new actions.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from .._segment import segment_name
from ._door import gunicorn_hooks, in_c
from ._logs import LogTarget
from ._record import DEFAULT_TRACEBACK_SIGNAL, RequestRecord
from ._routes import Routes
from ._settings import (
    DEFAULT_CAPACITY,
    DEFAULT_INTERRUPT_GRACE,
    DEFAULT_KILL_AFTER,
    WHEEL_ENV,
    TimeoutActions,
    TimeoutSettings,
)
from ._supervisor import DriverSupervisor
from ._worker import RequestTimer, timed_apps
from .asgi import TimeoutMiddleware
from .wsgi import InterruptibleApp
from .wsgi import TimeoutMiddleware as WSGIMiddleware

__all__ = ["install"]

_HOOKS = ("on_starting", "post_worker_init", "pre_request", "post_request", "on_exit")
_INSTALLED = "_shmwheel_installed"  # in the config: the hooks install() found there, and those it set
_REQUEST_ID_HEADER = "X-REQUEST-ID"  # Gunicorn upper-cases header names
_REQUEST_START_HEADER = "X-REQUEST-START"
# Gunicorn's worker classes that call pre_request and post_request around
# every request (eventlet's and gevent's derive from AsyncWorker).
_HOOKED_WORKERS = frozenset(
    {
        "gunicorn.workers.sync.SyncWorker",
        "gunicorn.workers.gthread.ThreadWorker",
        "gunicorn.workers.base_async.AsyncWorker",
    }
)
# Uvicorn's worker classes, which serve an ASGI application and call no
# request hook: the application is wrapped instead.  They set SIGABRT back
# to its default action, a core dump, and stop gracefully on SIGTERM.
_UVICORN_WORKERS = frozenset({"uvicorn_worker._workers.UvicornWorker", "uvicorn.workers.UvicornWorker"})
# Every ASGI worker class whose application is wrapped: Gunicorn's own asgi
# worker too (before Gunicorn 25 it called pre_request but not post_request).
_ASGI_WORKERS = _UVICORN_WORKERS | {"gunicorn.workers.gasgi.ASGIWorker"}
HOOKS, WRAP, NONE = "hooks", "wrap", "none"  # how a worker class's requests are timed


@dataclass(frozen=True)
class _Installed:
    """What install() was called with, checked."""

    name: str | None
    timeouts: TimeoutSettings  # every request's, and the driver's actions
    kill_signal_given: bool  # False: the worker class's own (see _actions_for)


class _State:
    """The master's supervisor and the workers' timer: one per process,
    kept across a reload, which calls install() again."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.settings: _Installed | None = None
        self.supervisor: DriverSupervisor | None = None
        self.timer: RequestTimer | None = None
        self.how = HOOKS  # how the worker class's requests are timed
        self.worker_class: type | None = None


_state = _State()


def install(
    config: MutableMapping[str, Any],
    timeout: float,
    *,
    name: str | None = None,
    tracebacks: bool = True,
    traceback_signal: int | str = DEFAULT_TRACEBACK_SIGNAL,
    kill: bool = False,
    kill_signal: int | str | None = None,
    kill_after: float = DEFAULT_KILL_AFTER,
    log: bool = True,
    capacity: int = DEFAULT_CAPACITY,
    warn_after: float | None = None,
    interrupt: bool = False,
    interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
    routes: Routes | None = None,
    on_timeout: Callable[[RequestRecord, str], object] | None = None,
    x_request_start: bool = False,
    metrics: str | None = None,
) -> None:
    """Give every request a ``timeout`` (seconds): call it with ``globals()``
    last in a Gunicorn config file.  ``name`` is the wheel's name (default
    ``gunicorn-<master pid>``); the stages and ``routes``, ``on_timeout``
    and ``x_request_start`` are those of the middlewares
    (:class:`shmwheel.contrib.wsgi.TimeoutMiddleware`); the rest are
    :class:`TimeoutActions`, where ``kill_signal`` defaults to the worker
    class's graceful signal: SIGABRT for Gunicorn's own, SIGTERM for
    Uvicorn's.  Called again in the same config, it takes the place of
    the earlier call."""
    if not isinstance(config, MutableMapping):
        raise TypeError(f"install() takes the config's namespace, globals(), not {type(config).__name__}")
    if name is not None:
        segment_name(name)  # a bad name fails now, not in a worker
    timeouts = TimeoutSettings(
        timeout, warn_after=warn_after, interrupt=interrupt, routes=routes, on_timeout=on_timeout,
        x_request_start=x_request_start, traceback_signal=traceback_signal, capacity=capacity,
        actions=TimeoutActions(
            log=log, tracebacks=tracebacks, kill=kill, kill_after=kill_after, interrupt_grace=interrupt_grace,
            kill_signal=signal.SIGABRT if kill_signal is None else kill_signal,  # type: ignore[arg-type]
            metrics=metrics,
        ),
    )  # fmt: skip
    settings = _Installed(name=name, timeouts=timeouts, kill_signal_given=kill_signal is not None)
    with _state.lock:
        reload = _state.supervisor is not None
        _state.settings = settings
    if reload:
        _reconfigure(settings)

    # A second install() in the same config takes the place of the first:
    # it calls what the first found there, not the first's hooks, which
    # would add a second timer a request and lose the first's handle.
    first_found, first_set = config.get(_INSTALLED, ({}, {}))
    earlier = {
        hook: first_found.get(hook) if hook in first_set and config.get(hook) is first_set[hook] else config.get(hook)
        for hook in _HOOKS
    }

    def on_starting(server: Any) -> None:
        _start(server, settings)
        _call(earlier["on_starting"], server)

    def post_worker_init(worker: Any) -> None:
        if _state.timer is not None:
            _state.timer.prepare()
            _time_once(worker, _state.timer)
            if _state.timer.interrupt:  # a request it interrupts is answered 504
                worker.wsgi = InterruptibleApp(worker.wsgi, _state.timer)
        elif _state.how == WRAP:
            _wrap(worker, settings)
        elif _state.how == NONE and not timed_apps:
            worker.log.error(
                "shmwheel: worker class %s calls no request hook and the application is not wrapped: its requests "
                "run without a timeout; wrap it in shmwheel.contrib.wsgi.TimeoutMiddleware(app, timeout) or "
                "shmwheel.contrib.asgi.TimeoutMiddleware(app, timeout), or use sync, gthread, eventlet, gevent or "
                "Uvicorn's workers",
                _class_name(type(worker)),
            )
        _call(earlier["post_worker_init"], worker)

    # The two hooks every request runs: what can be decided once is, here.
    earlier_pre = earlier["pre_request"] if callable(earlier["pre_request"]) else None
    earlier_post = earlier["post_request"] if callable(earlier["post_request"]) else None
    wanted = (_REQUEST_ID_HEADER, _REQUEST_START_HEADER) if timeouts.x_request_start else (_REQUEST_ID_HEADER,)

    def timer_pre(worker: Any, req: Any, *, declined: bool = False) -> None:
        """The request's timer from its start.  ``declined``: the C hook
        (shmwheel._fast's Hooks) tried it and gave it back, so it takes the
        waiting path (RequestTimer.start_declined).  A keyword: Gunicorn
        counts a hook's positional arguments."""
        timer = _state.timer
        if timer is not None:
            request_id = queued_since = None
            for key, value in req.headers:
                if key in wanted:
                    if key == _REQUEST_ID_HEADER:
                        request_id = request_id or str(value)  # the first that is not empty
                    else:
                        queued_since = queued_since or str(value)
            if declined:
                handle = timer.start_declined(req.method, req.path, request_id)
            else:
                handle = timer.start(req.method, req.path, request_id, None, queued_since)
            try:
                req.shmwheel_handle = handle
            except BaseException:  # no timer outlives a request that cannot keep its handle
                timer.finish(handle)
                raise

    def timer_post(worker: Any, req: Any, environ: Any, resp: Any) -> None:
        timer = _state.timer
        if timer is not None:
            timer.finish(getattr(req, "shmwheel_handle", None))

    # Every request's timer from its start in C where it can be, with no
    # frame of ours (the Python hook above takes what the C one does not).
    plain = in_c(timeouts, ends_in_call=False)  # an interrupted request is answered by InterruptibleApp
    hooks = gunicorn_hooks(_state, timer_pre, _REQUEST_ID_HEADER, plain)
    start: Callable[[Any, Any], None] = timer_pre if hooks is None else hooks.pre_request
    end: Callable[[Any, Any, Any, Any], None] = timer_post if hooks is None else hooks.post_request

    def pre_both(worker: Any, req: Any) -> None:
        start(worker, req)
        earlier_pre(worker, req)  # type: ignore[misc]

    def post_both(worker: Any, req: Any, environ: Any, resp: Any) -> None:
        try:
            earlier_post(worker, req, environ, resp)  # type: ignore[misc]
        finally:
            end(worker, req, environ, resp)

    pre_request = start if earlier_pre is None else pre_both
    post_request = end if earlier_post is None else post_both

    def on_exit(server: Any) -> None:
        try:
            _call(earlier["on_exit"], server)
        finally:
            _stop(server)

    ours = {
        "on_starting": on_starting,
        "post_worker_init": post_worker_init,
        "pre_request": pre_request,
        "post_request": post_request,
        "on_exit": on_exit,
    }
    config.update(ours)
    config[_INSTALLED] = (earlier, ours)


def _call(hook: Any, *args: Any) -> None:
    if callable(hook):
        hook(*args)


def _timer(name: str, settings: _Installed) -> RequestTimer:
    return RequestTimer.of(name, settings.timeouts)


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


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _ancestry(worker_class: type) -> set[str]:
    return {_class_name(c) for c in worker_class.__mro__}


def how_timed(worker_class: type) -> str:
    """How the requests of a Gunicorn worker class are timed: HOOKS for the
    classes that call pre_request and post_request around every request
    (sync, gthread and async, eventlet's and gevent's, and their
    subclasses); WRAP for the ASGI ones, whose application each worker
    wraps; NONE for the others (tornado, gevent_pywsgi, a gevent server of
    its own), whose application must be wrapped by hand."""
    ancestry = _ancestry(worker_class)
    if ancestry & _ASGI_WORKERS:
        return WRAP
    if ancestry & _HOOKED_WORKERS and getattr(worker_class, "server_class", None) is None:
        return HOOKS
    return NONE


def _actions_for(settings: _Installed, worker_class: type) -> TimeoutActions:
    """The settings' actions, with the worker class's kill_signal unless one was given."""
    actions = settings.timeouts.actions
    if settings.kill_signal_given or not _ancestry(worker_class) & _UVICORN_WORKERS:
        return actions
    return dataclasses.replace(actions, kill_signal=signal.SIGTERM)


def _wrap(worker: Any, settings: _Installed) -> None:
    """Wrap a worker's ASGI application (Gunicorn's asgi worker keeps it in
    ``worker.asgi``, Uvicorn's in ``worker.wsgi``) on the master's wheel.

    An application that is the middleware already is not wrapped again:
    its settings time each request, and the worker says so, since
    install()'s then do nothing.  (One whose middleware is further in is
    wrapped: the outer one's settings win, and the inner one says so at
    its first request.)"""
    attr = "asgi" if getattr(worker, "asgi", None) is not None else "wsgi"
    app = getattr(worker, attr)
    if isinstance(app, TimeoutMiddleware):
        _wrapped_already(worker, app, settings)
    else:
        app = TimeoutMiddleware.of(app, settings.timeouts, name=os.environ[WHEEL_ENV])
        setattr(worker, attr, app)
    app.timer.prepare()


def _wrapped_already(worker: Any, app: TimeoutMiddleware, settings: _Installed) -> None:
    """Say, at the worker's boot, that its ASGI application is the middleware
    already, whose settings win over install()'s.  What the driver does at a
    timeout is still install()'s (its driver acts on the master's wheel,
    which a middleware without a name uses), not the middleware's own."""
    wheel = os.environ[WHEEL_ENV]
    if (app.name or wheel) == wheel:
        driver = _actions_for(settings, type(worker))
        then = f"install()'s driver acts on its timeouts ({driver.summary()})"
        if app.actions.summary() != driver.summary():
            then += f", not as the middleware's own settings say ({app.actions.summary()})"
    else:
        then = f"its timers go to wheel {app.name!r}, which install()'s driver, on wheel {wheel!r}, does not drive"
    worker.log.warning(
        "shmwheel: the application is wrapped in shmwheel.contrib.asgi.TimeoutMiddleware already, so install() does "
        "not wrap it again: that middleware's settings time each request (%s), and install()'s (%s) do nothing; %s; "
        "wrap the application or call install(), not both",
        app.settings.summary(),
        settings.timeouts.summary(),
        then,
    )


def _time_once(worker: Any, timer: RequestTimer) -> None:
    """Have each WSGI middleware of the worker's (an application wrapped by
    hand as well) pass its requests through untimed, and say so: install()'s
    hooks time every request already.  Two timers a request would each act
    at their own timeout, and extend() and no_timeout() in the application
    would reach only the middleware's, so that install()'s would end, or
    kill, a request its code had exempted."""
    for middleware in list(timed_apps):
        if not isinstance(middleware, WSGIMiddleware) or middleware.timed_outside is not None:
            continue
        middleware.stand_aside("install()")
        worker.log.warning(
            "shmwheel: install()'s hooks time every request of this worker (%s), and the shmwheel.contrib.wsgi."
            "TimeoutMiddleware its application made (%s, on wheel %r) would time them again: install()'s settings "
            "win, and the middleware passes its requests through untimed; wrap the application or call install(), "
            "not both",
            timer.settings.summary(),
            middleware.timer.settings.summary(),
            middleware.timer.name,
        )


def _check_setup(server: Any, settings: _Installed, how: str) -> None:
    """Log what would make timeouts silently not happen, as far as the master can tell."""
    cfg = server.cfg
    worker_class = server.worker_class
    if how == WRAP:
        server.log.info(
            "shmwheel: worker class %s calls no request hook: each worker wraps its ASGI application in "
            "shmwheel.contrib.asgi.TimeoutMiddleware",
            _class_name(worker_class),
        )
    elif how == NONE:
        server.log.warning(
            "shmwheel: worker class %s does not call Gunicorn's pre_request and post_request hooks around each "
            "request: its requests are timed only if the application is wrapped in "
            "shmwheel.contrib.wsgi.TimeoutMiddleware or shmwheel.contrib.asgi.TimeoutMiddleware",
            _class_name(worker_class),
        )
    actions = settings.timeouts.actions
    if (
        actions.kill
        and settings.kill_signal_given
        and actions.kill_signal == signal.SIGABRT
        and _ancestry(worker_class) & _UVICORN_WORKERS
    ):
        server.log.warning(
            "shmwheel: kill_signal SIGABRT ends a Uvicorn worker with a core dump (it sets SIGABRT back to its "
            "default action): leave kill_signal out, and SIGTERM is sent"
        )
    if settings.timeouts.interrupt and "gunicorn.workers.geventlet.EventletWorker" in _ancestry(worker_class):
        server.log.warning(
            "shmwheel: interrupt=True cannot end a request of the eventlet worker (only gevent's greenlets can be "
            "interrupted from another thread): its timed-out requests are logged, and with kill=True killed; use "
            "the gevent worker to have them ended"
        )
    heartbeat = float(cfg.timeout)
    kind = str(cfg.worker_class_str)
    if (kind == "sync" or kind.endswith("SyncWorker")) and 0 < heartbeat <= settings.timeouts.timeout:
        # A sync worker in a request does not notify the master, which
        # kills it after Gunicorn's own timeout: before the request's timer
        # fires, with no request named and no tracebacks.
        server.log.warning(
            "shmwheel: the request timeout (%g s) is not below Gunicorn's timeout (%g s): the master kills a "
            "sync worker stuck in a request first, and the request is never reported; make it shorter than %g s",
            settings.timeouts.timeout,
            heartbeat,
            heartbeat,
        )


def _start(server: Any, settings: _Installed) -> None:
    _use_server_log(server)
    worker_class = server.worker_class
    how = how_timed(worker_class)
    _check_setup(server, settings, how)
    name = settings.name or f"gunicorn-{server.pid}"
    owner = _workers_ids(server)
    actions = _actions_for(settings, worker_class)
    # The driver writes to Gunicorn's error log, in its format, as the workers do.
    log_target = LogTarget.of(server.log.error_log)
    capacity = settings.timeouts.capacity
    supervisor = DriverSupervisor(name, actions, capacity=capacity, owner=owner, log_target=log_target)
    supervisor.start()
    os.environ[WHEEL_ENV] = name  # the workers inherit it: a middleware without a name uses this wheel
    with _state.lock:
        _state.supervisor = supervisor
        _state.how = how
        _state.worker_class = worker_class
        _state.timer = _timer(name, settings) if how == HOOKS else None
    server.log.info(
        "shmwheel: request timeout %g s on wheel %r, driver pid %s%s%s",
        settings.timeouts.timeout,
        name,
        supervisor.pid,
        ", workers are killed on timeout" if actions.kill else "",
        "" if owner is None else f"; the wheel and the driver belong to the workers' uid {owner[0]}, gid {owner[1]}",
    )


def _reconfigure(settings: _Installed) -> None:
    supervisor = _state.supervisor
    assert supervisor is not None
    with _state.lock:
        _state.timer = _timer(supervisor.name, settings) if _state.how == HOOKS else None
        worker_class = _state.worker_class
    assert worker_class is not None
    actions = _actions_for(settings, worker_class)
    if actions != supervisor.actions:
        supervisor.restart(actions)


def _stop(server: Any) -> None:
    with _state.lock:
        supervisor, _state.supervisor = _state.supervisor, None
        _state.timer = None
    if supervisor is not None:
        supervisor.stop()
        server.log.info("shmwheel: driver stopped, wheel %r removed", supervisor.name)
