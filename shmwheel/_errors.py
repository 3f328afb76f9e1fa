"""The exceptions shmwheel raises.

``ShmwheelError`` is the root and is never raised itself.  Each subclass
that has a builtin counterpart inherits it too, so ``except
FileExistsError`` keeps working for code that does not know shmwheel; the
two about a segment's name carry ``errno`` and ``filename`` (the name as
shm_open(3) takes it, ``/NAME``), as the builtin ones do.  All of them
pickle, so they cross process boundaries (multiprocessing,
concurrent.futures) intact.
"""

from __future__ import annotations

__all__ = [
    "CorruptSegmentError",
    "DriverRunningError",
    "DriverStartError",
    "IncompatibleSegmentError",
    "LockTimeoutError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "SegmentRemovedError",
    "ShmwheelError",
    "WheelFullError",
]


def one_line(exc: BaseException) -> str:
    """An error in one line for a log or stderr: an OSError without its
    "[Errno n]" prefix; shmwheel's own errors already say which segment."""
    if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, ShmwheelError):
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc)


class ShmwheelError(Exception):
    """Root of every shmwheel exception; never raised itself."""


class _NamedSegmentError(ShmwheelError, OSError):
    """An OSError about a segment's name: ``str()`` is the message alone,
    without the "[Errno N]" prefix and the name repeated after it."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class SegmentExistsError(_NamedSegmentError, FileExistsError):
    """``create`` found a segment of that name already."""


class SegmentNotFoundError(_NamedSegmentError, FileNotFoundError):
    """``attach`` or ``unlink`` found no segment of that name."""


class SegmentRemovedError(ShmwheelError):
    """The segment this Wheel maps was removed from its name, or replaced by
    another: it takes no new timers.  ``attach`` the name again for the
    wheel it names now."""


class LockTimeoutError(ShmwheelError, TimeoutError):
    """The segment's lock was not released within the lock timeout.  The
    message names the process that holds it and what state it is in (a
    stopped process: SIGSTOP, a debugger, a frozen cgroup); ``holder_pid``
    is that pid, or None if no such process can be seen from here."""

    def __init__(self, message: str, holder_pid: int | None = None) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0], self.holder_pid))


class IncompatibleSegmentError(ShmwheelError):
    """The segment is not a shmwheel segment, or another layout version or ABI."""


class CorruptSegmentError(ShmwheelError):
    """An invariant of the segment does not hold; the message names it."""


class WheelFullError(ShmwheelError):
    """No room for what was asked, and nothing was added: no free slot in
    the slab (for ``add_many``, fewer than the batch needs), or, for a
    ``cancel_on_exit`` timer, no free entry in the table of attached
    processes."""


class DriverRunningError(ShmwheelError):
    """A live driver is registered on the segment: a second one, or poll(), is refused."""


class DriverStartError(ShmwheelError):
    """A driver process exited, or did not register in time, before it was
    running; its own error, if it could report one, is raised instead."""
