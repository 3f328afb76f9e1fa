"""The driver a server runs (shmwheel.contrib._supervisor): DriverSupervisor
restarting a dead driver, keeping it out of the server's process group
and ending it with the server's process; create_wheel taking over a
sound wheel left behind, replacing one that is not (saying what it
drops), and leaving a segment it cannot read alone."""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _contrib import driver_pid, wait_until
from conftest import foreign_segment, header

import shmwheel
from shmwheel._binding import lib
from shmwheel._process import start_time
from shmwheel.contrib import DriverSupervisor, TimeoutActions, create_wheel


def test_supervisor_restarts_a_dead_driver_and_cleans_up(name: str) -> None:
    sup = DriverSupervisor(name, TimeoutActions(tracebacks=False))
    sup.start()
    try:
        first = sup.pid
        assert first is not None and driver_pid(name) == first
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: sup.restarts == 1, "the driver was not restarted")
        assert driver_pid(name) == sup.pid != first
        second = sup.pid
        sup.restart(TimeoutActions(kill=True))
        assert sup.pid != second and driver_pid(name) == sup.pid
        assert "--kill" in " ".join(open(f"/proc/{sup.pid}/cmdline").read().split("\0"))
    finally:
        last = sup.pid
        sup.stop()
    assert not Path("/dev/shm", name).exists()
    assert last is not None and not os.path.exists(f"/proc/{last}")


def test_supervisor_restarts_a_crash_loop_at_once_and_says_so_once(name: str, caplog) -> None:
    """Five deaths in a row: each driver is restarted as soon as it may be
    (twice a second at most), not after a backoff that doubles (1, 2, 4, 8,
    16 s: 31 s in all), which left requests untimed; one ERROR line says it."""
    sup = DriverSupervisor(name, TimeoutActions(tracebacks=False))
    sup.start()
    try:
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, "shmwheel.timeouts"):
            for n in range(1, 6):
                pid = sup.pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                wait_until(lambda n=n: sup.restarts == n and driver_pid(name) == sup.pid, "not restarted")
        # The doubling backoff alone took 31 s, however fast the machine; five
        # restarts at most twice a second take seconds, even on a busy one.
        assert time.monotonic() - started < 25.0
        died = [r.getMessage() for r in caplog.records if "the driver (pid" in r.getMessage()]
        assert len(died) == 1 and "was killed by SIGKILL after" in died[0], died
    finally:
        sup.stop()


def test_supervisor_keeps_the_driver_out_of_the_servers_process_group(name: str) -> None:
    # A terminal's Ctrl-C goes to the foreground process group: the server's.
    # The driver must not get it behind the server's back (the watcher would
    # log its death and start another while the server shuts down); the
    # server's stop() stops it.
    sup = DriverSupervisor(name, TimeoutActions(tracebacks=False))
    sup.start()
    try:
        assert sup.pid is not None
        assert os.getpgid(sup.pid) == sup.pid != os.getpgid(0)
    finally:
        sup.stop()
    assert sup.restarts == 0 and not Path("/dev/shm", name).exists()


def test_supervisor_refuses_a_wheel_with_a_live_driver_and_replaces_a_stale_one(name: str, caplog) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = shmwheel.create(name, capacity=10)
    assert lib.shmw_driver_register(stale.core, gone.pid, 1, 0, 0) == 0  # its driver died
    stale.close()
    first = DriverSupervisor(name)
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        first.start()
    try:
        assert "replacing a segment left over from a server that is gone" in caplog.text
        with pytest.raises(shmwheel.DriverRunningError, match="is in use"):
            DriverSupervisor(name).start()
    finally:
        first.stop()


#: What create_wheel says of a wheel of capacity 10 and the default record size.
OTHER_SIZE = "capacity 10, tick 0.001 s and records of 64 bytes, not 65536, 0.001 s and 256"


def test_a_sound_wheel_no_driver_runs_on_is_taken_over_with_its_timers(name: str, caplog) -> None:
    """What a driver restarted by a process manager finds (--create), while
    the workers go on adding to the wheel: it is kept, timers and all."""
    assert create_wheel(name) is True
    with shmwheel.attach(name) as worker:
        h = worker.add(3600.0, b"a request in progress")
        with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
            assert create_wheel(name) is False
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", f"wheel {name!r}: taking over a wheel no driver runs on; its 1 timer stay")
        ]
        assert worker.cancel(h), "the wheel was replaced under the worker"


def test_a_wheel_that_is_not_sound_is_replaced_not_taken_over(name: str, caplog) -> None:
    create_wheel(name)
    with shmwheel._wheel.observe(name) as old:
        header(old).free_count -= 1  # a scribble in shard 0
        shards = old.stats().shards  # one a CPU: how many depends on the machine
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        assert create_wheel(name) is True
    assert "replacing a segment no driver runs on (segment" in caplog.text
    free = 65536 // shards
    where = "" if shards == 1 else "shard 0: "
    assert f"{where}counters: free_count is {free - 1} but {free} entries are free);" in caplog.text


def test_an_empty_wheel_of_another_size_is_replaced_without_a_warning(name: str, caplog) -> None:
    shmwheel.create(name, capacity=10).close()
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        create_wheel(name)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert (
        "replacing a segment no driver runs on (OTHER); it holds no timers".replace(
            "OTHER", "capacity 10, tick 0.001 s and records of 64 bytes, not 65536, 0.001 s and 256"
        )
        in caplog.text
    )


def test_a_wheel_no_driver_runs_on_with_timers_pending_is_replaced_with_a_warning_that_counts_them(
    name: str, caplog
) -> None:
    """`shmwheel create` and a timer an hour away: --create may replace it, not silently."""
    kept = shmwheel.create(name, capacity=10)
    kept.add(3600.0, b"somebody's timer")
    kept.add(60.0, b"a request of a worker that is gone")
    kept.close()
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        create_wheel(name)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            f"wheel {name!r}: replacing a segment no driver runs on ({OTHER_SIZE}); dropping its 2 pending timers",
        )
    ]
    with shmwheel.attach(name) as fresh:
        assert len(fresh) == 0


def test_a_wheel_whose_driver_died_is_replaced_with_a_warning_that_counts_its_timers(name: str, caplog) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = shmwheel.create(name, capacity=10)
    stale.add(60.0)
    assert lib.shmw_driver_register(stale.core, gone.pid, 1, 0, 0) == 0
    stale.close()
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        create_wheel(name)
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        f"wheel {name!r}: replacing a segment left over from a server that is gone "
        f"(its driver, pid {gone.pid}, died; {OTHER_SIZE}); dropping its 1 pending timer"
    )


@pytest.mark.parametrize(
    ("data", "match", "remove_with"),
    [
        (b"another program's bytes", "is not a shmwheel segment", "rm /dev/shm/{name}"),
        (b"", "is not an initialised shmwheel segment", "rm /dev/shm/{name}"),
        (struct.pack("<QI", lib.SHMW_MAGIC, 999), "has another layout version", "shmwheel unlink {name}"),
    ],
    ids=["foreign", "zeros", "future-version"],
)
def test_create_wheel_leaves_a_segment_it_cannot_read_as_a_wheel_alone(
    name: str, data: bytes, match: str, remove_with: str
) -> None:
    """Not a wheel, or not one this build reads: an error naming it and how to remove it, and it stays."""
    foreign_segment(name, data)
    with pytest.raises(shmwheel.IncompatibleSegmentError) as info:
        create_wheel(name)
    message = str(info.value)
    assert message.startswith(f"segment {name!r} {match}")
    assert f"not replacing it; if nothing uses it, remove it yourself: {remove_with.format(name=name)}" in message
    assert Path("/dev/shm", name).read_bytes()[: len(data)] == data


def test_a_driver_whose_parent_is_killed_removes_the_wheel(name: str, tmp_path: Path) -> None:
    """SIGKILL the process that runs the supervisor: its driver stops and takes the wheel with it."""
    code = (
        "from shmwheel.contrib import DriverSupervisor as S\n"
        f"s = S({name!r})\ns.start()\nprint(s.pid, flush=True)\ninput()"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert Path("/dev/shm", name).exists()
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: not Path("/dev/shm", name).exists(), "the wheel outlived its server")
    wait_until(lambda: start_time(child) is None, "the driver outlived its server")


def test_a_driver_outlives_the_thread_that_started_it_and_not_its_process(name: str) -> None:
    """The thread that spawned the driver exits: the driver runs on.  The
    process is killed later: the driver goes, and the wheel with it."""
    code = (
        "import threading, time\n"
        "from shmwheel.contrib import DriverSupervisor as S\n"
        f"s = S({name!r})\n"
        "t = threading.Thread(target=s.start)\nt.start()\nt.join()\n"
        "print(s.pid, flush=True)\n"
        "input()\n"
        "print(s.pid, s.restarts, flush=True)\n"
        "input()"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdin is not None and parent.stdout is not None
        child = int(parent.stdout.readline())
        child_start = start_time(child)
        time.sleep(1.0)  # a driver stopped by the thread's exit would be gone by now
        assert start_time(child) == child_start, "the driver stopped when the thread that started it exited"
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().split() == [str(child), "0"]
        with shmwheel.attach(name) as wheel:
            assert wheel.stats().driver_pid == child
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: not Path("/dev/shm", name).exists(), "the wheel outlived its server")
    wait_until(lambda: start_time(child) is None, "the driver outlived its server")
