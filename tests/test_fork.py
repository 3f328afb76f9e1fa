"""The package's one fork hook (shmwheel._process): the cached pid and every
module's after-fork work, in a child forked with Python's hooks and in one
forked without them, as uWSGI forks its workers unless told otherwise."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

import shmwheel
from shmwheel import _process
from shmwheel.contrib._record import PAYLOAD_SIZE, RequestRecord, decode_request

# The child's side, run in a fresh interpreter so that a raw fork never
# happens inside the test runner.  It prints what the parent checks.
_CHILD = textwrap.dedent(
    """
    import ctypes, os, sys
    from shmwheel import _process
    from shmwheel.contrib._worker import RequestTimer

    ran = []
    _process.after_fork(lambda: ran.append(os.getpid()))
    timer = RequestTimer(sys.argv[1], 0.2, traceback_signal=None)
    timer.finish(timer.start("GET", "/in-the-parent"))  # attached in the parent
    parent = os.getpid()
    fork = os.fork if sys.argv[2] == "python" else ctypes.CDLL(None, use_errno=True).fork
    pid = fork()
    if pid == 0:
        try:
            before = _process.pid
            timer.prepare()  # a server's post-fork hook
            handle = timer.start("GET", "/in-the-child")
            print(parent, os.getpid(), before, _process.pid, ran, handle is not None, flush=True, sep=" ")
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    """
)


@pytest.mark.parametrize("how", ["python", "raw"])
def test_a_forked_childs_pid_hooks_and_records_are_its_own(make_wheel, how: str) -> None:
    """os.fork() runs the hook at once; a raw fork(), which runs none of
    Python's, is caught up by RequestTimer.prepare(), so the child's
    records name the child and not its parent."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, wheel.name, how], capture_output=True, text=True, timeout=60, check=True
    )
    parent, child, before, after, ran = done.stdout.split(" ", 4)
    assert before == (child if how == "python" else parent)
    assert after == child
    assert ran.strip() == f"[{child}] True"
    fires = [(fire.owner_pid, record.pid, record.path) for fire, record in _fires(wheel)]
    assert fires == [(int(child), int(child), "/in-the-child")]


def _fires(wheel: shmwheel.Wheel) -> list[tuple[shmwheel.Fire, RequestRecord]]:
    """Every timer pending in ``wheel``, fired once due, with its record:
    the child's timer outlived it (it never finished its request)."""
    found = []
    deadline = time.monotonic() + 30
    while len(wheel) and time.monotonic() < deadline:
        time.sleep(0.05)
        for fire in wheel.poll():
            record = decode_request(fire.payload)
            assert record is not None
            found.append((fire, record))
    return found


def test_the_pid_is_cached_and_a_fork_without_hooks_is_caught_up_once() -> None:
    assert _process.pid > 0
    assert _process.catch_up_fork() is False  # this process: nothing to catch up
