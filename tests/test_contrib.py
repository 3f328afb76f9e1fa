"""shmwheel.contrib piece by piece: the request record, the handler's actions
on real processes, the worker's timer, the middleware, the supervisor, and
the Gunicorn and uWSGI settings.  (test_servers.py runs the real servers.)"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import resource
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import entry, foreign_segment, script_processes

import shmwheel
from shmwheel._binding import ffi, lib
from shmwheel._process import signal_disposition, start_time
from shmwheel.contrib import (
    KIND_ANSWER,
    KIND_CHECK,
    KIND_GRACEFUL,
    KIND_KILL,
    KIND_REQUEST,
    PAYLOAD_SIZE,
    DriverSupervisor,
    RequestTimer,
    TimeoutActions,
    TimeoutHandler,
    create_wheel,
    decode_request,
    encode_request,
    signal_process,
    timeouts,
)
from shmwheel.contrib import gunicorn as contrib_gunicorn
from shmwheel.contrib._handler import DUMP_TIME, signal_if
from shmwheel.contrib._record import HEAD, KIND_FINISHED, KIND_LATE, KIND_RELEASED, KINDS, shown, with_kind
from shmwheel.contrib._settings import reserve_for
from shmwheel.contrib.uwsgi import settings as uwsgi_settings
from shmwheel.contrib.wsgi import TimeoutMiddleware

WAIT = 30.0

# -- the request record -----------------------------------------------------------


def test_request_record_round_trips() -> None:
    payload = encode_request(KIND_REQUEST, 1234, 987654321, 42, "GET", "abc.7", "/a/b?c=d é")
    record = decode_request(payload)
    assert record is not None
    assert record == (
        KIND_REQUEST, 1234, 987654321, 42, "GET", "abc.7", "/a/b?c=d é", False, 0, 0, "", 0, 0, 0, False, False, 0
    )  # fmt: skip
    assert record.describe() == "GET /a/b?c=d é (request abc.7, worker pid 1234)"


def test_what_a_client_chose_is_shown_as_data_in_log_lines_and_kept_as_it_is_in_json() -> None:
    """A path with a newline, ESC, a C1 code, a right-to-left override, a
    line separator, a tab and a backslash: written visibly, so that no line
    of the log begins with the client's text and no terminal obeys it; the
    JSON fields keep the path as it came.  Plain text, é included, is left
    as it is."""
    path = "/a\n[x] [CRITICAL] forged\x1b[2J\x85\u202e\u2028\t\\ é"
    payload = encode_request(KIND_REQUEST, 1, 2, 3, "GET", "r", path)
    record = decode_request(payload)
    assert record is not None
    line = record.describe()
    assert line == r"GET /a\n[x] [CRITICAL] forged\x1b[2J\x85\u202e\u2028\t\\ é (request r, worker pid 1)"
    assert line.isprintable()
    assert record.as_dict()["path"] == path
    assert shown("x" * 300, 200) == "x" * 200 + "..."


@pytest.mark.parametrize("kind", ["task", "greenlet"])
def test_a_request_record_names_its_thread_its_task_and_its_signals(kind: str) -> None:
    payload = encode_request(
        KIND_REQUEST, 7, 8, 9, "GET", "r", "/x", thread=0x7F00AB, task=0xBEEF, task_kind=kind,
        stack_signal=signal.SIGURG, dump_signal=signal.SIGRTMIN,
    )  # fmt: skip
    record = decode_request(payload)
    assert record is not None
    assert (record.thread, record.task, record.task_kind) == (0x7F00AB, 0xBEEF, kind)
    assert (record.stack_signal, record.dump_signal) == (signal.SIGURG, signal.SIGRTMIN)
    # The thread as faulthandler writes it, so that a dump of every thread can be read.
    assert record.describe() == f"GET /x (request r, worker pid 7, thread 0x00000000007f00ab, {kind} 0xbeef)"
    assert record.as_dict() == {
        "method": "GET", "path": "/x", "truncated": False, "request_id": "r", "worker_pid": 7,
        "thread": 0x7F00AB, "task": 0xBEEF, "task_kind": kind, "started_ns": 9, "timeout_ms": 0, "warn": False,
        "interrupt": False, "queued_ms": 0,
    }  # fmt: skip


def test_a_long_path_is_cut_to_fit_and_marked() -> None:
    payload = encode_request(KIND_REQUEST, 1, 2, 3, "POST", "id", "/" + "x" * 1000, size=100)
    assert len(payload) == 100
    record = decode_request(payload)
    assert record is not None and record.truncated
    assert record.path == "/" + "x" * (100 - HEAD.size - len("POST") - len("id") - 1)
    assert record.describe().startswith("POST /xxx") and "x... (request id" in record.describe()


def test_a_payload_too_small_for_the_request_id_leaves_it_out() -> None:
    """The worker's pid and the request's start stand in for a client's id
    that does not fit; a payload too small for the method is refused."""
    payload = encode_request(KIND_REQUEST, 0x2A, 2, 0xABCDEF, "GET", "x" * 20, "/longer", size=HEAD.size + 8)
    record = decode_request(payload)
    assert record is not None and (record.request_id, record.path, record.truncated) == ("2a.00abcdef", "/long", True)
    with pytest.raises(ValueError, match="a payload of 54 bytes has no room for a request record"):
        encode_request(KIND_REQUEST, 1, 2, 3, "OPTIONS", "", "/", size=HEAD.size + 2)


def test_a_record_of_a_request_that_queued_knows_its_own_timeout() -> None:
    """X-Request-Start moved its start 700 ms back: its timeout counts from
    there, the driver's kill from when its worker took it."""
    payload = encode_request(KIND_REQUEST, 1, 2, 10**9, "GET", "q", "/", timeout_ms=1000, queued_ms=700)
    record = decode_request(payload)
    assert record is not None and record.queued_ms == 700
    assert (record.timeout_at(), record.own_timeout_at()) == (2 * 10**9, int(2.7 * 10**9))
    plain = decode_request(encode_request(KIND_REQUEST, 1, 2, 10**9, "GET", "q", "/", timeout_ms=1000))
    assert plain is not None and plain.own_timeout_at() is None


_GOOD = encode_request(KIND_REQUEST, 1, 2, 3, "GET", "id", "/")


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        _GOOD[: HEAD.size - 1],  # shorter than the head
        bytes([max(KINDS) + 1]) + _GOOD[1:],  # no such kind
        _GOOD[:1] + b"\xff\xff" + _GOOD[3:],  # sizes past the end
        _GOOD[:42] + b"\x00\x00" + _GOOD[44:],  # no magic number: another program's payload
        _GOOD[: HEAD.size] + b"G T" + _GOOD[HEAD.size + 3 :],  # a method that is no HTTP token
        b"\x01" * 100,
    ],
)
def test_a_payload_that_is_no_record_decodes_to_none(payload: bytes) -> None:
    assert decode_request(_GOOD) is not None
    assert decode_request(payload) is None


def test_a_payload_too_small_for_any_record_is_refused() -> None:
    with pytest.raises(ValueError, match="no room"):
        encode_request(KIND_REQUEST, 1, 2, 3, "GET", "x" * 64, "/", size=40)


# -- the actions and their checks ------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kill": 1}, TypeError, "kill must be True or False"),
        ({"kill_signal": "NOPE"}, ValueError, "no signal named 'NOPE'"),
        ({"kill_signal": 999}, ValueError, "999 is not a signal"),
        ({"kill_signal": 1.5}, TypeError, "signal number or name"),
        ({"kill_after": 0}, ValueError, "positive"),
        ({"kill_after": float("nan")}, ValueError, "positive"),
        ({"kill_after": "5"}, TypeError, "number of seconds"),
    ],
)
def test_actions_refuse_bad_settings(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        TimeoutActions(**kwargs)  # type: ignore[arg-type]


def test_actions_take_signal_names_and_round_trip_through_the_command_line() -> None:
    actions = TimeoutActions(kill=True, kill_signal="abrt", tracebacks=False, kill_after=2.5, log=False)
    assert actions.kill_signal == signal.SIGABRT
    again = TimeoutActions.from_args(timeouts._parser("shmwheel timeouts").parse_args(["w", *actions.as_args()]))
    assert again == actions


# A stand-in for a worker.  Given a wheel and a timeout, it starts the
# timers of its requests there with RequestTimer, as a worker does (the
# driver acts only on a timer that the worker it names added itself):
# request r1, GET /slow, and in "two" mode r2, GET /slower too.  Then it says
# it is ready and sits in a function with a name to find in its stack:
# asleep, or in "gil" mode in a regular expression that holds the GIL for
# many seconds, so that no Python runs.  "stubborn" also ignores SIGTERM, so
# only SIGKILL ends it.  "lost" listens on SIGUSR2, then sets it back to
# its default action, as something in a worker might.  "ends" finishes its
# request 0.2 s after its timeout.  Without a wheel it registers faulthandler on SIGURG
# and only sits.
WORKER = textwrap.dedent(
    """
    import faulthandler, re, signal, sys, time
    from shmwheel.contrib import RequestTimer
    mode = sys.argv[1]
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if len(sys.argv) > 2:
        timer = RequestTimer(sys.argv[2], float(sys.argv[3]), traceback_signal="USR2" if mode == "lost" else "URG")
        assert timer.prepare()
        handle = timer.start("GET", "/slow", "r1")
        assert handle is not None
        if mode == "lost":  # something took the stack signal since its start's look: its default action ends it
            from shmwheel.contrib import decode_request
            signal.signal(decode_request(timer.active()[handle].payload).stack_signal, signal.SIG_DFL)
        if mode in ("two", "stubborn"):
            assert timer.start("GET", "/slower", "r2") is not None
    else:
        faulthandler.register(signal.SIGURG, file=sys.stderr, all_threads=True)
    def serving_a_slow_request():
        print("ready", flush=True)
        if mode == "ends":  # it ends just after its timeout, while the driver acts on it
            time.sleep(float(sys.argv[3]) + 0.2)
            timer.finish(handle)
        if mode == "gil":
            re.match(r"(a+)+$", "a" * 32 + "b")
        time.sleep(60)
    serving_a_slow_request()
    """
)


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[object]:
    with script_processes(tmp_path, WORKER, "worker") as run:

        def start(mode: str = "polite", wheel: str | None = None, timeout: float = 0.05) -> subprocess.Popen[str]:
            return run([mode] if wheel is None else [mode, wheel, repr(timeout)])

        yield start


def test_signal_process_checks_the_start_time(worker) -> None:
    proc = worker()
    start = start_time(proc.pid)
    assert start is not None
    assert not signal_process(proc.pid, start + 1, signal.SIGKILL)  # another process with that pid
    time.sleep(0.2)
    assert proc.poll() is None
    assert signal_process(proc.pid, start, signal.SIGKILL)
    assert proc.wait(WAIT) == -signal.SIGKILL
    assert not signal_process(proc.pid, start, signal.SIGKILL)  # reaped: gone


SIGNAL_WAITER = """
import resource, signal, sys
resource.setrlimit(resource.RLIMIT_SIGPENDING, (0, resource.getrlimit(resource.RLIMIT_SIGPENDING)[1]))
ask = signal.SIGRTMIN + 5
signal.pthread_sigmask(signal.SIG_BLOCK, {ask})
print("ready", flush=True)
info = signal.sigwaitinfo({ask})
print("queued" if info.si_code == -1 else "plain", flush=True)  # SI_QUEUE is -1
"""


def test_an_ask_with_no_room_for_its_value_still_gets_there_plainly() -> None:
    """A worker whose user has no room for one more queued real-time signal
    (RLIMIT_SIGPENDING, here 0): the driver's sigqueue gets EAGAIN, and the
    ask goes plainly instead, which the worker reads as "every late
    request".  (Before, the driver raised OSError and the ask was lost.)"""
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_WAITER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        start = start_time(proc.pid)
        assert start is not None
        assert signal_if(proc.pid, start, signal.SIGRTMIN + 5, None, 12345)
        assert proc.stdout.readline() == "plain\n"
        assert proc.wait(WAIT) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def fire_all(wheel: shmwheel.Wheel, handler: TimeoutHandler, until: float) -> int:
    """Poll until ``until`` (monotonic), handing every fire to the handler."""
    n = 0
    while time.monotonic() < until:
        for fire in wheel.poll():
            handler(fire)
            n += 1
        time.sleep(0.01)
    return n


def fire_kinds(wheel: shmwheel.Wheel, handler: TimeoutHandler, until: float) -> dict[int, int]:
    """fire_all(), counting the fires by kind of record (answers left out:
    a worker answers each stack signal, and one signal may answer for two)."""
    kinds: dict[int, int] = {}
    while time.monotonic() < until:
        for fire in wheel.poll():
            handler(fire)
            if fire.payload[0] != KIND_ANSWER:
                kinds[fire.payload[0]] = kinds.get(fire.payload[0], 0) + 1
        time.sleep(0.01)
    return kinds


def record_for(proc: subprocess.Popen[str], path: str = "/slow") -> bytes:
    start = start_time(proc.pid)
    assert start is not None
    return encode_request(KIND_REQUEST, proc.pid, start, time.monotonic_ns(), "GET", "r1", path)


def _err(proc: subprocess.Popen[str]) -> str:
    return Path(proc.err.name).read_text()  # type: ignore[attr-defined]


def wait_for(proc: subprocess.Popen[str], text: str) -> str:
    give_up = time.monotonic() + WAIT
    while text not in _err(proc):
        assert time.monotonic() < give_up, f"no {text!r} from the worker: {_err(proc)}"
        time.sleep(0.02)
    return _err(proc)


def test_handler_asks_the_worker_for_the_requests_own_stack(make_wheel, worker, caplog) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("polite", wheel.name)
    handler = TimeoutHandler(wheel.name, TimeoutActions())
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        # The request, the worker's answer, and the driver's look for it.
        assert fire_all(wheel, handler, time.monotonic() + 1.2) == 3
    [line] = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(
        rf"request timed out: GET /slow \(request r1, worker pid {proc.pid}, thread (0x[0-9a-f]{{16}})\), "
        r"running for 0\.\d+ s; asking it for the request's stack \(SIGRTMIN\+\d\)",
        line,
    )
    err = wait_for(proc, "in serving_a_slow_request")
    # One header line that repeats the driver's, then the request's own stack.
    request = line.split("request timed out: ")[1].split(", running for")[0]
    assert f"shmwheel: the stack of timed-out request {request}, running for" in err
    assert err.count("(most recent call last):") == 1
    assert "Current thread" not in err  # the worker answered: faulthandler's dump was not needed
    assert proc.poll() is None  # asked for a stack, not killed


def test_a_worker_in_which_no_python_runs_gets_faulthandlers_dump(make_wheel, worker, caplog) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("gil", wheel.name)
    handler = TimeoutHandler(wheel.name, TimeoutActions())
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        assert fire_all(wheel, handler, time.monotonic() + 1.2) == 3  # the request, two looks: no answer
    timed_out, no_answer = [r.getMessage() for r in caplog.records]
    thread = re.search(r"thread (0x[0-9a-f]{16})", timed_out)
    assert thread is not None
    assert no_answer.startswith(f"worker pid {proc.pid} did not write the stack of GET /slow")
    assert no_answer.endswith(f"on SIGRTMIN, and the request's is thread {thread[1]}")
    err = wait_for(proc, "in serving_a_slow_request")
    assert f"Current thread {thread[1]} (most recent call first)" in err  # faulthandler's
    assert "the stack of timed-out request" not in err


def test_a_stack_signal_the_worker_does_not_catch_is_not_sent(make_wheel, worker, caplog) -> None:
    """The record names the signal, but the worker no longer catches it (its
    default action would end it): the driver says so and falls back to the
    dump signal, which it does catch."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("lost", wheel.name)
    handler = TimeoutHandler(wheel.name, TimeoutActions())
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        assert fire_all(wheel, handler, time.monotonic() + 0.8) == 1
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == (
        f"worker pid {proc.pid} does not catch SIGRTMIN+1, which its records name to ask it for a stack (it leaves the "
        "default action to it): not sent"
    )
    assert lines[1].endswith("; asking it for every thread's stack (SIGRTMIN)")
    wait_for(proc, "in serving_a_slow_request")  # faulthandler's
    assert proc.poll() is None


FORK_THEN_CLOSE = textwrap.dedent(
    """
    import os, signal, sys, time
    from shmwheel.contrib import RequestTimer
    RequestTimer(sys.argv[1], 30.0).prepare()  # the stack signal's handler, and its pipe
    pid = os.fork()
    if pid == 0:  # a child that closes every descriptor (a daemon does) and reuses their numbers
        os.closerange(3, 4096)
        fds = [os.open(sys.argv[2] + str(n), os.O_WRONLY | os.O_CREAT, 0o600) for n in range(4)]
        os.kill(os.getpid(), signal.SIGURG)  # the stack signal, as a driver would send it
        time.sleep(0.2)
        for fd in fds:
            os.write(fd, b"mine")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def test_the_stack_signal_never_writes_into_a_descriptor_a_forked_child_reused(make_wheel, tmp_path: Path) -> None:
    """The signal's handler, inherited by a fork, writes to its pipe only:
    not to a file the child opened under a number the pipe once had."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    prefix = str(tmp_path / "file")
    subprocess.run([sys.executable, "-c", FORK_THEN_CLOSE, wheel.name, prefix], check=True, timeout=WAIT)
    assert [Path(prefix + str(n)).read_bytes() for n in range(4)] == [b"mine"] * 4


def test_a_request_that_ends_after_its_timeout_fired_spares_its_worker_the_kill(make_wheel, worker, caplog) -> None:
    """The timer fired and the worker was asked for the stack; then the
    request ended: the worker says so, and the driver, which would have
    sent the kill signal next, leaves it alone and says why."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("ends", wheel.name)
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True, kill_after=0.5))
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        fire_all(wheel, handler, time.monotonic() + 1.5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-1] == f"GET /slow (request r1, worker pid {proc.pid}, thread " + lines[-1].split(", thread ")[1]
    assert lines[-1].endswith(f"has finished since it timed out: worker pid {proc.pid} is left alone")
    assert proc.poll() is None  # no SIGTERM came


def test_handler_kills_a_worker_that_ignores_the_graceful_signal(make_wheel, worker, caplog) -> None:
    """Both requests of the stubborn worker time out: it is sent SIGTERM once,
    for the first, and SIGKILL ends it; the polite one exits on SIGTERM."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    stubborn, polite = worker("stubborn", wheel.name), worker("polite", wheel.name)
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True, kill_after=0.5))
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        # Each of the three requests and its look; two SIGKILL follow-ups.
        kinds = fire_kinds(wheel, handler, time.monotonic() + 2.5)
        assert kinds == {KIND_REQUEST: 3, KIND_CHECK: 3, KIND_KILL: 2}
    assert polite.wait(WAIT) == -signal.SIGTERM
    assert stubborn.wait(WAIT) == -signal.SIGKILL
    lines = [r.getMessage() for r in caplog.records]
    pid = stubborn.pid
    [again] = [line for line in lines if "again" in line]
    assert again.startswith(f"worker pid {pid} is not sent SIGTERM again for GET /")
    assert "is draining its other requests; SIGKILL ends it" in again
    [killed] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert killed.startswith(
        f"killed worker pid {pid} with SIGKILL: it was still there 0.5 s after SIGTERM, which it ignores (GET /"
    )
    assert f"worker pid {polite.pid} exited within 0.5 s of SIGTERM (for GET /slow" in "\n".join(lines)
    assert "in serving_a_slow_request" in _err(stubborn)  # the stack was written before the kill


def fire_all_full(wheel: shmwheel.Wheel, handler: TimeoutHandler, until: float) -> None:
    """fire_all with the wheel kept full, as requests that flood it keep it:
    after each poll, ordinary adds take every slot they may."""
    while time.monotonic() < until:
        fires = wheel.poll()
        with contextlib.suppress(shmwheel.WheelFullError):
            while True:
                wheel.add(3600.0, b"filler")
        for fire in fires:
            handler(fire)
        time.sleep(0.01)


@pytest.mark.parametrize("reserve", [reserve_for(64), 0], ids=["reserve", "none-left"])
def test_a_full_wheel_keeps_every_stage_and_its_timing(reserve: int, make_wheel, worker, caplog) -> None:
    """The workers' requests keep the wheel full.  The worker's answers
    take the slots kept in reserve, and the driver's follow-ups half of
    them at most; the driver keeps the others in its memory.  Either way the
    stages come as they would, in order and on time: the stack written and
    said, the stack check DUMP_TIME later, SIGTERM, and SIGKILL kill_after
    after it for the worker that ignores SIGTERM.  (Before, a refused
    follow-up meant SIGTERM at once, with no SIGKILL after it.)"""
    wheel = make_wheel(capacity=64, payload_size=PAYLOAD_SIZE, reserve=reserve)
    stubborn = worker("stubborn", wheel.name, 0.2)
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True, kill_after=0.5))
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        fire_all_full(wheel, handler, time.monotonic() + 2.5)
    assert stubborn.wait(WAIT) == -signal.SIGKILL
    records = caplog.records
    kept = [r.getMessage() for r in records if "kept in the driver's memory" in r.getMessage()]
    if reserve:  # the driver takes at most half of it, and keeps the rest of its follow-ups itself
        assert not any("did not write the stack" in r.getMessage() for r in records)  # the answers got through
    else:
        assert len(kept) == 1 and re.match(r"\d+ follow-ups? could not be added to wheel", kept[0]), kept
    timed_out = next(r for r in records if r.getMessage().startswith("request timed out: GET /slow"))
    [killed] = [r for r in records if r.levelno == logging.ERROR]
    assert killed.getMessage().startswith(f"killed worker pid {stubborn.pid} with SIGKILL: it was still there 0.5 s "
                                          "after SIGTERM, which it ignores")  # fmt: skip
    # The stack check, then kill_after: no stage skipped its wait.
    assert killed.created - timed_out.created >= DUMP_TIME / 2 + 0.5
    assert "in serving_a_slow_request" in _err(stubborn)  # the stack was written before the kill
    # The thread that brought kept follow-ups back ends once none is left.
    wait_until(lambda: not any(t.name == "shmwheel-follow-ups" for t in threading.enumerate()), "it lingers")


def test_a_dead_drivers_warn_stage_check_is_carried_on_as_the_warn_stage(make_wheel, worker, caplog) -> None:
    """The driver that died had warned about a request (warn_after 0.1 s of
    a 30 s timeout) and left its stack check; the new one carries it on as
    the warn stage it was: a "slow" line and a timeout stage for later, no
    timeout, no kill.  (Carried on as a timeout, it was killed at 0.6 s.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("polite", wheel.name, 60.0)  # a worker of the wheel, with a handler for SIGURG
    start = start_time(proc.pid)
    assert start is not None
    record = encode_request(
        KIND_CHECK, proc.pid, start, time.monotonic_ns(), "GET", "r9", "/warned",
        stack_signal=signal.SIGURG, timeout_ms=30_000, warn=True,
    )  # fmt: skip
    dead = subprocess.run(
        [sys.executable, "-c", f"import shmwheel; shmwheel.attach({wheel.name!r}).add(0.05, {record!r}); print(1)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert dead.stdout == "1\n"
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True, kill_after=0.2))
    fires = []
    give_up = time.monotonic() + WAIT
    while not fires:
        assert time.monotonic() < give_up
        fires = wheel.poll()
        time.sleep(0.01)
    [fire] = fires
    handler.took_over(fire.owner_pid, 0)
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        handler(fire)
        fire_all(wheel, handler, time.monotonic() + 1.0)
    text = caplog.text
    assert "carrying on its stack check, which driver" in text, text
    assert "request is slow: GET /warned (request r9," in text, text
    assert "request timed out" not in text and "SIGTERM" not in text, text
    assert proc.poll() is None


def test_handler_leaves_a_worker_that_has_exited_alone(make_wheel, worker, caplog) -> None:
    """A worker killed while its request runs: its timer still fires (no
    driver reaped it), and the driver says the worker has exited."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("polite", wheel.name, 0.3)
    deadline = time.monotonic() + WAIT
    while len(wheel) == 0:  # its request has started
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.kill()
    proc.wait()
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        fire_all(wheel, TimeoutHandler(wheel.name, TimeoutActions(kill=True)), time.monotonic() + 0.6)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"request timed out: GET /slow (request r1, worker pid {proc.pid}, thread 0x")
    assert line.endswith("; the worker has exited")
    assert len(wheel) == 0  # no kill timer was scheduled


@pytest.mark.parametrize("how", ["through the API", "by hand"])
def test_a_forgers_thousand_timers_for_a_process_that_has_exited_are_said_in_two_lines(
    how: str, make_wheel, worker, caplog
) -> None:
    """Records naming a process that has exited, added by somebody else by
    the thousand: refused on who added them, whether or not the process is
    there; written by hand to look as if it had added them itself, taken
    for the timers of a worker that has exited.  Either way said in two
    lines.  (Before, one WARNING each.)"""
    wheel = make_wheel(capacity=4096, payload_size=PAYLOAD_SIZE)
    proc = worker()
    payload = record_for(proc)
    proc.kill()
    proc.wait()
    mask = (1 << lib.shmw_index_bits(wheel.capacity)) - 1
    for _ in range(3000):
        handle = wheel.add(0.01, payload)
        if how == "by hand":
            entry(wheel, handle & mask).owner_pid = proc.pid
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True))
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        deadline = time.monotonic() + WAIT
        while len(wheel) or len(caplog.records) < 2:
            assert time.monotonic() < deadline, (handler.refused, len(caplog.records))
            fire_all(wheel, handler, time.monotonic() + 0.2)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    if how == "by hand":
        assert lines[0].endswith("; the worker has exited"), lines
        assert lines[1].startswith("2999 more timed-out requests of workers that have exited in the last 1 s"), lines
    else:
        assert "not by the worker it names" in lines[0], lines
        assert lines[1].startswith("2999 more timers were not acted on in the last 1 s"), lines


@pytest.mark.parametrize("kind", [KIND_REQUEST, KIND_GRACEFUL, KIND_KILL], ids=["request", "graceful", "kill"])
def test_handler_signals_no_process_but_a_worker_of_the_wheel_that_added_the_timer(
    kind: int, make_wheel, worker, caplog
) -> None:
    """A record naming a live process that is attached to no wheel: added by
    another process (a request) or by the handler's own (a follow-up, as
    the handler adds them), it gets one WARNING saying why, and no signal."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    stranger = worker()
    wheel.add(0.01, bytes([kind]) + record_for(stranger)[1:])
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True, kill_after=0.1))
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        assert fire_all(wheel, handler, time.monotonic() + 0.5) == 1  # and no follow-up
    assert stranger.poll() is None
    [line] = [r.getMessage() for r in caplog.records]
    assert re.match(rf"timer \d+ names GET /slow \(request r1, worker pid {stranger.pid}\) but is not acted on: ", line)
    if kind == KIND_REQUEST:
        assert f"the timer was added by pid {os.getpid()}, not by the worker it names" in line
    else:
        assert f"pid {stranger.pid} is not a process attached to wheel {wheel.name!r}" in line
    assert line.endswith("; nothing was signalled")


def test_a_flood_of_forged_timers_is_said_in_a_few_lines_and_a_real_timeout_still_logged(
    make_wheel, worker, caplog
) -> None:
    """20,000 timers due at once, each naming a live process that is
    attached to no wheel, and one real request of a worker of the wheel:
    the refusals are counted, and said in one line at once and one line a
    second after (before, one WARNING each: 20,000 lines); the real one is
    logged as ever."""
    wheel = make_wheel(capacity=32768, payload_size=PAYLOAD_SIZE)
    stranger = worker()
    forged = record_for(stranger, "/forged")
    worker("polite", wheel.name, 1.0)
    deadline = time.monotonic() + WAIT
    while len(wheel) == 0:  # its request has started: its timeout comes amid the flood
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for _ in range(20_000):
        wheel.add(0.3, forged)
    handler = TimeoutHandler(wheel.name, TimeoutActions())
    real = "request timed out: GET /slow (request r1"
    summary = "19999 more timers were not acted on in the last 1 s, and nothing signalled; the last: timer "
    deadline = time.monotonic() + WAIT
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        while not all(any(line in r.getMessage() for r in caplog.records) for line in (real, summary)):
            assert time.monotonic() < deadline, (handler.refused, [r.getMessage() for r in caplog.records][:5])
            fire_all(wheel, handler, time.monotonic() + 0.2)
    lines = [r.getMessage() for r in caplog.records]
    refused = [line for line in lines if "not acted on" in line]
    assert handler.refused == 20_000
    assert len(refused) == 2, lines[:5]
    assert refused[0].startswith("timer ") and refused[0].endswith("nothing was signalled")
    assert refused[1].startswith(summary), refused[1]
    assert sum(real in line for line in lines) == 1, lines
    assert stranger.poll() is None


KEPT_WORKER = textwrap.dedent(
    """
    import signal, sys, threading, time
    from shmwheel.contrib import RequestTimer
    timer = RequestTimer(sys.argv[1], float(sys.argv[2]), warn_after=float(sys.argv[3]))
    assert timer.prepare()
    done = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: done.set())
    handle = timer.start("GET", "/slow", "kept")
    print("ready", flush=True)
    done.wait(60)
    timer.finish(handle)
    print("finished", flush=True)
    time.sleep(60)
    """
)


@contextlib.contextmanager
def driving(name: str, actions: TimeoutActions) -> Iterator[shmwheel.Driver]:
    """A Driver with a TimeoutHandler, in a thread of this process."""
    driver = shmwheel.Driver(name, TimeoutHandler(name, actions))
    thread = threading.Thread(target=driver.run)
    thread.start()
    try:
        yield driver
    finally:
        driver.stop()
        thread.join()


@pytest.mark.parametrize("how", ["finished", "exited"])
def test_a_requests_fire_is_kept_in_flight_only_while_its_stages_run(how: str, make_wheel, tmp_path: Path) -> None:
    """A request past its warn_after stage: its own fire is kept in flight
    while the driver holds its timeout stage.  Finished, its worker frees
    the fire itself, driver or none (a driver that took over would
    otherwise begin its stages again); exited, the driver frees it once
    the timeout stage finds it gone.  (Before, the first stayed in flight
    until a new driver took it, and the second for good.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    with script_processes(tmp_path, KEPT_WORKER, "kept") as run:
        proc = run([wheel.name, "1.0", "0.2"])
        with driving(wheel.name, TimeoutActions(tracebacks=False)):
            wait_until(lambda: wheel.stats().in_flight == 1, "its warn_after stage, its fire kept")
            if how == "exited":
                proc.kill()
                proc.wait()
                wait_until(lambda: wheel.stats().in_flight == 0, "its timeout stage to find it gone")
                return
        assert wheel.stats().in_flight == 1  # the driver stopped: kept for the next one
        proc.send_signal(signal.SIGUSR1)
        assert proc.stdout is not None and proc.stdout.readline() == "finished\n"
        assert wheel.stats().in_flight == 0  # freed by its worker, with no driver to hand it to


def test_a_kept_fire_whose_request_finishes_while_it_waits_begins_no_stage(make_wheel, worker, caplog) -> None:
    """A new driver is handed a request's kept fire and waits for the dead
    driver's follow-ups to be due before it begins the stages again; the
    worker says meanwhile that the request has finished: nothing begins.
    (Before, the word was dropped, and the stage began again at the end
    of the wait: the worker, which forgets ended requests, was asked for a
    stack it would not write, dumped, and with kill on, killed.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("polite", wheel.name, 60.0)
    payload = record_for(proc)
    handler = TimeoutHandler(wheel.name, TimeoutActions(tracebacks=True, kill=True))
    handler.took_over(12345, 1)
    now = time.monotonic_ns()
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        kept = handler(shmwheel.Fire(7, now, now, payload, proc.pid, True, True))
        assert kept is shmwheel.KEEP_IN_FLIGHT  # its stages wait: kept still
        handler(shmwheel.Fire(8, now, now, with_kind(payload, KIND_FINISHED), proc.pid))
        waited = handler(shmwheel.Fire(9, now, now, with_kind(payload, KIND_LATE), os.getpid()))
    lines = [r.getMessage() for r in caplog.records]
    assert waited is None and not any("request timed out" in line or "begin again" in line for line in lines), lines
    assert proc.poll() is None


def test_the_timers_of_a_process_refused_a_moment_ago_are_refused_unread(make_wheel, worker, caplog) -> None:
    """A forger's timers, added by a process of its own that is attached
    to the wheel: the first is read and refused; the rest, for USE_TTL,
    are refused unread - its owner pid is enough, so not even a payload
    that is no record is read - and counted and said all the same.  The
    driver's own fires are read as ever, and past USE_TTL the forger's are
    read again."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    stranger, forger = worker(), worker("polite", wheel.name, 60.0)  # the forger attached: a producer of the wheel
    handler = TimeoutHandler(wheel.name, TimeoutActions(tracebacks=False))
    handler.USE_TTL = 0.5
    now = time.monotonic_ns()

    def fire(payload: bytes, owner: int, kept: bool = False) -> shmwheel.Fire:
        return shmwheel.Fire(1, now, now, payload, owner, kept, kept)

    forged = record_for(stranger, "/forged")
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        handler(fire(forged, forger.pid))
        for _ in range(1000):
            handler(fire(b"junk", forger.pid))
        handler(fire(b"junk", os.getpid()))
        handler(fire(b"junk", forger.pid, kept=True))  # a driver kept it: read, whoever added it
        handler(fire(with_kind(forged, KIND_FINISHED), forger.pid))  # a worker's word: read, believed
        # What the dispatcher takes out of its batches unread, those words
        # left in (shmwheel.Driver): the same process, for the same time.
        owners, spare = handler.refuses_unread()
        assert owners == [forger.pid] and sorted(spare) == sorted((KIND_ANSWER, KIND_FINISHED, KIND_RELEASED))
        handler.refused_unread(500, 7, forger.pid)
        time.sleep(0.6)
        assert handler.refuses_unread()[0] == []
        handler(fire(b"junk", forger.pid))
        time.sleep(1.2)  # the summary of the last second
    lines = [r.getMessage() for r in caplog.records]
    assert handler.refused == 1501
    assert sum("carries no request record" in line for line in lines) == 3, lines  # this driver's, kept, past USE_TTL
    unread = f"it was added by pid {forger.pid}, whose timers were refused a moment ago; nothing was signalled"
    assert [line for line in lines if "1500 more timers were not acted on" in line][0].endswith(unread), lines
    assert "timer 7 is not acted on" in [line for line in lines if "1500 more" in line][0]
    assert stranger.poll() is None


def test_a_record_naming_the_driver_itself_is_refused(make_wheel, caplog) -> None:
    """The driver maps the wheel, so the kernel's word holds for it too: a
    record naming the driver's own process (here this one, which adds the
    timer and runs the handler) is refused all the same, before any line
    about a timeout.  (Before, a forger could have the driver SIGTERM
    itself after every restart.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    start = start_time(os.getpid())
    assert start is not None
    wheel.add(0.01, encode_request(KIND_REQUEST, os.getpid(), start, time.monotonic_ns(), "GET", "self", "/",
                                   stack_signal=signal.SIGURG))  # fmt: skip
    handler = TimeoutHandler(wheel.name, TimeoutActions())
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        fire_all(wheel, handler, time.monotonic() + 0.3)
    [line] = [r.getMessage() for r in caplog.records]
    assert f"but is not acted on: pid {os.getpid()} is this driver" in line, line
    assert handler.refused == 1


def test_a_worker_tells_its_late_requests_to_each_new_driver_even_after_a_gap_with_none() -> None:
    """The worker's word to a new driver (RequestTimer.tell_again), with the
    wheel's driver read as: the one that asked, none for a while (it
    stopped cleanly), another, the same again, a third with the second's
    pid.  Each new one hears of the late request once; the one that asked
    and the gap hear nothing.  (Before, a gap with no driver made the next
    one a first sighting, and it was never told.)"""
    from types import SimpleNamespace

    timer = RequestTimer("shmwheel-test-tell-again", 1.0)
    payload = encode_request(KIND_REQUEST, os.getpid(), 1, 2, "GET", "late", "/")
    drivers = iter([(100, 1), (0, 0), (200, 2), (200, 2), (200, 3)])
    told: list[tuple[int, int]] = []
    seen: list[tuple[int, int]] = []

    class Wheel:
        def raw_stats(self) -> SimpleNamespace:
            pid, start = next(drivers)
            seen.append((pid, start))
            return SimpleNamespace(driver_pid=pid, driver_start=start)

    timer._wheel = Wheel()  # type: ignore[assignment]
    timer.active = lambda: {7: SimpleNamespace(payload=payload)}  # type: ignore[method-assign]
    timer._tell = lambda p, kind: told.append((kind, seen[-1][0]))  # type: ignore[method-assign]
    for _ in range(5):
        timer.tell_again({(payload, True)})
    assert told == [(KIND_LATE, 200), (KIND_LATE, 200)]  # the second: pid 200 again, but another driver


def test_handler_reports_a_timer_that_is_not_a_request(make_wheel, caplog) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    wheel.add(0.01, b"something else")
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        fire_all(wheel, TimeoutHandler(wheel.name), time.monotonic() + 0.2)
    assert "carries no request record" in caplog.text


# -- the worker's timer and the middleware ------------------------------------------------


def test_request_timer_adds_and_cancels_owned_by_the_worker(make_wheel) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(wheel.name, 30.0, traceback_signal=None)
    handle = timer.start("GET", "/x")
    assert handle is not None and len(wheel) == 1
    assert [pid for pid, _, _ in wheel.producers()] == [os.getpid()]
    timer.finish(handle)
    assert len(wheel) == 0
    timer.finish(None)  # a request that had no timer


def test_request_timer_without_a_wheel_lets_requests_run(name: str, caplog) -> None:
    timer = RequestTimer(name, 1.0, traceback_signal=None)
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        assert timer.start("GET", "/") is None
        assert timer.start("GET", "/") is None
    assert caplog.text.count("requests run without a timeout") == 1  # not once per request


def _a_second_later(timer: RequestTimer) -> None:
    """Make the timer's next start() its once-a-second look at the wheel."""
    timer._look_at = 0
    if timer._fast is not None:  # the C path looks when its own time comes
        timer._fast.look_at = 0


def test_request_timer_follows_its_wheel_when_it_is_replaced(name: str, caplog) -> None:
    """Removed or replaced under a worker: the next request attaches the name
    again; a request that started in the old wheel is still cancelled there."""
    old = shmwheel.create(name, capacity=16, payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(name, 30.0, traceback_signal=None)
    before = timer.start("GET", "/before")
    assert before is not None and len(old) == 1
    shmwheel.unlink(name)  # marks it removed: the next add knows at once
    new = shmwheel.create(name, capacity=16, payload_size=PAYLOAD_SIZE)
    try:
        after = timer.start("GET", "/after")
        assert after is not None and len(new) == 1
        timer.finish(before)
        timer.finish(after)
        assert (len(old), len(new)) == (0, 0), "a request's timer was left behind"
        # Removed by hand (rm in /dev/shm): nothing marks it, so the worker
        # finds out when it next looks at the name, within a second.
        os.unlink(f"/dev/shm/{name}")
        newer = shmwheel.create(name, capacity=16, payload_size=PAYLOAD_SIZE)
        try:
            _a_second_later(timer)
            assert timer.start("GET", "/later") is not None
            assert (len(new), len(newer)) == (0, 1)
            # And removed with nothing in its place: requests run without a timer, said once.
            shmwheel.unlink(name)
            with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
                assert timer.start("GET", "/orphan") is None
                assert timer.start("GET", "/orphan") is None
            assert caplog.text.count("requests run without a timeout") == 1
        finally:
            newer.close()
    finally:
        old.close()
        new.close()


def test_a_request_started_before_its_wheel_went_is_cancelled_there_even_with_no_wheel_to_follow(name: str) -> None:
    """rm /dev/shm/NAME (or systemd-logind's RemoveIPC) under a running driver:
    the worker finds nothing to attach, yet the request that ends in time must
    still be cancelled in the old wheel, which the driver still drives."""
    old = shmwheel.create(name, capacity=16, payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(name, 30.0, traceback_signal=None)
    try:
        h = timer.start("GET", "/finished-in-time")
        os.unlink(f"/dev/shm/{name}")
        _a_second_later(timer)
        assert timer.start("GET", "/other") is None  # nothing to attach to
        timer.finish(h)
        assert len(old) == 0, "the finished request's timer would still fire"
    finally:
        old.close()


def test_request_timer_threads_replacing_and_finishing_raise_nothing(name: str) -> None:
    """finish() in some threads while another replaces the wheel (what a
    thread does when its add says the wheel was removed) as fast as it can:
    no AttributeError or closed-Wheel ValueError escapes into a request."""
    shmwheel.create(name, capacity=1024, payload_size=PAYLOAD_SIZE).close()
    timer = RequestTimer(name, 30.0, traceback_signal=None)
    assert timer.prepare()
    errors: list[BaseException] = []
    stop = threading.Event()

    def finisher() -> None:
        while not stop.is_set():
            try:
                timer.finish(12345)
            except BaseException as exc:
                errors.append(exc)

    def replacer() -> None:
        while not stop.is_set():
            current = timer._wheel
            if current is not None:
                timer._replaced(current)
            timer._ready()

    threads = [threading.Thread(target=finisher) for _ in range(3)] + [threading.Thread(target=replacer)]
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes
    try:
        for t in threads:
            t.start()
        time.sleep(3.0)
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(old_interval)
    assert errors == []


def test_request_timer_with_a_full_wheel_lets_requests_run(make_wheel, caplog) -> None:
    wheel = make_wheel(capacity=1, payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(wheel.name, 30.0, traceback_signal=None)
    first = timer.start("GET", "/1")
    assert first is not None
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        assert timer.start("GET", "/2") is None
    assert "a request runs without a timeout" in caplog.text
    # Finished, as a server finishes it: a request left in progress here would
    # be reported as overdue by a later test's look at this process's requests.
    timer.finish(first)


def test_request_timer_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="invalid wheel name"):
        RequestTimer("a b", 1.0)
    with pytest.raises(ValueError, match="positive"):
        RequestTimer("ok", 0)
    with pytest.raises(ValueError, match="no signal"):
        RequestTimer("ok", 1.0, traceback_signal="SIGNOPE")


def test_request_timer_in_a_forked_child_is_the_childs(make_wheel) -> None:
    """A worker forked after the timer was used adds timers of its own (cancelled if it dies)."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(wheel.name, 30.0, traceback_signal=None)
    timer.finish(timer.start("GET", "/in-the-parent"))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: add a timer and die without cancelling it
        try:
            handle = timer.start("GET", "/in-the-child")
            os.write(w, b"1" if handle is not None else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    assert len(wheel) == 1
    assert wheel.reap_dead_producers() == 1  # it was the child's, so it went with the child
    assert len(wheel) == 0


def test_middleware_times_the_whole_response_and_cancels_on_close(make_wheel) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    seen: list[object] = []

    def app(environ, start_response):
        seen.append(environ["shmwheel.timer"])
        start_response("200 OK", [])
        yield b"a"
        yield b"b"

    mw = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None)
    body = mw({"REQUEST_METHOD": "GET", "PATH_INFO": "/caf\xc3\xa9"}, lambda *a: None)
    assert len(wheel) == 1  # the app has returned, the body is not sent yet
    assert b"".join(body) == b"ab"
    assert len(wheel) == 1  # sent, but the server has not closed it yet
    body.close()  # PEP 3333: the server closes the body once it is sent
    assert len(wheel) == 0 and wheel.stats().cancelled == 1

    # The timer carries the request, path and all, should it fire.
    body = mw({"REQUEST_METHOD": "GET", "PATH_INFO": "/caf\xc3\xa9"}, lambda *a: None)
    assert b"".join(body) == b"ab"
    [fire_payload] = [decode_request(f.payload) for f in wheel.poll(time.monotonic() + 3600)]
    assert fire_payload is not None and fire_payload.path == "/café"  # PEP 3333's latin-1, read back as UTF-8
    body.close()  # after the fire: nothing left to cancel
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


def test_middleware_cancels_when_the_body_is_closed_or_the_app_raises(make_wheel) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    closed: list[bool] = []

    class Body(list):  # type: ignore[type-arg]
        def close(self) -> None:
            closed.append(True)

    mw = TimeoutMiddleware(lambda e, s: Body([b"x"]), wheel.name, 30.0, traceback_signal=None)
    body = mw({"REQUEST_METHOD": "GET", "PATH_INFO": "/"}, lambda *a: None)
    assert len(wheel) == 1
    body.close()  # type: ignore[attr-defined]
    assert closed == [True] and len(wheel) == 0

    def broken(environ, start_response):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        TimeoutMiddleware(broken, wheel.name, 30.0, traceback_signal=None)({}, lambda *a: None)
    assert len(wheel) == 0
    with pytest.raises(TypeError, match="WSGI application"):
        TimeoutMiddleware("app", wheel.name, 1.0)  # type: ignore[arg-type]


# -- the supervisor ---------------------------------------------------------------------


def driver_pid(name: str) -> int | None:
    with shmwheel._wheel.observe(name) as w:
        return w.stats().driver_pid


def wait_until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    give_up = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < give_up, what
        time.sleep(0.02)


def test_supervisor_restarts_a_dead_driver_and_cleans_up(name: str) -> None:
    sup = DriverSupervisor(name, TimeoutActions(tracebacks=False))
    sup.start()
    try:
        first = sup.pid
        assert first is not None and driver_pid(name) == first
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: sup.restarts == 1, "the driver was not restarted")
        assert driver_pid(name) == sup.pid != first
        second = sup.pid
        sup.restart(TimeoutActions(kill=True))
        assert sup.pid != second and driver_pid(name) == sup.pid
        assert "--kill" in " ".join(open(f"/proc/{sup.pid}/cmdline").read().split("\0"))
    finally:
        last = sup.pid
        sup.stop()
    assert not Path("/dev/shm", name).exists()
    assert last is not None and not os.path.exists(f"/proc/{last}")


def test_supervisor_restarts_a_crash_loop_at_once_and_says_so_once(name: str, caplog) -> None:
    """Five deaths in a row: each driver is restarted as soon as it may be
    (twice a second at most), not after a backoff that doubles (1, 2, 4, 8,
    16 s: 31 s in all), which left requests untimed; one ERROR line says it."""
    sup = DriverSupervisor(name, TimeoutActions(tracebacks=False))
    sup.start()
    try:
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, "shmwheel.timeouts"):
            for n in range(1, 6):
                pid = sup.pid
                assert pid is not None
                os.kill(pid, signal.SIGKILL)
                wait_until(lambda n=n: sup.restarts == n and driver_pid(name) == sup.pid, "not restarted")
        assert time.monotonic() - started < 15.0  # the doubling backoff alone took 31 s
        died = [r.getMessage() for r in caplog.records if "the driver (pid" in r.getMessage()]
        assert len(died) == 1 and "was killed by SIGKILL after" in died[0], died
    finally:
        sup.stop()


def test_supervisor_keeps_the_driver_out_of_the_servers_process_group(name: str) -> None:
    # A terminal's Ctrl-C goes to the foreground process group: the server's.
    # The driver must not get it behind the server's back (the watcher would
    # log its death and start another while the server shuts down); the
    # server's stop() stops it.
    sup = DriverSupervisor(name, TimeoutActions(tracebacks=False))
    sup.start()
    try:
        assert sup.pid is not None
        assert os.getpgid(sup.pid) == sup.pid != os.getpgid(0)
    finally:
        sup.stop()
    assert sup.restarts == 0 and not Path("/dev/shm", name).exists()


def test_supervisor_refuses_a_wheel_with_a_live_driver_and_replaces_a_stale_one(name: str, caplog) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = shmwheel.create(name, capacity=10)
    assert lib.shmw_driver_register(stale.core, gone.pid, 1, 0, 0) == 0  # its driver died
    stale.close()
    first = DriverSupervisor(name)
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        first.start()
    try:
        assert "replacing a segment left over from a server that is gone" in caplog.text
        with pytest.raises(shmwheel.DriverRunningError, match="is in use"):
            DriverSupervisor(name).start()
    finally:
        first.stop()


#: What create_wheel says of a wheel of capacity 10 and the default record size.
OTHER_SIZE = "capacity 10, tick 0.001 s and records of 64 bytes, not 65536, 0.001 s and 256"


def test_a_sound_wheel_no_driver_runs_on_is_taken_over_with_its_timers(name: str, caplog) -> None:
    """What a driver restarted by a process manager finds (--create), while
    the workers go on adding to the wheel: it is kept, timers and all."""
    assert create_wheel(name) is True
    with shmwheel.attach(name) as worker:
        h = worker.add(3600.0, b"a request in progress")
        with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
            assert create_wheel(name) is False
        assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
            ("INFO", f"wheel {name!r}: taking over a wheel no driver runs on; its 1 timer stay")
        ]
        assert worker.cancel(h), "the wheel was replaced under the worker"


def test_a_wheel_that_is_not_sound_is_replaced_not_taken_over(name: str, caplog) -> None:
    create_wheel(name)
    with shmwheel._wheel.observe(name) as old:
        ffi.cast("struct shmw_header *", old._buf).free_count -= 1  # a scribble
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        assert create_wheel(name) is True
    assert "replacing a segment no driver runs on (segment" in caplog.text
    assert "counters: free_count is 65535 but 65536 entries are free);" in caplog.text


def test_an_empty_wheel_of_another_size_is_replaced_without_a_warning(name: str, caplog) -> None:
    shmwheel.create(name, capacity=10).close()
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        create_wheel(name)
    assert [r.levelname for r in caplog.records] == ["INFO"]
    assert (
        "replacing a segment no driver runs on (OTHER); it holds no timers".replace(
            "OTHER", "capacity 10, tick 0.001 s and records of 64 bytes, not 65536, 0.001 s and 256"
        )
        in caplog.text
    )


def test_a_wheel_no_driver_runs_on_with_timers_pending_is_replaced_with_a_warning_that_counts_them(
    name: str, caplog
) -> None:
    """`shmwheel create` and a timer an hour away: --create may replace it, not silently."""
    kept = shmwheel.create(name, capacity=10)
    kept.add(3600.0, b"somebody's timer")
    kept.add(60.0, b"a request of a worker that is gone")
    kept.close()
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        create_wheel(name)
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            f"wheel {name!r}: replacing a segment no driver runs on ({OTHER_SIZE}); dropping its 2 pending timers",
        )
    ]
    with shmwheel.attach(name) as fresh:
        assert len(fresh) == 0


def test_a_wheel_whose_driver_died_is_replaced_with_a_warning_that_counts_its_timers(name: str, caplog) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = shmwheel.create(name, capacity=10)
    stale.add(60.0)
    assert lib.shmw_driver_register(stale.core, gone.pid, 1, 0, 0) == 0
    stale.close()
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        create_wheel(name)
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        f"wheel {name!r}: replacing a segment left over from a server that is gone "
        f"(its driver, pid {gone.pid}, died; {OTHER_SIZE}); dropping its 1 pending timer"
    )


@pytest.mark.parametrize(
    ("data", "match", "remove_with"),
    [
        (b"another program's bytes", "is not a shmwheel segment", "rm /dev/shm/{name}"),
        (b"", "is not an initialised shmwheel segment", "rm /dev/shm/{name}"),
        (struct.pack("<QI", lib.SHMW_MAGIC, 999), "has another layout version", "shmwheel unlink {name}"),
    ],
    ids=["foreign", "zeros", "future-version"],
)
def test_create_wheel_leaves_a_segment_it_cannot_read_as_a_wheel_alone(
    name: str, data: bytes, match: str, remove_with: str
) -> None:
    """Not a wheel, or not one this build reads: an error naming it and how to remove it, and it stays."""
    foreign_segment(name, data)
    with pytest.raises(shmwheel.IncompatibleSegmentError) as info:
        create_wheel(name)
    message = str(info.value)
    assert message.startswith(f"segment {name!r} {match}")
    assert f"not replacing it; if nothing uses it, remove it yourself: {remove_with.format(name=name)}" in message
    assert Path("/dev/shm", name).read_bytes()[: len(data)] == data


def test_a_driver_whose_parent_is_killed_removes_the_wheel(name: str, tmp_path: Path) -> None:
    """SIGKILL the process that runs the supervisor: its driver stops and takes the wheel with it."""
    code = (
        "from shmwheel.contrib import DriverSupervisor as S\n"
        f"s = S({name!r})\ns.start()\nprint(s.pid, flush=True)\ninput()"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert Path("/dev/shm", name).exists()
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: not Path("/dev/shm", name).exists(), "the wheel outlived its server")
    wait_until(lambda: start_time(child) is None, "the driver outlived its server")


def test_a_driver_outlives_the_thread_that_started_it_and_not_its_process(name: str) -> None:
    """The thread that spawned the driver exits: the driver runs on.  The
    process is killed later: the driver goes, and the wheel with it."""
    code = (
        "import threading, time\n"
        "from shmwheel.contrib import DriverSupervisor as S\n"
        f"s = S({name!r})\n"
        "t = threading.Thread(target=s.start)\nt.start()\nt.join()\n"
        "print(s.pid, flush=True)\n"
        "input()\n"
        "print(s.pid, s.restarts, flush=True)\n"
        "input()"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdin is not None and parent.stdout is not None
        child = int(parent.stdout.readline())
        child_start = start_time(child)
        time.sleep(1.0)  # a driver stopped by the thread's exit would be gone by now
        assert start_time(child) == child_start, "the driver stopped when the thread that started it exited"
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().split() == [str(child), "0"]
        with shmwheel.attach(name) as wheel:
            assert wheel.stats().driver_pid == child
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: not Path("/dev/shm", name).exists(), "the wheel outlived its server")
    wait_until(lambda: start_time(child) is None, "the driver outlived its server")


# -- the servers' settings ------------------------------------------------------------------


def test_gunicorn_install_defines_hooks_gunicorn_accepts_and_keeps_earlier_ones() -> None:
    from gunicorn.config import Config

    calls: list[str] = []
    namespace: dict[str, object] = {"post_request": lambda worker, req, environ, resp: calls.append("theirs")}
    contrib_gunicorn.install(namespace, timeout=5, kill=True, kill_signal="TERM")
    cfg = Config()
    for hook in contrib_gunicorn._HOOKS:
        cfg.set(hook, namespace[hook])  # gunicorn checks each hook's arity here

    class Req:
        headers = [("X-REQUEST-ID", "abc")]

    namespace["post_request"](None, Req(), {}, None)  # type: ignore[operator]
    assert calls == ["theirs"]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"timeout": 0}, ValueError), ({"timeout": "5"}, TypeError), ({"timeout": 5, "kill_signal": "X"}, ValueError)],
)
def test_gunicorn_install_checks_its_arguments(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        contrib_gunicorn.install({}, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="globals"):
        contrib_gunicorn.install([], timeout=5)  # type: ignore[arg-type]


def test_uwsgi_settings_read_the_ini_options() -> None:
    opts = {
        "shmwheel-timeout": b"2.5",
        "shmwheel-kill": [b"false", b"yes"],  # given twice: the last one counts
        "shmwheel-kill-signal": b"QUIT",
        "shmwheel-tracebacks": True,  # a bare flag
        "shmwheel-capacity": b"100",
    }
    s = uwsgi_settings(opts, 4321)
    assert s.name == "uwsgi-4321" and s.timeouts.timeout == 2.5 and s.timeouts.capacity == 100
    assert s.timeouts.actions == TimeoutActions(kill=True, kill_signal=signal.SIGQUIT, tracebacks=True)


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({}, "no shmwheel-timeout option"),
        ({"shmwheel-timeout": b"soon"}, "shmwheel-timeout must be a number"),
        ({"shmwheel-timeout": b"-1"}, "positive"),
        ({"shmwheel-timeout": b"1", "shmwheel-kill": b"maybe"}, "shmwheel-kill must be true or false"),
        ({"shmwheel-timeout": b"1", "shmwheel-kill-signal": b"NOPE"}, "no signal named"),
    ],
)
def test_uwsgi_settings_name_the_bad_option(opts: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        uwsgi_settings(opts, 1)


def test_the_driver_command_creates_and_removes_its_wheel(name: str) -> None:
    """``python -m shmwheel.contrib.timeouts NAME --create``, for servers without a master to run it."""
    cmd = [sys.executable, "-m", "shmwheel.contrib.timeouts", name, "--create", "--kill", "--kill-signal=INT"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: Path("/dev/shm", name).exists() and driver_pid(name) == proc.pid, "no driver")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 0, err
    assert not Path("/dev/shm", name).exists()
    bad = subprocess.run([*cmd[:4], "--kill-signal=NOPE"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no signal named 'NOPE'" in bad.stderr
    assert not Path("/dev/shm", name).exists()


def run_driver_command(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "shmwheel.contrib.timeouts", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT, **kwargs)  # type: ignore[call-overload]


def test_the_driver_command_reports_a_bad_name_as_a_usage_error() -> None:
    proc = run_driver_command("bad/name")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "python -m shmwheel.contrib.timeouts: error: invalid wheel name 'bad/name': "
        "use 1-200 characters of A-Z a-z 0-9 . _ - (a leading / is allowed and ignored)"
    )


def _file_size_limit_1_mib() -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # inherited: posix_fallocate fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_the_driver_command_reports_an_os_error_in_one_line(name: str) -> None:
    """--create under a file size limit smaller than the wheel: one line and status 1, no traceback."""
    proc = run_driver_command(name, "--create", preexec_fn=_file_size_limit_1_mib)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == ["python -m shmwheel.contrib.timeouts: File too large"]
    assert not Path("/dev/shm", name).exists()


def test_the_driver_command_does_not_replace_another_programs_segment(name: str) -> None:
    foreign_segment(name, b"someone else's")
    proc = run_driver_command(name, "--create")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"python -m shmwheel.contrib.timeouts: segment {name!r} is not a shmwheel segment: not replacing it; "
        f"if nothing uses it, remove it yourself: rm /dev/shm/{name}"
    ]
    assert Path("/dev/shm", name).read_bytes().startswith(b"someone else's")


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ("signal.signal(signal.SIGURG, lambda *a: None)", "caught"),
        # The kernel blocks a signal in the thread that runs its handler: still caught.
        ("signal.signal(signal.SIGURG, lambda *a: None); signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGURG})",
         "caught"),
        ("signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGURG})", "blocked"),
        ("signal.signal(signal.SIGURG, signal.SIG_IGN)", "ignored"),
        ("pass", "default"),
    ],
)  # fmt: skip
def test_a_signal_with_a_handler_is_caught_even_while_the_main_thread_blocks_it(setup: str, expected: str) -> None:
    code = f"import signal, sys\n{setup}\nprint('ready', flush=True)\nsys.stdin.read()\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert signal_disposition(proc.pid, signal.SIGURG) == expected
    finally:
        proc.communicate("")
