"""kill -9 torture: real producers and a real driver, SIGKILLed over and over.

Three producer processes (forked, so that a restart is fast) add timers due
in 0-200 ms, cancel some of their own and reset others, while the test
SIGKILLs a random producer at short random intervals and starts a fresh one
at once, and now and then SIGKILLs the driver and starts another, which
takes over the dead one's registration.  A producer can die anywhere: in
Python, between an add and its log line, or holding the segment's lock,
and then the next locker repairs (``stats().recoveries``).  The driver can
die with fires in flight, which its successor hands out again, marked
redelivered; half of its kills wait for a moment with fires in flight.

A producer spends almost all of an add or a cancel outside the lock (in
Python), so a kill seldom lands inside one.  To make that common, each
producer also runs "ballast": batches of 1,000 timers due in 1 s, added and
at once cancelled with one C call each (``shmw_add_many``,
``shmw_cancel_many``, on arrays made once), which spend tens of
microseconds under the lock doing real work.  A batch cut short by a kill
may leave some of its timers pending; they fire a second later.

Every producer incarnation keeps a log of its own, one ``os.write`` of
whole lines on an O_APPEND fd each:

* ``a HANDLE SEQ`` once ``add`` (or ``add_many``) has returned HANDLE; the
  timer's payload is ``INCARNATION:SEQ``;
* ``x HANDLE`` just before it calls ``cancel``, then ``c HANDLE`` if the
  cancel returned True or ``n HANDLE`` if it returned False.  An ``x`` with
  neither after it is a cancel the kill interrupted: it may or may not have
  happened, so that timer may or may not fire;
* ``A K`` once ballast batch K (payload ``bINCARNATION:K``, fixed-width,
  on each of its timers) is added, ``C K COUNT`` once ``cancel_many`` has
  returned COUNT.

The driver's handler (one file per driver incarnation) writes a line per
fire.  Only complete lines are read back: a kill can cut a write short (the
kernel writes a line that crosses a page boundary of the file a page at a
time).

At the end the killing stops, the last producers finish normally, the wheel
drains, the driver stops gracefully, and then:

* every timer whose add returned and that was never cancelled (or whose
  cancel returned False) fired at least once;
* no timer whose cancel returned True ever fired, and a ballast batch whose
  cancel_many returned COUNT fired exactly its 1,000 - COUNT others;
* a live driver delivers a fire once; across drivers a fire may come again,
  but every copy after the first is marked redelivered;
* every fire carries the payload, owner and deadline its add gave it, and
  none fires early; fires of adds that never returned are allowed, but they
  too are whole timers of ours;
* nothing is left pending or in flight, no slot leaked, check() passes.

``pytest --long`` runs 10,000 producer kills instead of 200 (and 1,000
driver kills instead of 20).  SHMWHEEL_TORTURE_SEED replays a seed (the
kill schedule and the producers' choices; the timing is the machine's).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import random
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

import shmwheel
from shmwheel._binding import ffi, lib

PRODUCERS = 3
PRODUCER_KILLS, DRIVER_KILLS = 200, 20  # the CI run
LONG_PRODUCER_KILLS = 10_000
LONG_DRIVER_KILLS = LONG_PRODUCER_KILLS * DRIVER_KILLS // PRODUCER_KILLS
KILL_INTERVAL = 0.1  # the killer sleeps uniform(0, KILL_INTERVAL) s between producer kills
MAX_DELAY = 0.2
BALLAST = 1000  # timers a ballast batch
BALLAST_DELAY = 1.0
SLOW_HANDLER = 0.005  # the share of fires whose handler takes 10 ms
CAPACITY = 200_000
PAYLOAD_SIZE = 32
WAIT = 30.0  # the bound on every wait: nothing in the test can hang longer


# -- the driver's handler (runs in the driver process) ----------------------------------

_fire_fds: dict[str, int] = {}


def record_fire(path: str, fire: shmwheel.Fire) -> None:
    """One whole line a fire: handle, redelivered, owner, deadline, fired_at, payload.

    Now and then it takes 10 ms, as a real handler does, so that the driver
    often holds fires that it has sent and not yet acknowledged.
    """
    fd = _fire_fds.get(path)
    if fd is None:
        fd = _fire_fds[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(
        fd,
        b"%d %d %d %d %d %s\n"
        % (fire.handle, fire.redelivered, fire.owner_pid, fire.deadline_ns, fire.fired_at_ns, fire.payload),
    )
    if random.random() < SLOW_HANDLER:
        time.sleep(0.01)


# -- a producer (a forked child; it runs until told to stop, or is killed) --------------


def producer(wheel: shmwheel.Wheel, incarnation: int, log_path: str, stop: object, seed: int) -> None:
    rng = random.Random(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    live: list[int] = []  # recent handles of ours, not yet cancelled: candidates to cancel or reset
    seq = 0
    # Ballast: the C arrays are made once, so nearly all of a batch's time is under the lock.
    delays = ffi.new("double[]", [BALLAST_DELAY + k * 1e-4 for k in range(BALLAST)])
    handles = ffi.new("int64_t[]", BALLAST)
    lens = ffi.new("uint32_t[]", [len(b"b%06d:%06d" % (incarnation, 0))] * BALLAST)
    batch = 0
    while not stop.value:  # type: ignore[attr-defined]
        for _ in range(rng.randint(1, 8)):
            r = rng.random()
            if r < 0.55:
                h = wheel.add(rng.uniform(0, MAX_DELAY), b"%d:%d" % (incarnation, seq))
                os.write(fd, b"a %d %d\n" % (h, seq))
                live.append(h)
                seq += 1
            elif r < 0.555:
                n = rng.randint(10, 100)
                hs = wheel.add_many(
                    [rng.uniform(0, MAX_DELAY) for _ in range(n)],
                    [b"%d:%d" % (incarnation, seq + k) for k in range(n)],
                )
                os.write(fd, b"".join(b"a %d %d\n" % (h, seq + k) for k, h in enumerate(hs)))
                live += hs
                seq += n
            elif r < 0.85:
                if live:
                    h = live.pop(rng.randrange(len(live)))
                    os.write(fd, b"x %d\n" % h)
                    ok = wheel.cancel(h)
                    os.write(fd, b"%s %d\n" % (b"c" if ok else b"n", h))
            elif live:
                wheel.reset(live[rng.randrange(len(live))], rng.uniform(0, MAX_DELAY))
        if rng.random() < 0.5:
            # Fixed width: every batch's payloads have the length `lens` says.
            rc = lib.shmw_add_many(
                wheel.core, delays, BALLAST, b"b%06d:%06d" % (incarnation, batch) * BALLAST, lens, handles
            )
            assert rc == 0, f"ballast add_many failed with code {rc}"
            os.write(fd, b"A %d\n" % batch)
            count = lib.shmw_cancel_many(wheel.core, handles, BALLAST)
            os.write(fd, b"C %d %d\n" % (batch, count))
            batch += 1
        del live[:-100]
        time.sleep(0.001)
    os.close(fd)
    wheel.close()


# -- helpers ------------------------------------------------------------------------------


def complete_lines(path: Path) -> list[bytes]:
    """The whole lines of a log; a kill may have cut the last one short."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return data[: data.rfind(b"\n") + 1].splitlines()


def wait_for(predicate: Callable[[], bool], what: str | Callable[[], str], timeout: float = WAIT) -> None:
    """Wait until predicate() holds; after `timeout` s fail, saying `what` (or what it returns then)."""
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"hang: {what() if callable(what) else what}, after {timeout} s")
        time.sleep(0.005)


@dataclass
class Producer:
    process: mp.process.BaseProcess
    pid: int
    log: Path
    exitcode: int | None = None  # once reaped

    def reap(self, timeout: float = WAIT) -> int | None:
        """Wait for the process to end; then release its fds (10,000 of them would run out)."""
        if self.exitcode is None:
            self.process.join(timeout)
            self.exitcode = self.process.exitcode
            if self.exitcode is not None:
                self.process.close()
        return self.exitcode


# -- the test -------------------------------------------------------------------------------


@pytest.mark.parametrize("shards", [1, PRODUCERS], ids=["one shard", "a shard each"])
def test_kill_9_producers_and_driver(make_wheel, long_run: bool, tmp_path: Path, shards: int) -> None:
    producer_kills = LONG_PRODUCER_KILLS if long_run else PRODUCER_KILLS
    driver_kills = LONG_DRIVER_KILLS if long_run else DRIVER_KILLS
    seed = int(os.environ.get("SHMWHEEL_TORTURE_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"\ntorture: seed {seed} (SHMWHEEL_TORTURE_SEED={seed} replays the schedule)")
    rng = random.Random(seed)
    wheel = make_wheel(capacity=CAPACITY, payload_size=PAYLOAD_SIZE, shards=shards)
    ctx = mp.get_context("fork")
    # A raw shared int, read without a lock: a producer killed while reading
    # it leaves nothing held (an mp.Event would leave its lock taken).
    stop = ctx.RawValue("i", 0)
    producers: list[Producer] = []  # by incarnation; all but the last three reaped
    slots: list[Producer] = []  # the running three
    driver_logs: list[Path] = []  # by driver incarnation
    driver: shmwheel.DriverProcess | None = None  # the running one; the dead ones are dropped (and their fds)
    aimed = 0

    def start_producer() -> Producer:
        k = len(producers)
        log = tmp_path / f"producer-{k}.log"
        proc = ctx.Process(target=producer, args=(wheel, k, str(log), stop, rng.randrange(1 << 32)), daemon=True)
        proc.start()
        p = Producer(proc, proc.pid, log)
        producers.append(p)
        return p

    def start_new_driver() -> shmwheel.DriverProcess:
        log = tmp_path / f"driver-{len(driver_logs)}.log"
        driver_logs.append(log)
        return shmwheel.start_driver(wheel.name, functools.partial(record_fire, str(log)), timeout=WAIT)

    def sigkill_producer(p: Producer) -> None:
        if not p.process.is_alive():
            raise AssertionError(f"producer pid {p.pid} died on its own (exit code {p.reap()})")
        p.process.kill()
        if p.reap() is None:
            raise AssertionError(f"hang: producer pid {p.pid} still alive {WAIT} s after SIGKILL")
        # It may have died between the check above and the kill: anything but -9 is its own death.
        assert p.exitcode == -signal.SIGKILL, f"producer pid {p.pid} exited with {p.exitcode}"

    def sigkill_driver(d: shmwheel.DriverProcess) -> bool:
        """Kill the driver, half the time once it has fires in flight; say whether it had."""
        if not d.is_alive():
            raise AssertionError(f"driver pid {d.pid} died on its own (exit code {d.stop()})")
        in_flight = False
        if rng.random() < 0.5:
            give_up = time.monotonic() + 0.5
            while not (in_flight := wheel.stats().in_flight > 0) and time.monotonic() < give_up:
                pass
        os.kill(d.pid, signal.SIGKILL)
        wait_for(lambda: not d.is_alive(), f"driver pid {d.pid} still alive after SIGKILL")
        return in_flight

    started = time.monotonic()
    driver_at = set(rng.sample(range(producer_kills), driver_kills))
    try:
        driver = start_new_driver()
        slots = [start_producer() for _ in range(PRODUCERS)]
        for i in range(producer_kills):
            time.sleep(rng.uniform(0, KILL_INTERVAL))
            slot = rng.randrange(PRODUCERS)
            sigkill_producer(slots[slot])
            slots[slot] = start_producer()
            if i in driver_at:
                aimed += sigkill_driver(driver)
                driver = start_new_driver()
        killing = time.monotonic() - started

        # The end: the last producers finish normally, the wheel drains, the driver stops.
        stop.value = 1
        for p in slots:
            assert p.reap() is not None, f"hang: producer pid {p.pid} did not stop in {WAIT} s"
            assert p.exitcode == 0, f"a last producer (pid {p.pid}) exited with {p.exitcode}"

        def drained() -> bool:
            assert driver.is_alive(), f"driver pid {driver.pid} died while draining (exit code {driver.stop()})"
            st = wheel.stats()
            return st.pending == 0 and st.in_flight == 0

        wait_for(drained, lambda: f"the wheel did not drain: {wheel.stats()}")
        code = driver.stop(timeout=WAIT)
        assert code == 0, f"the last driver's graceful stop exited with {code}"
    finally:
        # Whatever went wrong, nothing is left running: a live driver would
        # also keep pytest from exiting (multiprocessing joins it at exit).
        stop.value = 1
        try:
            for p in slots:
                if p.exitcode is None:
                    p.process.kill()
                    p.reap()
        finally:
            if driver is not None and driver.is_alive():
                driver.stop(timeout=5)  # SIGTERM; SIGKILL after 5 s
    elapsed = time.monotonic() - started

    # -- read the logs back -----------------------------------------------------------------

    # Compact, for --long's millions of timers: a timer's payload I:S is kept as the int I << 32 | S.
    added: dict[int, int] = {}  # handle -> its payload, for every add that returned
    cancelled: set[int] = set()  # cancel returned True
    refused: set[int] = set()  # cancel returned False
    in_doubt: set[int] = set()  # a cancel the kill interrupted
    ballast_left: dict[int, int] = {}  # batch I << 32 | K -> how many must fire: cancel_many returned
    ballast_batches = 0
    for k, p in enumerate(producers):
        intents: set[int] = set()
        for line in complete_lines(p.log):
            kind, *rest = line.split()
            h = int(rest[0])  # a handle, or for A and C a ballast batch
            if kind == b"a":
                assert h not in added, f"add returned handle {h} twice (incarnations {added[h] >> 32} and {k})"
                added[h] = k << 32 | int(rest[1])
            elif kind == b"x":
                assert added.get(h, -1) >> 32 == k, f"producer {k} cancelled a handle it never added: {h}"
                intents.add(h)
            elif kind in (b"c", b"n"):
                assert h in intents, f"bad log line in {p.log.name}: {line!r}"
                intents.discard(h)
                (cancelled if kind == b"c" else refused).add(h)
            elif kind == b"A":
                ballast_batches += 1
            else:
                assert kind == b"C", f"bad log line in {p.log.name}: {line!r}"
                ballast_left[k << 32 | h] = BALLAST - int(rest[1])
        assert len(intents) <= 1, f"producer {k}: {len(intents)} cancels without an outcome"
        in_doubt |= intents
    pids = [p.pid for p in producers]
    recorded_payloads = set(added.values())

    first: dict[int, tuple[int, bool]] = {}  # handle -> (driver, redelivered) of its first fire
    again: dict[int, list[tuple[int, bool]]] = defaultdict(list)  # handle -> its later fires
    unrecorded_payloads: dict[int, int] = {}  # payload -> handle, for adds that never returned
    ballast_fired: dict[int, int] = defaultdict(int)  # batch I << 32 | K -> timers of it fired
    problems: dict[str, list[str]] = defaultdict(list)  # kind -> examples
    fires = redelivered_copies = 0
    worst_lateness = 0
    for d, log in enumerate(driver_logs):
        for line in complete_lines(log):
            h_, re_, owner_, deadline_, fired_at_, payload = line.split(b" ")
            h, redelivered, owner = int(h_), re_ == b"1", int(owner_)
            deadline_ns, fired_at_ns = int(deadline_), int(fired_at_)
            fires += 1
            redelivered_copies += redelivered
            if h in first:
                earlier = [first[h], *again[h]]
                if not redelivered:
                    problems["fired again, not marked redelivered"].append(
                        f"{h}: (driver, redelivered) {earlier}, then {d}"
                    )
                if any(e == d for e, _ in earlier):
                    problems["delivered twice by one live driver"].append(f"{h} by driver {d}")
                again[h].append((d, redelivered))
                continue  # the first copy's payload, owner and deadline were checked
            first[h] = (d, redelivered)
            if fired_at_ns < deadline_ns:
                problems["fired early"].append(f"{h}: {deadline_ns - fired_at_ns} ns")
            worst_lateness = max(worst_lateness, fired_at_ns - deadline_ns)
            try:
                inc_, seq_ = payload.removeprefix(b"b").split(b":")
                inc, seq = int(inc_), int(seq_)
                pid = pids[inc]
            except (ValueError, IndexError):
                problems["a payload no producer gave"].append(f"{h}: {payload!r}")
                continue
            if owner != pid:
                problems["wrong owner"].append(f"{h} ({payload!r}): owner {owner}, added by pid {pid}")
            key = inc << 32 | seq
            if payload.startswith(b"b"):
                ballast_fired[key] += 1
            elif h in added:
                if added[h] != key:
                    problems["another timer's payload"].append(
                        f"{h}: {payload!r}, added as {added[h] >> 32}:{added[h] & 0xFFFFFFFF}"
                    )
            elif key in recorded_payloads:
                problems["another timer's payload"].append(f"{h} (add never returned): {payload!r}")
            elif unrecorded_payloads.setdefault(key, h) != h:
                problems["one payload, two timers"].append(f"{payload!r}: {unrecorded_payloads[key]} and {h}")

    # A batch whose cancel_many returned fires exactly what it did not cancel; one cut short, at most all.
    for key in ballast_left.keys() | ballast_fired.keys():
        n, left = ballast_fired.get(key, 0), ballast_left.get(key)
        if n != left and not (left is None and n <= BALLAST):
            expected = f"{left}" if left is not None else f"at most {BALLAST}"
            problems["a ballast batch fired wrong"].append(f"{key >> 32}:{key & 0xFFFFFFFF}: {n} fired, not {expected}")
    must_fire = set(added) - cancelled - in_doubt
    missing = sorted(must_fire - first.keys())
    wrongly = sorted(cancelled & first.keys())
    st = wheel.stats()

    print(
        f"torture: {producer_kills} producer kills ({len(producers)} producer processes), "
        f"{driver_kills} driver kills ({aimed} with fires in flight; {len(driver_logs)} drivers); "
        f"killing {killing:.1f} s, in all {elapsed:.1f} s\n"
        f"torture: adds returned {len(added)}, cancels True {len(cancelled)}, False {len(refused)}, "
        f"in doubt {len(in_doubt)}; resets {st.resets}; ballast batches {ballast_batches}\n"
        f"torture: fires {fires} ({len(first)} timers), redelivered copies {redelivered_copies}, "
        f"timers fired more than once {len(again)}, timers of adds that never returned {len(unrecorded_payloads)}, "
        f"ballast fired {sum(ballast_fired.values())}, worst lateness {worst_lateness / 1e6:.1f} ms\n"
        f"torture: stats: recoveries {st.recoveries}, redelivered {st.redelivered}, added {st.added}, "
        f"cancelled {st.cancelled}, fired {st.fired}, acked {st.acked}, handler errors {st.handler_errors}"
    )

    assert not missing, (
        f"{len(missing)} timers whose add returned and that were not cancelled never fired, e.g. "
        + ", ".join(
            f"{h} (incarnation {added[h] >> 32}, {'cancel refused' if h in refused else 'never cancelled'})"
            for h in missing[:10]
        )
    )
    assert not wrongly, f"{len(wrongly)} timers fired after cancel returned True, e.g. {wrongly[:10]}"
    assert not problems, "fires that break the promises:\n" + "\n".join(
        f"  {kind}: {len(examples)}, e.g. {'; '.join(examples[:3])}" for kind, examples in problems.items()
    )
    assert (st.pending, st.in_flight, st.driver_pid) == (0, 0, None), st
    assert st.free + st.retired == st.capacity, f"slots leaked: {st}"
    assert st.handler_errors == 0, st
    wheel.check()
