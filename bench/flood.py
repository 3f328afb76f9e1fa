#!/usr/bin/env python3
"""A flood of forged timers: how late a real request's timeout is logged.

Whoever can write a request wheel can fill it with timers whose records
name processes the driver may not signal.  The request-timeout driver
refuses each (TimeoutHandler.refused) and says so in two lines a second;
what this measures is what the flood costs the real timeouts due at the
same moment.

A wheel with a 1 ms tick; a worker process (a RequestTimer on the wheel)
starts one request whose timeout falls in the tick of moment D;
``--forged`` timers (100,000) due at D too, each naming a live process
that is attached to no wheel and added by another (a forgery through the
API); a Driver with the TimeoutHandler in this process.  Reported, from D: when the handler logged the real request's
"request timed out" line, when it had refused the last forged timer, and
how many lines it logged in all.  The same run with no forged timers
first, as the baseline: compare the two, not figures from another day.
With ``--ahead MS`` the forged timers are due MS before the real one, so
that the clock fires them all first, whatever lane they are in.

Every segment is removed however the run ends.

Usage::

    python bench/flood.py [--forged N] [--ahead MS] [--repeat N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import Segments, progress, scratch, strict_json  # noqa: E402

import shmwheel  # noqa: E402
from shmwheel._process import start_time  # noqa: E402
from shmwheel.contrib import (  # noqa: E402
    KIND_REQUEST,
    PAYLOAD_SIZE,
    TimeoutActions,
    TimeoutHandler,
    encode_request,
)

WORKER = """
import sys, time
from shmwheel.contrib import RequestTimer
name = sys.argv[1]
timer = RequestTimer(name, 3.0)
assert timer.start("GET", "/real", "real") is not None
print("started", time.monotonic_ns() + 3_000_000_000, flush=True)  # its deadline, give or take microseconds
time.sleep(60)
"""
TICK_NS = 1_000_000

FORGER = """
import sys, time
import shmwheel
name, due_ns, record = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3])
wheel = shmwheel.attach(name)
for line in sys.stdin:  # a count of timers to add, each time
    n = int(line)
    for first in range(0, n, 10_000):  # one call into C a chunk
        k = min(10_000, n - first)
        wheel.add_many([(due_ns - time.monotonic_ns()) / 1e9] * k, [record] * k)
    print("added", flush=True)
"""


class Lines(logging.Handler):
    """The handler's log lines, each with when it was written."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic_ns(), record.getMessage()))


def add_forged(forger: subprocess.Popen[str], n: int) -> None:
    """The forger adds ``n`` more timers."""
    assert forger.stdin is not None and forger.stdout is not None
    forger.stdin.write(f"{n}\n")
    forger.stdin.flush()
    assert forger.stdout.readline() == "added\n"


def one_run(segs: Segments, forged: int, ahead_ms: float) -> dict[str, Any]:
    stranger = subprocess.Popen(["sleep", "600"])
    worker: subprocess.Popen[str] | None = None
    forger: subprocess.Popen[str] | None = None
    lines = Lines()
    log = logging.getLogger("shmwheel.timeouts")
    log.addHandler(lines)
    try:
        start = start_time(stranger.pid)
        assert start is not None
        with segs.wheel(capacity=1 << 18, payload_size=PAYLOAD_SIZE, tick=TICK_NS / 1e9) as wheel:
            worker = subprocess.Popen([sys.executable, "-c", WORKER, wheel.name], stdout=subprocess.PIPE, text=True)
            assert worker.stdout is not None
            said, deadline = worker.stdout.readline().split()
            assert said == "started"
            # D: the middle of the tick the worker's timer fires in, and the
            # forged timers' deadline (--ahead before it).
            due = -(-int(deadline) // TICK_NS) * TICK_NS - TICK_NS // 2
            record = encode_request(KIND_REQUEST, stranger.pid, start, time.monotonic_ns(), "GET", "forged", "/x")
            forged_due = due - int(ahead_ms * 1e6)
            forger = subprocess.Popen([sys.executable, "-c", FORGER, wheel.name, str(forged_due), record.hex()],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
            add_forged(forger, forged)
            handler = TimeoutHandler(wheel.name, TimeoutActions(tracebacks=False))
            driver = shmwheel.Driver(wheel.name, handler)
            thread = threading.Thread(target=driver.run)
            thread.start()
            try:
                give_up = time.monotonic() + 120
                while (handler.refused < forged or not any("GET /real" in m for _, m in lines.lines)) and (
                    time.monotonic() < give_up
                ):
                    time.sleep(0.005)
                last_refused = time.monotonic_ns()
                time.sleep(1.2)  # the summary line of the last second
            finally:
                driver.stop()
                thread.join()
        real = [at for at, message in lines.lines if "request timed out: GET /real" in message]
        return {
            "forged": forged,
            "ahead_ms": ahead_ms,
            "real_logged_ms": (real[0] - due) / 1e6 if real else None,
            "all_refused_ms": (last_refused - due) / 1e6,
            "refused": handler.refused,
            "lines": len(lines.lines),
        }
    finally:
        log.removeHandler(lines)
        for proc in (stranger, worker, forger):
            if proc is not None:
                proc.kill()
                proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forged", type=int, default=100_000, help="forged timers due with the real one")
    parser.add_argument("--ahead", type=float, default=0.0, metavar="MS", help="forged ones due MS before the real one")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each (default 3)")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    args = parser.parse_args()
    logging.getLogger("shmwheel.timeouts").propagate = False  # the lines are counted, not shown
    segs = Segments("shmwheel-bench-flood")
    results = []
    with scratch(segs):
        for n in range(args.repeat):
            for forged in (0, args.forged):
                progress(f"run {n + 1}: {forged} forged timers")
                results.append(one_run(segs, forged, args.ahead))
    print("| forged | due before the real one (ms) | real timeout logged (ms after due) | last forged refused (ms) "
          "| refused | lines |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for r in results:
        real = "never" if r["real_logged_ms"] is None else f"{r['real_logged_ms']:.1f}"
        cells = (r["forged"], f"{r['ahead_ms']:g}", real, f"{r['all_refused_ms']:.1f}", r["refused"], r["lines"])
        print("| " + " | ".join(str(cell) for cell in cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(strict_json(results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
