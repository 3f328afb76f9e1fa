#!/usr/bin/env python3
"""A flood of forged timers: how late a real request's timeout is logged.

Whoever can write a request wheel can fill it with timers whose records
name processes the driver may not signal.  The request-timeout driver
refuses each (TimeoutHandler.refused) and says so in two lines a second;
what this measures is what the flood costs the real timeouts due at the
same moment.

A wheel with a 1 ms tick; a worker process (a RequestTimer on the wheel)
starts one request whose timeout falls at a fixed moment D; ``--forged``
timers (100,000) due at D too, half added before the worker's, half after,
each naming a live process that is attached to no wheel and added by this
one (a forgery through the API); a Driver with the TimeoutHandler in this
process.  Reported, from D: when the handler logged the real request's
"request timed out" line, when it had refused the last forged timer, and
how many lines it logged in all.  The same run with no forged timers
first, as the baseline: compare the two, not figures from another day.

Every segment is removed however the run ends.

Usage::

    python bench/flood.py [--forged N] [--repeat N] [--json FILE]
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
from shmwheel.contrib.timeouts import (  # noqa: E402
    KIND_REQUEST,
    PAYLOAD_SIZE,
    TimeoutActions,
    TimeoutHandler,
    encode_request,
)

WORKER = """
import sys, time
from shmwheel.contrib.timeouts import RequestTimer
name, due_ns = sys.argv[1], int(sys.argv[2])
timer = RequestTimer(name, (due_ns - time.monotonic_ns()) / 1e9)
assert timer.start("GET", "/real", "real") is not None
print("started", flush=True)
time.sleep(60)
"""


class Lines(logging.Handler):
    """The handler's log lines, each with when it was written."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.monotonic_ns(), record.getMessage()))


def add_forged(wheel: shmwheel.Wheel, due_ns: int, record: bytes, n: int) -> None:
    """``n`` timers of ``record`` due at ``due_ns``, in chunks of one call into C each."""
    for first in range(0, n, 10_000):
        k = min(10_000, n - first)
        wheel.add_many([(due_ns - time.monotonic_ns()) / 1e9] * k, [record] * k)


def one_run(segs: Segments, forged: int) -> dict[str, Any]:
    stranger = subprocess.Popen(["sleep", "600"])
    worker: subprocess.Popen[str] | None = None
    lines = Lines()
    log = logging.getLogger("shmwheel.timeouts")
    log.addHandler(lines)
    try:
        start = start_time(stranger.pid)
        assert start is not None
        with segs.wheel(capacity=1 << 18, payload_size=PAYLOAD_SIZE, tick=0.001) as wheel:
            due = time.monotonic_ns() + 3_000_000_000
            record = encode_request(KIND_REQUEST, stranger.pid, start, time.monotonic_ns(), "GET", "forged", "/x")
            add_forged(wheel, due, record, forged // 2)
            worker = subprocess.Popen([sys.executable, "-c", WORKER, wheel.name, str(due)],
                                      stdout=subprocess.PIPE, text=True)  # fmt: skip
            assert worker.stdout is not None and worker.stdout.readline() == "started\n"
            add_forged(wheel, due, record, forged - forged // 2)
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
            "real_logged_ms": (real[0] - due) / 1e6 if real else None,
            "all_refused_ms": (last_refused - due) / 1e6,
            "refused": handler.refused,
            "lines": len(lines.lines),
        }
    finally:
        log.removeHandler(lines)
        for proc in (stranger, worker):
            if proc is not None:
                proc.kill()
                proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forged", type=int, default=100_000, help="forged timers due with the real one")
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
                results.append(one_run(segs, forged))
    print("| forged | real timeout logged (ms after due) | last forged refused (ms) | refused | lines |")
    print("|---|---|---|---|---|")
    for r in results:
        real = "never" if r["real_logged_ms"] is None else f"{r['real_logged_ms']:.1f}"
        print(f"| {r['forged']} | {real} | {r['all_refused_ms']:.1f} | {r['refused']} | {r['lines']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(strict_json(results), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
