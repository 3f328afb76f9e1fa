"""End to end: a WSGI request stuck each way it can be, under each WSGI server.

tests/apps/flask_stuck.py has a route stuck in time.sleep, in a blocking
recv, in a CPU loop and in a regular expression that holds the GIL.  Each
server is started once, with a 1 s timeout and no kill: fast requests
never time out; each stuck request is timed out once, by its path, worker
pid and thread, and the worker writes that request's own stack, down to
the function it is stuck in.  The regular expression lets no Python run,
so the worker cannot answer: the driver says so and faulthandler's dump
of every thread follows, the request's thread among them.

The three that let Python run are sent together, the regular expression
after them: while it runs, the reporter of its worker cannot run either.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _servers import (
    APPS,
    BIN,
    DRIVER_TIMED_OUT,
    WAIT,
    Server,
    assert_nothing_left,
    free_port,
    get,
    gunicorn_app,
    serve,
    uwsgi_ini,
)

SECONDS = 4  # how long a stuck request lasts: well past the 1 s timeout
COOPERATIVE = {"/sleep": "stuck_in_sleep", "/recv": "stuck_in_recv"}  # under gevent, they yield to the hub
STUCK = {**COOPERATIVE, "/spin": "stuck_in_spin"}
REGEX = "/regex"
FUNCTIONS = {*STUCK.values(), "stuck_in_regex"}


def uwsgi(tmp_path: Path, port: int) -> list[str]:
    options = {
        "module": "flask_stuck_uwsgi:application",
        "pythonpath": str(APPS),
        "processes": "2",
        "threads": "4",
        "shmwheel-timeout": "1",
        "shmwheel-kill": "false",
        "shmwheel-kill-after": None,
    }
    return [str(BIN / "uwsgi"), "--ini", str(uwsgi_ini(tmp_path, port, **options))]


# Each server, and how its workers serve: the sync worker one request at a
# time (enough of them for the stuck requests), gthread's one worker in
# several threads, gevent's in greenlets, uWSGI's two in threads.
SERVERS = {
    "sync": lambda tmp_path, port: gunicorn_app(tmp_path, port, "sync", "--workers", "4"),
    "gthread": lambda tmp_path, port: gunicorn_app(tmp_path, port, "gthread", "--workers", "1", "--threads", "8"),
    "gevent": lambda tmp_path, port: gunicorn_app(tmp_path, port, "gevent", "--workers", "1"),
    "uwsgi": uwsgi,
}


def get_as(port: int, path: str, request_id: str) -> tuple[int, str]:
    return get(port, path, WAIT, request_id)


def driver_line(path: str, request_id: str) -> str:
    """The driver's line: groups the worker pid and its thread."""
    return (
        rf"request timed out: GET {re.escape(path)} \(request {re.escape(request_id)}, "
        r"worker pid (\d+), thread 0x([0-9a-f]{16})(?:, greenlet 0x[0-9a-f]+)?\), running for [\d.]+ s"
    )


def the_one_driver_line(server: Server, path: str, request_id: str) -> tuple[int, str]:
    """The worker pid and thread of a request timed out exactly once."""
    server.wait_for(driver_line(path, request_id))
    found = re.findall(driver_line(path, request_id), server.log())
    assert len(found) == 1, found
    return int(found[0][0]), found[0][1]


def own_stack(server: Server, path: str, request_id: str, pid: int, thread: str, function: str) -> str:
    """The worker's report of a request: its header names the same worker
    and thread as the driver's line, and its stack ends in ``function`` of
    the app and holds no other stuck function.  Returns the stack."""
    header = (
        rf"shmwheel: the stack of timed-out request GET {re.escape(path)} \(request {re.escape(request_id)}, "
        rf"worker pid {pid}, thread 0x{thread}(?:, greenlet 0x[0-9a-f]+)?\), running for [\d.]+ s \(most recent "
        r"call last\):\n"
    )
    frame = rf'  File ".*/tests/apps/flask_stuck\.py", line \d+, in {function}\n'
    server.wait_for(header + r"(?:  .*\n)*?" + frame)
    stack = re.search(header + r"((?:  .*\n)*)", server.log())
    assert stack is not None
    lines = stack.group(1)
    assert re.search(frame, lines), lines
    assert {f for f in FUNCTIONS if f" in {f}\n" in lines} == {function}, lines
    return lines


def stuck_requests_are_timed_out_with_their_own_stacks(server: Server, name: str) -> dict[str, str]:
    """Fast requests never time out; each stuck request is timed out once and
    its stack written (for the regular expression, faulthandler's dump).
    Returns each stuck way's stack."""
    for _ in range(20):
        assert get(server.port, "/")[0] == 200
    stacks = {}
    with ThreadPoolExecutor(len(STUCK)) as pool:
        answers = {path: pool.submit(get_as, server.port, f"{path}?s={SECONDS}", f"{name}{path}") for path in STUCK}
        for path, function in STUCK.items():
            pid, thread = the_one_driver_line(server, path, f"{name}{path}")
            stacks[path] = own_stack(server, path, f"{name}{path}", pid, thread, function)
            assert answers[path].result() == (200, f"done by pid {pid}\n")  # no kill: it finishes

    with ThreadPoolExecutor(1) as pool:
        # 2**27 steps: 3 s or more here.  At 2**26 (1.5 s on an idle
        # machine) the regex could end before the dump was asked for.
        answer = pool.submit(get_as, server.port, f"{REGEX}?n=27", f"{name}{REGEX}")
        pid, thread = the_one_driver_line(server, REGEX, f"{name}{REGEX}")
        server.wait_for(
            rf"worker pid {pid} did not write the stack of GET {REGEX} \(request {re.escape(name + REGEX)}, .*\) "
            rf"within [\d.]+ s: .*; asking it for faulthandler's dump of every thread on SIGRTMIN, to its stderr, "
            rf"which it writes where it can tell that no Python runs; the request's is thread 0x{thread}$"
        )
        dump = (
            rf"^(?:Current thread|Thread) 0x{thread} \(most recent call first\):\n(?:  .*\n)*?"
            r'  File ".*/tests/apps/flask_stuck\.py", line \d+ in stuck_in_regex\n'
        )
        server.wait_for(dump)
        assert answer.result() == (200, f"done by pid {pid}\n")

    assert len(re.findall(DRIVER_TIMED_OUT, server.log())) == len(STUCK) + 1
    return stacks


@pytest.mark.parametrize("server_name", sorted(SERVERS))
def test_a_request_stuck_each_way_is_timed_out_with_its_own_stack(server_name: str, tmp_path: Path) -> None:
    port = free_port()
    prefix = "uwsgi" if server_name == "uwsgi" else "gunicorn"
    with serve(SERVERS[server_name](tmp_path, port), port, tmp_path, prefix) as server:
        server.wait_for(r"running on wheel|driver pid \d+")
        stacks = stuck_requests_are_timed_out_with_their_own_stacks(server, server_name)
        if server_name == "gevent":
            # A greenlet that waits is shown by its own frames, not the hub's
            # that runs meanwhile; one in a CPU loop by its thread's.
            for path in COOPERATIVE:
                assert not re.search(r'gevent/hub\.py", line \d+, in run\n', stacks[path]), stacks[path]
            assert "which has no Python frame" not in server.log()
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


def test_gunicorn_gevent_worker_stuck_in_a_request_is_killed_and_replaced(tmp_path: Path) -> None:
    """kill=True with the gevent worker: the worker of a stuck request gets
    SIGABRT, then SIGKILL if it is still there; Gunicorn replaces it."""
    port = free_port()
    cmd = gunicorn_app(tmp_path, port, "gevent", "--workers", "1", install="timeout=1.0, kill=True, kill_after=2.0")
    with serve(cmd, port, tmp_path, "gunicorn") as server:
        for _ in range(20):
            assert get(server.port, "/")[0] == 200
        assert get_as(server.port, "/sleep?s=60", "gevent-kill")[0] in (0, 500)
        pid, thread = the_one_driver_line(server, "/sleep", "gevent-kill")
        server.wait_for(
            driver_line("/sleep", "gevent-kill") + r"; asking it for the request's stack \(SIGRTMIN\+\d\), then SIGABRT"
        )
        own_stack(server, "/sleep", "gevent-kill", pid, thread, "stuck_in_sleep")
        server.wait_for(rf"Worker \(pid:{pid}\) (?:exited with code|was sent SIGKILL)")
        server.wait_for(rf"Booting worker with pid: (?!{pid}\b)\d+")
        give_up = time.monotonic() + WAIT
        while True:  # served by the worker that replaced it
            status, body = get(server.port, "/")
            if status == 200:
                break
            assert time.monotonic() < give_up, body
            time.sleep(0.1)
        assert body != f"done by pid {pid}\n"
        assert len(re.findall(DRIVER_TIMED_OUT, server.log())) == 1
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


# Two greenlets start a request each: one waits in time.sleep, the other
# spins past its timeout, sends the process the stack signal, and spins on
# until the reporter thread has written both stacks.  Monkey-patching
# before shmwheel is imported, or after.
PATCHED = """
import sys
if sys.argv[1] == "patch first":
    from gevent import monkey; monkey.patch_all()
import shmwheel
from shmwheel.contrib import _stacks, _worker
if sys.argv[1] == "shmwheel first":
    from gevent import monkey; monkey.patch_all()
import logging, os, signal, threading, time, gevent

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
wheel = shmwheel.create(sys.argv[2], capacity=8, payload_size=256)
timer = _worker.RequestTimer(sys.argv[2], 0.05)
assert timer.prepare()

def in_sleep():
    handle = timer.start("GET", "/sleep")
    time.sleep(0.1)
    timer.finish(handle)

def in_spin():
    handle = timer.start("GET", "/spin")
    until = time.monotonic() + 0.1
    while time.monotonic() < until:
        pass
    os.kill(os.getpid(), signal.SIGURG)
    give_up = time.monotonic() + 20
    while len(_stacks._reported) < 2 and time.monotonic() < give_up:
        pass
    timer.finish(handle)

print("thread", hex(monkey.get_original("_thread", "get_ident")()), "patched", hex(threading.get_ident()))
gevent.joinall([gevent.spawn(in_sleep), gevent.spawn(in_spin)])
"""


@pytest.mark.parametrize("order", ["patch first", "shmwheel first"])
def test_a_request_in_a_greenlet_names_its_os_thread_and_its_own_frames(order: str, name: str) -> None:
    """Under gevent's monkey-patching, in either order: the record names the
    OS thread, not the greenlet threading.get_ident() returns, and the
    stack is the greenlet's own: where it waits, or where it spins."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PATCHED), order, name],
        capture_output=True, text=True, timeout=WAIT, check=True,
    ).stdout  # fmt: skip
    ids = re.search(r"^thread 0x([0-9a-f]+) patched 0x([0-9a-f]+)$", out, re.MULTILINE)
    assert ids is not None, out
    thread, patched = ids.groups()
    assert thread != patched
    for path, function in (("/sleep", "in_sleep"), ("/spin", "in_spin")):
        header = (
            rf"the stack of timed-out request GET {path} \(request \S+, worker pid \d+, thread 0x0*{thread}, "
            r"greenlet 0x"
        )
        stack = re.search(header + r".*\n((?:  .*\n)*)", out)
        assert stack is not None, out
        assert re.search(rf'  File "<string>", line \d+, in {function}\n', stack.group(1)), out
        assert not re.search(r'gevent/hub\.py", line \d+, in run\n', stack.group(1)), out
