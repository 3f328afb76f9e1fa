#!/usr/bin/env python3
"""Micro-benchmark of shmwheel, measured from Python on this machine.

What it measures (wall-clock, per operation, as a Python caller pays it):

1. add, cancel, reset, one add+cancel pair, add_many and cancel_many per
   timer (batches of 1,000 and of 100,000) and poll per fired timer; for
   reference also an empty Python loop, ``len(wheel)`` (one cffi call that
   takes the lock and touches nothing else) and a poll that finds nothing due.
2. The add+cancel pair with 1 k, 100 k, 1 M and 10 M far-future timers
   pending, and the ratio of the largest level to the smallest.  Next to it
   a "churn" figure: cancel a *random* pending timer and add a new one.  The
   pair keeps reusing one hot slab entry; churn touches entries all over the
   slab, so it shows what the cache does at 10 M.
3. The slab's bytes per entry beyond the payload, derived from the size of
   the segment in /dev/shm at two capacities, and the segment sizes.

Timing method.  Each case is a function that does its own untimed setup and
teardown around one timed loop.  Every case runs once to warm up, then
``--repeat`` times, and the minimum is reported: on a shared machine the
minimum is the figure least polluted by other work.  The machine's slow
spells last long enough to cover a whole loop, so the cases of a section
are run round-robin, one repetition of each in turn: figures that are
compared with each other (the pair at 1 k and at 10 M pending, say) then
see the same spells.  The garbage collector is off while a loop runs, and
bound methods are bound to locals before it.  Loop overhead is *included*
in every figure: the "empty loop" row shows how much it is.

The targets are printed next to the figures, not asserted.

Every segment the script creates is closed and unlinked, also on error,
Ctrl-C or SIGTERM; the names are ``shmwheel-bench-<pid>-<n>``.

Usage::

    python bench/micro.py [--quick] [--json FILE] [--repeat N] [--seed N]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field

from _common import Segments, progress, scratch, segment_size, terminate
from _machine import machine_info

import shmwheel

# Delay ranges, in seconds.  NEAR is what request timeouts look like (at the
# default 1 ms tick it spreads timers over wheel levels 1 and 2); FAR is for
# timers that only have to sit in the wheel while we measure (levels 2 and
# 3), so that nothing comes due during a run.
NEAR = (1.0, 3600.0)
FAR = (3600.0, 7 * 86400.0)
# reset() moves NEAR timers here: a bucket no NEAR delay maps to, so every
# reset measured really unlinks its entry and appends it elsewhere.
RESET_DELAY = 2 * 3600.0

SMALL_BATCH = 1_000
LARGE_BATCH = 100_000
SLACK = 1_024  # spare slab slots on top of what a measurement needs

# Capacities of the two segments whose size difference gives bytes per entry.
MEMORY_CAPACITIES = (1_000, 101_000)
MEMORY_PAYLOADS = (0, 64)

# Targets: printed next to the figures, not asserted.
TARGET_PAIR_NS = 1_000.0
TARGET_RATIO = 1.3
TARGET_BATCH_NS = 100.0
TARGET_ENTRY_BYTES = 64.0


@dataclass(frozen=True)
class Config:
    """Sizes of one run; FULL and QUICK below are the two presets."""

    name: str
    repeat: int  # timed repetitions of every case (the best is reported)
    ops: int  # operations per loop for the single-operation cases
    batch_timers: int  # timers per repetition of the batch cases
    fires: int  # timers fired by the one poll of a repetition
    idle_polls: int  # polls per loop when nothing is due
    pending_levels: tuple[int, ...]  # timers pending, for the scaling cases
    pair_ops: int  # pairs (and churns) per loop at each pending level
    churn_sample: int  # pending handles the churn loops pick from
    fill_chunk: int  # add_many chunk used to fill a wheel


# Loops are short (tens of milliseconds) and repeated many times: a short
# loop has a fair chance of running undisturbed on a shared machine.
FULL = Config(
    name="full",
    repeat=25,
    ops=20_000,
    batch_timers=200_000,
    fires=50_000,
    idle_polls=5_000,
    pending_levels=(1_000, 100_000, 1_000_000, 10_000_000),
    pair_ops=20_000,
    # 1 M entries, their list neighbours and the Python ints: well beyond
    # any L3, and more than the (repeat + 1) * pair_ops visits of a run, so
    # no churn loop finds the entries the previous one left in the cache.
    churn_sample=1_000_000,
    fill_chunk=100_000,
)

QUICK = Config(
    name="quick",
    repeat=10,
    ops=10_000,
    batch_timers=LARGE_BATCH,
    fires=10_000,
    idle_polls=2_000,
    pending_levels=(1_000, 100_000, 1_000_000),  # no 10 M level
    pair_ops=10_000,
    churn_sample=200_000,
    fill_chunk=100_000,
)

#: A case: (operations in its timed loop, function returning the loop's ns).
Case = tuple[int, Callable[[], int]]


@dataclass
class Result:
    """One row of the report."""

    key: str  # stable identifier, for the JSON output
    label: str  # what the Markdown table shows
    value: float
    unit: str  # "ns", "ratio" or "bytes"
    target: float | None = None  # the upper bound we hope for, if any
    samples: list[float] = field(default_factory=list)  # every timed repetition
    note: str = ""

    @property
    def meets(self) -> bool | None:
        return None if self.target is None else self.value <= self.target


# -- timing --------------------------------------------------------------------


def measure(repeat: int, cases: dict[str, Case]) -> dict[str, list[float]]:
    """Time every case ``repeat`` times, round-robin; return ns per operation of each run.

    Every case first runs once untimed: that faults pages in, warms the
    caches and lets the interpreter specialise the loop.
    """
    for _, trial in cases.values():
        trial()
    samples: dict[str, list[float]] = {key: [] for key in cases}
    for _ in range(repeat):
        for key, (ops, trial) in cases.items():
            gc.collect()
            gc.disable()
            try:
                elapsed = trial()
            finally:
                gc.enable()
            samples[key].append(elapsed / ops)
    return samples


def spread(rng: random.Random, n: int, bounds: tuple[float, float]) -> list[float]:
    """``n`` delays drawn uniformly from ``bounds``."""
    lo, hi = bounds
    return [rng.uniform(lo, hi) for _ in range(n)]


def count_label(n: int) -> str:
    """1000 -> '1 k', 10_000_000 -> '10 M'."""
    for size, suffix in ((1_000_000, "M"), (1_000, "k")):
        if n >= size and n % size == 0:
            return f"{n // size} {suffix}"
    return f"{n:,}"


# -- 1. single operations ------------------------------------------------------
#
# Each factory returns the trial of one case, bound to its wheel and data.
# Every trial leaves the wheel with no timers pending, as it found it.


def empty_loop_trial(delays: list[float]) -> Callable[[], int]:
    def trial() -> int:
        t0 = time.perf_counter_ns()
        for _ in delays:
            pass
        return time.perf_counter_ns() - t0

    return trial


def len_trial(wheel: shmwheel.Wheel, n: int) -> Callable[[], int]:
    def trial() -> int:
        size = wheel.__len__  # one cffi call: the lock, and nothing under it
        t0 = time.perf_counter_ns()
        for _ in itertools.repeat(None, n):
            size()
        return time.perf_counter_ns() - t0

    return trial


def add_trial(wheel: shmwheel.Wheel, delays: list[float]) -> Callable[[], int]:
    def trial() -> int:
        add = wheel.add
        handles: list[int] = []
        append = handles.append  # keeps the handles for the teardown
        t0 = time.perf_counter_ns()
        for d in delays:
            append(add(d))
        elapsed = time.perf_counter_ns() - t0
        wheel.cancel_many(handles)
        return elapsed

    return trial


def cancel_trial(wheel: shmwheel.Wheel, delays: list[float]) -> Callable[[], int]:
    def trial() -> int:
        handles = wheel.add_many(delays)
        cancel = wheel.cancel
        t0 = time.perf_counter_ns()
        for h in handles:
            cancel(h)
        return time.perf_counter_ns() - t0

    return trial


def reset_trial(wheel: shmwheel.Wheel, delays: list[float]) -> Callable[[], int]:
    def trial() -> int:
        handles = wheel.add_many(delays)
        reset = wheel.reset
        delay = RESET_DELAY
        t0 = time.perf_counter_ns()
        for h in handles:
            reset(h, delay)
        elapsed = time.perf_counter_ns() - t0
        wheel.cancel_many(handles)
        return elapsed

    return trial


def pair_trial(wheel: shmwheel.Wheel, delays: list[float]) -> Callable[[], int]:
    def trial() -> int:
        add, cancel = wheel.add, wheel.cancel
        t0 = time.perf_counter_ns()
        for d in delays:
            cancel(add(d))
        return time.perf_counter_ns() - t0

    return trial


def add_many_trial(wheel: shmwheel.Wheel, chunks: list[list[float]]) -> Callable[[], int]:
    def trial() -> int:
        add_many = wheel.add_many
        batches: list[list[int]] = []
        append = batches.append
        t0 = time.perf_counter_ns()
        for chunk in chunks:
            append(add_many(chunk))
        elapsed = time.perf_counter_ns() - t0
        for handles in batches:
            wheel.cancel_many(handles)
        return elapsed

    return trial


def cancel_many_trial(wheel: shmwheel.Wheel, chunks: list[list[float]]) -> Callable[[], int]:
    def trial() -> int:
        batches = [wheel.add_many(chunk) for chunk in chunks]
        cancel_many = wheel.cancel_many
        t0 = time.perf_counter_ns()
        for handles in batches:
            cancel_many(handles)
        return time.perf_counter_ns() - t0

    return trial


def fire_trial(wheel: shmwheel.Wheel, n: int) -> Callable[[], int]:
    due_now = [0.0] * n

    def trial() -> int:
        wheel.poll()  # bring the wheel clock up to now, so the timers land in level 0
        wheel.add_many(due_now)
        time.sleep(3 * wheel.tick)  # let their tick pass
        now = time.monotonic()
        poll = wheel.poll
        t0 = time.perf_counter_ns()
        fired = poll(now)
        elapsed = time.perf_counter_ns() - t0
        if len(fired) != n:
            raise RuntimeError(f"poll fired {len(fired)} timers, expected {n}")
        return elapsed

    return trial


def idle_poll_trial(wheel: shmwheel.Wheel, n: int) -> Callable[[], int]:
    def trial() -> int:
        poll = wheel.poll
        t0 = time.perf_counter_ns()
        for _ in itertools.repeat(None, n):
            poll()
        return time.perf_counter_ns() - t0

    return trial


def bench_operations(segs: Segments, cfg: Config, rng: random.Random) -> list[Result]:
    """Every single-operation case, on one wheel with the default payload_size."""
    n = cfg.ops
    delays = spread(rng, n, NEAR)
    batch_delays = spread(rng, cfg.batch_timers, NEAR)
    capacity = max(n, cfg.batch_timers, cfg.fires) + SLACK

    with segs.wheel(capacity=capacity) as wheel:
        # key: (label, target, note, case)
        rows: dict[str, tuple[str, float | None, str, Case]] = {
            "loop_overhead": ("empty Python loop (reference)", None, "", (n, empty_loop_trial(delays))),
            "len": (
                "len(wheel): one cffi call, the lock and nothing else (reference)",
                None,
                "",
                (n, len_trial(wheel, n)),
            ),
            "add": ("add", None, "includes list.append of the handle", (n, add_trial(wheel, delays))),
            "cancel": ("cancel", None, "", (n, cancel_trial(wheel, delays))),
            "reset": ("reset", None, "each moves its timer to another bucket", (n, reset_trial(wheel, delays))),
            "pair": ("add + cancel pair", TARGET_PAIR_NS, "", (n, pair_trial(wheel, delays))),
        }
        for size in (SMALL_BATCH, LARGE_BATCH):
            total = max(size, cfg.batch_timers - cfg.batch_timers % size)
            chunks = [batch_delays[i : i + size] for i in range(0, total, size)]
            label = count_label(size)
            note = f"{len(chunks)} call{'s' if len(chunks) > 1 else ''} a loop"
            rows[f"add_many_{size}"] = (
                f"add_many, per timer (batches of {label})",
                TARGET_BATCH_NS,
                note,
                (total, add_many_trial(wheel, chunks)),
            )
            rows[f"cancel_many_{size}"] = (
                f"cancel_many, per timer (batches of {label})",
                TARGET_BATCH_NS,
                note,
                (total, cancel_many_trial(wheel, chunks)),
            )
        rows["poll_per_fire"] = (
            "poll, per fired timer",
            None,
            f"{cfg.fires:,} due at once, empty payloads",
            (cfg.fires, fire_trial(wheel, cfg.fires)),
        )
        rows["poll_idle"] = (
            "poll with nothing due, per call",
            None,
            "",
            (cfg.idle_polls, idle_poll_trial(wheel, cfg.idle_polls)),
        )

        progress(f"operations: {len(rows)} cases, {cfg.repeat} rounds")
        samples = measure(cfg.repeat, {key: row[3] for key, row in rows.items()})
        if len(wheel) != 0:
            raise RuntimeError(f"{len(wheel)} timers left pending by the operation cases")

    return [
        Result(key, label, min(samples[key]), "ns", target, samples[key], note)
        for key, (label, target, note, _) in rows.items()
    ]


# -- 2. scaling with the number of pending timers -------------------------------


def fill(wheel: shmwheel.Wheel, n: int, chunk: list[float], keep: int) -> list[int]:
    """Add ``n`` far-future timers with add_many; return about ``keep`` of their handles.

    The handles kept are evenly strided over the fill, hence over the slab.
    """
    add_many = wheel.add_many
    step = max(1, n // keep)
    kept: list[int] = []
    left = n
    while left:
        k = min(left, len(chunk))
        kept.extend(add_many(chunk if k == len(chunk) else chunk[:k])[::step])
        left -= k
    return kept[:keep]


def visit_order(rng: random.Random, m: int, total: int) -> list[int]:
    """``total`` indices into ``range(m)``: one random permutation after another."""
    order: list[int] = []
    while len(order) < total:
        order.extend(rng.sample(range(m), m))
    del order[total:]
    return order


def churn_trial(
    wheel: shmwheel.Wheel, live: list[int], slices: Iterator[list[int]], delays: list[float]
) -> Callable[[], int]:
    """Cancel random pending timers and add a replacement for each.

    The number pending stays the same and ``live`` keeps holding live
    handles.  Each run takes the next slice of a random visiting order.
    """

    def trial() -> int:
        add, cancel = wheel.add, wheel.cancel
        indices = next(slices)
        t0 = time.perf_counter_ns()
        for i, d in zip(indices, delays, strict=False):
            cancel(live[i])
            live[i] = add(d)
        return time.perf_counter_ns() - t0

    return trial


def bench_pending(segs: Segments, cfg: Config, rng: random.Random) -> tuple[list[Result], list[Result]]:
    """The add+cancel pair, and churn, with ever more timers pending.

    All levels are filled first and then timed round-robin.  Returns the
    timing rows and one segment-size row per level.
    """
    k = cfg.pair_ops
    runs = cfg.repeat + 1  # measure() runs each case once more, to warm up
    chunk = spread(rng, cfg.fill_chunk, FAR)
    delays = spread(rng, k, FAR)
    cases: dict[str, Case] = {}
    sizes: list[Result] = []

    with contextlib.ExitStack() as stack:
        wheels: dict[int, shmwheel.Wheel] = {}
        for n in cfg.pending_levels:
            label = count_label(n)
            progress(f"{label} pending: filling")
            wheel = stack.enter_context(segs.wheel(capacity=n + SLACK, payload_size=0))
            t0 = time.monotonic()
            live = fill(wheel, n, chunk, cfg.churn_sample)
            fill_s = time.monotonic() - t0
            order = visit_order(rng, len(live), runs * k)
            slices = iter([order[i : i + k] for i in range(0, runs * k, k)])
            wheels[n] = wheel
            cases[f"pair_pending_{n}"] = (k, pair_trial(wheel, delays))
            cases[f"churn_pending_{n}"] = (k, churn_trial(wheel, live, slices, delays))
            sizes.append(
                Result(
                    f"segment_bytes_{n}",
                    f"segment size, capacity {n + SLACK:,}, payload_size 0",
                    segment_size(wheel.name),
                    "bytes",
                    note=f"filled with {label} timers in {fill_s:.2f} s",
                )
            )

        progress(f"pending levels: {len(cases)} cases, {cfg.repeat} rounds")
        samples = measure(cfg.repeat, cases)

        # Every cancel above found its timer, and the levels still hold n each.
        for n, wheel in wheels.items():
            stats = wheel.stats()
            if stats.pending != n or stats.cancelled != 2 * runs * k:
                raise RuntimeError(
                    f"{count_label(n)} level: {stats.pending} pending (expected {n}), "
                    f"{stats.cancelled} cancelled (expected {2 * runs * k})"
                )

    lo, hi = min(wheels), max(wheels)
    ratio_note = "" if hi == 10_000_000 else "the 10 M level is skipped with --quick"
    results: list[Result] = []
    for kind, label, target in (
        ("pair", "add + cancel pair", TARGET_PAIR_NS),
        ("churn", "cancel a random pending timer + add", None),
    ):
        rows = {
            n: Result(
                f"{kind}_pending_{n}",
                f"{label}, {count_label(n)} pending",
                min(samples[f"{kind}_pending_{n}"]),
                "ns",
                target,
                samples[f"{kind}_pending_{n}"],
            )
            for n in cfg.pending_levels
        }
        results.extend(rows.values())
        results.append(
            Result(
                f"{kind}_ratio",
                f"{kind} ratio, {count_label(hi)} / {count_label(lo)} pending",
                rows[hi].value / rows[lo].value,
                "ratio",
                TARGET_RATIO if kind == "pair" else None,
                note=ratio_note,
            )
        )
    return results, sizes


# -- 3. memory ----------------------------------------------------------------------


def bench_memory(segs: Segments) -> list[Result]:
    """Bytes a slab entry costs beyond its payload, from two segment sizes."""
    c1, c2 = MEMORY_CAPACITIES
    results: list[Result] = []
    for payload in MEMORY_PAYLOADS:
        sizes = []
        for capacity in (c1, c2):
            with segs.wheel(capacity=capacity, payload_size=payload) as wheel:
                sizes.append(segment_size(wheel.name))
        s1, s2 = sizes
        per_entry = (s2 - s1) / (c2 - c1)  # payload included
        results.append(
            Result(
                f"entry_overhead_bytes_p{payload}",
                f"bytes per entry beyond the payload, payload_size {payload}",
                per_entry - payload,
                "bytes",
                TARGET_ENTRY_BYTES,
                note=f"{per_entry:g} bytes a slot in all",
            )
        )
        results.append(
            Result(
                f"fixed_bytes_p{payload}",
                f"segment without the slab (header, buckets, heap, lane lists), payload_size {payload}",
                s1 - c1 * per_entry,
                "bytes",
            )
        )
        for capacity, size in zip((c1, c2), sizes, strict=True):
            results.append(
                Result(
                    f"segment_bytes_c{capacity}_p{payload}",
                    f"segment size, capacity {capacity:,}, payload_size {payload}",
                    size,
                    "bytes",
                )
            )
    return results


def run(cfg: Config, seed: int, segs: Segments) -> list[tuple[str, list[Result]]]:
    """Every measurement of a run, as (section title, rows) in the order of the report."""
    rng = random.Random(seed)
    operations = bench_operations(segs, cfg, rng)
    pending, pending_sizes = bench_pending(segs, cfg, rng)
    progress("segment sizes")
    memory = bench_memory(segs) + pending_sizes
    return [
        ("Operations", operations),
        ("With timers pending (payload_size 0)", pending),
        ("Memory", memory),
    ]


# -- report ---------------------------------------------------------------------------


def format_value(r: Result) -> str:
    if r.unit == "ns":
        return f"{r.value:,.0f} ns" if r.value >= 100 else f"{r.value:.1f} ns"
    if r.unit == "ratio":
        return f"{r.value:.2f}x"
    text = f"{r.value:,.0f} B" if r.value == int(r.value) else f"{r.value:,.2f} B"
    if r.value >= 10 * 2**20:
        text += f" ({r.value / 2**20:,.1f} MiB)"
    return text


def format_target(r: Result) -> tuple[str, str]:
    """The target column and the meets column of a row."""
    if r.target is None:
        return "", ""
    if r.unit == "ns":
        bound = f"<= {r.target:,.0f} ns"
    elif r.unit == "ratio":
        bound = f"<= {r.target:g}x"
    else:
        bound = f"<= {r.target:g} B"
    return bound, "yes" if r.meets else "**no**"


def markdown(cfg: Config, machine: dict[str, str | int | None], sections: list[tuple[str, list[Result]]]) -> str:
    lines = [
        f"## shmwheel micro-benchmark ({cfg.name} run)",
        "",
        f"- CPU: {machine['cpu']}, {machine['cpus']} logical CPUs; {machine['os']}",
        f"- Python: {machine['python']}, cffi {machine['cffi']}, shmwheel {machine['shmwheel']}",
        f"- Best of {cfg.repeat} timed repetitions (after one warm-up, cases interleaved, GC off); "
        "wall-clock per operation from Python, loop overhead included.",
        "",
        "| Measurement | Result | Target | Meets | Note |",
        "|:---|---:|---:|:---:|:---|",
    ]
    for title, results in sections:
        lines.append(f"| **{title}** | | | | |")
        for r in results:
            target, meets = format_target(r)
            lines.append(f"| {r.label} | {format_value(r)} | {target} | {meets} | {r.note} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and no 10 M level (well under 30 s)")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    parser.add_argument(
        "--repeat",
        type=int,
        metavar="N",
        help=f"timed repetitions of each case (default {FULL.repeat}, {QUICK.repeat} with --quick)",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the random delays and orders (default 1)")
    args = parser.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        parser.error("--repeat must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.repeat is not None:
        cfg = Config(**{**asdict(cfg), "repeat": args.repeat})
    signal.signal(signal.SIGTERM, terminate)

    segs = Segments()
    started = time.monotonic()
    print(f"shmwheel micro-benchmark, {cfg.name} run:", file=sys.stderr)
    try:
        with scratch(segs):
            sections = run(cfg, args.seed, segs)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    progress(f"done in {time.monotonic() - started:.0f} s")

    machine = machine_info()
    print(markdown(cfg, machine, sections))

    if args.json:
        document = {
            "machine": machine,
            "config": asdict(cfg),
            "seed": args.seed,
            "results": [
                {"section": title, **asdict(r), "meets": r.meets} for title, results in sections for r in results
            ],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
