"""The driver that a server's workers start themselves, for servers whose
master runs no code of ours (Uvicorn, Hypercorn): :class:`AutoDriver`.
The worker's side: it starts the driver command as a process of its own,
and imports nothing of the driver's.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import subprocess
import sys
import threading

from .._errors import SegmentExistsError
from .._segment import SHM, bare_name, segment_name
from .._wheel import create
from ._logs import LogTarget
from ._record import PAYLOAD_SIZE
from ._settings import COMMAND, DEFAULT_CAPACITY, TimeoutActions, reserve_for, shards_for
from ._stacks import server_logger

__all__ = ["AutoDriver"]

_log = logging.getLogger("shmwheel.timeouts")


class AutoDriver:
    """The driver of a wheel that a server's workers share, started by the
    workers themselves: for servers whose master runs no code of ours
    (Uvicorn, Hypercorn), so that wrapping the application is all it takes.

    Whichever worker finds no driver on the wheel starts one, ``python -m
    shmwheel.contrib.timeouts NAME --while-used``, in a session of its own,
    handing it an exclusive :func:`fcntl.flock` on the wheel's file that it
    holds for its whole life.  The lock is the question "does a driver run,
    or is one starting?": a worker that cannot take it leaves things be, and
    the kernel lets go of it however the driver ends, SIGKILL included, so
    that the next worker to look starts another, which takes the wheel over
    with its timers.  The driver ends by itself once no process has used
    the wheel for :data:`shmwheel.contrib._supervisor.IDLE_EXIT` seconds, and removes it: it outlives
    every worker by that long, whichever of them started it, and a server
    that stops leaves nothing in /dev/shm.
    """

    def __init__(
        self, name: str, actions: TimeoutActions, *, capacity: int = DEFAULT_CAPACITY, after_server_log: bool = False
    ) -> None:
        segment_name(name)
        self.name = name
        self.actions = actions
        self.capacity = capacity
        #: Start the driver only once the server's error log is set up (or
        #: at the first request), so that it writes there: a server that
        #: sets it up late (Hypercorn) would leave it writing to stderr.
        self.after_server_log = after_server_log

    def make_wheel(self) -> None:
        """Create the wheel unless it is there (of two workers, one makes it)."""
        with contextlib.suppress(SegmentExistsError):
            create(
                self.name,
                capacity=self.capacity,
                payload_size=PAYLOAD_SIZE,
                reserve=reserve_for(self.capacity),
                shards=shards_for(self.capacity),
            ).close()

    def ensure_running(self) -> int | None:
        """Start a driver unless one runs or is starting; its pid if this call started it.

        Call it once attached to the wheel: the driver ends when it finds no
        process attached, and the caller is one."""
        try:
            fd = os.open(SHM / bare_name(self.name), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None  # removed: the next add sees it and makes another
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # a driver holds it
            cmd = [sys.executable, "-m", COMMAND, self.name, "--while-used", f"--lock-fd={fd}", *self.actions.as_args()]
            target = LogTarget.of(server_logger())
            if target is not None:  # the server's error log, where the worker writes its stacks
                cmd += target.as_args()
            # In a session of its own: it outlives the worker that starts it,
            # and a Ctrl-C at the terminal is for the server, whose workers
            # still finish their requests, which still need timing.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, pass_fds=(fd,), start_new_session=True)
        finally:
            os.close(fd)  # the driver's copy holds the lock from here on
        # Reaped when it exits before this worker does (else init reaps it).
        threading.Thread(target=proc.wait, name="shmwheel-reap", daemon=True).start()
        _log.info("wheel %r: no driver ran on it; started one, pid %d", self.name, proc.pid)
        return proc.pid
