"""The driver: the one process per wheel that advances the clock and hands the
fires to a handler.

Two threads besides the main one:

* the clock (``shmw_driver_clock``, in C without the GIL) sleeps in
  FUTEX_WAIT until the earliest non-empty bucket is due, or until a
  producer adds an earlier timer, and moves what is due onto the segment's
  in-flight list, stamping ``fired_at``; a slow handler never holds it up;
* the dispatcher takes the in-flight fires not yet handed out
  (``shmw_driver_take``, which sleeps without the GIL until the clock fires
  some), calls the handler for each, and acknowledges a batch once its
  handlers have returned, which frees the slots.  For an external consumer
  the second thread is a writer instead (``shmw_driver_writer``): it writes
  the fires as fixed-size records to an fd or a named FIFO, whose reader
  reads them with :class:`FireReader` and acknowledges them itself; a slow
  reader blocks the writer and only it.

Delivery is exactly once while the driver lives.  If it dies (SIGKILL, a
crash), whatever was in flight (fired, handler not finished or not yet
acknowledged) stays in the segment, and the next driver, or poll(), hands
it out again with ``redelivered`` set: at least once across driver crashes.
A handler whose work outlives its call (a stage that ends seconds later)
returns :data:`KEEP_IN_FLIGHT`: the fire stays in flight, marked ``kept``,
until the handler acknowledges it itself (:meth:`Wheel.acknowledge`), so
that a driver that takes over is handed it again, knowing it had been.

Any process that maps the segment can scribble on it.  When the clock or the
dispatcher meets something that makes no sense, and on a periodic audit,
the driver repairs the segment (:meth:`Wheel.repair`) and goes on: the
healthy timers keep firing, and entries too damaged to fire are retired,
each logged.  It never stops, or crash-loops, over a scribble.
"""

from __future__ import annotations

import errno
import gc
import logging
import math
import multiprocessing as mp
import os
import queue
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._binding import ffi, lib
from ._checks import LOCK_TIMEOUT, check_lock_timeout
from ._errors import CorruptSegmentError, DriverStartError, LockTimeoutError
from ._process import start_time
from ._results import Fire, decode_fires
from ._wheel import Wheel, attach, observe

__all__ = [
    "KEEP_IN_FLIGHT",
    "Driver",
    "DriverProcess",
    "FireReader",
    "Handler",
    "OutputFailed",
    "dedicated_process",
    "start_driver",
]

_log = logging.getLogger("shmwheel.driver")

Handler = Callable[[Fire], object]


class _KeepInFlight:
    __slots__ = ()

    def __repr__(self) -> str:
        return "shmwheel.KEEP_IN_FLIGHT"


#: What a handler returns to keep its fire in flight: not acknowledged
#: with its batch, but marked ``kept``; the handler acknowledges it with
#: :meth:`Wheel.acknowledge` once its work is done.  A driver that takes the
#: wheel over first is handed it again, with ``redelivered`` and ``kept`` set.
KEEP_IN_FLIGHT: Any = _KeepInFlight()

_CLOCK_BATCH = 1024  # fires per lock hold
_SEND_BATCH = 512  # fires taken per lock hold: a dispatcher's batch, or one write(2)
_READ_SIZE = 1 << 18
_REAP_INTERVAL = 1.0  # seconds between looks for producers that have exited
#: Seconds between audits of the whole segment (Wheel.repair).  An audit
#: holds the lock for O(capacity): 0.6 ms for the 65,536 slots of a
#: request-timeout wheel, 5 ms for a million (bench machine), so it is rare.
AUDIT_INTERVAL = 10.0
_REPAIR_GIVE_UP = 3  # operations failing in a row on a segment a repair finds sound


def _log_fire(fire: Fire) -> None:
    _log.warning(
        "timer %d fired %.3f ms after its deadline: payload %r (owner pid %d)%s",
        fire.handle,
        fire.lateness * 1e3,
        fire.payload,
        fire.owner_pid,
        (", redelivered" if fire.redelivered else "") + (", kept by a driver before" if fire.kept else ""),
    )


class Driver:
    """Drives one wheel: ``run()`` blocks until :meth:`stop` is called.

    ``handler`` is called once per fire in a thread of this process (by
    default each fire is logged); its exceptions are logged and counted,
    never fatal.  With ``fd`` (an inherited, writable file descriptor) or
    ``fifo`` (a path; the driver opens it for writing) the records go to an
    external consumer instead, which reads them with :class:`FireReader`.
    Every ``audit_interval`` seconds (None: never) the driver checks the
    whole segment and repairs it if a scribble broke it; it also repairs at
    once whenever one of its own operations meets corruption.  A lock not
    released within ``lock_timeout`` is said in the log (who holds it) and
    waited out: never a reason for the driver to stop.

    A handler may also say whose fires it refuses without reading them, so
    that a flood of them costs a few nanoseconds each, not a call: its
    ``refuses_unread()`` returns the owner pids and the payloads' first
    bytes it reads all the same (a kept fire is always read); the
    dispatcher takes those fires out of each batch before any Fire is
    made, acknowledges them, and tells ``refused_unread(count, handle,
    pid)``: how many, and the last one's handle and owner.  A handler's
    ``look_after()``, if it has one, is called about once a second from
    the driver's main thread, beside the driver's own periodic jobs.
    """

    def __init__(
        self,
        name: str,
        handler: Handler | None = None,
        *,
        fd: int | None = None,
        fifo: str | os.PathLike[str] | None = None,
        ack_timeout: float = 10.0,
        audit_interval: float | None = AUDIT_INTERVAL,
        lock_timeout: float = LOCK_TIMEOUT,
    ) -> None:
        if fd is not None and fifo is not None:
            raise ValueError("give fd or fifo, not both")
        if handler is not None and (fd is not None or fifo is not None):
            raise ValueError("a handler runs in this process; fd and fifo send the fires elsewhere")
        if handler is not None and not callable(handler):
            raise TypeError(f"handler must be callable, not {type(handler).__name__}")
        if audit_interval is not None and not (isinstance(audit_interval, (int, float)) and audit_interval > 0):
            raise ValueError(f"audit_interval must be a positive number of seconds or None, not {audit_interval!r}")
        self.name = name
        self._handler = handler or _log_fire
        self._kept: list[int] = []  # the batch's fires its handler kept in flight
        self._external = fd is not None or fifo is not None
        self._fd = fd
        self._fifo = fifo
        self._ack_timeout = ack_timeout
        self._audit_interval = audit_interval
        self._lock_timeout = check_lock_timeout(lock_timeout)
        self._repair_lock = threading.Lock()  # the clock, the dispatcher and the audit may all find it
        self._stuck_said = -math.inf
        self._unseen: set[tuple[int, int]] = set()  # producers in another PID namespace, reported once
        # stop() sets the flag and writes a byte to the pipe, which the
        # main loop waits on.  Not a threading.Event: stop() is called from
        # signal handlers, which run on the main thread, and the main thread
        # may be inside Event.wait() holding the Event's lock, so Event.set()
        # there deadlocks.  A write(2) takes no lock.
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._clock_stop = ffi.new("int *")
        self._send_stop = ffi.new("int *")  # stops the dispatcher's takes, or the writer
        self._wheel: Wheel | None = None
        self.handler_errors = 0
        self.fired = 0
        self._refused = 0  # the handler's count of refused fires, as last put in the segment

    def stop(self) -> None:
        """Ask ``run()`` to finish: safe from a signal handler or another thread."""
        self._stopping = True
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full (a stop is pending anyway), or closed by __del__
            pass

    def _wait_stop(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for stop(); whether it was called."""
        if not self._stopping:
            select.select([self._wake_r], [], [], timeout)
        return self._stopping

    def __del__(self) -> None:
        for fd in (getattr(self, "_wake_r", -1), getattr(self, "_wake_w", -1)):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def run(self, on_ready: Callable[[], object] | None = None) -> None:
        """Register, drive until stopped, then finish the fires in flight and deregister."""
        while True:  # a lock held too long (a stopped process, a jammed word) is waited out, and said
            try:
                # Not as a producer: attaching as one takes a sound segment.
                wheel = observe(self.name, lock_timeout=self._lock_timeout)
                break
            except LockTimeoutError as exc:
                self._say_stuck(exc)
                if self._wait_stop(0):
                    return
        self._wheel = wheel
        me, my_start = os.getpid(), start_time(os.getpid())
        assert my_start is not None
        try:
            self._register(wheel, me, my_start)
            try:
                self._drive(wheel, me, on_ready)
            finally:
                rc = lib.shmw_driver_register(wheel.core, 0, 0, me, my_start)
                if rc not in (0, lib.SHMW_ENOTDRIVER):
                    raise wheel.error(rc)
                _log.info("driver %d: stopped on wheel %r", me, self.name)
        finally:
            wheel.close()

    # -- internals ----------------------------------------------------------

    def _register(self, wheel: Wheel, me: int, my_start: int) -> None:
        """Register as the wheel's driver, taking over from one that is gone
        (:meth:`Wheel.take_over_driver`) and repairing a segment a scribble
        broke first: a driver that cannot start is a driver that restarts
        for ever, and nothing fires meanwhile."""
        gone = gone_start = 0

        def register() -> int:
            nonlocal gone, gone_start
            rc, st = wheel.take_over_driver(me, my_start)
            gone, gone_start = st.driver_pid, st.driver_start
            if rc == 0 and st.inflight:
                _log.warning(
                    "driver %d: redelivering %d fire%s left in flight", me, st.inflight, "" if st.inflight == 1 else "s"
                )
            return rc

        while True:
            try:
                rc = self._repairing(wheel, "the registration", register)
            except LockTimeoutError as exc:  # from the stats
                self._say_stuck(exc)
                if self._wait_stop(0):
                    raise
                continue
            if rc == 0:
                if gone:
                    _log.warning("driver %d: took over wheel %r from driver %d, which is gone", me, self.name, gone)
                    # A handler that keeps state across fires (a request
                    # timeout's stages) may carry on what that one began.
                    took_over = getattr(self._handler, "took_over", None)
                    if callable(took_over):
                        took_over(gone, gone_start or 0)
                return
            if rc != lib.SHMW_ENOTDRIVER:
                raise wheel.error(rc)

    def _drive(self, wheel: Wheel, me: int, on_ready: Callable[[], object] | None) -> None:
        out_fd = None
        if self._external:
            out_fd = self._open_output()
            if out_fd is None:
                return  # asked to stop while waiting for the FIFO's reader
        errors: list[BaseException] = []

        def clock() -> None:
            rc = self._repairing(
                wheel, "the clock", lambda: lib.shmw_driver_clock(wheel.core, self._clock_stop, _CLOCK_BATCH)
            )
            if rc:
                errors.append(wheel.error(rc))
                self.stop()

        def writer(fd: int) -> None:
            buf = ffi.new("char[]", _SEND_BATCH * wheel.fire_record.size)
            try:
                rc = self._repairing(
                    wheel,
                    "the writer",
                    lambda: lib.shmw_driver_writer(wheel.core, fd, self._send_stop, buf, _SEND_BATCH),
                )
                if rc == lib.SHMW_EIO:
                    errors.append(OSError(ffi.errno, f"writing fires failed: {os.strerror(ffi.errno)}"))
                elif rc:  # taking them out of the segment failed: ECORRUPT, ELOCK...
                    errors.append(wheel.error(rc))
                if rc:
                    self.stop()
            finally:
                os.close(fd)  # the reader sees EOF once everything is sent

        def dispatch() -> None:
            try:
                self._dispatch(wheel)
            except OutputFailed as exc:
                # How a pipeline ends (`--jsonl | head -1`), not a failure of ours: no traceback.
                _log.info("driver %d: stopping: writing the fires failed (%s)", me, exc.error.strerror)
                errors.append(exc.error)
                self.stop()
            except BaseException as exc:
                _log.exception("driver %d: the dispatcher failed", me)
                errors.append(exc)
                self.stop()

        clock_thread = threading.Thread(target=clock, name="shmwheel-clock", daemon=True)
        if out_fd is not None:
            sender = threading.Thread(target=writer, args=(out_fd,), name="shmwheel-writer", daemon=True)
        else:
            sender = threading.Thread(target=dispatch, name="shmwheel-dispatch")
        sender.start()
        clock_thread.start()
        try:
            _log.info("driver %d: running on wheel %r", me, self.name)
            self._handler_looks_after(me)  # once now: what it keeps in the wheel is there from the start
            if on_ready is not None:
                on_ready()
            # Meanwhile, cancel the cancel-on-exit timers of producers that
            # have gone, once a second, and audit the segment now and then:
            # the periodic jobs, in Python.
            audit_at = time.monotonic() + (self._audit_interval or math.inf)
            while not self._wait_stop(_REAP_INTERVAL):
                try:
                    self._look_after(wheel, me, audit=time.monotonic() >= audit_at)
                except LockTimeoutError as exc:
                    self._say_stuck(exc)
                if time.monotonic() >= audit_at:
                    audit_at = time.monotonic() + (self._audit_interval or math.inf)
        finally:
            # Graceful stop, and on any way out: no new fires; hand out what
            # has fired; let the handlers finish and acknowledge.  The
            # threads use the mapping, so they must be gone before run()
            # closes the wheel.
            lib.shmw_driver_set_state(wheel.core, me, lib.SHMW_DRIVER_STOPPING)
            self._clock_stop[0] = 1
            lib.shmw_wake(wheel.core)
            clock_thread.join()
            self._send_stop[0] = 1
            lib.shmw_wake(wheel.core)
            sender.join()
            if self._external:
                self._await_external_acks(wheel)
        if errors:
            raise errors[0]

    def _look_after(self, wheel: Wheel, me: int, audit: bool) -> None:
        """The periodic jobs: the producers that have gone, those this driver
        cannot see, and now and then an audit of the whole segment."""
        try:
            n = wheel.reap_dead_producers()
        except CorruptSegmentError:
            self._repair(wheel, "the reaper")
            n = 0
        if n:
            _log.info("driver %d: cancelled %d timers of producers that exited", me, n)
        self._report_unseen(wheel, me)
        self._handler_looks_after(me)
        if audit:
            self._repair(wheel, "the audit")

    def _handler_looks_after(self, me: int) -> None:
        """The handler's own periodic job, if it has one."""
        look_after = getattr(self._handler, "look_after", None)
        if look_after is not None:
            try:
                look_after()
            except Exception:  # noqa: BLE001 - the reaper and the audit go on
                _log.exception("driver %d: the handler's look_after() failed", me)

    def _repair(self, wheel: Wheel, who: str) -> bool:
        """Repair the segment if it needs it, and log what was wrong; whether it did."""
        with self._repair_lock:
            before = wheel.stats().quarantined
            reason = wheel.repair()
            if reason is None:
                return False
            lost = wheel.stats().quarantined - before
            _log.error(
                "driver %d: wheel %r is corrupt (%s, found by %s); repaired it%s",
                os.getpid(),
                self.name,
                reason,
                who,
                f", retiring {lost} entr{'y' if lost == 1 else 'ies'} too damaged to fire" if lost else "",
            )
            return True

    def _repairing(self, wheel: Wheel, who: str, call: Callable[[], int]) -> int:
        """``call()`` - a C loop of the clock or the writer, a take, an
        acknowledgement - again after each repair of a corruption it met, and
        after each lock timeout (a holder stopped, a jammed lock word: said
        in the log, never a reason to stop); its last result otherwise."""
        in_a_row = 0
        while True:
            rc = call()
            try:
                if rc == lib.SHMW_ELOCK:
                    raise wheel.error(rc)
                if rc != lib.SHMW_ECORRUPT:
                    return rc
                in_a_row = 0 if self._repair(wheel, who) else in_a_row + 1
            except LockTimeoutError as exc:
                if self._stopping:
                    return rc
                self._say_stuck(exc)
                continue
            if in_a_row >= _REPAIR_GIVE_UP:  # it keeps failing on what the checker finds sound
                return rc
            time.sleep(0.01 * in_a_row)

    def _say_stuck(self, exc: LockTimeoutError) -> None:
        """A lock timeout, in the log at most once a minute; the caller tries again."""
        now = time.monotonic()
        if now - self._stuck_said >= 60.0:
            self._stuck_said = now
            _log.error("driver %d: %s; waiting for it", os.getpid(), exc)

    def _keep(self, wheel: Wheel, handles: list[int]) -> None:
        """Mark fires a handler kept in flight (KEEP_IN_FLIGHT): left for it
        to acknowledge, and sent again marked if this driver dies first."""
        arr = ffi.new("int64_t[]", handles)
        rc = self._repairing(
            wheel, "keeping fires in flight", lambda: lib.shmw_keep_many(wheel.core, arr, len(handles))
        )
        if rc < 0:
            raise wheel.error(rc)

    def _ack(self, wheel: Wheel, handles: list[int], errors: int) -> None:
        """Acknowledge a batch (see :meth:`_ack_array`)."""
        self._ack_array(wheel, ffi.new("int64_t[]", handles) if handles else ffi.NULL, len(handles), errors)

    def _ack_array(self, wheel: Wheel, arr: Any, n: int, errors: int) -> None:
        """Acknowledge the ``n`` fires whose handles are in C array ``arr``,
        repairing what the acknowledgement meets.  A retry is safe: what was
        freed already no longer matches its handle.  A handler that refuses
        fires (their records name a process it may not signal) counts them
        in an int attribute ``refused``, which goes into the segment's count
        (``stats().refused``) with the batch."""
        refused = getattr(self._handler, "refused", 0)
        new = refused - self._refused if isinstance(refused, int) and refused > self._refused else 0
        self._refused += new
        count = [errors, min(new, 2**32 - 1)]  # counted by the first call only

        def ack() -> int:
            rc: int = lib.shmw_ack_many(wheel.core, arr, n, count[0], count[1])
            count[0] = count[1] = 0
            return rc

        rc = self._repairing(wheel, "an acknowledgement", ack)
        if rc < 0:
            raise wheel.error(rc)

    def _report_unseen(self, wheel: Wheel, me: int) -> None:
        """Say once per producer that runs in another PID namespace what this driver cannot do for it."""
        for p in wheel.producers():
            if p.alive is None and (p.pid, p.start) not in self._unseen:
                self._unseen.add((p.pid, p.start))
                _log.warning(
                    "driver %d: a producer of wheel %r (pid %d in its own PID namespace) runs in another PID "
                    "namespace, a container this driver cannot see into: it cannot tell when that process exits, "
                    "so its cancel_on_exit timers stay, and it signals nothing there; run the driver in the same "
                    "PID namespace (the same container, or Kubernetes shareProcessNamespace: true)",
                    me,
                    self.name,
                    p.pid,
                )

    def _await_external_acks(self, wheel: Wheel) -> None:
        """Give an external consumer time to acknowledge what it was sent.

        What is still in flight when the driver deregisters is marked
        redelivered and sent again by the next driver; waiting here avoids
        that for a consumer that is merely a little behind.
        """
        give_up = time.monotonic() + self._ack_timeout
        while wheel.raw_stats().inflight and time.monotonic() < give_up:
            time.sleep(0.01)

    def _open_output(self) -> int | None:
        """The fd the writer writes to; None if asked to stop while waiting
        for a FIFO's reader."""
        if self._fd is not None:
            return self._fd
        assert self._fifo is not None
        return self._open_fifo(self._fifo)

    def _open_fifo(self, path: str | os.PathLike[str]) -> int | None:
        """Open the FIFO for writing once a reader has it open; stop() interrupts the wait.

        A blocking open would wait for a reader with no way out: PEP 475
        retries it after the signal handler that asked us to stop.
        """
        while True:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
                if self._wait_stop(0.05):
                    return None  # asked to stop before anyone read
                continue
            os.set_blocking(fd, True)
            return fd

    def _dispatch(self, wheel: Wheel) -> None:
        """Take fires out of the segment and handle them until stopped.

        The records are copied straight into one buffer allocated up front:
        no pipe, no writer thread to wake, no system call but the futex
        wait when there is nothing to do.
        """
        rec = wheel.fire_record
        buf = ffi.new("char[]", _SEND_BATCH * rec.size)
        view = memoryview(ffi.buffer(buf))

        sift = self._sifter(wheel, buf)

        def take() -> int:
            return self._repairing(
                wheel, "the dispatcher", lambda: lib.shmw_driver_take(wheel.core, self._send_stop, buf, _SEND_BATCH)
            )

        while (n := take()) > 0:
            if sift is not None:
                n = sift(n)
            fires = decode_fires(rec, view[: n * rec.size])
            try:
                errors = self.handle_batch(fires)
            except OutputFailed as exc:
                # The fire it failed on and those after it stay in flight:
                # the next driver (or poll()) hands them out again.
                self.fired += exc.delivered
                self._ack(wheel, [f.handle for f in fires[: exc.delivered]], 0)
                raise
            self.fired += len(fires)
            self.handler_errors += errors
            kept, self._kept = self._kept, []
            if kept:
                self._keep(wheel, kept)
            held = set(kept)
            self._ack(wheel, [f.handle for f in fires if f.handle not in held], errors)
        if n < 0:
            raise wheel.error(n)

    def _sifter(self, wheel: Wheel, buf: Any) -> Callable[[int], int] | None:
        """What takes the fires its handler refuses unread (see the class)
        out of a batch of ``n`` in ``buf``, acknowledges them and returns
        how many are left; None if the handler refuses none so."""
        refuses = getattr(self._handler, "refuses_unread", None)
        refused = getattr(self._handler, "refused_unread", None)
        if not (callable(refuses) and callable(refused)):
            return None
        handles, pids = ffi.new("int64_t[]", _SEND_BATCH), ffi.new("int32_t[]", _SEND_BATCH)
        taken = ffi.new("uint32_t *")

        def sift(n: int) -> int:
            owners, spare = refuses()
            if not owners:
                return n
            n = lib.shmw_sift(wheel.core, buf, n, owners, len(owners), spare, len(spare), handles, pids, taken)
            if k := taken[0]:
                refused(k, handles[k - 1], pids[k - 1])
                self.fired += k
                self._ack_array(wheel, handles, k, 0)
            return int(n)

        return sift

    def handle_batch(self, fires: list[Fire]) -> int:
        """For the package: call the handler on each fire of a batch; return
        how many failed.  A driver that hands fires out otherwise (the
        command line's ``--jsonl``) overrides it.

        Raises OutputFailed, with how many fires got out, when the rest of
        the batch cannot be delivered and the driver must stop.
        """
        errors = 0
        for fire in fires:
            try:
                if self._handler(fire) is KEEP_IN_FLIGHT:
                    self._kept.append(fire.handle)
            except Exception:
                errors += 1
                _log.exception("handler failed on timer %d", fire.handle)
        return errors


class OutputFailed(Exception):
    """Where a driver writes its fires failed for good (stdout's reader has
    gone): the first ``delivered`` fires of the batch got out, the rest did not."""

    def __init__(self, delivered: int, error: OSError) -> None:
        super().__init__(delivered, error)
        self.delivered = delivered
        self.error = error


def _read_batches(wheel: Wheel, fd: int) -> Iterator[list[Fire]]:
    """Whole records from ``fd`` until EOF, as lists of fires.

    Reads into one buffer allocated up front: os.read would allocate (and
    glibc mmap and munmap) a fresh 256 KiB object for every read.
    """
    rec = wheel.fire_record
    buf = bytearray(max(rec.size, _READ_SIZE - _READ_SIZE % rec.size))
    view = memoryview(buf)
    have = 0
    while True:
        n = os.readv(fd, [view[have:]])
        if n == 0:
            return
        have += n
        whole = have - have % rec.size
        if whole:
            fires = decode_fires(rec, view[:whole])
            view[: have - whole] = view[whole:have]  # the start of a record, if any
            have -= whole
            yield fires


def _ack(wheel: Wheel, handles: list[int], errors: int) -> None:
    if not handles and not errors:
        return
    arr = ffi.new("int64_t[]", handles) if handles else ffi.NULL
    rc = lib.shmw_ack_many(wheel.core, arr, len(handles), errors, 0)
    if rc < 0:
        raise wheel.error(rc)


class FireReader:
    """Reads a driver's fire records from an fd or a named FIFO, in another process.

    Iterating yields :class:`Fire` objects; a fire is acknowledged once the
    iteration moves past it, or when the reader is closed.  Leaving a
    ``with FireReader(...)`` block by an exception does not acknowledge the
    fire in hand: it stays in flight and the next driver redelivers it.
    """

    def __init__(self, name: str, source: int | str | os.PathLike[str]) -> None:
        self._wheel = attach(name)
        self._fd = source if isinstance(source, int) else os.open(source, os.O_RDONLY)
        self._unacked: list[int] = []
        self._in_hand: int | None = None

    def __iter__(self) -> Iterator[Fire]:
        for fires in _read_batches(self._wheel, self._fd):
            for fire in fires:
                self._in_hand = fire.handle
                yield fire
                self._unacked.append(fire.handle)
                self._in_hand = None
            self._flush()

    def _flush(self) -> None:
        _ack(self._wheel, self._unacked, 0)
        self._unacked = []

    def close(self, *, acknowledge_in_hand: bool = True) -> None:
        """Acknowledge what was read (and the fire in hand, unless told not to); release everything."""
        if self._wheel.closed:
            return
        if acknowledge_in_hand and self._in_hand is not None:
            self._unacked.append(self._in_hand)
        self._in_hand = None
        self._flush()
        os.close(self._fd)
        self._wheel.close()

    def __enter__(self) -> FireReader:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(acknowledge_in_hand=exc_type is None)


# -- running a driver in a process of its own ------------------------------------


def dedicated_process() -> None:
    """Settings for a process that does nothing but drive.

    Every fire becomes a Fire, a tuple subclass the cyclic collector tracks;
    a burst of them set off young-generation collections over and over (a
    fifth of the dispatcher's time in a 1 M burst).  Objects made before the
    driver starts are frozen out of collections, and the threshold raised.
    """
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _serve(name: str, handler: Handler | None, status: Any, audit_interval: float | None) -> None:
    dedicated_process()
    driver = Driver(name, handler, audit_interval=audit_interval)
    signal.signal(signal.SIGTERM, lambda *_: driver.stop())
    signal.signal(signal.SIGINT, lambda *_: driver.stop())
    try:
        driver.run(on_ready=lambda: status.put(None))
    except BaseException as exc:
        status.put(exc)
        raise SystemExit(1) from None


class DriverProcess:
    """A driver running in a child process (see :func:`start_driver`)."""

    def __init__(self, process: Any) -> None:
        self._process = process

    @property
    def pid(self) -> int:
        pid: int = self._process.pid
        return pid

    def is_alive(self) -> bool:
        return bool(self._process.is_alive())

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then wait for the graceful stop; SIGKILL after ``timeout``.  Returns the exit code."""
        if self._process.is_alive():
            os.kill(self._process.pid, signal.SIGTERM)
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        code: int | None = self._process.exitcode
        return code


def start_driver(
    name: str,
    handler: Handler | None = None,
    *,
    timeout: float = 30.0,
    audit_interval: float | None = AUDIT_INTERVAL,
) -> DriverProcess:
    """Start a driver for wheel ``name`` in a new process; return once it is registered.

    ``handler`` must be picklable (a module-level function): the process is
    started with the spawn method.  ``audit_interval``: see :class:`Driver`.
    Raises DriverRunningError if another driver is running on the wheel.
    """
    ctx = mp.get_context("spawn")
    status = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(name, handler, status, audit_interval), name=f"shmwheel-driver-{name}")
    proc.start()
    give_up = time.monotonic() + timeout
    while True:
        try:
            result = status.get(timeout=0.05)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise DriverStartError(f"the driver for {name!r} exited with status {proc.exitcode} on start") from None
            if time.monotonic() > give_up:
                proc.kill()
                proc.join()
                raise DriverStartError(f"the driver for {name!r} did not start within {timeout} s") from None
    if isinstance(result, BaseException):
        proc.join()
        raise result
    return DriverProcess(proc)
