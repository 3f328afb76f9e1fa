#!/usr/bin/env python3
"""Load test of the shmwheel driver, measured on this machine.

The driver runs as it is deployed: one process started with
:func:`shmwheel.start_driver`, its clock thread in C, and a handler
called by its Python dispatcher thread.

1. Steady load.  A wheel with a 1 ms tick and 2 producer processes, each
   paced at 50,000 operations a second (an operation is an add or a cancel)
   against the monotonic clock, in 1 ms batches.  The traffic is request
   timeouts: each request adds a timer; most requests complete and cancel
   theirs (timeout 1-10 s, completed 1-50 ms later), the others hang and
   their timers fire (timeout 5-100 ms, so that they fire within the run).
   The share that hangs follows from the rates: 50,000 ops/s a producer and
   20,000 fires/s in all make 30,000 adds and 20,000 cancels a producer a
   second, one timer in three left to fire.  Reported: the operations per
   second each producer achieved, fires per second, fire lateness
   (fired_at - deadline, as the driver's clock thread stamps it) at p50 /
   p99 / p99.9 / max against the targets, the part of it that is the
   driver's own delay past the tick the timer was due at, the delay until
   the handler had the fire, and CPU time: the driver's, the producers', and
   what the rest of the machine used meanwhile (it is shared).
   Also the CPU time stolen by the hypervisor: on a VM, a descheduled vCPU
   stalls whatever thread was on it, which is where most of the tail came
   from on the machine this was written on.
2. Burst.  ``--burst`` timers (1,000,000) added with add_many in chunks, all
   due in one tick about 0.5 s ahead, and a handler that records the handle
   only.  Reported, from the deadline: when the clock had fired the last of
   them, and when the last had reached the handler (target 2 s), both seen by
   polling the wheel's stats every millisecond from here.

Both check exactly-once delivery: every timer that was not successfully
cancelled fires exactly once and no other timer fires.  The producers (the
burst: this process) report every handle they added and the result of every
cancel; the driver's handler reports every fire it saw.  The steady run also
checks that no timer fired before its deadline and that each fire carries its
own timer's payload.

Repetitions.  The steady load runs once: its figures are distributions over
the whole run, and the best of several runs would hide exactly the stalls
that the tail percentiles are there to show.  The burst is one figure, so it
is repeated (``--repeat``) and the best is reported, all samples alongside.

The targets are printed next to the figures, not asserted.  The exit status
is 1 if any fire was lost, duplicated, unexpected, early or carried another
timer's payload: with ``--quick`` this is a smoke test for CI.

Every segment the script creates is closed and unlinked, also on error,
Ctrl-C or SIGTERM; the names are ``shmwheel-bench-driver-<pid>-<n>``.  Each
segment is unlinked as soon as every process that uses it has it mapped, so
not even a SIGKILL of this script leaves it behind.

Usage::

    python bench/driver.py [--quick] [--duration S] [--burst N] [--repeat N]
                           [--json FILE] [--seed N]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
from _common import (
    CLOCK_TICKS,
    READY_TIMEOUT,
    CpuMeter,
    CpuUse,
    Delivery,
    FireLog,
    Segments,
    ceil_div,
    check_handles,
    collect,
    distribution_ms,
    progress,
    read_fire_log,
    scratch,
    start_producers,
    stop_driver,
    strict_json,
    terminate,
)
from _machine import machine_info

import shmwheel

TICK = 0.001  # s: the wheel's resolution
PAYLOAD_SIZE = 8  # bytes: a producer index and a sequence number (see added_by)

# Steady load.
PRODUCERS = 2
OPS_PER_SECOND = 50_000  # each producer: adds and cancels
FIRES_PER_SECOND = 20_000  # all producers together
BATCH = 0.001  # s between a producer's batches: 50 operations each
REQUEST_TIMEOUT = (1.0, 10.0)  # s: timers of requests that complete, and are cancelled
SERVICE_TIME = (0.001, 0.050)  # s: how long such a request runs before it cancels its timer
HANG_TIMEOUT = (0.005, 0.100)  # s: timers of requests that hang, and fire
STEADY_CAPACITY = 1 << 16  # about 2,000 timers are pending at a time
DURATION = 10.0  # s
QUICK_DURATION = 3.0

# Burst.
BURST = 1_000_000
BURST_CHUNK = 1_000  # timers per add_many call
BURST_LEAD = 0.5  # s from the start of the adds to the deadline
# The deadline is put this far into a tick: the C side reads the clock a
# little after we compute each chunk's delay, so every deadline comes out a
# little later than aimed (by at most the length of the add_many call), and
# this keeps them all in one tick unless a call is preempted.
BURST_OFFSET = 0.05 * TICK
REPEAT = 3
QUICK_REPEAT = 1
BURST_POLL = 0.001  # s between two looks at the wheel's stats during a burst
SLACK = 1_024  # spare slab slots

# How long to wait for things that take well under a second when all is well.
DRAIN_TIMEOUT = 60.0  # s: every timer fired and acknowledged after the load stops

# Targets: printed next to the figures, not asserted.
TARGET_P50_MS = 1.0  # one tick
TARGET_P99_MS = 2.0
TARGET_P999_MS = 10.0
TARGET_BURST_S = 2.0

# A payload is the 8-byte little-endian key: producer index << KEY_BITS | sequence number.
KEY_BITS = 40


# -- the report's rows ------------------------------------------------------------


@dataclass
class Row:
    """One row of the report."""

    key: str  # stable identifier, for the JSON output
    label: str
    value: float | dict[str, float]  # a dict for a distribution: p50, p99, p99.9, max
    unit: str  # "ops/s", "fires/s", "ms", "s", "cpu_s", "ns", "pct" or "count"
    target: float | None = None  # the upper bound we hope for, if any
    note: str = ""
    samples: list[float] = field(default_factory=list)

    @property
    def meets(self) -> bool | None:
        if self.target is None or isinstance(self.value, dict):
            return None
        return self.value <= self.target


@dataclass
class Milestones:
    """When polling stats() saw a wheel reach each stage (CLOCK_MONOTONIC ns; None: not seen)."""

    clock_done_ns: int | None = None  # nothing pending: the clock has fired everything
    drained_ns: int | None = None  # nothing pending or in flight: every handler has run and been acknowledged
    redelivered: int = 0  # the wheel's count of fires sent again after a driver died
    handler_errors: int = 0


def watch_until_drained(wheel: shmwheel.Wheel, driver: shmwheel.DriverProcess, interval: float) -> Milestones:
    """Poll stats() (one short lock hold) every ``interval`` s until the wheel is drained.

    Gives up after DRAIN_TIMEOUT, leaving ``drained_ns`` None.
    """
    seen = Milestones()
    give_up = time.monotonic_ns() + round(DRAIN_TIMEOUT * 1e9)
    while True:
        st = wheel.stats()
        now = time.monotonic_ns()
        if seen.clock_done_ns is None and st.pending == 0:
            seen.clock_done_ns = now
        if st.pending == 0 and st.in_flight == 0:
            seen.drained_ns = now
        if seen.drained_ns is not None or now > give_up:
            seen.redelivered, seen.handler_errors = st.redelivered, st.handler_errors
            return seen
        if not driver.is_alive():
            raise RuntimeError("the driver died")
        time.sleep(interval)


def delivery_rows(prefix: str, d: Delivery, *, detailed: bool) -> list[Row]:
    rows = [
        Row(f"{prefix}_lost", "lost fires (not cancelled, never fired)", d.lost, "count", 0),
        Row(f"{prefix}_duplicated", "duplicated fires", d.duplicated, "count", 0),
        Row(f"{prefix}_unexpected", "fires of cancelled or unknown timers", d.unexpected, "count", 0),
    ]
    if detailed:
        rows.append(Row(f"{prefix}_early", "fires before their deadline", d.early, "count", 0))
        rows.append(Row(f"{prefix}_wrong_payload", "fires with another timer's payload", d.wrong_payload, "count", 0))
    if d.redelivered:
        rows.append(Row(f"{prefix}_redelivered", "fires sent again (a driver died)", d.redelivered, "count"))
    return rows


def machine_rows(prefix: str, cpu: CpuUse) -> list[Row]:
    """How busy the machine was: a tail latency is often somebody else's doing."""
    pct = 100 / cpu.capacity if cpu.capacity else math.nan
    return [
        Row(
            f"{prefix}_machine_busy_pct",
            f"machine CPU busy, all {os.cpu_count()} CPUs",
            cpu.busy * pct,
            "pct",
            note=f"of which outside this benchmark: {cpu.outside * pct:.0f} % (the machine is shared)",
        ),
        Row(
            f"{prefix}_steal_ms",
            "CPU time stolen by the hypervisor, all CPUs",
            round(cpu.steal * 1e3),  # whole clock ticks
            "ms",
            note=f"{cpu.steal * pct:.1f} % of the CPUs' time, counted in steps of {1e3 / CLOCK_TICKS:g} ms; "
            "a descheduled vCPU stalls whatever thread was on it",
        ),
    ]


# -- 1. steady load ---------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What each producer does in the steady run."""

    duration: float  # s
    ops_per_second: float = OPS_PER_SECOND
    fires_per_second: float = FIRES_PER_SECOND / PRODUCERS

    @property
    def cancel_share(self) -> float:
        """Of the timers added, the share that is cancelled.

        Every timer is cancelled or fires: adds = cancels + fires, and
        adds + cancels = ops, so adds = (ops + fires) / 2.
        """
        adds = (self.ops_per_second + self.fires_per_second) / 2
        return 1 - self.fires_per_second / adds


def produce(name: str, index: int, load: Load, seed: int, channel: Any, go: Any, start_at: Any) -> None:
    """A producer process: request timeouts at the paced rate, then a report.

    Each batch does the operations the clock says are owed since the start:
    first the cancels of the requests that have completed by now, then adds
    for the rest.  Once the time is up no more requests start; those still
    running complete on schedule, so their timers are cancelled too.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    wheel = shmwheel.attach(name)
    rng = random.Random(seed)
    rand, uniform = rng.random, rng.uniform
    add, cancel, monotonic = wheel.add, wheel.cancel, time.monotonic
    cancel_share = load.cancel_share
    rate = load.ops_per_second
    batch_ops = rate * BATCH
    key = index << KEY_BITS
    added = array("q")  # every handle, in the order added: the sequence number is the index
    cancelled = array("q")  # cancel returned True: must never fire
    too_late = array("q")  # cancel returned False: fired already, so must fire once
    completions: list[tuple[float, int]] = []  # heap of (when the request completes, its timer)
    adds = cancels = backlog = 0

    channel.put(("ready", index, None))
    if not go.wait(READY_TIMEOUT):
        return  # the parent is gone
    start = start_at.value
    end = start + load.duration
    pause = start - monotonic()
    if pause > 0:
        time.sleep(pause)
    now = monotonic()
    while now < end:
        owed = int((now - start) * rate) - adds - cancels
        backlog = max(backlog, owed)
        while owed > 0 and completions and completions[0][0] <= now:
            handle = heapq.heappop(completions)[1]
            (cancelled if cancel(handle) else too_late).append(handle)
            owed -= 1
            cancels += 1
        for _ in range(owed):
            payload = (key | len(added)).to_bytes(8, "little")
            if rand() < cancel_share:
                handle = add(uniform(*REQUEST_TIMEOUT), payload)
                heapq.heappush(completions, (now + uniform(*SERVICE_TIME), handle))
            else:
                handle = add(uniform(*HANG_TIMEOUT), payload)
            added.append(handle)
            adds += 1
        pause = start + (adds + cancels + batch_ops) / rate - monotonic()
        if pause > 0:
            time.sleep(pause)
        now = monotonic()
    window = {"adds": adds, "cancels": cancels, "backlog": backlog}

    for when, handle in sorted(completions):
        pause = when - monotonic()
        if pause > 0:
            time.sleep(pause)
        (cancelled if cancel(handle) else too_late).append(handle)
    wheel.close()
    channel.put(("done", index, {**window, "added": added, "cancelled": cancelled, "too_late": too_late}))


@dataclass
class SteadyRun:
    """What the steady run saw, for steady_report."""

    load: Load
    start: float  # when the producers started, time.monotonic()
    reports: list[dict[str, Any]]  # one per producer, from produce()
    fires: dict[str, Any]  # the driver's FireLog
    cpu: CpuUse  # over the producers' run
    seen: Milestones  # after it


def run_steady(segs: Segments, load: Load, seed: int, tmp: str) -> SteadyRun:
    ctx = mp.get_context("spawn")
    log = FireLog(os.path.join(tmp, "steady.pickle"))
    with segs.wheel(capacity=STEADY_CAPACITY, tick=TICK, payload_size=PAYLOAD_SIZE) as wheel:
        progress(f"steady load: starting the driver and {PRODUCERS} producers")
        driver = shmwheel.start_driver(wheel.name, log.record)
        producers: list[Any] = []
        try:
            channel = ctx.Queue()
            go = ctx.Event()
            start_at = ctx.RawValue("d", 0.0)
            arglists = [(wheel.name, i, load, seed * 1000 + i, channel, go, start_at) for i in range(PRODUCERS)]
            producers = start_producers(ctx, produce, arglists, "shmwheel-bench-producer", channel)
            segs.release(wheel.name)  # the driver and the producers have it mapped

            meter = CpuMeter(
                {"driver": psutil.Process(driver.pid)}
                | {f"producer {i}": psutil.Process(p.pid) for i, p in enumerate(producers)}
                | {"this process": psutil.Process()}
            )
            start = time.monotonic() + 0.05
            start_at.value = start
            go.set()
            time.sleep(max(0.0, start - time.monotonic()))
            meter.start()
            progress(f"steady load: {load.duration:g} s")
            time.sleep(max(0.0, start + load.duration - time.monotonic()))
            cpu = meter.stop()

            reports = collect(channel, producers, "done")
            for p in producers:
                p.join()
            seen = watch_until_drained(wheel, driver, 0.01)
        finally:
            for p in producers:
                if p.is_alive():
                    p.terminate()
                if p.pid is not None:  # started
                    p.join()
            exit_code = stop_driver(driver)
    if exit_code != 0:
        raise RuntimeError(f"the driver exited with code {exit_code}")
    return SteadyRun(load, start, reports, read_fire_log(log.path, exit_code), cpu, seen)


def steady_report(run: SteadyRun) -> tuple[list[Row], Delivery]:
    load, reports, fires, cpu, seen = run.load, run.reports, run.fires, run.cpu, run.seen
    handle, deadline, fired_at = fires["handle"], fires["deadline_ns"], fires["fired_at_ns"]

    # Exactly once: every timer added and not successfully cancelled fires
    # once.  A payload names the producer and the place of the handle in its
    # list of adds, which must be the handle that fired.
    added = [r["added"] for r in reports]
    cancelled = set(itertools.chain.from_iterable(r["cancelled"] for r in reports))
    delivery = check_handles(set(itertools.chain.from_iterable(added)) - cancelled, handle)
    delivery.early = sum(f < d for d, f in zip(deadline, fired_at, strict=True))
    delivery.wrong_payload = sum(
        added_by(added, int.from_bytes(payload, "little")) != h
        for h, payload in zip(handle, fires["payloads"], strict=True)
    )
    delivery.redelivered = seen.redelivered

    start_ns = round(run.start * 1e9)
    end_ns = start_ns + round(load.duration * 1e9)
    tick_ns = round(TICK * 1e9)
    in_window = sum(start_ns <= f < end_ns for f in fired_at)
    lateness = distribution_ms([f - d for d, f in zip(deadline, fired_at, strict=True)])
    # A timer is due at the first tick boundary at or after its deadline
    # (shmw_ticks_ceil); what comes after that boundary is the driver's own delay.
    past_tick = distribution_ms([f - ceil_div(d, tick_ns) * tick_ns for d, f in zip(deadline, fired_at, strict=True)])
    to_handler = distribution_ms([h - d for d, h in zip(deadline, fires["handled_ns"], strict=True)])
    too_late = sum(len(r["too_late"]) for r in reports)

    rows: list[Row] = []
    for i, r in enumerate(reports):
        rows.append(
            Row(
                f"producer_{i}_ops_per_s",
                f"producer {i}: operations/s (paced at {load.ops_per_second:,.0f})",
                (r["adds"] + r["cancels"]) / load.duration,
                "ops/s",
                note=f"{r['adds'] / load.duration:,.0f} adds/s + {r['cancels'] / load.duration:,.0f} cancels/s; "
                f"at most {r['backlog']:,} operations behind schedule",
            )
        )
    rows.append(
        Row(
            "fires_per_s",
            f"fires/s, all producers (aimed at {FIRES_PER_SECOND:,})",
            in_window / load.duration,
            "fires/s",
            note=f"{delivery.fires:,} fires in all; {too_late:,} cancels came too late (those timers fired)",
        )
    )
    targets = {"p50": TARGET_P50_MS, "p99": TARGET_P99_MS, "p99.9": TARGET_P999_MS}
    for name, value in lateness.items():
        rows.append(
            Row(f"lateness_{name}_ms", f"lateness (fired_at - deadline), {name}", value, "ms", targets.get(name))
        )
    rows.append(
        Row(
            "past_tick_ms",
            "fired_at - the tick boundary it was due at: p50 / p99 / p99.9 / max",
            past_tick,
            "ms",
            note="the driver's own delay: lateness is this plus the rounding up to a tick",
        )
    )
    rows.append(
        Row(
            "to_handler_ms",
            "deadline -> the handler has it: p50 / p99 / p99.9 / max",
            to_handler,
            "ms",
            note="lateness plus the dispatcher's wake-up and the handlers before it in its batch",
        )
    )
    driver_cpu = cpu.processes["driver"]
    rows.append(
        Row(
            "driver_cpu_s",
            f"driver CPU time over the {load.duration:g} s",
            driver_cpu,
            "cpu_s",
            note=f"{100 * driver_cpu / load.duration:.1f} % of one CPU; "
            f"{1e6 * driver_cpu / max(1, in_window):.1f} us per fire, the handler's included",
        )
    )
    producer_cpu = [cpu.processes[f"producer {i}"] for i in range(PRODUCERS)]
    rows.append(
        Row(
            "producer_cpu_s",
            "producer CPU time, the busier one",
            max(producer_cpu),
            "cpu_s",
            note="each: " + " / ".join(f"{c:.2f} s" for c in producer_cpu),
        )
    )
    rows += machine_rows("steady", cpu)
    if seen.drained_ns is None:
        rows.append(Row("steady_not_drained", "timers still pending or in flight at the end", 1, "count", 0))
    if seen.handler_errors:
        rows.append(Row("steady_handler_errors", "handler errors", seen.handler_errors, "count", 0))
    rows += delivery_rows("steady", delivery, detailed=True)
    return rows, delivery


def added_by(added: list[array[int]], key: int) -> int | None:
    """The handle a payload key names: producer ``key >> KEY_BITS``, add number ``key & mask``."""
    producer, seq = key >> KEY_BITS, key & ((1 << KEY_BITS) - 1)
    if producer < len(added) and seq < len(added[producer]):
        return added[producer][seq]
    return None


# -- 2. burst ---------------------------------------------------------------------------


@dataclass
class BurstRun:
    """One burst.  Times in seconds from the deadline, as polled from here."""

    add_s: float  # adding the timers
    skew_ms: float  # the deadlines came out up to this much after the aim (see run_burst)
    clock_done_s: float  # the clock has fired them all
    drained_s: float  # the last handler has run and been acknowledged
    cpu: CpuUse  # from just before the deadline until drained
    delivery: Delivery


def run_burst(segs: Segments, n: int, k: int, tmp: str) -> BurstRun:
    log = FireLog(os.path.join(tmp, f"burst-{k}.pickle"))
    tick_ns = round(TICK * 1e9)
    with segs.wheel(capacity=n + SLACK, tick=TICK, payload_size=PAYLOAD_SIZE) as wheel:
        driver = shmwheel.start_driver(wheel.name, log.record_handle)
        try:
            segs.release(wheel.name)  # the driver has it mapped
            meter = CpuMeter({"driver": psutil.Process(driver.pid), "this process": psutil.Process()})
            # Each chunk's delay is the time left until the aim, computed just
            # before add_many, which reads the clock again: its deadlines come
            # out later than the aim by at most the length of that call.  The
            # aim is BURST_OFFSET into a tick, so that all of them still fall
            # in one tick as long as no call takes longer than the rest of it.
            aim_ns = (time.monotonic_ns() + round(BURST_LEAD * 1e9)) // tick_ns * tick_ns + round(BURST_OFFSET * 1e9)
            handles: list[int] = []
            skew_ns = 0
            t0 = time.perf_counter()
            for left in range(n, 0, -BURST_CHUNK):
                before = time.monotonic_ns()
                if before >= aim_ns:
                    raise RuntimeError(f"adding {n:,} timers took longer than the {BURST_LEAD:g} s lead")
                handles += wheel.add_many([(aim_ns - before) / 1e9] * min(left, BURST_CHUNK))
                skew_ns = max(skew_ns, time.monotonic_ns() - before)
            add_s = time.perf_counter() - t0
            due_in = (aim_ns - time.monotonic_ns()) / 1e9
            progress(f"burst {k + 1}: {n:,} timers added in {add_s:.2f} s, due in {due_in:.2f} s")
            time.sleep(max(0.0, due_in - 0.05))  # start watching just before the deadline
            meter.start()
            seen = watch_until_drained(wheel, driver, BURST_POLL)
            cpu = meter.stop()
        finally:
            exit_code = stop_driver(driver)
    if exit_code != 0:
        raise RuntimeError(f"the driver exited with code {exit_code}")
    if seen.drained_ns is None:
        progress(f"burst {k + 1}: not drained within {DRAIN_TIMEOUT:g} s")
    delivery = check_handles(set(handles), read_fire_log(log.path, exit_code)["handle"])
    delivery.redelivered = seen.redelivered

    def since_aim(t_ns: int | None) -> float:
        return math.inf if t_ns is None else (t_ns - aim_ns) / 1e9

    return BurstRun(
        add_s=add_s,
        skew_ms=skew_ns / 1e6,
        clock_done_s=since_aim(seen.clock_done_ns),
        drained_s=since_aim(seen.drained_ns),
        cpu=cpu,
        delivery=delivery,
    )


def burst_rows(n: int, runs: list[BurstRun], handler_ns: float) -> list[Row]:
    best = min(runs, key=lambda r: r.drained_s)
    samples = [r.drained_s for r in runs]
    every = "; all: " + ", ".join(f"{s:.3f} s" for s in samples) if len(runs) > 1 else ""
    polled = f"polled every {BURST_POLL * 1e3:g} ms"
    rows = [
        Row(
            "burst_add_s",
            f"add {n:,} timers (add_many, {BURST_CHUNK:,} a call)",
            best.add_s,
            "s",
            note=f"{1e9 * best.add_s / n:.0f} ns a timer; deadlines at most {best.skew_ms:.2f} ms after the aim"
            + ("" if best.skew_ms < (TICK - BURST_OFFSET) * 1e3 else ", so they may span two ticks"),
        ),
        Row("burst_clock_done_s", "deadline -> the clock has fired all", best.clock_done_s, "s", note=polled),
        Row(
            "burst_drained_s",
            "deadline -> the last has reached the handler (and been acknowledged)",
            best.drained_s,
            "s",
            TARGET_BURST_S,
            samples=samples,
            note=f"best of {len(runs)}{every}; {polled}; the handler adds about {handler_ns * n / 1e9:.2f} s in all",
        ),
        Row("burst_fires_per_s", "fires through the handler a second, overall", n / best.drained_s, "fires/s"),
        Row(
            "burst_driver_cpu_s",
            "driver CPU time, deadline to drained",
            best.cpu.processes["driver"],
            "cpu_s",
            note=f"{1e9 * best.cpu.processes['driver'] / n:,.0f} ns per fire",
        ),
        *machine_rows("burst", best.cpu),
    ]
    total = sum((r.delivery for r in runs[1:]), runs[0].delivery)
    return rows + delivery_rows("burst", total, detailed=False)


def noop(fire: shmwheel.Fire) -> None:
    """A handler that does nothing: the yardstick for the recording ones."""


def handler_costs() -> dict[str, float]:
    """ns per call of the two handlers and of a no-op, in this process."""
    log = FireLog(os.devnull)  # made here, never pickled: never dumped
    handlers = {"noop": noop, "record": log.record, "record_handle": log.record_handle}
    return {name: handler_cost(h) for name, h in handlers.items()}


def handler_cost(handler: Any, repeat: int = 5, calls: int = 200_000) -> float:
    """ns per call of ``handler`` on one fire, in this process: best of ``repeat``."""
    fire = shmwheel.Fire(1 << 40, 2 << 40, 3 << 40, bytes(PAYLOAD_SIZE), os.getpid())
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in itertools.repeat(None, calls):
            handler(fire)
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


# -- report ----------------------------------------------------------------------------


def format_number(value: float, unit: str) -> str:
    if unit in ("ops/s", "fires/s"):
        return f"{value:,.0f} {unit}"
    if unit == "ms":
        if float(value).is_integer():  # a count of whole milliseconds
            return f"{value:,.0f} ms"
        return f"{value:.3f} ms" if value < 10 else f"{value:,.1f} ms"
    if unit in ("s", "cpu_s"):
        return f"{value:.3f} s" if value < 10 else f"{value:,.1f} s"
    if unit == "ns":
        return f"{value:,.0f} ns"
    if unit == "pct":
        return f"{value:.0f} %"
    return f"{value:,.0f}"


def format_value(r: Row) -> str:
    if isinstance(r.value, dict):
        numbers = " / ".join(f"{v:.3f}" if v < 10 else f"{v:,.1f}" for v in r.value.values())
        return f"{numbers} {r.unit}"
    return format_number(r.value, r.unit)


def format_target(r: Row) -> tuple[str, str]:
    """The target column and the meets column of a row."""
    if r.target is None:
        return "", ""
    bound = "0" if r.unit == "count" else f"<= {format_number(r.target, r.unit)}"
    return bound, "yes" if r.meets else "**no**"


def markdown(title: str, machine: dict[str, str | int | None], sections: list[tuple[str, list[Row]]]) -> str:
    lines = [
        f"## shmwheel driver benchmark ({title})",
        "",
        f"- CPU: {machine['cpu']}, {machine['cpus']} logical CPUs; {machine['os']}",
        f"- Python: {machine['python']}, cffi {machine['cffi']}, psutil {machine['psutil']}, "
        f"shmwheel {machine['shmwheel']}",
        f"- One driver process (start_driver), tick {TICK * 1e3:g} ms, payload_size {PAYLOAD_SIZE}; "
        "times on CLOCK_MONOTONIC.",
        "",
        "| Measurement | Result | Target | Meets | Note |",
        "|:---|---:|---:|:---:|:---|",
    ]
    for heading, rows in sections:
        lines.append(f"| **{heading}** | | | | |")
        for r in rows:
            target, meets = format_target(r)
            lines.append(f"| {r.label} | {format_value(r)} | {target} | {meets} | {r.note} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"a {QUICK_DURATION:g} s steady run and one burst: a CI smoke test"
    )
    parser.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help=f"seconds of steady load (default {DURATION:g}, {QUICK_DURATION:g} with --quick)",
    )
    parser.add_argument(
        "--burst", type=int, default=BURST, metavar="N", help=f"timers in the burst (default {BURST:,})"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help=f"bursts, the best is reported (default {REPEAT}, {QUICK_REPEAT} with --quick)",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    parser.add_argument("--seed", type=int, default=1, help="seed of the producers' random choices (default 1)")
    args = parser.parse_args(argv)
    if args.duration is not None and not 0 < args.duration <= 3600:
        parser.error("--duration must be more than 0 and at most 3600 s")
    if not 1 <= args.burst <= 100_000_000:
        parser.error("--burst must be between 1 and 100,000,000")
    if args.repeat is not None and args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    duration = args.duration or (QUICK_DURATION if args.quick else DURATION)
    repeat = args.repeat or (QUICK_REPEAT if args.quick else REPEAT)
    signal.signal(signal.SIGTERM, terminate)

    segs = Segments("shmwheel-bench-driver")
    started = time.monotonic()
    print(f"shmwheel driver benchmark{', quick run' if args.quick else ''}:", file=sys.stderr)
    try:
        with scratch(segs, "shmwheel-bench-driver-") as tmp:
            costs = handler_costs()
            steady_run = run_steady(segs, Load(duration), args.seed, tmp)
            bursts = [run_burst(segs, args.burst, k, tmp) for k in range(repeat)]
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    progress(f"done in {time.monotonic() - started:.0f} s")

    machine = machine_info(psutil=psutil.__version__)
    steady_rows, steady_delivery = steady_report(steady_run)
    reference = [
        Row(
            "handler_record_ns",
            "the steady run's handler (FireLog.record), per call",
            costs["record"],
            "ns",
            note="four array appends, one of them a clock read, and a list append",
        ),
        Row(
            "handler_record_handle_ns",
            "the burst's handler (FireLog.record_handle), per call",
            costs["record_handle"],
            "ns",
            note="one array append",
        ),
        Row("handler_noop_ns", "a no-op handler, per call", costs["noop"], "ns"),
    ]
    sections = [
        (f"Steady load: {PRODUCERS} producers x {OPS_PER_SECOND:,} ops/s, {duration:g} s", steady_rows),
        (
            f"Burst: {args.burst:,} timers due at once, {repeat} run{'s' if repeat > 1 else ''}",
            burst_rows(args.burst, bursts, costs["record_handle"] - costs["noop"]),
        ),
        ("Handlers, measured in this process", reference),
    ]
    title = f"{'quick' if args.quick else 'full'} run"
    print(markdown(title, machine, sections))

    ok = steady_delivery.ok and all(b.delivery.ok for b in bursts)
    if args.json:
        document = {
            "machine": machine,
            "config": {
                "duration_s": duration,
                "producers": PRODUCERS,
                "ops_per_second_each": OPS_PER_SECOND,
                "fires_per_second": FIRES_PER_SECOND,
                "tick_s": TICK,
                "payload_size": PAYLOAD_SIZE,
                "burst": args.burst,
                "burst_chunk": BURST_CHUNK,
                "repeat": repeat,
                "seed": args.seed,
            },
            "ok": ok,
            "results": [
                {"section": heading, **asdict(r), "meets": r.meets} for heading, rows in sections for r in rows
            ],
            "bursts": [asdict(b) for b in bursts],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(strict_json(document), f, indent=2, allow_nan=False)
            f.write("\n")
    if not ok:
        print("FAILED: fires were lost, duplicated, unexpected, early or mixed up (see the table)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
