"""The worker's side of request timeouts: one timer per request, carrying
its request record, added when the request comes in and cancelled when its
response is done.

:class:`RequestTimer` is what every server adapter uses.  It keeps the
table of this process's requests in progress, and sets up the signals on
which the driver asks for the stack of one that timed out
(:mod:`shmwheel.contrib._stacks`).
"""

from __future__ import annotations

import asyncio
import contextvars
import decimal
import logging
import math
import os
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Container, Iterable
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from .. import _process
from .._checks import check_seconds
from .._errors import SegmentNotFoundError, SegmentRemovedError, ShmwheelError, one_line
from .._process import after_fork, catch_up_fork, start_time
from .._segment import segment_name
from .._wheel import Wheel, attach
from ._body import file_wrapper_for, timed_file
from ._door import Clerk, core_of, enter, here, leave, new_table
from ._interrupt import interrupt, listen_for_wake
from ._record import (
    AT_STARTED,
    DEFAULT_TRACEBACK_SIGNAL,
    HEAD,
    INTERRUPT,
    KIND_ANSWER,
    KIND_FINISHED,
    KIND_LATE,
    KIND_RELEASED,
    KIND_REQUEST,
    MAGIC,
    PAYLOAD_SIZE,
    REQUEST_ID,
    WARN,
    RequestRecord,
    decode_request,
    due,
    encode_request,
    rearmed,
    with_kind,
)
from ._routes import Routes
from ._settings import TimeoutActions, TimeoutSettings
from ._stacks import (
    Active,
    TimedOut,
    ask_signal,
    keep_listening,
    listen,
    listening,
    own_frames,
    real,
    reporters,
    server_log,
    server_logger,
    view_of,
)

if TYPE_CHECKING:
    from ._autodriver import AutoDriver

__all__ = [
    "RequestTimer",
    "extend",
    "in_progress_here",
    "no_timeout",
    "queued_ns",
    "rearm_here",
    "timed_apps",
    "timer_here",
    "times_requests",
]

_log = logging.getLogger("shmwheel.timeouts")

LOOK_INTERVAL_NS = 1_000_000_000  # how often a worker checks that its wheel's name still names it
#: How long, and how many, requests that ended after their timer fired are
#: remembered, to be said again to a driver that carries on a dead one's
#: stages (a restart takes about a second, and a stage begun again waits
#: until the dead driver's follow-ups would all have been due).
ENDED_FOR = 60.0
ENDED_KEPT = 64
BY_HAND_KEPT = 64  # requests ended by hand whose end this process has not seen yet, before the gone are let go
_STARTED = struct.Struct("<q")


def started_of(active: Active) -> int:
    """The start of the request (its record's started_ns): which an ask by hand names it by."""
    return int(_STARTED.unpack_from(active.payload, AT_STARTED)[0])


KEEP_OLD = 2  # wheels replaced under a worker that it keeps open for the cancels of their requests
ATTACH_TRIES = 3  # an AutoDriver's wheel may be removed between its making and the attach: made again

#: The middlewares (WSGI, ASGI) made in this process: a server adapter that
#: cannot time requests itself looks here to tell whether the application
#: has been wrapped.
timed_apps: weakref.WeakSet[object] = weakref.WeakSet()

# Every RequestTimer of this process, so that a forked child can give each a
# lock of its own: the parent's may have been held, by a thread the child
# does not have, at the moment of the fork.
_request_timers: weakref.WeakSet[RequestTimer] = weakref.WeakSet()


@after_fork
def _new_locks() -> None:
    for timer in list(_request_timers):
        timer._lock = threading.Lock()


_monotonic_ns = time.monotonic_ns
_pack = HEAD.pack


class Ender(Protocol):
    """A request that its adapter ends at its interrupt (the ASGI middleware's)."""

    def end(self) -> bool:
        """In the request's event loop, at the interrupt: whether its task is still to be cancelled."""


class RequestTimer:
    """A worker's request timers: :meth:`start` when a request comes in,
    :meth:`finish` when its response is done.

    ``traceback_signal`` is the signal on which this process writes the
    stacks of its requests that timed out (None: it cannot be asked).  The
    driver asks on the next free real-time signal after the dump signal,
    where its asks queue with their values, and on ``traceback_signal``
    only where none is free; ``traceback_signal`` stays for an operator's
    ``kill``.  faulthandler dumps every thread on a real-time signal,
    :data:`DUMP_SIGNAL` or the next free one, when no Python can run to
    answer.  Each request's record names both signals it is asked on, so
    a driver asks the way the worker listens.

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

    def __init__(
        self,
        name: str,
        timeout: float,
        *,
        traceback_signal: int | None = DEFAULT_TRACEBACK_SIGNAL,
        auto_driver: AutoDriver | None = None,
        warn_after: float | None = None,
        interrupt: bool = False,
        routes: Routes | None = None,
        on_timeout: Callable[[RequestRecord, str], object] | None = None,
        stacks: bool = True,
    ) -> None:
        settings = TimeoutSettings(
            timeout, warn_after=warn_after, interrupt=interrupt, routes=routes, on_timeout=on_timeout,
            traceback_signal=traceback_signal, actions=TimeoutActions(tracebacks=stacks),
        )  # fmt: skip
        self._set_up(name, settings, auto_driver, settings.traceback_signal)  # type: ignore[arg-type]  # an int

    @classmethod
    def of(
        cls, name: str, settings: TimeoutSettings, auto_driver: AutoDriver | None = None, *, always_listen: bool = False
    ) -> RequestTimer:
        """The timer of an adapter's ``settings`` (checked when they were
        made) on wheel ``name``.  Its process listens on ``settings.signal``,
        or with ``always_listen`` on ``settings.traceback_signal`` even where
        nothing asks: as a RequestTimer made by hand does, so that an
        operator's ``kill -SIGNAL`` of a custom signal never takes the
        signal's default action."""
        timer = cls.__new__(cls)
        listen = settings.traceback_signal if always_listen else settings.signal
        timer._set_up(name, settings, auto_driver, listen)  # type: ignore[arg-type]  # checked: an int or None
        return timer

    def _set_up(
        self, name: str, settings: TimeoutSettings, auto_driver: AutoDriver | None, traceback_signal: int | None
    ) -> None:
        segment_name(name)  # a bad name fails here, not at the first request
        self.name = name
        self.settings = settings
        #: Makes the wheel and starts its driver when there is none (the
        #: ASGI middleware's own wheel); without it both come from elsewhere.
        self.auto_driver = auto_driver
        self.timeout = settings.timeout
        self.warn_after = settings.warn_after
        self.traceback_signal = traceback_signal
        self.interrupt = settings.interrupt
        self.on_timeout = settings.on_timeout
        #: Whether the worker writes a late request's stack to the server's log.
        self.stacks = settings.actions.tracebacks
        self._routes = settings.lookup
        self._warn_ns = 0 if self.warn_after is None else round(self.warn_after * 1e9)
        self._interrupted: set[int] = set()  # handles of the requests interrupted
        # Requests an operator ended by hand (shmwheel end), by their start
        # (the record's started_ns): past their timeout from then on.
        self._by_hand: dict[int, int] = {}
        # Requests that ended after their timer fired: record: when (tell_ended_again).
        self._ended_late: dict[bytes, float] = {}
        self._driver_seen: tuple[int, int] | None = None  # the wheel's driver (pid, start) as last seen
        self._ended_lock = threading.Lock()
        # Held while an interrupt is made and logged, while a 504 is logged,
        # and while the driver is told that a late request has ended:
        # "interrupting" comes first in the log, even when the request is
        # answered or ends (in its thread, or its loop's) before the
        # reporter has finished saying how.  A real lock: the reporter is a
        # real thread, under gevent too.
        self._saying = real("_thread", "RLock")()
        # The server's wsgi.file_wrapper last seen, and what stands for it (see _timing_file_wrapper).
        self._file_wrapper: tuple[object, Any] = (None, None)
        #: Handles of the requests whose code is the application's right now,
        #: kept by the adapters that answer an interrupted request (``gated``):
        #: a request only ever sees its interrupt there, never in the
        #: server's code that writes its response, which would cut the
        #: response short.  One that is not there when its timeout comes is
        #: interrupted when it next enters the application, if it does.
        self.in_app: set[int] = set()
        self.gated = False
        #: What ends an asyncio request at its interrupt, by handle, set by the
        #: ASGI middleware: its end(), run in the loop's thread before the task
        #: is cancelled, says whether the task still is (_interrupt.interrupt).
        self.enders: dict[int, Ender] = {}
        self._lock = threading.Lock()
        self._pid = 0
        self._wheel: Wheel | None = None
        # start() and finish() in C, on the wheel's lock tried with the GIL
        # kept (shmwheel._fast): made with each attach, dropped with its wheel.
        self._fast: Any = None
        self._start_time = 0
        self._size = PAYLOAD_SIZE
        self._retry_at = 0.0
        self._warned_at = -math.inf
        self._look_at = 0  # time.monotonic_ns() when to check the name still names our wheel
        self._old: list[Wheel] = []  # wheels replaced under us, for the cancels of their requests
        self._timeout_ns = round(self.timeout * 1e9)
        self._timeout_ms = -(-self._timeout_ns // 1_000_000)
        self._delay = (self._timeout_ns if self.warn_after is None else self._warn_ns) / 1e9  # to the first stage
        self._flags = INTERRUPT if settings.interrupt else 0  # the record's flags every request of this timer has
        self._stack_signal = 0  # the signals this process listens on, as its records name them
        self._dump_signal = 0
        self._active = new_table()  # handle: a request of this process in progress
        self._getcurrent: Any = None  # greenlet.getcurrent, once greenlets are in use here
        # The OS thread's id, as faulthandler and sys._current_frames() name
        # it: under gevent's or eventlet's monkey-patching threading.get_ident()
        # is the current greenlet's id instead.
        self._get_ident: Callable[[], int] = threading.get_ident
        self._said_unheard = 0  # the process that has said its reporters hear of none of its timeouts
        _request_timers.add(self)

    def prepare(self) -> bool:
        """Attach this process and register the traceback signal now rather
        than on the first request; True if the wheel is there.  Called from
        a server's post-fork hook, it also sees a fork made without Python's
        fork hooks (uWSGI's), which start() sees only within a second."""
        catch_up_fork()
        return self._ready() is not None

    def _ready(self) -> Wheel | None:
        pid = _process.pid
        wheel = self._wheel  # once: another thread may drop it meanwhile
        if self._pid == pid and wheel is not None:
            return wheel
        if catch_up_fork():
            pid = _process.pid
        with self._lock:
            if self._pid != pid:  # first use in this process: forked, or new
                self._pid = pid
                self._wheel = None
                self._drop_fast()
                self._old = []
                self._active = new_table()
                self._interrupted = set()
                self._by_hand = {}
                self._ended_late = {}
                self._driver_seen = None
                self._ended_lock = threading.Lock()
                self._saying = real("_thread", "RLock")()
                self.in_app = set()
                self.enders = {}
                self._getcurrent = getattr(sys.modules.get("greenlet"), "getcurrent", None)
                self._get_ident = real("_thread", "get_ident")
                self._start_time = start_time(pid) or 0
                self._listen()
            if self._wheel is None and time.monotonic() >= self._retry_at:
                try:
                    wheel = self._attach()
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
                self._fast = self._make_fast(wheel)
                wheel.show_use(self._start_time)  # what the driver checks before it signals this process
            return self._wheel

    def _drop_fast(self) -> None:
        """Let go of the C Clerk (under self._lock): retired, so that the
        WSGI callables and bodies that kept it ask for the next."""
        fast, self._fast = self._fast, None
        if fast is not None:
            fast.retire()

    def _make_fast(self, wheel: Wheel) -> Any:
        """The C start() and finish() for ``wheel`` in this process (under
        self._lock), or None for a wheel closed meanwhile."""
        core = core_of(wheel)
        if core is None:
            return None
        warn = 0 < self._warn_ns < self._timeout_ns
        head = _pack(
            KIND_REQUEST, 0, 0, self._flags | (WARN if warn else 0), self._pid, self._start_time, 0, 0, 0,
            self._stack_signal, self._dump_signal, MAGIC, self._timeout_ms, 0,
        )  # fmt: skip
        return Clerk(
            core=core, head=head, due_ns=self._warn_ns if warn else self._timeout_ns, timeout_ns=self._timeout_ns,
            size=self._size, table=self._active, interrupted=self._interrupted, var=_current, owner=self,
            getcurrent=self._getcurrent, interrupt=self.interrupt, warn_ns=self._warn_ns, look_ns=LOOK_INTERVAL_NS,
            current_tasks=getattr(asyncio.tasks, "_current_tasks", None), current_task=asyncio.current_task,
        )  # fmt: skip

    def _listen(self) -> None:
        """Set up the stack signals in this process (under self._lock)."""
        self._stack_signal = self._dump_signal = 0
        say_unheard([self])
        if self.traceback_signal is None:
            return
        try:
            dump = listen(self.traceback_signal, lambda: list(_request_timers))
        except OSError as exc:
            self._warn(f"a timed-out request's stack cannot be asked for: {one_line(exc)}")
            return
        # The driver asks on a real-time signal, whose asks queue with their
        # values; on the traceback signal itself where none is free.
        self._stack_signal, self._dump_signal = ask_signal() or self.traceback_signal, dump
        if self.interrupt:
            listen_for_wake()  # in the main thread (a sync worker's): its C calls can be ended too

    def _attach(self) -> Wheel:
        """This process's attach of the wheel; with an AutoDriver, the wheel
        made first if it is missing, and a driver started if none runs."""
        auto = self.auto_driver
        if auto is None:
            return attach(self.name)
        for tries in range(1, ATTACH_TRIES + 1):
            auto.make_wheel()
            try:
                wheel = attach(self.name)
            except SegmentNotFoundError:  # removed by its driver, which had just found it unused
                if tries == ATTACH_TRIES:
                    raise
                continue
            if not auto.after_server_log or server_log() is not None:
                self._drive(auto)
            # Else at the first request (start() looks at once): the driver
            # writes where the server logs, and Hypercorn sets its log up
            # only once it serves, after its lifespan startup.
            return wheel
        raise AssertionError("unreachable")

    def _drive(self, auto: AutoDriver) -> None:
        try:
            auto.ensure_running()
        except OSError as exc:
            self._warn(f"no driver could be started, so no request times out: {one_line(exc)}")

    def start(
        self,
        method: str,
        path: str,
        request_id: str | None = None,
        task: Any = None,
        queued_since: str | None = None,
    ) -> int | None:
        """Add the request's timer; return its handle, or None if it has none.

        ``task`` is the asyncio or trio task that runs the request, if it
        runs in one; a request in a greenlet (gevent, eventlet) is found by
        itself.  ``queued_since`` is the proxy's ``X-Request-Start``
        header, from which the request's time is counted when it is sane
        (see :func:`queued_ns`).  The handle stays the request's for
        :meth:`finish` even if :func:`extend` gives it another timer."""
        now = _monotonic_ns()
        fast = self._fast
        plain = queued_since is None and self._routes is None  # the timer's own timeout, from now
        if fast is None:
            if now >= self._look_at:
                self._look(now)
        elif plain:
            handle: int | None = fast.start(now, method, path, request_id, task)  # it looks once a second itself
            if handle is not None:
                return handle
        if plain:
            return self._start_slow(now, method, path, request_id, task, self._timeout_ns, now)
        times = self._times(now, method, path, queued_since)
        if times is None:
            return None  # exempt by its route
        timeout_ns, started = times
        if fast is not None:
            handle = fast.start(now, method, path, request_id, task, timeout_ns, started)
            if handle is not None:
                return handle
        return self._start_slow(now, method, path, request_id, task, timeout_ns, started)

    def start_declined(self, method: str, path: str, request_id: str | None = None, task: Any = None) -> int | None:
        """start() for a request the C path had and gave back having tried
        it (the lock held by another process, a record to cut, an error):
        the waiting path at once, never the C path again.  For the adapters,
        whose requests take no route and no X-Request-Start."""
        now = _monotonic_ns()
        return self._start_slow(now, method, path, request_id, task, self._timeout_ns, now)

    def _times(self, now: int, method: str, path: str, queued_since: str | None) -> tuple[int, int] | None:
        """The request's timeout by its route, and its start by the proxy's
        X-Request-Start, in ns; None if its route has no timeout."""
        timeout_ns = self._timeout_ns
        if self._routes is not None:
            try:
                route_ns = self._routes(method, path)
            except Exception as exc:  # noqa: BLE001 - the user's callable: never a failed request
                self._warn(f"routes({method!r}, {path!r}) failed, so the default timeout applies: {one_line(exc)}")
            else:
                if route_ns is None:
                    return None
                timeout_ns = route_ns
        if queued_since is not None and (queued := queued_ns(queued_since, time.time_ns())):
            # At most its whole timeout: a request that queued that long is
            # due as it starts.  The driver's kill counts from now all the same.
            return timeout_ns, now - min(queued, timeout_ns)
        return timeout_ns, now

    def _start_slow(
        self, now: int, method: str, path: str, request_id: str | None, task: Any, timeout_ns: int, started: int
    ) -> int | None:
        """start() for what its C path gives back: a record to cut, a wheel
        to attach, the lock held by another process (here the add releases
        the GIL while it waits), an error."""
        wheel = self._wheel
        if wheel is None or self._pid != _process.pid:
            wheel = self._ready()
            if wheel is None:
                return None
        warn = 0 < self._warn_ns < timeout_ns
        due = started + (self._warn_ns if warn else timeout_ns)
        if timeout_ns == self._timeout_ns and started == now:
            delay = self._delay  # to the first stage, in seconds, for the default timeout
        else:
            delay = max(due - now, 0) / 1e9
        if request_id is not None and not REQUEST_ID.fullmatch(request_id):
            request_id = None  # the record's own id, from the worker's pid and the start, stands in
        thread = self._get_ident()
        kind = ""
        if task is not None:
            kind = "task"
        elif self._getcurrent is not None:
            current = self._getcurrent()
            if current.parent is not None:  # not the thread's own: a greenlet that serves the request
                task, kind = current, "greenlet"
        try:
            payload = encode_request(
                KIND_REQUEST, self._pid, self._start_time, started, method, request_id or "", path, self._size,
                thread=thread, task=0 if task is None else id(task), task_kind=kind,
                stack_signal=self._stack_signal, dump_signal=self._dump_signal,
                timeout_ms=-(-timeout_ns // 1_000_000), warn=warn, interrupt=self.interrupt,
                queued_ms=-(-max(now - started, 0) // 1_000_000),
            )  # fmt: skip
            handle: int | None = wheel.add(delay, payload, cancel_on_exit=True)
        except SegmentRemovedError:  # removed or replaced: the name may hold another wheel now
            handle = self._add_again(wheel, delay, payload)
        except (ShmwheelError, ValueError) as exc:
            self._warn(f"a request runs without a timeout: {exc}")
            return None
        if handle is None:
            return None
        self._active[handle] = Active(payload, due, thread, task, handle, started + timeout_ns, self.interrupt)
        if task is None:
            enter(self, handle)
        else:
            _current.set((self, handle))
        return handle

    def _look(self, now: int) -> None:
        """Once a second, from start(): that the wheel's name still names
        this wheel, that its driver runs, and that this is the process that
        the pid kept names."""
        self._look_at = now + LOOK_INTERVAL_NS
        if catch_up_fork():
            return
        if self._pid != _process.pid:
            return  # not attached in this process yet
        if self._stack_signal and self._stack_signal in keep_listening():
            with self._lock:  # its records must not name it: the traceback signal, if still ours; else none
                traceback_signal = self.traceback_signal or 0
                self._stack_signal = traceback_signal if listening(traceback_signal) else 0
                if self._fast is not None and self._wheel is not None:
                    self._drop_fast()
                    self._fast = self._make_fast(self._wheel)
        current = self._wheel  # once: another thread may drop it meanwhile
        if current is not None and not current.is_current():  # removed by hand (rm, an old unlink)
            self._replaced(current)
        elif current is not None and self.auto_driver is not None:  # its driver may have died
            self._drive(self.auto_driver)
        if current is not None:
            # Again, and after _drive, which opens and closes the wheel's
            # file: closing any descriptor of it lets this process's go.
            current.show_use(self._start_time)

    def _add_again(self, wheel: Wheel, delay: float, payload: bytes) -> int | None:
        """The add of a request whose wheel was removed or replaced: on the name's wheel now, if any."""
        self._replaced(wheel)
        again = self._ready()
        if again is None:
            return None
        try:
            return again.add(delay, payload, cancel_on_exit=True)
        except (ShmwheelError, ValueError) as exc:
            self._warn(f"a request runs without a timeout: {exc}")
            return None

    def _add(self, wheel: Wheel, delay: float, payload: bytes) -> int | None:
        try:
            return wheel.add(delay, payload, cancel_on_exit=True)
        except SegmentRemovedError:
            return self._add_again(wheel, delay, payload)

    def in_progress(self) -> dict[int, Active]:
        """A copy of this process's table of requests in progress, by handle."""
        return self._active.copy()

    def interrupted(self, handle: int | None) -> bool:
        """Whether the request of ``handle`` has been interrupted at its timeout."""
        return handle in self._interrupted

    def answered_timeout(self, handle: int | None) -> None:
        """Say, in the server's log, that the interrupted request of
        ``handle`` was answered 504: the one line a timed-out request's end
        gets, at WARNING, where a framework that saw the RequestTimeout
        would have logged an error (none does: it is a BaseException)."""
        active = None if handle is None else self._active.get(handle)
        record = None if active is None else decode_request(active.payload)
        with self._saying:
            if record is None:
                server_logger().warning("shmwheel: a timed-out request was answered 504 Gateway Timeout")
                return
            what, running = record.describe(), record.running_for()
            how = "was ended by hand" if active is not None and started_of(active) in self._by_hand else "timed out"
            server_logger().warning("shmwheel: %s %s: answered 504 Gateway Timeout, after %.3f s", what, how, running)

    def timed_out(
        self, handle: int, active: Active, record: RequestRecord, stack: str, frames: dict[int, FrameType]
    ) -> bool:
        """The request of ``handle`` is past its timeout and its driver has
        asked: the worker's hook and the reporters (an error tracker's),
        then the interrupt.  In the reporter thread; ``frames`` are every
        thread's, as its stack was taken.  Whether a reporter was told, and
        so has something to flush (``_stacks.flush_reporters``)."""
        if self.on_timeout is not None:
            try:
                self.on_timeout(record, stack)
            except Exception:  # noqa: BLE001 - the user's hook: logged, and the interrupt goes ahead
                server_logger().exception("shmwheel: on_timeout(%s) failed", record.describe())
        told = reporters()
        if told:
            try:
                own = own_frames(active, frames)
                timed_out = TimedOut(record, stack, own, view_of(own), active.thread, active.task)
            except Exception:  # noqa: BLE001 - a frame it could not read: the report goes without
                server_logger().exception("shmwheel: the frames of %s could not be read", record.describe())
                timed_out = TimedOut(record, stack, (), None, active.thread, active.task)
            for reporter in told:
                try:
                    reporter.report(timed_out)
                except Exception:  # noqa: BLE001 - logged, and the interrupt goes ahead
                    server_logger().exception("shmwheel: %r could not report %s", reporter, record.describe())
        self._interrupt(handle, active, record)
        return bool(told)

    def _interrupt(self, handle: int, active: Active, record: RequestRecord) -> None:
        if not active.interrupt or handle in self._interrupted:
            return
        self._interrupted.add(handle)

        def mine() -> bool:  # in any thread: whether the code running there is this request's
            current = _current.get()
            return current is not None and current[0] is self and current[1] == handle

        ender = self.enders.get(handle)
        end = None if ender is None else ender.end
        with self._saying:
            if not self.gated:
                how = interrupt(active.thread, active.task, lambda: handle in self._active, mine, end)
            elif handle in self.in_app:
                how = interrupt(active.thread, active.task, lambda: handle in self.in_app, mine, end)
            else:
                how = "its response is being written: it is ended if it goes back into the application"
            by_hand = " (ended by hand: shmwheel end)" if started_of(active) in self._by_hand else ""
            server_logger().warning("shmwheel: interrupting %s%s: %s", record.describe(), by_hand, how)

    def answer(self, payload: bytes) -> None:
        """Tell the driver that the stack of the request ``payload`` names has been written."""
        self._tell(payload, KIND_ANSWER)

    def _tell(self, payload: bytes, kind: int) -> None:
        """A timer due at once, which the driver hears: the request ``payload`` names, as ``kind``."""
        wheel = self._wheel
        if wheel is None:
            return
        try:
            wheel.add(0.0, with_kind(payload, kind), reserved=True)
        except (ShmwheelError, ValueError) as exc:
            _log.debug("wheel %r: the driver could not be told about a timed-out request: %s", self.name, exc)

    def current_handle(self) -> int | None:
        """The handle of this timer's request in progress here, if any."""
        current = _here()
        return current[1] if current is not None and current[0] is self else None

    def finish(self, handle: int | None) -> None:
        """Cancel the request's timer (nothing if it had none or it fired).

        The wheel it was added to may have been replaced since, and none
        attached again yet: its timer is still cancelled there, or a request
        that ended in time would be timed out by a driver that still drives
        the old wheel."""
        if handle is None or self._pid != _process.pid:
            return
        fast = self._fast
        if fast is not None:  # True: cancelled; else as below, the lock held by another, say
            active = fast.finish(handle)
            if active is None or active is True:
                return
        else:
            active = self._active.pop(handle, None)
            leave(self, handle)
            if active is None:  # exempted by no_timeout(), or finished already
                return
            if self._interrupted:
                self._interrupted.discard(handle)
        self._finished(active)

    def _timing_file_wrapper(self, wrapper: object) -> Any:
        """The stand-in for a server's ``wsgi.file_wrapper`` that is a
        function (:func:`shmwheel.contrib._body.file_wrapper_for`), made once
        for the last one seen; None to leave it.  Also for shmwheel._fast's
        Clerk.wsgi."""
        seen, timing = self._file_wrapper
        if wrapper is not seen:
            timing = file_wrapper_for(wrapper, self)
            self._file_wrapper = (wrapper, timing)
        return timing

    def _file_body(self, body: Any, wrapper: type, handle: int) -> Any:
        """For shmwheel._fast's Clerk.wsgi: :func:`shmwheel.contrib._body.timed_file`."""
        return timed_file(body, wrapper, self, handle)

    def _finished(self, active: Active) -> None:
        """The rest of finish() for a request taken out of the table whose
        timer the C path did not cancel (also from shmwheel._fast.Body)."""
        if self._cancel(active.handle) is not False:
            return
        # Not cancelled: its timer has fired (at its deadline, or moved to
        # now by an operator's end by hand, whose ask may not have come
        # yet), and the driver is acting on a request that has ended.
        # Told, it leaves the worker alone; and the fire it keeps in flight
        # while its stages run is freed, so that no driver that takes over
        # begins them again.
        self._by_hand.pop(started_of(active), None)
        self._acknowledge(active.handle)
        with self._saying:  # the driver's "ended … after it was interrupted" after "interrupting"
            self._tell(active.payload, KIND_FINISHED)
        now = time.monotonic()
        with self._ended_lock:
            ended = self._ended_late
            ended[active.payload] = now
            if len(ended) > ENDED_KEPT:
                del ended[next(iter(ended))]

    def end_by_hand(self, handle: int) -> bool:
        """An operator ended the request of ``handle`` by hand (``shmwheel
        end``): its driver moved its timer to now and asks it to end.  From
        now on it is past its timeout here, as at its timeout (in the
        reporter thread).  Whether it is still in progress."""
        active = self._active.get(handle)
        if active is None:
            return False  # it ended first: its finish() found its timer fired, and told the driver
        by_hand = self._by_hand
        by_hand.setdefault(started_of(active), time.monotonic_ns())
        if len(by_hand) > BY_HAND_KEPT:  # (of requests whose end no finish() saw: a fork's, say)
            live = {started_of(a) for a in self._active.copy().values()}
            self._by_hand = {s: t for s, t in by_hand.items() if s in live}
        return True

    def ended_by_hand(self, handle: int) -> bool:
        """Whether the request of ``handle`` was ended by hand (end_by_hand)."""
        active = self._active.get(handle)
        return active is not None and started_of(active) in self._by_hand

    def tell_again(self, asked: Container[tuple[bytes, bool]]) -> None:
        """To a driver other than the one last seen (in the reporter thread,
        at each stack signal and once a second while a request is late):
        which requests ended after their timer fired, in the last ENDED_FOR
        seconds, and which still run past their timeout, which a driver
        asked about (``(record, True)`` in ``asked``).  The one that died may
        have taken the first word with it, and the follow-ups of its stages:
        its successor carries on the stages it knows of, and begins again,
        from the timeout, those only the worker knows of now (a driver two
        deaths back, or follow-ups a full wheel left in its memory)."""
        wheel = self._wheel
        if wheel is None:
            return
        try:
            stats = wheel.raw_stats()
        except ShmwheelError:
            return
        if not stats.driver_pid:
            return  # none runs now: the next one is told, whoever saw the last
        driver = (stats.driver_pid, stats.driver_start)  # a new driver with a dead one's pid is new all the same
        now = time.monotonic()
        with self._ended_lock:
            ended = self._ended_late
            for payload in [p for p, at in ended.items() if now - at > ENDED_FOR]:
                del ended[payload]
            if driver == self._driver_seen:
                return
            first, self._driver_seen = self._driver_seen is None, driver
            again = list(ended)
        for payload in again:
            self._tell(payload, KIND_FINISHED)
        if first:
            return  # the driver that asked is the one seen now
        for active in self.in_progress().values():
            if (active.payload, True) in asked:
                self._tell(active.payload, KIND_LATE)

    def _cancel(self, handle: int) -> bool | None:
        """Cancel timer ``handle`` in whichever of this process's wheels has
        it (each wheel has its own key, so a handle cancels nothing in
        another); whether it was, or None if the wheel failed."""
        current, old = self._wheel, self._old  # once each: other threads replace them, never change them
        try:
            for wheel in (current, *old) if current is not None else old:
                if wheel.cancel(handle):
                    return True
        except ShmwheelError as exc:
            self._warn(f"cancelling a request's timer failed: {exc}")
            return None
        return False

    def _acknowledge(self, handle: int) -> None:
        """Free the fire of timer ``handle``, which the driver keeps in flight
        while the request's stages run (KEEP_IN_FLIGHT), in whichever of
        this process's wheels has it."""
        current, old = self._wheel, self._old
        try:
            for wheel in (current, *old) if current is not None else old:
                if wheel.acknowledge([handle]):
                    return
        except ShmwheelError:
            pass  # the wheel is gone: so is the fire

    def rearm(self, handle: int, seconds: float | None, *, from_start: bool = False) -> bool:
        """Give the request of ``handle`` ``seconds`` from now, or with
        ``from_start`` from its start (None: no timeout at all); False if it
        has no timer, or has timed out."""
        active = self._active.get(handle)
        if active is None or handle in self._interrupted or self._pid != _process.pid:
            return False
        if started_of(active) in self._by_hand:
            return False  # an operator ended it
        now = time.monotonic_ns()
        cancelled = self._cancel(active.handle)
        if cancelled is None:
            return False
        if not cancelled:
            if due(active.timeout_ns, now):
                return False  # its timeout has fired: the driver is acting on it
            if not due(active.deadline_ns, now):
                return False  # fired before its deadline: an operator's end by hand, whose ask is on its way
            # Its warn_after stage has fired, and the driver holds its
            # timeout stage: told, it drops that.
            self._acknowledge(active.handle)
            self._tell(active.payload, KIND_RELEASED)
        if seconds is None:
            self._active.pop(handle, None)
            return True
        ns = round(seconds * 1e9)
        record = decode_request(active.payload)
        wheel = self._ready()
        if record is None or wheel is None:
            self._active.pop(handle, None)
            return False
        if from_start:
            ns = max(record.started_ns + ns - now, 0)
            seconds = ns / 1e9
        payload = rearmed(active.payload, -(-(now + ns - record.started_ns) // 1_000_000))
        try:
            new = self._add(wheel, seconds, payload)
        except (ShmwheelError, ValueError) as exc:
            self._warn(f"a request runs on without a timeout: {exc}")
            new = None
        if new is None:
            self._active.pop(handle, None)
            return False
        self._active[handle] = active._replace(payload=payload, deadline_ns=now + ns, handle=new, timeout_ns=now + ns)
        return True

    def _replaced(self, wheel: Wheel) -> None:
        """``wheel`` was removed or replaced: attach the name again at the next start."""
        with self._lock:
            if self._wheel is not wheel:
                return  # another thread saw it first
            self._wheel = None
            self._drop_fast()
            self._retry_at = 0.0
            # A new list, not the old one changed: a finish() in another
            # thread may be walking that.  The oldest is let go, not closed,
            # for the same reason; the collector unmaps it once unused.
            self._old = [wheel, *self._old][:KEEP_OLD]
        _log.info("wheel %r: it was removed or replaced; attaching the name again", self.name)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= 60.0:
            self._warned_at = now
            _log.warning("wheel %r: %s", self.name, message)


# The request in progress in this context (thread, asyncio task, greenlet):
# its timer and handle, for extend() and no_timeout().
_current: contextvars.ContextVar[tuple[RequestTimer, int] | None] = contextvars.ContextVar(
    "shmwheel_request", default=None
)


def _here() -> tuple[RequestTimer, int] | None:
    """The request in progress here, and its timer: the one this thread
    runs itself, if this is no greenlet but the thread's own; else the one
    of this context (its task's, its greenlet's, or one that a copy of the
    context was taken in).  None if neither is in progress."""
    mine = here()
    if mine is not None and mine[1] in mine[0]._active:
        greenlet = sys.modules.get("greenlet")
        if greenlet is None or greenlet.getcurrent().parent is None:
            return mine
    current = _current.get()
    return current if current is not None and current[1] in current[0]._active else None


def timer_here() -> RequestTimer | None:
    """The timer of the request in progress here (this thread's, task's or
    greenlet's), if one is."""
    current = _here()
    return None if current is None else current[0]


def say_wrapped_twice(middleware: str, app: object, settings: TimeoutSettings, wheel_env: str) -> None:
    """Say that the application ``app``, wrapped in ``middleware`` (with
    ``settings``) inside another that times its requests already, is timed
    by the outer one, whose settings win: an application wrapped twice, by
    hand, or by hand and by Gunicorn's ``install()`` (on the wheel that
    ``wheel_env`` names), which wraps it again unless this is the
    application itself.  From within a request the outer one times."""
    outer = timer_here()
    inner = f"{getattr(app, '__module__', None) or '?'}.{getattr(app, '__qualname__', type(app).__qualname__)}"
    whose = ""
    if outer is not None:
        whose = f" ({outer.settings.summary()}, on wheel {outer.name!r}"
        if outer.name == os.environ.get(wheel_env):
            whose += ": under Gunicorn, install() wraps the application in one"
        whose += ")"
    server_logger().warning(
        "shmwheel: %s is wrapped in %s (%s) inside another, which times its requests already%s: the outer one's "
        "settings win, and this one's do nothing; wrap the application once",
        inner,
        middleware,
        settings.summary(),
        whose,
    )


def extend(seconds: float) -> bool:
    """Give the request in progress ``seconds`` from now before it times
    out, whatever its timeout was: for an upload, a streaming response that
    makes progress.  Its warn_after stage, if it had one yet to come, is
    dropped.  Returns False, changing nothing, if this request has no timer
    (none is in progress here, its route has none, it was exempted) or if
    it has timed out already: too late."""
    return rearm_here("extend", check_seconds(seconds, "seconds", positive=True))


def no_timeout() -> bool:
    """Exempt the request in progress from its timeout; False if it had no
    timer, or has timed out already (too late)."""
    return rearm_here("no_timeout", None)


_told_none_here = False


def in_progress_here() -> bool:
    """Whether a request of this process's timers is in progress here (this
    thread's, task's or greenlet's)."""
    return _here() is not None


def say_unheard(timers: Iterable[RequestTimer] | None = None) -> None:
    """Say, once a process and timer, that an error tracker's reporter is
    told of none of the timer's timeouts: with no stacks and no stage its
    driver never asks the worker, and the worker never knows.  Called for
    a timer as it is first used in a process, and for every timer
    (``timers`` None) as a reporter is added."""
    if not reporters():
        return
    for timer in list(_request_timers) if timers is None else timers:
        if timer.settings.signal is None and timer._said_unheard != _process.pid:
            timer._said_unheard = _process.pid
            server_logger().warning(
                "shmwheel: wheel %r: its timeouts reach no error tracker (%s): with no stacks and no stage its "
                "driver never asks the worker about a late request (turn stacks on, or interrupt)",
                timer.name,
                ", ".join(map(repr, reporters())),
            )


def timed_out_here() -> bool:
    """Whether the request in progress here (this thread's, task's or
    greenlet's) is past its timeout: whatever ends it now, the interrupt or
    the kill stage's signal, is the timeout's doing."""
    current = _here()
    if current is None:
        return False
    active = current[0]._active.get(current[1])
    return active is not None and active.timeout_ns <= time.monotonic_ns()


def times_requests() -> bool:
    """Whether anything in this process times requests: a RequestTimer, or
    an adapter that makes one at its first request."""
    return bool(_request_timers) or bool(timed_apps)


def rearm_here(what: str, seconds: float | None, from_start: bool = False) -> bool:
    """extend(), no_timeout() and request_timeout on the request in
    progress here (``from_start``: ``seconds`` counted from its start).  Where
    none is, said once a process in the server's log if a request that a
    plain thread runs is in progress in another thread, which only that
    thread reaches (the call may come from code the request handed to a
    thread of its own: an async view under asgiref)."""
    global _told_none_here
    current = _here()
    if current is not None:
        return current[0].rearm(current[1], seconds, from_start=from_start)
    if _told_none_here:
        return False
    me = real("_thread", "get_ident")()
    for timer in list(_request_timers):
        for active in timer.in_progress().values():
            if active.task is None and active.thread != me:
                _told_none_here = True
                server_logger().warning(
                    "shmwheel: %s() was called in thread 0x%016x, which runs no request, while thread 0x%016x "
                    "runs one: under a threaded WSGI server a request is its thread's, and code it runs in another "
                    "thread (an async view, which asgiref runs in a thread of its own) cannot reach it",
                    what, me, active.thread,
                )  # fmt: skip
                return False
    return False


#: How long a request may have queued by its X-Request-Start header: a
#: longer wait is taken for a clock that differs from the proxy's.
MAX_QUEUED_NS = 3600 * 1_000_000_000
_UNITS = ((10**17, 1), (10**14, 1_000), (10**11, 1_000_000))  # ns, us, ms since the epoch: above these


def queued_ns(header: str, now_ns: int) -> int:
    """How long a request waited before its worker took it, from the proxy's
    ``X-Request-Start`` header (``t=1700000000.123``, ``t=1700000000123456``,
    seconds, milliseconds, microseconds or nanoseconds since the epoch, as
    nginx, Heroku and HAProxy set it), at wall-clock ``now_ns``; 0 if the
    header says nothing sane (in the future, or older than an hour: clocks
    that disagree)."""
    text = header.strip()
    if text.startswith("t="):
        text = text[2:]
    try:
        value = decimal.Decimal(text)  # exact: a float would round away the microseconds
    except decimal.InvalidOperation:
        return 0
    if not value.is_finite() or value <= 0:
        return 0
    scale = next((s for above, s in _UNITS if value > above), 1_000_000_000)
    queued = now_ns - int(value * scale)
    return queued if 0 <= queued <= MAX_QUEUED_NS else 0
