"""The exceptions shmwheel raises.

``ShmwheelError`` is the root and is never raised itself.  Each subclass
that has a builtin counterpart inherits it too, so ``except
FileExistsError`` keeps working for code that does not know shmwheel.
All of them pickle: they carry their message in ``args`` and nothing else,
so they cross process boundaries (multiprocessing, concurrent.futures)
intact.
"""

from __future__ import annotations

__all__ = [
    "CorruptSegmentError",
    "DriverRunningError",
    "IncompatibleSegmentError",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "ShmwheelError",
    "WheelFullError",
]


class ShmwheelError(Exception):
    """Root of every shmwheel exception; never raised itself."""


class SegmentExistsError(ShmwheelError, FileExistsError):
    """``create`` found a segment of that name already."""


class SegmentNotFoundError(ShmwheelError, FileNotFoundError):
    """``attach`` or ``unlink`` found no segment of that name."""


class IncompatibleSegmentError(ShmwheelError):
    """The segment is not a shmwheel segment, or another layout version or ABI."""


class CorruptSegmentError(ShmwheelError):
    """An invariant of the segment does not hold; the message names it."""


class WheelFullError(ShmwheelError):
    """Every slot of the slab is in use; nothing was added."""


class DriverRunningError(ShmwheelError):
    """A live driver is registered on the segment: a second one, or poll(), is refused."""
