"""The thin layer between the cffi module and the public API.

The C core returns 0 or a negative ``SHMW_E*`` code from every call;
:func:`raise_for` is the one place those codes become exceptions.  Every
number comes from the compiled header through ``lib``: nothing here
repeats a constant.
"""

from __future__ import annotations

from typing import NoReturn

from ._errors import (
    CorruptSegmentError,
    DriverRunningError,
    IncompatibleSegmentError,
    LockTimeoutError,
    SegmentRemovedError,
    WheelFullError,
)
from ._shmwheel import ffi, lib

__all__ = ["MAX_DELAY", "ffi", "lib", "raise_for"]

#: The longest delay any wheel accepts, in seconds (2**62 ns, ~146 years).
MAX_DELAY: float = lib.SHMW_MAX_DELAY_NS / 1e9

_MESSAGES: dict[int, tuple[type[Exception], str]] = {
    lib.SHMW_EINVAL: (ValueError, "invalid argument"),
    lib.SHMW_ETIME: (ValueError, "{what} must be a finite, non-negative number of seconds"),
    lib.SHMW_ERANGE: (
        ValueError,
        f"{{what}} is beyond the maximum delay of {MAX_DELAY:.0f} s (about 146 years)",
    ),
    lib.SHMW_EPAYLOAD: (ValueError, "payload is longer than the wheel's payload_size of {payload_size} bytes"),
    lib.SHMW_EFULL: (WheelFullError, "the wheel is full: all {capacity} slots are in use"),
    lib.SHMW_EHANDLE: (ValueError, "a handle is a non-negative int below 2**63"),
    lib.SHMW_ECORRUPT: (CorruptSegmentError, "segment {name!r} is corrupt"),
    lib.SHMW_EMAGIC: (IncompatibleSegmentError, "segment {name!r} is not a shmwheel segment"),
    lib.SHMW_EVERSION: (
        IncompatibleSegmentError,
        f"segment {{name!r}} has another layout version (this build reads {lib.SHMW_LAYOUT_VERSION})",
    ),
    lib.SHMW_EABI: (
        IncompatibleSegmentError,
        "segment {name!r} was made by a build with other struct sizes",
    ),
    lib.SHMW_ESIZE: (
        IncompatibleSegmentError,
        "segment {name!r} is smaller than its header says: its file was shrunk, and a process that maps it "
        "dies of SIGBUS where the rest was",
    ),
    lib.SHMW_ELOCK: (LockTimeoutError, "the lock of segment {name!r} was not released in {lock_timeout} s{holder}"),
    # Only the fast path (shmwheel._fast) asks not to wait, and it waits
    # through the normal call instead; should the code come up, it says so.
    lib.SHMW_EBUSY: (LockTimeoutError, "the lock of segment {name!r} was held, and the call was not to wait"),
    lib.SHMW_ENOMEM: (MemoryError, "out of memory"),
    lib.SHMW_ECLOSED: (ValueError, "operation on a closed Wheel"),
    lib.SHMW_EDRIVER: (DriverRunningError, "a driver is registered on segment {name!r}"),
    lib.SHMW_EIO: (OSError, "writing fires to the driver's fd or FIFO failed"),
    lib.SHMW_EPRODUCERS: (
        WheelFullError,
        f"segment {{name!r}} records {lib.SHMW_MAX_PRODUCERS} attached processes: none is left for "
        "cancel_on_exit (a driver frees the ids of those that have exited once a second)",
    ),
    lib.SHMW_ENOTATTACHED: (
        RuntimeError,
        "this process has no producer id in segment {name!r}: it has not attached since it was forked",
    ),
    lib.SHMW_ENOTDRIVER: (DriverRunningError, "another driver took over segment {name!r}"),
    lib.SHMW_ESTALE: (
        RuntimeError,
        "the producer id in segment {name!r} no longer holds that process: another reaped it first",
    ),
    lib.SHMW_EREMOVED: (
        SegmentRemovedError,
        "segment {name!r} was removed or replaced: it takes no new timers (attach the name again)",
    ),
}


class _Context(dict[str, object]):
    """Fills fields a message needs but the caller did not give with '?'."""

    def __missing__(self, key: str) -> str:
        return "?"


def error_for(rc: int, **context: object) -> Exception:
    """The exception for the negative code ``rc``; ``context`` fills the message."""
    try:
        cls, template = _MESSAGES[rc]
    except KeyError:
        return RuntimeError(f"unexpected result {rc} from the C core")
    context.setdefault("what", "delay")
    return cls(template.format_map(_Context(context)))


def raise_for(rc: int, **context: object) -> NoReturn:
    """Raise the exception for the negative code ``rc``; ``context`` fills the message."""
    raise error_for(rc, **context)
