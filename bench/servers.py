#!/usr/bin/env python3
"""What a request timeout costs in real servers, measured with wrk on loopback.

A hello-world application (``_servers_app.py``: ``hello`` and an ``X-Pid``
header, nothing else) runs under four servers, each with its timeouts off
and on and beside the timers those servers offer today:

- Gunicorn ``sync``, 2 workers, and ``gthread``, 2 workers x 4 threads:
  off; shmwheel (``install(globals(), timeout=30)``); a ``setitimer`` pair
  in ``pre_request``/``post_request`` (``signal.setitimer(ITIMER_REAL, 30)``
  then ``0``); a ``faulthandler.dump_traceback_later(30)`` /
  ``cancel_dump_traceback_later()`` pair in the same hooks.  Both pairs are
  process-wide, one timer per process: right for a sync worker, only a
  cost figure under gthread, where a thread's call replaces another's.
  Gunicorn's own ``timeout`` is always on: every worker beats its
  heartbeat (``os.utime`` of a temporary file) each turn of its loop
  whatever the setting (``timeout = 0`` only stops the master from
  looking), so it cannot be measured apart and is in every Gunicorn row,
  "off" included.  It is 60 s here, above the request timeout, as
  ``install()`` asks of sync workers.
- uWSGI (pyuwsgi), 2 processes x 4 threads: off; shmwheel (the driver
  mule, ``shmwheel-timeout = 30`` and ``request_timeouts(application)``);
  ``harakiri = 30``; a ``setitimer`` pair around the application (uWSGI
  has no hooks for it), a cost figure as under gthread.
- Uvicorn ``--workers 2`` (no uvloop or httptools unless installed): off;
  shmwheel (``TimeoutMiddleware(app, timeout=30)``); ``asyncio.timeout(30)``
  around the application (Python 3.11+).

Every timeout is 30 s, so nothing fires: what is measured is the cost of
adding and cancelling a timer with every request.  Access logs are off.

Rounds.  A round runs every variant once, server by server, the servers'
order rotated from round to round.  The variants of one server run side
by side: a server for each, started for the round (wait for ``GET /`` to
answer 200, then a warm-up of wrk), idle while another is measured (a
shmwheel driver idles with its server: its clock sleeps until the
earliest timer).  By default each gets five bursts of ``wrk -t1 -c8 -d1s
--latency`` (``--bursts``, ``--duration``; a Lua script that
counts the responses per ``X-Pid`` and those that are not 2xx), taken in
turn, the order rotated from burst to burst; then every server is stopped
(SIGTERM; SIGINT for uWSGI) and waited for until its processes, its
driver and its wheel are gone.  On this shared machine a server's CPU a
request moves by 10 % from one second to the next and by as much again
over tens of seconds; bursts in turn put each variant beside the same
stretch of the machine as its "off", where runs one after the other (a
server each, 5 s) gave the slow part to whichever ran then.

Reported per run (a variant's bursts of a round, together): requests/s;
latency p50 / p99 (wrk's, over every request of a burst; the median of
the bursts'); the server's CPU time per request (each process's CPU
clock, in ns, over the server's process group, master and workers: a
second's burst is only a hundred clock ticks of ``/proc/<pid>/stat`` a
worker); their context switches per request
(every thread's, voluntary or not, from ``/proc/<pid>/task/*/status``: a
GIL handed between a worker's threads shows there); the shmwheel
driver's apart (found as the wheel's ``driver_pid``: under Gunicorn and
Uvicorn a process in a session of its own, under uWSGI the mule, taken
out of the group's sum), per request and as a share of one CPU; CPU time
stolen by the hypervisor; and how the requests fell on the workers.
wrk's connections stay open (except under sync workers, which close each
one), so whichever worker accepted a connection serves all of its
requests: the kernel may give one worker every connection, and the
other idles.  The table says when it did (in how many runs, one burst
of them at least).  With ``--close`` every
request comes on a connection of its own (wrk sends ``Connection:
close``), as nginx proxies to its upstreams unless told otherwise: the
workers take turns at accepting, and both stay busy.

Summary per variant: medians over the rounds, and each variant's ratios to
its server's "off" in the same round, requests/s and CPU per request
(server plus driver), as median (min-max) over the rounds, and requests/s
again over only the rounds where no burst of either run was served by
one worker alone (how many is said): a worker that got every connection
halves a 2-worker server's throughput whatever the timer.  Below it, the CPU ratio's mean
and standard error over the rounds, to compare variants by.  The machine
is shared and noisy: compare only ratios within one run.

``--build NAME=PATH`` runs every shmwheel variant chosen a second time
with the shmwheel package found in the checkout at PATH (its built
extensions beside its sources) first on ``PYTHONPATH``, as
``SERVER/shmwheel@NAME``, interleaved with the rest: two builds compared
within one run, each against the same round's "off".  Repeat it for more.

``--quick`` is a smoke test for CI (about 20 s): one round of one 1 s
burst of a few variants.  The exit status is 1 if any run had a non-2xx
response, a socket error, no response at all, a server that did not
start, a shmwheel variant without its driver, or left anything in
/dev/shm.  Every server started here is stopped (its whole process
group, and the driver under Uvicorn) however the script ends, Ctrl-C and
SIGTERM included.

Needs wrk (Debian: ``apt-get install wrk``) and the servers of the test
extra (``pip install -e '.[test]'``).

Usage::

    python bench/servers.py [--quick] [--rounds N] [--bursts N] [--duration S] [--connections N] [--close]
                            [--workers N] [--threads N] [--wrk-threads N] [--only REGEX]
                            [--build NAME=PATH]... [--json FILE]

On a machine of many cores, give the servers as many workers as it has
cores to fill (``--workers 12 --threads 4``) and wrk threads enough to
keep them busy (``--wrk-threads 4 --connections 48``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http.client
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _common import SHM_DIR, progress, strict_json, terminate
from _machine import machine_info

import shmwheel
import shmwheel._wheel

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
TIMEOUT = 30.0  # s: every timer's; no hello request comes near it
GUNICORN_TIMEOUT = 60  # s: Gunicorn's own, always on, above the request timeout
WORKERS = 2
THREADS = 4
WRK_THREADS = 1  # on a machine of many cores, one wrk thread cannot keep many workers busy

ROUNDS, QUICK_ROUNDS = 5, 1
DURATION, QUICK_DURATION = 1, 1  # s of wrk a burst (wrk takes whole seconds)
BURSTS, QUICK_BURSTS = 5, 1  # bursts a variant a round
WARMUP = 1  # s of wrk before a server's first burst, not counted
CONNECTIONS = 8  # as many as the gthread and uWSGI workers have threads in all
START_TIMEOUT = 30.0  # s: for the server to answer
STOP_TIMEOUT = 30.0  # s: for it, its driver and its wheel to be gone
LOPSIDED = 0.99  # one worker served at least this share of the requests


@dataclass(frozen=True)
class Variant:
    server: str  # "gunicorn-sync", "gunicorn-gthread", "uwsgi", "uvicorn"
    timer: str  # "off", "shmwheel", ...
    label: str  # what the table calls it
    build: str = ""  # the --build whose shmwheel it runs; "" for this checkout's

    @property
    def key(self) -> str:
        return f"{self.server}/{self.timer}" + (f"@{self.build}" if self.build else "")

    @property
    def shmwheel(self) -> bool:
        return self.timer == "shmwheel"


def server_label(server: str) -> str:
    return {
        "gunicorn-sync": f"Gunicorn sync, {WORKERS} workers",
        "gunicorn-gthread": f"Gunicorn gthread, {WORKERS} x {THREADS} threads",
        "uwsgi": f"uWSGI, {WORKERS} processes x {THREADS} threads",
        "uvicorn": f"Uvicorn, --workers {WORKERS}",
    }[server]


GUNICORN_TIMERS = {
    "off": f"off (Gunicorn's own timeout = {GUNICORN_TIMEOUT} only)",
    "shmwheel": "shmwheel install()",
    "setitimer": "setitimer pair in hooks",
    "faulthandler": "faulthandler dump_traceback_later pair in hooks",
}
VARIANTS = [
    *(
        Variant(server, timer, label)
        for server in ("gunicorn-sync", "gunicorn-gthread")
        for timer, label in GUNICORN_TIMERS.items()
    ),
    Variant("uwsgi", "off", "off"),
    Variant("uwsgi", "shmwheel", "shmwheel mule + request_timeouts"),
    Variant("uwsgi", "harakiri", f"harakiri = {TIMEOUT:g}"),
    Variant("uwsgi", "setitimer", "setitimer pair around the application"),
    Variant("uvicorn", "off", "off"),
    Variant("uvicorn", "shmwheel", "shmwheel TimeoutMiddleware"),
    *([Variant("uvicorn", "asyncio", "asyncio.timeout middleware")] if hasattr(asyncio, "timeout") else []),
]
BUILDS: dict[str, str] = {}  # --build: name, the checkout whose shmwheel its variants run
QUICK_VARIANTS = (
    "gunicorn-sync/off",
    "gunicorn-sync/shmwheel",
    "gunicorn-gthread/shmwheel",
    "uwsgi/shmwheel",
    "uvicorn/shmwheel",
)

# wrk's Lua: responses per X-Pid and those that are not 2xx, per thread,
# gathered in done() with the latency percentiles (microseconds).
WRK_SCRIPT = """
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) pids = {}; non2xx = 0 end
function response(status, headers, body)
  if status < 200 or status > 299 then non2xx = non2xx + 1 end
  local pid = headers["X-Pid"] or headers["x-pid"] or "none"
  pids[pid] = (pids[pid] or 0) + 1
end
function done(summary, latency, requests)
  local bad = 0
  for _, t in ipairs(threads) do
    bad = bad + t:get("non2xx")
    for pid, n in pairs(t:get("pids")) do io.write(string.format("BENCH pid %s %d\\n", pid, n)) end
  end
  local e = summary.errors
  io.write(string.format("BENCH summary %d %d %d %d %d %d %d %d %d %d %d\\n", summary.requests, summary.duration,
    e.connect, e.read, e.write, e.status, e.timeout, bad,
    latency:percentile(50), latency:percentile(99), latency.max))
end
"""
SUMMARY_FIELDS = (
    "requests",
    "duration_us",
    "connect",
    "read",
    "write",
    "status",
    "timeout",
    "non2xx",
    "p50_us",
    "p99_us",
    "max_us",
)


# -- servers -----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def gunicorn_config(variant: Variant, port: int) -> str:
    lines = [
        f"bind = '127.0.0.1:{port}'",
        f"workers = {WORKERS}",
        f"worker_class = '{variant.server.split('-')[1]}'",
        f"threads = {THREADS if variant.server == 'gunicorn-gthread' else 1}",
        f"timeout = {GUNICORN_TIMEOUT}",
        "accesslog = None",
    ]
    if variant.timer == "shmwheel":
        lines += [
            "from shmwheel.contrib import gunicorn as shmwheel_gunicorn",
            f"shmwheel_gunicorn.install(globals(), timeout={TIMEOUT})",
        ]
    elif variant.timer == "setitimer":
        lines += [
            "import signal",
            "def pre_request(worker, req):",
            f"    signal.setitimer(signal.ITIMER_REAL, {TIMEOUT})",
            "def post_request(worker, req, environ, resp):",
            "    signal.setitimer(signal.ITIMER_REAL, 0)",
        ]
    elif variant.timer == "faulthandler":
        lines += [
            "import faulthandler",
            "def pre_request(worker, req):",
            f"    faulthandler.dump_traceback_later({TIMEOUT})",
            "def post_request(worker, req, environ, resp):",
            "    faulthandler.cancel_dump_traceback_later()",
        ]
    return "\n".join(line for line in lines if line) + "\n"


def uwsgi_ini(variant: Variant, port: int) -> str:
    lines = [
        "[uwsgi]",
        "master = true",
        f"processes = {WORKERS}",
        f"threads = {THREADS}",
        f"http11-socket = 127.0.0.1:{port}",  # keep-alive, as the other servers (http-socket closes each connection)
        f"chdir = {HERE}",
        "module = "
        + {"shmwheel": "_servers_uwsgi:application", "setitimer": "_servers_app:setitimer_application"}.get(
            variant.timer, "_servers_app:application"
        ),
        "die-on-term = true",
        "need-app = true",
        "disable-logging = true",
    ]
    if variant.timer == "shmwheel":
        lines += ["mule = shmwheel.contrib.uwsgi:driver", f"shmwheel-timeout = {TIMEOUT:g}"]
    elif variant.timer == "harakiri":
        lines += [f"harakiri = {TIMEOUT:g}"]
    return "\n".join(lines) + "\n"


def command(variant: Variant, port: int, tmp: Path) -> tuple[list[str], str, int]:
    """The server's command line, its wheel's name prefix and its stop signal."""
    if variant.server.startswith("gunicorn"):
        conf = tmp / f"gunicorn-{variant.timer}-{port}.conf.py"
        conf.write_text(gunicorn_config(variant, port))
        cmd = [str(BIN / "gunicorn"), "-c", str(conf), "--chdir", str(HERE), "_servers_app:application"]
        if "--no-control-socket" in subprocess_help("gunicorn"):
            cmd.insert(-1, "--no-control-socket")
        return cmd, "gunicorn", signal.SIGTERM
    if variant.server == "uwsgi":
        ini = tmp / f"uwsgi-{variant.timer}-{port}.ini"
        ini.write_text(uwsgi_ini(variant, port))
        return [str(BIN / "uwsgi"), "--ini", str(ini)], "uwsgi", signal.SIGINT
    app = {"off": "asgi_app", "shmwheel": "asgi_timed", "asyncio": "asgi_asyncio_timeout"}[variant.timer]
    cmd = [
        str(BIN / "uvicorn"),
        f"_servers_app:{app}",
        "--app-dir",
        str(HERE),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        str(WORKERS),
        "--no-access-log",
        "--log-level",
        "warning",
    ]
    return cmd, "asgi", signal.SIGTERM


_help_cache: dict[str, str] = {}


def subprocess_help(program: str) -> str:
    if program not in _help_cache:
        out = subprocess.run([str(BIN / program), "--help"], capture_output=True, text=True, timeout=60)
        _help_cache[program] = out.stdout
    return _help_cache[program]


class ServerFailed(Exception):
    pass


def group_members(pgid: int) -> list[int]:
    """The live (not zombie) processes of a process group."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_bytes().rsplit(b")", 1)[1].split()
            if fields[0] != b"Z" and int(fields[2]) == pgid:
                pids.append(int(stat.parent.name))
    return pids


def run_ns(pid: int) -> int | None:
    """CPU time of a process, its exited threads' included, in ns (its CPU
    clock, clock_gettime's ``(~pid << 3) | 2``); None once it is gone.  A
    second's burst is only a hundred clock ticks of ``/proc/<pid>/stat`` a
    worker, and the driver's a few."""
    try:
        return time.clock_gettime_ns((~pid << 3) | 2)
    except OSError:
        return None


def switches(pid: int) -> int | None:
    """Context switches, voluntary and not, of every thread of a process
    (/proc/<pid>/task/*/status): a GIL handed between a worker's threads
    shows here; None once it is gone."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                for line in (task / "status").read_text().splitlines():
                    if "ctxt_switches:" in line:
                        total += int(line.split()[1])
    except OSError:
        return None
    return total


def alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != b"Z"


def get_status(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


@dataclass
class Server:
    variant: Variant
    proc: subprocess.Popen[bytes]
    port: int
    wheel: str
    stop_signal: int
    log_path: Path
    driver: int | None = None

    def log_tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def find_driver(self) -> int | None:
        """The pid of the driver on the server's wheel, as the wheel names it."""
        give_up = time.monotonic() + START_TIMEOUT
        while time.monotonic() < give_up:
            with contextlib.suppress(shmwheel.ShmwheelError, OSError):
                with shmwheel._wheel.observe(self.wheel) as wheel:
                    pid = wheel.stats().driver_pid
                if pid is not None:
                    return int(pid)
            time.sleep(0.05)
        return None


def wheel_exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


@contextlib.contextmanager
def serve(variant: Variant, tmp: Path, problems: list[str], wheels: list[str]) -> Iterator[Server]:
    """Run the variant's server until the block ends; then stop it and make
    sure its processes, its driver and its wheel are gone (what had to be
    forced goes to ``problems``)."""
    port = free_port()
    cmd, prefix, stop_signal = command(variant, port, tmp)
    log_path = tmp / f"{variant.server}-{variant.timer}{variant.build and '-' + variant.build}-{port}.log"
    env = {**os.environ, "SHMWHEEL_BENCH_TIMEOUT": str(TIMEOUT), "PYTHONUNBUFFERED": "1"}
    if variant.build:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (BUILDS[variant.build], env.get("PYTHONPATH"))))
    if variant.server == "uvicorn":
        env["SHMWHEEL_BENCH_NODELAY"] = "1"  # see _servers_app.py: Uvicorn --workers loses TCP_NODELAY
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=HERE, env=env, start_new_session=True)
    server = Server(variant, proc, port, f"{prefix}-{proc.pid}", stop_signal, log_path)
    wheels.append(server.wheel)
    try:
        give_up = time.monotonic() + START_TIMEOUT
        while get_status(port) != 200:
            if proc.poll() is not None or time.monotonic() > give_up:
                raise ServerFailed(f"{variant.key}: the server did not start:\n{server.log_tail()}")
            time.sleep(0.1)
        if variant.shmwheel:
            server.driver = server.find_driver()
            if server.driver is None:
                raise ServerFailed(f"{variant.key}: no driver on wheel {server.wheel}:\n{server.log_tail()}")
        yield server
    finally:
        stop(server, problems)


def stop(server: Server, problems: list[str]) -> None:
    """Stop the server, with Ctrl-C and SIGTERM held until it is done: a
    second one must not cut the clean-up short."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        _stop(server, problems)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _stop(server: Server, problems: list[str]) -> None:
    proc, key = server.proc, server.variant.key
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, server.stop_signal)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            problems.append(f"{key}: the server did not stop on {signal.Signals(server.stop_signal).name}")
    # The workers, uWSGI's mule and its wheel remover, and a driver in a
    # session of its own (Uvicorn's lingers 2 s after the workers) end by
    # themselves, and the wheel goes with the last of them.
    give_up = time.monotonic() + STOP_TIMEOUT
    while group_members(proc.pid) or (server.driver and alive(server.driver)) or wheel_exists(server.wheel):
        if time.monotonic() > give_up:
            problems.append(f"{key}: processes or the wheel {server.wheel} outlived the server; killed, removed")
            break
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if server.driver and alive(server.driver):
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.driver, signal.SIGKILL)
    if proc.poll() is None:
        proc.wait()
    with contextlib.suppress(shmwheel.SegmentNotFoundError):
        shmwheel.unlink(server.wheel)


# -- one run -----------------------------------------------------------------------


@dataclass
class Run:
    variant: str
    round: int
    requests: int = 0
    requests_per_s: float = 0.0
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    max_ms: float = float("nan")
    errors: dict[str, int] = field(default_factory=dict)  # socket errors by kind, non-2xx
    server_cpu_us: float = float("nan")  # per request: master and workers
    switches: float = float("nan")  # context switches per request: master and workers, every thread
    driver_cpu_us: float = float("nan")  # per request: the shmwheel driver
    driver_core_pct: float = float("nan")  # the driver's CPU time as a share of one CPU
    steal_pct: float = float("nan")  # of the machine's CPU time, during the run
    per_worker: dict[str, int] = field(default_factory=dict)  # requests by X-Pid
    failure: str = ""
    bursts: int = 0  # of wrk, merged into this run
    lopsided_bursts: int = 0  # bursts in which one worker served every request
    burst_cpu_us: list[float] = field(default_factory=list)  # server CPU a request, burst by burst
    wall_s: float = 0.0  # s of wrk in all

    @property
    def busiest_share(self) -> float:
        total = sum(self.per_worker.values())
        return max(self.per_worker.values()) / total if total else float("nan")

    @property
    def lopsided(self) -> bool:
        """One worker served every request of at least one burst."""
        return self.lopsided_bursts > 0

    @property
    def ok(self) -> bool:
        return not self.failure and self.requests > 0 and not any(self.errors.values())


def wrk(port: int, duration: int, connections: int, script: Path) -> dict[str, Any]:
    cmd = [
        "wrk",
        f"-t{WRK_THREADS}",
        f"-c{connections}",
        f"-d{duration}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        f"http://127.0.0.1:{port}/",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60)
    summary: dict[str, Any] = {"pids": {}}
    for line in out.stdout.splitlines():
        parts = line.split()
        if parts[:2] == ["BENCH", "summary"]:
            summary.update(zip(SUMMARY_FIELDS, map(int, parts[2:]), strict=True))
        elif parts[:2] == ["BENCH", "pid"]:
            summary["pids"][parts[2]] = int(parts[3])
    if out.returncode != 0 or "requests" not in summary:
        raise ServerFailed(f"wrk failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    return summary


def machine_cpu() -> tuple[float, float]:
    """(steal, all) CPU seconds of the machine since boot."""
    t = psutil.cpu_times()
    return getattr(t, "steal", 0.0), sum(t)


def measure(server: Server, rnd: int, duration: int, connections: int, script: Path) -> Run:
    """One burst of wrk against a running server: its figures as a run of one burst."""
    run = Run(server.variant.key, rnd, bursts=1)
    driver = server.driver
    members = [pid for pid in group_members(server.proc.pid) if pid != driver]
    before = {pid: run_ns(pid) for pid in members}
    switches_before = {pid: switches(pid) for pid in members}
    driver_before = run_ns(driver) if driver else None
    steal_before, all_before = machine_cpu()
    started = time.monotonic()
    summary = wrk(server.port, duration, connections, script)
    run.wall_s = time.monotonic() - started
    steal_after, all_after = machine_cpu()
    members = [pid for pid in group_members(server.proc.pid) if pid != driver]
    after = {pid: run_ns(pid) for pid in members}
    switches_after = {pid: switches(pid) for pid in members}
    driver_after = run_ns(driver) if driver else None

    server_ns = sum((a or 0) - (before.get(pid) or 0) for pid, a in after.items())
    run.requests = summary["requests"]
    run.requests_per_s = summary["requests"] / (summary["duration_us"] / 1e6)
    run.p50_ms, run.p99_ms, run.max_ms = (summary[k] / 1e3 for k in ("p50_us", "p99_us", "max_us"))
    run.errors = {k: summary[k] for k in ("connect", "read", "write", "timeout", "non2xx")}
    run.per_worker = summary["pids"]
    run.lopsided_bursts = int(run.busiest_share >= LOPSIDED)
    run.steal_pct = 100 * (steal_after - steal_before) / max(all_after - all_before, 1e-9)
    if run.requests:
        run.server_cpu_us = server_ns / 1e3 / run.requests
        switched = sum((a or 0) - (switches_before.get(pid) or 0) for pid, a in switches_after.items())
        run.switches = switched / run.requests
    if driver and driver_before is not None and driver_after is not None:
        driver_s = (driver_after - driver_before) / 1e9
        run.driver_cpu_us = driver_s / max(run.requests, 1) * 1e6
        run.driver_core_pct = 100 * driver_s / (summary["duration_us"] / 1e6)
    elif driver:
        run.failure = f"the driver {driver} exited during the run"
    if run.requests == 0:
        run.failure = run.failure or "no response"
    return run


def merge(bursts: list[Run]) -> Run:
    """A variant's bursts of one round as one run: per request over all of
    their requests, throughput over all of their time, wrk's latencies the
    median of the bursts' (the max the largest)."""
    first = bursts[0]
    run = Run(
        first.variant, first.round, bursts=len(bursts), failure=next((b.failure for b in bursts if b.failure), "")
    )
    run.requests = sum(b.requests for b in bursts)
    run.wall_s = sum(b.wall_s for b in bursts)
    run.lopsided_bursts = sum(b.lopsided_bursts for b in bursts)
    for b in bursts:
        for k, n in b.errors.items():
            run.errors[k] = run.errors.get(k, 0) + n
        for pid, n in b.per_worker.items():
            run.per_worker[pid] = run.per_worker.get(pid, 0) + n
    served = [b for b in bursts if b.requests]
    if not served:
        run.failure = run.failure or "no response"
        return run
    run.requests_per_s = run.requests / sum(b.requests / b.requests_per_s for b in served)
    run.p50_ms = med([b.p50_ms for b in served])
    run.p99_ms = med([b.p99_ms for b in served])
    run.max_ms = max(b.max_ms for b in served)
    run.steal_pct = sum(b.steal_pct * b.wall_s for b in served) / sum(b.wall_s for b in served)

    def per_request(name: str) -> float:
        return float(sum(getattr(b, name) * b.requests for b in served)) / run.requests

    run.server_cpu_us = per_request("server_cpu_us")
    run.burst_cpu_us = [b.server_cpu_us for b in served]
    run.switches = per_request("switches")
    if all(b.driver_cpu_us == b.driver_cpu_us for b in served):
        run.driver_cpu_us = per_request("driver_cpu_us")
        measured = [b.requests / b.requests_per_s for b in served]  # wrk's own duration of each burst
        run.driver_core_pct = sum(b.driver_core_pct * t for b, t in zip(served, measured, strict=True)) / sum(measured)
    return run


def run_group(
    group: list[Variant],
    rnd: int,
    args: argparse.Namespace,
    tmp: Path,
    script: Path,
    problems: list[str],
    wheels: list[str],
) -> list[Run]:
    """A round of one server's variants: a server for each, all started
    before any is measured and left idle while another is; each warmed up,
    then ``bursts`` bursts of wrk each, taken in turn, the order rotated
    from one burst to the next.  One run a variant, its bursts merged."""
    done: dict[Variant, Run] = {}
    bursts: dict[Variant, list[Run]] = {v: [] for v in group}
    with contextlib.ExitStack() as stack:
        servers: dict[Variant, Server] = {}
        for variant in group:
            try:
                servers[variant] = stack.enter_context(serve(variant, tmp, problems, wheels))
                if args.warmup > 0:
                    wrk(servers[variant].port, args.warmup, args.connections, script)
            except ServerFailed as exc:
                done[variant] = Run(variant.key, rnd, failure=str(exc).split("\n")[0])
                problems.append(str(exc))
        for b in range(args.bursts):
            shift = (rnd - 1 + b) % len(group)
            for variant in group[shift:] + group[:shift]:
                if variant in done:
                    continue
                try:
                    burst = measure(servers[variant], rnd, args.duration, args.connections, script)
                except ServerFailed as exc:
                    burst = Run(variant.key, rnd, failure=str(exc).split("\n")[0])
                    problems.append(str(exc))
                bursts[variant].append(burst)
                if burst.failure:
                    done[variant] = merge(bursts[variant])
    return [done[v] if v in done else merge(bursts[v]) for v in group]


# -- the report ---------------------------------------------------------------------


def med(values: Sequence[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def spread(values: Sequence[float]) -> str:
    values = [v for v in values if v == v]
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def fmt(value: float, digits: int = 0, unit: str = "") -> str:
    if value != value:
        return "-"
    return f"{value:,.{digits}f}{unit}"


def total_cpu_us(run: Run) -> float:
    driver = run.driver_cpu_us if run.driver_cpu_us == run.driver_cpu_us else 0.0
    return run.server_cpu_us + driver


def ratios(runs: list[Run], variant: Variant) -> tuple[list[float], list[float], list[float]]:
    """Per round: requests/s and CPU per request, this variant over its
    server's "off"; and requests/s in the rounds where neither run had one
    worker serve every request (the load spread over the workers)."""
    off = {r.round: r for r in runs if r.variant == f"{variant.server}/off" and r.ok}
    rps, cpu, busy = [], [], []
    for r in runs:
        if r.variant == variant.key and r.ok and r.round in off and total_cpu_us(off[r.round]) > 0:
            rps.append(r.requests_per_s / off[r.round].requests_per_s)
            cpu.append(total_cpu_us(r) / total_cpu_us(off[r.round]))
            if not (r.lopsided or off[r.round].lopsided):
                busy.append(rps[-1])
    return rps, cpu, busy


def split_text(runs: list[Run]) -> str:
    shares = [r.busiest_share for r in runs if r.per_worker]
    lopsided = sum(r.lopsided for r in runs)
    text = f"{100 * med(shares):.0f} %" if shares else "-"
    if lopsided:
        text += f"; one worker got all in {lopsided} of {len(runs)}"
    return text


def summary_table(runs: list[Run], variants: list[Variant]) -> str:
    lines = [
        "| server | timeout | requests/s | latency p50 / p99 ms | server CPU µs/request | context switches/request "
        "| driver CPU µs/request | driver, % of a core | requests/s ÷ off | requests/s ÷ off, load spread "
        "| CPU/request ÷ off | busiest worker's share | errors |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in variants:
        mine = [r for r in runs if r.variant == v.key]
        good = [r for r in mine if r.ok]
        rps, cpu, busy = ratios(runs, v)
        errors = sum(sum(r.errors.values()) for r in mine) + sum(1 for r in mine if r.failure)
        lines.append(
            f"| {server_label(v.server)} | {v.label} | {fmt(med([r.requests_per_s for r in good]))} "
            f"| {fmt(med([r.p50_ms for r in good]), 2)} / {fmt(med([r.p99_ms for r in good]), 2)} "
            f"| {fmt(med([r.server_cpu_us for r in good]))} | {fmt(med([r.switches for r in good]), 2)} "
            f"| {fmt(med([r.driver_cpu_us for r in good]), 2) if v.shmwheel else ''} "
            f"| {fmt(med([r.driver_core_pct for r in good]), 2, ' %') if v.shmwheel else ''} "
            f"| {'1' if v.timer == 'off' else spread(rps)} "
            f"| {'1' if v.timer == 'off' else spread(busy) + f' in {len(busy)}'} "
            f"| {'1' if v.timer == 'off' else spread(cpu)} "
            f"| {split_text(mine)} | {errors} |"
        )
    return "\n".join(lines)


def cpu_text(runs: list[Run], variants: list[Variant]) -> str:
    """CPU a request over off, mean and standard error over the rounds: the
    figure to compare two variants by (their difference is significant
    where it is well over both errors), which a median does not give."""
    parts = []
    for v in variants:
        cpu = ratios(runs, v)[1]
        if v.timer != "off" and cpu:
            error = statistics.stdev(cpu) / len(cpu) ** 0.5 if len(cpu) > 1 else float("nan")
            parts.append(f"{v.key} {statistics.mean(cpu):.3f} ± {fmt(error, 3)}")
    return "CPU a request ÷ off, mean ± standard error over the rounds: " + "; ".join(parts) + "." if parts else ""


def rounds_table(runs: list[Run]) -> str:
    lines = [
        "| round | variant | requests/s | p50 / p99 ms | server µs/req | switches/req | driver µs/req "
        "| driver % core | requests by worker | steal | errors |",
        "|---:|:---|---:|---:|---:|---:|---:|---:|:---|---:|:---|",
    ]
    for r in runs:
        split = " / ".join(str(n) for n in sorted(r.per_worker.values(), reverse=True))
        if r.lopsided:
            split += f" (one worker got all in {r.lopsided_bursts} of {r.bursts} bursts)"
        errors = ", ".join(f"{k} {n}" for k, n in r.errors.items() if n) or r.failure or "0"
        lines.append(
            f"| {r.round} | {r.variant} | {fmt(r.requests_per_s)} | {fmt(r.p50_ms, 2)} / {fmt(r.p99_ms, 2)} "
            f"| {fmt(r.server_cpu_us)} | {fmt(r.switches, 2)} | {fmt(r.driver_cpu_us, 2)} "
            f"| {fmt(r.driver_core_pct, 2)} | {split} "
            f"| {fmt(r.steal_pct, 1, ' %')} | {errors} |"
        )
    return "\n".join(lines)


def versions() -> dict[str, str]:
    found = {}
    for dist in ("gunicorn", "pyuwsgi", "uvicorn", "uvloop", "httptools"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[dist] = importlib.metadata.version(dist)
    wrk_version = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    found["wrk"] = wrk_version.split(" [")[0].removeprefix("wrk ")
    return found


# -- main -------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="one round of one 1 s burst of a few variants: a CI smoke test"
    )
    parser.add_argument("--rounds", type=int, help=f"rounds (default {ROUNDS}, {QUICK_ROUNDS} with --quick)")
    parser.add_argument(
        "--duration",
        type=int,
        metavar="S",
        help=f"seconds of wrk a burst (default {DURATION:g}, {QUICK_DURATION:g} with --quick)",
    )
    parser.add_argument(
        "--bursts",
        type=int,
        metavar="N",
        help=f"bursts of wrk a variant a round, taken in turn (default {BURSTS}, {QUICK_BURSTS} with --quick)",
    )
    parser.add_argument(
        "--connections", type=int, default=CONNECTIONS, help=f"wrk's connections (default {CONNECTIONS})"
    )
    parser.add_argument(
        "--close", action="store_true", help="a connection a request (wrk sends Connection: close), as nginx proxies"
    )
    parser.add_argument(
        "--only", metavar="REGEX", help="the variants whose server/timer matches, e.g. 'uwsgi|sync/off'"
    )
    parser.add_argument(
        "--threads", type=int, default=THREADS, help=f"threads a worker, gthread and uWSGI (default {THREADS})"
    )
    parser.add_argument(
        "--workers", type=int, default=WORKERS, help=f"worker processes of each server (default {WORKERS})"
    )
    parser.add_argument(
        "--wrk-threads",
        type=int,
        default=WRK_THREADS,
        metavar="N",
        help=f"wrk's threads (default {WRK_THREADS}; at most --connections)",
    )
    parser.add_argument(
        "--build",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="also run each shmwheel variant with the shmwheel of the checkout at PATH, as SERVER/shmwheel@NAME",
    )
    parser.add_argument("--json", metavar="FILE", help="also write every run to FILE as JSON")
    args = parser.parse_args(argv)
    for build in args.build:
        name, sep, path = build.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name in BUILDS:
            parser.error(f"--build {build!r}: NAME=PATH, NAME a word of its own")
        if not os.path.isfile(os.path.join(path, "shmwheel", "__init__.py")):
            parser.error(f"--build {build!r}: {path} has no shmwheel package")
        BUILDS[name] = os.path.abspath(path)
    if args.threads < 1:
        parser.error("--threads must be at least 1")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if not 1 <= args.wrk_threads <= args.connections:
        parser.error("--wrk-threads must be at least 1 and at most --connections (wrk's rule)")
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.duration is not None and not 0 < args.duration <= 600:
        parser.error("--duration must be more than 0 and at most 600 s")
    if args.bursts is not None and args.bursts < 1:
        parser.error("--bursts must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    global THREADS, WORKERS, WRK_THREADS
    args = parse_args(argv)
    THREADS, WORKERS, WRK_THREADS = args.threads, args.workers, args.wrk_threads
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    args.duration = duration = args.duration or (QUICK_DURATION if args.quick else DURATION)
    args.bursts = args.bursts or (QUICK_BURSTS if args.quick else BURSTS)
    args.warmup = warmup = WARMUP
    variants = [v for v in VARIANTS if not args.quick or v.key in QUICK_VARIANTS]
    variants += [
        dataclasses.replace(v, build=name, label=f"{v.label} ({name})")
        for name in BUILDS
        for v in variants
        if v.shmwheel
    ]
    if args.only:
        variants = [v for v in variants if re.search(args.only, v.key)]
    if not variants:
        print("no variant matches", file=sys.stderr)
        return 2
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, terminate)

    wheels: list[str] = []  # our servers' (the machine is shared: other wheels are not ours)
    runs: list[Run] = []
    problems: list[str] = []
    started = time.monotonic()
    print(
        f"shmwheel real-server benchmark{', quick run' if args.quick else ''}: {len(variants)} variants x "
        f"{rounds} round{'s' if rounds > 1 else ''} x {args.bursts} burst{'s' if args.bursts > 1 else ''} "
        f"x {duration:g} s",
        file=sys.stderr,
    )
    tmp = Path(tempfile.mkdtemp(prefix="shmwheel-bench-servers-"))
    try:
        script = tmp / "count.lua"
        script.write_text(('wrk.headers["Connection"] = "close"\n' if args.close else "") + WRK_SCRIPT)
        kinds = list(dict.fromkeys(v.server for v in variants))
        for rnd in range(1, rounds + 1):
            shift = (rnd - 1) % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                group = [v for v in variants if v.server == kind]
                for run in run_group(group, rnd, args, tmp, script, problems, wheels):
                    runs.append(run)
                    progress(
                        f"round {rnd}/{rounds} {run.variant}: {fmt(run.requests_per_s)} requests/s, "
                        f"server {fmt(run.server_cpu_us, 1)} µs/request"
                        + (f", driver {fmt(run.driver_core_pct, 2)} % of a core" if "/shmwheel" in run.variant else "")
                        + (f", FAILED: {run.failure}" if run.failure else "")
                        + (f", errors {run.errors}" if any(run.errors.values()) else "")
                    )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.monotonic() - started

    left = sorted(name for name in wheels if wheel_exists(name))
    if left:
        problems.append(f"left in {SHM_DIR}: {', '.join(left)}")

    machine = machine_info(**versions())
    server_versions = ", ".join(
        f"{k} {machine[k]}" for k in ("gunicorn", "pyuwsgi", "uvicorn", "uvloop", "httptools") if k in machine
    )
    print(f"## shmwheel in real servers ({'quick' if args.quick else 'full'} run, {elapsed:.0f} s)")
    print()
    print(f"- CPU: {machine['cpu']}, {machine['cpus']} logical CPUs; {machine['os']}")
    print(f"- {machine['python']}, shmwheel {machine['shmwheel']}; {server_versions}; wrk {machine['wrk']}")
    for name, path in BUILDS.items():
        print(f"- `@{name}`: the shmwheel of {path}")
    print(
        f"- wrk -t1 -c{args.connections} -d{duration:g}s --latency"
        + (" with Connection: close" if args.close else "")
        + f" on loopback, {rounds} round(s) of {args.bursts} burst(s) a variant, a server's variants side by side "
        f"and taken in turn; every timeout {TIMEOUT:g} s (none fires); medians over the rounds; ratios to the same "
        'server\'s "off" in the same round, median (min-max)'
    )
    print()
    print(summary_table(runs, variants))
    print()
    if text := cpu_text(runs, variants):
        print(text)
        print()
    print(rounds_table(runs))
    lopsided = [r for r in runs if r.lopsided]
    if lopsided:
        print()
        print(
            f"The kernel gave one worker every connection in {len(lopsided)} of {len(runs)} runs, "
            "in some of their bursts: "
            + ", ".join(f"round {r.round} {r.variant} ({r.lopsided_bursts} of {r.bursts})" for r in lopsided)
            + "."
        )

    failed = [r for r in runs if not r.ok]
    if args.json:
        document = {
            "machine": machine,
            "config": {
                "rounds": rounds,
                "duration_s": duration,
                "warmup_s": warmup,
                "bursts": args.bursts,
                "connections": args.connections,
                "connection_close": args.close,
                "timeout_s": TIMEOUT,
                "gunicorn_timeout_s": GUNICORN_TIMEOUT,
                "workers": WORKERS,
                "threads": THREADS,
                "wrk_threads": WRK_THREADS,
            },
            "runs": [{**asdict(r), "busiest_share": r.busiest_share, "ok": r.ok} for r in runs],
            "problems": problems,
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(strict_json(document), f, indent=2, allow_nan=False)
            f.write("\n")
    for problem in problems:
        print(f"problem: {problem}", file=sys.stderr)
    if failed or problems:
        print(
            f"FAILED: {len(failed)} of {len(runs)} runs had errors or no responses; {len(problems)} problems",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
