#!/usr/bin/env python3
"""What a request's timer costs a worker in instructions and cache lines,
counted by cachegrind: figures a noisy machine cannot move.

A server's request meets the timer's code and data cold: between two
requests of a worker its kernel and its own code run for tens of µs and
evict most of what the last one touched.  On a shared machine the CPU time
that costs swings by more than the timer itself (``servers.py`` reads
±10 % between rounds on a bad day); what it is made of does not.  So this
counts it, under valgrind's cachegrind with this machine's L1 and L2 as
one core sees them (32 KiB L1i and L1d, 1 MiB L2), the caches emptied
before every request by a 4 MiB copy, as a server's other work would:

- ``Ir``: instructions a request;
- ``data lines``: data cache lines a request brings in from beyond L2
  (``DLmr + DLmw``: each one an L3 or memory access on this machine);
- ``code lines``: the same for instructions (``ILmr``).

The request is uWSGI's, which has the leanest path of the servers (and so
shows the timer's share best): an environ of 23 fresh strings as uWSGI
builds it, ``wsgi.file_wrapper`` a function, the application called
through ``TimeoutMiddleware.direct()`` as ``request_timeouts`` does, its
body iterated, and ``close`` looked up and called.  ``bare`` is the same
request to the bare application; each build's figures are net of its own
``bare``.  A child runs ``n`` requests and then ``3n``; their difference
over ``2n`` is one request, without the interpreter's start.  The hash
seed and the address layout are fixed, the collector's passes left out
(one lands in one child's requests and not the other's; what a request
adds to them is the objects it tracks, which the counts show), and
RequestTimer's once-a-second look at its wheel put off (under valgrind a
second is a few requests).

Usage::

    python bench/lines.py [--requests N] LABEL=ROOT [LABEL=ROOT ...]

each ROOT a checkout with its extensions built in place (``pip install
-e .``, or the shared objects copied in).  Needs valgrind (Debian:
``apt-get install valgrind``).  Wheels are named ``shmwheel-lines-<pid>``
and unlinked, also on error.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile

CACHES = ["--I1=32768,8,64", "--D1=32768,8,64", "--LL=1048576,16,64"]
EVICT_BYTES = 4 << 20  # four times L2: nothing of the last request is left in it
CASES = ("bare", "direct")
# Addresses laid out alike in every child (util-linux's setarch): with them
# at random, a run's count moves by a couple of hundred instructions a request.
NO_ASLR = ["setarch", "-R"] if shutil.which("setarch") else []

# The environ uWSGI hands a WSGI application for a plain GET from wrk, with
# the values it gives (its keys and strings are made anew for each request).
ENVIRON = {
    "REQUEST_METHOD": "GET", "REQUEST_URI": "/", "PATH_INFO": "/", "QUERY_STRING": "",
    "SERVER_PROTOCOL": "HTTP/1.1", "SCRIPT_NAME": "", "SERVER_NAME": "bench", "SERVER_PORT": "8000",
    "UWSGI_ROUTER": "http", "REMOTE_ADDR": "127.0.0.1", "REMOTE_PORT": "40000", "HTTP_HOST": "127.0.0.1:8000",
    "wsgi.input": None, "wsgi.file_wrapper": None, "wsgi.version": (1, 0), "wsgi.errors": None,
    "wsgi.run_once": False, "wsgi.multithread": False, "wsgi.multiprocess": True, "wsgi.url_scheme": "http",
    "uwsgi.version": b"2.0.28", "uwsgi.node": b"bench", "uwsgi.core": 0,
}  # fmt: skip


def _child(root: str, case: str, n: int) -> None:
    sys.path.insert(0, root)
    import shmwheel
    import shmwheel.contrib._worker as worker
    from shmwheel.contrib.wsgi import TimeoutMiddleware

    assert shmwheel.__file__ is not None and shmwheel.__file__.startswith(root), shmwheel.__file__
    worker.LOOK_INTERVAL_NS = 1 << 62  # the look at the wheel's name: once a second, a few requests here
    name = f"shmwheel-lines-{os.getpid()}"
    wheel = shmwheel.create(name, capacity=4096, payload_size=256)
    try:
        body = b"hello\n"

        def app(environ: dict[str, object], start_response: object) -> list[bytes]:
            start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "6")])  # type: ignore[operator]
            return [body]

        def start_response(status: str, headers: object, exc_info: object = None) -> None:
            pass

        middleware = TimeoutMiddleware(app, name, 30.0, traceback_signal=None)  # no listener thread to count
        assert middleware.timer.prepare()
        call = middleware.direct() if case == "direct" else app
        template = dict(ENVIRON, **{"wsgi.file_wrapper": os.getpid})  # a function, as uWSGI's is
        junk = bytearray(EVICT_BYTES)
        gc.collect()
        gc.disable()  # a collection lands in one child's requests and not the other's: counted apart from them
        for _ in range(n):
            bytes(junk)
            # Fresh strings, as uWSGI's: not the interned ones of this module's constants.
            environ = {"".join((k, "")): "".join((v, "")) if isinstance(v, str) else v for k, v in template.items()}
            result = call(environ, start_response)
            for _chunk in result:
                pass
            if hasattr(result, "close"):  # as uWSGI: looked up, then called
                close = result.close
                close()
    finally:
        wheel.close()
        shmwheel.unlink(name)


def _count(root: str, case: str, n: int, out_dir: str) -> list[int]:
    """Program totals of a child of ``n`` requests: Ir, data lines, code lines."""
    out = os.path.join(out_dir, f"cg-{case}-{n}.out")
    run = subprocess.run(
        NO_ASLR
        + ["valgrind", "--tool=cachegrind", "--cache-sim=yes", *CACHES, f"--cachegrind-out-file={out}"]
        + [sys.executable, __file__, "--child", root, "--case", case, "--requests", str(n)],
        capture_output=True,
        text=True,
        cwd="/",
        env={**os.environ, "PYTHONHASHSEED": "0"},
    )
    if run.returncode != 0:
        tail = [line for line in run.stderr.splitlines() if not line.startswith("==")][-1:] or ["(no output)"]
        sys.exit(f"lines.py: the {case} child of {root} failed (exit {run.returncode}): {tail[0]}")
    with open(out) as f:
        lines = f.read().splitlines()
    events = next(line.split()[1:] for line in lines if line.startswith("events:"))
    totals = [int(v) for v in next(line.split()[1:] for line in lines if line.startswith("summary:"))]
    got = dict(zip(events, totals, strict=True))
    return [got["Ir"], got["DLmr"] + got["DLmw"], got["ILmr"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    ap.add_argument("--requests", type=int, default=100, help="n: the children run n and 3n requests (default 100)")
    ap.add_argument("builds", nargs="*", metavar="LABEL=ROOT")
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.case, args.requests)
        return
    if shutil.which("valgrind") is None:
        sys.exit("lines.py: valgrind is not installed (Debian: apt-get install valgrind)")
    if not args.builds or any(not re.fullmatch(r"[^=]+=.+", b) for b in args.builds):
        ap.error("give one or more builds as LABEL=ROOT")
    n = args.requests
    print("per request, net of the bare application in the same build: instructions, and cache lines from beyond L2")
    print(f"{'build':<10}{'Ir':>9}{'data lines':>12}{'code lines':>12}")
    for label, root in (b.split("=", 1) for b in args.builds):
        root = os.path.abspath(root)
        per: dict[str, list[float]] = {}
        with tempfile.TemporaryDirectory() as tmp:
            for case in CASES:
                low, high = _count(root, case, n, tmp), _count(root, case, 3 * n, tmp)
                per[case] = [(h - lo) / (2 * n) for lo, h in zip(low, high, strict=True)]
                print(f"  {label} {case}: " + " ".join(f"{v:.1f}" for v in per[case]), file=sys.stderr)
        net = [d - b for d, b in zip(per["direct"], per["bare"], strict=True)]
        print(f"{label:<10}{net[0]:>9.0f}{net[1]:>12.1f}{net[2]:>12.1f}")


if __name__ == "__main__":
    main()
