"""The demo (``shmwheel demo``): worker processes run requests under
per-request timeouts on one wheel, and its driver, in a process of its own,
prints each timeout as it fires.  The README opens with it.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import sys
import time

from ._driver import start_driver
from ._results import Fire
from ._wheel import Wheel, create, unlink

__all__ = ["demo"]


def _request_worker(wheel: Wheel, seed: int, until: float) -> None:
    """A stand-in for a web worker: every request runs under its own timeout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_OVER_FORK)  # held by the parent while it forked us
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < until:
        n += 1
        limit = rng.choice((0.05, 0.1, 0.2))
        payload = f"pid {os.getpid()} request {n} limit {limit * 1000:.0f} ms".encode()
        with wheel.timeout(limit, payload):
            # Most requests finish well inside their limit; a few hang.
            time.sleep(rng.uniform(0.1, 0.3) if rng.random() < 0.05 else rng.uniform(0, 0.02))
    wheel.close()


def _print_timeout(fire: Fire) -> None:
    """The demo's handler; it runs in the driver process."""
    print(
        f"  {fire.fired_at:12.3f}  timeout  {fire.payload.decode()}"
        f"  (fired {fire.lateness * 1000:.2f} ms after its deadline)",
        flush=True,
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)  # unwinds through the finally blocks that clean up


# The exception a signal handler raises inside os.fork() is raised in the
# fork hooks, which print it as "Exception ignored" and carry on: a Ctrl-C
# there would be lost.  The demo holds these signals while it forks.
_HELD_OVER_FORK = frozenset({signal.SIGINT, signal.SIGTERM})


def demo(workers: int, duration: float) -> int:
    """``shmwheel demo``: ``workers`` processes run requests under
    per-request timeouts for ``duration`` seconds while a driver prints each
    timeout that fires; the wheel is removed at the end.  Returns the exit
    status (130 after Ctrl-C)."""
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    name = f"shmwheel-demo-{os.getpid()}"
    wheel = create(name, capacity=10_000, tick=0.001, payload_size=64)
    print(f"created wheel {name!r} in /dev/shm: capacity 10000, tick 1 ms, {wheel.levels} levels")
    driver = None
    procs: list[mp.Process] = []
    status = 0
    try:
        driver = start_driver(name, _print_timeout)
        print(f"started its driver, pid {driver.pid}")
        print(f"{workers} worker processes run requests under per-request timeouts for {duration:g} s;")
        print("the driver prints each timeout as it fires:\n", flush=True)
        until = time.monotonic() + duration
        signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_OVER_FORK)
        try:
            procs = [
                mp.Process(target=_request_worker, args=(wheel, seed, until), daemon=True) for seed in range(workers)
            ]
            for p in procs:
                p.start()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_OVER_FORK)  # one that came meanwhile lands here
        for p in procs:
            p.join()
        # Let the last timeouts fire and their handlers finish.
        give_up = time.monotonic() + 5
        while (len(wheel) or wheel.stats().in_flight) and time.monotonic() < give_up:
            time.sleep(0.01)
    except KeyboardInterrupt:
        print("\ninterrupted")
        status = 128 + signal.SIGINT  # as the shell reports a command Ctrl-C ended
    finally:
        for p in procs:
            if p.is_alive():  # interrupted: end the requests now, cancelling their timers on the way out
                p.terminate()
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        if driver is not None:
            driver.stop()
        st = wheel.stats()
        wheel.close()
        unlink(name)
    print(f"\n{st.added} timers added, {st.cancelled} cancelled by finished requests, {st.fired} fired")
    print(f"stopped the driver and removed {name!r} from /dev/shm")
    return status
