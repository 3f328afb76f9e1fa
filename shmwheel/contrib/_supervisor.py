"""Supervision: the request-timeout wheel, the driver process that drives
it, and their lifetime.

:func:`create_wheel` makes a wheel (or takes over one a restarted driver
finds); :class:`DriverSupervisor` runs the driver, ``python -m
shmwheel.contrib.timeouts``, as a child of a server's master, restarts it
if it dies and removes the wheel when the server stops; the driver watches
that master (:func:`watch_parent`) and removes the wheel itself if it is
killed outright.  A server that drops privileges hands both to the
workers' user (``owner``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from .._checks import check_owner, check_seconds
from .._errors import (
    CorruptSegmentError,
    DriverRunningError,
    DriverStartError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmwheelError,
)
from .._process import alive
from .._results import WheelStats
from .._segment import bare_name, segment_name, wheel_stat
from .._wheel import Wheel, create, observe, unlink
from ._logs import LogTarget
from ._record import PAYLOAD_SIZE, signal_name
from ._settings import COMMAND, DEFAULT_CAPACITY, TimeoutActions, reserve_for, shards_for

__all__ = [
    "IDLE_EXIT",
    "LOG_FORMAT",
    "DriverSupervisor",
    "create_wheel",
    "terminate",
    "watch_parent",
    "watch_use",
]

_log = logging.getLogger("shmwheel.timeouts")

# Gunicorn's layout, so that the driver's lines sit well among the server's.
LOG_FORMAT = "[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s"
PARENT_POLL = 0.5  # s: how often to look for the parent without a pidfd
#: Seconds a ``--while-used`` driver goes on with no process using its
#: wheel before it removes the wheel and exits: time for a server to start
#: a worker in place of one that died, when it was the only one.
IDLE_EXIT = 2.0
USE_POLL = 1.0  # s: how often a --while-used driver looks at who uses its wheel


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
            create(name, capacity=capacity, tick=tick, payload_size=PAYLOAD_SIZE, reserve=reserve_for(capacity),
                   shards=shards_for(capacity), owner=owner).close()  # fmt: skip
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
            reserve = -(-reserve_for(capacity) // st.shards) * st.shards  # as create() divides it
            if st.reserve != reserve:  # made by an earlier version, with workers on it: kept
                _log.info("wheel %r keeps %d slots in reserve, not %d, until it is made again",
                          name, st.reserve, reserve)  # fmt: skip
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
    # The capacity as create() makes it: rounded up to a multiple of the
    # shards.  A wheel of another shard count is taken over all the same.
    made = -(-capacity // st.shards) * st.shards
    if (st.capacity, st.payload_size) != (made, PAYLOAD_SIZE) or not math.isclose(st.tick, tick):
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

    #: Seconds between two looks at the driver.
    POLL = 0.1
    #: The shortest time between two starts of a driver that keeps dying:
    #: a crash loop costs a start twice a second, and no request goes
    #: untimed for more than about this plus POLL.
    MIN_LIFE = 0.5
    #: How often a crash loop is said in the log, at most: one line a
    #: minute with the deaths since the last one.
    SAY_EVERY = 60.0

    def __init__(
        self,
        name: str,
        actions: TimeoutActions | None = None,
        *,
        capacity: int = DEFAULT_CAPACITY,
        tick: float = 0.001,
        start_timeout: float = 30.0,
        owner: tuple[int, int] | None = None,
        log_target: LogTarget | None = None,
    ) -> None:
        segment_name(name)
        self.owner = None if owner is None else check_owner(owner)
        self.log_target = log_target
        self.name = name
        self.actions = actions or TimeoutActions()
        self.capacity = capacity
        self.tick = tick
        self.start_timeout = check_seconds(start_timeout, "start_timeout", positive=True)
        self.restarts = 0
        self._deaths = 0  # since the last line that said so
        self._said = -math.inf
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
                terminate(proc, timeout)
        with contextlib.suppress(SegmentNotFoundError):
            unlink(self.name)

    def restart(self, actions: TimeoutActions | None = None) -> None:
        """Replace the driver by a new one (with new ``actions``); fires in
        flight are redelivered to the new one."""
        with self._lock:
            if actions is not None:
                self.actions = actions
            if self._proc is not None:
                terminate(self._proc, 30.0)
            self._spawn()

    def _spawn(self) -> None:
        cmd = [sys.executable, "-m", COMMAND, self.name, f"--parent={os.getpid()}", *self.actions.as_args()]
        if self.owner is not None:
            cmd += [f"--user={self.owner[0]}", f"--group={self.owner[1]}"]
        if self.log_target is not None:
            cmd += self.log_target.as_args()
        # Out of the server's process group: the terminal's Ctrl-C (SIGINT to
        # the foreground group) would stop the driver while the server still
        # runs, and the watcher would log its death and start another.
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        self._proc = proc
        self._started = time.monotonic()
        give_up = self._started + self.start_timeout
        with observe(self.name) as wheel:
            while wheel.stats().driver_pid != proc.pid:
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
        """Restart a driver that died, within a second: the requests' timers
        go on being added meanwhile, and a new driver fires what came due
        and carries on the stages the dead one began.  A crash loop is
        restarted just as soon, no more than twice a second, and said once
        a minute."""
        while not self._stopping.wait(self.POLL):
            with self._lock:
                proc = self._proc
                # poll() also sees a driver that the server reaped itself (a
                # master that waits for any child): ECHILD reads as gone.
                if proc is None or proc.poll() is None:
                    continue
                lived = time.monotonic() - self._started
            self._say_died(proc, lived)
            if self._stopping.wait(max(self.MIN_LIFE - lived, 0.0)):
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

    def _say_died(self, proc: subprocess.Popen[bytes], lived: float) -> None:
        now = time.monotonic()
        self._deaths += 1
        if now - self._said < self.SAY_EVERY:
            return
        status = proc.returncode
        if status is not None and status < 0:
            how = f"was killed by {signal_name(-status)}"
        elif status:
            how = f"exited with status {status}"
        else:  # 0: or the server reaped it (Gunicorn's master waits for any child), and its status is gone
            how = "is gone"
        more = f", and {self._deaths - 1} more died in the last {self.SAY_EVERY:g} s" if self._deaths > 1 else ""
        _log.error(
            "wheel %r: the driver (pid %d) %s after %.1f s%s; starting another (a driver that dies again is "
            "restarted as soon, and said once a minute)",
            self.name, proc.pid, how, lived, more,
        )  # fmt: skip
        self._said, self._deaths = now, 0


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, wait up to ``timeout`` for the graceful stop, then SIGKILL."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def watch_parent(parent: int, on_exit: Callable[[], object]) -> None:
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
                time.sleep(PARENT_POLL)
        on_exit()

    threading.Thread(target=watch, name="shmwheel-parent", daemon=True).start()


def watch_use(name: str, on_unused: Callable[[str, bool], object], idle_exit: float = IDLE_EXIT) -> None:
    """Call ``on_unused(why, gone)`` (from a daemon thread) once no process but
    this one has been attached to wheel ``name`` for ``idle_exit`` seconds
    (``gone`` False), or the name no longer names the wheel it named at the
    call, removed or replaced by someone else (``gone`` True).  A process in another PID namespace counts
    as using it: its liveness cannot be told from here."""
    wheel = observe(name)
    me = os.getpid()

    def watch() -> None:
        idle_since: float | None = None
        while True:
            time.sleep(USE_POLL)
            try:
                if not wheel.is_current():
                    on_unused("it was removed or replaced", True)
                    return
                used = any(p.alive is not False and p.pid != me for p in wheel.producers())
            except ShmwheelError as exc:  # a lock held too long, a scribble: the driver says what
                _log.debug("wheel %r: who uses it is not known now: %s", name, exc)
                continue
            now = time.monotonic()
            if used:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= idle_exit:
                on_unused(f"no process has used it for {idle_exit:g} s", False)
                return

    threading.Thread(target=watch, name="shmwheel-use", daemon=True).start()
