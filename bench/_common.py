"""What the benchmarks in this folder share.

Segments that are always unlinked, the driver's fire log, the exactly-once
check, percentiles, CPU time over a window, the collection of producer
reports, and the small helpers of every report (progress on stderr, strict
JSON, SIGTERM as an exit).  ``driver.py``, ``micro.py`` and ``compare/``
import it; nothing here measures anything by itself.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import math
import os
import pickle
import queue
import shutil
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import psutil

import shmwheel

SHM_DIR = "/dev/shm"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the unit of /proc/stat, where psutil reads the CPU times

# How long to wait for things that take well under a second when all is well.
READY_TIMEOUT = 60.0  # s: processes to start and attach
STOP_TIMEOUT = 60.0  # s: the driver's graceful stop, its fire log included

PERCENTILES = (("p50", 50.0), ("p99", 99.0), ("p99.9", 99.9), ("max", 100.0))


# -- segments ------------------------------------------------------------------


class Segments:
    """Hands out benchmark wheels and makes sure every one of them is removed.

    A name is recorded *before* its segment is created, so that ``cleanup``
    also catches a segment whose creation was interrupted half-way.
    """

    def __init__(self, prefix: str = "shmwheel-bench") -> None:
        self._prefix = prefix  # names are <prefix>-<pid>-<n>
        self._counter = itertools.count()
        self._names: list[str] = []

    @contextlib.contextmanager
    def wheel(self, **params: int | float) -> Iterator[shmwheel.Wheel]:
        """Create a wheel for the block; close and unlink it when the block ends."""
        name = f"{self._prefix}-{os.getpid()}-{next(self._counter)}"
        self._names.append(name)
        try:
            wheel = shmwheel.create(name, **params)
        except shmwheel.SegmentExistsError:
            self._names.remove(name)  # somebody else's: leave it alone
            raise
        try:
            yield wheel
        finally:
            wheel.close()
            self.release(name)

    def release(self, name: str) -> None:
        """Unlink a segment's name now; the processes that have it mapped keep
        using it, adding timers too: it is not marked removed, as a wheel
        taken away from its users would be."""
        with contextlib.suppress(shmwheel.SegmentNotFoundError):
            shmwheel.unlink(name, mark=False)

    def cleanup(self) -> None:
        """Unlink every segment this process made that still exists."""
        for name in self._names:
            if os.path.exists(os.path.join(SHM_DIR, name)):
                _unlink_quietly(name)


@contextlib.contextmanager
def scratch(segs: Segments, prefix: str | None = None) -> Iterator[str]:
    """A benchmark's leftovers, removed however it ends (Ctrl-C included):
    every segment ``segs`` handed out and, with ``prefix``, a scratch
    directory, whose path is yielded ("" without one)."""
    tmp = tempfile.mkdtemp(prefix=prefix) if prefix else ""
    try:
        yield tmp
    finally:
        segs.cleanup()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def _unlink_quietly(name: str) -> None:
    with contextlib.suppress(shmwheel.SegmentNotFoundError):
        shmwheel.unlink(name)


def segment_size(name: str) -> int:
    """The size in bytes of the segment behind a wheel name."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


# -- collecting the fires ---------------------------------------------------------
#
# How.  The handler runs in the driver process, as a deployed handler does,
# and appends what it needs of each fire to arrays of int64 in memory; when
# the driver process exits (after its graceful stop, which runs the handlers
# of everything in flight) the arrays are written to a file this process reads.
#
# Why this and not a FireReader here, on a FIFO the driver writes to: an
# external reader changes what is measured.  The driver would run without its
# dispatcher, so its CPU time would leave out the decoding, the handler calls
# and the acknowledgements a deployed driver does, and the fires would be
# decoded by a Python generator in a third busy process on a 2-core machine.
#
# What it costs.  Nothing on the clock's path: fired_at is stamped by the C
# clock thread before a fire reaches Python, so the lateness figures cannot
# see the handler.  The steady run records four numbers and the payload of
# each fire (about a microsecond, 20,000 times a second: some 2 % of a CPU in
# the driver's CPU time).  The burst records the handle only, one array
# append, and takes its times from outside by polling stats().  The last
# section of the report gives both handlers' cost next to a no-op's.  Arrays,
# not the Fire objects themselves: keeping a million Fire tuples alive made
# the burst's dispatcher about twice as slow (memory growth, and the cyclic
# collector walking them).


class FireLog:
    """The handler, and what it has seen.

    Made here and pickled into the driver process by start_driver; what
    arrives there is a fresh, empty log that writes itself to ``path`` when
    that process exits (see :meth:`__reduce__`).
    """

    COLUMNS = ("handle", "deadline_ns", "fired_at_ns", "handled_ns")

    def __init__(self, path: str) -> None:
        self.path = path
        self.columns = {name: array("q") for name in self.COLUMNS}
        self.payloads: list[bytes] = []  # decoded here, after the run
        # Bound once: each is a single attribute lookup in the handlers.
        self._handle = self.columns["handle"].append
        self._deadline = self.columns["deadline_ns"].append
        self._fired_at = self.columns["fired_at_ns"].append
        self._handled = self.columns["handled_ns"].append
        self._payload = self.payloads.append

    def record(self, fire: shmwheel.Fire) -> None:
        """Handler of the steady run: the fire, and when it reached the handler."""
        self._handle(fire.handle)
        self._deadline(fire.deadline_ns)
        self._fired_at(fire.fired_at_ns)
        self._payload(fire.payload)
        self._handled(time.monotonic_ns())

    def record_handle(self, fire: shmwheel.Fire) -> None:
        """Handler of the burst: the handle only, for the exactly-once check."""
        self._handle(fire.handle)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_fire_log_in_driver, (self.path,))

    def dump(self) -> None:
        """Write the columns out: atexit, once the driver has stopped."""
        part = f"{self.path}.part"
        with open(part, "wb") as f:
            pickle.dump({**self.columns, "payloads": self.payloads}, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(part, self.path)  # a reader never sees half a log


def _fire_log_in_driver(path: str) -> FireLog:
    """Unpickling a FireLog, in the driver process."""
    log = FireLog(path)
    atexit.register(log.dump)
    return log


def read_fire_log(path: str, exit_code: int | None) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            columns: dict[str, Any] = pickle.load(f)
    except FileNotFoundError:
        raise RuntimeError(f"the driver exited (code {exit_code}) without writing its fire log") from None
    return columns


def stop_driver(driver: shmwheel.DriverProcess) -> int | None:
    """Graceful stop; the fire log is written on the way out."""
    return driver.stop(timeout=STOP_TIMEOUT)


# -- checking delivery -------------------------------------------------------------


@dataclass
class Delivery:
    """The exactly-once check of one run.  Everything but ``fires`` must be 0."""

    fires: int  # fires the handler saw
    lost: int  # not cancelled, and never fired
    duplicated: int  # fires beyond the first of a timer
    unexpected: int  # fires of timers that were cancelled, or never added
    early: int = 0  # fired before the deadline (checked in the steady run)
    wrong_payload: int = 0  # the payload of another timer (checked in the steady run)
    redelivered: int = 0  # sent again after a driver died (the wheel's counter)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.unexpected or self.early or self.wrong_payload)

    def __add__(self, other: Delivery) -> Delivery:
        return Delivery(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


def check_handles(expected: set[int], handles: Sequence[int]) -> Delivery:
    """Compare the handles that fired with those that should have, once each."""
    seen = set(handles)
    return Delivery(
        fires=len(handles),
        lost=len(expected - seen),
        duplicated=len(handles) - len(seen),
        unexpected=len(seen - expected),
    )


# -- figures --------------------------------------------------------------------------


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ordered sequence; NaN if it is empty."""
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def distribution_ms(values_ns: Sequence[int]) -> dict[str, float]:
    ordered = sorted(values_ns)
    return {name: percentile(ordered, q) / 1e6 for name, q in PERCENTILES}


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def cpu_seconds(times: Any) -> float:
    """User plus system time of a psutil cpu_times() result."""
    return float(times.user + times.system)


@dataclass
class CpuUse:
    """CPU seconds spent over a window."""

    processes: dict[str, float]  # each process measured, user + system
    busy: float  # the whole machine, all CPUs: neither idle nor stolen
    steal: float  # time the hypervisor ran something else on this VM's CPUs
    capacity: float  # the window times the number of CPUs

    @property
    def outside(self) -> float:
        """What the rest of the machine used: it is shared."""
        return max(0.0, self.busy - sum(self.processes.values()))


class CpuMeter:
    """CPU time of some processes, and of the whole machine, over a window."""

    def __init__(self, processes: dict[str, psutil.Process]) -> None:
        self._processes = processes
        self._start: dict[str, float] = {}
        self._machine_start = (0.0, 0.0, 0.0)

    @staticmethod
    def _machine() -> tuple[float, float, float]:
        """(busy, steal, all) CPU seconds of the machine since boot, all CPUs."""
        t = psutil.cpu_times()
        busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        steal = getattr(t, "steal", 0.0)
        return busy, steal, busy + steal + t.idle + getattr(t, "iowait", 0.0)

    def start(self) -> None:
        self._start = {key: cpu_seconds(p.cpu_times()) for key, p in self._processes.items()}
        self._machine_start = self._machine()

    def stop(self) -> CpuUse:
        used = {key: cpu_seconds(p.cpu_times()) - self._start[key] for key, p in self._processes.items()}
        busy, steal, capacity = (b - a for a, b in zip(self._machine_start, self._machine(), strict=True))
        return CpuUse(used, busy, steal, capacity)


def collect(channel: Any, producers: list[Any], kind: str) -> list[Any]:
    """One message of ``kind`` from each producer, in producer order."""
    got: dict[int, Any] = {}
    give_up = time.monotonic() + READY_TIMEOUT
    while len(got) < len(producers):
        try:
            what, index, body = channel.get(timeout=0.1)
        except queue.Empty:
            dead = [p.name for p in producers if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"producer failed: {', '.join(dead)}") from None
            if time.monotonic() > give_up:
                raise RuntimeError(f"producers did not report {kind!r} within {READY_TIMEOUT:g} s") from None
            continue
        if what == kind:
            got[index] = body
    return [got[i] for i in range(len(producers))]


# -- reports ------------------------------------------------------------------------


def start_producers(ctx: Any, target: Any, arglists: Sequence[tuple[Any, ...]], name: str, channel: Any) -> list[Any]:
    """Start one daemon process per argument tuple and wait until each has said "ready" on ``channel``."""
    procs = [ctx.Process(target=target, args=args, name=f"{name}-{i}", daemon=True) for i, args in enumerate(arglists)]
    for p in procs:
        p.start()
    collect(channel, procs, "ready")
    return procs


def strict_json(obj: Any) -> Any:
    """``obj`` with NaN and infinities (a figure that could not be measured) as None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {key: strict_json(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(value) for value in obj]
    return obj


def progress(message: str) -> None:
    """Progress goes to stderr, so that stdout holds only the report."""
    print(f"  {message}", file=sys.stderr, flush=True)


def terminate(signum: int, frame: object) -> None:
    """A SIGTERM handler: SystemExit, so that the finally blocks stop the
    processes we started and unlink our segments."""
    sys.exit(128 + signum)
