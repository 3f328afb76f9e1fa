"""The driver's side of a timeout (shmwheel.contrib._handler's
TimeoutHandler) on real worker processes: the request's stack asked
for, faulthandler's dump where no Python runs, SIGTERM then SIGKILL, a
full wheel, a dead driver's stages carried on, and the timers it
refuses (a forger's, a gone process's, its own), said in a few lines."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _contrib import WAIT, wait_until
from conftest import entry, script_processes

import shmwheel
from shmwheel._binding import lib
from shmwheel._process import signal_disposition, start_time
from shmwheel.contrib import (
    KIND_ANSWER,
    KIND_CHECK,
    KIND_GRACEFUL,
    KIND_KILL,
    KIND_REQUEST,
    PAYLOAD_SIZE,
    TimeoutActions,
    TimeoutHandler,
    _handler,
    encode_request,
    signal_process,
)
from shmwheel.contrib._handler import DUMP_ASKED, DUMP_TIME, signal_if
from shmwheel.contrib._record import KIND_END, KIND_FINISHED, KIND_GRACE, KIND_LATE, KIND_RELEASED, with_kind
from shmwheel.contrib._settings import reserve_for

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
        timer = RequestTimer(
            sys.argv[2], float(sys.argv[3]), traceback_signal="USR2" if mode == "lost" else "URG",
            warn_after=0.2 if mode == "warned" else None,
            on_timeout=(lambda record, stack: time.sleep(2)) if mode == "slow-hook" else None,
        )
        assert timer.prepare()
        if mode == "gil":
            from shmwheel._binding import lib
            while not lib.shmw_signal_waiting():  # the reporter at its wait, as in a worker that has served a while
                time.sleep(0.01)
        handle = timer.start("GET", "/slow", "r1")
        assert handle is not None
        if mode == "lost":  # something took the stack signal since its start's look: its default action ends it
            from shmwheel.contrib import decode_request
            signal.signal(decode_request(timer.in_progress()[handle].payload).stack_signal, signal.SIG_DFL)
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
    request".  (Before, the driver raised OSError and the ask was lost.)
    But not the driver's dump, which the worker's gate tells by its value:
    sent plainly, it would pass as an operator's; it is not sent at all."""
    proc = subprocess.Popen([sys.executable, "-c", SIGNAL_WAITER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        start = start_time(proc.pid)
        assert start is not None
        assert not signal_if(proc.pid, start, signal.SIGRTMIN + 5, None, DUMP_ASKED, plain=False)
        assert signal_if(proc.pid, start, signal.SIGRTMIN + 5, None, 12345)
        assert proc.stdout.readline() == "plain\n"
        assert proc.wait(WAIT) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


BYTECODE_HOLDS_THE_GIL = """
import os, signal, subprocess, sys, time
from shmwheel.contrib import _stacks
dump = _stacks.listen(signal.SIGURG, lambda: [])
ask = _stacks.ask_signal()
# As the driver asks, and dumps half a second on, with the value it queues.
asks = f\"\"\"
import os, time
from shmwheel._binding import lib
fd = os.pidfd_open({os.getpid()})
time.sleep(0.3)
lib.shmw_pidfd_sigqueue(fd, {ask}, 12345)
time.sleep(0.5)
lib.shmw_pidfd_sigqueue(fd, {dump}, 1)
\"\"\"
sys.setswitchinterval(1.0)  # bytecode keeps the GIL from the reporter for a second
driver = subprocess.Popen([sys.executable, "-c", asks])
until = time.monotonic() + 2.0
while time.monotonic() < until:
    pass
driver.wait()
print("done", flush=True)
"""


def test_the_drivers_dump_is_not_done_while_bytecode_keeps_the_gil_from_the_reporter() -> None:
    """A worker whose main thread runs bytecode with a switch interval of a
    second (set after the gate was): its reporter, woken by the ask, waits
    for the GIL half a second when the driver's dump comes.  The gate reads
    the interval where the GIL keeps it, and does not dump.  (The first
    gate took 0.3 s of waiting for proof that no Python ran, and dumped.)"""
    done = subprocess.run([sys.executable, "-c", BYTECODE_HOLDS_THE_GIL], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "done\n"), done
    assert "faulthandler's dump of every thread not done" in done.stderr, done.stderr
    assert "most recent call first" not in done.stderr, done.stderr


GATE_KEPT = """
import faulthandler, signal, sys
from shmwheel._binding import lib
from shmwheel.contrib import _stacks
dump = _stacks.listen(signal.SIGURG, lambda: [])
print(lib.shmw_signal_gated(dump), end=" ")
faulthandler.unregister(dump)
faulthandler.register(dump, file=sys.stderr)  # the application's own, after shmwheel's
print(lib.shmw_signal_gated(dump), end=" ")
_stacks.keep_listening()  # once a second, from a request's start
print(lib.shmw_signal_gated(dump))
"""


def test_the_dump_signal_is_gated_again_after_the_application_registers_it() -> None:
    """faulthandler registered anew on the dump signal by the application:
    the look once a second puts the gate back in front of it."""
    done = subprocess.run([sys.executable, "-c", GATE_KEPT], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "1 0 1\n"), done


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


def test_handler_asks_the_worker_for_the_requests_own_stack(make_wheel, worker, caplog, monkeypatch) -> None:
    monkeypatch.setattr(_handler, "DUMP_TIME", 2.0)  # its answer before the look (1 s) on a slow machine
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("polite", wheel.name)
    handler = TimeoutHandler(wheel.name, TimeoutActions())
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        # The request, the worker's answer, and the driver's look for it.
        assert fire_all(wheel, handler, time.monotonic() + 2.0) == 3
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
    assert no_answer.endswith(f"where it can tell that no Python runs; the request's is thread {thread[1]}")
    err = wait_for(proc, "in serving_a_slow_request")
    assert f"Current thread {thread[1]} (most recent call first)" in err  # faulthandler's
    assert "the stack of timed-out request" not in err


def test_a_worker_slow_to_answer_is_not_dumped_while_python_runs_in_it(make_wheel, worker, caplog) -> None:
    """A worker whose on_timeout hook takes 2 s: it has not answered when
    the driver's dump signal comes, though Python runs in it.  The dump is
    not done (faulthandler reads the other threads' frames with no lock,
    and crashed a worker so), and one line says why; the stack comes.
    (Before, faulthandler dumped every thread while the reporter ran.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("slow-hook", wheel.name)
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=False))
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        fire_all(wheel, handler, time.monotonic() + 1.0)
        assert "did not write the stack of GET /slow" in caplog.text  # and sent the dump signal
        err = wait_for(proc, "dump of every thread not done: nothing shows that no Python runs in this worker")
        fire_all(wheel, handler, time.monotonic() + 2.0)
    err = wait_for(proc, "in serving_a_slow_request")
    assert "most recent call first" not in err, err  # faulthandler's
    assert proc.poll() is None


def test_a_stack_signal_the_worker_does_not_catch_is_not_sent(make_wheel, worker, caplog) -> None:
    """The record names the signal, but the worker no longer catches it (its
    default action would end it): the driver says so and falls back to the
    dump signal, which it does catch; the worker, never asked, cannot tell
    that no Python runs in it, and does not dump."""
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
    err = wait_for(proc, "faulthandler's dump of every thread not done: nothing shows that no Python runs")
    assert "most recent call first" not in err
    assert proc.poll() is None


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


def test_a_request_that_ends_after_its_timeout_fired_spares_its_worker_the_kill(
    make_wheel, worker, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timer fired and the worker was asked for the stack; then the
    request ended: the worker says so, and the driver, which would have
    sent the kill signal next, leaves it alone and says why.  (The check
    that would send it comes DUMP_TIME / 2 after the ask: 1 s here, so that
    the worker's end, 0.2 s after its timeout, comes first on a slow machine.)"""
    monkeypatch.setattr(_handler, "DUMP_TIME", 2.0)
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("ends", wheel.name)
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True, kill_after=0.5))
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        fire_all(wheel, handler, time.monotonic() + 2.5)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-1] == f"GET /slow (request r1, worker pid {proc.pid}, thread " + lines[-1].split(", thread ")[1]
    assert lines[-1].endswith(f"has finished since it timed out: worker pid {proc.pid} is left alone")
    assert proc.poll() is None  # no SIGTERM came


def test_handler_kills_a_worker_that_ignores_the_graceful_signal(make_wheel, worker, caplog, monkeypatch) -> None:
    """Both requests of the stubborn worker time out: it is sent SIGTERM once,
    for the first, and SIGKILL ends it; the polite one exits on SIGTERM."""
    monkeypatch.setattr(_handler, "DUMP_TIME", 2.0)  # each answer before its look (1 s) on a slow machine
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    stubborn, polite = worker("stubborn", wheel.name), worker("polite", wheel.name)
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=True, kill_after=0.5))
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        # Each of the three requests and its look; two SIGKILL follow-ups.
        kinds = fire_kinds(wheel, handler, time.monotonic() + 3.5)
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


def test_a_request_that_ran_on_past_its_grace_is_said_to_end_once_and_forgotten_with_its_worker(
    make_wheel, worker, caplog
) -> None:
    """With kill off, a request that has not ended when its interrupt's
    grace is over runs on: the driver still says when its worker tells it
    that the request ended, once however often it is told; and it does not
    keep a request whose worker has died without telling, which it finds
    gone when another request runs on.  (Before, the driver forgot the
    request at the end of its grace, and its end was never said.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    one, two = worker("polite", wheel.name, 60.0), worker("polite", wheel.name, 60.0)
    handler = TimeoutHandler(wheel.name, TimeoutActions(interrupt_grace=0.5))
    now = time.monotonic_ns()

    def fire(payload: bytes, kind: int, owner: int) -> None:
        handler(shmwheel.Fire(-1, now, now, with_kind(payload, kind), owner))

    first, gone, later = record_for(one, "/first"), record_for(two, "/gone"), record_for(one, "/later")
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        fire(first, KIND_GRACE, os.getpid())
        fire(gone, KIND_GRACE, os.getpid())
        fire(first, KIND_FINISHED, one.pid)
        fire(first, KIND_FINISHED, one.pid)  # told again (as it tells every new driver it sees): said once
        two.kill()
        two.wait()
        fire(later, KIND_GRACE, os.getpid())  # /gone's worker is looked for, and is gone
        fire(gone, KIND_FINISHED, two.pid)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("it runs on (kill is off)" in line for line in lines) == 3, lines
    ended = [line for line in lines if " after it was interrupted" in line and "has not ended" not in line]
    assert len(ended) == 1, lines
    assert re.fullmatch(rf"GET /first \(request r1, worker pid {one.pid}\) ended \d+\.\d{{3}} s after it was "
                        r"interrupted", ended[0])  # fmt: skip


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


def test_handler_reports_a_timer_that_is_not_a_request(make_wheel, caplog) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    wheel.add(0.01, b"something else")
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        fire_all(wheel, TimeoutHandler(wheel.name), time.monotonic() + 0.2)
    assert "carries no request record" in caplog.text


def test_an_end_by_hand_asked_as_the_requests_warn_stage_fires_begins_its_timeout_stage(
    make_wheel, worker, caplog
) -> None:
    """``shmwheel end`` asked just as a request's warn_after stage comes:
    the driver is handed the ask while the request's own timer has fired
    and its fire waits, in flight, to be handled next.  There is nothing
    to move, and the fire that comes next begins the timeout stage, by
    hand.  (Before, the ask was said to come after the request's end and
    the fire was taken for its warning: the command waited out the grace
    and said that the request ran on.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("warned", wheel.name, 30.0)
    (own,) = wheel.timers()
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=False))
    held: list[shmwheel.Fire] = []

    def ask_comes_first(fire: shmwheel.Fire) -> object:
        if fire.payload[0] == KIND_END:
            held.append(fire)  # handed over with the warn_after stage's fire, just before it
            return shmwheel.KEEP_IN_FLIGHT
        if fire.handle == own.handle:
            (ask,) = held
            handler(ask)
        return handler(fire)

    driver = shmwheel.Driver(wheel.name, ask_comes_first)
    thread = threading.Thread(target=driver.run)
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        thread.start()
        try:
            wheel.add(0.0, with_kind(own.payload, KIND_END), reserved=True)  # as shmwheel end adds it, from here
            wait_until(lambda: "by hand" in caplog.text, "the end by hand")
        finally:
            driver.stop()
            thread.join()
    text = caplog.text
    assert re.search(
        rf"request ended by hand \(shmwheel end, pid {os.getpid()}, uid {os.getuid()}\): GET /slow \(request r1, "
        rf"worker pid {proc.pid}, ",
        text,
    ), text
    assert "has ended already" not in text and "request is slow" not in text, text
    wait_for(proc, "in serving_a_slow_request")  # the stack its timeout stage asked for
    assert not [t for t in wheel.timers() if t.payload[0] == KIND_END]  # the ask, done, let go of


def test_a_requests_own_timer_moved_by_someone_else_keeps_its_timeout(make_wheel, worker, caplog) -> None:
    """A request's own timer that fires before its timeout, with no end by
    hand behind it (a process that writes the wheel moved it): nothing is
    done then, and its timeout stage still comes at its time.  (Before,
    the fire was passed over, and the request had no timeout left.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("polite", wheel.name, 3.0)
    (own,) = wheel.timers()
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"), driving(wheel.name, TimeoutActions(kill=False)):
        assert wheel.reset(own.handle, 0.0)
        wait_until(lambda: "request timed out" in caplog.text, "its timeout stage")
    text = caplog.text
    assert re.search(rf"timer {own.handle} of GET /slow \(request r1, .*\) fired [\d.]+ s before", text), text
    running = re.search(
        rf"request timed out: GET /slow \(request r1, worker pid {proc.pid}, .*running for ([\d.]+) s", text
    )
    assert running is not None and float(running[1]) >= 2.95, text  # at its time, not at the move
    wait_for(proc, "in serving_a_slow_request")


def driver_dies_after_the_move(wheel: shmwheel.Wheel, own: shmwheel.Timer) -> None:
    """``shmwheel end`` of the request whose own timer is ``own``, asked
    of a driver that moves the timer and stops before its fire: both the
    ask and the fire are left in flight, for the next driver."""
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=False))
    left: list[shmwheel.Fire] = []

    def dies_at_the_fire(fire: shmwheel.Fire) -> object:
        if fire.handle == own.handle:
            left.append(fire)
            return shmwheel.KEEP_IN_FLIGHT  # never handled: the driver is dying
        return handler(fire)

    with contextlib.ExitStack() as stack:
        driver = shmwheel.Driver(wheel.name, dies_at_the_fire)
        thread = threading.Thread(target=driver.run)
        thread.start()
        stack.callback(thread.join)
        stack.callback(driver.stop)
        wheel.add(0.0, with_kind(own.payload, KIND_END), reserved=True)  # as shmwheel end adds it, from here
        wait_until(lambda: left, "the moved timer's fire")
    assert len([t for t in wheel.timers() if t.fired]) == 2  # the ask, and the moved timer's fire


@pytest.mark.parametrize("first", ["ask", "fire"])
def test_an_end_by_hand_whose_driver_died_before_the_moved_timer_fired_is_done_by_the_next(
    first: str, make_wheel, worker, caplog
) -> None:
    """The driver moved the request's timer for ``shmwheel end`` and died
    before its fire: the next driver is handed the ask, kept in flight
    till then, and the fire, in either order, and begins the timeout stage
    by hand, once.  (Before, the ask had been let go at the move, and the
    fire, early, was passed over: the end was lost, and the request left
    with no timeout.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    proc = worker("polite", wheel.name, 30.0)
    (own,) = wheel.timers()
    driver_dies_after_the_move(wheel, own)
    handler = TimeoutHandler(wheel.name, TimeoutActions(kill=False))
    held: list[shmwheel.Fire] = []
    began = False

    def in_order(fire: shmwheel.Fire) -> object:
        nonlocal began
        ours = fire.payload[0] == KIND_END or fire.handle == own.handle
        if ours and (fire.payload[0] == KIND_END) == (first == "ask"):
            began = True
        elif ours and not began:
            held.append(fire)  # the other comes first
            return shmwheel.KEEP_IN_FLIGHT
        result = handler(fire)
        while held:
            late = held.pop()
            if handler(late) is None:
                wheel.acknowledge([late.handle])
        return result

    driver = shmwheel.Driver(wheel.name, in_order)
    thread = threading.Thread(target=driver.run)
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        thread.start()
        try:
            wait_until(lambda: "ended by hand" in caplog.text and not held, "the end by hand")
            wait_for(proc, "in serving_a_slow_request")  # the stack its timeout stage asked for
        finally:
            driver.stop()
            thread.join()
    text = caplog.text
    assert began
    assert text.count("request ended by hand (shmwheel end, pid") == 1, text
    assert re.search(rf"request ended by hand \(shmwheel end, pid {os.getpid()}, uid {os.getuid()}\): GET /slow", text)
    assert "not acted on" not in text and "has ended already" not in text, text
    assert not [t for t in wheel.timers() if t.payload[0] == KIND_END]  # the ask, done, let go of
