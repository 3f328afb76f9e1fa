"""Signals are shared, not taken: an application's own SIGURG handler and
faulthandler registration keep working beside shmwheel's, whichever came
first, and the server's log says once what was done.

The pieces run in fresh interpreters, so that the handlers they set never
reach the test process; then the same under a real Gunicorn with an
application (tests/apps/signals_app.py) that sets both at import and its
SIGURG handler again at a request, after shmwheel's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _servers import (
    GATEWAY_TIMEOUT,
    STUCK_FOR,
    WAIT,
    booted,
    free_port,
    get,
    gunicorn_app,
    pid_of,
    serve,
    stopped_cleanly,
)

PRELUDE = """
import faulthandler, logging, os, signal, sys, time
logging.basicConfig(stream=sys.stdout, format="%(message)s")
from shmwheel._binding import lib
from shmwheel.contrib import _stacks

theirs, woke = [], []
def count(signum, frame):
    theirs.append(signum)
def wait_for(what):
    until = time.monotonic() + 10
    while not what() and time.monotonic() < until:
        time.sleep(0.01)
def owner():
    return {0: "default", 1: "ignored", 2: "shmwheel", 3: "another"}[lib.shmw_signal_owner(signal.SIGURG)]
"""


def fresh(body: str) -> subprocess.CompletedProcess[str]:
    code = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_a_handler_set_before_shmwheel_is_kept_and_called_after_its_own() -> None:
    """Theirs runs after shmwheel's, as it was installed: a Python handler
    that raises still ends a blocking recv in the main thread (no
    SA_RESTART, as CPython installs it), where shmwheel's alone would not."""
    done = fresh("""
        import socket, threading
        signal.signal(signal.SIGURG, count)
        _stacks.listen(signal.SIGURG, lambda: woke.append(1) or [])
        print("owner", owner())
        os.kill(os.getpid(), signal.SIGURG)
        wait_for(lambda: theirs and woke)
        print("theirs", len(theirs), "woke", len(woke))

        class Stop(Exception):
            pass
        def stop(signum, frame):
            raise Stop
        signal.signal(signal.SIGURG, stop)
        _stacks.keep_listening()
        main = threading.get_ident()
        threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGURG)).start()
        a, b = socket.socketpair()
        try:
            a.recv(1)
        except Stop:
            print("recv ended by their handler", flush=True)
    """)
    assert "owner shmwheel\ntheirs 1 woke 1\n" in done.stdout, done.stdout
    assert "recv ended by their handler" in done.stdout, done.stdout
    assert "shmwheel: SIGURG has a Python handler of its own in this process, which is kept" in done.stdout


def test_a_handler_set_after_shmwheel_is_taken_back_at_the_look_and_kept() -> None:
    """The application's signal.signal() after shmwheel's listen: the look
    (once a second, from a request's start) takes the signal back, keeps
    theirs in the chain, and says so once, however many looks see it."""
    done = fresh("""
        _stacks.listen(signal.SIGURG, lambda: woke.append(1) or [])
        signal.signal(signal.SIGURG, count)
        print("owner", owner())
        for _ in range(3):
            _stacks.keep_listening()
        print("owner", owner())
        signal.signal(signal.SIGURG, count)  # again: it was said already
        _stacks.keep_listening()
        os.kill(os.getpid(), signal.SIGURG)
        wait_for(lambda: theirs and woke)
        print("theirs", len(theirs), "woke", len(woke))
    """)
    assert re.search(r"^owner another\n(?:shmwheel: .*\n)?owner shmwheel\n", done.stdout, re.M), done.stdout
    assert "theirs 1 woke 1\n" in done.stdout, done.stdout
    said = re.findall(
        r"shmwheel: SIGURG was given a Python handler of its own in this process after shmwheel's; shmwheel's is back, "
        r"and calls that handler after its own, for every signal",
        done.stdout,
    )
    assert len(said) == 1, done.stdout


def test_a_handler_that_is_not_pythons_is_left_alone_and_said_so() -> None:
    """faulthandler registered on SIGURG with chain=True, after shmwheel: it
    raises the signal again for the handler before it, so the two calling
    each other would recurse until the stack overflows.  shmwheel's look
    leaves it alone and says so, and the signal does no harm; registered
    before, listen() refuses the signal in one line."""
    done = fresh("""
        import tempfile
        sink = tempfile.TemporaryFile("w+")
        _stacks.listen(signal.SIGURG, lambda: woke.append(1) or [])
        faulthandler.register(signal.SIGURG, file=sink, all_threads=True, chain=True)
        print("lost", _stacks.keep_listening() == {signal.SIGURG}, "owner", owner(), flush=True)
        for _ in range(20):
            os.kill(os.getpid(), signal.SIGURG)
        time.sleep(0.1)
        print("alive", flush=True)
    """)
    assert "lost True owner another\nalive\n" in done.stdout, done.stdout + done.stderr
    assert "after shmwheel's that is not a Python one (a C library's, or faulthandler's), which shmwheel leaves " in (
        done.stdout
    )
    refused = fresh("""
        faulthandler.register(signal.SIGURG, file=sys.stderr, all_threads=True)
        try:
            _stacks.listen(signal.SIGURG, lambda: [])
        except OSError as exc:
            print("refused:", exc)
    """)
    assert "refused: [Errno 16] SIGURG has a handler of its own in this process that is not a Python one" in (
        refused.stdout
    ), refused.stdout


def test_an_applications_faulthandler_registration_is_left_to_it() -> None:
    """SIGRTMIN registered by the application (to a file of its own): shmwheel
    dumps on SIGRTMIN+1, and each signal's dump goes where its owner said."""
    done = fresh("""
        import tempfile
        mine = tempfile.TemporaryFile("w+")
        faulthandler.register(signal.SIGRTMIN, file=mine, all_threads=True)
        dump = _stacks.listen(signal.SIGURG, lambda: [])
        print("dump", dump - signal.SIGRTMIN, flush=True)
        os.kill(os.getpid(), signal.SIGRTMIN)
        mine.seek(0)
        print("theirs got", "(most recent call first)" in mine.read())
        sys.stdout.flush()
        os.kill(os.getpid(), dump)
        time.sleep(0.1)
    """)
    assert "dump 1\ntheirs got True\n" in done.stdout, done.stdout
    assert re.search(r"shmwheel: SIGRTMIN has a handler of its own in this process \(a faulthandler registration of "
                     r"the application's\?\), which is left to it: every thread's stack is dumped on SIGRTMIN\+1",
                     done.stdout), done.stdout  # fmt: skip
    assert "(most recent call first)" in done.stderr, done.stderr


def test_a_record_names_the_dump_signal_its_worker_uses_and_the_driver_sends_it() -> None:
    """What the driver accepts: a real-time signal of DUMP_SIGNALS, not another."""
    from shmwheel.contrib._handler import TimeoutHandler
    from shmwheel.contrib._record import DUMP_SIGNALS, KIND_REQUEST, decode_request, encode_request

    handler = TimeoutHandler("shmwheel-signals-no-such-wheel")
    for signum, sent in ((signal.SIGRTMIN + 1, signal.SIGRTMIN + 1), (signal.SIGRTMIN + 9, 0)):
        payload = encode_request(KIND_REQUEST, 1, 2, 3, "GET", "r", "/", stack_signal=0, dump_signal=signum)
        record = decode_request(payload)
        assert record is not None
        handler._catches = lambda record, signum: bool(signum)  # type: ignore[method-assign]
        assert handler._stack_signals(record, True) == (0, sent)
    assert DUMP_SIGNALS[0] == signal.SIGRTMIN and len(DUMP_SIGNALS) == 8


# -- under Gunicorn ---------------------------------------------------------------


def test_an_applications_own_signal_handlers_work_beside_shmwheels_under_gunicorn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The application sets SIGURG's handler and registers SIGRTMIN with
    faulthandler at import, and SIGURG's again at a request.  The log says
    each once; a stuck request is still interrupted (a 504), asked on
    SIGRTMIN+2, the first real-time signal nobody has; the application's
    handler sees an operator's SIGURG through shmwheel's; SIGRTMIN still
    writes to the application's file, and the dump shmwheel asks for
    (SIGRTMIN+1) to the server's log."""
    dump_file = tmp_path / "app-dump.txt"
    monkeypatch.setenv("SIGNALS_APP_DUMP", str(dump_file))
    port = free_port()
    install = "timeout=1.0, interrupt=True"
    # The sync worker: a request runs in the main thread, where signal.signal() may be called.
    cmd = gunicorn_app(tmp_path, port, "sync", "--workers", "1", install=install, app="signals_app:app")
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        pid = pid_of(get(port, "/"))
        worker = rf"\[{pid}\] \[WARNING\] shmwheel: "
        server.wait_for(worker + r"SIGURG has a Python handler of its own in this process, which is kept")
        server.wait_for(worker + r"SIGRTMIN has a handler of its own in this process .*: every thread's stack is "
                        r"dumped on SIGRTMIN\+1$")  # fmt: skip
        assert pid_of(get(port, "/retake")) == pid
        # The look, once a second from a request's start, takes it back.
        give_up = time.monotonic() + WAIT
        while not re.search(worker + "SIGURG was given a Python handler of its own", server.log()):
            assert time.monotonic() < give_up, server.log()[-3000:]
            get(port, "/")
            time.sleep(0.2)
        assert get(port, f"/spin?s={STUCK_FOR}", WAIT, "spun") == GATEWAY_TIMEOUT
        # The driver asks on the next free real-time signal, where asks queue.
        spun = r"request timed out: GET /spin \(request spun, .*\), running for [\d.]+ s; asking it to end the request"
        server.wait_for(spun + r" \(SIGRTMIN\+2\)")
        assert get(port, "/count") == (200, "0 SIGURG\n")
        os.kill(pid, signal.SIGURG)  # an operator's ask, through shmwheel's handler, reaches the application's
        give_up = time.monotonic() + WAIT
        while get(port, "/count") != (200, "1 SIGURG\n"):
            assert time.monotonic() < give_up
            time.sleep(0.05)
        assert dump_file.read_text() == ""
        # One signal at a time: faulthandler writes one dump at a time in a
        # process and drops one asked for while another is being written
        # (its guard against reentry is one flag for every signal).
        os.kill(pid, signal.SIGRTMIN)
        give_up = time.monotonic() + WAIT
        while "(most recent call first)" not in dump_file.read_text():
            assert time.monotonic() < give_up
            time.sleep(0.05)
        assert "(most recent call first)" not in server.log()
        # Asked again until it comes: one asked while the first was still
        # being written would be dropped.
        give_up = time.monotonic() + WAIT
        while not re.search(r"Thread 0x[0-9a-f]+ \(most recent call first\)", server.log()):
            assert time.monotonic() < give_up
            os.kill(pid, signal.SIGRTMIN + 1)
            time.sleep(0.5)
        assert pid_of(get(port, "/")) == pid and booted(server) == 1
