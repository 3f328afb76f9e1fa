#!/usr/bin/env python3
"""Interrupting timed-out requests: how late the 504 comes, what the
request's siblings see, and what a request pays for the stages.

What it measures:

1. **Deadline to 504**, per worker model, with real servers on loopback:
   a request stuck past its timeout ``T`` is ended where it runs
   (``interrupt=True``) and answered ``504 Gateway Timeout``.  Measured by
   the client: the arrival of the answer's first byte minus (the moment
   the request was sent + ``T``).  So it holds everything on the way: the
   request reaching the worker, the driver's tick and its signal, the
   worker's reporter thread writing the request's stack (the default) and
   raising the interrupt, the request unwinding, the 504 going out.  The
   models:

   * ``gthread-spin``: Gunicorn's gthread worker (one worker, 8 threads),
     ``install(globals(), timeout=T, interrupt=True)`` in its config file,
     a plain WSGI application whose request thread is stuck in a Python
     loop: ``RequestTimeout`` raised in that thread;
   * ``asgi-sleep``: Uvicorn (one process) serving
     ``shmwheel.contrib.asgi.TimeoutMiddleware(app, T, interrupt=True)``,
     the request's task in ``await asyncio.sleep``: the task is cancelled;
   * ``asgi-spin``: the same server, an ``async def`` endpoint stuck in a
     CPU loop that never awaits (it blocks the event loop): the exception
     is raised in the loop's thread, into the task's step;
   * ``gevent-sleep``: Gunicorn's gevent worker, a greenlet in a
     monkey-patched ``time.sleep``: ``RequestTimeout`` thrown into it from
     its hub;
   * ``gevent-spin``: the same worker, a greenlet in a CPU loop, which
     keeps the hub: raised in its thread;
   * ``gthread-sleep``, only when ``--models`` names it: the limit of the
     thread model.  A thread in a C call (``time.sleep``, a blocking
     ``recv``) sees the exception only once the call returns, here 3 s
     after the deadline: its 504 comes then, and the driver logs that the
     request has not ended ``interrupt_grace`` after its interrupt.

   Several stuck requests are in flight at once where the worker can run
   them side by side (gthread, an awaiting task, a waiting greenlet); one
   at a time where a stuck request blocks the whole worker (the two CPU
   loops), since a second one would not even start before the first had
   ended, and its lateness would be the first one's.
2. **The siblings**: while the stuck requests are being interrupted, a
   separate process sends a steady stream of fast requests (``GET /``,
   one every 10 ms, a new connection each) to the same worker.  Every one
   must be answered 200, by the same worker process (none is killed: kill
   is off); where the stuck request blocks the worker, they wait for it,
   and their latency shows it.
3. **At the deadline**: on each server, after the siblings' stream, requests
   whose work lasts about their timeout (T +- 5 ms), and how each ended: a
   whole 200 (it ended first), a 504 (the interrupt reached it in the
   application), or a 200 cut short: the interrupt reached it while the
   server wrote its response, whose status line had gone, and the server
   closed the connection (as documented: "its connection closed if its
   response has started").  Reported, not judged.
4. **What a request pays**, in this process, cases interleaved in each
   round (the median of the rounds is reported): ``RequestTimer.start`` +
   ``finish`` with the defaults (today's path), with ``warn_after`` and
   ``interrupt=True``, and with routes too; the WSGI
   ``TimeoutMiddleware`` (call, iterate, close) with and without
   ``interrupt=True``, net of the bare application; and a ``setitimer``
   set-and-clear pair, the cost of a per-process alarm, as a reference.

Exit status 1 if a stuck request did not get its 504 or a sibling did not
get its 200.  Every server runs in a process group of its own; the servers,
their drivers and their wheels are removed however the benchmark ends
(Ctrl-C, SIGTERM, an error), and so is the wheel of section 4.

Usage::

    python bench/interrupt.py [--quick] [--json FILE] [--timeout S] [--samples N] [--models A,B]
                              [--inflight N] [--logs DIR] [--no-servers | --no-cost]

A full run takes about four minutes, ``--quick`` about half a minute.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import importlib.metadata
import json
import math
import multiprocessing
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from _common import SHM_DIR, CpuMeter, Segments, distribution_ms, progress, scratch, strict_json, terminate
from _machine import machine_info

import shmwheel
from shmwheel.contrib import RequestTimer
from shmwheel.contrib.wsgi import TimeoutMiddleware

BIN = os.path.dirname(sys.executable)  # gunicorn and uvicorn of this environment
READY_TIMEOUT = 60.0  # s: a server to answer its first request
STOP_TIMEOUT = 15.0  # s: a server's graceful stop
STUCK_EXTRA = 3.0  # s: a stuck request lasts T + this, unless it is interrupted
SIBLING_INTERVAL = 0.010  # s between the starts of two sibling requests
SIBLING_TIMEOUT = 30.0  # s: a sibling that waits this long is dropped
APP_MODULE = "interrupt_apps"

# The application every server serves, written into the scratch directory.
APPS = '''\
"""The benchmark's applications: GET / answers at once with the worker's
pid; /spin?s=N is stuck in a Python loop, /sleep?s=N in time.sleep (a
monkey-patched one under gevent) or, in the ASGI app, await asyncio.sleep."""

import asyncio
import os
import time
from urllib.parse import parse_qs


def seconds(query):
    return float(parse_qs(query).get("s", ["0"])[0])


def spin(s):
    until = time.monotonic() + s
    while time.monotonic() < until:
        pass


def app(environ, start_response):
    path = environ.get("PATH_INFO", "/")
    if path == "/spin":
        spin(seconds(environ.get("QUERY_STRING", "")))
    elif path == "/sleep":
        time.sleep(seconds(environ.get("QUERY_STRING", "")))
    body = f"ok {os.getpid()}\\n".encode()
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]


async def bare_asgi(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    path = scope["path"]
    if path == "/spin":
        spin(seconds(scope["query_string"].decode()))
    elif path == "/sleep":
        await asyncio.sleep(seconds(scope["query_string"].decode()))
    body = f"ok {os.getpid()}\\n".encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


if os.environ.get("BENCH_TIMEOUT"):
    from shmwheel.contrib.asgi import TimeoutMiddleware

    asgi_app = TimeoutMiddleware(bare_asgi, float(os.environ["BENCH_TIMEOUT"]), interrupt=True)
'''

GUNICORN_CONFIG = """\
from shmwheel.contrib import gunicorn as shmwheel_gunicorn

shmwheel_gunicorn.install(globals(), timeout={timeout!r}, interrupt=True)
"""


# -- configuration ---------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    name: str
    samples: int  # stuck requests per model
    timeout: float  # T, s
    edge: int  # requests that end about at their deadline, per model
    rounds: int  # interleaved rounds of section 4
    loops: int  # requests per case and round in section 4


FULL = Config("full", samples=200, timeout=0.2, edge=100, rounds=31, loops=5_000)
QUICK = Config("quick", samples=8, timeout=0.2, edge=8, rounds=5, loops=2_000)


@dataclass(frozen=True)
class Model:
    name: str
    server: str  # gthread, gevent, uvicorn
    path: str  # /spin or /sleep
    inflight: int  # stuck requests in flight at once
    how: str  # how the request is ended, for the table
    default: bool = True  # run unless --models names others


MODELS = (
    Model("gthread-spin", "gthread", "/spin", 4, "RequestTimeout raised in the request's thread"),
    Model("asgi-sleep", "uvicorn", "/sleep", 4, "the task cancelled (CancelledError)"),
    Model("asgi-spin", "uvicorn", "/spin", 1, "RequestTimeout raised in the loop thread, in the task's step"),
    Model("gevent-sleep", "gevent", "/sleep", 4, "RequestTimeout thrown into the greenlet from its hub"),
    Model("gevent-spin", "gevent", "/spin", 1, "RequestTimeout raised in the thread the greenlet runs in"),
    # The limit, on request only: a thread in a C call sees the exception
    # when the call returns, here STUCK_EXTRA s after its deadline.
    Model("gthread-sleep", "gthread", "/sleep", 2, "RequestTimeout raised once time.sleep returns", default=False),
)


# -- a client on a raw socket ------------------------------------------------------


def request(port: int, path: str, timeout: float) -> tuple[int, float, float, bytes]:
    """GET ``path`` on a new connection: (status, sent, answered, body), the
    times on ``time.monotonic()``, ``answered`` at the answer's first byte;
    status 0 if the connection broke or timed out."""
    sent = nan = float("nan")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            data = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
            sent = time.monotonic()
            sock.sendall(data)
            chunk = sock.recv(65536)
            answered = time.monotonic()
            buf = chunk
            while chunk:
                chunk = sock.recv(65536)
                buf += chunk
    except OSError:
        return 0, sent, nan, b""
    head, _, body = buf.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    status = int(parts[1]) if len(parts) > 1 and head.startswith(b"HTTP/") and parts[1].isdigit() else 0
    return status, sent, answered, body


def sibling_stream(port: int, stop: Any, results: Any) -> None:
    """Fast requests to ``port`` every SIBLING_INTERVAL until ``stop`` is
    set; puts (status counts, latencies in ns, pids that answered)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops it
    counts: collections.Counter[int] = collections.Counter()
    latencies: list[int] = []
    pids: set[str] = set()
    next_at = time.monotonic()
    while not stop.is_set():
        status, sent, answered, body = request(port, "/", SIBLING_TIMEOUT)
        counts[status] += 1
        if status == 200:
            latencies.append(round((answered - sent) * 1e9))
            pids.add(body.decode(errors="replace").split()[-1])
        next_at += SIBLING_INTERVAL
        pause = next_at - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            next_at = time.monotonic()
    results.put((dict(counts), latencies, sorted(pids)))


# -- servers -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: str
    wheel: str  # the wheel the server makes: gunicorn-<master pid>, asgi-<pid>

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def log(self) -> str:
        return self.log_tail(10**9)


class Servers:
    """Starts servers, each in a session of its own, and stops them, their
    drivers and their wheels however the benchmark ends."""

    def __init__(self, tmp: str, logs: str | None = None) -> None:
        self.tmp = tmp
        self.logs = logs or tmp  # where the servers' logs go
        self.running: list[Server] = []
        with open(os.path.join(tmp, f"{APP_MODULE}.py"), "w", encoding="utf-8") as f:
            f.write(APPS)

    def command(self, kind: str, port: int, timeout: float) -> tuple[list[str], dict[str, str], str]:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("BENCH_TIMEOUT", None)
        if kind == "uvicorn":
            env["BENCH_TIMEOUT"] = repr(timeout)
            cmd = [
                os.path.join(BIN, "uvicorn"), f"{APP_MODULE}:asgi_app", "--app-dir", self.tmp,
                "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--lifespan", "on",
                "--timeout-graceful-shutdown", "5",
            ]  # fmt: skip
            return cmd, env, "asgi"
        config = os.path.join(self.tmp, "gunicorn.conf.py")
        with open(config, "w", encoding="utf-8") as f:
            f.write(GUNICORN_CONFIG.format(timeout=timeout))
        workers = ["--threads", "8"] if kind == "gthread" else ["--worker-connections", "1000"]
        cmd = [
            os.path.join(BIN, "gunicorn"), "-c", config, "--bind", f"127.0.0.1:{port}", "--worker-class", kind,
            "--workers", "1", *workers, "--graceful-timeout", "5", "--chdir", self.tmp, "--no-control-socket",
            f"{APP_MODULE}:app",
        ]  # fmt: skip
        return cmd, env, "gunicorn"

    def start(self, kind: str, timeout: float) -> Server:
        for attempt in range(3):  # a port taken between free_port() and the bind: another one
            port = free_port()
            cmd, env, prefix = self.command(kind, port, timeout)
            log_path = os.path.join(self.logs, f"{kind}-{time.strftime('%H%M%S')}-{attempt}.log")
            with open(log_path, "wb") as out:
                proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                    cwd=self.tmp, start_new_session=True,
                )  # fmt: skip
            server = Server(proc, port, log_path, f"{prefix}-{proc.pid}")
            self.running.append(server)
            give_up = time.monotonic() + READY_TIMEOUT
            while proc.poll() is None and time.monotonic() < give_up:
                if request(port, "/", 2.0)[0] == 200:
                    return server
                time.sleep(0.1)
            tail = server.log_tail()
            self.stop(server)
            if "Address already in use" not in tail:
                raise RuntimeError(f"{kind} did not come up:\n{tail}")
        raise RuntimeError(f"{kind} found no free port")

    def stop(self, server: Server) -> None:
        """SIGTERM (a graceful stop, which removes the wheel), SIGKILL to the
        group after STOP_TIMEOUT; then the driver, if it outlived it, and the wheel."""
        proc = server.proc
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of its group: workers
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT)
        remove_wheel(server.wheel)
        if server in self.running:
            self.running.remove(server)

    def cleanup(self) -> None:
        for server in list(self.running):
            self.stop(server)


def remove_wheel(name: str) -> None:
    """Once its server has gone: a server's driver removes its wheel (the
    ASGI one two seconds after its last user); if it has not within a few
    seconds, end that driver (it runs in a session of its own) and remove it."""
    path = os.path.join(SHM_DIR, name)
    give_up = time.monotonic() + 6.0
    while os.path.exists(path) and time.monotonic() < give_up:
        time.sleep(0.1)
    if not os.path.exists(path):
        return
    with contextlib.suppress(shmwheel.ShmwheelError, OSError):
        with shmwheel.attach(name) as wheel:
            pid = wheel.stats().driver_pid
        if pid and _is_driver_of(pid, name):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(shmwheel.SegmentNotFoundError):
        shmwheel.unlink(name)


def _is_driver_of(pid: int, name: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return name.encode() in argv and any(b"shmwheel" in a for a in argv)


# -- 1 and 2: deadline to 504, and the siblings ---------------------------------------


@dataclass
class ModelResult:
    model: str
    server: str
    how: str
    inflight: int
    samples: int
    got_504: int
    other: dict[str, int]  # statuses other than 504 (0: a broken connection), how many
    late_ms: dict[str, float]  # deadline to 504: p50, p99, p99.9, max
    siblings: int
    siblings_not_200: dict[str, int]
    sibling_ms: dict[str, float]
    sibling_pids: list[str]
    driver_ms: dict[str, float]  # from the driver's log: deadline to its signal ("running for" - T)
    ended_ms: dict[str, float]  # from the driver's log: its signal to the worker's word that the request ended
    interrupt_lines: int  # "interrupting ..." lines in the server's log
    not_ended_lines: int  # "... has not ended ... after it was interrupted"
    edge: dict[str, int]  # how the requests that end about at their deadline ended
    busy: float  # the whole machine while the stuck requests ran: CPU busy, of all its CPUs
    stolen: float  # and the share the hypervisor gave to others
    seconds: float
    late_ns: list[int] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.got_504 == self.samples and not self.siblings_not_200 and self.siblings > 0


# The driver's lines, in the server's log: the stuck request's timeout, and
# the worker's word, through the wheel, that the request has ended.
DRIVER_LINE = re.compile(r"request timed out: GET /(?:spin|sleep) \(.*\), running for (\d+\.\d+) s")
ENDED_LINE = re.compile(r"GET /(?:spin|sleep) \(.*\) ended (\d+\.\d+) s after it was interrupted")
WARM_UP = 2  # stuck requests before the measured ones, one at a time


def from_log(line: re.Pattern[str], log: str, minus: float = 0.0) -> list[int]:
    """The seconds each match of ``line`` in ``log`` gives, less ``minus``, in
    ns, but for the warm-up's (the first ones: the warm-up runs alone, first)."""
    return [round((float(m) - minus) * 1e9) for m in line.findall(log)[WARM_UP:]]


def stuck_requests(port: int, path: str, timeout: float, count: int, inflight: int) -> list[tuple[int, int]]:
    """``count`` stuck requests, ``inflight`` at a time: (status, lateness in ns) each."""
    query = f"{path}?s={timeout + STUCK_EXTRA:g}"
    per = [count // inflight + (i < count % inflight) for i in range(inflight)]

    abort = threading.Event()  # the benchmark is being stopped: no more requests

    def one_client(index: int, n: int) -> list[tuple[int, int]]:
        abort.wait(index * timeout / inflight)  # spread: not every deadline in the same tick
        out = []
        for _ in range(n):
            if abort.is_set():
                break
            status, sent, answered, _ = request(port, query, timeout + STUCK_EXTRA + 15.0)
            late = round((answered - sent - timeout) * 1e9) if status else 0
            out.append((status, late))
        return out

    pool = ThreadPoolExecutor(inflight)
    try:
        futures = [pool.submit(one_client, i, n) for i, n in enumerate(per) if n]
        return [r for f in futures for r in f.result()]
    finally:
        # On Ctrl-C or SIGTERM, return at once: the server is stopped next,
        # which ends the requests the clients wait for.
        abort.set()
        pool.shutdown(wait=False, cancel_futures=True)


EDGE_MS = 5.0  # the edge requests' work lasts T +- this


def edge_requests(port: int, path: str, timeout: float, count: int, inflight: int) -> dict[str, int]:
    """``count`` requests whose work lasts about their timeout (T +- EDGE_MS,
    uniformly), ``inflight`` at a time: how each ended.  One that ends just
    before its deadline is answered 200; one the interrupt reaches in the
    application, 504; one it reaches while the server writes the response,
    which has started, is cut short (its status line and headers, then a
    closed connection), as the middlewares' documentation says."""
    rng = random.Random(1)
    queries = [f"{path}?s={timeout + rng.uniform(-EDGE_MS, EDGE_MS) / 1e3:.4f}" for _ in range(count)]
    outcomes: collections.Counter[str] = collections.Counter()

    def one_client(part: list[str]) -> None:
        for query in part:
            status, _, _, body = request(port, query, timeout + STUCK_EXTRA + 15.0)
            if status == 200:
                outcomes["200" if body.startswith(b"ok ") else "200 cut short"] += 1
            else:
                outcomes[str(status) if status else "broken"] += 1

    with ThreadPoolExecutor(inflight) as pool:
        list(pool.map(one_client, [queries[i::inflight] for i in range(inflight)]))
    return dict(outcomes)


def run_model(model: Model, cfg: Config, servers: Servers, ctx: Any) -> ModelResult:
    started = time.monotonic()
    server = servers.start(model.server, cfg.timeout)
    try:
        # Warm-up, not counted: the first interrupt of a worker imports and sets up what later ones reuse.
        for status, _ in stuck_requests(server.port, model.path, cfg.timeout, WARM_UP, 1):
            if status != 504:
                raise RuntimeError(f"{model.name}: the warm-up got {status}, not 504:\n{server.log_tail()}")
        stop, results = ctx.Event(), ctx.Queue()
        stream = ctx.Process(target=sibling_stream, args=(server.port, stop, results), daemon=True)
        stream.start()
        try:
            time.sleep(0.2)
            meter = CpuMeter({})
            meter.start()
            got = stuck_requests(server.port, model.path, cfg.timeout, cfg.samples, model.inflight)
            cpu = meter.stop()
            time.sleep(0.2)
        finally:
            stop.set()
            try:
                counts, sibling_ns, pids = results.get(timeout=SIBLING_TIMEOUT + 10)
            finally:
                stream.join(10)
                if stream.is_alive():
                    stream.kill()
        time.sleep(0.3)  # the driver's last lines about the stuck requests
        log = server.log()  # theirs only: the edge requests' lines would mix with them
        edge = edge_requests(server.port, model.path, cfg.timeout, cfg.edge, model.inflight)
    finally:
        servers.stop(server)
    late = [ns for status, ns in got if status == 504]
    other = collections.Counter(str(status) for status, _ in got if status != 504)
    return ModelResult(
        model=model.name,
        server=model.server,
        how=model.how,
        inflight=model.inflight,
        samples=len(got),
        got_504=len(late),
        other=dict(other),
        late_ms=distribution_ms(late),
        siblings=sum(counts.values()),
        siblings_not_200={str(k): v for k, v in counts.items() if k != 200},
        sibling_ms=distribution_ms(sibling_ns),
        sibling_pids=pids,
        driver_ms=distribution_ms(from_log(DRIVER_LINE, log, cfg.timeout)),
        ended_ms=distribution_ms(from_log(ENDED_LINE, log)),
        interrupt_lines=log.count("shmwheel: interrupting "),
        not_ended_lines=log.count("after it was interrupted: it is in a C call"),
        edge=edge,
        busy=cpu.busy / cpu.capacity if cpu.capacity else math.nan,
        stolen=cpu.steal / cpu.capacity if cpu.capacity else math.nan,
        seconds=time.monotonic() - started,
        late_ns=late,
    )


# -- 4: what a request pays ----------------------------------------------------------------

# The calling thread's CPU time: what a request costs the worker, without
# the time this thread spends descheduled, which on a shared machine is most
# of the noise of a wall clock.  The loops make no system call that blocks.
CLOCK = time.thread_time_ns
ROUTES = {"/upload": 300.0, "POST /api/": 60.0, "/health": None, "/reports/": 120.0}
METHOD, PATH = "GET", "/items/42"  # matches no route: the default timeout, after every prefix is tried
ENVIRON = {"REQUEST_METHOD": METHOD, "SCRIPT_NAME": "", "PATH_INFO": PATH, "QUERY_STRING": ""}
HEADERS = [("Content-Type", "text/plain"), ("Content-Length", "3")]


def bare_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", HEADERS)
    return [b"ok\n"]


def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
    return _write


def _write(data: bytes) -> None:
    pass


def loop_empty(n: int) -> int:
    t0 = CLOCK()
    for _ in range(n):
        pass
    return CLOCK() - t0


def loop_setitimer(n: int) -> int:
    setitimer, real = signal.setitimer, signal.ITIMER_REAL
    t0 = CLOCK()
    for _ in range(n):
        setitimer(real, 30.0)
        setitimer(real, 0)
    return CLOCK() - t0


def loop_timer(timer: RequestTimer) -> Callable[[int], int]:
    def run(n: int) -> int:
        start, finish = timer.start, timer.finish
        t0 = CLOCK()
        for _ in range(n):
            finish(start(METHOD, PATH))
        return CLOCK() - t0

    return run


def loop_wsgi(app: Callable[..., Any]) -> Callable[[int], int]:
    def run(n: int) -> int:
        environ = dict(ENVIRON)
        t0 = CLOCK()
        for _ in range(n):  # what a WSGI server does with each request
            body = app(environ, start_response)
            for _chunk in body:
                pass
            close = getattr(body, "close", None)
            if close is not None:
                close()
        return CLOCK() - t0

    return run


@dataclass
class CostRow:
    key: str
    label: str
    ns: float  # median of the rounds, ns a request
    net: float | None = None  # median of the rounds of (this - base)
    net_label: str = ""
    over: float | None = None  # median of the rounds of (this - today's path)
    rounds: list[float] = field(default_factory=list)


def stage_costs(cfg: Config, segs: Segments) -> list[CostRow]:
    from shmwheel.contrib._record import PAYLOAD_SIZE

    with segs.wheel(capacity=4096, payload_size=PAYLOAD_SIZE) as wheel:
        name = wheel.name
        stages = {"warn_after": 10.0, "interrupt": True}
        cases: dict[str, Callable[[int], int]] = {
            "empty": loop_empty,
            "setitimer": loop_setitimer,
            "timer": loop_timer(RequestTimer(name, 30.0)),
            "timer_stages": loop_timer(RequestTimer(name, 30.0, **stages)),  # type: ignore[arg-type]
            "timer_routes": loop_timer(RequestTimer(name, 30.0, routes=ROUTES, **stages)),  # type: ignore[arg-type]
            "wsgi_bare": loop_wsgi(bare_app),
            "wsgi": loop_wsgi(TimeoutMiddleware(bare_app, name, 30.0)),
            "wsgi_interrupt": loop_wsgi(TimeoutMiddleware(bare_app, name, 30.0, interrupt=True)),
        }
        keys = list(cases)
        for key in keys:  # warm-up: attach, the signal and the reporter thread, caches
            cases[key](max(cfg.loops // 10, 100))
        per: dict[str, list[float]] = {key: [] for key in keys}
        for r in range(cfg.rounds):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]  # each round starts with another case
            for key in order:
                gc.collect()
                gc.disable()
                try:
                    per[key].append(cases[key](cfg.loops) / cfg.loops)
                finally:
                    gc.enable()
            progress(f"cost: round {r + 1} of {cfg.rounds}")
        if len(wheel):
            raise RuntimeError(f"{len(wheel)} timers left pending by the cost loops")

    def med(key: str) -> float:
        return statistics.median(per[key])

    def net(key: str, base: str) -> float:
        return statistics.median(a - b for a, b in zip(per[key], per[base], strict=True))

    labels = {
        "empty": "empty loop (included in every row)",
        "setitimer": "setitimer(ITIMER_REAL) set + clear: a per-process alarm, for reference",
        "timer": "RequestTimer.start + finish, defaults (today's path)",
        "timer_stages": "RequestTimer.start + finish, warn_after + interrupt=True",
        "timer_routes": "the same + routes (4 prefixes, none matching)",
        "wsgi_bare": "bare WSGI app: call, iterate, close",
        "wsgi": "wsgi.TimeoutMiddleware, defaults (today's path)",
        "wsgi_interrupt": "wsgi.TimeoutMiddleware, interrupt=True",
    }
    rows = []
    for key in keys:
        row = CostRow(key, labels[key], med(key), rounds=[round(x, 1) for x in per[key]])
        if key in ("setitimer", "timer", "timer_stages", "timer_routes"):
            row.net, row.net_label = net(key, "empty"), "net of the empty loop"
        if key in ("wsgi", "wsgi_interrupt"):
            row.net, row.net_label = net(key, "wsgi_bare"), "net of the bare app"
        if key in ("timer_stages", "timer_routes"):
            row.over = net(key, "timer")
        if key == "wsgi_interrupt":
            row.over = net(key, "wsgi")
        rows.append(row)
    return rows


# -- report ----------------------------------------------------------------------------------


def fmt_ms(values: dict[str, float], keys: Sequence[str] = ("p50", "p99", "max")) -> str:
    return " / ".join("-" if v != v else f"{v:.1f}" for v in (values[k] for k in keys))


def fmt_counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{n}× {'broken' if s == '0' else s}" for s, n in sorted(counts.items())) or "0"


def report(cfg: Config, machine: dict[str, Any], models: list[ModelResult], costs: list[CostRow]) -> str:
    lines = [
        f"## shmwheel interrupt benchmark ({cfg.name} run)",
        "",
        f"- CPU: {machine['cpu']}, {machine['cpus']} logical CPUs; {machine['os']}",
        f"- {machine['python']}, shmwheel {machine['shmwheel']}, gunicorn {machine['gunicorn']}, "
        f"uvicorn {machine['uvicorn']}, gevent {machine['gevent']}",
    ]
    if models:
        lines += [
            f"- Request timeout T = {cfg.timeout:g} s, interrupt=True, kill off, stacks written (the default); "
            f"one worker per server; lateness = the 504's first byte - (request sent + T), measured by the client",
            f"- Siblings: fast GET / to the same worker every {SIBLING_INTERVAL * 1e3:g} ms from another "
            "process, a new connection each, while the stuck requests are interrupted",
            "- Machine busy / stolen: the CPU time of the whole machine (this benchmark, its servers and whatever "
            "else runs) while the stuck requests ran, and the share the hypervisor gave to other guests, as a "
            "fraction of all its CPUs",
            "",
            "| model | how it is ended | in flight | 504s / stuck requests | deadline → 504 p50 / p99 / max ms "
            "| of which: deadline → driver's signal, p50 / p99 ms | signal → request ended, p50 / p99 ms "
            "| siblings | siblings not 200 | sibling latency p50 / p99 / max ms | worker pids seen "
            "| machine busy / stolen |",
            "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for m in models:
            lines.append(
                f"| {m.model} | {m.how} | {m.inflight} | {m.got_504} / {m.samples}"
                + (f" (other: {fmt_counts(m.other)})" if m.other else "")
                + f" | {fmt_ms(m.late_ms)} | {fmt_ms(m.driver_ms, ('p50', 'p99'))} "
                f"| {fmt_ms(m.ended_ms, ('p50', 'p99'))} | {m.siblings} | {fmt_counts(m.siblings_not_200)} "
                f"| {fmt_ms(m.sibling_ms)} | {len(m.sibling_pids)} | {m.busy:.0%} / {m.stolen:.0%} |"
            )
    if models:
        lines += [
            "",
            f"Requests whose work lasts about their timeout, T ± {EDGE_MS:g} ms (after the siblings' stream): "
            "how they ended",
            "",
            "| model | requests | 200, whole | 504 | 200 cut short (headers, then the connection closed) | other |",
            "|:---|---:|---:|---:|---:|:---|",
        ]
        for m in models:
            e = dict(m.edge)
            whole, gone, cut = e.pop("200", 0), e.pop("504", 0), e.pop("200 cut short", 0)
            other = ", ".join(f"{n}× {k}" for k, n in sorted(e.items())) or "0"
            lines.append(f"| {m.model} | {sum(m.edge.values())} | {whole} | {gone} | {cut} | {other} |")
    if costs:
        lines += [
            "",
            f"What a request pays, in one process: CPU ns a request (the thread's CPU time), median of {cfg.rounds} "
            f"interleaved rounds of {cfg.loops:,} requests per case; the net and over columns are medians of the "
            "rounds' differences.",
            "",
            "| path | ns a request | net | net of | over today's path |",
            "|:---|---:|---:|:---|---:|",
        ]
        for c in costs:
            net = "" if c.net is None else f"{c.net:,.0f}"
            over = "" if c.over is None else f"{c.over:+,.0f}"
            lines.append(f"| {c.label} | {c.ns:,.0f} | {net} | {c.net_label} | {over} |")
    return "\n".join(lines)


def versions() -> dict[str, str]:
    out = {}
    for package in ("gunicorn", "uvicorn", "gevent"):
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "not installed"
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.samples} stuck requests per model, fewer rounds")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE as JSON")
    parser.add_argument("--timeout", type=float, metavar="S", help=f"the request timeout T (default {FULL.timeout:g})")
    parser.add_argument("--samples", type=int, metavar="N", help="stuck requests per model")
    names = [m.name for m in MODELS]
    default = ",".join(m.name for m in MODELS if m.default)
    others = ",".join(m.name for m in MODELS if not m.default)
    parser.add_argument("--models", metavar="A,B", help=f"the models to run (default {default}; also {others})")
    parser.add_argument(
        "--inflight", type=int, metavar="N", help="stuck requests in flight at once, for the models that run several"
    )
    parser.add_argument("--logs", metavar="DIR", help="keep the servers' logs in DIR (default: removed with the rest)")
    parser.add_argument("--no-servers", action="store_true", help="only what a request pays (section 4)")
    parser.add_argument("--no-cost", action="store_true", help="only the servers (sections 1 to 3)")
    args = parser.parse_args(argv)
    if args.models:
        unknown = set(args.models.split(",")) - set(names)
        if unknown:
            parser.error(f"unknown model(s): {', '.join(sorted(unknown))}; known: {', '.join(names)}")
    if args.samples is not None and args.samples < 1:
        parser.error("--samples must be at least 1")
    if args.inflight is not None and args.inflight < 1:
        parser.error("--inflight must be at least 1")
    if args.timeout is not None and not 0.01 <= args.timeout <= 60:
        parser.error("--timeout must be between 0.01 and 60 s")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = QUICK if args.quick else FULL
    changes = {k: v for k, v in (("samples", args.samples), ("timeout", args.timeout)) if v is not None}
    cfg = Config(**{**asdict(cfg), **changes})
    chosen = set(args.models.split(",")) if args.models else {m.name for m in MODELS if m.default}
    models = [] if args.no_servers else [m for m in MODELS if m.name in chosen]
    if args.inflight is not None:
        models = [replace(m, inflight=args.inflight) if m.inflight > 1 else m for m in models]
    signal.signal(signal.SIGTERM, terminate)
    ctx = multiprocessing.get_context("fork")  # the stream starts before this process has any thread

    segs = Segments()
    started = time.monotonic()
    print(f"shmwheel interrupt benchmark, {cfg.name} run:", file=sys.stderr)
    results: list[ModelResult] = []
    costs: list[CostRow] = []
    try:
        with scratch(segs, prefix="shmwheel-bench-interrupt-") as tmp:
            if args.logs:
                os.makedirs(args.logs, exist_ok=True)
            servers = Servers(tmp, args.logs)
            try:
                for model in models:
                    progress(f"{model.name}: {cfg.samples} stuck requests, {model.inflight} in flight")
                    result = run_model(model, cfg, servers, ctx)
                    results.append(result)
                    progress(
                        f"{model.name}: {result.got_504}/{result.samples} 504s, late p50 {result.late_ms['p50']:.1f} "
                        f"ms; siblings {result.siblings}, not 200: {fmt_counts(result.siblings_not_200)} "
                        f"({result.seconds:.0f} s)"
                    )
            finally:
                servers.cleanup()
            if not args.no_cost:
                costs = stage_costs(cfg, segs)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    progress(f"done in {time.monotonic() - started:.0f} s")

    machine = machine_info(**versions())
    print(report(cfg, machine, results, costs))
    failed = [m for m in results if not m.ok]
    for m in failed:
        print(
            f"FAILED {m.model}: {m.got_504}/{m.samples} stuck requests got their 504 (other: {fmt_counts(m.other)}), "
            f"{sum(m.siblings_not_200.values())} of {m.siblings} siblings did not get 200",
            file=sys.stderr,
        )

    if args.json:
        document = {
            "machine": machine,
            "config": asdict(cfg),
            "models": [{k: v for k, v in asdict(m).items() if k != "late_ns"} | {"ok": m.ok} for m in results],
            "costs": [asdict(c) for c in costs],
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(strict_json(document), f, indent=2)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
