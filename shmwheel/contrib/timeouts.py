"""Per-request timeouts: the worker's side, the driver's side, and a supervisor.

A worker adds one timer per request, carrying a *request record* (who is
running what since when), and cancels it when the response is done.  The
timers of all workers live in one wheel; one driver process fires the
ones that come due and hands each to :class:`TimeoutHandler`, which acts on
the worker, because a worker stuck in a request cannot act for itself:

1. a WARNING log line with the method, path, request id, worker pid and
   how long the request has been running;
2. optionally a dump of the worker's Python tracebacks: the worker has
   :mod:`faulthandler` registered on ``traceback_signal``, which dumps
   every thread's stack to the worker's stderr from inside its signal
   handler, whatever the worker is blocked in;
3. optionally ``kill_signal`` (graceful: the worker may finish up), then,
   ``kill_after`` seconds later if the same process is still there,
   SIGKILL.  The SIGKILL is itself a timer in the wheel.

A process is signalled only if it is still the one that added the timer:
the record carries the worker's pid *and* its start time, the handler opens
a pidfd for the pid, checks the start time, and signals through the pidfd,
so a pid reused in the meantime is never hit, not even in the gap between
the check and the signal.

Who can write a wheel is who its driver trusts: anyone who can write it
can put a record there.  So the driver believes no record on its word.
Before any signal it checks that the process named is one of this wheel's
own workers: a live process in the wheel's producer table (pid and start
time), the one that added the timer (``Fire.owner_pid``, which the C core
writes, not the record; a SIGKILL or kill_signal follow-up must have been
added by this driver process), and one that runs as the driver's own
effective uid (its real or saved uid), which is the kernel's rule for a
sender without privileges.  Otherwise it logs one WARNING line and signals
nothing.  A server that starts as root and runs its workers as another user
hands the wheel to that user and runs the driver as that user too
(``DriverSupervisor(owner=...)``, ``--user``/``--group``): the driver can
then signal exactly what the workers could signal each other.  The
command refuses to run as root on a wheel that another user can write
unless told ``--allow-root``.

The request record is a 24-byte head then the method, the request id and
the path (little-endian)::

    offset  size  field
         0     1  kind: 1 request, 2 the SIGKILL that follows kill_signal,
                  3 the kill_signal that follows a traceback dump
         1     1  method length in bytes
         2     1  request id length in bytes
         3     1  flags: bit 0 set if the path was cut to fit
         4     4  worker pid
         8     8  worker start time, clock ticks since boot (/proc/PID/stat)
        16     8  request start, time.monotonic_ns()
        24     -  method, request id, path (UTF-8, the path cut to fit)
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import faulthandler
import grp
import itertools
import logging
import math
import os
import pwd
import re
import select
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._checks import check_owner
from .._driver import Driver, dedicated_process
from .._errors import (
    CorruptSegmentError,
    DriverRunningError,
    DriverStartError,
    SegmentExistsError,
    SegmentNotFoundError,
    SegmentRemovedError,
    ShmwheelError,
    one_line,
)
from .._process import alive, start_time, uids
from .._records import Fire, WheelStats
from .._segment import SHM, bare_name, segment_name, wheel_stat
from .._wheel import Wheel, attach, create, observe, unlink

__all__ = [
    "DEFAULT_CAPACITY",
    "PAYLOAD_SIZE",
    "DriverSupervisor",
    "RequestRecord",
    "RequestTimer",
    "TimeoutActions",
    "TimeoutHandler",
    "create_wheel",
    "decode_request",
    "encode_request",
    "signal_process",
]

_log = logging.getLogger("shmwheel.timeouts")

#: Timers a request-timeout wheel holds: one per request in progress.
DEFAULT_CAPACITY = 65_536
#: Bytes of request record per timer: room for a path of about 200 bytes.
PAYLOAD_SIZE = 256

KIND_REQUEST = 1
KIND_KILL = 2
KIND_GRACEFUL = 3
_TRUNCATED = 1
_LOOK_INTERVAL_NS = 1_000_000_000  # how often a worker checks that its wheel's name still names it
_KEEP_OLD = 2  # wheels replaced under a worker that it keeps open for the cancels of their requests
_HEAD = struct.Struct("<BBBBIQq")
_MAX_METHOD = 32
_MAX_REQUEST_ID = 64
# What a request id taken from a client header may hold: it is written into
# log lines, so nothing that could forge one.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,64}")

#: faulthandler's signal.  SIGURG is ignored by default, so a dump request
#: that reaches a process without faulthandler registered on it does no harm,
#: and neither Gunicorn nor uWSGI gives it a meaning in a worker.
DEFAULT_TRACEBACK_SIGNAL = signal.SIGURG
#: How long a worker may take to go after kill_signal before SIGKILL.
DEFAULT_KILL_AFTER = 5.0
#: Seconds from the traceback signal to kill_signal: time for the dump.
DUMP_TIME = 0.25


# -- the request record --------------------------------------------------------


class RequestRecord(NamedTuple):
    """A request record, decoded."""

    kind: int
    pid: int  #: the worker
    start: int  #: the worker's start time (with the pid, its identity)
    started_ns: int  #: when the request started, time.monotonic_ns()
    method: str
    request_id: str
    path: str
    truncated: bool  #: the path was cut to fit the payload

    def running_for(self, now_ns: int | None = None) -> float:
        """Seconds since the request started."""
        return ((time.monotonic_ns() if now_ns is None else now_ns) - self.started_ns) / 1e9

    def describe(self) -> str:
        """``GET /path (request ID, worker pid N)``, for log lines."""
        path = self.path + ("..." if self.truncated else "")
        return f"{self.method} {path} (request {self.request_id}, worker pid {self.pid})"


def encode_request(
    kind: int,
    pid: int,
    start: int,
    started_ns: int,
    method: str,
    request_id: str,
    path: str,
    size: int = PAYLOAD_SIZE,
) -> bytes:
    """A request record of at most ``size`` bytes: the path is cut to fit."""
    m = method.encode("ascii", "replace")[:_MAX_METHOD]
    r = request_id.encode("ascii", "replace")[:_MAX_REQUEST_ID]
    p = path.encode("utf-8", "surrogateescape")
    room = size - _HEAD.size - len(m) - len(r)
    if room < 0:
        raise ValueError(f"a payload of {size} bytes has no room for a request record")
    flags = 0
    if len(p) > room:
        p = p[:room]
        flags |= _TRUNCATED
    return _HEAD.pack(kind, len(m), len(r), flags, pid, start, started_ns) + m + r + p


def decode_request(payload: bytes) -> RequestRecord | None:
    """The record in a timer's payload, or None if it holds none."""
    if len(payload) < _HEAD.size:
        return None
    kind, m_len, r_len, flags, pid, start, started_ns = _HEAD.unpack_from(payload)
    if kind not in (KIND_REQUEST, KIND_KILL, KIND_GRACEFUL) or _HEAD.size + m_len + r_len > len(payload):
        return None
    at = _HEAD.size
    method = payload[at : at + m_len].decode("ascii", "replace")
    at += m_len
    request_id = payload[at : at + r_len].decode("ascii", "replace")
    at += r_len
    path = payload[at:].decode("utf-8", "replace")
    return RequestRecord(kind, pid, start, started_ns, method, request_id, path, bool(flags & _TRUNCATED))


# -- acting on a worker --------------------------------------------------------


def signal_process(pid: int, start: int, signum: int) -> bool:
    """Send ``signum`` to ``pid`` if it is still the process that started at
    ``start``; return whether it was sent.

    Through a pidfd: once open it names one process for good, so checking
    the start time after opening it and signalling through it leaves no
    window in which the pid could be reused.  Kernels without pidfds
    (before 5.3) get a check and a kill(2), with that window.
    """
    return _signal_if(pid, start, signum, None)


def _signal_if(pid: int, start: int, signum: int, may: Callable[[], bool] | None) -> bool:
    """signal_process(), asking ``may()`` too once the process is known to be
    the one that started at ``start``, right before the signal."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        if not alive(pid, start) or (may is not None and not may()):
            return False
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        return True
    try:
        if not alive(pid, start) or (may is not None and not may()):
            return False
        signal.pidfd_send_signal(fd, signum)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def _uid_refusal(pid: int) -> str | None:
    """Why this process may not signal ``pid`` by the uid rule, or None if it may.

    The rule is the kernel's for a sender without privileges: the target's
    real or saved uid is the sender's effective uid.  Applied here to a
    driver that runs as root too, so that root signals only root's
    processes: a root driver whose workers are another user's has been
    set up wrong, and says so instead of acting as root on their records.
    """
    me = os.geteuid()
    ids = uids(pid)
    if ids is None:
        return None  # gone: the signal through the pidfd finds nothing to hit
    real, _, saved = ids
    if me in (real, saved):
        return None
    return (
        f"pid {pid} runs as uid {real} and this driver as uid {me}: a driver signals only processes of "
        "its own uid (run it as the workers' user)"
    )


def _signal_number(value: object, what: str) -> signal.Signals:
    """A signal from a number, a Signals member or a name ("TERM", "SIGTERM")."""
    if isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"{what}: no signal named {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a signal number or name, not {type(value).__name__}")
    try:
        return signal.Signals(value)
    except ValueError:
        raise ValueError(f"{what}: {value} is not a signal number") from None


def _seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds, not {value}")
    return value


@dataclass(frozen=True)
class TimeoutActions:
    """What the driver does when a request's timer fires (see the module docs)."""

    log: bool = True  #: the WARNING line
    tracebacks: bool = True  #: signal the worker to dump its Python stacks
    traceback_signal: int = DEFAULT_TRACEBACK_SIGNAL
    kill: bool = False  #: kill_signal, then SIGKILL after kill_after
    kill_signal: int = signal.SIGTERM
    kill_after: float = DEFAULT_KILL_AFTER

    def __post_init__(self) -> None:
        for flag in ("log", "tracebacks", "kill"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"{flag} must be True or False, not {getattr(self, flag)!r}")
        object.__setattr__(self, "traceback_signal", _signal_number(self.traceback_signal, "traceback_signal"))
        object.__setattr__(self, "kill_signal", _signal_number(self.kill_signal, "kill_signal"))
        object.__setattr__(self, "kill_after", _seconds(self.kill_after, "kill_after"))
        if self.tracebacks and self.traceback_signal in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError("traceback_signal cannot be SIGKILL or SIGSTOP: no handler can catch it")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TimeoutActions:
        """The settings parsed from the arguments :meth:`as_args` makes."""
        return cls(
            log=args.log,
            tracebacks=args.tracebacks,
            traceback_signal=args.traceback_signal,
            kill=args.kill,
            kill_signal=args.kill_signal,
            kill_after=args.kill_after,
        )

    def as_args(self) -> list[str]:
        """The same settings as command-line arguments of ``python -m shmwheel.contrib.timeouts``."""
        args = [
            f"--traceback-signal={signal.Signals(self.traceback_signal).name}",
            f"--kill-signal={signal.Signals(self.kill_signal).name}",
            f"--kill-after={self.kill_after!r}",
        ]
        if not self.log:
            args.append("--no-log")
        if not self.tracebacks:
            args.append("--no-tracebacks")
        if self.kill:
            args.append("--kill")
        return args


_FOLLOW_UPS = {KIND_KILL: "SIGKILL", KIND_GRACEFUL: "kill_signal"}


class TimeoutHandler:
    """The driver's handler for a request-timeout wheel: ``Driver(name, TimeoutHandler(name, actions))``.

    It signals only this wheel's own workers (see the module docs): a
    record that names any other process is logged, in one WARNING line
    saying why, and nothing is signalled.
    """

    #: Seconds a reading of the producer table is used for other fires; a
    #: process not found in it is looked for in a fresh reading.
    PRODUCERS_TTL = 1.0

    def __init__(self, name: str, actions: TimeoutActions | None = None) -> None:
        segment_name(name)
        self.name = name
        self.actions = actions or TimeoutActions()
        self._wheel: Wheel | None = None  # for the follow-up timers and the producer table, opened on first need
        self._producers: dict[int, int] = {}  # pid: start time of the live producers, as last read
        self._producers_read = -math.inf

    def __reduce__(self) -> tuple[Any, ...]:
        return (TimeoutHandler, (self.name, self.actions))

    def __call__(self, fire: Fire) -> None:
        record = decode_request(fire.payload)
        if record is None:
            _log.warning("timer %d carries no request record: payload %r", fire.handle, fire.payload[:64])
            return
        there = alive(record.pid, record.start)
        if there:
            why = self._refusal(fire, record)
            if why is not None:
                self._refuse(fire, record, why)
                return
        if record.kind in _FOLLOW_UPS:
            if there:
                if record.kind == KIND_KILL:
                    self._sigkill(fire, record)
                else:
                    self._graceful(fire, record)
            return
        actions = self.actions
        if actions.log:
            # One line, written before the worker is signalled, so that it
            # comes ahead of the tracebacks the worker writes.
            if not there:
                then = "; the worker has exited"
            else:
                steps = ["dumping its tracebacks"] if actions.tracebacks else []
                if actions.kill:
                    name = signal.Signals(actions.kill_signal).name
                    steps.append(f"sending it {name}, then SIGKILL in {actions.kill_after:g} s")
                then = "; " + ", ".join(steps) if steps else ""
            _log.warning(
                "request timed out: %s, running for %.3f s%s%s",
                record.describe(),
                record.running_for(),
                " (redelivered after a driver restart)" if fire.redelivered else "",
                then,
            )
        if not there:
            return
        if actions.tracebacks:
            if not self._signal(fire, record, actions.traceback_signal):
                return
            if actions.kill:
                # The dump runs in the worker's signal handler; a kill_signal
                # that lands before it is done can end the worker mid-dump
                # (uWSGI's SIGTERM exits at once), so it follows a little later.
                self._later(DUMP_TIME, KIND_GRACEFUL, fire.payload)
        elif actions.kill:
            self._graceful(fire, record)

    def _open(self) -> Wheel:
        if self._wheel is None:
            self._wheel = attach(self.name)
        return self._wheel

    def _later(self, delay: float, kind: int, payload: bytes) -> None:
        """A timer of this wheel that will bring the record back as ``kind``."""
        self._open().add(delay, bytes([kind]) + payload[1:])

    def _graceful(self, fire: Fire, record: RequestRecord) -> None:
        if self._signal(fire, record, self.actions.kill_signal):
            self._later(self.actions.kill_after, KIND_KILL, fire.payload)

    def _sigkill(self, fire: Fire, record: RequestRecord) -> None:
        if self._signal(fire, record, signal.SIGKILL):
            _log.error(
                "killed worker pid %d with SIGKILL: %s had run for %.3f s and it ignored %s",
                record.pid,
                record.describe(),
                record.running_for(),
                signal.Signals(self.actions.kill_signal).name,
            )

    def _signal(self, fire: Fire, record: RequestRecord, signum: int) -> bool:
        """``signum`` to the record's worker, if it is still there and still
        passes the uid rule right before the signal; whether it was sent."""

        def may() -> bool:
            why = _uid_refusal(record.pid)
            if why is not None:
                self._refuse(fire, record, why)
            return why is None

        return _signal_if(record.pid, record.start, signum, may)

    def _refusal(self, fire: Fire, record: RequestRecord) -> str | None:
        """Why the live process a record names is not one this driver may
        signal for it, or None if it is."""
        if record.kind in _FOLLOW_UPS:
            # Only this driver adds follow-ups, so only its own count; one
            # an earlier driver left (it died or was restarted within the
            # wait) is not told from a forgery, and is not acted on.
            me = os.getpid()
            if fire.owner_pid != me:
                what = _FOLLOW_UPS[record.kind]
                return (
                    f"its {what} follow-up was added by pid {fire.owner_pid}, and only this driver's (pid {me}) count"
                )
        elif fire.owner_pid != record.pid:
            return f"the timer was added by pid {fire.owner_pid}, not by the worker it names"
        if not self._is_producer(record.pid, record.start):
            return f"pid {record.pid} is not a process attached to wheel {self.name!r}"
        return _uid_refusal(record.pid)

    def _is_producer(self, pid: int, start: int) -> bool:
        """Whether (pid, start) is a live producer of the wheel: from the
        last reading of the table if it is recent and has it, else from a
        fresh one, so that a miss is never the answer of stale data."""
        if time.monotonic() - self._producers_read < self.PRODUCERS_TTL and self._producers.get(pid) == start:
            return True
        self._producers_read = time.monotonic()
        self._producers = {p: s for p, s, live in self._open().producers() if live}
        return self._producers.get(pid) == start

    def _refuse(self, fire: Fire, record: RequestRecord, why: str) -> None:
        _log.warning(
            "timer %d names %s but is not acted on: %s; nothing was signalled", fire.handle, record.describe(), why
        )


# -- the worker's side ------------------------------------------------------------


# Every RequestTimer of this process, so that a forked child can give each a
# lock of its own: the parent's may have been held, by a thread the child
# does not have, at the moment of the fork.
_request_timers: weakref.WeakSet[RequestTimer] = weakref.WeakSet()


def _new_locks_after_fork() -> None:
    for timer in list(_request_timers):
        timer._lock = threading.Lock()


os.register_at_fork(after_in_child=_new_locks_after_fork)


class RequestTimer:
    """A worker's request timers: :meth:`start` when a request comes in,
    :meth:`finish` when its response is done.

    Safe to share between the threads of a worker and across fork (each
    process attaches on first use and is recorded as a producer of its
    own, so its timers are cancelled if it exits).  It never lets the
    wheel break a request: if the wheel is missing, full or not this
    process's to open, the request runs without a timer and a warning is
    logged (at most once a minute).  A wheel that is removed or replaced
    under it (a standalone driver restarted with ``--create``, ``shmwheel
    unlink``) is noticed - at once by the next add, or within a second if
    it was removed by hand - and the name attached again; the timers of
    requests started before are still cancelled in the old wheel.
    """

    def __init__(self, name: str, timeout: float, *, traceback_signal: int | None = DEFAULT_TRACEBACK_SIGNAL) -> None:
        segment_name(name)  # a bad name fails here, not at the first request
        self.name = name
        self.timeout = _seconds(timeout, "timeout")
        if traceback_signal is not None:
            traceback_signal = _signal_number(traceback_signal, "traceback_signal")
        self.traceback_signal = traceback_signal
        self._lock = threading.Lock()
        self._pid = 0
        self._wheel: Wheel | None = None
        self._start = 0
        self._size = PAYLOAD_SIZE
        self._ids = itertools.count(1)
        self._retry_at = 0.0
        self._warned_at = -math.inf
        self._look_at = 0  # time.monotonic_ns() when to check the name still names our wheel
        self._old: list[Wheel] = []  # wheels replaced under us, for the cancels of their requests
        _request_timers.add(self)

    def prepare(self) -> bool:
        """Attach this process and register the traceback signal now rather
        than on the first request; True if the wheel is there."""
        return self._ready() is not None

    def _ready(self) -> Wheel | None:
        pid = os.getpid()
        wheel = self._wheel  # once: another thread may drop it meanwhile
        if self._pid == pid and wheel is not None:
            return wheel
        with self._lock:
            if self._pid != pid:  # first use in this process: forked, or new
                self._pid = pid
                self._wheel = None
                self._old = []
                self._ids = itertools.count(1)
                self._start = start_time(pid) or 0
                if self.traceback_signal is not None:
                    faulthandler.register(self.traceback_signal, file=sys.stderr, all_threads=True)
            if self._wheel is None and time.monotonic() >= self._retry_at:
                try:
                    wheel = attach(self.name)
                except (ShmwheelError, OSError) as exc:  # PermissionError: the wheel is another user's
                    self._retry_at = time.monotonic() + 1.0
                    who = f" (this process runs as uid {os.geteuid()}, gid {os.getegid()})"
                    self._warn(
                        f"requests run without a timeout: {one_line(exc)}"
                        + (who if isinstance(exc, PermissionError) else "")
                    )
                    return None
                self._size = wheel.payload_size
                self._wheel = wheel
            return self._wheel

    def start(self, method: str, path: str, request_id: str | None = None) -> int | None:
        """Add the request's timer; return its handle, or None if it has none."""
        now = time.monotonic_ns()
        if now >= self._look_at and self._pid == os.getpid():
            self._look_at = now + _LOOK_INTERVAL_NS
            current = self._wheel  # once: another thread may drop it meanwhile
            if current is not None and not current.is_current():  # removed by hand (rm, an old unlink)
                self._replaced(current)
        wheel = self._ready()
        if wheel is None:
            return None
        if request_id is None or not _REQUEST_ID.fullmatch(request_id):
            request_id = f"{self._pid:x}.{next(self._ids)}"
        try:
            payload = encode_request(KIND_REQUEST, self._pid, self._start, now, method, request_id, path, self._size)
            try:
                return wheel.add(self.timeout, payload, cancel_on_exit=True)
            except SegmentRemovedError:  # removed or replaced: the name may hold another wheel now
                self._replaced(wheel)
                wheel = self._ready()
                if wheel is None:
                    return None
                return wheel.add(self.timeout, payload, cancel_on_exit=True)
        except (ShmwheelError, ValueError) as exc:
            self._warn(f"a request runs without a timeout: {exc}")
            return None

    def finish(self, handle: int | None) -> None:
        """Cancel the request's timer (nothing if it had none or it fired).

        The wheel it was added to may have been replaced since, and none
        attached again yet: its timer is still cancelled there, or a request
        that ended in time would be timed out by a driver that still drives
        the old wheel.  A handle cancels nothing in another wheel (each has
        its own key), so the wheels are simply tried in turn."""
        if handle is None or self._pid != os.getpid():
            return
        current, old = self._wheel, self._old  # once each: other threads replace them, never change them
        try:
            for wheel in (current, *old) if current is not None else old:
                if wheel.cancel(handle):
                    return
        except ShmwheelError as exc:
            self._warn(f"cancelling a request's timer failed: {exc}")

    def _replaced(self, wheel: Wheel) -> None:
        """``wheel`` was removed or replaced: attach the name again at the next start."""
        with self._lock:
            if self._wheel is not wheel:
                return  # another thread saw it first
            self._wheel = None
            self._retry_at = 0.0
            # A new list, not the old one changed: a finish() in another
            # thread may be walking that.  The oldest is let go, not closed,
            # for the same reason; the collector unmaps it once unused.
            self._old = [wheel, *self._old][:_KEEP_OLD]
        _log.info("wheel %r: it was removed or replaced; attaching the name again", self.name)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 60.0:
            self._warned_at = now
            _log.warning("wheel %r: %s", self.name, message)


# -- the wheel and its driver --------------------------------------------------------


def create_wheel(
    name: str, *, capacity: int = DEFAULT_CAPACITY, tick: float = 0.001, owner: tuple[int, int] | None = None
) -> bool:
    """Create a request-timeout wheel named ``name``, or take over a sound one
    no driver runs on; True if it made a new one.

    ``owner`` (uid, gid) is who the wheel belongs to, when that is not who
    creates it: the workers' user and group, when a server started as root
    runs them as another user (see :func:`shmwheel.create`).

    What is there already under that name decides:

    * a wheel whose driver is running belongs to a server that is up:
      DriverRunningError, and it is left alone;
    * a wheel no driver runs on that passes its check and has the asked-for
      capacity, tick, record size and owner is taken over as it is, with
      its timers: what a driver restarted by a process manager finds, while
      the workers go on adding to it (an INFO line counts the timers);
    * any other wheel no driver runs on is replaced, and the timers it holds
      are dropped: marked removed first, so that workers still holding it
      attach the new one.  One whose registered driver died is left over
      from a server that did not shut down (SIGKILL, a crash): a WARNING.
      Otherwise a WARNING if it holds timers, an INFO line if it is empty.
      Either line says how many timers are dropped;
    * a segment that cannot be read as a wheel (another program's, a wheel
      of another layout version or build) is never removed: its
      IncompatibleSegmentError is raised again, saying how to remove it by
      hand.
    """
    for _ in range(2):
        try:
            create(name, capacity=capacity, tick=tick, payload_size=PAYLOAD_SIZE, owner=owner).close()
            return True
        except SegmentExistsError:
            pass
        try:
            with observe(name) as old:
                st = old.stats()
                problem = _why_not_take_over(old, st, capacity, tick, owner)
        except SegmentNotFoundError:
            continue  # removed meanwhile
        except ShmwheelError as exc:
            raise _not_replaced(name, exc) from exc
        if st.driver_pid and alive(st.driver_pid, st.driver_start or 0):
            raise DriverRunningError(f"wheel {name!r} is in use: its driver, pid {st.driver_pid}, is running")
        if problem is None:
            _log.info("wheel %r: taking over a wheel no driver runs on%s", name, _kept(st))
            return False
        # A driver that registers or a timer added from here to the unlink
        # goes with the segment: the name is the only lock there is.
        if st.driver_pid:
            _log.warning(
                "wheel %r: replacing a segment left over from a server that is gone (its driver, pid %d, died; %s)%s",
                name,
                st.driver_pid,
                problem,
                _dropped(st),
            )
        elif st.pending or st.in_flight:  # kept by a driver that stopped, or never driven
            _log.warning("wheel %r: replacing a segment no driver runs on (%s)%s", name, problem, _dropped(st))
        else:
            _log.info("wheel %r: replacing a segment no driver runs on (%s)%s", name, problem, _dropped(st))
        with contextlib.suppress(SegmentNotFoundError):
            unlink(name)
    raise SegmentExistsError(f"wheel {name!r} keeps being created by someone else")


def _why_not_take_over(
    old: Wheel, st: WheelStats, capacity: int, tick: float, owner: tuple[int, int] | None
) -> str | None:
    """Why create_wheel replaces a wheel rather than take it over, or None."""
    if (st.capacity, st.payload_size) != (capacity, PAYLOAD_SIZE) or not math.isclose(st.tick, tick):
        return (
            f"capacity {st.capacity}, tick {st.tick:g} s and records of {st.payload_size} bytes, "
            f"not {capacity}, {tick:g} s and {PAYLOAD_SIZE}"
        )
    uid, gid = owner or (-1, -1)
    want = (os.geteuid() if uid == -1 else uid, os.getegid() if gid == -1 else gid)
    got = old.owner()
    if got != want:
        return f"owned by uid {got[0]}, gid {got[1]}, not {want[0]}, {want[1]}"
    if st.removed:
        return "marked removed"
    try:
        old.check()
    except CorruptSegmentError as exc:
        return str(exc)
    return None


def _kept(st: WheelStats) -> str:
    """The end of create_wheel's line when it takes a wheel over: the timers that stay."""
    return _timers(st, "; its {n} timer{s} stay", " ({fired} fired, to be handed out again)")


def _dropped(st: WheelStats) -> str:
    """The end of create_wheel's line when it replaces one: the timers that go with it."""
    return _timers(st, "; dropping its {n} pending timer{s}", " ({fired} of them fired, their handlers not done)")


def _timers(st: WheelStats, some: str, in_flight: str) -> str:
    n = st.pending + st.in_flight
    if not n:
        return "; it holds no timers"
    return some.format(n=n, s="s" if n != 1 else "") + (in_flight.format(fired=st.in_flight) if st.in_flight else "")


def _not_replaced(name: str, exc: ShmwheelError) -> ShmwheelError:
    """create_wheel's error for a segment it cannot read as a wheel, which it leaves alone."""
    bare = bare_name(name)
    try:
        ours = wheel_stat(bare) is not None  # the test `shmwheel unlink` makes first
    except OSError:
        ours = False
    how = f"shmwheel unlink {bare}" if ours else f"rm /dev/shm/{bare}"  # `shmwheel unlink` refuses the others
    return type(exc)(f"{exc}: not replacing it; if nothing uses it, remove it yourself: {how}")


class DriverSupervisor:
    """Creates a request-timeout wheel, runs its driver in a child process,
    restarts the driver if it dies, and removes the wheel on :meth:`stop`.

    For servers that do not supervise processes of their own (Gunicorn's
    master runs one).  The driver is ``python -m shmwheel.contrib.timeouts
    --parent=PID``: if the process that started it dies without calling
    stop() (SIGKILL), the driver notices (through a pidfd on that process,
    whichever thread started it), stops, and removes the wheel itself.  It
    runs in a process group of its own, so that a Ctrl-C at the terminal
    reaches the server, whose stop() then stops the driver, and not the
    driver behind the server's back.

    ``owner``, a (uid, gid), is the user and group the server's workers run
    as, when the server starts as root and drops privileges: the wheel is
    made theirs and the driver runs as them (``--user``/``--group``), so
    that it can signal what the workers could signal each other and nothing
    else.
    """

    #: Seconds between two looks at the driver; and the longest wait
    #: between restarts of a driver that keeps dying.
    POLL = 0.5
    MAX_BACKOFF = 30.0

    def __init__(
        self,
        name: str,
        actions: TimeoutActions | None = None,
        *,
        capacity: int = DEFAULT_CAPACITY,
        tick: float = 0.001,
        start_timeout: float = 30.0,
        owner: tuple[int, int] | None = None,
    ) -> None:
        segment_name(name)
        self.owner = None if owner is None else check_owner(owner)
        self.name = name
        self.actions = actions or TimeoutActions()
        self.capacity = capacity
        self.tick = tick
        self.start_timeout = _seconds(start_timeout, "start_timeout")
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()  # the watcher against restart() and stop()
        self._started = 0.0

    @property
    def pid(self) -> int | None:
        """The driver's pid, while it runs."""
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        """Create the wheel and start the driver; return once it drives."""
        if self._watcher is not None:
            raise RuntimeError("this supervisor has been started already")
        create_wheel(self.name, capacity=self.capacity, tick=self.tick, owner=self.owner)
        try:
            with self._lock:
                self._spawn()
        except BaseException:
            unlink(self.name)
            raise
        self._watcher = threading.Thread(target=self._watch, name="shmwheel-supervisor", daemon=True)
        self._watcher.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the driver (SIGTERM: it finishes the fires in flight; SIGKILL
        after ``timeout``) and remove the wheel.  Safe to call twice."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None:
                _terminate(proc, timeout)
        with contextlib.suppress(SegmentNotFoundError):
            unlink(self.name)

    def restart(self, actions: TimeoutActions | None = None) -> None:
        """Replace the driver by a new one (with new ``actions``); fires in
        flight are redelivered to the new one."""
        with self._lock:
            if actions is not None:
                self.actions = actions
            if self._proc is not None:
                _terminate(self._proc, 30.0)
            self._spawn()

    def _spawn(self) -> None:
        cmd = [sys.executable, "-m", __name__, self.name, f"--parent={os.getpid()}", *self.actions.as_args()]
        if self.owner is not None:
            cmd += [f"--user={self.owner[0]}", f"--group={self.owner[1]}"]
        # Out of the server's process group: the terminal's Ctrl-C (SIGINT to
        # the foreground group) would stop the driver while the server still
        # runs, and the watcher would log its death and start another.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        self._proc = proc
        self._started = time.monotonic()
        give_up = self._started + self.start_timeout
        with observe(self.name) as wheel:
            while wheel.raw_stats().driver_pid != proc.pid:
                if proc.poll() is not None:
                    raise DriverStartError(
                        f"the driver of wheel {self.name!r} exited on start (status {proc.returncode})"
                    )
                if time.monotonic() > give_up:
                    proc.kill()
                    proc.wait()
                    raise DriverStartError(f"the driver of wheel {self.name!r} did not start in {self.start_timeout} s")
                time.sleep(0.01)
        _log.info("wheel %r: driver running, pid %d", self.name, proc.pid)

    def _watch(self) -> None:
        backoff = self.POLL
        while not self._stopping.wait(self.POLL):
            with self._lock:
                proc = self._proc
                # poll() also sees a driver that the server reaped itself (a
                # master that waits for any child): ECHILD reads as gone.
                if proc is None or proc.poll() is None:
                    continue
                lived = time.monotonic() - self._started
            backoff = self.POLL if lived > 60.0 else min(backoff * 2, self.MAX_BACKOFF)
            _log.error(
                "wheel %r: the driver (pid %d) died after %.1f s; starting another in %.1f s",
                self.name,
                proc.pid,
                lived,
                backoff,
            )
            if self._stopping.wait(backoff):
                return
            with self._lock:
                if self._proc is not proc or self._stopping.is_set():
                    continue  # restarted or stopped meanwhile
                try:
                    self._spawn()
                except ShmwheelError as exc:
                    _log.error("wheel %r: %s", self.name, exc)
                else:
                    self.restarts += 1


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, wait up to ``timeout`` for the graceful stop, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the driver process ------------------------------------------------------------


# Gunicorn's layout, so that the driver's lines sit well among the server's.
_LOG_FORMAT = "[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s"
_PARENT_POLL = 0.5  # s: how often to look for the parent without a pidfd


def _watch_parent(parent: int, on_exit: Callable[[], object]) -> None:
    """Call ``on_exit`` (from a daemon thread) once process ``parent`` has exited.

    Not PR_SET_PDEATHSIG: that signal comes when the *thread* that forked
    us exits, and a SIGKILLed master's threads die one by one, so it can
    arrive while the master still counts as our parent (getppid(2) names a
    thread of it that is still on its way out) and the driver could not
    tell a dead master from a live one.  A pidfd turns readable only when
    the whole thread group is gone.  Kernels without pidfds (before 5.3)
    get getppid(2) polled instead: it changes only once the last thread
    of the parent has exited.
    """
    if os.getppid() != parent:  # gone already
        on_exit()
        return
    try:
        fd = os.pidfd_open(parent)
    except ProcessLookupError:
        on_exit()
        return
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        fd = -1

    def watch() -> None:
        if fd >= 0:
            select.select([fd], [], [])
            os.close(fd)
        else:
            while os.getppid() == parent:
                time.sleep(_PARENT_POLL)
        on_exit()

    threading.Thread(target=watch, name="shmwheel-parent", daemon=True).start()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m shmwheel.contrib.timeouts",
        description="Drive a request-timeout wheel: log, dump tracebacks of and kill workers whose requests time out.",
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
    p.add_argument("--no-log", dest="log", action="store_false", help="no WARNING line per timeout")
    p.add_argument("--no-tracebacks", dest="tracebacks", action="store_false", help="do not ask workers for tracebacks")
    p.add_argument("--traceback-signal", default=DEFAULT_TRACEBACK_SIGNAL.name, metavar="SIG")
    p.add_argument("--kill", action="store_true", help="signal the worker, then SIGKILL it")
    p.add_argument("--kill-signal", default="SIGTERM", metavar="SIG")
    p.add_argument("--kill-after", type=float, default=DEFAULT_KILL_AFTER, metavar="SECONDS")
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the driver command; return the exit status.

    As ``shmwheel``'s command line does: a usage error is argparse's (exit
    status 2), any other error one line "shmwheel.contrib.timeouts: ..." on
    stderr and exit status 1.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        segment_name(args.name)
        actions = TimeoutActions.from_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    target = _target_ids(parser, args)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=_LOG_FORMAT)
    parent_gone = threading.Event()
    owns = False
    try:
        driver = Driver(args.name, TimeoutHandler(args.name, actions))
        signal.signal(signal.SIGTERM, lambda *_: driver.stop())
        signal.signal(signal.SIGINT, lambda *_: driver.stop())
        if args.parent is not None:

            def orphaned() -> None:
                parent_gone.set()
                driver.stop()

            _watch_parent(args.parent, orphaned)
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
                "processes attached to the wheel, but whoever writes it can forge that too",
                os.getpid(),
                args.name,
                writers,
            )
        dedicated_process()
        driver.run()
    except (ShmwheelError, OSError, ValueError, TypeError) as exc:
        print(f"shmwheel.contrib.timeouts: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        if parent_gone.is_set():
            _remove(args.name)  # the server that made the wheel is gone without removing it
        elif owns:
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
