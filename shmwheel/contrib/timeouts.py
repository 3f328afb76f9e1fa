"""The request-timeout driver command: ``shmwheel timeouts NAME [--create]
[--kill] ...``, the same as ``python -m shmwheel.contrib.timeouts NAME ...``.

It drives a request-timeout wheel: for servers whose master does not run
the driver itself (the Gunicorn and uWSGI adapters do), under a process
manager, or beside any server whose workers use the WSGI or ASGI
middleware.  The public names of request timeouts are in
:mod:`shmwheel.contrib`; those this module used to hold still resolve
here, with a DeprecationWarning.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import grp
import logging
import os
import pwd
import signal
import stat
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from .._driver import Driver, dedicated_process
from .._errors import SegmentNotFoundError, ShmwheelError, one_line
from .._segment import SHM, bare_name, segment_name
from .._wheel import observe, unlink
from ._handler import TimeoutHandler
from ._logs import LogTarget
from ._metrics import serve_metrics
from ._settings import DEFAULT_INTERRUPT_GRACE, DEFAULT_KILL_AFTER, TimeoutActions
from ._supervisor import LOG_FORMAT, create_wheel, watch_parent, watch_use

__all__ = ["main"]

_log = logging.getLogger("shmwheel.timeouts")


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Drive a request-timeout wheel: log the requests that time out, have their workers write "
        "their stacks, and kill the workers if asked.",
    )
    p.add_argument("name", help="the wheel")
    p.add_argument(
        "--create",
        action="store_true",
        help="create the wheel, and remove it on exit unless processes still use it.  A sound wheel of that "
        "name that no driver runs on, of the same size and owner, is taken over with its timers (a restart); "
        "another one no driver runs on is replaced and the timers it holds are dropped, logged with their "
        "number; one whose driver runs, and a segment that is not a wheel this version reads (another "
        "program's), are left alone: an error",
    )
    p.add_argument("--parent", type=int, metavar="PID", help="stop, and remove the wheel, if process PID exits")
    p.add_argument(
        "--while-used",
        action="store_true",
        help="drive the wheel while processes use it: SIGTERM and SIGINT do not end it (a stopping server's "
        "workers still finish their requests); once no process has used the wheel for a moment it removes "
        "the wheel and exits.  What the ASGI middleware's workers start by themselves",
    )
    p.add_argument("--lock-fd", type=int, metavar="FD", help=argparse.SUPPRESS)  # the flock of AutoDriver
    LogTarget.add_arguments(p)
    p.add_argument("--no-log", dest="log", action="store_false", help="no WARNING line per timeout")
    p.add_argument(
        "--no-tracebacks",
        dest="tracebacks",
        action="store_false",
        help="do not ask workers for a timed-out request's stack (each worker's records name the signal to ask with)",
    )
    p.add_argument("--kill", action="store_true", help="signal the worker, then SIGKILL it")
    p.add_argument("--kill-signal", default="SIGTERM", metavar="SIG")
    p.add_argument("--kill-after", type=float, default=DEFAULT_KILL_AFTER, metavar="SECONDS")
    p.add_argument(
        "--interrupt-grace",
        type=float,
        default=DEFAULT_INTERRUPT_GRACE,
        metavar="SECONDS",
        help="how long a request its worker was asked to end (interrupt=True in the worker) has to end before "
        "it is logged and, with --kill, its worker signalled (default %(default)s)",
    )
    p.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve the driver's metrics there, on /metrics, in Prometheus's text format (shmwheel metrics NAME "
        "prints the same text)",
    )
    p.add_argument(
        "--route",
        action="append",
        metavar="ROUTE",
        help="a route the metrics count requests by, as the workers' routes name it ('/report', 'POST /upload'); "
        "again for each route.  Other requests count as route 'other'",
    )
    p.add_argument(
        "--user",
        type=_user,
        metavar="NAME|UID",
        help="started as root, run as this user (and --group, or the user's own group) from before the first fire: "
        "the workers' user.  With --create the wheel is made theirs",
    )
    p.add_argument("--group", type=_group, metavar="NAME|GID", help="the group that goes with --user")
    p.add_argument(
        "--allow-root",
        action="store_true",
        help="run as root on a wheel that another user can write (logged as a WARNING): whoever can write the "
        "wheel can then name processes for a root driver to signal",
    )
    return p


def _user(value: str) -> int:
    """--user: a user name or a uid."""
    return _id(value, "user", lambda name: pwd.getpwnam(name).pw_uid)


def _group(value: str) -> int:
    """--group: a group name or a gid."""
    return _id(value, "group", lambda name: grp.getgrnam(name).gr_gid)


def _id(value: str, what: str, lookup: Callable[[str], int]) -> int:
    if value.isdigit():
        return int(value)
    try:
        return lookup(value)
    except KeyError:
        raise argparse.ArgumentTypeError(f"no {what} named {value!r}") from None


def _target_ids(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[int, int] | None:
    """The (uid, gid) that --user and --group ask for, or None."""
    if args.user is None:
        if args.group is not None:
            parser.error("--group goes with --user")
        return None
    if args.group is not None:
        return args.user, args.group
    try:
        return args.user, pwd.getpwuid(args.user).pw_gid
    except KeyError:
        parser.error(f"uid {args.user} has no entry in the user database: give --group too")


def _become(uid: int, gid: int) -> None:
    """Run as ``uid``:``gid`` from now on, with no supplementary groups.

    Groups first and the uid last: setgroups and setgid need root, and
    setuid to another user gives it up for good (real, effective and saved
    uid alike), so nothing the driver later reads can take it back.  The
    driver needs no file but the wheel, which is the user's: no
    supplementary groups.
    """
    if (os.getresuid(), os.getresgid()) == ((uid,) * 3, (gid,) * 3):
        return  # already (a driver started by that user)
    if os.geteuid() != 0:
        raise PermissionError(
            errno.EPERM, f"--user needs root: this driver runs as uid {os.geteuid()}, not as uid {uid} already"
        )
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getresuid() != (uid,) * 3 or os.getresgid() != (gid,) * 3 or os.getgroups():
        raise PermissionError(errno.EPERM, f"could not become uid {uid}, gid {gid}")


def _other_writers(name: str) -> str | None:
    """Who besides root can write the wheel ``name`` (in words), or None: the
    users a root driver of it would take orders from."""
    try:
        st = os.stat(SHM / bare_name(name))
    except FileNotFoundError:
        return None  # the driver's attach says so
    who = []
    if st.st_uid != 0:  # an owner may chmod it whatever its mode says
        who.append(f"its owner (uid {st.st_uid})")
    if st.st_mode & stat.S_IWGRP:
        who.append(f"its group (gid {st.st_gid})")
    if st.st_mode & stat.S_IWOTH:
        who.append("every user")
    return " and ".join(who) or None


def main(argv: Sequence[str] | None = None, prog: str = "python -m shmwheel.contrib.timeouts") -> int:
    """Run the driver command; return the exit status.

    As ``shmwheel``'s command line does: a usage error is argparse's (exit
    status 2), any other error one line "PROG: ..." on
    stderr and exit status 1.
    """
    parser = _parser(prog)
    args = parser.parse_args(argv)
    try:
        segment_name(args.name)
        actions = TimeoutActions.from_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    target = _target_ids(parser, args)
    if args.while_used and (args.create or args.parent is not None):
        parser.error("--while-used goes with neither --create nor --parent: the wheel lives as long as its users")
    log_target = LogTarget.from_args(args)
    try:
        handler = logging.StreamHandler(sys.stderr) if log_target is None else log_target.handler()
    except OSError as exc:
        parser.error(f"--log-to: {one_line(exc)}")
    if log_target is None:
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    parent_gone = threading.Event()
    unused = threading.Event()
    owns = False
    if args.lock_fd is not None:
        os.set_inheritable(args.lock_fd, False)  # held by this process alone, for its whole life
    try:
        on_fire = TimeoutHandler(args.name, actions)
        if args.parent is not None:
            on_fire.spare(args.parent)  # the server's master
        driver = Driver(args.name, on_fire)
        if args.while_used:
            said: list[int] = []

            def stays(signum: int, frame: object) -> None:
                if not said:
                    said.append(signum)
                    _log.info(
                        "driver %d: %s: it stops by itself once no process uses wheel %r",
                        os.getpid(),
                        signal.Signals(signum).name,
                        args.name,
                    )

            signal.signal(signal.SIGTERM, stays)
            signal.signal(signal.SIGINT, stays)

            def idle(why: str, gone: bool) -> None:
                _log.info("driver %d: stopping: wheel %r is not used any more (%s)", os.getpid(), args.name, why)
                if not gone:
                    unused.set()  # to remove: nobody else will
                driver.stop()

            watch_use(args.name, idle)
        else:
            signal.signal(signal.SIGTERM, lambda *_: driver.stop())
            signal.signal(signal.SIGINT, lambda *_: driver.stop())
        if args.parent is not None:

            def orphaned() -> None:
                parent_gone.set()
                driver.stop()

            watch_parent(args.parent, orphaned)
        if args.create:
            create_wheel(args.name, owner=target)
            owns = True
        # Everything the driver needs is imported by now (a user's view of
        # the Python installation may be narrower than root's), and no fire
        # has been taken yet: from here on it acts as the workers' user.
        if target is not None:
            _become(*target)
            _log.info("driver %d: running as uid %d, gid %d", os.getpid(), *target)
        if os.geteuid() == 0 and (writers := _other_writers(args.name)):
            if not args.allow_root:
                raise PermissionError(
                    errno.EPERM,
                    f"wheel {args.name!r} can be written by {writers}, and a root driver would signal what they "
                    "name: run it as the workers' user (--user, --group), or pass --allow-root",
                )
            _log.warning(
                "driver %d: running as root on wheel %r, which %s can write (--allow-root): it signals only "
                "processes the kernel shows using the wheel, but whoever writes it can have it signal any of those",
                os.getpid(),
                args.name,
                writers,
            )
        dedicated_process()
        driver.run(on_ready=lambda: serve_metrics(args.name, actions))  # once it drives the wheel
    except (ShmwheelError, OSError, ValueError, TypeError) as exc:
        print(f"{parser.prog}: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        if parent_gone.is_set():
            _remove(args.name)  # the server that made the wheel is gone without removing it
        elif unused.is_set() or owns:
            _remove_unless_in_use(args.name)
    return 0


def _remove(name: str) -> None:
    with contextlib.suppress(SegmentNotFoundError):
        unlink(name)


def _remove_unless_in_use(name: str) -> None:
    """What ``--create`` does on the way out: remove the wheel, unless workers
    still use it.  A process manager restarts a driver while the server goes
    on; removing the wheel then would leave its workers one retry away from
    running without timeouts, and drop the timers of the requests in progress."""
    try:
        with observe(name) as wheel:
            users = [p.pid for p in wheel.producers() if p.alive is not False and p.pid != os.getpid()]
    except SegmentNotFoundError:
        return
    except (ShmwheelError, OSError) as exc:
        _log.warning("wheel %r: not removed (%s)", name, one_line(exc))
        return
    if users:
        _log.info(
            "wheel %r: kept for the next driver: %d process%s still use%s it (pid %s)",
            name,
            len(users),
            "es" if len(users) != 1 else "",
            "" if len(users) != 1 else "s",
            ", ".join(map(str, users[:5])) + (", ..." if len(users) > 5 else ""),
        )
        return
    _remove(name)


if __name__ == "__main__":
    sys.exit(main())


def __getattr__(name: str) -> Any:
    package = sys.modules["shmwheel.contrib"]
    if name not in package.__all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"import {name} from shmwheel.contrib, not shmwheel.contrib.timeouts, which is the driver command",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(package, name)
