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
import itertools
import logging
import math
import os
import re
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .. import _wheel
from .._driver import Driver, _dedicated_process
from .._errors import (
    DriverRunningError,
    DriverStartError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmwheelError,
)
from .._process import alive, start_time
from .._wheel import Fire, Wheel, attach, create, unlink

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
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        if not alive(pid, start):
            return False
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        return True
    try:
        if not alive(pid, start):
            return False
        signal.pidfd_send_signal(fd, signum)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


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


class TimeoutHandler:
    """The driver's handler for a request-timeout wheel: ``Driver(name, TimeoutHandler(name, actions))``."""

    def __init__(self, name: str, actions: TimeoutActions | None = None) -> None:
        self.name = name
        self.actions = actions or TimeoutActions()
        self._wheel: Wheel | None = None  # for the SIGKILL timers, opened on first need

    def __reduce__(self) -> tuple[Any, ...]:
        return (TimeoutHandler, (self.name, self.actions))

    def __call__(self, fire: Fire) -> None:
        record = decode_request(fire.payload)
        if record is None:
            _log.warning("timer %d carries no request record: payload %r", fire.handle, fire.payload[:64])
            return
        if record.kind == KIND_KILL:
            self._sigkill(record)
            return
        if record.kind == KIND_GRACEFUL:
            self._graceful(record, fire.payload)
            return
        actions = self.actions
        there = alive(record.pid, record.start)
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
            if not signal_process(record.pid, record.start, actions.traceback_signal):
                return
            if actions.kill:
                # The dump runs in the worker's signal handler; a kill_signal
                # that lands before it is done can end the worker mid-dump
                # (uWSGI's SIGTERM exits at once), so it follows a little later.
                self._later(DUMP_TIME, KIND_GRACEFUL, fire.payload)
        elif actions.kill:
            self._graceful(record, fire.payload)

    def _later(self, delay: float, kind: int, payload: bytes) -> None:
        """A timer of this wheel that will bring the record back as ``kind``."""
        if self._wheel is None:
            self._wheel = attach(self.name)
        self._wheel.add(delay, bytes([kind]) + payload[1:])

    def _graceful(self, record: RequestRecord, payload: bytes) -> None:
        if signal_process(record.pid, record.start, self.actions.kill_signal):
            self._later(self.actions.kill_after, KIND_KILL, payload)

    def _sigkill(self, record: RequestRecord) -> None:
        if signal_process(record.pid, record.start, signal.SIGKILL):
            _log.error(
                "killed worker pid %d with SIGKILL: %s had run for %.3f s and it ignored %s",
                record.pid,
                record.describe(),
                record.running_for(),
                signal.Signals(self.actions.kill_signal).name,
            )


# -- the worker's side ------------------------------------------------------------


class RequestTimer:
    """A worker's request timers: :meth:`start` when a request comes in,
    :meth:`finish` when its response is done.

    Safe to share between the threads of a worker and across fork (each
    process attaches on first use and is recorded as a producer of its
    own, so its timers are cancelled if it exits).  It never lets the
    wheel break a request: if the wheel is missing or full, the request
    runs without a timer and a warning is logged (at most once a minute).
    """

    def __init__(self, name: str, timeout: float, *, traceback_signal: int | None = DEFAULT_TRACEBACK_SIGNAL) -> None:
        _wheel._segment_name(name)  # a bad name fails here, not at the first request
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

    def prepare(self) -> bool:
        """Attach this process and register the traceback signal now rather
        than on the first request; True if the wheel is there."""
        return self._ready() is not None

    def _ready(self) -> Wheel | None:
        pid = os.getpid()
        if self._pid == pid and self._wheel is not None:
            return self._wheel
        with self._lock:
            if self._pid != pid:  # first use in this process: forked, or new
                self._pid = pid
                self._wheel = None
                self._ids = itertools.count(1)
                self._start = start_time(pid) or 0
                if self.traceback_signal is not None:
                    faulthandler.register(self.traceback_signal, file=sys.stderr, all_threads=True)
            if self._wheel is None and time.monotonic() >= self._retry_at:
                try:
                    wheel = attach(self.name)
                except ShmwheelError as exc:
                    self._retry_at = time.monotonic() + 1.0
                    self._warn(f"requests run without a timeout: {exc}")
                    return None
                self._size = wheel.payload_size
                self._wheel = wheel
            return self._wheel

    def start(self, method: str, path: str, request_id: str | None = None) -> int | None:
        """Add the request's timer; return its handle, or None if it has none."""
        wheel = self._ready()
        if wheel is None:
            return None
        if request_id is None or not _REQUEST_ID.fullmatch(request_id):
            request_id = f"{self._pid:x}.{next(self._ids)}"
        try:
            payload = encode_request(
                KIND_REQUEST, self._pid, self._start, time.monotonic_ns(), method, request_id, path, self._size
            )
            return wheel.add(self.timeout, payload, cancel_on_exit=True)
        except (ShmwheelError, ValueError) as exc:
            self._warn(f"a request runs without a timeout: {exc}")
            return None

    def finish(self, handle: int | None) -> None:
        """Cancel the request's timer (nothing if it had none or it fired)."""
        if handle is not None and self._wheel is not None and self._pid == os.getpid():
            try:
                self._wheel.cancel(handle)
            except ShmwheelError as exc:
                self._warn(f"cancelling a request's timer failed: {exc}")

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 60.0:
            self._warned_at = now
            _log.warning("wheel %r: %s", self.name, message)


# -- the wheel and its driver --------------------------------------------------------


def create_wheel(
    name: str, *, capacity: int = DEFAULT_CAPACITY, tick: float = 0.001, owner: tuple[int, int] | None = None
) -> None:
    """Create a request-timeout wheel named ``name``, replacing a wheel no driver runs on.

    What is there already under that name decides:

    * a wheel whose driver is running belongs to a server that is up:
      DriverRunningError, and it is left alone;
    * a wheel no driver runs on is replaced, and the timers it holds are
      dropped.  One whose registered driver died is left over from a server
      that did not shut down (SIGKILL, a crash): a WARNING.  One with no
      driver registered was kept by a driver that stopped in good order for
      a reload (uWSGI's mule), or never driven (``shmwheel create``): a
      WARNING if it holds timers, an INFO line if it is empty, as a reload
      leaves it.  Either line says how many timers are dropped;
    * a segment that cannot be read as a wheel (another program's, a wheel
      of another layout version or build, a corrupt one) is never removed:
      its IncompatibleSegmentError or CorruptSegmentError is raised again,
      saying how to remove it by hand.

    ``owner`` is as for :func:`shmwheel.create`: the ``(uid, gid)`` of the
    workers, when the server creates the wheel before it drops privileges.
    """
    for _ in range(2):
        try:
            create(name, capacity=capacity, tick=tick, payload_size=PAYLOAD_SIZE, owner=owner).close()
            return
        except SegmentExistsError:
            pass
        try:
            with _wheel._attach(name, producer=False) as old:
                st = old.stats()
        except SegmentNotFoundError:
            continue  # removed meanwhile
        except ShmwheelError as exc:
            raise _not_replaced(name, exc) from exc
        if st.driver_pid and alive(st.driver_pid, st.driver_start or 0):
            raise DriverRunningError(f"wheel {name!r} is in use: its driver, pid {st.driver_pid}, is running")
        # A driver that registers or a timer added from here to the unlink
        # goes with the segment: the name is the only lock there is.
        if st.driver_pid:
            _log.warning(
                "wheel %r: replacing a segment left over from a server that is gone (its driver, pid %d, died)%s",
                name,
                st.driver_pid,
                _dropped(st),
            )
        elif st.pending or st.in_flight:  # kept by a driver that stopped, or never driven
            _log.warning("wheel %r: replacing a segment no driver runs on%s", name, _dropped(st))
        else:  # what a reload leaves
            _log.info("wheel %r: replacing a segment no driver runs on%s", name, _dropped(st))
        with contextlib.suppress(SegmentNotFoundError):
            unlink(name)
    raise SegmentExistsError(f"wheel {name!r} keeps being created by someone else")


def _dropped(st: _wheel.WheelStats) -> str:
    """The end of create_wheel's line: the timers that go with the segment."""
    n = st.pending + st.in_flight
    if not n:
        return "; it holds no timers"
    text = f"; dropping its {n} pending timer{'s' if n != 1 else ''}"
    if st.in_flight:
        text += f" ({st.in_flight} of them fired, their handlers not done)"
    return text


def _not_replaced(name: str, exc: ShmwheelError) -> ShmwheelError:
    """create_wheel's error for a segment it cannot read as a wheel, which it leaves alone."""
    bare = _wheel._bare(name)
    try:
        ours = _wheel._wheel_stat(bare) is not None  # the test `shmwheel unlink` makes first
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
    ) -> None:
        _wheel._segment_name(name)
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
        create_wheel(self.name, capacity=self.capacity, tick=self.tick)
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
        # Out of the server's process group: the terminal's Ctrl-C (SIGINT to
        # the foreground group) would stop the driver while the server still
        # runs, and the watcher would log its death and start another.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        self._proc = proc
        self._started = time.monotonic()
        give_up = self._started + self.start_timeout
        with _wheel._attach(self.name, producer=False) as wheel:
            while wheel._raw_stats().driver_pid != proc.pid:
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
        help="create the wheel and remove it on exit.  A wheel of that name that no driver runs on (its "
        "driver died or stopped, or none ever ran) is replaced and the timers it holds are dropped, logged "
        "with their number; one whose driver runs, and a segment that is not a wheel this version reads "
        "(another program's), are left alone: an error",
    )
    p.add_argument("--parent", type=int, metavar="PID", help="stop, and remove the wheel, if process PID exits")
    p.add_argument("--no-log", dest="log", action="store_false", help="no WARNING line per timeout")
    p.add_argument("--no-tracebacks", dest="tracebacks", action="store_false", help="do not ask workers for tracebacks")
    p.add_argument("--traceback-signal", default=DEFAULT_TRACEBACK_SIGNAL.name, metavar="SIG")
    p.add_argument("--kill", action="store_true", help="signal the worker, then SIGKILL it")
    p.add_argument("--kill-signal", default="SIGTERM", metavar="SIG")
    p.add_argument("--kill-after", type=float, default=DEFAULT_KILL_AFTER, metavar="SECONDS")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the driver command; return the exit status.

    As ``shmwheel``'s command line does: a usage error is argparse's (exit
    status 2), any other error one line "shmwheel.contrib.timeouts: ..." on
    stderr and exit status 1.
    """
    from .._cli import _message  # an OSError without its "[Errno n]"

    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _wheel._segment_name(args.name)
        actions = TimeoutActions.from_args(args)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
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
            create_wheel(args.name)
            owns = True
        _dedicated_process()
        driver.run()
    except (ShmwheelError, OSError, ValueError, TypeError) as exc:
        print(f"shmwheel.contrib.timeouts: {_message(exc)}", file=sys.stderr)
        return 1
    finally:
        if parent_gone.is_set():
            owns = True  # the server that made the wheel is gone without removing it
        if owns:
            with contextlib.suppress(SegmentNotFoundError):
                unlink(args.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
