#!/usr/bin/env python3
"""How long the repair after a lock holder's death takes, by capacity.

A child process is stopped (by a crash point of the core built for the
tests, shmwheel._shmwheel_testing) in the middle of an add, holding the
lock, on a wheel with the given number of timers pending; the time of the
parent's next lock, which finds EOWNERDEAD and rebuilds the free list,
buckets, heap and counters, is the repair time.  Best of --repeat runs;
the segment is removed whatever happens.

That module is not shipped: a run of the test suite builds it beside the
package's sources, or ``python csrc/build_shmwheel.py --testing`` does.

Usage: python bench/recovery.py [--capacity N ...] [--repeat N]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

import shmwheel

try:
    from shmwheel import _shmwheel_testing as testing
except ImportError:
    sys.exit("bench/recovery.py: no shmwheel._shmwheel_testing: build it with python csrc/build_shmwheel.py --testing")


def crash_mid_add(name: str) -> None:
    """In a child: map the segment, open it with the tests' core and die
    half-way through an add, holding the lock."""
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    with mmap.mmap(fd, 0) as mm:
        out = testing.ffi.new("shmw_t **")
        assert testing.lib.shmw_open(testing.ffi.from_buffer(mm), len(mm), out) == 0
        testing.lib.shmw_test_crash_after(5)
        testing.lib.shmw_add(out[0], 1.0, testing.ffi.NULL, 0, 0)


def one_repair(capacity: int, fill: float) -> float:
    name = f"shmwheel-bench-recovery-{os.getpid()}"
    w = shmwheel.create(name, capacity=capacity, payload_size=0)
    try:
        n = int(capacity * fill)
        for start in range(0, n, 100_000):
            w.add_many([3600.0 + (start + i) * 1e-4 for i in range(min(100_000, n - start))])
        pid = os.fork()
        if pid == 0:
            try:
                crash_mid_add(name)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        t0 = time.perf_counter()
        w.stats()  # the first lock: EOWNERDEAD, then the repair
        elapsed = time.perf_counter() - t0
        assert w.stats().recoveries == 1
        return elapsed
    finally:
        w.close()
        shmwheel.unlink(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--fill", type=float, default=0.9, help="fraction of the capacity pending")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"| capacity | pending | repair (best of {args.repeat}) |")
    print("| ---: | ---: | ---: |")
    for capacity in args.capacity:
        best = min(one_repair(capacity, args.fill) for _ in range(args.repeat))
        print(f"| {capacity:,} | {int(capacity * args.fill):,} | {best * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
