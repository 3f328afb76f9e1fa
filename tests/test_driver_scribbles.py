"""A driver against a segment that a writer scribbles on: it repairs and goes
on, and hands every healthy fire out, at once and exactly once.

Each test is a case a review found the driver getting wrong: a healthy fire
kept from the dispatcher by a damaged one behind it in the same batch, left
in flight with nobody woken, slept on past the clock's 100 ms cap; a
scribble that kept every new driver from starting; a jammed lock word that
stopped the driver and every one after it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import entry, header, layout, mutex_span, put_in_flight, wait_for

import shmwheel
from shmwheel._binding import ffi, lib


class Running:
    """A Driver in a thread of this process, collecting the payloads it hands out."""

    def __init__(self, name: str, wait_ready: bool = True, **options: object) -> None:
        self.payloads: list[bytes] = []
        self.driver = shmwheel.Driver(name, lambda f: self.payloads.append(f.payload), **options)  # type: ignore[arg-type]
        self.error: BaseException | None = None
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,))
        self.thread.start()
        if wait_ready:
            ready.wait(30)

    def _run(self, ready: threading.Event) -> None:
        try:
            self.driver.run(on_ready=ready.set)
        except BaseException as exc:  # the test reads it
            self.error = exc
            ready.set()

    def stop(self) -> None:
        self.driver.stop()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture
def drive() -> Iterator[Callable[..., Running]]:
    started: list[Running] = []

    def start(name: str, wait_ready: bool = True, **options: object) -> Running:
        r = Running(name, wait_ready, **options)
        started.append(r)
        return r

    yield start
    for r in started:
        if r.thread.is_alive():
            r.stop()


def slot(w: shmwheel.Wheel, handle: int) -> int:
    return handle & ((1 << (w.capacity - 1).bit_length()) - 1)


def test_a_damaged_fire_does_not_hold_back_the_healthy_ones_taken_with_it(make_wheel, drive) -> None:
    """A dispatcher's batch: the fires ahead of a damaged one are handed out."""
    w = make_wheel(capacity=64, payload_size=8)
    for k in range(5):
        w.add(0, bytes([k]))
    put_in_flight(w, 5)  # a driver died with them in flight
    entry(w, header(w).inflight_tail).payload_len = 999
    r = drive(w.name)
    wait_for(lambda: len(r.payloads) == 4, timeout=10)
    r.stop()
    assert sorted(r.payloads) == [bytes([k]) for k in range(4)]
    assert (w.stats().in_flight, w.stats().quarantined) == (0, 1)


def test_poll_returns_the_timers_it_fired_before_a_damaged_one(make_wheel) -> None:
    w = make_wheel(capacity=64, payload_size=8)
    now = w.stats().clock
    handles = [w.add_at(now, bytes([k])) for k in range(4)]
    entry(w, slot(w, handles[3])).payload_len = 999
    fired = w.poll(now + 0.01)
    assert [f.payload for f in fired] == [bytes([k]) for k in range(3)]
    with pytest.raises(shmwheel.CorruptSegmentError):
        w.poll(now + 0.01)  # the damaged one, next time
    assert w.repair() is not None
    assert w.poll(now + 0.01) == [] and w.stats().quarantined == 1


def test_the_clock_wakes_the_dispatcher_for_what_it_fired_before_a_damaged_timer(make_wheel, drive) -> None:
    w = make_wheel(capacity=64, payload_size=8)
    r = drive(w.name)
    at = time.monotonic() + 0.1
    w.add_at(at, b"A")
    entry(w, slot(w, w.add_at(at, b"B"))).payload_len = 999
    wait_for(lambda: r.payloads == [b"A"], timeout=2)  # not whenever something else fires next
    r.stop()


def test_a_scribbled_bucket_expiry_does_not_put_the_clock_to_sleep_for_ever(make_wheel, drive) -> None:
    """expiry * tick wrapped negative read as "no deadline" to the futex wait."""
    w = make_wheel(capacity=64, payload_size=8)
    r = drive(w.name, audit_interval=0.3)
    w.add(0.5, b"healthy")
    buckets = ffi.cast("struct shmw_bucket *", w._buf + layout(w).buckets)
    heap = ffi.cast("uint32_t *", w._buf + layout(w).heap)
    buckets[heap[0]].expires = (1 << 63) // 1_000_000 + 1
    wait_for(lambda: r.payloads == [b"healthy"], timeout=3)
    r.stop()
    assert w.stats().repairs >= 1


@pytest.mark.parametrize("scribble", ["damaged flag", "in-flight count"])
def test_a_scribble_does_not_keep_a_driver_from_starting(make_wheel, drive, scribble: str) -> None:
    """It used to raise at attach or registration, and so at every restart."""
    w = make_wheel(capacity=64, payload_size=8)
    w.add(0.2, b"healthy")
    hd = header(w)
    if scribble == "damaged flag":
        hd.flags |= lib.SHMW_F_DAMAGED
    else:
        hd.inflight = 1  # and the list is empty
    r = drive(w.name)
    assert r.error is None, r.error
    wait_for(lambda: r.payloads == [b"healthy"], timeout=5)
    r.stop()
    assert w.stats().repairs >= 1


def test_an_audit_of_a_sound_busy_wheel_repairs_nothing(make_wheel) -> None:
    """The clock moving past the auditor's reading of the time is no fault."""
    w = make_wheel(capacity=64)
    w.add(60)
    assert lib.shmw_repair(w.core, 0, ffi.NULL, 0) == 0  # "now" long past: read again under the lock


def test_a_jammed_lock_word_is_waited_out_and_said_not_fatal(make_wheel, drive, caplog) -> None:
    w = make_wheel(capacity=16, payload_size=8)
    w.add(0.3, b"late")
    word = ffi.cast("int32_t *", w._buf + mutex_span()[0])
    word[0] = 0x3FFFFFF0  # a thread that never existed holds it
    try:
        with caplog.at_level(logging.ERROR, "shmwheel.driver"):
            r = drive(w.name, wait_ready=False, lock_timeout=0.2)
            wait_for(lambda: "waiting for it" in caplog.text, timeout=10)
        assert r.thread.is_alive() and r.error is None
    finally:
        word[0] = 0
    wait_for(lambda: r.payloads == [b"late"], timeout=10)
    r.stop()
    assert caplog.text.count("waiting for it") == 1  # once a minute, not once a try
