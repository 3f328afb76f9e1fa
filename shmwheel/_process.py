"""Process identity: a pid plus its start time, so that a reused pid is never
mistaken for the process that registered it.

The start time is field 22 of /proc/PID/stat, in clock ticks since boot, not
psutil's create_time(): that one adds the boot time as seen from the wall
clock, which moves whenever the wall clock is stepped (NTP at boot,
``date -s``), so two readings of one live process can disagree and a live
driver would be declared dead.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import psutil

__all__ = [
    "USE_LOCK_AT",
    "after_fork",
    "alive",
    "catch_up_fork",
    "describe_lock_holder",
    "pid",
    "pid_namespace",
    "signal_disposition",
    "start_time",
    "uids",
    "uses_file",
]


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot, or None
    if there is no such process (a zombie counts as gone)."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no such process
        return None
    # The command name (field 2) is in parentheses and may hold anything,
    # spaces and parentheses included: count the fields after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # field 3, the state: zombie or dead
        return None
    return int(fields[19])  # field 22


def alive(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start``."""
    return start_time(pid) == start


#: Where in a wheel's file a process that uses it holds its lock: this
#: plus its start time, far beyond any segment (see ``Wheel.show_use()``).
USE_LOCK_AT = 1 << 40


def uses_file(pid: int, start: int, dev: int, ino: int) -> bool | None:
    """Whether process ``pid``, which started at ``start``, uses the file
    ``(dev, ino)``, as the kernel says, never a segment anyone may write:
    it maps the file (/proc/PID/maps), or, where that cannot be read (a
    process that dropped its privileges is not dumpable, and its maps are
    root's to read), /proc/locks shows a POSIX lock on the file's byte
    USE_LOCK_AT + ``start``, taken by ``pid`` (``Wheel.show_use()``).

    The lock is the weaker word: /proc/locks names the process that took
    a lock, and one taken by a process that shared its descriptor table
    with another outlives it.  Its byte, the start time of the process,
    makes a lock that is to pass for a later process's have to be taken
    before that process starts, at the moment it will.  None if neither
    can be read."""
    major, minor = f"{os.major(dev):02x}".encode(), f"{os.minor(dev):02x}".encode()
    inode = str(ino).encode()
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            # "7f0c..-7f0c.. rw-s 00000000 00:1a 5678   /dev/shm/NAME"
            for line in f:
                fields = line.split(None, 5)
                if len(fields) >= 5 and fields[3] == major + b":" + minor and fields[4] == inode:
                    return True
        return False
    except PermissionError:
        pass
    except OSError:  # gone
        return False
    held = major + b":" + minor + b":" + inode
    mine = str(pid).encode()
    at = str(USE_LOCK_AT + start).encode()
    try:
        with open("/proc/locks", "rb") as f:
            # "1: POSIX  ADVISORY  READ 1234 00:1a:5678 0 0"; a blocked
            # waiter's line starts with "1: ->" and holds nothing yet.
            for line in f:
                fields = line.split()
                if (
                    len(fields) >= 8
                    and fields[1] == b"POSIX"
                    and (fields[4], fields[5], fields[6], fields[7]) == (mine, held, at, at)
                ):
                    return True
    except OSError:
        return None
    return False


def pid_namespace() -> int:
    """This process's PID namespace: the inode of /proc/self/ns/pid (0 if
    the kernel has none to show).  Pids mean something only within one.

    A process never changes namespace (unshare and setns move only the
    children it makes next), so it is read once, and again after a fork.
    """
    global _pid_namespace
    if _pid_namespace is None:
        try:
            _pid_namespace = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            _pid_namespace = 0
    return _pid_namespace


_pid_namespace: int | None = None


# This process's pid, asked once and again in a forked child, and what else
# the package must redo there: one fork hook runs every module's, in the
# order they were registered.  The C request path (shmwheel._fast) keeps a
# copy of its own, set by pthread_atfork, which runs at every fork.
#: This process's pid, without a system call.  Read it as ``_process.pid``:
#: a name imported from here would keep the pid it had at the import.
pid = os.getpid()
_in_child: list[Callable[[], None]] = []


def after_fork(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` in every forked child, after the pid is set again."""
    _in_child.append(hook)
    return hook


def _forked() -> None:
    """The hooks, each whatever the others do (one that raises is logged:
    a lock another skipped hook would have made anew could deadlock the
    child), then the pid, so that nothing sees the child's pid before its
    hooks have run."""
    global pid, _pid_namespace
    _pid_namespace = None
    for hook in _in_child:
        try:
            hook()
        except Exception:
            logging.getLogger("shmwheel").exception("shmwheel: a fork hook failed: %r", hook)
    pid = os.getpid()


def catch_up_fork() -> bool:
    """Run the fork hooks now if this process was forked without them
    (uWSGI forks its workers without Python's hooks unless told
    ``py-call-osafterfork``); True if this call ran them.  Of threads that
    see it at once, the first to claim the new pid runs them (a lock could
    not be trusted: the fork may have copied it held).  A system call: for
    the moments a process attaches, and once a second."""
    me = os.getpid()
    if pid == me or _catching_up.setdefault(me, threading.get_ident()) != threading.get_ident():
        return False
    _forked()
    return True


_catching_up: dict[int, int] = {}  # pid: the thread that runs its late hooks (setdefault is atomic)
os.register_at_fork(after_in_child=_forked)


def uids(pid: int) -> tuple[int, int, int] | None:
    """The real, effective and saved uid of process ``pid``, or None if
    there is no such process (anyone may read them)."""
    if pid <= 0:
        return None
    try:
        real, effective, saved = psutil.Process(pid).uids()
    except psutil.Error:  # gone, or a zombie
        return None
    return real, effective, saved


def signal_disposition(pid: int, signum: int) -> str | None:
    """What process ``pid`` does with signal ``signum``, from /proc/PID/status:
    "caught" (a handler, whether or not the main thread blocks it right
    now: the kernel does while that thread runs the handler, and a signal
    sent meanwhile waits or goes to another thread, never to the default
    action), "ignored", "blocked" (with no handler, as the main thread
    shows it) or "default"; None if that cannot be read (gone, or another
    PID namespace)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = {k: v.strip() for k, _, v in (line.partition(":") for line in f) if k.startswith("Sig")}
        bit = 1 << (signum - 1)
        if int(masks["SigIgn"], 16) & bit:
            return "ignored"
        if int(masks["SigCgt"], 16) & bit:
            return "caught"
        return "blocked" if int(masks["SigBlk"], 16) & bit else "default"
    except (OSError, KeyError, ValueError):
        return None


# How the state of a process that holds a lock too long reads, and what it suggests.
_HOLDER_STATES = {
    psutil.STATUS_STOPPED: "stopped (SIGSTOP or a job-control stop; `kill -CONT {pid}` resumes it)",
    psutil.STATUS_TRACING_STOP: "stopped in a debugger",
    psutil.STATUS_DISK_SLEEP: "in uninterruptible sleep (a frozen cgroup or a paused container?)",
    psutil.STATUS_SLEEPING: "asleep (a frozen cgroup or a paused container?)",
    psutil.STATUS_RUNNING: "running",
    psutil.STATUS_ZOMBIE: "exiting",
    psutil.STATUS_DEAD: "exiting",
}


def describe_lock_holder(tid: int) -> tuple[str, int | None]:
    """The end of a lock timeout's message, and the holder's pid if it can be seen."""
    if tid <= 0:
        return ": no holder is recorded in it (its lock word is scribbled)", None
    try:
        status = psutil.Process(tid).status()
        with open(f"/proc/{tid}/status") as f:
            pid = next(int(line.split()[1]) for line in f if line.startswith("Tgid:"))
    except (psutil.Error, OSError, StopIteration, ValueError):
        return (
            f": it names thread {tid}, which does not exist in this PID namespace (the lock word is scribbled, "
            "or its holder runs in another PID namespace)",
            None,
        )
    who = f"process {pid}" if pid == tid else f"process {pid} (thread {tid})"
    return f": held by {who}, which is " + _HOLDER_STATES.get(status, status).format(pid=pid), pid
