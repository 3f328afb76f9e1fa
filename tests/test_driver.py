"""The driver, as a real process: fires, wake-ups, delivery, lifecycle.

Handlers run in the driver's process (spawned), so the ones here are
module-level functions that append each fire as a JSON line to a file the
test reads back.
"""

from __future__ import annotations

import fcntl
import functools
import itertools
import json
import logging
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import entry, header, script_processes, wait_for

import shmwheel
from shmwheel._binding import lib
from shmwheel._cli import _json_line, _JsonLinesDriver
from shmwheel._driver import OutputFailed
from shmwheel._process import start_time

# -- handlers (run in the driver process) -------------------------------------------


def record(path: str, fire: shmwheel.Fire) -> None:
    line = {
        "handle": fire.handle,
        "deadline_ns": fire.deadline_ns,
        "fired_at_ns": fire.fired_at_ns,
        "payload": fire.payload.decode(),
        "owner_pid": fire.owner_pid,
        "redelivered": fire.redelivered,
        "kept": fire.kept,
        "handled_ns": time.monotonic_ns(),
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def record_slowly(path: str, seconds: float, fire: shmwheel.Fire) -> None:
    time.sleep(seconds)
    record(path, fire)


def record_or_block(path: str, fire: shmwheel.Fire) -> None:
    """Records every fire, then hangs on the one whose payload says so."""
    record(path, fire)
    if fire.payload == b"block":
        time.sleep(3600)


def record_or_wait(path: str, gate: str, fire: shmwheel.Fire) -> None:
    """Records every fire, then waits on the one whose payload says so until ``gate`` exists."""
    record(path, fire)
    give_up = time.monotonic() + 60
    while fire.payload == b"block" and not os.path.exists(gate) and time.monotonic() < give_up:
        time.sleep(0.01)


def record_and_keep(path: str, fire: shmwheel.Fire) -> object:
    """Records every fire, and keeps in flight those whose payload says so."""
    record(path, fire)
    return shmwheel.KEEP_IN_FLIGHT if fire.payload == b"keep" else None


class Sifting:
    """Records every fire it reads, keeps in flight those whose payload says
    so if ``keep``, and refuses unread the fires of ``owner`` but those
    whose payload begins with "w": each batch taken out is a line too."""

    def __init__(self, path: str, owner: int, keep: bool) -> None:
        self.path, self.owner, self.keep = path, owner, keep

    def refuses_unread(self) -> tuple[list[int], bytes]:
        return [self.owner], b"w"

    def refused_unread(self, count: int, handle: int, pid: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"refused": count, "handle": handle, "owner_pid": pid}) + "\n")

    def __call__(self, fire: shmwheel.Fire) -> object:
        record(self.path, fire)
        return shmwheel.KEEP_IN_FLIGHT if self.keep and fire.payload == b"keep" else None


def record_or_raise(path: str, fire: shmwheel.Fire) -> None:
    if fire.payload == b"bad":
        raise RuntimeError("a handler that fails")
    record(path, fire)


# -- helpers -----------------------------------------------------------------------------


def read_records(path: Path) -> list[dict]:
    """The complete lines so far (the handler may be half-way through one)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


@pytest.fixture
def drivers() -> Iterator[list[shmwheel.DriverProcess]]:
    """Drivers started by the test; killed at teardown if still running."""
    started: list[shmwheel.DriverProcess] = []
    yield started
    for d in started:
        if d.is_alive():
            d.stop(timeout=10)


@pytest.fixture
def start(drivers: list[shmwheel.DriverProcess]) -> Callable[..., shmwheel.DriverProcess]:
    def start(name: str, handler: Callable[[shmwheel.Fire], object] | None = None) -> shmwheel.DriverProcess:
        d = shmwheel.start_driver(name, handler)
        drivers.append(d)
        return d

    return start


# -- tests ----------------------------------------------------------------------------------


def test_every_surviving_timer_fires_once_and_never_early(make_wheel, start, tmp_path: Path) -> None:
    wheel = make_wheel(capacity=5000)
    out = tmp_path / "fires.jsonl"
    start(wheel.name, functools.partial(record, str(out)))
    rng = random.Random(3)
    handles = [wheel.add(rng.uniform(0, 0.5), b"t%d" % i) for i in range(2000)]
    cancelled = {h for h in handles[::3] if wheel.cancel(h)}
    expected = set(handles) - cancelled
    wait_for(lambda: len(read_records(out)) >= len(expected))
    time.sleep(0.1)  # room for a duplicate to show up
    fires = read_records(out)
    fired = [f["handle"] for f in fires]
    assert len(fired) == len(set(fired)), "a timer fired twice"
    assert set(fired) == expected
    assert all(f["fired_at_ns"] >= f["deadline_ns"] for f in fires), "fired before its deadline"
    assert not any(f["redelivered"] for f in fires)
    assert all(f["owner_pid"] == os.getpid() for f in fires)
    st = wheel.stats()
    assert (st.pending, st.in_flight, st.fired, st.acked) == (0, 0, len(expected), len(expected))


def test_a_scribbled_generation_is_retired_and_the_driver_goes_on(make_wheel, start, tmp_path: Path) -> None:
    """High bits scribbled into a pending entry's generation would make a
    negative handle: the driver must not hand that out (whose acknowledgement
    would fail and stop it, and every restart with it), but retire the entry,
    say so, and deliver every healthy timer exactly once."""
    wheel = make_wheel(capacity=100)
    out = tmp_path / "fires.jsonl"
    handles = [wheel.add(0.5, b"t%d" % i) for i in range(10)]
    index_bits = lib.shmw_index_bits(wheel.capacity)
    victim = handles[3] & ((1 << index_bits) - 1)
    entry(wheel, victim).generation |= 1 << (63 - index_bits)  # the handle's sign bit
    driver = start(wheel.name, functools.partial(record, str(out)))
    wait_for(lambda: len(read_records(out)) >= 9)
    later = wheel.add(0.05, b"after")  # and it goes on firing
    wait_for(lambda: any(f["handle"] == later for f in read_records(out)))
    time.sleep(0.1)  # room for a duplicate, or the damaged one, to show up
    fired = [f["handle"] for f in read_records(out)]
    assert sorted(fired) == sorted([h for h in handles if h != handles[3]] + [later])
    assert all(h >= 0 for h in fired)
    assert driver.is_alive()
    st = wheel.stats()
    assert (st.quarantined, st.pending, st.in_flight) == (1, 0, 0)
    assert st.repairs >= 1 and st.retired == 1
    assert driver.stop() == 0


# A driver on the tests' core, whose clock sleeps up to a day instead of its
# 100 ms cap: then nothing but a producer's wake-up fires an earlier timer
# within the minute a test gives it.  argv: the tests' folder, the wheel.
_DRIVER_WITHOUT_CAP = """
import sys
sys.path.insert(0, sys.argv[1])
import conftest  # noqa: F401  (the tests' core, as in the suite's own process)
import shmwheel
from shmwheel._binding import lib
lib.shmw_test_clock_cap(lib.SHMW_TEST_CLOCK_CAP_MAX_NS)
shmwheel.Driver(sys.argv[2], lambda fire: None).run(on_ready=lambda: print("ready", flush=True))
"""


def test_an_earlier_timer_wakes_a_driver_sleeping_for_an_hour(make_wheel, tmp_path: Path) -> None:
    """The driver's clock may sleep a day here (the tests' core lets a test
    stretch its cap): each timer added while it sleeps on the hour's timer
    fires within a minute only if the add woke it."""
    wheel = make_wheel(capacity=10)
    wheel.add(3600, b"later")
    hd, tick_ns = header(wheel), round(wheel.tick * 1e9)
    with script_processes(tmp_path, _DRIVER_WITHOUT_CAP, "driver") as run:
        proc = run([str(Path(__file__).parent), wheel.name])
        for n in range(1, 4):
            # Asleep until the hour's timer: the tick it sleeps until is that far.
            wait_for(lambda: hd.sleep_until * tick_ns > time.monotonic_ns() + 600 * 10**9, timeout=60)
            wheel.add(0.010, b"soon")
            wait_for(lambda n=n: wheel.stats().acked == n, timeout=60)
        assert proc.poll() is None, proc.err.read()
    assert len(wheel) == 1


def test_a_slow_handler_does_not_delay_the_clock(make_wheel, start, tmp_path: Path) -> None:
    """The handler holds on to the first fire until the test lets it go:
    the clock fires the seven behind it meanwhile, each stamped as it fired."""
    wheel = make_wheel(capacity=100)
    out, gate = tmp_path / "fires.jsonl", tmp_path / "gate"
    start(wheel.name, functools.partial(record_or_wait, str(out), str(gate)))
    wheel.add(0.05, b"block")
    for i in range(7):
        wheel.add(0.07 + 0.02 * i, b"%d" % i)
    # A clock that waited for the handler would stop at one fire, for good.
    wait_for(lambda: wheel.stats().fired == 8)
    assert [f["payload"] for f in read_records(out)] == ["block"], "the handler let go of the first fire"
    let_go = time.monotonic_ns()
    gate.touch()
    wait_for(lambda: len(read_records(out)) == 8)
    fires = read_records(out)
    assert [f["payload"] for f in fires] == ["block", *(str(i) for i in range(7))]
    # Every fire was stamped when the clock fired it, not when the handler got to it.
    for f in fires:
        assert f["deadline_ns"] <= f["fired_at_ns"] < let_go


def test_handler_errors_are_counted_not_fatal(make_wheel, start, tmp_path: Path) -> None:
    wheel = make_wheel(capacity=10)
    out = tmp_path / "fires.jsonl"
    d = start(wheel.name, functools.partial(record_or_raise, str(out)))
    wheel.add(0.01, b"bad")
    wheel.add(0.05, b"good")
    wait_for(lambda: len(read_records(out)) == 1 and wheel.stats().in_flight == 0)
    st = wheel.stats()
    assert st.handler_errors == 1 and st.acked == 2
    assert d.is_alive()


def test_sigkilled_driver_is_taken_over_and_redelivers_only_what_was_in_flight(
    make_wheel, start, tmp_path: Path
) -> None:
    wheel = make_wheel(capacity=100)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    d1 = start(wheel.name, functools.partial(record_or_block, str(first)))
    early = [wheel.add(0.05, b"early") for _ in range(5)]
    blocker = wheel.add(0.2, b"block")
    behind = [wheel.add(0.25, b"behind") for _ in range(3)]
    later = [wheel.add(1.5, b"later") for _ in range(2)]
    # The first driver handles the early five, hangs in the blocker's
    # handler, and fires the three behind it into flight meanwhile.
    wait_for(lambda: len(read_records(first)) == 6 and wheel.stats().in_flight == 4)
    os.kill(d1.pid, signal.SIGKILL)
    wait_for(lambda: not d1.is_alive())
    assert wheel.stats().driver_pid == d1.pid  # still registered: nobody knows yet

    d2 = start(wheel.name, functools.partial(record, str(second)))
    assert d2.pid != d1.pid
    wait_for(lambda: len(read_records(second)) == 6)
    time.sleep(0.1)
    got = read_records(second)
    redelivered = sorted(f["handle"] for f in got if f["redelivered"])
    fresh = sorted(f["handle"] for f in got if not f["redelivered"])
    assert redelivered == sorted([blocker, *behind])
    assert fresh == sorted(later)
    assert not set(early) & {f["handle"] for f in got}, "an acknowledged fire came again"
    st = wheel.stats()
    assert (st.in_flight, st.redelivered, st.driver_pid) == (0, 4, d2.pid)


def test_a_kept_fire_stays_in_flight_until_acknowledged_and_a_new_driver_is_handed_it_kept(
    make_wheel, start, tmp_path: Path
) -> None:
    """A handler that returns KEEP_IN_FLIGHT (its work outlives the call)
    leaves the fire in flight with the batch acknowledged around it.  The
    driver that takes over from a SIGKILLed one is handed it again, marked
    redelivered and kept; acknowledged, it is freed once."""
    wheel = make_wheel(capacity=100)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    d1 = start(wheel.name, functools.partial(record_and_keep, str(first)))
    kept = wheel.add(0.05, b"keep")
    done = [wheel.add(0.05, b"done") for _ in range(3)]
    wait_for(lambda: len(read_records(first)) == 4 and wheel.stats().acked == 3)
    st = wheel.stats()
    assert (st.in_flight, st.pending) == (1, 0)
    assert not any(f["kept"] for f in read_records(first))  # kept by this handler, not before

    os.kill(d1.pid, signal.SIGKILL)
    wait_for(lambda: not d1.is_alive())
    d2 = start(wheel.name, functools.partial(record, str(second)))
    wait_for(lambda: len(read_records(second)) == 1 and wheel.stats().in_flight == 0)
    (again,) = read_records(second)
    assert (again["handle"], again["redelivered"], again["kept"]) == (kept, True, True)
    assert not set(done) & {f["handle"] for f in read_records(second)}
    assert d2.stop() == 0

    # Acknowledged by the handler's own wheel: freed once, and only if in flight.
    d3 = start(wheel.name, functools.partial(record_and_keep, str(first)))
    again_kept = wheel.add(0.01, b"keep")
    wait_for(lambda: len(read_records(first)) == 5 and wheel.stats().in_flight == 1)
    acked = wheel.stats().acked
    assert wheel.acknowledge([again_kept]) == 1
    assert wheel.acknowledge([again_kept]) == 0
    assert wheel.acknowledge([]) == 0
    st = wheel.stats()
    assert (st.in_flight, st.acked) == (0, acked + 1)
    with pytest.raises(TypeError):
        wheel.acknowledge(["1"])  # type: ignore[list-item]
    assert d3.stop() == 0


def test_fires_a_handler_refuses_unread_are_taken_out_before_it_reads_them(make_wheel, start, tmp_path: Path) -> None:
    """A handler that names the processes whose fires it refuses unread
    (refuses_unread) is handed none of theirs: the dispatcher takes them out
    of each batch, acknowledges them and tells it how many.  It still reads
    their fires that begin with a byte it names, a fire a driver kept in
    flight before, and every other process's."""
    wheel = make_wheel(capacity=5000)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    d1 = start(wheel.name, Sifting(str(first), owner=0, keep=True))
    kept = wheel.add(0.01, b"keep")
    wait_for(lambda: len(read_records(first)) == 1)
    os.kill(d1.pid, signal.SIGKILL)
    wait_for(lambda: not d1.is_alive())

    start(wheel.name, Sifting(str(second), owner=os.getpid(), keep=False))
    words = [wheel.add(0.2, b"w%d" % k) for k in range(3)]
    refused = wheel.add_many([0.2] * 1000, [b"x"] * 1000)
    other = subprocess.run(
        [sys.executable, "-c", f"import shmwheel; print(shmwheel.attach({wheel.name!r}).add(0.2, b'x'))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    theirs = int(other.stdout)

    def lines() -> tuple[list[dict], list[dict]]:
        got = read_records(second)
        return [r for r in got if "payload" in r], [r for r in got if "refused" in r]

    wait_for(lambda: sum(r["refused"] for r in lines()[1]) == 1000 and len(lines()[0]) == 5)
    wait_for(lambda: wheel.stats().in_flight == 0)
    read, told = lines()
    assert sorted(r["handle"] for r in read) == sorted([kept, *words, theirs])
    assert [r["kept"] for r in read if r["handle"] == kept] == [True]
    assert {r["owner_pid"] for r in told} == {os.getpid()} and {r["handle"] for r in told} <= set(refused)
    st = wheel.stats()
    assert (st.pending, st.in_flight, st.free) == (0, 0, st.capacity)


def test_a_driver_whose_registration_is_taken_hands_out_nothing_more(make_wheel, start, tmp_path: Path) -> None:
    # Only a driver found dead is taken over, but should a takeover meet a
    # live one (a registration written by hand, a pid check fooled), the
    # old driver must stop handing out at once: what is still unsent
    # belongs to the new one, and sending it too would deliver it twice.
    wheel = make_wheel(capacity=100)
    out, gate = tmp_path / "fires.jsonl", tmp_path / "gate"
    d1 = start(wheel.name, functools.partial(record_or_wait, str(out), str(gate)))
    blocker = wheel.add(0.05, b"block")
    behind = [wheel.add(0.1, b"behind") for _ in range(3)]
    # The dispatcher waits in the blocker's handler; the clock fires the rest.
    wait_for(lambda: len(read_records(out)) == 1 and wheel.stats().in_flight == 4)
    me, my_start, d1_start = os.getpid(), start_time(os.getpid()), wheel.stats().driver_start
    assert lib.shmw_driver_register(wheel.core, me, my_start, d1.pid, d1_start) == 0
    gate.touch()  # the handler returns; the dispatcher comes back for more
    wait_for(lambda: not d1.is_alive())
    assert d1.stop() == 1  # it has exited, with the error
    assert [f["handle"] for f in read_records(out)] == [blocker]
    # The blocker's handler did run, so its acknowledgement stands; the
    # three behind it wait for whoever drives next.
    wait_for(lambda: wheel.stats().in_flight == 3)
    assert lib.shmw_driver_register(wheel.core, 0, 0, me, my_start) == 0
    start(wheel.name, functools.partial(record, str(out)))
    wait_for(lambda: len(read_records(out)) == 4 and wheel.stats().in_flight == 0)
    again = read_records(out)[1:]
    assert sorted(f["handle"] for f in again) == sorted(behind)
    assert all(f["redelivered"] for f in again)


def test_a_second_driver_is_refused(make_wheel, start) -> None:
    wheel = make_wheel(capacity=10)
    d = start(wheel.name)
    with pytest.raises(shmwheel.DriverRunningError, match=f"pid {d.pid}"):
        shmwheel.start_driver(wheel.name)
    cli = subprocess.run(
        [sys.executable, "-m", "shmwheel", "driver", wheel.name], capture_output=True, text=True, timeout=30
    )
    assert cli.returncode == 1
    assert "already running" in cli.stderr and "Traceback" not in cli.stderr
    assert wheel.stats().driver_pid == d.pid


class _ExitsWhenUnpickled:
    """A handler whose unpickling ends the driver's process before it runs:
    a start that fails with no exception to send back."""

    def __call__(self, fire: shmwheel.Fire) -> None:  # pragma: no cover - never runs
        raise AssertionError("unreachable")

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return (os._exit, (3,))


def test_a_driver_that_dies_before_it_runs_is_a_driver_start_error(make_wheel) -> None:
    wheel = make_wheel(capacity=10)
    with pytest.raises(shmwheel.DriverStartError, match=r"exited with status 3 on start") as info:
        shmwheel.start_driver(wheel.name, _ExitsWhenUnpickled())
    assert type(info.value) is shmwheel.DriverStartError and isinstance(info.value, shmwheel.ShmwheelError)
    assert wheel.stats().driver_pid is None


def test_poll_is_refused_while_a_driver_runs_and_takes_over_from_a_dead_one(make_wheel, start, tmp_path: Path) -> None:
    wheel = make_wheel(capacity=10)
    out = tmp_path / "fires.jsonl"
    d = start(wheel.name, functools.partial(record_or_block, str(out)))
    with pytest.raises(shmwheel.DriverRunningError):
        wheel.poll()
    h = wheel.add(0.01, b"block")
    wait_for(lambda: len(read_records(out)) == 1)
    os.kill(d.pid, signal.SIGKILL)
    wait_for(lambda: not d.is_alive())
    (fire,) = wheel.poll()
    assert fire.handle == h and fire.redelivered and fire.payload == b"block"
    st = wheel.stats()
    assert (st.driver_pid, st.driver_state, st.in_flight) == (None, "none", 0)


def test_sigterm_finishes_the_handlers_in_flight_then_exits_0(make_wheel, start, tmp_path: Path) -> None:
    wheel = make_wheel(capacity=10)
    out = tmp_path / "fires.jsonl"
    d = start(wheel.name, functools.partial(record_slowly, str(out), 0.3))
    for _ in range(3):
        wheel.add(0.01)
    wait_for(lambda: wheel.stats().in_flight == 3)
    assert d.stop() == 0
    assert len(read_records(out)) == 3
    st = wheel.stats()
    assert (st.in_flight, st.acked, st.driver_pid) == (0, 3, None)


def _wake_ups(pid: int) -> int:
    """Times the threads of process ``pid`` have gone to sleep and woken up so far."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        for line in status.read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def test_an_idle_driver_uses_almost_no_cpu(make_wheel, start) -> None:
    """With a million far-future timers pending, the driver sleeps in the kernel:
    no periodic tick, only the clock's capped sleep and the reaper's second."""
    wheel = make_wheel(capacity=1_000_000, payload_size=0)
    for _ in range(10):
        wheel.add_many([3600.0 + i for i in range(100_000)])
    d = start(wheel.name)
    time.sleep(0.5)
    before = _wake_ups(d.pid)
    time.sleep(2.0)
    woke = _wake_ups(d.pid) - before
    # In 2 s: the clock every 100 ms (its sleep cap: 20) and the main
    # thread's look for dead producers every second (2); fewer on a busy
    # machine, which wakes them late, but at least one, or the count sees
    # nothing.  A tick of even 10 ms would be 200.
    assert 1 <= woke <= 40, f"an idle driver woke {woke} times in 2 s"
    assert len(wheel) == 1_000_000


def test_cli_driver_prints_json_lines_and_stops_on_sigterm(make_wheel) -> None:
    wheel = make_wheel(capacity=10)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmwheel", "driver", wheel.name, "--jsonl"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: wheel.stats().driver_pid == proc.pid)
        h = wheel.add(0.01, b"\x00hi")
        line = proc.stdout.readline()  # type: ignore[union-attr]
        fire = json.loads(line)
        assert set(fire) == {"handle", "deadline", "fired_at", "payload_hex", "owner_pid", "redelivered", "kept"}
        assert fire["handle"] == h and fire["payload_hex"] == "006869" and fire["redelivered"] is fire["kept"] is False
        assert fire["fired_at"] >= fire["deadline"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert wheel.stats().driver_pid is None


def test_jsonl_output_cut_short_delivers_only_the_lines_written_whole() -> None:
    """A write the reader's leaving cuts short counts the lines before the cut, not the one it cut."""
    r, w = os.pipe()
    size = fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)  # the write fills this much, then blocks
    fires = [shmwheel.Fire(h, 10**9, 2 * 10**9, b"payload", 1) for h in range(200)]
    ends = list(itertools.accumulate(len(_json_line(f)) for f in fires))
    assert ends[-1] > size
    driver = _JsonLinesDriver("unused", w)

    def leave_once_full() -> None:  # the reader goes away while the write waits for it
        give_up = time.monotonic() + 30
        while struct.unpack("i", fcntl.ioctl(r, termios.FIONREAD, b"\0" * 4))[0] < size:
            assert time.monotonic() < give_up
            time.sleep(0.01)
        os.close(r)

    leave = threading.Thread(target=leave_once_full)
    leave.start()
    try:
        with pytest.raises(OutputFailed) as failed:
            driver.handle_batch(fires)
    finally:
        leave.join()
        os.close(w)
    delivered = failed.value.delivered
    assert ends[delivered - 1] <= size < ends[delivered]
    assert isinstance(failed.value.error, BrokenPipeError)


def test_external_consumer_reads_a_fifo_and_acknowledges(make_wheel, tmp_path: Path) -> None:
    wheel = make_wheel(capacity=100)
    fifo = tmp_path / "fires.fifo"
    os.mkfifo(fifo)
    driver = shmwheel.Driver(wheel.name, fifo=fifo)
    thread = threading.Thread(target=driver.run)
    thread.start()
    try:
        handles = {wheel.add(0.01 * i, b"x") for i in range(20)}
        got = []
        with shmwheel.FireReader(wheel.name, fifo) as reader:
            for fire in reader:
                got.append(fire.handle)
                if len(got) == 20:
                    break
        assert set(got) == handles
        st = wheel.stats()
        assert (st.in_flight, st.acked) == (0, 20)
    finally:
        driver.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def _add_and_die(name: str, ready, cancel_on_exit: bool) -> None:
    w = shmwheel.attach(name)
    # The owned one far enough off that the driver's look (once a second)
    # cancels it first on a slow machine; the other due soon, to fire.
    w.add(30.0 if cancel_on_exit else 1.5, b"owned", cancel_on_exit=cancel_on_exit)
    ready.set()
    time.sleep(3600)  # SIGKILLed here


def test_cancel_on_exit_timers_of_a_dead_producer_are_cancelled(make_wheel, start, tmp_path: Path) -> None:
    import multiprocessing as mp

    wheel = make_wheel(capacity=10)
    out = tmp_path / "fires.jsonl"
    start(wheel.name, functools.partial(record, str(out)))
    ctx = mp.get_context("fork")
    procs = []
    for owned in (True, False):
        ready = ctx.Event()
        p = ctx.Process(target=_add_and_die, args=(wheel.name, ready, owned))
        p.start()
        assert ready.wait(10)
        procs.append(p)
    assert {pid for pid, _, alive in wheel.producers() if alive} >= {p.pid for p in procs}
    for p in procs:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    # The driver looks once a second.
    wait_for(lambda: wheel.stats().cancelled == 1, timeout=15)
    wait_for(lambda: len(read_records(out)) == 1, timeout=5)
    (fire,) = read_records(out)
    assert fire["owner_pid"] == procs[1].pid, "only the timer that did not ask to be cancelled fires"
    assert not {p.pid for p in procs} & {pid for pid, _, _ in wheel.producers()}, "dead producers stay listed"


def test_cancel_on_exit_after_fork_belongs_to_the_child(make_wheel) -> None:
    wheel = make_wheel(capacity=10)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            wheel.add(60, b"child", cancel_on_exit=True)
            code = 0
        finally:
            os._exit(code)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0
    assert wheel.reap_dead_producers() == 1, "the child's timer was filed under the parent"
    assert len(wheel) == 0


def test_stop_from_a_signal_handler_wakes_the_main_loop_at_once(make_wheel, monkeypatch) -> None:
    """stop() in the handler of a signal that lands while run() waits ends the wait."""
    monkeypatch.setattr("shmwheel._driver._REAP_INTERVAL", 60.0)  # what run() would otherwise wait
    wheel = make_wheel()
    driver = shmwheel.Driver(wheel.name, lambda fire: None)
    old = signal.signal(signal.SIGUSR1, lambda *_: driver.stop())
    main = threading.get_ident()
    stopped_at: list[float] = []

    def kick() -> None:
        time.sleep(0.3)  # well inside the main loop's first 1 s wait
        stopped_at.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGUSR1)

    try:
        threading.Thread(target=kick).start()
        driver.run()
    finally:
        signal.signal(signal.SIGUSR1, old)
    # Woken by the stop, not by the end of the 60 s wait it interrupted.
    assert time.monotonic() - stopped_at[0] < 30


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_a_producer_in_another_pid_namespace_is_never_judged_by_its_pid(make_wheel) -> None:
    """A container sharing /dev/shm but not the PID namespace: its producer is
    pid 1 in there, which names init out here.  It must not be taken for dead
    (its cancel_on_exit timers cancelled while it lives); the driver says
    once what it cannot do for it."""
    wheel = make_wheel(capacity=16)
    script = (
        "import sys, shmwheel\n"
        f"w = shmwheel.attach({wheel.name!r})\n"
        "w.add(3600, b'contained', cancel_on_exit=True)\n"
        "print('added', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    contained = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    driver = None
    try:
        assert contained.stdout is not None and contained.stdout.readline() == "added\n"
        (theirs,) = [p for p in wheel.producers() if p.pid != os.getpid()]
        assert theirs.pid == 1 and theirs.alive is None
        assert wheel.reap_dead_producers() == 0
        assert len(wheel) == 1, "the timer of a live process was cancelled"
        driver = subprocess.Popen(
            [sys.executable, "-m", "shmwheel", "driver", wheel.name], stderr=subprocess.PIPE, text=True
        )
        assert driver.stderr is not None
        lines = []
        while not any("another PID namespace" in line for line in lines):
            line = driver.stderr.readline()
            assert line, "the driver exited: " + "".join(lines)
            lines.append(line)
        time.sleep(2.5)  # two more rounds of the driver's once-a-second look
        assert len(wheel) == 1
    finally:
        if driver is not None:
            driver.terminate()
            rest = driver.communicate(timeout=30)[1]
            assert driver.returncode == 0
            assert sum("another PID namespace" in line for line in lines + rest.splitlines()) == 1, (
                "said more than once"
            )
        contained.communicate("\n", timeout=30)
    assert contained.returncode == 0


class _LooksAfter:
    """A handler with a periodic job of its own, whose second run fails."""

    def __init__(self) -> None:
        self.looks: list[float] = []

    def __call__(self, fire: shmwheel.Fire) -> None:
        pass

    def look_after(self) -> None:
        self.looks.append(time.monotonic())
        if len(self.looks) == 2:
            raise RuntimeError("a look that fails")


def test_a_handlers_look_after_is_called_at_start_and_once_a_second(make_wheel, caplog) -> None:
    """Once the driver has registered, before on_ready (so that what it keeps
    in the wheel is there from the start), then with the driver's own
    periodic jobs; one that raises is logged, and the next comes all the same."""
    wheel = make_wheel(capacity=100)
    handler = _LooksAfter()
    ready: list[int] = []
    driver = shmwheel.Driver(wheel.name, handler)
    thread = threading.Thread(target=driver.run, kwargs={"on_ready": lambda: ready.append(len(handler.looks))})
    with caplog.at_level(logging.ERROR):
        thread.start()
        try:
            wait_for(lambda: len(handler.looks) >= 3)
        finally:
            driver.stop()
            thread.join(timeout=30)
    assert not thread.is_alive()
    assert ready == [1]
    assert "the handler's look_after() failed" in caplog.text
