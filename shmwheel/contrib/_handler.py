"""The driver's side of request timeouts: what it does when a request's
timer fires, and whom it may do it to.

When a timer fires the driver hands it to :class:`TimeoutHandler`, which
acts on the worker, because a worker stuck in a request cannot act for
itself.  A request's timer is due at its first stage; the driver adds
the timers of the later ones (follow-ups), so that the worker still pays
one add and one cancel a request:

0. at ``warn_after``, if the request's record says it has that stage: a
   WARNING line, the request's own stack as in 2., and a follow-up for
   its timeout;
1. at its timeout, a WARNING line with the method, path, request id,
   worker pid, thread (and task or greenlet) and how long the request has
   been running;
2. optionally the request's own stack: the record names the signal on
   which the worker writes it (:mod:`shmwheel.contrib._stacks`), and the
   worker answers through the wheel once it has.  A worker that has not
   answered :data:`DUMP_TIME` later is one in which no Python runs (a C
   call that holds the GIL): it gets the record's dump signal, on which
   :mod:`faulthandler` writes every thread's stack from C, and a line says
   which thread is the request's.  A record with the INTERRUPT flag has
   the same signal tell its worker to end the request
   (:mod:`shmwheel.contrib._interrupt`), and a follow-up
   ``interrupt_grace`` later says whether it has: a request that has ended
   tells the driver so, and is left alone; one that has not, with kill
   off, runs on, and is remembered until it ends (its worker tells the
   driver, which says so) or its worker is gone;
3. optionally ``kill_signal`` (graceful: the worker may finish up), once
   the stack is written or, for an interrupted request, once the grace is
   over and it has not ended; then, ``kill_after`` seconds later if the
   same process is still there, SIGKILL.  A worker that has had kill_signal
   already (another of its requests timed out) is not sent it again: it
   is draining, and the SIGKILL already due ends it.  Each of these steps
   is a timer in the wheel, and the log says what came of each: the
   worker exited, or was killed and why it had not gone (it ignores or
   blocks the signal, or handles it and was still draining or stuck).

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
nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import heapq
import itertools
import logging
import math
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._binding import lib
from .._driver import KEEP_IN_FLIGHT
from .._errors import ShmwheelError, WheelFullError, one_line
from .._process import alive, signal_disposition, start_time, uids, uses_file
from .._results import Fire, Timer
from .._segment import segment_name
from .._wheel import Wheel, attach
from ._metrics import Counts
from ._record import (
    DUMP_SIGNALS,
    KIND_ANSWER,
    KIND_CHECK,
    KIND_END,
    KIND_END_KILL,
    KIND_FINISHED,
    KIND_GRACE,
    KIND_GRACEFUL,
    KIND_KILL,
    KIND_LATE,
    KIND_RELEASED,
    KIND_REQUEST,
    KIND_TIMEOUT,
    STACK_SIGNALS,
    RequestRecord,
    decode_request,
    due,
    signal_name,
    with_kind,
)
from ._settings import TimeoutActions
from ._stacks import ASK_END, asked_value

__all__ = [
    "DUMP_TIME",
    "TimeoutHandler",
    "signal_if",
    "signal_process",
    "uid_refusal",
]

_log = logging.getLogger("shmwheel.timeouts")

#: Seconds a worker has to write a request's stack before the driver takes
#: it that no Python can run there; and from the dump to kill_signal.
DUMP_TIME = 0.5
#: The value the driver's dump signal is queued with (asks are 2 and up),
#: which the worker's gate tells from an operator's plain one.
DUMP_ASKED = 1


def signal_process(pid: int, start: int, signum: int) -> bool:
    """Send ``signum`` to ``pid`` if it is still the process that started at
    ``start``; return whether it was sent.

    Through a pidfd: once open it names one process for good, so checking
    the start time after opening it and signalling through it leaves no
    window in which the pid could be reused.  Kernels without pidfds
    (before 5.3) get a check and a kill(2), with that window.
    """
    return signal_if(pid, start, signum, None)


def signal_if(
    pid: int, start: int, signum: int, may: Callable[[], bool] | None, value: int = 0, plain: bool = True
) -> bool:
    """signal_process(), asking ``may()`` too once the process is known to be
    the one that started at ``start``, right before the signal; with
    ``value`` queued with it (sigqueue's), where the kernel has pidfds.
    Not ``plain``: only queued with its value, or not sent."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError as exc:
        if exc.errno != errno.ENOSYS:
            raise
        if not plain or not alive(pid, start) or (may is not None and not may()):
            return False
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return False
        return True
    try:
        if not alive(pid, start) or (may is not None and not may()):
            return False
        rc = lib.shmw_pidfd_sigqueue(fd, signum, value) if value else -errno.EAGAIN
        if rc == -errno.EAGAIN and not plain:
            return False
        if rc == -errno.EAGAIN:
            # No value, or no room for it: the worker's user has as many
            # real-time signals queued as RLIMIT_SIGPENDING allows.  A plain
            # one still gets there, and is read as "every late request".
            signal.pidfd_send_signal(fd, signum)
        elif rc < 0:
            raise OSError(-rc, os.strerror(-rc))
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


class Burst:
    """Lines of one kind, said at most once a BURST_EVERY: the first of a
    burst at once, in full; the rest counted, and said in one line with
    the last of them at the end of the interval (``summary(count, last)``).
    Whoever can write the wheel can add timers by the hundred thousand: the
    log says so in a few lines, and no time goes to writing the rest, which
    the real timeouts due meanwhile would wait for."""

    def __init__(self, summary: Callable[[int, str], str]) -> None:
        self._summary = summary
        self.count = 0  # since it was made
        self._lock = threading.Lock()
        self._said = -math.inf  # time.monotonic() of the last line
        self._unsaid = 0  # refused since then
        self._last: str | Callable[[], str] = ""
        self._flusher: threading.Timer | None = None
        _bursts.add(self)  # what the last interval counted is said as the driver exits

    def add(self, what: str | Callable[[], str], count: int = 1) -> None:
        """``count`` more lines, the last of which is ``what``, or a
        function that makes it, called only if the line is said (the first
        of a burst, or the last)."""
        now = time.monotonic()
        with self._lock:
            self.count += count
            say = now - self._said >= BURST_EVERY and not self._unsaid
            if say:
                self._said = now
            if count > say:
                self._unsaid += count - say
                self._last = what
                if self._flusher is None:
                    self._flusher = threading.Timer(max(self._said + BURST_EVERY - now, 0.0), self._flush)
                    self._flusher.daemon = True
                    self._flusher.start()
        if say:
            _log.warning("%s", what if isinstance(what, str) else what())

    def _flush(self) -> None:
        with self._lock:
            unsaid, last, self._unsaid, self._flusher = self._unsaid, self._last, 0, None
            self._said = time.monotonic()
        if unsaid:
            _log.warning("%s", self._summary(unsaid, last if isinstance(last, str) else last()))


#: How often the lines of a Burst are said, at most.
BURST_EVERY = 1.0
_bursts: weakref.WeakSet[Burst] = weakref.WeakSet()


@atexit.register
def _say_the_rest() -> None:
    for burst in list(_bursts):
        burst._flush()


def _refusals(count: int, last: str) -> str:
    were = "timers were" if count > 1 else "timer was"
    return f"{count} more {were} not acted on in the last {BURST_EVERY:.0f} s, and nothing signalled; the last: {last}"


def _unread(handle: int, pid: int) -> str:
    return (
        f"timer {handle} is not acted on: it was added by pid {pid}, whose timers were refused a moment ago; "
        f"nothing was signalled"
    )


def _gone(count: int, last: str) -> str:
    requests = "requests" if count > 1 else "request"
    return (
        f"{count} more timed-out {requests} of workers that have exited in the last {BURST_EVERY:.0f} s; "
        f"the last: {last}"
    )


def _early(count: int, last: str) -> str:
    timers = "timers of requests" if count > 1 else "timer of a request"
    return f"{count} more {timers} fired before the timeout in the last {BURST_EVERY:.0f} s; the last: {last}"


def uid_refusal(pid: int) -> str | None:
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


_WORDS = frozenset(bytes([kind]) for kind in (KIND_ANSWER, KIND_FINISHED, KIND_RELEASED))  # a worker's, by kind byte
_WORD_BYTES = b"".join(sorted(_WORDS))
FOLLOW_UPS = {
    KIND_KILL: "SIGKILL",
    KIND_GRACEFUL: "kill_signal",
    KIND_CHECK: "stack check",
    KIND_TIMEOUT: "timeout stage",
    KIND_GRACE: "interrupt check",
}
_OWN_KINDS = frozenset(bytes([kind]) for kind in (*FOLLOW_UPS, KIND_LATE))  # what this driver adds, by kind byte
_END_KINDS = frozenset(bytes([kind]) for kind in (KIND_END, KIND_END_KILL))  # an operator's end by hand, by kind byte
WARNED, TIMED_OUT = "warned", "timed out"  # the stage a late request is at
FORGET_AFTER = 600.0  # s: how long a worker sent kill_signal, or a late request, is remembered, at most
ASK_KEPT = 10.0  # s: how long an end by hand waits for the fire of the timer it moved (its request may end first)
HELD_IDLE = 1.0  # s: how long the thread that brings kept follow-ups back waits for another before it ends
RUNNING_ON_KEPT = 4096  # requests running on past their interrupt's grace (kill off) kept at most, to say their end


def _running(record: RequestRecord) -> str:
    """``1.002 s``, or ``1.002 s, 0.700 s of it queued by its X-Request-Start``."""
    running = f"{record.running_for():.3f} s"
    if record.queued_ms:
        running += f", {record.queued_ms / 1000:.3f} s of it queued by its X-Request-Start"
    return running


@dataclass(frozen=True)
class _Ask:
    """An operator's end by hand, while its request's own timer, moved, is still to fire."""

    who: str  # in words
    kill: bool  # shmwheel end --kill
    handle: int  # the ask's own fire, kept in flight
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Late:
    """What the driver knows of a request past its warn_after stage or its
    timeout, while follow-ups of it are due."""

    stage: str  # WARNED or TIMED_OUT
    since: float = field(default_factory=time.monotonic)
    answered: bool = False  # the worker has written the stack asked for
    ended: bool = False  # the request has finished, or the worker gave it a new timer
    asked_at: float = 0.0  # time.monotonic() when the worker was signalled at this stage
    interrupted_at: float = 0.0  # time.monotonic() when it was asked to end it
    dumped_at: float = 0.0  # time.monotonic() when faulthandler's dump was asked for
    asked_again: bool = False  # the stack signal was sent a second time, plainly
    by_hand: str = ""  # an operator ended it (shmwheel end): who, in words
    kill: bool | None = None  # whether its kill stage follows, where not the actions' (shmwheel end --kill)


class TimeoutHandler:
    """The driver's handler for a request-timeout wheel: ``Driver(name, TimeoutHandler(name, actions))``.

    It signals only this wheel's own workers (see the module docs): a
    record that names any other process is logged, in one WARNING line
    saying why, and nothing is signalled.
    """

    #: Seconds a reading of the producer table is used for other fires; a
    #: process not found in it is looked for in a fresh reading.
    PRODUCERS_TTL = 1.0
    #: Seconds a reading is fresh enough for a process not found in it: a
    #: worker attaches before it adds a timer, which fires its delay later.
    PRODUCERS_FRESH = 0.05
    #: Seconds the kernel's word on whether a process uses the wheel is kept.
    USE_TTL = 1.0

    def __init__(self, name: str, actions: TimeoutActions | None = None) -> None:
        segment_name(name)
        self.name = name
        self.actions = actions or TimeoutActions()
        self._wheel: Wheel | None = None  # for the follow-up timers and the producer table, opened on first need
        self._counts: Counts | None = None  # what the metrics report, in the wheel's counters
        self._producers: dict[int, int] = {}  # pid: start time of the live producers, as last read
        self._producers_read = -math.inf
        self._late: dict[bytes, _Late] = {}  # request (record past its kind): while follow-ups of it are due
        self._draining: dict[tuple[int, int], float] = {}  # (pid, start): when it was sent kill_signal
        # Fires come from the driver's dispatch thread and, for the
        # follow-ups a full wheel refused, from _bring_back's: one at a time.
        self._lock = threading.RLock()
        self._held: list[tuple[int, int, bytes]] = []  # (due, seq, follow-up) the wheel refused: a heap
        self._held_seq = itertools.count()
        self._held_ready = threading.Condition(threading.Lock())
        self._held_thread: threading.Thread | None = None
        self._held_pid = os.getpid()
        self._held_count = 0  # kept since the last line that said so
        self._held_said = -math.inf
        self._using: dict[tuple[int, int], tuple[float, str | None]] = {}  # (pid, start): (when, why not)
        self._spared: set[int] = set()
        self._refused_lately: dict[tuple[int, int], tuple[float, str]] = {}  # (pid, start): (when, why)
        # Processes whose timers were refused a moment ago: their next ones
        # are refused unread, so a flood costs the real timeouts that come
        # after it in the same batch about a microsecond a timer.
        self._refusing: dict[int, tuple[float, int]] = {}  # owner pid: when, its start as a producer
        self._refusals = Burst(_refusals)
        self._gone = Burst(_gone)  # timers of workers that have exited: one, or a forger's hundred thousand
        self._predecessor = 0  # the driver this one took the wheel over from, which died: its follow-ups count
        self._took_over_at = -math.inf
        self._carried: dict[bytes, float] = {}  # requests whose stages it began that this one carries on: since
        # A request's own fire stays in flight while its stages run
        # (KEEP_IN_FLIGHT), so that a driver which takes over is handed it
        # again, whatever died with this one: its follow-ups kept in memory,
        # a driver before it, a worker in which no Python runs to say so.
        self._kept: dict[bytes, list[int]] = {}  # request: the handles of its fires kept in flight
        self._due: dict[bytes, tuple[int, float]] = {}  # request: this driver's follow-ups of it still to come, since
        self._ended: dict[bytes, float] = {}  # requests whose worker said they ended while no stage ran here: when
        # Requests past their timeout whose stages are over, with kill off
        # (interrupted and not ended within the grace, or not interrupted
        # at all): they run on, their own fire kept in flight, so that
        # `shmwheel requests` lists them, and their worker's word that they
        # ended is still said (_heard).  (pid, start) of the worker, when it
        # was asked to end the request (0.0: it was not), and when it timed out.
        self._running_on: dict[bytes, tuple[tuple[int, int], float, float]] = {}
        # Requests an operator ended by hand (shmwheel end) whose own timer
        # this driver moved to now, until that timer's fire comes: the ask,
        # whose fire is kept in flight till then, so that a driver which
        # takes over from this one, dead before the move's fire, finds it.
        self._by_hand: dict[bytes, _Ask] = {}
        # Asks of a dead driver that this one found in flight, and acted on
        # at the early fire of their request's own timer: handle, request.
        # When the ask itself is handed over, it has been done.
        self._asks_done: dict[int, bytes] = {}
        # Requests warned, then ended by hand: the timeout stage their
        # warn_after stage added for later is theirs no more.  When it is
        # due (time.monotonic_ns()), so that those never heard of are let go.
        self._taken_by_hand: dict[bytes, int] = {}
        self._early = Burst(_early)  # a request's own timers that fire before its timeout

    def spare(self, pid: int) -> None:
        """Never signal ``pid`` (the server's master, which maps the wheel
        but serves no request), whatever a record says."""
        self._spared.add(pid)

    def took_over(self, pid: int, start: int) -> None:
        """The driver took the wheel over from driver ``pid``, which died:
        the stages it began are carried on (:meth:`_carry_on`)."""
        self._predecessor = pid
        self._took_over_at = time.monotonic()

    def __reduce__(self) -> tuple[Any, ...]:
        return (TimeoutHandler, (self.name, self.actions))

    def __call__(self, fire: Fire) -> Any:
        with self._lock:
            if fire.handle >= 0:  # (not one of the follow-ups kept here, whose lateness is this process's)
                with contextlib.suppress(ShmwheelError, OSError):  # the wheel gone: its counts with it
                    self._counting().lateness(time.monotonic_ns() - fire.deadline_ns)
            if self._refused_unread(fire):
                return None
            key = fire.payload[1:]
            if fire.owner_pid == os.getpid() and fire.payload[:1] in _OWN_KINDS:
                self._came(key)  # one of this driver's follow-ups: one fewer to come
            record = self._handle(fire)
            keep = (
                record is not None
                and record.kind == KIND_REQUEST
                and fire.handle >= 0
                and (key in self._due or key in self._running_on)
            )
            if keep:
                handles = self._kept.setdefault(key, [])
                if fire.handle not in handles:
                    handles.append(fire.handle)
            self._release()
            if keep or (key in self._by_hand and self._by_hand[key].handle == fire.handle):
                return KEEP_IN_FLIGHT
            return None

    def _came(self, key: bytes) -> None:
        count, since = self._due.get(key, (0, 0.0))
        if count > 1:
            self._due[key] = (count - 1, since)
        else:
            self._due.pop(key, None)

    def look_after(self) -> None:
        """The periodic job (the driver calls it about once a second): the
        requests that ran on past their stages, of workers that are gone,
        forgotten, and their fires kept in flight acknowledged."""
        with self._lock:
            self._counting()  # its note written, so that the metrics have their labels before the first fire
            self._forget_gone()
            self._release()
            self._let_asks_go(time.monotonic() - ASK_KEPT)

    def _release(self) -> None:
        """Acknowledge the fires kept in flight of requests whose stages are
        over and that do not run on past them: none of this driver's
        follow-ups of them is still to come (or one has been lost for
        FORGET_AFTER: a repair retired it)."""
        now = time.monotonic()
        done = [
            key
            for key in self._kept
            if key not in self._running_on and now - self._due.get(key, (0, -math.inf))[1] >= FORGET_AFTER
        ]
        if not done:
            return
        for key in done:
            self._due.pop(key, None)
        self._acknowledge([handle for key in done for handle in self._kept.pop(key)])

    def _acknowledge(self, handles: list[int]) -> None:
        """Free fires this handler kept in flight."""
        try:
            self._open().acknowledge(handles)
        except ShmwheelError as exc:  # the wheel is gone or replaced: nothing left to free
            _log.debug("could not acknowledge fires kept in flight: %s", one_line(exc))

    def _let_asks_go(self, before: float) -> None:
        """Let go of the ends by hand asked before ``before`` whose moved
        timer has not fired: its request ended meanwhile, and cancelled it."""
        gone = [key for key, ask in self._by_hand.items() if ask.at < before]
        if gone:
            self._acknowledge([self._by_hand.pop(key).handle for key in gone])

    def _handle(self, fire: Fire) -> RequestRecord | None:
        """Act on one fire; the record it carries, if any."""
        record = decode_request(fire.payload)
        if record is None:
            _log.warning("timer %d carries no request record: payload %r", fire.handle, fire.payload[:64])
            return None
        key = fire.payload[1:]
        if record.kind in (KIND_ANSWER, KIND_FINISHED, KIND_RELEASED):
            # They only spare a worker the dump or the kill: believed on their word.
            self._heard(self._late.get(key), record, key)
            return record
        if record.kind in (KIND_END, KIND_END_KILL):
            if self._asks_done.pop(fire.handle, None) != key:
                self._end_asked(fire, record)
            return record
        # Who added it, first: a timer that names a worker and was added by
        # anyone else is refused whether or not that worker is there still.
        why = self._owner_refusal(fire, record)
        ours = record.kind in FOLLOW_UPS  # this driver's stage, which a refusal would lose for good
        if why is None and not ours:  # a process refused a moment ago is refused again on that word
            refused = self._refused_lately.get((record.pid, record.start))
            if refused is not None and time.monotonic() - refused[0] < self.USE_TTL:
                why = refused[1]
        there = why is None and alive(record.pid, record.start)
        if there:
            why = self._refusal(record, fresh=ours)
            if why is not None and not ours:
                if len(self._refused_lately) > 1024:
                    self._refused_lately.clear()
                self._refused_lately[(record.pid, record.start)] = (time.monotonic(), why)
        if why is not None:
            self._refuse(fire, record, why)
            return record
        if record.kind == KIND_REQUEST and key in self._by_hand:
            ask = self._by_hand.pop(key)
            self._timed_out(fire, record, there, by_hand=ask.who, kill=ask.kill)
            self._acknowledge([ask.handle])  # (after its follow-ups were added: a driver that takes over has them)
        elif record.kind == KIND_REQUEST and self._fired_early(fire, record, there):
            pass
        elif record.kind == KIND_LATE or (record.kind == KIND_REQUEST and fire.kept):
            self._told_late(fire, record, there)
        elif record.kind in (KIND_CHECK, KIND_GRACE, KIND_GRACEFUL) and fire.owner_pid != os.getpid():
            self._carry_on(fire, record, there)
        elif record.kind == KIND_KILL:
            if fire.owner_pid != os.getpid():  # the dead driver's: its stage is under way here now
                self._carried[key] = time.monotonic()
            self._sigkill(fire, record, there)
        elif record.kind == KIND_GRACEFUL:
            late = self._late.pop(key, None)
            if late is not None and late.ended:
                self._finished(record)
            elif there:
                self._graceful(fire, record, late)
        elif record.kind == KIND_CHECK:
            self._check(fire, record, there)
        elif record.kind == KIND_GRACE:
            self._grace_over(fire, record, there)
        elif (fire.redelivered or key in self._carried) and key in self._late:
            pass  # its stage is under way here already: its worker said it was late (KIND_LATE)
        elif record.kind == KIND_TIMEOUT:
            late = self._late.get(key)
            if late is not None and late.ended:
                del self._late[key]
            elif self._taken_by_hand.pop(key, None) is not None:
                pass  # ended by hand since its warn_after stage: its timeout stage came then
            else:
                self._timed_out(fire, record, there)
        elif self._warn_stage(record):
            self._warned(fire, record, there)
        else:  # its timeout; a warn_after stage delivered late (a driver restart) is its timeout too
            self._timed_out(fire, record, there)
        return record

    def _carry_on(self, fire: Fire, record: RequestRecord, there: bool) -> None:
        """A follow-up that the driver this one took over from added before
        it died: what it knew of the request (answered, ended) died with it,
        so the stage is begun again, from the timeout, as a fire of the
        request's own would; the worker answers again, and says again that
        a request has ended if it has (see _stacks.report_overdue).  Its
        SIGKILL follow-up needs nothing it knew, and is acted on as it is.
        Once a request: its other follow-ups from then are the new stage's."""
        key = fire.payload[1:]
        now = time.monotonic()
        self._carried = {k: t for k, t in self._carried.items() if now - t < FORGET_AFTER}
        if key in self._carried:
            return
        self._carried[key] = now
        if self.actions.log and there:
            _log.info(
                "%s: carrying on its %s, which driver %d added before it died",
                record.describe(),
                FOLLOW_UPS[record.kind],
                fire.owner_pid,
            )
        self._late.pop(key, None)
        if there:
            self._begin_again(fire, record, there)

    def _told_late(self, fire: Fire, record: RequestRecord, there: bool) -> None:
        """A request whose stages a driver before this one began: its worker
        says it runs past its timeout, to this driver, the first time it sees
        it (KIND_LATE), or its own fire, which that driver kept in flight,
        is handed to this one.  Unless its stage is under way here already
        (carried on), it begins again: what the dead driver knew, and its
        follow-ups, may have died with it (a driver two deaths back;
        follow-ups a full wheel left in memory)."""
        key = fire.payload[1:]
        now = time.monotonic()
        self._carried = {k: t for k, t in self._carried.items() if now - t < FORGET_AFTER}
        self._ended = {k: t for k, t in self._ended.items() if now - t < FORGET_AFTER}
        if key in self._late or key in self._carried or key in self._ended or not there:
            return
        # Shortly after a takeover the dead driver's own follow-ups may still
        # be on their way (its SIGKILL kill_after after its kill signal):
        # carried on, they say its stage is under way.  Until they are all
        # due, this word waits, as a follow-up of this driver's.
        wait = self._took_over_at + self._follow_ups_within() - now
        if wait > 0 and fire.owner_pid != os.getpid():
            self._later(wait, KIND_LATE, fire.payload)
            return
        self._carried[key] = now
        if self.actions.log:
            _log.info(
                "%s: still running past its %s, which a driver before this one had begun to act on: its stages "
                "begin again",
                record.describe(),
                "warn_after" if self._warn_stage(record) else "timeout",
            )
        self._begin_again(fire, record, there)

    def _warn_stage(self, record: RequestRecord) -> bool:
        """Whether a request with a warn_after stage is not past its timeout yet."""
        return bool(record.warn) and not due(record.timeout_at() or 0, time.monotonic_ns())

    def _begin_again(self, fire: Fire, record: RequestRecord, there: bool) -> None:
        """The stage a request is at, begun again by a driver that does not
        know what the one that began it did."""
        if self._warn_stage(record):
            self._warned(fire, record, there)
        else:
            self._timed_out(fire, record, there)

    def _follow_ups_within(self) -> float:
        """Seconds within which a follow-up added at a request's timeout is
        due: the stack check, the interrupt's grace, the kill signal and the
        SIGKILL after it."""
        actions = self.actions
        return DUMP_TIME + actions.interrupt_grace + DUMP_TIME + actions.kill_after + 1.0

    def _heard(self, late: _Late | None, record: RequestRecord, key: bytes) -> None:
        """The worker's word about a request whose follow-ups are due, or
        that runs on past its interrupt's grace."""
        if late is None and record.kind != KIND_ANSWER and key in self._running_on:
            _, interrupted_at, timed_out_at = self._running_on.pop(key)
            if record.kind != KIND_FINISHED:
                pass
            elif interrupted_at:
                _log.info(
                    "%s ended %.3f s after it was interrupted", record.describe(), time.monotonic() - interrupted_at
                )
            elif self.actions.log:
                _log.info("%s finished %.3f s after it timed out", record.describe(), time.monotonic() - timed_out_at)
            return
        if late is None and record.kind != KIND_ANSWER and key in self._due:
            self._ended[key] = time.monotonic()  # its stage waits to begin again (_told_late): it need not
            return
        if late is None or late.ended:
            return
        if record.kind == KIND_ANSWER:
            late.answered = True
            return
        late.ended = True
        if record.kind == KIND_FINISHED and late.interrupted_at:
            self._counting().interrupted("ended")
            ended = time.monotonic() - late.interrupted_at
            _log.info("%s ended %.3f s after it was interrupted", record.describe(), ended)
        elif record.kind == KIND_FINISHED and late.stage == WARNED:
            _log.info("%s finished, %.3f s after it started", record.describe(), record.running_for())

    def _new_late(self, key: bytes, stage: str) -> _Late:
        now = time.monotonic()
        if len(self._late) > 64:  # the follow-ups of some were lost (a full wheel): not kept for ever
            self._late = {k: v for k, v in self._late.items() if now - v.since < FORGET_AFTER}
        late = self._late[key] = _Late(stage)
        return late

    def _stack_signals(self, record: RequestRecord, asked: bool) -> tuple[int, int]:
        """The signals to ask the worker with, if ``asked``: those its record names, if it catches them."""
        if not asked:
            return 0, 0
        stack = record.stack_signal if self._catches(record, record.stack_signal) else 0
        dump = record.dump_signal if record.dump_signal in DUMP_SIGNALS else 0
        return stack, dump if self._catches(record, dump) else 0

    def _warned(self, fire: Fire, record: RequestRecord, there: bool) -> None:
        """The request's warn_after stage: its stack, and its timeout stage added for later."""
        if there:
            self._counting().warning(record)
        timeout_at = record.timeout_at() or 0
        stack, dump = self._stack_signals(record, there and self.actions.tracebacks)
        if self.actions.log:
            if not there:
                then = "; the worker has exited"
            elif stack:
                then = f"; asking it for the request's stack ({signal_name(stack)})"
            else:
                then = ""
            line = (
                f"request is slow: {record.describe()}, running for {_running(record)}, "
                f"{(timeout_at - time.monotonic_ns()) / 1e9:.3f} s before its timeout{then}"
            )
            self._say(line, there)
        if not there:
            return
        key = fire.payload[1:]
        self._later(max(timeout_at - time.monotonic_ns(), 0) / 1e9, KIND_TIMEOUT, fire.payload)
        late = self._new_late(key, WARNED)
        if stack and self._signal(fire, record, stack, asked_value(record.started_ns, False)):
            late.asked_at = time.monotonic()
            self._later(DUMP_TIME / 2, KIND_CHECK, fire.payload)

    def _say(self, line: str, there: bool) -> None:
        """A stage's line: as it is, or, for a worker that has exited (one,
        or a forger's hundred thousand), through the once-a-second summary."""
        if there:
            _log.warning("%s", line)
        else:
            self._gone.add(line)

    def _timed_out(
        self, fire: Fire, record: RequestRecord, there: bool, by_hand: str = "", kill: bool | None = None
    ) -> None:
        """The request's timeout stage; or, ``by_hand``, the same stage now,
        which an operator asked for (``shmwheel end``: who, in words), with
        its kill stage if ``kill`` (None: as the actions say)."""
        actions = self.actions
        kill = actions.kill if kill is None else kill
        if there and by_hand:
            self._counting().ended_by_hand()
        elif there:
            self._counting().timeout(record)
        # A worker that ends its requests itself is signalled for that, even
        # with tracebacks off: the same signal has it look.
        stack, dump = self._stack_signals(record, there and (actions.tracebacks or record.interrupt or bool(by_hand)))
        interrupting = bool(stack) and record.interrupt
        if not actions.tracebacks and not interrupting and not by_hand:
            stack = dump = 0
        if actions.log or by_hand:  # (an operator's act is always said)
            # One line, written before the worker is signalled, so that it
            # comes ahead of the stack the worker writes.
            if not there:
                then = "; the worker has exited"
            else:
                steps = []
                if interrupting:
                    steps.append(f"asking it to end the request ({signal_name(stack)})")
                elif stack:
                    steps.append(f"asking it for the request's stack ({signal_name(stack)})")
                elif dump:
                    steps.append(f"asking it for every thread's stack ({signal_name(dump)})")
                if kill:
                    name = signal_name(actions.kill_signal)
                    if interrupting:
                        steps.append(f"then {name} if it has not ended {actions.interrupt_grace:g} s later")
                    else:
                        steps.append(f"then {name}")
                    steps[-1] += f", and SIGKILL {actions.kill_after:g} s after that"
                then = "; " + ", ".join(steps) if steps else ""
            what = f"request ended by hand ({by_hand})" if by_hand else "request timed out"
            line = (
                f"{what}: {record.describe()}, running for {_running(record)}"
                f"{' (redelivered after a driver restart)' if fire.redelivered else ''}{then}"
            )
            self._say(line, there)
        if not there:
            return
        key = fire.payload[1:]
        if stack:
            if not self._signal(fire, record, stack, asked_value(record.started_ns, ASK_END if by_hand else True)):
                self._late.pop(key, None)
                return
            late = self._new_late(key, TIMED_OUT)
            late.by_hand, late.kill = by_hand, kill
            late.asked_at = time.monotonic()
            self._later(DUMP_TIME / 2, KIND_CHECK, fire.payload)
            if interrupting:
                late.interrupted_at = time.monotonic()
                self._later(actions.interrupt_grace, KIND_GRACE, fire.payload)
        elif dump:
            self._late.pop(key, None)
            if self._signal(fire, record, dump, DUMP_ASKED, plain=False) and kill:
                # The dump runs in the worker's signal handler; a kill_signal
                # that lands before it is done can end the worker mid-dump
                # (uWSGI's SIGTERM exits at once), so it follows a little later.
                self._new_late(key, TIMED_OUT).kill = kill
                self._later(DUMP_TIME, KIND_GRACEFUL, fire.payload)
            elif not kill:
                self._runs_on(key, record, None, interrupted=False)
        elif kill:
            self._late.pop(key, None)
            self._graceful(fire, record)
        else:
            self._late.pop(key, None)
            self._runs_on(key, record, None, interrupted=False)

    def _catches(self, record: RequestRecord, signum: int) -> bool:
        """Whether the worker has a handler for ``signum``, which its record
        names (0: none): a signal it does not catch is not sent, since it
        could end the worker (a real-time signal's default action)."""
        if not signum:
            return False
        if signum not in STACK_SIGNALS.union(DUMP_SIGNALS) or signum == self.actions.kill_signal:
            _log.warning(
                "worker pid %d: its record names %s to ask it for a stack, which is no signal for that: not sent",
                record.pid,
                signal_name(signum),
            )
            return False
        how = signal_disposition(record.pid, signum)
        if how in ("caught", None):  # None: /proc cannot say; the pidfd's signal finds out
            return True
        _log.warning(
            "worker pid %d does not catch %s, which its records name to ask it for a stack (it %s it): not sent",
            record.pid,
            signal_name(signum),
            {"default": "leaves the default action to", "ignored": "ignores", "blocked": "blocks"}[how],
        )
        return False

    def _check(self, fire: Fire, record: RequestRecord, there: bool) -> None:
        """Half of DUMP_TIME after the stack signal, the signal once more if
        the worker has not answered; DUMP_TIME after it, the dump if it has
        still not; then, at a timeout that is not interrupted, the kill."""
        key = fire.payload[1:]
        late = self._late.get(key)
        if late is None or time.monotonic() - late.asked_at < DUMP_TIME / 4:
            return  # settled (it ended), or the check of its warn_after stage, which its timeout has overtaken
        waits = late.stage == WARNED or late.interrupted_at > 0  # a timeout stage or an interrupt check follows
        kill = self._kills(late)
        if not waits:
            self._late.pop(key, None)
        if not there:
            self._late.pop(key, None)
            return
        if late.ended:
            if not waits:
                self._finished(record)
            return
        if not late.answered and not late.asked_again and self._catches(record, record.stack_signal):
            # Once more before it is taken for one in which no Python runs.
            # On a standard signal plainly (every late request of the
            # worker): one that came while another was pending merged with
            # it, and the value that named this request was lost with it.
            # A real-time one queues: the same value again.
            late.asked_again = True
            value = 0
            if record.stack_signal >= signal.SIGRTMIN or late.by_hand:  # (an end by hand is never asked plainly)
                value = asked_value(record.started_ns, ASK_END if late.by_hand else late.stage != WARNED)
            if self._signal(fire, record, record.stack_signal, value):
                self._late[key] = late
                self._later(DUMP_TIME / 2, KIND_CHECK, fire.payload)
                return
        if self._dump(fire, record, late) and not waits and kill:
            self._late[key] = late
            self._later(DUMP_TIME, KIND_GRACEFUL, fire.payload)
            return
        if not waits and kill:
            self._graceful(fire, record, late)
        elif not waits:
            self._runs_on(key, record, late, interrupted=False)

    def _dump(self, fire: Fire, record: RequestRecord, late: _Late) -> bool:
        """faulthandler's dump of every thread, for a worker that has not
        answered and was not dumped yet, if it catches the dump signal;
        whether it was sent."""
        if late.answered or late.dumped_at or record.dump_signal not in DUMP_SIGNALS:
            return False
        if not self._catches(record, record.dump_signal):
            return False
        _log.warning(
            "worker pid %d did not write the stack of %s within %.3f s: no Python runs in it (a C call that holds "
            "the GIL?); asking it for faulthandler's dump of every thread on %s, to its stderr, which it writes "
            "where it can tell that no Python runs; the request's is thread 0x%016x",
            record.pid,
            record.describe(),
            time.monotonic() - late.asked_at,
            signal_name(record.dump_signal),
            record.thread,
        )
        # Queued with a value, which tells the worker's gate that this is the
        # driver's dump, let through only if no Python runs there (a plain
        # one, an operator's kill, is let through as faulthandler would);
        # never plainly, then.
        if not self._signal(fire, record, record.dump_signal, DUMP_ASKED, plain=False):
            return False
        late.dumped_at = time.monotonic()
        return True

    def _grace_over(self, fire: Fire, record: RequestRecord, there: bool) -> None:
        """interrupt_grace after the interrupt: a request that has not ended is logged, and with kill, killed;
        without, remembered until it ends (:meth:`_runs_on`)."""
        late = self._late.pop(fire.payload[1:], None)
        if not there or (late is not None and late.ended):
            return
        if late is not None and late.asked_again:
            self._dump(fire, record, late)  # its stack check is due with this: the dump comes first
        actions = self.actions
        kill = self._kills(late)
        wait = self._kill_waits(record)
        if not kill:
            then = "; it runs on (kill is off)"
        elif wait > 0:
            then = (
                f"; {signal_name(actions.kill_signal)} waits {wait:.3f} s more, until it is as late counted from "
                f"when its worker took it (it had queued {record.queued_ms / 1000:g} s by its X-Request-Start)"
            )
        else:
            then = f"; sending {signal_name(actions.kill_signal)}"
        _log.warning(
            "%s has not ended %g s after it was interrupted: it has not reached a point where it may be interrupted "
            "(a C call that has not returned, cleanup code, logging), or its code caught RequestTimeout%s",
            record.describe(),
            actions.interrupt_grace,
            then,
        )
        self._counting().interrupted("killed" if kill else "ran_on")
        if not kill:
            self._runs_on(fire.payload[1:], record, late)
            return
        if late is not None and late.dumped_at and time.monotonic() - late.dumped_at < DUMP_TIME:
            # faulthandler may be writing yet: kill_signal could end the worker mid-dump.
            self._late[fire.payload[1:]] = late
            self._later(DUMP_TIME, KIND_GRACEFUL, fire.payload)
            return
        self._graceful(fire, record, late)

    def _kills(self, late: _Late | None) -> bool:
        """Whether a request's kill stage follows: as the actions say, but for one ended by hand."""
        return self.actions.kill if late is None or late.kill is None else late.kill

    def _fired_early(self, fire: Fire, record: RequestRecord, there: bool) -> bool:
        """Whether a request's own timer fired before the timeout its record
        says, which the wheel never does by itself (its warn_after stage
        aside): someone moved it, which an operator's end by hand does
        through this driver (which knows it, and does not come here), or
        through a driver that died before the fire, or a process that
        writes the wheel by hand.  A dead driver's ask is still in flight:
        the stage it asked for begins now, by hand.  Otherwise nothing is
        done now (its worker would not take it for a timeout, and a kill
        stage would follow its silence), said once a second at most, and
        its timeout stage is added for its time, as a warn_after stage
        adds it: the request keeps its timeout."""
        timeout_at = record.timeout_at()
        now = time.monotonic_ns()
        if record.warn or timeout_at is None or due(timeout_at, now):
            return False
        key = fire.payload[1:]
        ask = self._ask_in_flight(key, record)
        if ask is not None:
            if len(self._asks_done) > 1024:
                self._asks_done.clear()
            self._asks_done[ask.handle] = key
            self._timed_out(fire, record, there, by_hand=ask.who, kill=ask.kill)
            return True
        self._early.add(
            lambda: (
                f"timer {fire.handle} of {record.describe()} fired {(timeout_at - fire.fired_at_ns) / 1e9:.3f} s "
                "before the request's timeout: it was moved (an end by hand whose driver died, or a process that "
                "writes the wheel by hand); not acted on but for its timeout stage, kept for its time"
            )
        )
        if there:
            self._later((timeout_at - now) / 1e9, KIND_TIMEOUT, fire.payload)
            self._new_late(key, WARNED)
        return True

    def _ask_in_flight(self, key: bytes, record: RequestRecord) -> _Ask | None:
        """An end by hand of the request, in flight: asked of a driver that
        died before the fire of the timer it moved; if its asker may."""
        for timer in self._open().timers():
            if timer.fired and timer.payload[:1] in _END_KINDS and timer.payload[1:] == key:
                who, why = self._asker(timer.owner_pid)
                if who is None:
                    _log.warning("%s was asked by hand to end, which is not done: %s", record.describe(), why)
                    return None
                return _Ask(who, timer.payload[0] == KIND_END_KILL, timer.handle)
        return None

    def _end_asked(self, fire: Fire, record: RequestRecord) -> None:
        """An operator's ``shmwheel end`` (``KIND_END``, ``KIND_END_KILL``):
        the request's timeout stage now.  Its own timer, if pending, is
        moved to now, and its fire begins the stage as its timeout would,
        marked as done by hand (with its kill stage, for --kill, whatever
        the actions say); so that whichever comes first, the request's end
        or the move, the wheel decides: a request that ended first has no
        timer to move, and one whose timer moved finds it fired when it
        ends, and says so.  One at its warn_after stage goes to its timeout
        stage at once; one past its timeout has had it, and with --kill
        goes on to its kill stage.  Only the wheel's owner, or root, may ask."""
        kill = record.kind == KIND_END_KILL
        key = fire.payload[1:]
        who, why = self._asker(fire.owner_pid)
        there = why is None and alive(record.pid, record.start)
        if why is None:
            why = self._refusal(record) if there else f"{record.describe()} has ended, and its worker is gone"
        if why is not None or who is None:
            _log.warning("%s was asked by hand to end, which is not done: %s", record.describe(), why)
            return
        late = self._late.get(key)
        if late is not None and late.stage == WARNED:
            now = time.monotonic_ns()
            taken = self._taken_by_hand
            if len(taken) > 1024:
                self._taken_by_hand = taken = {k: t for k, t in taken.items() if now - t < FORGET_AFTER * 1e9}
            taken[key] = record.timeout_at() or now
            self._timed_out(fire, record, there, by_hand=who, kill=kill)
            return
        if (late is not None and late.stage == TIMED_OUT) or key in self._running_on:
            if kill:
                _log.warning(
                    "%s, past its timeout, ended by hand (%s): its worker's kill stage", record.describe(), who
                )
                self._running_on.pop(key, None)
                if late is not None:
                    late.kill = True  # its grace, if still to come, leads to the kill stage under way
                self._graceful(fire, record, late)
            else:
                _log.warning(
                    "%s was asked by hand (%s) to end, but it is past its timeout and was asked to end already: "
                    "shmwheel end --kill goes on to its worker's kill stage",
                    record.describe(),
                    who,
                )
            return
        own = self._own_timer(key, record)
        if own is not None:
            if len(self._by_hand) > 1024:
                self._let_asks_go(math.inf)
            self._by_hand[key] = _Ask(who, kill, fire.handle)
            if own.fired and late is None and key not in self._kept:
                # Fired, and handed to this driver after this ask: its
                # warn_after stage, or its timeout, come at this moment; or
                # a driver that died after the move left both in flight.
                return  # that fire begins the stage, by hand
            if self._open().reset(own.handle, 0.0):
                return  # its fire begins the stage
            del self._by_hand[key]
        _log.info("%s was asked by hand (%s) to end, but it has ended already", record.describe(), who)

    def _asker(self, pid: int) -> tuple[str | None, str | None]:
        """Who asked for an end by hand, in words, or why the ask is refused:
        only a live process of the wheel's owner, or root, that uses the
        wheel by the kernel's word (the timer's owner is the segment's, which
        its writers can write)."""
        ids, start = uids(pid), start_time(pid)
        if ids is None or start is None:
            return None, f"pid {pid}, which asked, has exited"
        dev, ino = self._open().file_id()
        if not uses_file(pid, start, dev, ino):
            return None, f"pid {pid}, which the timer names as the asker, does not use wheel {self.name!r}"
        owner = self._open().owner()[0]
        if ids[1] not in (owner, 0):
            return None, f"pid {pid}, which asked, runs as uid {ids[1]}: only the wheel's owner (uid {owner}) or root"
        return f"shmwheel end, pid {pid}, uid {ids[1]}", None

    def _own_timer(self, key: bytes, record: RequestRecord) -> Timer | None:
        """The request's own timer, pending or in flight, if it is there: a
        pass over the wheel's timers, a few hundred at a time (an operator's
        ask, which comes seldom)."""
        own = bytes([KIND_REQUEST]) + key
        for timer in self._open().timers():
            if timer.owner_pid == record.pid and timer.payload == own:
                return timer
        return None

    def _runs_on(self, key: bytes, record: RequestRecord, late: _Late | None, interrupted: bool = True) -> None:
        """Keep a request that runs on past its stages (kill is off): past
        its interrupt's grace, or past its timeout without an interrupt.
        Its own fire stays in flight, so that what reads the wheel sees it
        (``shmwheel requests``), and its end, which its worker tells, is
        still said.

        Forgotten when its worker says it ended, or once its worker is gone
        (a worker that dies says nothing: its requests are looked for once
        a second, :meth:`look_after`, and each time another request begins
        to run on, one /proc read a worker).  Not after a time: a request
        that runs on may end an hour later, and that it did is what the
        line is for.  Its worker's word can also be lost while the worker
        lives (a wheel full to its reserve), so at most RUNNING_ON_KEPT are
        kept, the oldest let go first: past that many requests stuck at
        once, with kill off, the operator has more pressing news than when
        each of them ends."""
        now = time.monotonic()
        interrupted_at = late.interrupted_at if late is not None and late.interrupted_at else 0.0
        if interrupted and not interrupted_at:  # not known here (a driver that took over): the grace is over now
            interrupted_at = now - self.actions.interrupt_grace
        self._forget_gone()
        running_on = self._running_on
        while len(running_on) >= RUNNING_ON_KEPT:
            del running_on[next(iter(running_on))]
        running_on[key] = ((record.pid, record.start), interrupted_at, late.since if late is not None else now)

    def _forget_gone(self) -> None:
        """Let go of the requests running on in workers that are gone."""
        running_on = self._running_on
        gone = {worker for worker in {v[0] for v in running_on.values()} if not alive(*worker)}
        if gone:
            self._running_on = {k: v for k, v in running_on.items() if v[0] not in gone}

    def _finished(self, record: RequestRecord) -> None:
        _log.info("%s has finished since it timed out: worker pid %d is left alone", record.describe(), record.pid)

    def _open(self) -> Wheel:
        if self._wheel is None:
            self._wheel = attach(self.name)
        return self._wheel

    def _counting(self) -> Counts:
        if self._counts is None:
            self._counts = Counts(self._open(), self.actions)
        return self._counts

    def _later(self, delay: float, kind: int, payload: bytes) -> None:
        """A timer of this wheel that will bring the record back as ``kind``.
        One the wheel refuses (it is full) is kept in this process instead,
        and comes back from a thread of its own: a stage is never skipped
        for want of a slot."""
        follow_up = with_kind(payload, kind)
        key, now = payload[1:], time.monotonic()
        if len(self._due) > 1024:  # some were lost (a repair retired them): not counted for ever
            self._due = {k: v for k, v in self._due.items() if now - v[1] < FORGET_AFTER}
        count, since = self._due.get(key, (0, now))
        self._due[key] = (count + 1, since)
        try:
            wheel = self._open()
            try:
                wheel.add(delay, follow_up)
            except WheelFullError:
                # Into the reserve while at least half of it is free: the
                # rest is the workers', whose answers have no other way.
                if wheel.stats().free * 2 <= wheel.reserve:
                    raise
                wheel.add(delay, follow_up, reserved=True)
        except (ShmwheelError, OSError) as exc:
            self._hold(delay, follow_up, exc)

    def _hold(self, delay: float, follow_up: bytes, exc: Exception) -> None:
        """Keep a follow-up the wheel refused, due ``delay`` s from now."""
        now = time.monotonic()
        with self._held_ready:
            if self._held_pid != os.getpid():  # a fork's copy: what its parent kept is the parent's to bring back
                self._held, self._held_thread, self._held_pid = [], None, os.getpid()
            heapq.heappush(self._held, (time.monotonic_ns() + int(delay * 1e9), next(self._held_seq), follow_up))
            self._held_count += 1
            if self._held_thread is None or not self._held_thread.is_alive():
                self._held_thread = threading.Thread(target=self._bring_back, name="shmwheel-follow-ups", daemon=True)
                self._held_thread.start()
            self._held_ready.notify()
            say = now - self._held_said >= 60.0
            if say:
                self._held_said, count, self._held_count = now, self._held_count, 0
        if say:
            _log.warning(
                "%d follow-up%s could not be added to wheel %r (%s), so %s kept in the driver's memory, which a "
                "driver restart loses",
                count,
                "" if count == 1 else "s",
                self.name,
                one_line(exc),
                "it is" if count == 1 else "they are",
            )

    def _bring_back(self) -> None:
        """The thread that hands the kept follow-ups back to the handler when due."""
        me = os.getpid()
        while True:
            with self._held_ready:
                while not self._held or self._held[0][0] > time.monotonic_ns():
                    if not self._held:
                        # Nothing kept: the thread ends after a while (another
                        # starts with the next), so none lingers in a process
                        # that fills its wheel once.
                        if not self._held_ready.wait(HELD_IDLE) and not self._held:
                            self._held_thread = None
                            return
                        continue
                    self._held_ready.wait((self._held[0][0] - time.monotonic_ns()) / 1e9)
                due, _, follow_up = heapq.heappop(self._held)
            try:
                self(Fire(-1, due, time.monotonic_ns(), follow_up, me))
            except Exception:  # noqa: BLE001 - one failed follow-up must not end the others
                _log.exception("a kept follow-up failed")

    def _kill_waits(self, record: RequestRecord) -> float:
        """Seconds the kill stage of a request whose time counts from the
        proxy's X-Request-Start must wait yet: a worker is killed only for a
        request late by its own clock (its timeout, and the interrupt's
        grace, counted from when it took the request), so that no header,
        forged or not, is ever the reason for a kill."""
        own = record.own_timeout_at()
        if own is None:
            return 0.0
        if record.interrupt:
            own += int(self.actions.interrupt_grace * 1e9)
        return max(own - time.monotonic_ns(), 0) / 1e9

    def _graceful(self, fire: Fire, record: RequestRecord, late: _Late | None = None) -> None:
        """kill_signal to the request's worker, unless it is draining; or,
        for a request not late by its own clock yet, a follow-up for then,
        with what is known of the request (``late``) kept for it."""
        wait = self._kill_waits(record)
        if wait > 0:
            # Again then: the request may have ended by that time, which
            # its worker says (see _heard).
            key = fire.payload[1:]
            self._late[key] = late or self._late.get(key) or _Late(TIMED_OUT)
            self._later(wait, KIND_GRACEFUL, fire.payload)
            return
        worker = (record.pid, record.start)
        now = time.monotonic()
        self._draining = {w: t for w, t in self._draining.items() if now - t < FORGET_AFTER}
        name = signal_name(self.actions.kill_signal)
        sent = self._draining.get(worker)
        if sent is not None and now - sent < self.actions.kill_after + 1.0:
            # A second signal would only disturb its shutdown (Gunicorn's
            # gthread worker would raise SystemExit in the thread joins of
            # its exit, and drop the requests it is finishing).
            _log.warning(
                "worker pid %d is not sent %s again for %s: it was sent %s %.3f s ago and is draining its other "
                "requests; SIGKILL ends it %.3f s from now if it has not exited",
                record.pid,
                name,
                record.describe(),
                name,
                now - sent,
                sent + self.actions.kill_after - now,
            )
            return
        if self._signal(fire, record, self.actions.kill_signal):
            self._counting().kill()
            self._draining[worker] = now
            self._later(self.actions.kill_after, KIND_KILL, fire.payload)

    def _sigkill(self, fire: Fire, record: RequestRecord, there: bool) -> None:
        name = signal_name(self.actions.kill_signal)
        if not there:
            self._draining.pop((record.pid, record.start), None)
            _log.info("worker pid %d exited within %g s of %s (for %s)", record.pid, self.actions.kill_after, name,
                      record.describe())  # fmt: skip
            return
        how = signal_disposition(record.pid, self.actions.kill_signal)
        if self._signal(fire, record, signal.SIGKILL):
            self._counting().kill(sigkill=True)
            self._draining.pop((record.pid, record.start), None)
            after = f"{self.actions.kill_after:g} s after {name}"
            why = {
                "ignored": f"it was still there {after}, which it ignores",
                "blocked": f"it was still there {after}, which it blocks",
                "caught": f"it was still there {after}, which it handles: still draining its requests, or stuck",
            }.get(how or "", f"it was still there {after}")
            _log.error("killed worker pid %d with SIGKILL: %s (%s had run for %.3f s)", record.pid, why,
                       record.describe(), record.running_for())  # fmt: skip

    def _signal(self, fire: Fire, record: RequestRecord, signum: int, value: int = 0, plain: bool = True) -> bool:
        """``signum`` to the record's worker, if it is still there and still
        passes the uid rule right before the signal; whether it was sent.
        ``value``, queued with it, names the request and the stage asked
        about, so that the worker acts on no other before its line; not
        ``plain``, it is sent with it or not at all."""

        def may() -> bool:
            why = uid_refusal(record.pid) or self._not_using(record.pid, record.start, fresh=True)
            if why is not None:
                self._refuse(fire, record, why)
            return why is None

        return signal_if(record.pid, record.start, signum, may, value, plain)

    def _not_using(self, pid: int, start: int, fresh: bool = False) -> str | None:
        """Why ``pid`` (started at ``start``) is not a process that uses this
        wheel by the kernel's word, or None if it is.  The producer table and
        a fire's owner pid are the segment's, which anyone who can write the
        wheel can write; the kernel's maps and locks no one can.  Nor is the
        driver itself, or a process it was told to spare (:meth:`spare`: the
        server's master, which maps the wheel too), ever one to signal.

        A verdict is kept for USE_TTL, so that a forger's thousand records
        naming one process cost one reading; ``fresh``, right before a
        signal (the target's pidfd open, so that a pid reused since finds
        the signal going nowhere), a kept "no" is not enough to refuse a
        process the last look missed, and is looked at again."""
        if pid == os.getpid() or pid in self._spared:
            return f"pid {pid} is this driver, or the server's process that it watches, which it never signals"
        now = time.monotonic()
        kept = self._using.get((pid, start))
        if kept is not None and now - kept[0] < self.USE_TTL and (kept[1] is None or not fresh):
            return kept[1]
        dev, ino = self._open().file_id()
        uses = uses_file(pid, start, dev, ino)
        if uses:
            why = None
        elif uses is None:
            why = f"whether pid {pid} uses wheel {self.name!r} cannot be read from /proc"
        else:
            why = (
                f"pid {pid} neither maps wheel {self.name!r} (/proc/{pid}/maps) nor holds its lock (/proc/locks): "
                f"its producer table or the timer's owner says otherwise, which only a process that writes the "
                f"segment by hand makes it say"
            )
        if len(self._using) > 1024:
            self._using = {k: v for k, v in self._using.items() if now - v[0] < self.USE_TTL}
        self._using[(pid, start)] = (now, why)
        return why

    def _refusal(self, record: RequestRecord, fresh: bool = False) -> str | None:
        """Why the live process a record names, which added the timer, is not
        one this driver may signal for it, or None if it is."""
        if not self._is_producer(record.pid, record.start):
            return f"pid {record.pid} is not a process attached to wheel {self.name!r}"
        # The kernel's word too, before any line is written about the
        # request: a forgery is refused in a line a second, not logged as
        # a timeout first.
        return uid_refusal(record.pid) or self._not_using(record.pid, record.start, fresh)

    def _owner_refusal(self, fire: Fire, record: RequestRecord) -> str | None:
        """Why the timer is not one the process it names, or a driver whose
        follow-ups count, added; None if it is."""
        if record.kind in FOLLOW_UPS:
            # Only a driver adds follow-ups, so only this one's count, and
            # those of the driver it took the wheel over from, which died;
            # any other (an earlier driver's still) is not told from a
            # forgery, and is not acted on.
            me = os.getpid()
            if fire.owner_pid not in (me, self._predecessor or me):
                what = FOLLOW_UPS[record.kind]
                whose = f"this driver's (pid {me})"
                if self._predecessor:
                    whose += f" and the one it took over from (pid {self._predecessor})"
                return f"its {what} follow-up was added by pid {fire.owner_pid}, and only {whose} count"
        elif fire.owner_pid != record.pid and not (
            # A request's word that waits for the dead driver's follow-ups
            # to be due (_told_late): this driver's, or the one's it took over from.
            record.kind == KIND_LATE and fire.owner_pid in (os.getpid(), self._predecessor or os.getpid())
        ):
            return f"the timer was added by pid {fire.owner_pid}, not by the worker it names"
        return None

    def _producer_start(self, pid: int) -> int | None:
        """The start time of live producer ``pid``, from a reading of the
        table no older than PRODUCERS_TTL; None if it is none."""
        if time.monotonic() - self._producers_read >= self.PRODUCERS_TTL:
            self._producers_read = time.monotonic()
            self._producers = {p: s for p, s, live in self._open().producers() if live}
        return self._producers.get(pid)

    def _is_producer(self, pid: int, start: int) -> bool:
        """Whether (pid, start) is a live producer of the wheel: from the
        last reading of the table if it is recent and has it, else from a
        fresh one, so that a miss is never the answer of data older than
        PRODUCERS_FRESH."""
        age = time.monotonic() - self._producers_read
        if age < self.PRODUCERS_TTL and self._producers.get(pid) == start:
            return True
        if age < self.PRODUCERS_FRESH:
            return False  # read just now: a flood of forged records costs one reading per interval
        self._producers_read = time.monotonic()
        self._producers = {p: s for p, s, live in self._open().producers() if live}
        return self._producers.get(pid) == start

    def _refuse(self, fire: Fire, record: RequestRecord, why: str) -> None:
        self._refusals.add(
            lambda: f"timer {fire.handle} names {record.describe()} but is not acted on: {why}; nothing was signalled"
        )
        owner = fire.owner_pid
        start = self._producer_start(owner)  # a live producer: not a pid that another process may take next
        if start is not None and owner not in (os.getpid(), self._predecessor):  # never this driver's follow-ups
            if len(self._refusing) > 1024:
                self._refusing.clear()
            self._refusing[owner] = (time.monotonic(), start)

    def refuses_unread(self) -> tuple[list[int], bytes]:
        """For the dispatcher (:class:`shmwheel.Driver`): the processes whose
        timers it would refuse unread (:meth:`_refused_unread`), whose fires
        are taken out of a batch before any is read, and the kinds of
        record read all the same, a worker's words."""
        with self._lock:
            now = time.monotonic()
            return [owner for owner in list(self._refusing) if self._still_refusing(owner, now)], _WORD_BYTES

    def refused_unread(self, count: int, handle: int, pid: int) -> None:
        """The dispatcher took ``count`` fires out unread, as
        :meth:`refuses_unread` asked, the last of them ``handle`` of ``pid``."""
        self._refusals.add(lambda: _unread(handle, pid), count)

    def _refused_unread(self, fire: Fire) -> bool:
        """Refuse ``fire`` on its owner's pid alone, if a timer of that
        process was refused within USE_TTL and it is the same process: not
        a worker's word (an answer, a request finished), nor a fire a
        driver kept in flight."""
        if fire.owner_pid not in self._refusing or fire.kept or fire.payload[:1] in _WORDS:
            return False
        if not self._still_refusing(fire.owner_pid, time.monotonic()):
            return False
        self._refusals.add(lambda: _unread(fire.handle, fire.owner_pid))
        return True

    def _still_refusing(self, owner: int, now: float) -> bool:
        """Whether ``owner``'s timers are still refused unread: a refusal of
        the same process within USE_TTL.  One that has lapsed is forgotten."""
        when, start = self._refusing[owner]
        if now - when < self.USE_TTL and self._producers.get(owner) == start:
            return True
        del self._refusing[owner]
        return False

    @property
    def refused(self) -> int:
        """How many timers this handler has refused to act on (their records
        named a process it may not signal), since it was made."""
        return self._refusals.count
