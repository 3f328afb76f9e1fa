"""The worker's side of a timeout: the timed-out request's own stack, in
the server's own log.

Each :class:`~shmwheel.contrib._worker.RequestTimer` keeps a table of the
requests of this process that are in progress: the record its timer
carries, its deadline, and where it runs (its thread, its asyncio task or
its greenlet).  When the driver's signal arrives (the record names it), a
handler in C writes a byte to a pipe, which wakes a reporter thread
whatever the main thread is doing (uWSGI's never runs Python, and a
Python signal handler would never run there); the reporter finds the
requests past their deadline and writes, for each, one log record: a
header line that repeats the driver's line, then the request's own stack:

* a request in a thread: that thread's frames;
* an asyncio task: its await chain, from the task's coroutine down to the
  innermost frame and what that awaits; when the event loop is not waiting
  but running a step (a coroutine that blocks it), the loop thread's
  frames, which are where the request is stuck, or, when another task
  blocks the loop, those too;
* a trio task (Hypercorn's trio worker): its await chain, or its thread's
  frames when it is the one running;
* a greenlet (gevent, eventlet): its frames, or its thread's when it is
  the one running.

At a request's timeout (not at its warn_after stage) the reporter then
calls the worker's ``on_timeout`` hook with the record and that stack,
and, with ``interrupt``, ends the request (:mod:`shmwheel.contrib._interrupt`).
It then tells the driver, with a timer of kind ``KIND_ANSWER`` due at
once: a driver that hears nothing sends the dump signal, on which
:mod:`faulthandler` writes every thread's stack from C (the fallback for a
worker in which no Python can run: a C call that holds the GIL).  Only
then: faulthandler reads the other threads' frames with no lock, and can
crash a process in which Python runs, so a gate in C lets the driver's dump
through only on evidence that none runs: an ask is there that this
module's reporter thread has not taken, and the reporter, whose wait for
the pipe is in C (``shmw_signal_wait``), has woken and waited for the GIL
ever since, far longer than bytecode keeps it from a waiter
(``shmw_signal_gate_dump``).
A worker that is only slow to answer is not dumped, and says so in one
line.

The reporter is a real thread even under gevent's monkey-patching, so that
it runs while the hub is blocked; it reads the other threads' frames and
never changes them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import faulthandler
import itertools
import linecache
import logging
import os
import re
import signal
import site
import stat
import struct
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from .._binding import ffi, lib
from .._process import after_fork
from ._door import Active
from ._record import (
    AT_STACK_SIGNAL,
    AT_STARTED,
    DUMP_SIGNALS,
    SHOWN_MAX,
    STACK_SIGNALS,
    RequestRecord,
    decode_request,
    shown,
    signal_name,
    stack_pipe,
)

if TYPE_CHECKING:
    from ._worker import RequestTimer

__all__ = [
    "Active",
    "Frame",
    "TimedOut",
    "TimeoutReporter",
    "add_reporter",
    "keep_listening",
    "listen",
    "real",
    "remove_reporter",
    "server_logger",
    "writes_somewhere",
]

_log = logging.getLogger("shmwheel.timeouts")

#: Where a timeout's stack goes: the first of these loggers that writes
#: somewhere (the server's error log), else ``shmwheel.timeouts``.
SERVER_LOGGERS = ("gunicorn.error", "uvicorn.error", "hypercorn.error")
FALLBACK_FORMAT = "[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s"
MAX_FRAMES = 200  # of one stack: a runaway recursion is not written out whole


def writes_somewhere(logger: logging.Logger | None) -> bool:
    """Whether the records of ``logger`` reach a handler other than a NullHandler."""
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def server_log() -> logging.Logger | None:
    """The first of :data:`SERVER_LOGGERS` that is set up in this process, if any."""
    known = logging.root.manager.loggerDict
    for name in SERVER_LOGGERS:
        logger = known.get(name)
        if isinstance(logger, logging.Logger) and writes_somewhere(logger) and logger.isEnabledFor(logging.WARNING):
            return logger
    return None


def server_logger() -> logging.Logger:
    """The server's error log if one of :data:`SERVER_LOGGERS` is set up in
    this process, else ``shmwheel.timeouts`` (which, if nothing is set up to
    write its records, writes to stderr)."""
    logger = server_log()
    if logger is not None:
        return logger
    if not writes_somewhere(_log):
        with _lock:
            if not writes_somewhere(_log):
                handler = logging.StreamHandler(sys.stderr)
                handler.setFormatter(logging.Formatter(FALLBACK_FORMAT))
                _log.addHandler(handler)
    return _log


# -- the signal and the reporter: one of each per process --------------------

_lock = threading.Lock()
_reporter_pid = 0  # the process whose pipe and reporter thread these are (in a forked child, its parent's)
_pipe: tuple[int, int] = (-1, -1)  # the reporter reads; the signal handler (C) writes
_reporter_ident = 0  # its thread, which no report shows
_listening: set[int] = set()
_told: set[int] = set()  # the signals taken back from the application, which the log has said
_dump_signum = 0  # faulthandler's in this process, registered by listen(); 0: none yet
_ask_signum = 0  # the real-time signal the driver asks on, set up by ask_signal(); 0: none yet
_timers: Callable[[], Iterable[RequestTimer]] = list


def listen(signum: int, timers: Callable[[], Iterable[RequestTimer]]) -> int:
    """Write the timed-out requests' stacks when ``signum`` arrives, and have
    faulthandler dump every thread on a free signal of :data:`DUMP_SIGNALS`;
    ``timers()`` are the request timers of this process.  Returns the dump
    signal (0: none is free).  From any thread: the handler is C's
    (``shmw_signal_to_fd``), which wakes the reporter through a pipe.

    Taking the signals takes nothing from the application: a Python handler
    ``signum`` has already (``signal.signal()``) is kept, and called after
    shmwheel's; any other handler (a C library's, faulthandler's) is left
    to it, and OSError says that this process cannot be asked for stacks
    on ``signum``; a dump signal the application has a handler for (its
    own faulthandler registration, say) is left to it, and the next free
    one taken."""
    global _timers
    _timers = timers
    with _lock:
        dump = _dump_signal()
        _start_reporter()
        if signum in _listening:  # a fork's: _after_fork pointed it at this process's pipe
            return dump
        kept = lib.shmw_signal_to_fd(signum, _pipe[1], _python_handler())
        if kept < 0:
            raise OSError(-kept, f"{signal_name(signum)} cannot be caught: {os.strerror(-kept)}")
        if kept == 2:
            raise OSError(errno.EBUSY, _not_shared(signum))
        _listening.add(signum)
    if kept:
        server_logger().warning(
            "shmwheel: %s has a Python handler of its own in this process, which is kept: shmwheel's asks for a "
            "timed-out request's stack and then calls it, for every %s",
            signal_name(signum),
            signal_name(signum),
        )
    return dump


def _not_shared(signum: int) -> str:
    name = signal_name(signum)
    return (
        f"{name} has a handler of its own in this process that is not a Python one (a C library's, or "
        f"faulthandler's), which shmwheel leaves alone: set traceback_signal to a signal nothing here handles "
        f"({', '.join(sorted(signal_name(s) for s in STACK_SIGNALS if s != signum))})"
    )


def _python_handler() -> int:
    """The address of CPython's own C signal handler, which runs the Python
    handlers (signal.signal()): the one handler shmwheel's may call after its
    own.  Read off a signal that has a Python handler; 0 if none has."""
    for signum in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            if callable(signal.getsignal(signum)) and lib.shmw_signal_owner(signum) == 3:
                return int(lib.shmw_signal_handler(signum))
    return 0


#: How long, at least, the reporter must have waited for the GIL, with the
#: GIL in the same hands, for the driver's dump to be let through: besides
#: twenty switch intervals, which the gate reads where the GIL keeps them.
GIL_WAIT_NS = 300_000_000


_gil_fields: tuple[int, int] | None = None  # the addresses of the GIL's count of handoffs, its switch interval


def _gil_fields_of_this_process() -> tuple[int, int]:
    """The addresses of the count the GIL keeps of the times it changed
    hands, and of its switch interval (shmwheel._gil), once the count is
    seen to move when the GIL goes to another thread and back, and the
    interval to be sys.getswitchinterval(); (0, 0), said once, where they
    cannot be had or are not right: then the driver's dump is never let
    through in this process."""
    global _gil_fields
    if _gil_fields is None:
        why, every = "", 0
        try:
            from .. import _gil

            address, every = _gil.switches_address(), _gil.interval_address()
        except ImportError as exc:
            address, why = 0, f"shmwheel._gil cannot be loaded ({exc})"
        if address and ffi.cast("unsigned long *", every)[0] != round(sys.getswitchinterval() * 1e6):
            address, why = 0, "the switch interval is not where shmwheel looks for it"
        if address:
            count = ffi.cast("unsigned long *", address)
            before = count[0]
            done = real("_thread", "allocate_lock")()  # real threads, under gevent too
            done.acquire()
            real("_thread", "start_new_thread")(done.release, ())  # the GIL to it, and back
            done.acquire()
            if count[0] == before:
                address, why = 0, "the count it keeps of the times it changed hands does not move"
        elif not why:
            why = "where this CPython keeps its count of the times it changed hands is not known to shmwheel"
        if why:
            server_logger().warning(
                "shmwheel: the driver's fallback for a worker that does not answer, faulthandler's dump of every "
                "thread, is off in this process: it is done only where the GIL shows that no Python runs, and here "
                "%s",
                why,
            )
        _gil_fields = (address, every) if address else (0, 0)
    return _gil_fields


def _gate_dump(signum: int) -> int:
    """The gate before faulthandler's handler of ``signum``, as this
    process is now (its switch interval): 0, or -errno.  Shut for good as
    the interpreter exits: its finalization runs bytecode while the
    reporter, which it ends, may seem to wait for the GIL."""
    if not _closing:
        _closing.append(signum)
        atexit.register(lambda: lib.shmw_signal_gate_dump(signum, 2**62, 0, 0))
    return int(lib.shmw_signal_gate_dump(signum, GIL_WAIT_NS, *_gil_fields_of_this_process()))


_closing: list[int] = []  # the dump signal whose gate is shut at exit


def _dump_signal() -> int:
    """The signal faulthandler dumps every thread on in this process (under
    _lock): the first of DUMP_SIGNALS with no handler, registered once."""
    global _dump_signum
    if _dump_signum:
        return _dump_signum
    taken = []
    for signum in DUMP_SIGNALS:
        if lib.shmw_signal_owner(signum) == 0:  # the default action: no one's
            faulthandler.register(signum, file=sys.stderr, all_threads=True)
            # Let through only while no Python runs (see shmw_signal_gate_dump).
            gated = _gate_dump(signum)
            if gated < 0:
                server_logger().warning(
                    "shmwheel: the dump of every thread on %s cannot wait for Python to stop running (%s): "
                    "one that comes while it runs could crash this process",
                    signal_name(signum),
                    os.strerror(-gated),
                )
            _dump_signum = signum
            break
        taken.append(signal_name(signum))
    if taken:
        then = f"every thread's stack is dumped on {signal_name(_dump_signum)}" if _dump_signum else "none is free"
        server_logger().warning(
            "shmwheel: %s %s a handler of its own in this process (a faulthandler registration of the "
            "application's?), which is left to it: %s",
            ", ".join(taken),
            "has" if len(taken) == 1 else "have",
            then,
        )
    return _dump_signum


def ask_signal() -> int:
    """The signal the driver asks this process on, from any thread after
    :func:`listen`: the first free real-time signal of DUMP_SIGNALS, with
    the same handler as the traceback signal.  Real-time signals queue,
    each with the value the driver sent (the request and the stage it has
    logged), where a standard one that comes while another is pending is
    merged with it and its value lost: so the worker acts on no request
    before the driver's line about it.  The traceback signal stays for
    asks without a value (an operator's ``kill``).  0 if none is free."""
    global _ask_signum
    with _lock:
        if _ask_signum and _ask_signum in _listening:
            return _ask_signum
        _ask_signum = 0
        for signum in DUMP_SIGNALS:
            if lib.shmw_signal_owner(signum) == 0 and lib.shmw_signal_to_fd(signum, _pipe[1], 0) == 0:
                _listening.add(signum)
                _ask_signum = signum
                break
    return _ask_signum


def listening(signum: int) -> bool:
    """Whether ``signum`` is one of shmwheel's stack signals in this process."""
    return signum in _listening and _reporter_pid == os.getpid()


def keep_listening() -> set[int]:
    """That the stack signals are still shmwheel's in this process: once a
    second, from a request's start.  One the application gave a Python
    handler since (``signal.signal()``) is taken back, with that handler
    kept and called after shmwheel's; one given any other handler is left
    to it.  The log says each once.  Returns the signals left to others:
    this process's requests can no longer be asked for a stack on them."""
    lost: set[int] = set()
    if _reporter_pid != os.getpid():
        return lost
    if _dump_signum:
        # Gated again if faulthandler was registered anew; nothing if it
        # was unregistered.
        _gate_dump(_dump_signum)
    for signum in list(_listening):
        if lib.shmw_signal_owner(signum) == 2:
            continue
        with _lock:
            kept = lib.shmw_signal_to_fd(signum, _pipe[1], _python_handler())
            if kept == 2:
                _listening.discard(signum)
                lost.add(signum)
        if kept < 0 or signum in _told:
            continue
        _told.add(signum)
        if kept == 2:
            others = ", ".join(sorted(signal_name(s) for s in STACK_SIGNALS if s != signum))
            server_logger().warning(
                "shmwheel: %s was given a handler of its own in this process after shmwheel's that is not a Python "
                "one (a C library's, or faulthandler's), which shmwheel leaves alone: from now on its timed-out "
                "requests get no stack of their own and are not interrupted; set traceback_signal to a signal "
                "nothing here handles (%s)",
                signal_name(signum),
                others,
            )
        else:
            server_logger().warning(
                "shmwheel: %s was given %s in this process after shmwheel's; shmwheel's is back, %s",
                signal_name(signum),
                "a Python handler of its own" if kept else "the default action or ignored",
                "and calls that handler after its own, for every signal" if kept else "and nothing else needed it",
            )
    return lost


def _start_reporter() -> None:
    """The pipe and the reporter thread of this process: under _lock."""
    global _reporter_pid, _pipe
    pid = os.getpid()
    if _reporter_pid == pid:
        return
    if _pipe[0] < 0:
        _pipe = _new_pipe()
    _reporter_pid = pid
    # With every signal blocked, which it inherits: a signal sent to the
    # process (the server's SIGINT, SIGTERM) must land in one of the
    # server's threads, whose handlers expect it there, never in this one.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        real("_thread", "start_new_thread")(_report_forever, (_pipe[0], pid))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _new_pipe() -> tuple[int, int]:
    r, w = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(w, False)
    return r, w


def _after_fork() -> None:
    """In a forked child, while the inherited descriptors still are the
    parent's pipe: a pipe of its own, which the handler writes to from now
    on, so that the child's signals never reach the parent's reporter and a
    descriptor the child reuses is never written to.  Its reporter thread
    (the parent's did not come along) starts with its first listen()."""
    global _lock, _pipe
    _lock = threading.Lock()  # another thread may have held it at the fork
    lib.shmw_signal_reporter_runs()  # the parent's reporter's wait is not this child's
    if _pipe[0] < 0:
        return
    for fd in _pipe:
        with contextlib.suppress(OSError):
            os.close(fd)
    _pipe = _new_pipe()
    for signum in _listening:
        lib.shmw_signal_to_fd(signum, _pipe[1], 0)  # its own, inherited: only the pipe changes


after_fork(_after_fork)


def real(module: str, name: str) -> Any:
    """``module.name`` as it was before gevent's or eventlet's monkey-patching."""
    if "gevent.monkey" in sys.modules:
        from gevent import monkey

        if monkey.is_module_patched(module):
            return monkey.get_original(module, name)
    if "eventlet.patcher" in sys.modules:
        from eventlet import patcher

        return patcher.original(module).__dict__[name]
    return getattr(__import__(module), name)


#: What a signal that names a request asks of it: its stack at its
#: warn_after stage, or at its timeout (and its interrupt); or, by an
#: operator's hand, its end now (``shmwheel end``, through the driver) or
#: its stack now, to the pipe the operator waits on (``shmwheel stack``).
ASK_WARN, ASK_TIMEOUT, ASK_END, ASK_STACK = 0, 1, 2, 3
_STARTED_MASK = 2**60 - 1


def asked_value(started_ns: int, ask: int) -> int:
    """What is queued with the stack signal for a request (its start, the
    record's, on CLOCK_MONOTONIC) and what it asks (ASK_*; a bool: the
    timeout, or the warn_after stage): never 0, which a plain kill(2)
    reads as."""
    return (((started_ns & _STARTED_MASK) << 2) | int(ask)) + 2


def _asks(values: set[int], ask: int) -> set[int]:
    """The requests' starts (masked) that ``values`` ask ``ask`` of."""
    return {(v - 2) >> 2 for v in values if v >= 2 and (v - 2) & 3 == ask}


def _report_forever(fd: int, pid: int) -> None:
    global _reporter_ident
    _reporter_ident = real("_thread", "get_ident")()
    read = real("os", "read")
    size = lib.SHMW_SIGNAL_RECORD
    rest = b""
    while _reporter_pid == pid:
        # A request left for its own ask is looked at again once it is
        # ASK_WAIT late, whether or not a signal comes.
        timeout_ms = -1 if _look_again is None else -(-max(_look_again - time.monotonic_ns(), 0) // 1_000_000)
        # In C, the GIL let go, and its end noted: while this thread then
        # waits for the GIL, no Python runs (see shmw_signal_gate_dump).
        ready = lib.shmw_signal_wait(fd, timeout_ms)
        lib.shmw_signal_reporter_runs()
        try:
            if ready < 0 and ready != -errno.EINTR:
                raise OSError(-ready, os.strerror(-ready))
            data = rest + read(fd, 64 * size) if ready > 0 else rest  # those that came meanwhile are one report
        except OSError:  # closed: a fork of this process replaced it
            return
        whole = len(data) - len(data) % size
        data, rest = data[:whole], data[whole:]
        values = {int.from_bytes(data[at + 1 : at + size], "little") for at in range(0, whole, size)}
        # A plain kill (an operator's, an older driver's), or records lost: every late request.
        overflowed = lib.shmw_signal_overflowed()  # read (and cleared) whatever the values say
        everyone = overflowed or 0 in values
        try:
            report_overdue(asked=None if everyone else values, signalled=bool(whole) or overflowed)
        except Exception:  # noqa: BLE001 - one failed report must not end the reporter
            with contextlib.suppress(Exception):
                _log.exception("shmwheel: writing a timed-out request's stack failed")


_reported: set[tuple[bytes, bool]] = set()  # (record, timed out) whose stack has been written
#: How long a late request the driver has not asked about waits for its ask.
ASK_WAIT_NS = 50_000_000
#: How often, while one of its requests is past its timeout, a worker looks
#: whether its wheel has a new driver, to tell it.
LATE_LOOK_NS = 1_000_000_000
_look_again: int | None = None  # time.monotonic_ns() when such a request is looked at again
_RECORD_STARTED = struct.Struct("<q")


def report_overdue(now_ns: int | None = None, asked: set[int] | None = None, signalled: bool = True) -> int:
    """For each request of this process past its warn_after stage or its
    timeout that the driver has asked about (``asked``: the values its
    signals carried, see :func:`asked_value`; None: every one): its stack
    written (once a stage), and at its timeout the worker's on_timeout
    hook and its interrupt; then the driver answered (once a request when
    the reporter woke with no signal, to look again: not ``signalled``).
    Returns how many stacks were written."""
    global _look_again
    now = time.monotonic_ns() if now_ns is None else now_ns
    flush_until = time.monotonic() + FLUSH_TIME
    frames = sys._current_frames()
    written = 0
    to_flush = False
    answers: list[tuple[RequestTimer, bytes]] = []  # once what the reporters were told is sent
    still: set[tuple[bytes, bool]] = set()
    look_again: int | None = None
    ends = _asks(asked, ASK_END) if asked is not None else set()
    stacks = _asks(asked, ASK_STACK) if asked is not None else set()
    for timer in list(_timers()):
        timer.tell_again(_reported)
        for handle, active in timer.in_progress().items():
            started = _RECORD_STARTED.unpack_from(active.payload, AT_STARTED)[0]
            if started & _STARTED_MASK in stacks:
                _stack_by_hand(timer, active, frames, now)
            if started & _STARTED_MASK in ends and timer.end_by_hand(handle):
                assert asked is not None
                asked.add(asked_value(started, ASK_TIMEOUT))  # from now on it is past its timeout, as at it
            # Due exactly when its timer is: the driver fires no timer before
            # its deadline, and its follow-ups at the record's timeout, which
            # is never before this one (milliseconds, rounded up).  So a
            # signal for another request never brings a stage early.  But
            # for an operator's: one ended by hand is past its timeout now.
            by_hand = timer.ended_by_hand(handle)
            if active.deadline_ns > now and not by_hand:
                continue
            timed_out = active.timeout_ns <= now or by_hand
            queued = active.payload[AT_STACK_SIGNAL] >= signal.SIGRTMIN
            if asked is not None and (queued or now - active.deadline_ns < ASK_WAIT_NS):
                # Only at the stage the driver has asked about, which it said
                # in its log first: a request whose deadline has passed but
                # whose own fire the driver has not handled yet waits for
                # it.  Asks on a real-time signal queue, so it always comes;
                # on a standard one (no real-time signal was free) it waits
                # at most ASK_WAIT, since a signal that came while another
                # was pending merged with it, and lost the value that named
                # its request, though the driver had said its line.
                if timed_out and asked_value(started, True) not in asked:
                    timed_out = False
                if not timed_out and asked_value(started, False) not in asked:
                    still.update(m for m in ((active.payload, False), (active.payload, True)) if m in _reported)
                    if not queued:
                        again = active.deadline_ns + ASK_WAIT_NS
                        look_again = again if look_again is None else min(look_again, again)
                    continue
            mark = (active.payload, timed_out)
            still.add(mark)
            new = mark not in _reported
            if new:
                record = decode_request(active.payload)
                if record is not None:
                    stack = report(record, active, frames, now, timed_out, ENDED_BY_HAND if by_hand else "")
                    if timer.stacks:
                        server_logger().warning("%s", stack)
                        written += 1
                    if timed_out and timer.timed_out(handle, active, record, stack, frames):
                        to_flush = True
                        if not active.interrupt:
                            # The driver's kill follows the answer at once:
                            # the reporters send first.  An interrupted
                            # request's kill waits its grace anyway.
                            answers.append((timer, active.payload))
                            continue
            if new or signalled:  # not again at each look of a reporter that woke with no signal
                timer.answer(active.payload)
    if to_flush:
        flush_reporters(flush_until)
    for timer, payload in answers:
        timer.answer(payload)
    _reported.intersection_update(still)
    _reported.update(still)
    if any(timed_out for _, timed_out in still):
        # A request past its timeout: its driver is looked at once a second,
        # and a new one told about it (RequestTimer.tell_again), though no
        # signal comes: the follow-ups that would send one may have died.
        again = now + LATE_LOOK_NS
        look_again = again if look_again is None else min(look_again, again)
    _look_again = look_again
    return written


ENDED_BY_HAND = "ended by hand (shmwheel end)"
#: How long the reporter tries to write a stack asked for by hand into the
#: pipe its operator waits on (a pipe holds 64 KiB: a stack fits at once).
PIPE_WAIT = 1.0


def _stack_by_hand(timer: RequestTimer, active: Active, frames: dict[int, FrameType], now: int) -> None:
    """An operator's ask (``shmwheel stack``): the request's own stack, now,
    into the pipe the operator waits on, and a line in the server's log
    that says so; the request is left as it is.  The pipe must be one of
    this worker's user (made for it by the operator): another user's is
    not written to."""
    record = decode_request(active.payload)
    if record is None:
        return
    stack = report(record, active, frames, now, False, "asked for by hand (shmwheel stack)")
    path = stack_pipe(timer.name, record.pid, record.started_ns)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENXIO):  # gone, or no reader: it gave up (no Python ran here meanwhile)
            server_logger().info(
                "shmwheel: the stack of %s was asked for by hand, but whoever asked has stopped waiting for it",
                record.describe(),
            )
        else:
            server_logger().warning(
                "shmwheel: the stack of %s was asked for by hand, but its pipe cannot be opened: %s",
                record.describe(),
                exc,
            )
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid():
            server_logger().warning(
                "shmwheel: the stack of %s was asked for by hand, but %s is not a pipe of this worker's user: "
                "nothing written to it",
                record.describe(),
                path,
            )
            return
        data = (stack + "\n").encode("utf-8", "replace")
        give_up = time.monotonic() + PIPE_WAIT
        while data:
            try:
                data = data[os.write(fd, data) :]
            except BlockingIOError:
                if time.monotonic() > give_up:
                    break
                real("select", "select")([], [fd], [], 0.05)
        server_logger().info("shmwheel: the stack of %s was asked for by hand (shmwheel stack), and written",
                             record.describe())  # fmt: skip
    except OSError as exc:  # the operator gave up meanwhile
        server_logger().warning("shmwheel: the stack of %s was asked for by hand, but not written: %s",
                                record.describe(), exc)  # fmt: skip
    finally:
        os.close(fd)


def report(
    record: RequestRecord,
    active: Active,
    frames: dict[int, FrameType],
    now_ns: int,
    timed_out: bool = True,
    by_hand: str = "",
) -> str:
    """A late request's header line and its own stack (or, ``by_hand``, of
    one an operator ended or asked the stack of: the words that say so)."""
    running = f"running for {record.running_for(now_ns):.3f} s"
    if by_hand:
        head = f"shmwheel: the stack of request {record.describe()}, {running}, {by_hand}"
    elif timed_out:
        head = f"shmwheel: the stack of timed-out request {record.describe()}, {running}"
    else:
        left = (active.timeout_ns - now_ns) / 1e9
        head = f"shmwheel: the stack of slow request {record.describe()}, {running}, {left:.3f} s before its timeout"
    lines = [head + " (most recent call last):"]
    lines += _stack_of(active, frames)
    return "\n".join(line.rstrip("\n") for line in lines)


def _stack_of(active: Active, frames: dict[int, FrameType]) -> list[str]:
    task = active.task
    if isinstance(task, asyncio.Future):
        return _task_stack(task, active.thread, frames)  # type: ignore[arg-type]
    if hasattr(getattr(task, "coro", None), "cr_frame"):  # a trio task (Hypercorn's trio worker)
        return _trio_stack(task, active.thread, frames)
    if task is not None:  # a greenlet
        if getattr(task, "dead", False):
            return ["  (its greenlet has ended)"]
        top = getattr(task, "gr_frame", None)
        if top is None:  # the one running in its thread
            top = frames.get(active.thread)
        return _frames(top, f"  (its greenlet runs in thread 0x{active.thread:016x}, which has no Python frame)")
    return _frames(frames.get(active.thread), f"  (its thread 0x{active.thread:016x} has ended)")


def _frames(top: FrameType | None, missing: str) -> list[str]:
    if top is None:
        return [missing]
    chain = list(_walk(top))[:MAX_FRAMES]
    chain.reverse()
    return _format((f, f.f_lineno) for f in chain)


def _walk(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def _format(frames: Iterable[tuple[FrameType, int | None]]) -> list[str]:
    return traceback.format_list(traceback.StackSummary.extract(frames, lookup_lines=True))  # type: ignore[arg-type]


def _task_stack(task: asyncio.Task[Any], thread: int, frames: dict[int, FrameType]) -> list[str]:
    if task.done():
        return [f"  (its task {shown(task.get_name(), SHOWN_MAX)} has ended)"]
    loop = task.get_loop()
    running = asyncio.current_task(loop)  # the task in a step now, if any (from any thread)
    if running is task:  # it blocks the loop: its stack is the loop thread's
        return [f"  task {shown(task.get_name(), SHOWN_MAX)}, which blocks the event loop:"] + _frames(
            frames.get(thread), "  (the loop thread has no Python frame)"
        )
    chain = _await_chain(task.get_coro(), task)
    lines = [f"  task {shown(task.get_name(), SHOWN_MAX)}, awaiting:"] + chain + _pool_threads(chain, thread, frames)
    if running is not None:
        name = shown(running.get_name() if isinstance(running, asyncio.Task) else repr(running), SHOWN_MAX)
        lines.append(f"  meanwhile the event loop is blocked by task {name}, in thread 0x{thread:016x}:")
        lines += _frames(frames.get(thread), "  (the loop thread has no Python frame)")
    return lines


def _trio_stack(task: Any, thread: int, frames: dict[int, FrameType]) -> list[str]:
    coro, name = task.coro, shown(str(getattr(task, "name", "?")), SHOWN_MAX)
    if coro.cr_frame is None:
        return [f"  (its task {name} has ended)"]
    if coro.cr_running:  # in a step now: it blocks trio's loop, whose thread's stack is the request's
        return [f"  task {name}, which blocks the event loop:"] + _frames(
            frames.get(thread), "  (the loop thread has no Python frame)"
        )
    chain = _await_chain(coro)
    return [f"  task {name}, awaiting:"] + chain + _pool_threads(chain, thread, frames)


def _pool_threads(chain: list[str], thread: int, frames: dict[int, FrameType]) -> list[str]:
    """When a task's await chain waits for a function run in a thread (a
    synchronous endpoint of Starlette or FastAPI), the busy threads of the
    pool: nothing ties that thread to the task."""
    if not any(marker in line for line in chain for marker in (*_TO_THREAD, _TO_THREAD_FILE + '", line')):
        return []
    busy = [t for t, top in frames.items() if t not in (thread, _reporter_ident) and not _idle(top)]
    pool = [t for t in busy if _in_pool(frames[t])]
    if pool:  # the server's and shmwheel's own threads (a health check, a driver's reaper) are not its
        lines = [f"  it waits for a thread; this worker's busy pool threads ({len(pool)}):"]
    else:  # a pool not known here
        lines = [f"  it waits for a thread; this worker's busy threads besides the loop's ({len(busy)}):"]
    for other in pool or busy:
        lines.append(f"  thread 0x{other:016x}:")
        lines += _frames(frames[other], "")
    return lines


# A frame of these in a task's await chain: it awaits a function run in a
# thread; or of asgiref's sync_to_async (Django's sync views under ASGI),
# whose coroutine frames are all in that file.
_TO_THREAD = ("in run_in_threadpool", "in run_sync", "in run_in_executor", "in to_thread", "in to_thread_run_sync")
_TO_THREAD_FUNCTIONS = frozenset(marker.removeprefix("in ") for marker in _TO_THREAD)
_TO_THREAD_FILE = "/asgiref/sync.py"


def _hands_to_thread(frame: FrameType) -> bool:
    """Whether a frame of an await chain awaits a function run in a thread."""
    return frame.f_code.co_name in _TO_THREAD_FUNCTIONS or frame.f_code.co_filename.endswith(_TO_THREAD_FILE)


# Where a pool's thread runs what it is given: anyio's worker thread (the
# pool of Starlette and FastAPI), concurrent.futures' (run_in_executor,
# asyncio.to_thread), trio's thread cache (anyio under trio).
_POOL_FRAMES = (
    ("run", "/anyio/_backends/_asyncio.py"),
    ("_worker", "/concurrent/futures/thread.py"),
    ("_handle_job", "/trio/_core/_thread_cache.py"),
)


def _in_pool(top: FrameType) -> bool:
    """Whether a thread is one of a known pool's."""
    return any(
        frame.f_code.co_name == name and frame.f_code.co_filename.endswith(path)
        for frame in _walk(top)
        for name, path in _POOL_FRAMES
    )


def _idle(top: FrameType) -> bool:
    """Whether a thread waits for work: a pool's worker in its queue's get()."""
    frame: FrameType | None = top
    for _ in range(3):
        if frame is None:
            return False
        if frame.f_code.co_name == "get" and frame.f_code.co_filename.endswith("queue.py"):
            return True
        frame = frame.f_back
    return False


_AWAITS = ("cr_await", "gi_yieldfrom", "ag_await")  # what a coroutine, a generator, an async generator awaits


def _frame_of(coro: Any) -> FrameType | None:
    for name in ("cr_frame", "gi_frame", "ag_frame"):
        frame = getattr(coro, name, None)
        if frame is not None:
            return frame  # type: ignore[no-any-return]
    return None


def _await_chain(coro: Any, task: Any = None) -> list[str]:
    """A suspended task's coroutines from ``coro``, its outermost, down to
    what the innermost awaits (an asyncio ``task``'s future); into the
    asyncio tasks it awaits."""
    return [line for part in _await_parts(coro, task) for line in ([part] if isinstance(part, str) else _format(part))]


_Frames = list[tuple[FrameType, "int | None"]]

_KEPT_SHOWN = 4  # tasks a chain keeps whose own chains are shown in the log
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # shmwheel's package


def _await_parts(
    coro: Any, task: Any = None, seen: set[int] | None = None, kept: int = _KEPT_SHOWN
) -> list[str | _Frames]:
    """:func:`_await_chain` as runs of frames and the lines between them.
    Where the innermost coroutine waits on a future that is not a task (as
    ``asyncio.wait`` does), on into the tasks its chain keeps in locals (as
    :func:`holds` finds them; not shmwheel's own), at most ``kept`` of
    them, the one whose chain goes deepest first: the view Django's handler
    runs in a task of its own, beside a task that listens for the client
    leaving, and waits for both with ``asyncio.wait``."""
    parts: list[str | _Frames] = []
    chain: _Frames = []
    seen = set() if seen is None else seen
    if task is not None:
        seen.add(id(task))  # not shown again as a task another keeps
    while coro is not None and id(coro) not in seen and len(chain) < MAX_FRAMES:
        seen.add(id(coro))
        frame = _frame_of(coro)
        if frame is None:  # a task's coroutine without a frame (the C middleware's call, not started): through it
            coro = getattr(coro, "cr_await", None)
            continue
        if not chain or chain[-1][0] is not frame:  # the C middleware's Then gives the frame it stands for
            chain.append((frame, frame.f_lineno))
        inner = next((getattr(coro, a) for a in _AWAITS if getattr(coro, a, None) is not None), None)
        # An awaitable without a frame that stands for another (the C
        # middleware's Then, around the application's call): through it.
        while inner is not None and _frame_of(inner) is None and id(inner) not in seen:
            seen.add(id(inner))
            inner = getattr(inner, "cr_await", None)
        if inner is not None and _frame_of(inner) is not None:  # a coroutine it awaits: down into it
            coro = inner
            continue
        # The innermost coroutine: what it awaits is the future its task
        # waits for (a Future's own iterator stands in the chain).
        waiter = getattr(task, "_fut_waiter", None)
        if isinstance(waiter, asyncio.Task):
            parts += [chain, f"  awaiting task {shown(waiter.get_name(), SHOWN_MAX)}:"]
            chain, task, coro = [], waiter, waiter.get_coro()
            continue
        if waiter is not None:
            parts += [chain, f"  awaiting {shown(repr(waiter), SHOWN_MAX)}"]
            others = _kept_tasks(chain, seen) if kept else []
            seen.update(id(other) for other in others)
            theirs = [_await_parts(other.get_coro(), other, seen, kept) for other in others]
            depth = [sum(len(part) for part in their if not isinstance(part, str)) for their in theirs]
            for _, other, their in sorted(zip(depth, others, theirs, strict=True), key=lambda t: -t[0])[:kept]:
                parts.append(f"  and task {shown(other.get_name(), SHOWN_MAX)}, which it keeps:")
                parts += their
            return parts
        break
    return [*parts, chain]


def _kept_tasks(chain: _Frames, seen: set[int]) -> list[Any]:
    """The asyncio tasks not done that the frames of ``chain`` keep in
    locals (alone, in a list, tuple or set, or in a task group), innermost
    frame first, none already shown (``seen``), at most _KEPT_SHOWN; not
    those shmwheel's own frames keep (the ASGI middleware's receive)."""
    kept: list[Any] = []
    for frame, _ in reversed(chain):
        if frame.f_code.co_filename.startswith(_OWN_DIR):
            continue
        for value in frame.f_locals.values():
            kind = type(value)
            if kind in (list, tuple, set, frozenset):
                items: Iterable[Any] = itertools.islice(value, _KEPT_MAX)
            elif kind is getattr(asyncio, "TaskGroup", None):
                items = itertools.islice(value._tasks, _KEPT_MAX)
            else:
                items = (value,)
            for item in items:
                if (
                    isinstance(item, asyncio.Task)
                    and not item.done()
                    and id(item) not in seen
                    and all(item is not k for k in kept)
                ):
                    kept.append(item)
                    if len(kept) == _KEPT_SHOWN:
                        return kept
    return kept


def waits_for_thread(task: Any) -> bool:
    """Whether the suspended asyncio ``task`` waits, itself, for a function
    run in a thread (a synchronous endpoint of Starlette or FastAPI,
    ``asyncio.to_thread``): its await chain, not counting tasks it awaits,
    ends in one of the functions that hand code to a thread."""
    parts = _await_parts(task.get_coro(), task)
    own = next((part for part in parts if not isinstance(part, str)), [])
    if len(parts) > 1 and isinstance(parts[1], str) and parts[1].startswith("  awaiting task "):
        return False  # it waits for a task: that task's thread, if any, is that task's
    return any(_hands_to_thread(frame) for frame, _ in own)


def holds(task: Any, other: Any) -> bool:
    """Whether the suspended asyncio ``task`` waits for the task ``other``:
    awaits it, or keeps it in a local variable of a coroutine of its await
    chain, alone, in a list, tuple or set (the tasks Django's ASGI handler
    and Quart's wait for), or as one of a task group's.  A task that only
    copied the request's context (a library's background task, started
    during a request) is not held.  Reads values only: no code of the
    application's runs."""
    if getattr(task, "_fut_waiter", None) is other:
        return True
    coro, seen = task.get_coro(), 0
    while coro is not None and seen < MAX_FRAMES:
        seen += 1
        frame = _frame_of(coro)
        if frame is not None and any(_keeps(value, other) for value in frame.f_locals.values()):
            return True
        coro = next((getattr(coro, a) for a in _AWAITS if getattr(coro, a, None) is not None), None)
    return False


_KEPT_MAX = 1000  # items of a local's list looked at for a task


def _keeps(value: Any, other: Any) -> bool:
    if value is other:
        return True
    kind = type(value)
    if kind in (list, tuple, set, frozenset):
        return any(item is other for item in itertools.islice(value, _KEPT_MAX))
    if kind is getattr(asyncio, "TaskGroup", None):  # 3.11 and later
        return any(item is other for item in itertools.islice(value._tasks, _KEPT_MAX))
    return False


# -- the request's own frames, as data, for an error tracker ------------------


class Frame(NamedTuple):
    """One frame of a timed-out request's stack."""

    filename: str
    lineno: int | None
    function: str  #: its code's qualified name (``View.get``)
    module: str | None  #: its module's ``__name__``
    line: str  #: its source line, stripped ("" if not found)


@dataclass(frozen=True)
class TimedOut:
    """A request past its timeout, as the worker's reporter thread found it,
    for an error tracker (:func:`add_reporter`)."""

    request: RequestRecord
    stack: str  #: the log's header line and stack, as ``on_timeout`` gets it
    frames: tuple[Frame, ...]  #: the request's own frames, outermost first; () when none was found
    view: str | None  #: the view it runs: the innermost of its frames a library called into (``myapp.views.export``)
    #: Where it runs, as its timer has it, to find what else is kept of it
    #: there (its tracing span): its OS thread, and its asyncio or trio task
    #: or its greenlet (None: it runs in the thread itself).
    thread: int = 0
    task: Any = None

    @property
    def route(self) -> str:
        """What groups it with the other timeouts of the same view: its
        view, else its path with what looks like an id in it masked
        (:func:`masked_path`)."""
        return self.view or masked_path(self.request.path)


_HEX_ID = re.compile(r"[0-9a-fA-F]{16,}|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def masked_path(path: str) -> str:
    """``path`` with each segment that looks like an id (mostly digits, a
    UUID, a long hex string) as ``*``: ``/items/12/parts/7f3a...`` is
    ``/items/*/parts/*``, so that one route's requests group as one."""

    def one(segment: str) -> str:
        digits = sum(c.isdigit() for c in segment)
        return "*" if digits * 2 > len(segment) > 0 or _HEX_ID.fullmatch(segment) else segment

    return "/".join(one(segment) for segment in path.split("/"))


class TimeoutReporter(Protocol):
    """What the worker tells at each of its requests' timeouts (the Sentry
    and OpenTelemetry integrations are ones), in its reporter thread."""

    def report(self, timed_out: TimedOut) -> object:
        """The request has timed out: before the interrupt."""

    def flush(self, timeout: float) -> object:
        """Once the requests timed out together are interrupted, before the
        driver hears that the stacks of those not interrupted were written
        (and may kill their worker): what :meth:`report` left to send,
        sent, for at most ``timeout`` seconds (what is left of
        :data:`FLUSH_TIME`)."""


#: How long the reporters may take to send what they report, all together
#: and once a pass of the reporter thread (from when it woke), before the
#: driver is answered for the requests not interrupted.  Well within the
#: half second the driver waits for the answer before it takes the worker
#: for one in which no Python runs (the driver's DUMP_TIME), and dumps and
#: may kill it: a slow error tracker must not make a worker look wedged.
#: What is not sent by then still is, unless the kill comes first.
FLUSH_TIME = 0.25


_reporters: list[TimeoutReporter] = []


def add_reporter(reporter: TimeoutReporter) -> None:
    """Tell ``reporter`` of every timeout of this process's requests from now on (once, however often added)."""
    with _lock:
        if reporter not in _reporters:
            _reporters.append(reporter)


def remove_reporter(reporter: TimeoutReporter) -> None:
    """Tell ``reporter`` of no more timeouts (nothing if it was not added)."""
    with _lock:
        if reporter in _reporters:
            _reporters.remove(reporter)


def reporters() -> list[TimeoutReporter]:
    return list(_reporters)


def flush_reporters(until: float) -> None:
    """What the reporters were told, sent, until ``until`` (time.monotonic())
    at the latest: once a pass of the reporter thread, however many requests
    timed out in it, before it answers the driver for those it did not
    interrupt."""
    for reporter in reporters():
        try:
            reporter.flush(max(0.0, until - time.monotonic()))
        except Exception:  # noqa: BLE001
            server_logger().exception("shmwheel: %r could not send its report", reporter)


def own_frames(active: Active, frames: dict[int, FrameType]) -> tuple[Frame, ...]:
    """The request's own frames, outermost first: its thread's, its
    greenlet's, or its task's await chain (down into the thread it waits
    for, when one pool thread is busy), or the loop thread's when it is the
    task that blocks the loop.  Another task's frames are never its."""
    task, thread = active.task, active.thread
    chain: _Frames
    if isinstance(task, asyncio.Future) or hasattr(getattr(task, "coro", None), "cr_frame"):
        if isinstance(task, asyncio.Future):
            if task.done():
                return ()
            running = asyncio.current_task(task.get_loop()) is task
            coro = task.get_coro()  # type: ignore[attr-defined]
        else:  # trio's
            coro = task.coro
            if coro.cr_frame is None:
                return ()
            running = bool(coro.cr_running)
        if running:
            chain = _chain(frames.get(thread))
        else:
            # One chain: the task's, and on into the one task it keeps that
            # goes deepest (Django's view's), as a call stack of the request.
            chain = [f for part in _await_parts(coro, task, kept=1) if not isinstance(part, str) for f in part]
            if any(_hands_to_thread(frame) for frame, _ in chain):
                busy = [t for t, top in frames.items() if t not in (thread, _reporter_ident) and not _idle(top)]
                pool = [t for t in busy if _in_pool(frames[t])]
                if len(pool) == 1:  # the thread it waits for; with more, nothing says which
                    chain += _chain(frames[pool[0]])
    elif task is not None:  # a greenlet
        chain = [] if getattr(task, "dead", False) else _chain(getattr(task, "gr_frame", None) or frames.get(thread))
    else:
        chain = _chain(frames.get(thread))
    out = []
    for frame, lineno in chain[-MAX_FRAMES:]:  # a runaway recursion: the innermost, where it is stuck
        code = frame.f_code
        line = linecache.getline(code.co_filename, lineno or 0, frame.f_globals).strip()
        out.append(Frame(code.co_filename, lineno, code.co_qualname, frame.f_globals.get("__name__"), line))
    return tuple(out)


def _chain(top: FrameType | None) -> _Frames:
    chain = [(f, f.f_lineno) for f in _walk(top)][:MAX_FRAMES]
    chain.reverse()
    return chain


def view_of(frames: Iterable[Frame], verdicts: Iterable[bool | None] | None = None) -> str | None:
    """The view a request runs, in its frames, outermost first: the
    innermost frame of the application's own code that a library called
    (the framework: Django's handler, or a middleware of an installed
    package between), frames that are neither (the standard library's)
    passing the call through; None if its frames hold no such call.
    Whether a frame is the application's is ``verdicts``, one a frame (an
    error tracker's own rules), or else :func:`_application_code`: not the
    standard library's, no installed package's, not shmwheel's."""
    frames = list(frames)
    mine_each = verdicts if verdicts is not None else (_application_code(f.filename) for f in frames)
    view = None
    called_by_library = False
    for frame, mine in zip(frames, mine_each, strict=True):
        if mine is None:
            continue
        if mine and called_by_library:
            view = f"{frame.module}.{frame.function}" if frame.module else frame.function
        called_by_library = not mine
    return view


def _application_code(filename: str) -> bool | None:
    """True: the application's own code; False: an installed package's or
    shmwheel's; None: the standard library's or no file (neither calls a view).

    By the file's name as its code has it, against the directories' names
    as given and as resolved, both taken once: no system call here, which
    under a request that holds the GIL would wait for it each time."""
    if not filename or filename.startswith("<"):
        return None
    if filename.startswith(_NOT_APPLICATION):
        return False
    if filename.startswith(_STDLIB):
        return None
    return True


def _both(*paths: str) -> set[str]:
    """Each directory as given and as resolved (a symbolic link: a venv's lib64, Debian's /usr/lib)."""
    return {form + os.sep for p in paths for form in (os.path.abspath(p), os.path.realpath(p))}


def _installed() -> tuple[str, ...]:
    found = [sysconfig.get_paths()[name] for name in ("purelib", "platlib")]
    found += getattr(site, "getsitepackages", list)()
    found.append(site.getusersitepackages())
    return tuple(sorted(_both(*found)))


_INSTALLED = _installed()
_STDLIB = tuple(sorted(_both(*(sysconfig.get_paths()[name] for name in ("stdlib", "platstdlib")))))
_OWN_PACKAGE = tuple(sorted(_both(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
_NOT_APPLICATION = _OWN_PACKAGE + _INSTALLED
