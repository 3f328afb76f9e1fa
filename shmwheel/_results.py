"""What a wheel hands out: fires, decoded in bulk from the C core's fire
records, the producers it records and a snapshot of its state."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ._binding import ffi, lib

__all__ = ["Fire", "Payload", "Producer", "Timer", "WheelStats", "decode_fires", "decode_timers", "fire_struct"]

#: What a payload may be; its bytes are copied into the timer's slot.
Payload = bytes | bytearray | memoryview


class Fire(NamedTuple):
    """A timer that came due.

    ``deadline`` is the deadline as it was asked for (nanosecond precision,
    not rounded to a tick); ``fired_at`` is when the clock fired it.  Both
    are on the :func:`time.monotonic` clock; the ``_ns`` fields give them
    exactly.  A named tuple because a poll makes one per fire, and a tuple
    is the cheapest immutable object Python builds.
    """

    handle: int
    deadline_ns: int
    fired_at_ns: int
    payload: bytes
    owner_pid: int
    redelivered: bool = False  #: sent again after a driver died with it in flight
    kept: bool = False  #: a handler had kept it in flight (:data:`~shmwheel.KEEP_IN_FLIGHT`) before it was sent again

    @property
    def deadline(self) -> float:
        return self.deadline_ns / 1e9

    @property
    def fired_at(self) -> float:
        return self.fired_at_ns / 1e9

    @property
    def lateness(self) -> float:
        """``fired_at - deadline`` in seconds; never negative."""
        return (self.fired_at_ns - self.deadline_ns) / 1e9


class Timer(NamedTuple):
    """A timer pending or in flight, as :meth:`Wheel.timers` saw it."""

    handle: int
    deadline_ns: int  #: on the :func:`time.monotonic_ns` clock
    payload: bytes
    owner_pid: int  #: the process that added it
    fired: bool  #: fired and in flight (its handler has not acknowledged it yet); else pending
    fired_at_ns: int  #: when it fired, if it has

    @property
    def deadline(self) -> float:
        return self.deadline_ns / 1e9


class Producer(NamedTuple):
    """A process attached to a wheel, as its producer table records it."""

    pid: int  #: as the producer's own PID namespace numbers it
    start: int  #: its start time, clock ticks since boot: with the pid, its identity
    #: True or False as seen from this process; None when the producer runs
    #: in another PID namespace (another container), where its pid means
    #: nothing here, so nobody here can tell or act on it.
    alive: bool | None


# Fire records (struct shmw_fire, then the payload padded to 8) are decoded
# in bulk: iter_unpack over a whole batch is several times cheaper than
# reading cdata fields one by one.  The head's layout is checked against the
# compiler's at import, so it cannot drift from C.
_RECORD_HEAD = "=qqqiII4x"
_RECORD_FIELDS = ("handle", "deadline_ns", "fired_at_ns", "owner_pid", "payload_len", "flags")
if struct.calcsize(_RECORD_HEAD) != ffi.sizeof("struct shmw_fire") or [
    ffi.offsetof("struct shmw_fire", f) for f in _RECORD_FIELDS
] != [0, 8, 16, 24, 28, 32]:  # pragma: no cover - a build for another ABI
    raise ImportError("struct shmw_fire does not have the layout shmwheel/_results.py decodes")
_REDELIVERED = lib.SHMW_REDELIVERED
_KEPT = lib.SHMW_KEPT
_FIRED = lib.SHMW_FIRED


def fire_struct(record_size: int) -> struct.Struct:
    """The struct that decodes one fire record of ``record_size`` bytes."""
    return struct.Struct(f"{_RECORD_HEAD}{record_size - struct.calcsize(_RECORD_HEAD)}s")


def decode_fires(rec: struct.Struct, data: bytes | bytearray | memoryview) -> list[Fire]:
    """Fires from whole records; ``len(data)`` must be a multiple of ``rec.size``."""
    return [
        _new_fire(
            Fire,
            (handle, deadline_ns, fired_at_ns, payload[:length], pid, bool(flags & _REDELIVERED), bool(flags & _KEPT)),
        )
        for handle, deadline_ns, fired_at_ns, pid, length, flags, payload in rec.iter_unpack(data)
    ]


def decode_timers(rec: struct.Struct, data: bytes | bytearray | memoryview) -> list[Timer]:
    """Timers from whole snapshot records (fire records, SHMW_FIRED on those in flight)."""
    return [
        Timer(handle, deadline_ns, payload[:length], pid, bool(flags & _FIRED), fired_at_ns if flags & _FIRED else 0)
        for handle, deadline_ns, fired_at_ns, pid, length, flags, payload in rec.iter_unpack(data)
    ]


_new_fire = tuple.__new__


@dataclass(frozen=True, slots=True)
class WheelStats:
    """A consistent snapshot of a wheel's state, taken under its lock."""

    pending: int
    capacity: int
    free: int
    reserve: int  #: of the free entries, those only a ``reserved`` add may take
    retired: int
    added: int
    cancelled: int
    fired: int
    resets: int
    tick: float
    wheel_size: int
    levels: int
    payload_size: int
    shards: int  #: wheels of their own in the segment, each with its own lock (create(shards=))
    clock: float  #: the wheel clock (last tick advanced to), monotonic seconds
    next_expiry: float | None  #: when the earliest non-empty bucket comes due
    level_pending: tuple[int, ...]  #: timers in each level, lowest first
    driver_pid: int | None  #: the registered driver, if any
    driver_start: int | None  #: its start time (clock ticks since boot): with the pid, its identity
    driver_state: str  #: "none", "running" or "stopping"
    in_flight: int  #: fired by the driver, handler not yet done
    acked: int
    redelivered: int
    handler_errors: int
    refused: int  #: fires the driver's handler refused to act on (see TimeoutHandler.refused)
    recoveries: int  #: times a lock holder died and the next locker repaired the segment
    repairs: int  #: times a driver found the segment corrupt and repaired it
    quarantined: int  #: entries a repair found nonsensical (scribbled) and retired for good
    removed: bool  #: removed from its name or replaced: it takes no new timers
    #: How long the earliest due bucket has been waiting for the clock, in
    #: seconds: 0 while whoever drives the wheel keeps up.  (Not part of
    #: equality: it grows while you look at it.)
    lag: float = field(compare=False)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}
