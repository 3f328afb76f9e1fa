#!/usr/bin/env python3
"""The worker's path: what a request's timer costs a worker, next to a
``signal.setitimer`` pair, for one or more builds of the package.

Per request, in ns (wall clock, loop included):

- ``setitimer``: ``setitimer(ITIMER_REAL, 30)`` then ``setitimer(ITIMER_REAL, 0)``;
- ``timer``: ``RequestTimer.start(method, path, request_id)`` then ``finish()``;
- ``wsgi``: a call of ``TimeoutMiddleware`` and ``close()`` of its body, net
  of the same call of the bare application; ``wsgi_direct``: the same
  through ``TimeoutMiddleware.direct()``, as uWSGI calls it;
- ``gunicorn``: the ``pre_request`` and ``post_request`` hooks of
  ``install()`` for a real ``gunicorn.http.Request`` (parsed once), net of
  Gunicorn's default hooks, which they take the place of (``gunicorn_gross``:
  not netted);
- ``asgi``: a request through the ASGI ``TimeoutMiddleware`` (its
  ``http.response.start`` and ``http.response.body``) in a running asyncio
  loop, net of the bare application; ``asgi_interrupt``: the same with
  ``interrupt=True``, which takes the middleware's Python way (the gate
  around the application's code, the held start, the end at the interrupt);
- ``threads``: requests a second with 4 threads doing start+finish at once
  in one process, and the voluntary and involuntary context switches a
  request (getrusage), next to 1 thread in the same process.

``--cold`` times each case as a server meets it: one request at a time,
each after 16 MB copied between two buffers, which leaves none of what
the request touches (code, objects, the segment's lines, their pages'
TLB entries) in this machine's caches; the median of 400 such requests a
case.  A server's request runs a few hundred µs of other code between
two timers, so what it pays lies between the warm figure and this one.

Each build runs in a child process of its own (``--child ROOT``: the
package is imported from ROOT), the builds in turn, ``--rounds`` times;
within a child the cases run round-robin.  The report gives each figure's
median over the rounds and, the figure that survives a noisy machine, its
ratio to the setitimer pair measured in the same child.

Usage::

    python bench/worker_path.py [--rounds N] [--cold] LABEL=ROOT [LABEL=ROOT ...]

A build is a checkout whose extensions are built (pip install -e ., or
the .so files copied in): every build has its C path, shmwheel._fast, which
the figures measure; docs/bench-log.md has the runs of builds before it was
always there, with the cffi path alone beside it.

Every wheel is unlinked, also on error; names ``shmwheel-wpath-<pid>``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

N_PAIRS = 20_000
REPEAT = 7
THREADS = 4
THREAD_SECONDS = 1.0
COLD_SAMPLES = 400
EVICT_BYTES = 16 << 20  # past L2 and this VM's share of L3, and 4096 pages: past every TLB


def _child(root: str, cold: bool) -> None:
    sys.path.insert(0, root)
    import gc
    import signal

    import shmwheel._shmwheel as core

    import shmwheel
    from shmwheel.contrib import gunicorn as contrib_gunicorn
    from shmwheel.contrib._worker import RequestTimer
    from shmwheel.contrib.asgi import TimeoutMiddleware as AsgiMiddleware
    from shmwheel.contrib.wsgi import TimeoutMiddleware

    for module in (shmwheel, core):  # the build asked for, not the editable install's
        assert module.__file__ is not None and module.__file__.startswith(root), module.__file__
    from shmwheel.contrib import _settings

    name = f"shmwheel-wpath-{os.getpid()}"
    # As the servers make it: sharded by the CPUs, where the build shards.
    shards_for = getattr(_settings, "shards_for", None)
    sharded = {} if shards_for is None else {"shards": shards_for(65536)}
    wheel = shmwheel.create(name, capacity=65536, payload_size=256, **sharded)
    try:
        timer = RequestTimer(name, 30.0)
        assert timer.prepare()
        start, finish = timer.start, timer.finish
        setitimer, real = signal.setitimer, signal.ITIMER_REAL
        n = range(1 if cold else N_PAIRS)

        def body(environ: object, start_response: object) -> list[bytes]:
            return [b"ok"]

        mw = TimeoutMiddleware(body, name, 30.0)
        assert mw.timer.prepare()
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/api/v1/items/12345", "HTTP_X_REQUEST_ID": "req-abc-123"}

        def sr(status: str, headers: object) -> None:
            pass

        # A server gives each request an environ of its own; this one is
        # reused, so the key the middleware puts in it goes after each (a
        # middleware finds a request timed already by the key).
        forget, key = environ.pop, "shmwheel.handle"

        def case_setitimer() -> int:
            t = time.perf_counter_ns()
            for _ in n:
                setitimer(real, 30.0)
                setitimer(real, 0)
            return time.perf_counter_ns() - t

        def case_timer() -> int:
            t = time.perf_counter_ns()
            for _ in n:
                finish(start("GET", "/api/v1/items/12345", "req-abc-123"))
            return time.perf_counter_ns() - t

        def case_bare() -> int:
            t = time.perf_counter_ns()
            for _ in n:
                body(environ, sr)
            return time.perf_counter_ns() - t

        def case_wsgi() -> int:
            t = time.perf_counter_ns()
            for _ in n:
                mw(environ, sr).close()
                forget(key, None)
            return time.perf_counter_ns() - t

        direct = mw.direct() if hasattr(mw, "direct") else mw  # an older build: the middleware itself

        def case_wsgi_direct() -> int:
            t = time.perf_counter_ns()
            for _ in n:
                direct(environ, sr).close()
                forget(key, None)
            return time.perf_counter_ns() - t

        # Gunicorn: install()'s hooks, as a worker calls them, beside the defaults they replace.
        import asyncio
        import logging

        from gunicorn.config import Config
        from gunicorn.glogging import Logger
        from gunicorn.http.parser import RequestParser

        cfg = Config()
        raw = b"GET /api/v1/items/12345 HTTP/1.1\r\nHost: localhost\r\nX-Request-Id: req-abc-123\r\n\r\n"
        req = next(iter(RequestParser(cfg, [raw], ("127.0.0.1", 1))))

        class Worker:
            log = Logger(cfg)

        worker = Worker()
        logging.getLogger("gunicorn.error").setLevel(logging.INFO)  # as served: no debug lines
        hooks: dict[str, object] = {}
        contrib_gunicorn.install(hooks, 30.0, name=name)
        contrib_gunicorn._state.timer = contrib_gunicorn._timer(name, contrib_gunicorn._state.settings)
        assert contrib_gunicorn._state.timer.prepare()
        pre, post = hooks["pre_request"], hooks["post_request"]
        default_pre, default_post = cfg.pre_request, cfg.post_request

        def case_gunicorn() -> int:
            t = time.perf_counter_ns()
            for _ in n:
                pre(worker, req)
                post(worker, req, environ, None)
            return time.perf_counter_ns() - t

        def case_gunicorn_bare() -> int:
            t = time.perf_counter_ns()
            for _ in n:
                default_pre(worker, req)
                default_post(worker, req, environ, None)
            return time.perf_counter_ns() - t

        # ASGI: a request of two sends through the middleware, in a running loop.
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": "/api/v1/items/12345", "raw_path": b"/api/v1/items/12345", "query_string": b"",
            "root_path": "", "headers": [(b"host", b"localhost"), (b"x-request-id", b"req-abc-123")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000),
        }  # fmt: skip
        start_message = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        body_message = {"type": "http.response.body", "body": b"ok"}

        async def asgi_app(scope: object, receive: object, send: Any) -> None:
            await send(start_message)
            await send(body_message)

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: object) -> None:
            pass

        amw = AsgiMiddleware(asgi_app, name=name, timeout=30.0)
        amw_interrupt = AsgiMiddleware(asgi_app, name=name, timeout=30.0, interrupt=True)
        loop = asyncio.new_event_loop()

        async def asgi_loop(app: Any) -> int:
            t = time.perf_counter_ns()
            for _ in n:
                await app(scope, receive, send)
            return time.perf_counter_ns() - t

        assert amw.timer.prepare()

        def case_asgi() -> int:
            return loop.run_until_complete(asgi_loop(amw))

        def case_asgi_interrupt() -> int:
            return loop.run_until_complete(asgi_loop(amw_interrupt))

        def case_asgi_bare() -> int:
            return loop.run_until_complete(asgi_loop(asgi_app))

        cases = {
            "setitimer": case_setitimer, "timer": case_timer, "bare": case_bare, "wsgi": case_wsgi,
            "wsgi_direct": case_wsgi_direct,
            "gunicorn_gross": case_gunicorn, "gunicorn_bare": case_gunicorn_bare, "asgi": case_asgi,
            "asgi_interrupt": case_asgi_interrupt, "asgi_bare": case_asgi_bare,
        }  # fmt: skip
        best: dict[str, list[float]] = {k: [] for k in cases}
        for f in cases.values():
            f()  # warm up
        gc.disable()
        if cold:
            src, dst = bytearray(EVICT_BYTES), bytearray(EVICT_BYTES)
            for _ in range(COLD_SAMPLES):
                for k, f in cases.items():
                    dst[:] = src
                    best[k].append(f())
            out = {k: statistics.median(v) for k, v in best.items()}
        else:
            for _ in range(REPEAT):
                for k, f in cases.items():
                    best[k].append(f() / N_PAIRS)
            out = {k: min(v) for k, v in best.items()}
        gc.enable()
        out["wsgi_net"] = out.pop("wsgi") - out["bare"]
        out["wsgi_direct"] -= out["bare"]
        out["gunicorn"] = out["gunicorn_gross"] - out.pop("gunicorn_bare")
        out["asgi_interrupt"] -= out["asgi_bare"]
        out["asgi"] -= out.pop("asgi_bare")
        loop.close()

        def hammer(stop: threading.Event, counts: list[int], k: int) -> None:
            c = 0
            while not stop.is_set():
                for _ in range(100):
                    finish(start("GET", "/api/v1/items/12345", "req-abc-123"))
                c += 100
            counts[k] = c

        for nthreads in (1, THREADS):
            counts = [0] * nthreads
            stop = threading.Event()
            ts = [threading.Thread(target=hammer, args=(stop, counts, k)) for k in range(nthreads)]
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            for th in ts:
                th.start()
            time.sleep(THREAD_SECONDS)
            stop.set()
            for th in ts:
                th.join()
            dt = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            total = sum(counts)
            out[f"t{nthreads}_rps"] = total / dt
            out[f"t{nthreads}_vcsw"] = (r1.ru_nvcsw - r0.ru_nvcsw) / total
            out[f"t{nthreads}_ivcsw"] = (r1.ru_nivcsw - r0.ru_nivcsw) / total
        assert mw.timer is not None  # kept alive to here
        print(json.dumps(out))
    finally:
        wheel.close()
        shmwheel.unlink(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="each request after the caches are emptied")
    ap.add_argument("builds", nargs="*", help="LABEL=ROOT: a checkout with its extensions built")
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.cold)
        return
    builds = [b.split("=", 1) for b in args.builds]
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _ in builds}
    for r in range(args.rounds):
        for label, root in builds:
            cp = subprocess.run(
                [sys.executable, __file__, "--child", os.path.abspath(root)] + (["--cold"] if args.cold else []),
                capture_output=True,
                text=True,
                check=True,
                cwd="/",
            )
            results[label].append(json.loads(cp.stdout))
            print(f"round {r} {label}: {cp.stdout.strip()}", file=sys.stderr)
    paths = ["setitimer", "timer", "wsgi_net", "wsgi_direct", "gunicorn", "gunicorn_gross", "asgi", "asgi_interrupt"]
    print("per request, ns (median of the rounds), and / its ratio to the setitimer pair of the same child")
    print(f"{'build':<8}" + "".join(f"{k:>16}" for k in paths))
    for label, rows in results.items():
        cells = []
        for k in paths:
            ns = statistics.median(row[k] for row in rows)
            ratio = statistics.median(row[k] / row["setitimer"] for row in rows)
            cells.append(f"{ns:>9.0f} / {ratio:4.2f}")
        print(f"{label:<8}" + "".join(f"{c:>16}" for c in cells))
    keys = ["t1_rps", "t4_rps", "t4_vcsw", "t4_ivcsw", "t1_vcsw", "t1_ivcsw"]
    print(f"{'build':<8}" + "".join(f"{k:>11}" for k in keys) + f"{'t4/t1':>8}")
    for label, rows in results.items():
        med = {k: statistics.median(row[k] for row in rows) for k in keys}
        scale = statistics.median(row["t4_rps"] / row["t1_rps"] for row in rows)
        print(f"{label:<8}" + "".join(f"{med[k]:>11.3g}" for k in keys) + f"{scale:>8.2f}")
    # The threads' figures swing between rounds with what else the machine runs: their spread.
    print("4 threads, per build: requests/s and context switches a request (vol+invol), median [min, max]")
    for label, rows in results.items():
        rps = sorted(row["t4_rps"] for row in rows)
        cs = sorted(row["t4_vcsw"] + row["t4_ivcsw"] for row in rows)
        print(
            f"{label:<8}{statistics.median(rps):>11.3g} [{rps[0]:.3g}, {rps[-1]:.3g}]"
            f"{statistics.median(cs):>11.3g} [{cs[0]:.3g}, {cs[-1]:.3g}]"
        )


if __name__ == "__main__":
    main()
