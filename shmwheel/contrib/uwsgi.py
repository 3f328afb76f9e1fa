"""Per-request timeouts for uWSGI, the driver running as a mule.

In the uWSGI config::

    [uwsgi]
    master = true
    mule = shmwheel.contrib.uwsgi:driver
    shmwheel-timeout = 30
    shmwheel-kill = true

and where the application is defined::

    from shmwheel.contrib.uwsgi import request_timeouts
    application = request_timeouts(application)

The ``shmwheel-*`` options (uWSGI hands every process the whole config):

==========================  =================================================
``shmwheel-timeout``        seconds a request may run (required)
``shmwheel-kill``           ``true``: signal, then SIGKILL, a worker whose
                            request timed out (default ``false``)
``shmwheel-kill-signal``    the first signal (default ``TERM``; uWSGI's
                            harakiri-graceful sends the same)
``shmwheel-kill-after``     seconds from it to SIGKILL (default 5)
``shmwheel-tracebacks``     ``false``: no traceback dump (default ``true``)
``shmwheel-traceback-signal``  faulthandler's signal (default ``URG``)
``shmwheel-log``            ``false``: no log line per timeout
``shmwheel-name``           the wheel (default ``uwsgi-<master pid>``)
``shmwheel-capacity``       requests in progress at once (default 65536)
==========================  =================================================

The master creates the wheel when it loads the application (each worker
attaches right after it is forked, in a postfork hook, and registers the
traceback signal then); the mule drives it, and uWSGI restarts the
mule if it dies or is reloaded, which takes the same wheel over.  The mule
removes the wheel when uWSGI shuts down; on a reload of the whole server,
the master replaces it.  With ``lazy-apps`` the mule creates the wheel
instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .._driver import Driver
from .._errors import DriverRunningError, SegmentNotFoundError, ShmwheelError
from .._wheel import _attach, unlink
from .timeouts import (
    _LOG_FORMAT,
    DEFAULT_CAPACITY,
    DEFAULT_KILL_AFTER,
    DEFAULT_TRACEBACK_SIGNAL,
    TimeoutActions,
    TimeoutHandler,
    _seconds,
    _watch_parent,
    create_wheel,
)
from .wsgi import TimeoutMiddleware, WSGIApp

__all__ = ["driver", "request_timeouts"]

_log = logging.getLogger("shmwheel.timeouts")

_PREFIX = "shmwheel-"
_DRIVER = "shmwheel.contrib.uwsgi:driver"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Settings:
    """The ``shmwheel-*`` options of a uWSGI config."""

    name: str
    timeout: float
    actions: TimeoutActions
    capacity: int


def _option(opts: Mapping[str, Any], key: str) -> str | None:
    value = opts.get(_PREFIX + key)
    if isinstance(value, list):  # given more than once: the last one counts
        value = value[-1]
    if value is None:
        return None
    if value is True:  # a bare flag
        return "true"
    return value.decode() if isinstance(value, bytes) else str(value)


def _flag(opts: Mapping[str, Any], key: str, default: bool) -> bool:
    text = _option(opts, key)
    if text is None:
        return default
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"{_PREFIX}{key} must be true or false, not {text!r}")


def _number(opts: Mapping[str, Any], key: str, default: float | None, cast: Callable[[str], Any] = float) -> Any:
    text = _option(opts, key)
    if text is None:
        if default is None:
            raise ValueError(f"the uWSGI config has no {_PREFIX}{key} option: set it to the request timeout in seconds")
        return default
    try:
        return cast(text)
    except ValueError:
        raise ValueError(f"{_PREFIX}{key} must be a number, not {text!r}") from None


def settings(opts: Mapping[str, Any], master_pid: int) -> Settings:
    """Read the ``shmwheel-*`` options (``uwsgi.opt``); ValueError names a bad one."""
    try:
        return Settings(
            name=_option(opts, "name") or f"uwsgi-{master_pid}",
            timeout=_seconds(_number(opts, "timeout", None), f"{_PREFIX}timeout"),
            actions=TimeoutActions(
                log=_flag(opts, "log", True),
                tracebacks=_flag(opts, "tracebacks", True),
                traceback_signal=_option(opts, "traceback-signal") or DEFAULT_TRACEBACK_SIGNAL,  # type: ignore[arg-type]
                kill=_flag(opts, "kill", False),
                kill_signal=_option(opts, "kill-signal") or signal.SIGTERM,  # type: ignore[arg-type]
                kill_after=_number(opts, "kill-after", DEFAULT_KILL_AFTER),
            ),
            capacity=_number(opts, "capacity", DEFAULT_CAPACITY, int),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"shmwheel: {exc}") from None


def _uwsgi() -> Any:
    try:
        import uwsgi  # exists only in processes that uWSGI runs
    except ImportError:
        raise RuntimeError("shmwheel.contrib.uwsgi works only in a process that uWSGI runs") from None
    return uwsgi


def _settings() -> Settings:
    uwsgi = _uwsgi()
    return settings(uwsgi.opt, uwsgi.masterpid())


_created: set[str] = set()  # wheels this master has created (an app may be wrapped twice)


def request_timeouts(app: WSGIApp) -> TimeoutMiddleware:
    """Wrap the application: every request gets the timeout the config sets."""
    uwsgi = _uwsgi()
    config = _settings()
    mules = uwsgi.opt.get("mule") or []
    mules = [m.decode() if isinstance(m, bytes) else str(m) for m in (mules if isinstance(mules, list) else [mules])]
    if _DRIVER not in mules:
        _log.warning("shmwheel: no 'mule = %s' in the uWSGI config: nothing will act on timeouts", _DRIVER)
    if os.getpid() == uwsgi.masterpid() and config.name not in _created:
        create_wheel(config.name, capacity=config.capacity)
        _created.add(config.name)
    signum = config.actions.traceback_signal if config.actions.tracebacks else None
    middleware = TimeoutMiddleware(app, config.name, config.timeout, traceback_signal=signum)

    def after_fork() -> None:
        if uwsgi.worker_id() > 0:  # a worker, not a mule
            middleware.timer.prepare()

    import uwsgidecorators  # ships with uWSGI

    uwsgidecorators.postfork(after_fork)
    return middleware


def driver() -> None:
    """The mule: ``mule = shmwheel.contrib.uwsgi:driver``."""
    uwsgi = _uwsgi()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=_LOG_FORMAT)
    config = _settings()
    run = Driver(config.name, TimeoutHandler(config.name, config.actions))
    master = uwsgi.masterpid()
    stopped_by: int | None = None

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopped_by
        stopped_by = signum
        run.stop()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    # A master killed outright leaves no wheel behind: its death stops this
    # mule as its signals do (on the main thread, so that pause() returns).
    main = threading.main_thread().ident
    assert main is not None
    _watch_parent(master, lambda: signal.pthread_kill(main, signal.SIGTERM))
    try:
        try:
            _attach(config.name, producer=False).close()
        except SegmentNotFoundError:  # lazy-apps: no master made it
            create_wheel(config.name, capacity=config.capacity)
        run.run()
    except DriverRunningError as exc:
        # Another mule drives it.  Returning would only have uWSGI start
        # this mule again at once, so wait to be stopped.
        _log.error("shmwheel: %s; this mule stays idle", exc)
        while stopped_by is None:
            signal.pause()
        return
    except ShmwheelError as exc:
        _log.error("shmwheel: the driver failed: %s", exc)
        raise
    if _server_is_going(stopped_by, master):
        with contextlib.suppress(SegmentNotFoundError):
            unlink(config.name)
    else:
        _log.info("shmwheel: wheel %r kept for the mule or the master that comes next", config.name)


def _server_is_going(signum: int | None, master: int) -> bool:
    """Whether the signal that stopped the mule means uWSGI is going away.

    uWSGI tells a mule why it stops by the signal it sends: SIGINT when it
    shuts down (on SIGINT, SIGQUIT, or SIGTERM with die-on-term), SIGHUP
    or SIGTERM when it reloads, whether everything or the mules alone
    (touch-mules-reload).  On a reload something comes back for the wheel:
    a new mule takes it over, and a reloaded master replaces it; removing
    it would leave the workers holding a wheel nobody drives.  A master
    that has died (the mule is then someone else's child) comes back for
    nothing.
    """
    return signum in (signal.SIGINT, signal.SIGQUIT) or os.getppid() != master
