#!/usr/bin/env python3
"""Instructions a request costs in the request loop, counted by callgrind.

Wall-clock figures on a shared virtual machine move by a third from one
minute to the next; instruction counts do not move at all.  This script
runs the producer loop of ``stress.py`` (``stress.request_loop``, the very
function the benchmark times) under ``valgrind --tool=callgrind`` for each
of these timers, in one process, with nothing else around it:

- ``none``: an add that returns its key and a cancel that returns True:
  what the loop itself costs (the deque of requests in service, the keys,
  the clock, the adapters' calls);
- ``shmwheel``: ``Wheel.add`` and ``Wheel.cancel`` on a real segment (no
  driver: the producer's side only, which is what a worker pays);
- ``asyncio``: ``call_later`` and ``TimerHandle.cancel``, the loop given a
  turn every millisecond as in the benchmark;
- ``heapq``: the benchmark's heap with lazy cancellation.

The loop's clock is virtual: every reading is ``STEP_NS`` after the
previous one, as in a loop that runs 400,000 requests a second, so that
requests stay in service for as many turns as they do in the timed runs
and the in-process loops get their turn as often.  Each timer is counted
twice, for ``--requests`` requests and for one, and the difference divided
by the number of extra requests: start-up and tear-down cancel out.

Output: a Markdown table of instructions per request, per request beyond
the loop's own, and each timer's cost over shmwheel's.  Needs valgrind
(Debian: ``apt-get install valgrind``); without it the script says so and
exits 1.  The segment it creates is named ``shmwheel-bench-<pid>-<n>`` and
unlinked however the run ends.

Usage::

    python bench/compare/instructions.py [--requests N] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

# The helpers shared with the other benchmarks (_common) are one folder up,
# in bench/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import stress
from _common import Segments, scratch

STEP_NS = 2_500  # the virtual clock's step: a loop at 400,000 requests/s
REQUESTS = 20_000
BACKENDS = ("none", "shmwheel", "asyncio", "heapq")
COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


class NullClient:
    """A timer that does nothing: the loop's own cost."""

    @staticmethod
    def add(key: int, deadline_ns: int, delay_s: float) -> int:
        return key

    @staticmethod
    def cancel(token: int) -> bool:
        return True

    @staticmethod
    def service(now_ns: int) -> None:
        pass

    def close(self) -> None:
        pass


def inner(backend: str, requests: int) -> None:
    """One loop of ``requests`` requests on ``backend``, in this process."""
    segs = Segments()
    with scratch(segs), contextlib.ExitStack() as stack:
        client: Any
        if backend == "none":
            client = NullClient()
        elif backend == "shmwheel":
            wheel = stack.enter_context(
                segs.wheel(capacity=stress.CAPACITY_PER_PRODUCER, tick=stress.TICK, payload_size=8)
            )
            client = stress.connect(stress.Target("shmwheel", wheel.name))
        else:
            client = stress.connect(stress.Target(backend, ""))
        stack.callback(client.close)
        start = time.monotonic_ns()
        clock = itertools.count(start, STEP_NS).__next__
        stress.request_loop(client, 0, start + requests * STEP_NS, clock)


def count(valgrind: str, backend: str, requests: int) -> int:
    """Instructions of a whole run of this script's inner loop, as callgrind counts them."""
    cmd = [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, __file__]
    out = subprocess.run(
        [*cmd, "--inner", backend, "--requests", str(requests)], capture_output=True, text=True, check=False
    )
    found = COLLECTED.search(out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"callgrind on {backend} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return int(found.group(1))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, metavar="N", help=f"requests a counted run (default {REQUESTS:,})"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    parser.add_argument("--inner", choices=BACKENDS, help=argparse.SUPPRESS)  # the process callgrind runs
    args = parser.parse_args(argv)
    if args.inner is None and not 100 <= args.requests <= 10_000_000:  # the inner run's baseline is 1
        parser.error("--requests must be between 100 and 10,000,000")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.inner:
        inner(args.inner, args.requests)
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("instructions.py: valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 1
    per_request: dict[str, float] = {}
    try:
        for backend in BACKENDS:
            print(f"counting {backend} ...", file=sys.stderr)
            many, one = count(valgrind, backend, args.requests), count(valgrind, backend, 1)
            per_request[backend] = (many - one) / (args.requests - 1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    loop = per_request["none"]
    timer = {b: per_request[b] - loop for b in BACKENDS if b != "none"}
    print(f"Instructions a request in the request loop ({args.requests:,} requests, callgrind)\n")
    print(
        "| timer | instructions a request | beyond the loop's own "
        "| this / shmwheel, beyond the loop | this / shmwheel, a request |"
    )
    print("|:---|---:|---:|---:|---:|")
    for b in BACKENDS:
        if b == "none":
            print(f"| none (the loop alone) | {loop:,.0f} | | | |")
            continue
        print(
            f"| {b} | {per_request[b]:,.0f} | {timer[b]:,.0f} | {timer[b] / timer['shmwheel']:.2f}x "
            f"| {per_request[b] / per_request['shmwheel']:.2f}x |"
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"requests": args.requests, "step_ns": STEP_NS, "per_request": per_request}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
