"""The ``shmwheel`` command line (``python -m shmwheel``)."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Sequence

from ._errors import ShmwheelError
from ._wheel import Wheel, create, unlink

__all__ = ["main"]


def _request_worker(wheel: Wheel, seed: int, until: float) -> None:
    """A stand-in for a web worker: every request runs under its own timeout."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
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


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)  # unwinds through the finally blocks that clean up


def _demo(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    name = f"shmwheel-demo-{os.getpid()}"
    wheel = create(name, capacity=10_000, tick=0.001, payload_size=64)
    print(f"created wheel {name!r} in /dev/shm: capacity 10000, tick 1 ms, {wheel.levels} levels")
    print(f"{args.workers} worker processes run requests under per-request timeouts for {args.duration:g} s;")
    print("this process polls the wheel every tick and prints each timeout as it fires:\n")
    until = time.monotonic() + args.duration
    workers = [
        mp.Process(target=_request_worker, args=(wheel, seed, until), daemon=True) for seed in range(args.workers)
    ]
    lateness: list[float] = []
    try:
        for p in workers:
            p.start()
        while any(p.is_alive() for p in workers) or len(wheel):
            for fire in wheel.poll():
                lateness.append(fire.lateness)
                print(
                    f"  {fire.fired_at:12.3f}  timeout  {fire.payload.decode()}"
                    f"  (fired {fire.lateness * 1000:.2f} ms after its deadline)",
                    flush=True,
                )
            time.sleep(wheel.tick / 2)
            if time.monotonic() > until + 5:
                break
    except KeyboardInterrupt:
        print("\ninterrupted")
    finally:
        for p in workers:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
        st = wheel.stats()
        wheel.close()
        unlink(name)
    print(f"\n{st.added} timers added, {st.cancelled} cancelled by finished requests, {st.fired} fired")
    if lateness:
        ms = sorted(x * 1000 for x in lateness)
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        print(f"lateness: median {statistics.median(ms):.2f} ms, p99 {p99:.2f} ms, max {ms[-1]:.2f} ms")
    print(f"removed {name!r} from /dev/shm")
    return 0


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmwheel", description="A timing wheel in POSIX shared memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser("demo", help="run worker processes with per-request timeouts and show the fires")
    demo.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    demo.add_argument("--duration", type=_positive, default=5.0, help="seconds to run (default 5)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ShmwheelError, OSError, ValueError) as exc:
        print(f"shmwheel: {exc}", file=sys.stderr)
        return 1
