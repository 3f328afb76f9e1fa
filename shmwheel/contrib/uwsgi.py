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
``shmwheel-tracebacks``     ``false``: no stack of a timed-out request
                            (default ``true``)
``shmwheel-traceback-signal``  the signal a worker writes it on (default
                            ``URG``)
``shmwheel-warn-after``     seconds after which a request's stack is
                            logged, and it runs on (default: none)
``shmwheel-interrupt``      ``true``: end a request at its timeout, with
                            a 504, rather than only log it (default
                            ``false``)
``shmwheel-interrupt-grace``  seconds an interrupted request has to end
                            before the kill stage (default 1)
``shmwheel-route``          ``[METHOD] PATH SECONDS``, or ``none`` for no
                            timeout; once a route (a path covers what lies
                            below it; the longest that covers wins)
``shmwheel-on-timeout``     ``module:function``, called in the worker with
                            the request record and its stack at its timeout
``shmwheel-x-request-start``  ``true``: count a request's time from the
                            proxy's ``X-Request-Start`` header
``shmwheel-log``            ``false``: no log line per timeout
``shmwheel-name``           the wheel (default ``uwsgi-<master pid>``)
``shmwheel-capacity``       requests in progress at once (default 65536)
``shmwheel-metrics``        ``HOST:PORT``: the mule serves the metrics there,
                            on ``/metrics`` (Prometheus's text format)
==========================  =================================================

The master creates the wheel when it loads the application (each worker
attaches right after it is forked, in a postfork hook, and registers the
traceback signal then); the mule drives it, and uWSGI restarts the
mule if it dies or is reloaded, which takes the same wheel over.  The
master leaves a small process behind that removes the wheel once the
master has exited, however it exits: a shutdown, whichever of uWSGI's
processes the signal reached, or a master killed outright.  A reload of
the whole server keeps the master's pid (it re-executes itself), and the
reloaded master takes the wheel over.  Without the mule line, the master
logs an ERROR at start-up: no timeout would fire.  With ``uid``/``gid``
and ``drop-after-apps`` or ``master-as-root``, the master makes the wheel
as root and gives it to that user and group; by default uWSGI has dropped
to them before it loads the application.  With ``lazy-apps`` the mule
creates the wheel instead, and leaves the same process behind to remove it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import select
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

from .._checks import check_seconds
from .._driver import Driver
from .._errors import DriverRunningError, SegmentNotFoundError, ShmwheelError
from .._process import alive, start_time
from .._wheel import observe, unlink
from ._handler import TimeoutHandler
from ._metrics import serve_metrics
from ._record import DEFAULT_TRACEBACK_SIGNAL, check_traceback_signal
from ._settings import DEFAULT_CAPACITY, DEFAULT_INTERRUPT_GRACE, DEFAULT_KILL_AFTER, TimeoutActions, TimeoutSettings
from ._stacks import writes_somewhere
from ._supervisor import LOG_FORMAT, create_wheel, watch_parent
from .wsgi import TimeoutMiddleware, WSGIApp

__all__ = ["driver", "request_timeouts"]

_log = logging.getLogger("shmwheel.timeouts")

_PREFIX = "shmwheel-"
_DRIVER = "shmwheel.contrib.uwsgi:driver"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class Options:
    """The ``shmwheel-*`` options of a uWSGI config."""

    name: str
    #: Every request's, and the driver's actions; ``on_timeout`` left out:
    #: the function is imported where requests are served, never in the mule.
    timeouts: TimeoutSettings
    on_timeout: str | None = None  # module:function


def _text(value: object) -> str:
    if value is True:  # a bare flag
        return "true"
    return value.decode() if isinstance(value, bytes) else str(value)


def _option(opts: Mapping[str, Any], key: str, prefix: str = _PREFIX) -> str | None:
    value = opts.get(prefix + key)
    if isinstance(value, list):  # given more than once: the last one counts
        value = value[-1]
    return None if value is None else _text(value)


def repeated(opts: Mapping[str, Any], key: str) -> list[str]:
    """Every value of option ``key``, in the order given: uWSGI repeats an
    option by giving it again (``shmwheel-route``, ``mule``).

    ``uwsgi.opt`` lists them where uWSGI's Python plugin builds the list,
    but uWSGI 2.0 on Python 3 keeps only the last (it looks a key up as
    bytes and stores it as str), so the lines of ``key`` are read again
    from the ini files uWSGI was given (:func:`_complete` says when they
    can be trusted).  Where they cannot, only uWSGI's own value counts, and
    a WARNING, once, says what may be left out."""
    values, complete = _complete(opts, key)
    if not complete and key not in _warned:
        _warned.add(key)  # once a server: its workers and mules are forked from the master that said it
        _report(
            logging.WARNING,
            "shmwheel: uWSGI hands the application only the last %r of its config (uWSGI 2.0 under Python 3), "
            "and shmwheel cannot read the others back from an ini file it was given (%s): only %r applies",
            key,
            _why_incomplete(opts, key),
            values[-1],
        )
    return values


_warned: set[str] = set()
# What makes an ini file's lines differ from what uWSGI made of them: its
# config logic (if-env, for, ...) and its placeholders and magic variables.
_LOGIC = re.compile(r"(?:if-[\w-]+|for(?:-[\w-]+)?|else|endif|endfor|end)$")
_EXPANDS = ("%", "$(", "@(", "{{")
_MAX_INI = 1 << 20  # bytes of an ini file read back: a config, not a data file


def _complete(opts: Mapping[str, Any], key: str) -> tuple[list[str], bool]:
    """``key``'s values, and whether they are all of them: uWSGI's list; or
    the lines of the ini files uWSGI read, where none is inside its config
    logic or holds a placeholder, and the last is the value uWSGI has; or
    uWSGI's one value where no ini file has more than one such line."""
    given = opts.get(key)
    if isinstance(given, list):
        return [_text(value) for value in given], True
    if given is None:
        return [], True
    last = _text(given)
    found, plain = _ini_lines(opts, key)
    if plain and found and found[-1] == last:
        return found, True
    return [last], False


def _why_incomplete(opts: Mapping[str, Any], key: str) -> str:
    if opts.get("ini") is None:
        return "this config is not an ini file"
    found, plain = _ini_lines(opts, key)
    if not found:
        return "none of its lines is in the ini file as shmwheel reads it"
    if not plain:
        return "its lines use uWSGI's config logic or placeholders, which shmwheel does not expand"
    return f"the ini file's last reads {found[-1]!r}"


def _ini_lines(opts: Mapping[str, Any], key: str) -> tuple[list[str], bool]:
    """The values of ``key`` in the ini files uWSGI read (``--ini FILE`` or
    ``FILE:SECTION``), as its ini parser reads them: the lines ``key =
    value`` of the section (``[uwsgi]`` by default), ``;`` and ``#``
    beginning comments; and whether the section is plain: no config logic,
    and no placeholder in those lines."""
    inis = opts.get("ini")
    values: list[str] = []
    plain = True
    for given in inis if isinstance(inis, list) else [] if inis is None else [inis]:
        path, section = _text(given), "uwsgi"
        head, colon, tail = path.rpartition(":")
        if colon and head and "/" not in tail:
            path, section = head, tail
        here = None
        for line in _read_ini(path).splitlines():
            line = line.strip()
            if not line or line[0] in ";#":
                continue
            if line.startswith("["):
                here = line[1:].partition("]")[0].strip()
            elif here == section and "=" in line:
                name, _, value = line.partition("=")
                name, value = name.strip(), value.strip()
                if _LOGIC.match(name):
                    plain = False
                elif name == key:
                    values.append(value)
                    plain = plain and not any(mark in value for mark in _EXPANDS)
    return values, plain


def _read_ini(path: str) -> str:
    """An ini file uWSGI was given, read where it was: a relative path from
    the directory uWSGI started in (its ``chdir`` may have moved it since),
    else as given.  Only a regular file, and only its first MiB."""
    candidates = [path]
    if not os.path.isabs(path) and os.environ.get("PWD"):
        candidates.insert(0, os.path.join(os.environ["PWD"], path))
    for candidate in candidates:
        try:
            fd = os.open(candidate, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return os.read(fd, _MAX_INI).decode("utf-8", errors="replace")
        except OSError:
            pass
        finally:
            os.close(fd)
    return ""


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


def _routes(opts: Mapping[str, Any]) -> dict[str, float | None] | None:
    """``shmwheel-route = [METHOD] PATH SECONDS|none``, once a route."""
    given = repeated(opts, _PREFIX + "route")
    if not given:
        return None
    routes: dict[str, float | None] = {}
    for text in given:
        key, _, seconds = text.strip().rpartition(" ")
        if not key:
            raise ValueError(f"{_PREFIX}route must be '[METHOD] PATH SECONDS' or '[METHOD] PATH none', not {text!r}")
        try:
            routes[key.strip()] = None if seconds.lower() == "none" else float(seconds)
        except ValueError:
            raise ValueError(f"{_PREFIX}route {text!r}: {seconds!r} is not a number of seconds, or none") from None
    return routes


def on_timeout_hook(spec: str | None) -> Any:
    """The function ``module:function`` names (``shmwheel-on-timeout``), or None."""
    if spec is None:
        return None
    module, _, function = spec.partition(":")
    if not module or not function:
        raise ValueError(f"shmwheel: {_PREFIX}on-timeout must be module:function, not {spec!r}")
    import importlib

    try:
        hook = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"shmwheel: {_PREFIX}on-timeout {spec!r}: {exc}") from None
    return hook


def read_options(opts: Mapping[str, Any], master_pid: int) -> Options:
    """Read the ``shmwheel-*`` options (``uwsgi.opt``); ValueError names a bad one."""
    try:
        on_timeout = _option(opts, "on-timeout")
        timeouts = TimeoutSettings(
            check_seconds(_number(opts, "timeout", None), f"{_PREFIX}timeout", positive=True),
            warn_after=_number(opts, "warn-after", 0.0) or None,
            interrupt=_flag(opts, "interrupt", False),
            routes=_routes(opts),
            x_request_start=_flag(opts, "x-request-start", False),
            traceback_signal=check_traceback_signal(
                _option(opts, "traceback-signal") or DEFAULT_TRACEBACK_SIGNAL, f"{_PREFIX}traceback-signal"
            ),
            capacity=_number(opts, "capacity", DEFAULT_CAPACITY, int),
            actions=TimeoutActions(
                log=_flag(opts, "log", True),
                tracebacks=_flag(opts, "tracebacks", True),
                kill=_flag(opts, "kill", False),
                kill_signal=_option(opts, "kill-signal") or signal.SIGTERM,  # type: ignore[arg-type]
                kill_after=_number(opts, "kill-after", DEFAULT_KILL_AFTER),
                interrupt_grace=_number(opts, "interrupt-grace", DEFAULT_INTERRUPT_GRACE),
                metrics=_option(opts, "metrics"),
            ),
        )
        return Options(name=_option(opts, "name") or f"uwsgi-{master_pid}", timeouts=timeouts, on_timeout=on_timeout)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"shmwheel: {exc}") from None


def _uwsgi() -> Any:
    try:
        import uwsgi  # exists only in processes that uWSGI runs
    except ImportError:
        raise RuntimeError("shmwheel.contrib.uwsgi works only in a process that uWSGI runs") from None
    return uwsgi


def _options() -> Options:
    uwsgi = _uwsgi()
    return read_options(uwsgi.opt, uwsgi.masterpid())


_created: set[str] = set()  # wheels this master has created (an app may be wrapped twice)


def request_timeouts(app: WSGIApp) -> WSGIApp:
    """Wrap the application: every request gets the timeout the config sets
    (a :class:`~shmwheel.contrib.wsgi.TimeoutMiddleware`, called the way
    its ``direct()`` gives)."""
    uwsgi = _uwsgi()
    config = _options()
    in_master = os.getpid() == uwsgi.masterpid()
    mules, every_mule = _complete(uwsgi.opt, "mule")
    # Once: in the master, or with lazy-apps (no app in the master) in worker 1.  Where
    # uWSGI shows the last mule only, the driver may be another: nothing is said.
    if _DRIVER not in mules and every_mule and (in_master or uwsgi.worker_id() == 1) and config.name not in _created:
        _report(
            logging.ERROR,
            "shmwheel: no driver runs on wheel %r, so request timeouts will never fire: "
            "add 'mule = %s' to the uWSGI config",
            config.name,
            _DRIVER,
        )
    if in_master and config.name not in _created:
        owner = _workers_owner(uwsgi.opt)
        create_wheel(config.name, capacity=config.timeouts.capacity, owner=owner)
        _created.add(config.name)
        _remove_when_master_exits(config.name, os.getpid(), owner)
    elif not in_master:
        _created.add(config.name)  # reported once
    timeouts = config.timeouts
    if config.on_timeout is not None:
        timeouts = dataclasses.replace(timeouts, on_timeout=on_timeout_hook(config.on_timeout))
    middleware = TimeoutMiddleware.of(app, config.name, timeouts)

    def after_fork() -> None:
        if uwsgi.worker_id() > 0:  # a worker, not a mule
            middleware.timer.prepare()

    import uwsgidecorators  # ships with uWSGI

    uwsgidecorators.postfork(after_fork)
    return middleware.direct()


def _report(level: int, msg: str, *args: object) -> None:
    """Log from the master, in uWSGI's log (its stderr).

    The master runs the application's code, so this module leaves its
    logging configuration alone: the line goes through it if the
    application set one up, otherwise straight to stderr in the mule's
    format (the package's own NullHandler would swallow it).
    """
    if writes_somewhere(_log):
        _log.log(level, msg, *args)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    if _log.isEnabledFor(level):
        handler.handle(_log.makeRecord(_log.name, level, __file__, 0, msg, args, None))


def _workers_owner(opts: Mapping[str, Any]) -> tuple[int, int] | None:
    """The (uid, gid) uWSGI's ``uid`` and ``gid`` options drop to, if this
    process is root and will drop to them after it has made the wheel
    (``drop-after-apps``, ``master-as-root``); None if it makes the wheel as
    the workers' user already (uWSGI drops privileges before it loads the
    application unless told otherwise).  -1 for one that is not set, as
    uWSGI then leaves it as it is."""
    if os.geteuid() != 0:
        return None
    uid_name, gid_name = _option(opts, "uid", prefix=""), _option(opts, "gid", prefix="")
    if uid_name is None and gid_name is None:
        return None
    import grp
    import pwd

    try:
        uid = -1 if uid_name is None else int(uid_name) if uid_name.isdigit() else pwd.getpwnam(uid_name).pw_uid
        gid = -1 if gid_name is None else int(gid_name) if gid_name.isdigit() else grp.getgrnam(gid_name).gr_gid
    except KeyError as exc:
        raise ValueError(f"shmwheel: the uWSGI config names a user or group that does not exist: {exc}") from None
    return uid, gid


# The remover of a wheel, as "pid:start time:wheel", in the environment of
# the master that made it: a reload re-executes the master (same pid, same
# environment), and its new image finds the remover still there.
_REMOVER = "SHMWHEEL_UWSGI_REMOVER"
# What a remover must survive: the signals that stop uWSGI, sent to its
# whole process group (systemd, timeout(1), Ctrl-C), and those that would
# run the master's own handlers, which a forked child inherits.
_REMOVER_IGNORES = frozenset(
    {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTSTP}
)


def _remover_of(name: str) -> int | None:
    """The pid of the live remover of wheel ``name`` this master set up, if any."""
    pid, _, rest = os.environ.get(_REMOVER, "").partition(":")
    start, _, wheel = rest.partition(":")
    if wheel == name and pid.isdigit() and start.isdigit() and alive(int(pid), int(start)):
        return int(pid)
    return None


def _remove_when_master_exits(name: str, master: int, owner: tuple[int, int] | None = None) -> None:
    """Leave a process behind that removes wheel ``name`` once the master,
    this process or (with lazy-apps, where the mule makes the wheel) its
    parent, has exited, however it does.

    Only the master knows that uWSGI is going: it exits on a shutdown and
    re-executes itself, keeping its pid, on a reload, while the signals its
    mule gets say neither (a signal to the whole process group reaches the
    mule directly, and a graceful shutdown sends the same SIGHUP as a
    reload).  No code of ours runs when the master exits: it is C that
    calls exit(), and uWSGI runs no Python exit hook in the master.  So a
    child of the master waits on a pidfd for the master's end (an exec is
    not one), ignoring the signals meant for uWSGI, and removes the wheel:
    after a shutdown, a master killed outright, or a re-execution that
    failed.  It holds no descriptor of the master's but the standard ones,
    and runs as ``owner``, the workers' user, if the master is root yet.
    """
    if _remover_of(name) is not None:
        return
    master_start = start_time(master) or 0
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _REMOVER_IGNORES)  # until the child ignores them
    try:
        pid = os.fork()
        if pid == 0:
            _remover(name, master, master_start, blocked, owner)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.environ[_REMOVER] = f"{pid}:{start_time(pid) or 0}:{name}"


def _remover(
    name: str, master: int, master_start: int, mask: set[int | signal.Signals], owner: tuple[int, int] | None
) -> NoReturn:
    status = 0
    try:
        for signum in _REMOVER_IGNORES:
            signal.signal(signum, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the listening socket above all
        # In ps and top, not a second "uwsgi" master (a process whose uid has
        # changed since it was started, as uWSGI's has, may not rename itself).
        with contextlib.suppress(OSError), open("/proc/self/comm", "w") as comm:
            comm.write("shmwheel-remove")
        if owner is not None:  # no root process left behind by a server that drops privileges
            os.setgroups([])
            if owner[1] != -1:
                os.setgid(owner[1])
            if owner[0] != -1:
                os.setuid(owner[0])
        _wait_for_exit(master, master_start)
        with contextlib.suppress(SegmentNotFoundError):
            unlink(name)
    except BaseException as exc:  # noqa: BLE001 - one line in the log, and out
        with contextlib.suppress(BaseException):
            print(f"shmwheel: wheel {name!r} outlived uWSGI: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        os._exit(status)  # neither uWSGI's exit hooks nor the interpreter's: they are the master's


def driver() -> None:
    """The mule: ``mule = shmwheel.contrib.uwsgi:driver``."""
    uwsgi = _uwsgi()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=LOG_FORMAT)
    config = _options()
    run = Driver(config.name, TimeoutHandler(config.name, config.timeouts.actions))
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
    watch_parent(master, lambda: signal.pthread_kill(main, signal.SIGTERM))
    try:
        try:
            observe(config.name).close()
        except SegmentNotFoundError:  # lazy-apps: no master made it
            create_wheel(config.name, capacity=config.timeouts.capacity)
            _remove_when_master_exits(config.name, master)
        run.run(on_ready=lambda: serve_metrics(config.name, config.timeouts.actions))
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
    # Whatever stopped it - a reload of the mule or of the whole server, a
    # shutdown, a signal to the whole process group - the wheel stays: the
    # next mule takes it over, and the process left to remove it when the
    # master exits does so.  The signal alone cannot tell a shutdown from a
    # reload (a graceful shutdown sends the same SIGHUP).
    _log.info("shmwheel: wheel %r kept; it goes when the uWSGI master exits", config.name)


def _wait_for_exit(pid: int, start: int) -> None:
    """Return once process ``pid``, which started at ``start``, has exited
    (an exec is not an exit).  Through a pidfd, which names one process for
    good; kernels without one (before 5.3) get the start time polled."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        while alive(pid, start):
            time.sleep(0.5)
        return
    try:
        if alive(pid, start):  # not a process that took the pid over meanwhile
            select.select([fd], [], [])
    finally:
        os.close(fd)
