"""shmwheel: a hierarchical timing wheel in POSIX shared memory.

Many processes on one host add and cancel timers in O(1) in one segment;
one driver advances the clock and collects the fires.  See README.md.
"""

import logging

from ._binding import MAX_DELAY
from ._driver import KEEP_IN_FLIGHT, Driver, DriverProcess, FireReader, start_driver
from ._errors import (
    CorruptSegmentError,
    DriverRunningError,
    DriverStartError,
    IncompatibleSegmentError,
    LockTimeoutError,
    SegmentExistsError,
    SegmentNotFoundError,
    SegmentRemovedError,
    ShmwheelError,
    WheelFullError,
)
from ._results import Fire, Producer, Timer, WheelStats
from ._wheel import Wheel, attach, create, unlink

__version__ = "0.1.0"

__all__ = [
    "KEEP_IN_FLIGHT",
    "MAX_DELAY",
    "CorruptSegmentError",
    "Driver",
    "DriverProcess",
    "DriverRunningError",
    "DriverStartError",
    "Fire",
    "FireReader",
    "IncompatibleSegmentError",
    "LockTimeoutError",
    "Producer",
    "SegmentExistsError",
    "SegmentNotFoundError",
    "SegmentRemovedError",
    "ShmwheelError",
    "Timer",
    "Wheel",
    "WheelFullError",
    "WheelStats",
    "__version__",
    "attach",
    "create",
    "start_driver",
    "unlink",
]

logging.getLogger(__name__).addHandler(logging.NullHandler())
