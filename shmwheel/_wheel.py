"""``Wheel``: one shmwheel segment, mapped into this process.

The segment is a POSIX shared-memory object made and opened with posix_ipc
and mapped with :mod:`mmap`; the C core (``_shmwheel``) does every read and
write of it.  The methods on the add/cancel path are one cffi call each
(cffi releases the GIL around it) plus a sign test: argument errors are
found by the C core, before it takes the lock, and only then does Python
work out what to say about them.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import logging
import math
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import posix_ipc

from ._binding import MAX_DELAY, error_for, ffi, lib, raise_for
from ._checks import (
    CAPACITIES,
    LOCK_TIMEOUT,
    PAYLOAD_SIZES,
    WHEEL_SIZES,
    check_handle,
    check_int,
    check_lock_timeout,
    check_owner,
    check_payload,
    check_seconds,
    not_a_tick,
    not_a_wheel_size,
    too_big,
)
from ._errors import (
    CorruptSegmentError,
    DriverRunningError,
    IncompatibleSegmentError,
    LockTimeoutError,
    SegmentExistsError,
    SegmentNotFoundError,
    ShmwheelError,
    WheelFullError,
)
from ._process import USE_LOCK_AT, alive, describe_lock_holder, pid_namespace, start_time
from ._results import Fire, Payload, Producer, Timer, WheelStats, decode_fires, decode_timers, fire_struct
from ._segment import SHM, SegmentFile, open_segment, segment_name, wheel_stat

__all__ = ["COUNTERS", "NOTE_SIZE", "Wheel", "attach", "create", "observe", "unlink"]

#: The counters a segment keeps for its users (:meth:`Wheel.count`), and
#: the bytes of note beside them (:meth:`Wheel.set_note`).
COUNTERS: int = lib.SHMW_COUNTERS
NOTE_SIZE: int = lib.SHMW_NOTE_SIZE

_log = logging.getLogger("shmwheel")

_DRIVER_STATES = {
    lib.SHMW_DRIVER_NONE: "none",
    lib.SHMW_DRIVER_RUNNING: "running",
    lib.SHMW_DRIVER_STOPPING: "stopping",
}

#: How long attach waits for a segment that another process is still
#: creating (it exists, but its magic is not written yet).
_ATTACH_WAIT = 1.0

#: Fires fetched from C per call inside one poll().
_POLL_BATCH = 1024

# The hot path looks these up as module globals: an attribute lookup on the
# cffi ``lib`` object costs more than the rest of the Python side of a call.
_add = lib.shmw_add
_add_at = lib.shmw_add_at
_cancel = lib.shmw_cancel
_reset = lib.shmw_reset
_reset_at = lib.shmw_reset_at
_pending = lib.shmw_pending
_CANCEL_ON_EXIT = lib.SHMW_CANCEL_ON_EXIT
_RESERVED = lib.SHMW_RESERVED
_ENOTATTACHED = lib.SHMW_ENOTATTACHED
_REAP_CHUNK = 65536  # entries a reap looks at per lock hold

# The fast path calls the core of this very cffi module, by address: it links no copy of its own.
_FAST_ENTRIES = (
    int(ffi.cast("uintptr_t", ffi.addressof(lib, "shmw_add_at_ns"))),
    int(ffi.cast("uintptr_t", ffi.addressof(lib, "shmw_try_cancel"))),
)
#: Seconds a Wheel waits before it asks again for a producer id the
#: table had none of: the ask is one lock hold, but an add that needs the
#: id should not make it every time while the table is full.
_PRODUCER_RETRY = 1.0

# This process's producer id in a segment stays taken while any Wheel on
# that segment is open here, and after that while timers it added with
# cancel_on_exit may be pending (the driver frees it once we are gone).
_open_here: collections.Counter[str] = collections.Counter()
_owners_here: set[str] = set()


class Wheel:
    """An open shmwheel segment.  Make one with :func:`create` or :func:`attach`.

    A Wheel may be used from many threads at once; :meth:`close` must not
    race with other calls on the same object.  It pickles by name: the
    copy that arrives in another process attaches to the same segment.
    """

    __slots__ = (
        "_name",
        "_mm",
        "_buf",
        "_w",
        "_capacity",
        "_reserve",
        "_shards",
        "_payload_size",
        "_tick",
        "_levels",
        "_wheel_size",
        "_poll_buffers",
        "_record",
        "_producer",
        "_producer_retry_at",
        "_lock_timeout",
        "_fd",
        "_fast",
    )

    _name: str
    _mm: mmap.mmap
    _buf: Any  # cffi char[] over the mapping
    _w: Any  # cffi shmw_t *, NULL once closed
    _fast: Any  # a _fast.Core over _w, once fast_core() has made it
    _capacity: int
    _reserve: int
    _shards: int
    _payload_size: int
    _tick: float
    _levels: int
    _wheel_size: int
    _poll_buffers: list[Any]  # record buffers reused by poll(); pop/append are atomic under the GIL
    _record: struct.Struct
    _producer: int  # this process's producer id, or -1
    _producer_retry_at: float  # no new ask for a producer id before this time.monotonic()
    _lock_timeout: float
    _fd: SegmentFile  # the segment's file, kept open: fstat tells whether it was shrunk or replaced

    def __init__(self) -> None:
        raise TypeError("use shmwheel.create() or shmwheel.attach() to get a Wheel")

    @classmethod
    def _open(cls, name: str, mm: mmap.mmap, fd: int, lock_timeout: float, producer: bool = True) -> Wheel:
        """Takes over ``mm`` and ``fd``: they are closed here if this fails."""
        buf = ffi.from_buffer(mm)
        out = ffi.new("shmw_t **")
        rc = lib.shmw_open(buf, len(mm), out)
        if rc:
            ffi.release(buf)
            mm.close()
            os.close(fd)
            raise_for(rc, name=name)
        self = object.__new__(cls)
        self._name = name
        self._mm = mm
        self._buf = buf
        self._fd = SegmentFile(fd)
        self._w = ffi.gc(out[0], lib.shmw_close)
        self._lock_timeout = lock_timeout
        self._capacity = self._reserve = self._payload_size = 0  # for an error message until the stats say
        self._shards = 1
        lib.shmw_set_lock_timeout(self._w, round(lock_timeout * 1e9))
        try:
            st = self.raw_stats()
        except BaseException:  # the lock not taken in time
            self._w = ffi.NULL
            ffi.release(buf)
            mm.close()
            self._fd.close()
            raise
        self._capacity = st.capacity
        self._reserve = st.reserve
        self._shards = st.shards
        self._payload_size = st.payload_size
        self._tick = st.tick_ns / 1e9
        self._levels = st.levels
        self._wheel_size = st.wheel_size
        self._poll_buffers = []
        self._record = fire_struct(lib.shmw_record_size(self._w))
        self._producer = -1
        self._producer_retry_at = -math.inf
        self._fast = None
        _open_here[name] += 1
        if producer:
            self._attach_producer()
        return self

    # -- lifetime -----------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return bool(self._w == ffi.NULL)

    def close(self) -> None:
        """Unmap the segment from this process.  The segment itself stays."""
        w = self._w
        if w == ffi.NULL:
            return
        _open_here[self._name] -= 1
        if self._producer >= 0 and not _open_here[self._name] and self._name not in _owners_here:
            # Nothing of ours needs the id: free it now rather than leave
            # the driver a dead producer to sweep for.  (In a forked child
            # the id is the parent's, and release refuses: pid differs.)
            me = os.getpid()
            lib.shmw_producer_release(w, self._producer, me, start_time(me) or 0)
        if self._fast is not None:
            self._fast.close()  # before the struct is freed: its later calls give up
        self._w = ffi.NULL
        ffi.release(w)
        ffi.release(self._buf)
        self._mm.close()
        self._fd.close()

    def unlink(self) -> None:
        """Mark the segment removed and remove its name (see :func:`unlink`)."""
        self.mark_removed()
        unlink(self._name, mark=False)

    def owner(self) -> tuple[int, int]:
        """The (uid, gid) the segment's file belongs to."""
        st = os.fstat(self._fd.fd)
        return st.st_uid, st.st_gid

    def file_id(self) -> tuple[int, int]:
        """The (device, inode) of the segment's file: how the kernel names it
        in /proc/PID/maps and /proc/locks."""
        st = os.fstat(self._fd.fd)
        return st.st_dev, st.st_ino

    def show_use(self, start: int) -> bool:
        """Have the kernel vouch that this process, which started at
        ``start`` (its start time, as a producer's), uses the wheel: a POSIX
        read lock on byte USE_LOCK_AT + ``start`` of the segment's file,
        which /proc/locks shows with this pid to anyone (see
        :func:`shmwheel._process.uses_file`).  A driver that cannot read this process's
        /proc/PID/maps (it dropped its privileges, so it is not dumpable)
        looks there before it signals it.  The lock goes when the process
        exits, or when it closes any descriptor of the file, another
        Wheel's included: take it again now and then.  Whether it is held
        (False: another process holds a write lock there)."""
        try:
            fcntl.lockf(self._fd.fd, fcntl.LOCK_SH | fcntl.LOCK_NB, 1, USE_LOCK_AT + start)
        except OSError:
            return False
        return True

    def is_current(self) -> bool:
        """Whether the wheel's name still names this segment: False once it
        has been removed (:meth:`mark_removed`, :func:`unlink`, or ``rm``
        in /dev/shm) or another segment has taken the name.  Two system
        calls and no lock: for a producer to ask now and then, not per timer."""
        try:
            there = os.stat(SHM / self._name)
        except OSError:
            return False
        mine = os.fstat(self._fd.fd)
        if (there.st_dev, there.st_ino) != (mine.st_dev, mine.st_ino):
            return False
        return not lib.shmw_is_removed(self._w)

    def mark_removed(self) -> None:
        """Refuse new timers from now on (:class:`SegmentRemovedError`), so
        that producers attach to whatever the name holds next; the timers
        already in it stay, can be cancelled, and fire if it is driven."""
        rc = lib.shmw_mark_removed(self._w)
        if rc < 0:
            self._raise(rc)

    def __enter__(self) -> Wheel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reattach, (self._name, self._lock_timeout))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"capacity={self._capacity}"
        return f"<shmwheel.Wheel {self._name!r} {state}>"

    # -- parameters ---------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def reserve(self) -> int:
        """Of the free entries, how many only a ``reserved`` add may take."""
        return self._reserve

    @property
    def payload_size(self) -> int:
        return self._payload_size

    @property
    def tick(self) -> float:
        return self._tick

    @property
    def wheel_size(self) -> int:
        return self._wheel_size

    @property
    def levels(self) -> int:
        return self._levels

    max_delay: float = MAX_DELAY

    # -- timers ---------------------------------------------------------------

    def add(self, delay: float, payload: Payload = b"", *, cancel_on_exit: bool = False, reserved: bool = False) -> int:
        """Add a timer due ``delay`` seconds from now; return its handle.

        With ``cancel_on_exit``, the driver cancels the timer if this
        process exits first (a request timeout whose worker is gone).
        With ``reserved``, it may take one of the last free entries that
        the wheel keeps back from every other add (``create(reserve=)``):
        for the timers that must get through a wheel its producers filled.
        """
        flags = (cancel_on_exit and _CANCEL_ON_EXIT) | (reserved and _RESERVED)
        try:
            if cancel_on_exit:
                _owners_here.add(self._name)
            h: int = _add(self._w, delay, payload, len(payload), flags)
        except TypeError:
            return self.add(
                check_seconds(delay, "delay"), check_payload(payload), cancel_on_exit=cancel_on_exit, reserved=reserved
            )
        except OverflowError:
            raise too_big(delay, "delay") from None
        if h < 0:
            if h == _ENOTATTACHED:  # first use, or forked since
                h = self._attach_producer() or _add(self._w, delay, payload, len(payload), flags)
            if h < 0:
                self._raise(h, "delay", delay)
        return h

    def add_at(
        self, deadline: float, payload: Payload = b"", *, cancel_on_exit: bool = False, reserved: bool = False
    ) -> int:
        """Add a timer due at ``deadline`` on the :func:`time.monotonic` clock (see :meth:`add`)."""
        flags = (cancel_on_exit and _CANCEL_ON_EXIT) | (reserved and _RESERVED)
        try:
            if cancel_on_exit:
                _owners_here.add(self._name)
            h: int = _add_at(self._w, deadline, payload, len(payload), flags)
        except TypeError:
            return self.add_at(
                check_seconds(deadline, "deadline"),
                check_payload(payload),
                cancel_on_exit=cancel_on_exit,
                reserved=reserved,
            )
        except OverflowError:
            raise too_big(deadline, "deadline") from None
        if h < 0:
            if h == _ENOTATTACHED:  # first use, or forked since
                h = self._attach_producer() or _add_at(self._w, deadline, payload, len(payload), flags)
            if h < 0:
                self._raise(h, "deadline", deadline)
        return h

    def producers(self) -> list[Producer]:
        """The processes attached to the wheel, each with whether it is alive
        (None for one in another PID namespace: see :class:`Producer`)."""
        return [Producer(pid, start, _alive_here(pid, start, ns)) for _, pid, start, ns in self._producer_table()]

    def reap_dead_producers(self) -> int:
        """Cancel the cancel-on-exit timers of attached processes that are gone
        and free their ids; return how many timers were cancelled.  A
        running driver does this about once a second.  A producer in another
        PID namespace is never judged: its pid means nothing here."""
        cancelled = 0
        for producer, pid, start, ns in self._producer_table():
            if _alive_here(pid, start, ns) is not False:
                continue
            for first in range(0, self._capacity, _REAP_CHUNK):  # short lock holds
                n = lib.shmw_producer_reap(self._w, producer, pid, start, first, _REAP_CHUNK)
                if n == lib.SHMW_ESTALE:
                    break  # reaped by someone else meanwhile
                if n < 0:
                    self._raise(n)
                cancelled += n
            else:
                rc = lib.shmw_producer_release(self._w, producer, pid, start)
                if rc not in (0, lib.SHMW_ESTALE):
                    self._raise(rc)
        return cancelled

    def _producer_table(self) -> list[tuple[int, int, int, int]]:
        """(id, pid, start, PID namespace) of every producer."""
        pids = ffi.new("int32_t[]", lib.SHMW_MAX_PRODUCERS)
        starts = ffi.new("int64_t[]", lib.SHMW_MAX_PRODUCERS)
        spaces = ffi.new("uint32_t[]", lib.SHMW_MAX_PRODUCERS)
        rc = lib.shmw_producers(self._w, pids, starts, spaces, lib.SHMW_MAX_PRODUCERS)
        if rc < 0:
            self._raise(rc)
        return [(k, pids[k], starts[k], spaces[k]) for k in range(lib.SHMW_MAX_PRODUCERS) if pids[k]]

    def _attach_producer(self) -> int:
        """Take this process's producer id: 0, or SHMW_EPRODUCERS if the table is full.

        One lock hold: a full table is not swept here (judging a thousand
        processes takes a thousand reads of /proc); the driver frees the
        ids of the processes that have exited once a second, and this
        Wheel asks again at most once a second meanwhile.
        """
        if time.monotonic() < self._producer_retry_at:
            return int(lib.SHMW_EPRODUCERS)
        me = os.getpid()
        rc: int = lib.shmw_producer_attach(self._w, me, start_time(me) or 0, pid_namespace())
        if rc < 0 and rc != lib.SHMW_EPRODUCERS:
            self._raise(rc)
        self._producer = rc
        self._producer_retry_at = -math.inf if rc >= 0 else time.monotonic() + _PRODUCER_RETRY
        return min(rc, 0)

    def cancel(self, handle: int) -> bool:
        """Cancel a pending timer.  True exactly when it will now never fire."""
        try:
            rc: int = _cancel(self._w, handle)
        except (TypeError, OverflowError):
            check_handle(handle)
            raise
        if rc < 0:
            self._raise(rc)
        return rc == 1

    def acknowledge(self, handles: Iterable[int]) -> int:
        """Free fired timers that a driver's handler kept in flight
        (:data:`~shmwheel.KEEP_IN_FLIGHT`), once the work they stood for is
        done.  Returns how many were still in flight: not one that a driver
        which took the wheel over was handed again and has acknowledged."""
        handles = list(handles)
        for handle in handles:
            check_handle(handle)
        if not handles:
            return 0
        rc: int = lib.shmw_ack_many(self._w, ffi.new("int64_t[]", handles), len(handles), 0, 0)
        if rc < 0:
            self._raise(rc)
        return rc

    def reset(self, handle: int, delay: float) -> bool:
        """Re-arm a pending timer to ``delay`` seconds from now; False if not pending."""
        try:
            rc: int = _reset(self._w, handle, delay)
        except (TypeError, OverflowError):
            check_handle(handle)
            check_seconds(delay, "delay")
            raise too_big(delay, "delay") from None
        if rc < 0:
            self._raise(rc, "delay", delay)
        return rc == 1

    def reset_at(self, handle: int, deadline: float) -> bool:
        """Re-arm a pending timer to ``deadline``; False if not pending."""
        try:
            rc: int = _reset_at(self._w, handle, deadline)
        except (TypeError, OverflowError):
            check_handle(handle)
            check_seconds(deadline, "deadline")
            raise too_big(deadline, "deadline") from None
        if rc < 0:
            self._raise(rc, "deadline", deadline)
        return rc == 1

    def add_many(self, delays: Iterable[float], payloads: Iterable[Payload] | None = None) -> list[int]:
        """Add one timer per delay in one call into C; all are added or none.

        ``payloads``, if given, has one payload per delay.  A batch goes
        into one shard: this process's own, or the next with room for all
        of it.
        """
        if not isinstance(delays, (list, tuple)):
            delays = list(delays)
        n = len(delays)
        if n == 0:
            return []
        try:
            c_delays = ffi.new("double[]", delays)
        except (TypeError, OverflowError):
            for d in delays:
                check_seconds(d, "delay")
            raise too_big(next(d for d in delays if abs(d) > 1e300), "delay") from None
        joined, lens = ffi.NULL, ffi.NULL
        if payloads is not None:
            if not isinstance(payloads, (list, tuple)):
                payloads = list(payloads)
            if len(payloads) != n:
                raise ValueError(f"add_many got {n} delays but {len(payloads)} payloads")
            try:
                joined = b"".join(payloads)
            except TypeError:
                payloads = [check_payload(p) for p in payloads]
                joined = b"".join(payloads)
            lens = ffi.new("uint32_t[]", [len(p) for p in payloads])
        shards = self._shards
        if n > self._capacity // shards:  # the arguments are right, but they cannot fit
            where = "the wheel holds" if shards == 1 else f"a batch goes into one of the {shards} shards, which hold"
            raise WheelFullError(f"add_many of {n} timers: {where} at most {self._capacity // shards}")
        handles = ffi.new("int64_t[]", n)
        rc = lib.shmw_add_many(self._w, c_delays, n, joined, lens, handles)
        if rc == lib.SHMW_EFULL:
            reserve = f" (besides the {self._reserve} kept in reserve)" if self._reserve else ""
            where = "the wheel's" if shards == 1 else f"any one shard's {self._capacity // shards} of the wheel's"
            raise WheelFullError(
                f"add_many of {n} timers: fewer than {n} of {where} {self._capacity} slots are free{reserve}; "
                "none was added"
            )
        if rc < 0:
            bad = next((d for d in delays if not (0 <= d <= MAX_DELAY)), None)
            self._raise(rc, "delay", bad)
        added: list[int] = ffi.unpack(handles, n)
        return added

    def cancel_many(self, handles: Iterable[int]) -> int:
        """Cancel many timers in one call into C; return how many were pending."""
        if not isinstance(handles, (list, tuple)):
            handles = list(handles)
        if not handles:
            return 0
        try:
            c_handles = ffi.new("int64_t[]", handles)
        except (TypeError, OverflowError):
            for h in handles:
                check_handle(h)
            raise
        rc: int = lib.shmw_cancel_many(self._w, c_handles, len(handles))
        if rc < 0:
            self._raise(rc)
        return rc

    @contextlib.contextmanager
    def timeout(self, delay: float, payload: Payload = b"") -> Iterator[int]:
        """Add a timer for the block and cancel it when the block ends.

        The block is not interrupted: the timer's fire goes to whoever
        drives the wheel, who decides what a timeout means.
        """
        handle = self.add(delay, payload)
        try:
            yield handle
        finally:
            self.cancel(handle)

    def poll(self, now: float | None = None, max_fires: int | None = None) -> list[Fire]:
        """Advance the clock to ``now`` and return the timers due, in firing order.

        ``now`` is on the :func:`time.monotonic` clock and defaults to it.
        A clock never goes back: a ``now`` before the wheel clock fires
        nothing.  The wheel clock is shared: a ``now`` ahead of real time
        moves it ahead for every process, and timers due before it then
        wait for a poll at or past it (late, never early), so a future
        ``now`` is for a wheel you drive alone, as tests do.  With
        ``max_fires``, the rest stay due for the next poll.  Raises
        DriverRunningError while a live driver is registered.
        """
        use_clock = now is None
        if not use_clock:
            now = check_seconds(now, "now")
        if max_fires is not None:
            max_fires = check_int(max_fires, "max_fires", 0, 2**31 - 1)
        rec = self._record
        try:
            records = self._poll_buffers.pop()
        except IndexError:
            records = ffi.new("char[]", _POLL_BATCH * rec.size)
        more = ffi.new("int *")
        out: list[Fire] = []
        try:
            while True:
                want = _POLL_BATCH if max_fires is None else min(_POLL_BATCH, max_fires - len(out))
                if want == 0:
                    return out
                n: int = lib.shmw_poll(self._w, 0.0 if use_clock else now, use_clock, want, records, more)
                if n == lib.SHMW_EDRIVER and self._release_dead_driver():
                    continue
                if n < 0:
                    if out:  # fired and freed already: they are returned, the error comes next time
                        return out
                    self._raise(n, "now", now)
                if n:
                    out += decode_fires(rec, ffi.buffer(records, n * rec.size))
                if not more[0]:
                    return out
        finally:
            self._poll_buffers.append(records)

    def timers(self) -> list[Timer]:
        """Every timer pending or in flight, in no particular order.

        Read a few at a time, each shard's lock held only while it looks at
        a few hundred entries, so that the producers never wait for it
        long: a timer that stays pending or in flight throughout is in the
        list once; one added, fired or cancelled meanwhile may be in it or
        not.  Entries a buggy process scribbled on are left out."""
        rec = self._record
        records = ffi.new("char[]", lib.SHMW_SNAPSHOT_WORK * rec.size)
        at = ffi.new("uint32_t *", 0)
        out: list[Timer] = []
        while at[0] < self._capacity:
            n: int = lib.shmw_snapshot(self._w, at, lib.SHMW_SNAPSHOT_WORK, records)
            if n < 0:
                self._raise(n)
            if n:
                out += decode_timers(rec, ffi.buffer(records, n * rec.size))
        return out

    def count(self, counter: int, n: int = 1) -> None:
        """Add ``n`` to counter ``counter`` (0 to COUNTERS - 1) of the
        segment's own, which its users keep there for each other (the
        request-timeout driver keeps what its metrics report); an atomic
        add, with no lock."""
        rc = lib.shmw_count(self._w, check_int(counter, "counter", 0, COUNTERS - 1), check_int(n, "n", 0, 2**63 - 1))
        if rc < 0:
            self._raise(rc)

    def counters(self) -> list[int]:
        """The segment's COUNTERS counters (:meth:`count`), each read atomically."""
        out = ffi.new("uint64_t[]", COUNTERS)
        rc = lib.shmw_counters(self._w, out, COUNTERS)
        if rc < 0:
            self._raise(rc)
        return list(out)

    @property
    def note(self) -> bytes:
        """What its users keep in the segment beside the counters, up to
        NOTE_SIZE bytes, written whole (:meth:`set_note`): what the
        counters are of."""
        out = ffi.new("char[]", NOTE_SIZE)
        n = lib.shmw_note(self._w, out, NOTE_SIZE)
        if n < 0:
            self._raise(n)
        return bytes(ffi.buffer(out, n))

    def set_note(self, note: Payload) -> None:
        """Replace the note (:attr:`note`), whole."""
        data = bytes(note)
        if len(data) > NOTE_SIZE:
            raise ValueError(f"a note holds at most {NOTE_SIZE} bytes, not {len(data)}")
        rc = lib.shmw_set_note(self._w, data, len(data))
        if rc < 0:
            self._raise(rc)

    def __len__(self) -> int:
        """The number of pending timers (exact, and stale as soon as it is read)."""
        n: int = _pending(self._w)
        if n < 0:
            self._raise(n)
        return n

    def stats(self) -> WheelStats:
        st = self.raw_stats()
        tick_ns = st.tick_ns
        return WheelStats(
            pending=st.pending,
            capacity=st.capacity,
            free=st.free,
            reserve=st.reserve,
            retired=st.retired,
            added=st.added,
            cancelled=st.cancelled,
            fired=st.fired,
            resets=st.resets,
            tick=tick_ns / 1e9,
            wheel_size=st.wheel_size,
            levels=st.levels,
            payload_size=st.payload_size,
            shards=st.shards,
            clock=st.elapsed * tick_ns / 1e9,
            next_expiry=None if st.next_expiry_ns < 0 else st.next_expiry_ns / 1e9,
            level_pending=tuple(st.level_pending[0 : st.levels]),
            driver_pid=st.driver_pid or None,
            driver_start=st.driver_start if st.driver_pid else None,
            driver_state=_DRIVER_STATES.get(st.driver_state, "unknown"),
            in_flight=st.inflight,
            acked=st.acked,
            redelivered=st.redelivered,
            handler_errors=st.handler_errors,
            refused=st.refused,
            recoveries=st.recoveries,
            repairs=st.repairs,
            quarantined=st.quarantined,
            removed=bool(st.removed),
            lag=0.0 if st.next_expiry_ns < 0 else max(0.0, (lib.shmw_now_ns() - st.next_expiry_ns) / 1e9),
        )

    def check(self) -> None:
        """Run the C invariant checker; raise CorruptSegmentError naming what is broken.

        Also a file shorter than the segment it holds: shrunk under the
        processes that map it, which die of SIGBUS as soon as they touch
        the part that is gone (as with LMDB, that is beyond what they survive).
        """
        if short := self._short_by():
            raise CorruptSegmentError(
                f"segment {self._name!r} is corrupt: its file was shrunk to {len(self._mm) - short} of its "
                f"{len(self._mm)} bytes; a process that touches the rest dies of SIGBUS"
            )
        reason = ffi.new("char[]", 512)
        rc = lib.shmw_check(self._w, reason, len(reason))
        if rc < 0:
            text = ffi.string(reason).decode("utf-8", "replace")
            self._raise(rc, detail=text)

    def repair(self) -> str | None:
        """Check the segment and, if anything is wrong, rebuild it: what a
        running driver does once a second and whenever an operation finds
        corruption.  Entries whose own fields make no sense are retired for
        good (``stats().quarantined``); the healthy timers stay.  Returns
        what was found wrong first, or None if the segment was sound.
        """
        if self._short_by():
            self.check()  # raises: nothing in the segment can make up for a shrunk file
        reason = ffi.new("char[]", 512)
        rc = lib.shmw_repair(self._w, lib.shmw_now_ns(), reason, len(reason))
        if rc < 0:
            self._raise(rc)
        return ffi.string(reason).decode("utf-8", "replace") if rc else None

    def _short_by(self) -> int:
        """By how many bytes the segment's file is shorter than the mapping."""
        return max(0, len(self._mm) - os.fstat(self._fd.fd).st_size)

    # -- internals ----------------------------------------------------------

    def _release_dead_driver(self) -> bool:
        """Clear the registration of a driver that died; False if it is alive.

        What it had in flight is marked redelivered and handed out by the
        next poll (or the next driver).
        """
        try:
            rc, st = self.take_over_driver()
        except DriverRunningError:
            return False  # poll() raises its own EDRIVER
        if rc == 0 and st.driver_pid:
            _log.warning("wheel %r: released the registration of driver %d, which is gone", self._name, st.driver_pid)
        elif rc not in (0, lib.SHMW_ENOTDRIVER):
            self._raise(rc)
        return True

    def _lock_timeout_error(self) -> LockTimeoutError:
        """The lock was not released in time: say who holds it, and in what state."""
        tid = lib.shmw_lock_holder(self._w)
        holder, pid = describe_lock_holder(tid)
        exc = error_for(lib.SHMW_ELOCK, name=self._name, lock_timeout=f"{self._lock_timeout:g}", holder=holder)
        assert isinstance(exc, LockTimeoutError)
        exc.holder_pid = pid
        return exc

    def _raise(self, rc: int, what: str = "delay", value: object = None, detail: str = "") -> NoReturn:
        raise self.error(rc, what, value, detail)

    # -- for the package: the driver's way into the segment -----------------

    @property
    def core(self) -> Any:
        """For the package: the C core's ``shmw_t *`` for this mapping (NULL
        once closed), the first argument of a ``lib.shmw_*`` call.  The
        methods on the add/cancel path read the slot behind it directly."""
        return self._w

    def fast_core(self, core_type: Callable[..., Any]) -> Any:
        """For the package: this mapping as shmwheel._fast calls it, made
        once with ``core_type`` (its ``Core``, which only
        shmwheel.contrib._door imports), or None once closed.  Its adds are
        cancel-on-exit ones, so this process's producer id is kept for them
        as :meth:`add`'s are.  It keeps the struct and the mapping alive
        while it lives, and :meth:`close` closes it first."""
        if self._fast is None and self._w != ffi.NULL:
            _owners_here.add(self._name)
            self._fast = core_type(int(ffi.cast("uintptr_t", self._w)), *_FAST_ENTRIES, (self._w, self._buf))
        return self._fast

    @property
    def fire_record(self) -> struct.Struct:
        """For the package: the layout of one fire record of this segment,
        as ``shmw_poll`` and the driver's takes and writes hand them out."""
        return self._record

    def raw_stats(self) -> Any:
        """For the package: the C core's ``struct shmw_stats``, read in one
        lock hold (:meth:`stats` is what it says in Python)."""
        st = ffi.new("struct shmw_stats *")
        rc = lib.shmw_stats(self._w, st)
        if rc < 0:
            self._raise(rc)
        return st

    def take_over_driver(self, pid: int = 0, start: int = 0) -> tuple[int, Any]:
        """For the package: the one takeover of a dead driver's registration,
        by :meth:`poll` (``pid`` 0: it only releases it) and by a driver
        (its own pid and start time: it takes it).

        A registered driver whose pid is alive and started when the
        registration says is never taken over: DriverRunningError.  Any
        other registration is replaced by ``(pid, start)`` in one lock
        hold, which marks what the dead driver had in flight redelivered,
        for the next driver or poll.  Returns the C core's code for that -
        0; SHMW_ENOTDRIVER if the registration changed since it was read (call
        again); an error for the caller to raise or repair - and the stats
        read before it (``driver_pid``: the driver replaced, 0 for none;
        ``inflight``: what is redelivered).  Releasing a registration that
        nobody holds does nothing and returns 0.
        """
        st = self.raw_stats()
        gone, gone_start = st.driver_pid, st.driver_start
        if gone and alive(gone, gone_start):
            raise DriverRunningError(f"a driver (pid {gone}) is already running on wheel {self._name!r}")
        if not gone and not pid:
            return 0, st
        rc: int = lib.shmw_driver_register(self._w, pid, start, gone, gone_start)
        return rc, st

    def error(self, rc: int, what: str = "delay", value: object = None, detail: str = "") -> Exception:
        """For the package: the exception for the C core's negative code
        ``rc`` on this wheel, ``what`` and ``value`` naming the argument a
        time error is about, ``detail`` added to the message."""
        if rc in (lib.SHMW_ETIME, lib.SHMW_ERANGE) and value is not None:
            what = f"{what} {value!r}"
        if rc == lib.SHMW_ELOCK:
            return self._lock_timeout_error()
        exc = error_for(rc, name=self._name, what=what, payload_size=self._payload_size, capacity=self._capacity)
        if rc == lib.SHMW_EFULL and self._reserve:
            exc.args = (
                f"the wheel is full: all {self._capacity} slots are in use or kept in reserve (the last "
                f"{self._reserve} free ones go only to reserved adds)",
            )
        if detail:
            exc.args = (f"{exc.args[0]}: {detail}",)
        return exc


def create(
    name: str,
    *,
    capacity: int,
    tick: float = 0.001,
    payload_size: int = 64,
    reserve: int = 0,
    shards: int = 1,
    mode: int = 0o600,
    wheel_size: int = 256,
    lock_timeout: float = LOCK_TIMEOUT,
    owner: tuple[int, int] | None = None,
) -> Wheel:
    """Create a wheel in a new shared-memory segment and open it.

    ``capacity`` timers can be pending at once; each carries up to
    ``payload_size`` bytes.  ``reserve`` of them are kept for adds that
    ask for them (``add(..., reserved=True)``): every other add finds the
    wheel full once only those are left.  ``tick`` (seconds) is the resolution: a timer
    fires at the first tick boundary at or after its deadline.  The memory
    is reserved now, so a full ``/dev/shm`` fails here and not later.
    ``mode`` is applied as given, whatever the umask.  ``owner``, a
    ``(uid, gid)``, hands the segment to that user and group before anyone
    can open it (-1 leaves one as it is): what a server that starts as root
    and runs its workers as another user needs (changing the owner takes
    root).  ``lock_timeout``: see :func:`attach`.
    """
    shm_name = segment_name(name)
    lock_timeout = check_lock_timeout(lock_timeout)
    capacity = check_int(capacity, "capacity", *CAPACITIES)
    payload_size = check_int(payload_size, "payload_size", *PAYLOAD_SIZES)
    reserve = check_int(reserve, "reserve", 0, capacity - 1)
    shards = check_int(shards, "shards", 1, min(lib.SHMW_MAX_SHARDS, capacity))
    shard_capacity = -(-capacity // shards)
    if -(-reserve // shards) >= shard_capacity:
        raise ValueError(
            f"reserve {reserve} leaves no room for other adds in shards of {shard_capacity} slots "
            f"(capacity {capacity} in {shards} shards)"
        )
    mode = check_int(mode, "mode", 0, 0o777)
    wheel_size = check_int(wheel_size, "wheel_size", *WHEEL_SIZES)
    if problem := not_a_wheel_size(wheel_size):
        raise ValueError(f"wheel_size {problem}")
    tick = check_seconds(tick, "tick")
    if problem := not_a_tick(tick):
        raise ValueError(f"tick {problem}")
    if owner is not None:
        owner = check_owner(owner)

    params = ffi.new(
        "struct shmw_params *",
        {
            "capacity": capacity,
            "payload_size": payload_size,
            "wheel_bits": wheel_size.bit_length() - 1,
            "reserve": reserve,
            "tick_ns": round(tick * 1e9),
            "shards": shards,
        },
    )
    size_out = ffi.new("uint64_t *")
    rc = lib.shmw_segment_size(params, size_out)
    if rc:
        raise_for(rc, name=shm_name[1:])
    size = size_out[0]

    try:
        shm = posix_ipc.SharedMemory(shm_name, posix_ipc.O_CREX, mode=mode, size=0)
    except posix_ipc.ExistentialError:
        raise SegmentExistsError(
            errno.EEXIST, f"a shared-memory segment named {shm_name[1:]!r} exists already", shm_name
        ) from None
    except posix_ipc.PermissionsError as exc:
        raise PermissionError(errno.EACCES, f"cannot create segment {shm_name[1:]!r}: {exc}") from None
    try:
        os.fchmod(shm.fd, mode)  # shm_open applied the umask; the caller asked for `mode`
        if owner is not None:
            # Before the magic is written: nobody attaches to a segment
            # that still belongs to the wrong user.
            os.fchown(shm.fd, *owner)
        try:
            os.posix_fallocate(shm.fd, 0, size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise OSError(
                errno.ENOSPC,
                f"no room in /dev/shm for segment {shm_name[1:]!r} of {size} bytes "
                f"(capacity {capacity}, payload_size {payload_size})",
            ) from None
        mm = mmap.mmap(shm.fd, size)
        buf = ffi.from_buffer(mm)
        rc = lib.shmw_init(buf, size, params, lib.shmw_now_ns())
        ffi.release(buf)
        if rc:
            mm.close()
            raise_for(rc, name=shm_name[1:])
        wheel = Wheel._open(shm_name[1:], mm, os.dup(shm.fd), lock_timeout)
    except BaseException:
        shm.unlink()
        raise
    finally:
        shm.close_fd()
    _log.debug("created wheel %r: capacity %d, %d bytes", wheel.name, capacity, size)
    return wheel


def attach(name: str, *, lock_timeout: float = LOCK_TIMEOUT) -> Wheel:
    """Open an existing wheel by name.

    The process is recorded in the segment's producer table (pid, start
    time and PID namespace), which stat lists and through which the driver
    cancels its cancel-on-exit timers once it has gone.  An operation that
    cannot take the segment's lock within ``lock_timeout`` seconds raises
    :class:`LockTimeoutError`, naming the process that holds it.
    """
    return _attach(name, producer=True, lock_timeout=lock_timeout)


def _reattach(name: str, lock_timeout: float) -> Wheel:
    """How a pickled Wheel comes back."""
    return attach(name, lock_timeout=lock_timeout)


def observe(name: str, *, lock_timeout: float = LOCK_TIMEOUT) -> Wheel:
    """Open an existing wheel to look at or drive it, without being recorded
    as one of its producers (the command line, a driver, a supervisor)."""
    return _attach(name, producer=False, lock_timeout=lock_timeout)


def _attach(name: str, producer: bool, lock_timeout: float = LOCK_TIMEOUT) -> Wheel:
    """attach(), or with producer=False an observer's attach that is not recorded."""
    shm_name = segment_name(name)
    lock_timeout = check_lock_timeout(lock_timeout)
    deadline = time.monotonic() + _ATTACH_WAIT
    while True:
        shm = open_segment(shm_name)
        fd = os.dup(shm.fd)
        shm.close_fd()
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO, a device: shm_open opens anything
                raise IncompatibleSegmentError(
                    f"segment {shm_name[1:]!r} is not a shmwheel segment: not a regular file"
                )
            mm = mmap.mmap(fd, st.st_size) if st.st_size else None
        except BaseException:
            os.close(fd)
            raise
        # A segment being created has no size or no magic yet; wait a little.
        if mm is not None and (st.st_size < 8 or any(mm[:8])):
            return Wheel._open(shm_name[1:], mm, fd, lock_timeout, producer)
        os.close(fd)
        if mm is not None:
            mm.close()
        if time.monotonic() >= deadline:
            raise IncompatibleSegmentError(f"segment {shm_name[1:]!r} is not an initialised shmwheel segment")
        time.sleep(0.005)


def unlink(name: str, *, mark: bool = True) -> None:
    """Remove the segment ``name``.  Processes that have it open keep it.

    If it is a wheel this process can open, it is first marked removed
    (:meth:`Wheel.mark_removed`), so that its producers stop adding to it
    and attach the name again; ``mark=False`` skips that.  A segment that
    cannot be opened as a wheel - too damaged, a creator that died
    half-way, any other program's segment of that name - is removed all
    the same, which is what clean-up code needs.  ``shmwheel unlink NAME``
    on the command line looks first: it refuses a segment that is not a
    wheel, and a wheel that is in use, unless told ``--force``.
    """
    shm_name = segment_name(name)
    if mark:
        _mark_removed(shm_name[1:])
    try:
        posix_ipc.unlink_shared_memory(shm_name)
    except posix_ipc.ExistentialError:
        raise SegmentNotFoundError(errno.ENOENT, f"no shmwheel segment named {shm_name[1:]!r}", shm_name) from None


def _mark_removed(name: str) -> None:
    """Mark ``name`` removed if it is a wheel this process can open; never raises."""
    try:
        if wheel_stat(name) is None:
            return
        with _attach(name, producer=False, lock_timeout=1.0) as wheel:
            wheel.mark_removed()
    except (OSError, ShmwheelError) as exc:  # gone meanwhile, not ours to open, damaged, jammed
        _log.debug("wheel %r: not marked removed before its unlink: %s", name, exc)


def _alive_here(pid: int, start: int, pidns: int) -> bool | None:
    """Whether a producer is alive, or None if it runs in another PID namespace."""
    if pidns and pidns != pid_namespace():
        return None
    return alive(pid, start)
