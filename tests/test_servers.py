"""End to end: request timeouts in real Gunicorn and uWSGI servers on loopback.

Each test starts the server as a user would, with the configurations in
``examples/`` (or a variant written next to them), sends it real HTTP
requests, reads what the server and the driver write to its log, and stops
it with a real signal.  The demo application's ``/sleep`` and ``/stuck``
routes stand for requests that hang: ``/stuck`` survives the graceful
signal, so only the SIGKILL that follows ends it.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import re
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from _servers import (
    ASKED,
    BIN,
    DRIVER_TIMED_OUT,
    EXAMPLES,
    STUCK_ROUTES,
    WAIT,
    Server,
    assert_nothing_left,
    assert_nothing_left_of_asgi,
    auto_driver_of,
    free_port,
    get,
    live_members,
    no_segment,
    own_stack,
    serve,
    serve_asgi,
    timed_out_line,
    uwsgi_ini,
    where_they_wait,
)

import shmwheel
from shmwheel._process import start_time


def gunicorn(config: Path, port: int, worker_class: str) -> list[str]:
    env_free = ["--bind", f"127.0.0.1:{port}", "--worker-class", worker_class]
    if worker_class == "gthread":
        env_free += ["--threads", "4"]
    return [str(BIN / "gunicorn"), "-c", str(config), *env_free, "--no-control-socket", "app:application"]


@pytest.mark.parametrize("worker_class", ["sync", "gthread"])
def test_gunicorn_kills_and_replaces_a_stuck_worker(worker_class: str, tmp_path: Path) -> None:
    """The example config: fast requests never fire; a stuck one is logged, dumped, killed, replaced."""
    port = free_port()
    cmd = gunicorn(EXAMPLES / "gunicorn.conf.py", port, worker_class)
    with serve(cmd, port, tmp_path, "gunicorn") as server:
        server.wait_for(r"shmwheel: request timeout 2 s on wheel 'gunicorn-\d+', driver pid \d+, workers are killed")
        for _ in range(20):
            assert get(server.port, "/")[0] == 200

        status, _ = get(server.port, "/stuck?s=60", timeout=WAIT)
        assert status == 0  # the worker died under the request

        timed_out = server.wait_for(timed_out_line("/stuck") + ASKED + ", then SIGABRT")
        pid = int(timed_out.group(1))
        assert 2.0 <= float(timed_out.group(2)) < 2.0 + WAIT
        # The worker's own dump: the app's frame that hangs, and the handler's SIGKILL.
        server.wait_for(own_stack("/stuck", "_stuck"))
        server.wait_for(
            rf"killed worker pid {pid} with SIGKILL: it was still there \d+ s after SIGABRT, which it handles: "
            r".* \(GET /stuck "
        )
        server.wait_for(rf"Worker \(pid:{pid}\) was sent SIGKILL")
        # Gunicorn replaced it: the worker that answers now is another one.
        give_up = time.monotonic() + WAIT
        while True:
            booted = re.findall(r"Booting worker with pid: (\d+)", server.log())
            if len(booted) >= 3:
                break
            assert time.monotonic() < give_up, server.log()
            time.sleep(0.05)
        answers = {get(server.port, "/")[1] for _ in range(10)}
        assert f"done by pid {pid}\n" not in answers
        assert all(a.startswith("done by pid ") for a in answers)

        # The fast requests never timed out.
        assert len(re.findall(DRIVER_TIMED_OUT, server.log())) == 1
        assert server.stop(signal.SIGTERM) == 0
        assert "driver stopped, wheel" in server.log()
        assert_nothing_left(server)


def test_gunicorn_graceful_signal_ends_a_sleeping_sync_worker(tmp_path: Path) -> None:
    """SIGABRT makes a sync worker leave its request (Gunicorn's worker_abort); no SIGKILL needed."""
    port = free_port()
    cmd = gunicorn(EXAMPLES / "gunicorn.conf.py", port, "sync")
    with serve(cmd, port, tmp_path, "gunicorn") as server:
        # The SystemExit that SIGABRT raises unwinds the request: Gunicorn
        # answers 500 on its way out.
        assert get(server.port, "/sleep?s=60", timeout=WAIT)[0] == 500
        pid = int(server.wait_for(timed_out_line("/sleep")).group(1))
        server.wait_for(rf"Worker exiting \(pid: {pid}\)")
        server.wait_for(r"Booting worker with pid: \d+[\s\S]*Booting worker with pid: \d+[\s\S]*Booting worker")
        time.sleep(3.5)  # past kill_after: the SIGKILL timer fires and finds the worker gone
        assert f"killed worker pid {pid}" not in server.log()
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left(server)


def test_gunicorn_without_kill_logs_and_dumps_and_lets_the_request_finish(tmp_path: Path) -> None:
    """Logging and tracebacks only: the slow request completes; the driver restarts if it dies."""
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(
        "from shmwheel.contrib import gunicorn as shmwheel_gunicorn\n"
        "shmwheel_gunicorn.install(globals(), timeout=0.5)\n"
    )
    port = free_port()
    with serve(gunicorn(config, port, "gthread"), port, tmp_path, "gunicorn") as server:
        driver_pid = int(server.wait_for(r"wheel 'gunicorn-\d+', driver pid (\d+)").group(1))
        status, body = get(server.port, "/sleep?s=1.5")
        assert status == 200 and body.startswith("done by pid ")
        pid = int(server.wait_for(timed_out_line("/sleep") + ASKED + "$").group(1))
        assert body == f"done by pid {pid}\n"
        server.wait_for(own_stack("/sleep", "_sleep"))
        assert "SIGKILL" not in server.log()

        # A driver that dies is replaced by the master, and the wheel keeps working.
        os.kill(driver_pid, signal.SIGKILL)
        # Gunicorn's master reaps every child itself: how the driver died is its to know.
        server.wait_for(rf"the driver \(pid {driver_pid}\) (?:was killed by SIGKILL|is gone) after")
        server.wait_for(r"driver \d+: took over wheel")
        assert get(server.port, "/sleep?s=1.5")[0] == 200
        server.wait_for(timed_out_line("/sleep") + r"[\s\S]*" + timed_out_line("/sleep"))
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


def test_gunicorn_errorlog_gets_the_timeout_and_the_stack_in_gunicorns_format(tmp_path: Path) -> None:
    """With ``errorlog`` a file: the driver's line and the worker's stack go
    there, in Gunicorn's own format (its date, the writer's pid, the level), not to stderr."""
    errorlog = tmp_path / "error.log"
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(
        f"errorlog = {str(errorlog)!r}\n"
        "from shmwheel.contrib import gunicorn as shmwheel_gunicorn\n"
        "shmwheel_gunicorn.install(globals(), timeout=0.5)\n"
    )
    port = free_port()
    with serve(gunicorn(config, port, "gthread"), port, tmp_path, "gunicorn") as server:
        assert get(server.port, "/sleep?s=1.5")[0] == 200
        gunicorns = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [+-]\d{4}\] \[(\d+)\] \[WARNING\] "
        give_up = time.monotonic() + WAIT
        while not re.search(own_stack("/sleep", "_sleep"), errorlog.read_text()):
            assert time.monotonic() < give_up, errorlog.read_text()
            time.sleep(0.05)
        log = errorlog.read_text()
        driver = re.search(gunicorns + "shmwheel: " + timed_out_line("/sleep"), log)
        worker = re.search(gunicorns + own_stack("/sleep", "_sleep"), log)
        assert driver is not None and worker is not None, log
        assert driver[1] != worker[1] == driver[2]  # written by the driver, then by the worker it names
        assert "request timed out" not in server.log() and "the stack of" not in server.log()  # stderr
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


def test_a_second_timeout_in_a_draining_gthread_worker_drops_no_innocent_request(tmp_path: Path) -> None:
    """Two stuck requests and an innocent one in one gthread worker: the
    first timeout sends SIGABRT and the worker drains; the second is logged
    with its stack but not signalled again (a second SIGABRT would raise
    SystemExit in the thread joins of the worker's exit, which then dies at
    once), so the innocent request is answered, and SIGKILL ends the worker."""
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(
        "workers = 1\nthreads = 4\n"
        "from shmwheel.contrib import gunicorn as shmwheel_gunicorn\n"
        "shmwheel_gunicorn.install(globals(), timeout=2.0, kill=True, kill_after=3.0)\n"
    )
    port = free_port()
    with serve(gunicorn(config, port, "gthread"), port, tmp_path, "gunicorn") as server:
        results: dict[str, tuple[int, str]] = {}

        def fetch(path: str, delay: float) -> threading.Thread:
            def run() -> None:
                time.sleep(delay)
                results[path] = get(server.port, path, timeout=WAIT)

            thread = threading.Thread(target=run)
            thread.start()
            return thread

        # The innocent one starts before the first SIGABRT (about 2.5 s) and
        # ends after the second stuck request's timeout (2.2 s) and its look (2.7 s).
        threads = [fetch("/stuck?s=60", 0.0), fetch("/stuck?s=30", 0.2), fetch("/sleep?s=1.9", 1.2)]
        for thread in threads:
            thread.join(WAIT)
        assert results["/sleep?s=1.9"][0] == 200, (results, server.log()[-4000:])
        assert results["/stuck?s=60"][0] == results["/stuck?s=30"][0] == 0  # the worker was killed under them
        log = server.log()
        pid = int(re.search(timed_out_line("/stuck?s=60".split("?")[0]), log).group(1))  # type: ignore[union-attr]
        server.wait_for(rf"worker pid {pid} is not sent SIGABRT again for GET /stuck ")
        server.wait_for(
            rf"killed worker pid {pid} with SIGKILL: it was still there 3 s after SIGABRT, which it handles"
        )
        assert "Exception ignored" not in log and "SystemExit" not in log
        assert len(re.findall(own_stack("/stuck", "_stuck"), log)) == 2  # each stuck request's own
        # The master's replacement first: one it boots while it handles the
        # SIGTERM is never sent it, and the master waits out graceful_timeout.
        server.wait_for(rf"(?s)Worker \(pid:{pid}\) was sent SIGKILL.*Booting worker with pid")
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


def test_gunicorn_master_killed_outright_leaves_no_wheel(tmp_path: Path) -> None:
    """SIGKILL to the master: no on_exit hook runs, so the driver removes the wheel itself."""
    port = free_port()
    cmd = gunicorn(EXAMPLES / "gunicorn.conf.py", port, "sync")
    with serve(cmd, port, tmp_path, "gunicorn") as server:
        driver_pid = int(server.wait_for(r"driver pid (\d+)").group(1))
        assert not no_segment(server.wheel)
        server.proc.kill()
        server.proc.wait()
        give_up = time.monotonic() + WAIT
        while not (no_segment(server.wheel) and start_time(driver_pid) is None):  # a zombie is gone
            assert time.monotonic() < give_up, "the wheel or its driver outlived the master"
            time.sleep(0.05)


def test_gunicorn_warns_when_its_own_timeout_would_kill_a_sync_worker_first(tmp_path: Path) -> None:
    """A sync worker stuck in a request stops notifying the master, which kills
    it after Gunicorn's `timeout`: a request timeout not below it would never
    be reported.  The master says so at startup, in Gunicorn's log."""
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(
        "timeout = 1\n"
        "from shmwheel.contrib import gunicorn as shmwheel_gunicorn\n"
        "shmwheel_gunicorn.install(globals(), timeout=2.5)\n"
    )
    port = free_port()
    with serve(gunicorn(config, port, "sync"), port, tmp_path, "gunicorn") as server:
        server.wait_for(
            r"^\[[^]]+\] \[\d+\] \[WARNING\] shmwheel: the request timeout \(2.5 s\) is not below Gunicorn's "
            r"timeout \(1 s\): the master kills a sync worker stuck in a request first, and the request is never "
            r"reported; make it shorter than 1 s$"
        )
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


def test_gunicorn_wraps_the_app_of_its_own_asgi_worker(tmp_path: Path) -> None:
    """Gunicorn's asgi worker: install() wraps each worker's application in
    the ASGI middleware on the master's wheel.  Fast requests add timers and
    cancel every one; a request that overstays is timed out, and finishes."""
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(
        "from shmwheel.contrib import gunicorn as shmwheel_gunicorn\n"
        "shmwheel_gunicorn.install(globals(), timeout=0.5)\n"
    )
    port = free_port()
    cmd = [str(BIN / "gunicorn"), "-c", str(config), "--bind", f"127.0.0.1:{port}", "--worker-class", "asgi"]
    with serve([*cmd, "--no-control-socket", "asgi_app:routes"], port, tmp_path, "gunicorn") as server:
        server.wait_for(
            r"\[INFO\] shmwheel: worker class gunicorn\.workers\.gasgi\.ASGIWorker calls no request hook: each "
            r"worker wraps its ASGI application in shmwheel.contrib.asgi.TimeoutMiddleware$"
        )
        for _ in range(5):
            assert get(server.port, "/")[0] == 200
        with shmwheel.attach(server.wheel) as wheel:
            # Each request had its timer, cancelled once its response was
            # sent: maybe a moment after the client has read it.
            give_up = time.monotonic() + WAIT
            while len(wheel) or wheel.stats().added < 5:
                assert time.monotonic() < give_up, wheel.stats()
                time.sleep(0.01)
        status, body = get(server.port, "/sleep?s=1.5")
        assert status == 200
        pid = int(server.wait_for(timed_out_line("/sleep") + ASKED + "$").group(1))
        assert body == f"done by pid {pid}\n"
        assert len(re.findall(DRIVER_TIMED_OUT, server.log())) == 1
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


# A worker class that serves with wsgiref and calls none of Gunicorn's
# request hooks, as tornado's and gevent_pywsgi's do not: what the master
# cannot time by hooks nor wrap by itself.
PLAIN_WORKER = """
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer
from gunicorn.workers.base import Worker

class Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass

class PlainWorker(Worker):
    def run(self):
        listener = self.sockets[0]
        server = WSGIServer(listener.getsockname(), Quiet, bind_and_activate=False)
        server.socket.close()
        server.socket = listener.sock
        server.server_name, server.server_port = listener.getsockname()[:2]
        server.setup_environ()
        server.set_app(self.wsgi)
        server.timeout = 0.5
        while self.alive:
            self.notify()
            server.handle_request()
"""


def test_gunicorn_says_at_boot_when_a_worker_class_without_hooks_serves_an_unwrapped_app(tmp_path: Path) -> None:
    """A worker class that calls no request hook, with an application that is
    not wrapped: the master warns at startup, each worker logs an ERROR at
    boot saying what to add, requests are served and no timer is added."""
    (tmp_path / "plain_worker.py").write_text(PLAIN_WORKER)
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(
        "workers = 1\n"
        "from shmwheel.contrib import gunicorn as shmwheel_gunicorn\n"
        "shmwheel_gunicorn.install(globals(), timeout=0.2)\n"
    )
    port = free_port()
    cmd = [str(BIN / "gunicorn"), "-c", str(config), "--bind", f"127.0.0.1:{port}", "--pythonpath", str(tmp_path)]
    cmd += ["--worker-class", "plain_worker.PlainWorker", "--no-control-socket", "app:application"]
    with serve(cmd, port, tmp_path, "gunicorn") as server:
        server.wait_for(
            r"\[WARNING\] shmwheel: worker class plain_worker\.PlainWorker does not call Gunicorn's pre_request and "
            r"post_request hooks around each request: its requests are timed only if the application is wrapped"
        )
        server.wait_for(
            r"\[ERROR\] shmwheel: worker class plain_worker\.PlainWorker calls no request hook and the application "
            r"is not wrapped: its requests run without a timeout; wrap it in shmwheel\.contrib\.wsgi\.TimeoutMiddleware"
        )
        assert get(server.port, "/sleep?s=0.5")[0] == 200
        with shmwheel.attach(server.wheel) as wheel:
            assert wheel.stats().added == 0
        assert "request timed out" not in server.log()
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left(server)


def ids_of(pid: int) -> tuple[str, str]:
    """The Uid: and Gid: lines of /proc/PID/status (real, effective, saved, filesystem)."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return " ".join(status["Uid"].split()), " ".join(status["Gid"].split())


NOBODY = 65534  # nobody and nogroup
AS_NOBODY = f"{NOBODY} {NOBODY} {NOBODY} {NOBODY}"  # real, effective, saved and filesystem ids

# Workers that run as nobody import modules as they go, from the
# interpreter's installation (CPython 3.13's hashlib does, in a Gunicorn
# worker): where nobody may not read it (a Python under /root, mode 0700),
# they fail to boot, whatever the master imported for them first.


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: Gunicorn starts as root and runs its workers as nobody")
def test_gunicorn_started_as_root_with_workers_as_nobody_times_out_and_kills(tmp_path: Path) -> None:
    """Issue 15: the master is root, user/group are nobody/nogroup.  It boots;
    the wheel and the driver are nobody's; a request that overstays is
    timed out and its worker killed and replaced; fast requests are 200;
    nothing is left behind."""
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(
        "user = 'nobody'\n"
        "group = 'nogroup'\n"
        "workers = 2\n"
        "# The master imports the app, as root: the workers need not read its folder, nor,\n"
        "# with what they import later imported here (CPython 3.13's workers import hashlib's\n"
        "# _sha2 after the drop), an interpreter that nobody may not read (pyenv's under /root).\n"
        "import hashlib\n"
        "preload_app = True\n"
        "from shmwheel.contrib import gunicorn as shmwheel_gunicorn\n"
        "shmwheel_gunicorn.install(globals(), timeout=1.0, kill=True, kill_after=1.0)\n"
    )
    port = free_port()
    with serve(gunicorn(config, port, "sync"), port, tmp_path, "gunicorn") as server:
        driver = int(
            server.wait_for(
                r"wheel 'gunicorn-\d+', driver pid (\d+), workers are killed on timeout; "
                rf"the wheel and the driver belong to the workers' uid {NOBODY}, gid {NOBODY}$"
            ).group(1)
        )
        st = os.stat(f"/dev/shm/{server.wheel}")
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (NOBODY, NOBODY, 0o600)
        assert ids_of(driver) == (AS_NOBODY, AS_NOBODY)
        for _ in range(20):
            status, body = get(server.port, "/")
            assert status == 200
        assert ids_of(int(body.split()[-1]))[0] == AS_NOBODY  # a worker

        assert get(server.port, "/stuck?s=60", timeout=WAIT)[0] == 0  # the worker died under the request
        pid = int(server.wait_for(timed_out_line("/stuck") + ASKED + ", then SIGABRT").group(1))
        server.wait_for(own_stack("/stuck", "_stuck"))
        server.wait_for(
            rf"killed worker pid {pid} with SIGKILL: it was still there \d+ s after SIGABRT, which it handles: "
            r".* \(GET /stuck "
        )
        server.wait_for(r"Booting worker with pid: \d+[\s\S]*Booting worker with pid: \d+[\s\S]*Booting worker")
        answers = {get(server.port, "/")[1] for _ in range(10)}
        assert f"done by pid {pid}\n" not in answers
        assert all(a.startswith("done by pid ") for a in answers)
        for trouble in ("not acted on", "run without a timeout", "is not below Gunicorn's timeout"):
            assert trouble not in server.log()
        assert server.stop(signal.SIGTERM) == 0
        assert "driver stopped, wheel" in server.log()
        assert_nothing_left(server)


# -- uWSGI ----------------------------------------------------------------------


def test_uwsgi_kills_and_replaces_a_stuck_worker(tmp_path: Path) -> None:
    """The example config: fast requests never fire; a stuck one is logged, dumped, killed, replaced."""
    port = free_port()
    ini = uwsgi_ini(tmp_path, port)
    with serve([str(BIN / "uwsgi"), "--ini", str(ini)], port, tmp_path, "uwsgi") as server:
        server.wait_for(r"driver \d+: running on wheel 'uwsgi-\d+'")
        for _ in range(20):
            assert get(server.port, "/")[0] == 200

        assert get(server.port, "/stuck?s=60", timeout=WAIT)[0] in (0, 502)
        timed_out = server.wait_for(timed_out_line("/stuck") + ASKED + ", then SIGTERM")
        pid = int(timed_out.group(1))
        server.wait_for(own_stack("/stuck", "_stuck"))
        server.wait_for(rf"worker \d+ \(pid: {pid}\) died")
        server.wait_for(r"Respawned uWSGI worker \d+ \(new pid: \d+\)")
        answers = {get(server.port, "/")[1] for _ in range(10)}
        assert f"done by pid {pid}\n" not in answers
        assert all(a.startswith("done by pid ") for a in answers)
        assert len(re.findall(DRIVER_TIMED_OUT, server.log())) == 1
        assert server.stop(signal.SIGINT) == 0
        server.wait_for(r"driver \d+: stopped on wheel")
        assert_nothing_left(server)


def times_out_then_stops(server: Server) -> None:
    """A request past its 0.5 s is reported by the mule that drives now; SIGINT then leaves nothing."""
    status, body = get(server.port, "/sleep?s=1.5")
    assert status == 200
    pid = int(server.wait_for(timed_out_line("/sleep") + ASKED + "$").group(1))
    assert body == f"done by pid {pid}\n"
    assert server.stop(signal.SIGINT) == 0
    assert_nothing_left(server)


def test_uwsgi_mules_reload_keeps_the_wheel_the_workers_hold(tmp_path: Path) -> None:
    """touch-mules-reload stops the mule gracefully and starts another: the
    wheel stays (the workers hold it), the new mule drives it, and only the
    shutdown removes it."""
    port = free_port()
    trigger = tmp_path / "reload-mules"
    trigger.touch()
    options = {"shmwheel-kill": "false", "shmwheel-timeout": "0.5", "touch-mules-reload": str(trigger)}
    ini = uwsgi_ini(tmp_path, port, **options)
    with serve([str(BIN / "uwsgi"), "--ini", str(ini)], port, tmp_path, "uwsgi") as server:
        first = int(server.wait_for(r"driver (\d+): running on wheel").group(1))
        assert get(server.port, "/")[0] == 200  # a worker has attached
        segment = os.stat(f"/dev/shm/{server.wheel}").st_ino
        # uWSGI compares whole seconds of mtime, from a first look it takes
        # some time after the start: move it on until the reload shows.
        give_up, ahead = time.monotonic() + WAIT, 0
        while "mules reload" not in server.log():
            assert time.monotonic() < give_up, "uWSGI did not reload the mules"
            ahead += 5
            later = time.time_ns() + ahead * 10**9
            os.utime(trigger, ns=(later, later))
            time.sleep(0.5)
        server.wait_for(rf"driver {first}: stopped on wheel")
        server.wait_for(rf"driver (?!{first}:)\d+: running on wheel '{server.wheel}'")
        assert os.stat(f"/dev/shm/{server.wheel}").st_ino == segment, "the wheel was made anew"
        assert f"wheel '{server.wheel}' kept; it goes when the uWSGI master exits" in server.log()
        times_out_then_stops(server)


def test_uwsgi_mule_that_dies_is_respawned_and_takes_over(tmp_path: Path) -> None:
    """kill -9 the driver mule: uWSGI starts another, which drives the same wheel."""
    port = free_port()
    ini = uwsgi_ini(tmp_path, port, **{"shmwheel-kill": "false", "shmwheel-timeout": "0.5"})
    with serve([str(BIN / "uwsgi"), "--ini", str(ini)], port, tmp_path, "uwsgi") as server:
        mule = int(server.wait_for(r"driver (\d+): running on wheel").group(1))
        os.kill(mule, signal.SIGKILL)
        server.wait_for(rf"driver \d+: took over wheel 'uwsgi-\d+' from driver {mule}")
        times_out_then_stops(server)


# What ends uWSGI 2.0 (kill_them_all, its SIGINT to the mule): SIGINT, and
# SIGTERM with die-on-term or SIGQUIT without it.  The other two are a
# brutal reload (the master re-executes itself), not a shutdown.
GROUP_SHUTDOWNS = [
    (signal.SIGTERM, "true"),
    (signal.SIGINT, "true"),
    (signal.SIGQUIT, "false"),
    (signal.SIGINT, "false"),
]


def signal_group(pgid: int, signum: int, order: str, mule: int) -> None:
    """``signum`` to every process of the group: all at once (killpg), or
    one by one as systemd walks a cgroup, the master or the mule first and
    the rest a moment later, time enough for the first to act on it.  (Not
    the workers first: uWSGI would respawn them, and a SIGINT that lands in
    a new worker's postfork hook is a KeyboardInterrupt that pyuwsgi's
    worker swallows, and the master waits a minute for it.)"""
    if order == "killpg":
        os.killpg(pgid, signum)
        return
    first = pgid if order == "master first" else mule
    os.kill(first, signum)
    time.sleep(0.05)
    for pid in live_members(pgid):
        if pid != first:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


# How long uWSGI's master waits for a worker it told to stop before it
# kills it (worker-reload-mercy, 60 s unless set): well under WAIT.  And
# how many of the twenty shutdowns may need that: about one in a hundred
# did (a full run in four) before it was set; more is a pattern, not luck.
WORKER_MERCY = 8
WORKER_KILLS_TAKEN = 2
NO_MERCY = re.compile(r"worker \d+ \(pid: (\d+)\) is taking too much time to die\.\.\.NO MERCY")


@pytest.mark.long  # 30 s: twenty shutdowns in a row
def test_uwsgi_group_shutdown_never_leaks_the_wheel(tmp_path: Path) -> None:
    """A signal to the whole process group (systemd's KillMode=control-group,
    timeout(1)) reaches the mule as well as the master, in any order; twenty
    shutdowns in a row leave no wheel behind.

    A worker that a SIGINT catches in Python code (closing a response, on
    a busy machine) may not exit (uWSGI's exit() runs its Python exit hooks
    from the signal handler); its master kills it after worker-reload-mercy,
    and the wheel must not outlive that either.  Such a shutdown is
    reported as a warning with the worker's threads, and more than
    WORKER_KILLS_TAKEN of them fail the test; a mule (the driver,
    shmwheel's own code) that does not exit fails it at once."""
    leaked, slow = [], []
    for run in range(20):
        signum, die_on_term = GROUP_SHUTDOWNS[run % len(GROUP_SHUTDOWNS)]
        order = ("killpg", "master first", "mule first")[run % 3]
        what = f"run {run}: {signal.Signals(signum).name} (die-on-term {die_on_term}, {order})"
        port = free_port()
        ini = uwsgi_ini(tmp_path, port, **{"die-on-term": die_on_term, "worker-reload-mercy": str(WORKER_MERCY)})
        with serve([str(BIN / "uwsgi"), "--ini", str(ini)], port, tmp_path, "uwsgi") as server:
            mule = int(server.wait_for(r"driver (\d+): running on wheel").group(1))
            # Both workers past their postfork hooks: a SIGINT that lands in
            # Python code there is a KeyboardInterrupt uWSGI swallows, and
            # the master then waits a minute for that worker.
            answered: set[str] = set()
            give_up = time.monotonic() + WAIT
            while len(answered) < 2:
                assert time.monotonic() < give_up, f"only {answered} answered"
                status, body = get(server.port, "/")
                if status == 200:
                    answered.add(body)
            # Past the end of their last request too: a worker closes a
            # response in Python after the client has it.
            time.sleep(0.3)
            signal_group(server.proc.pid, signum, order, mule)
            threads = ""
            try:
                code = server.proc.wait(WORKER_MERCY / 2)
            except subprocess.TimeoutExpired:
                threads = where_they_wait(live_members(server.proc.pid))
                try:
                    code = server.proc.wait(WAIT)
                except subprocess.TimeoutExpired:
                    pytest.fail(
                        f"{what}: uWSGI still up {WAIT + WORKER_MERCY / 2:g} s after the signal; mule {mule}; "
                        f"threads {WORKER_MERCY / 2:g} s after it:\n{threads}\nnow:\n"
                        f"{where_they_wait(live_members(server.proc.pid))}\n" + server.log()[-4000:]
                    )
            log = server.log()
            assert code == 0, log[-3000:]
            killed = NO_MERCY.findall(log)
            if killed:
                slow.append(f"{what}: uWSGI killed worker(s) {', '.join(killed)}; threads:\n{threads}")
            give_up = time.monotonic() + WAIT
            while live_members(server.proc.pid):  # the wheel's remover, if any, on its way out
                assert time.monotonic() < give_up, "processes of the server outlived it"
                time.sleep(0.02)
            if not no_segment(server.wheel):
                leaked.append(what)
    assert not leaked, f"{len(leaked)} of 20 group shutdowns left the wheel: {leaked}"
    if slow:
        said = f"{len(slow)} of 20 group shutdowns waited for uWSGI to kill a worker:\n" + "\n".join(slow)
        assert len(slow) <= WORKER_KILLS_TAKEN, said
        warnings.warn(said, stacklevel=1)


def test_uwsgi_without_the_driver_mule_says_so_and_leaves_no_wheel(tmp_path: Path) -> None:
    """request_timeouts with no driver mule: one ERROR line at start-up saying
    what to add, requests still served, and the master's exit removes the wheel."""
    port = free_port()
    ini = uwsgi_ini(tmp_path, port, mule=None)
    with serve([str(BIN / "uwsgi"), "--ini", str(ini)], port, tmp_path, "uwsgi") as server:
        missing = (
            r"\[ERROR\] shmwheel.timeouts: shmwheel: no driver runs on wheel 'uwsgi-\d+', so request timeouts "
            r"will never fire: add 'mule = shmwheel.contrib.uwsgi:driver' to the uWSGI config$"
        )
        server.wait_for(missing)
        assert not no_segment(server.wheel)
        for _ in range(5):
            assert get(server.port, "/")[0] == 200
        assert len(re.findall(missing, server.log(), re.MULTILINE)) == 1
        assert "running on wheel" not in server.log()
        time.sleep(0.3)  # the workers past their last response's close, in C (see the group shutdown test)
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left(server)


# The modules the demo app, shmwheel's uWSGI glue and uwsgidecorators import,
# imported before uWSGI drops to nobody: here the interpreter lives under
# /root (mode 0700), which nobody cannot read.
PREIMPORT = (
    "import sys, functools, pickle, threading, app, shmwheel.contrib.uwsgi\nfrom pyuwsgi import run\nsys.exit(run())\n"
)


@pytest.mark.skipif(os.geteuid() != 0, reason="uWSGI drops privileges only when it is started as root")
@pytest.mark.parametrize("drop", ["before the app", "after the app"])
def test_uwsgi_dropping_to_nobody_times_out_and_leaves_nothing(drop: str, tmp_path: Path) -> None:
    """uWSGI started as root with uid/gid nobody/nogroup.  It drops them
    before it loads the application, so the wheel is nobody's from the
    start; with drop-after-apps the master makes it as root and hands it to
    nobody.  Either way the workers attach, the mule drives, and the
    master's exit removes it."""
    try:
        nobody, nogroup = pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid
    except KeyError:
        pytest.skip("no user nobody or group nogroup on this host")
    port = free_port()
    options = {"uid": "nobody", "gid": "nogroup", "shmwheel-kill": "false", "shmwheel-timeout": "0.5"}
    if drop == "after the app":
        options["drop-after-apps"] = "true"
    ini = uwsgi_ini(tmp_path, port, **options)
    cmd = [sys.executable, "-c", PREIMPORT, "--ini", str(ini)]
    with serve(cmd, port, tmp_path, "uwsgi") as server:
        server.wait_for(r"driver \d+: running on wheel")
        wheel = os.stat(f"/dev/shm/{server.wheel}")
        assert (wheel.st_uid, wheel.st_gid) == (nobody, nogroup)
        for pid in [server.proc.pid, *live_members(server.proc.pid)]:
            uids = Path(f"/proc/{pid}/status").read_text().split("\nUid:")[1].split()
            assert uids[:3] == [str(nobody)] * 3, f"pid {pid} runs as {uids}"
        times_out_then_stops(server)


def no_config(tmp_path: Path) -> Path:
    """An empty Gunicorn config: without one, Gunicorn reads the
    gunicorn.conf.py of its working directory, examples/, whose install()
    would time every request too, and the WSGI middleware would pass them
    through."""
    config = tmp_path / "empty.conf.py"
    config.write_text("# no install(): the application's WSGI middleware times its requests\n")
    return config


RESTART_APP = """
import os, sys
sys.path.insert(0, {examples!r})
from app import application as inner
from shmwheel.contrib.wsgi import TimeoutMiddleware
application = TimeoutMiddleware(inner, os.environ["SHMWHEEL_TEST_WHEEL"], timeout=0.5)
"""


def test_a_standalone_driver_restarted_under_a_serving_gunicorn_keeps_timing_requests_out(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process manager restarts the standalone driver (``--create``, SIGTERM,
    start again) while Gunicorn serves through the WSGI middleware: the
    driver keeps the wheel its workers hold, the next one takes it over, and
    every overdue request still times out."""
    (tmp_path / "restart_app.py").write_text(RESTART_APP.format(examples=str(EXAMPLES)))
    monkeypatch.setenv("SHMWHEEL_TEST_WHEEL", name)  # for the workers' app
    driver_log = tmp_path / "driver.log"

    def start_driver() -> subprocess.Popen[bytes]:
        with open(driver_log, "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "shmwheel.contrib.timeouts", name, "--create"], stderr=out)
        started.append(proc)
        give_up = time.monotonic() + WAIT
        while driver_log.read_text().count("running on wheel") < len(started):
            assert proc.poll() is None and time.monotonic() < give_up, driver_log.read_text()
            time.sleep(0.05)
        return proc

    started: list[subprocess.Popen[bytes]] = []
    driver = start_driver()
    port = free_port()
    cmd = [str(BIN / "gunicorn"), "-c", str(no_config(tmp_path)), "--bind", f"127.0.0.1:{port}", "--workers", "2"]
    cmd += ["--pythonpath", str(tmp_path)]
    try:
        with serve([*cmd, "--no-control-socket", "restart_app:application"], port, tmp_path, "gunicorn") as server:
            for round_ in range(3):
                if round_:
                    driver = start_driver()
                assert get(port, "/")[0] == 200
                status, _ = get(port, "/sleep?s=1.2")
                assert status == 200  # no kill: the request runs on, its timeout logged
                give_up = time.monotonic() + WAIT
                while driver_log.read_text().count("request timed out: GET /sleep") < round_ + 1:
                    assert time.monotonic() < give_up, f"round {round_}: no timeout\n{driver_log.read_text()}"
                    time.sleep(0.05)
                driver.send_signal(signal.SIGTERM)
                assert driver.wait(WAIT) == 0
                assert "kept for the next driver" in driver_log.read_text()
                assert not no_segment(name)
            assert server.stop() == 0
        driver = start_driver()  # nobody uses it now: the last driver removes it on the way out
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(WAIT) == 0
        assert no_segment(name)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


# -- ASGI: Uvicorn, Gunicorn's Uvicorn worker, Hypercorn -----------------------------


def stuck_requests_time_out_and_their_workers_are_replaced(server: Server, replaced: str) -> None:
    """Fast requests never fire; a request stuck in each route is timed out
    once, with its path and worker pid, and its worker is ended and replaced
    (``replaced``: the server's line for it, with {pid})."""
    for _ in range(20):
        assert get(server.port, "/")[0] == 200
    ended = []
    for path in STUCK_ROUTES:
        assert get(server.port, f"{path}?s=60", timeout=WAIT)[0] == 0  # the worker ended under the request
        pid = int(server.wait_for(timed_out_line(path) + ASKED + ", then SIGTERM").group(1))
        server.wait_for(replaced.format(pid=pid))
        ended.append(pid)
    # The task waits for the thread Starlette runs its synchronous endpoint in: that thread's stack.
    server.wait_for(own_stack("/block", "block", "asgi_app.py"))
    give_up = time.monotonic() + WAIT
    while True:  # served by the workers that replaced them
        answers = {get(server.port, "/")[1] for _ in range(10)}
        if all(a.startswith("done by pid ") for a in answers):
            break
        assert time.monotonic() < give_up, answers
        time.sleep(0.1)
    assert not answers & {f"done by pid {pid}\n" for pid in ended}
    assert len(re.findall(DRIVER_TIMED_OUT, server.log())) == len(STUCK_ROUTES)


# How each server is started on the wrapped app with two workers, and the
# line it logs when one ends.  Hypercorn replaces a worker that exits with
# status 0 and stops altogether when one ends by a signal, so the
# middleware has its workers exit 0 on the driver's SIGTERM.
ASGI_SERVERS = {
    "uvicorn": (
        ["uvicorn", "asgi_app:app", "--host", "127.0.0.1", "--port", "{port}"],
        r"Child process \[{pid}\] died",
    ),
    "hypercorn": (
        ["hypercorn", "asgi_app:app", "--bind", "127.0.0.1:{port}"],
        r"shmwheel: worker {pid} exits on SIGTERM",
    ),
}


@pytest.mark.parametrize("server_name", sorted(ASGI_SERVERS))
def test_asgi_server_workers_time_out_and_are_replaced_with_nothing_but_the_middleware(
    server_name: str, tmp_path: Path
) -> None:
    """``uvicorn`` or ``hypercorn`` with ``--workers 2`` on the wrapped app: a
    worker starts the driver of the server's own wheel; stuck requests are
    timed out, their workers ended and replaced; SIGTERM leaves nothing."""
    port = free_port()
    args, replaced = ASGI_SERVERS[server_name]
    cmd = [str(BIN / args[0]), *(a.format(port=port) for a in args[1:]), "--workers", "2"]
    with serve_asgi(cmd, port, tmp_path) as server:
        driver = auto_driver_of(server)
        stuck_requests_time_out_and_their_workers_are_replaced(server, replaced)
        assert server.stop(signal.SIGTERM) == 0
        assert_nothing_left_of_asgi(server, driver)


def test_a_single_process_uvicorn_with_kill_says_at_startup_that_a_kill_ends_the_server(tmp_path: Path) -> None:
    """``uvicorn app:app`` is one process, and the worker the driver kills is
    the server: said at startup, in Uvicorn's log, with what to do instead.
    Its requests are timed all the same, and nothing is left once it stops."""
    port = free_port()
    cmd = [str(BIN / "uvicorn"), "asgi_app:app", "--host", "127.0.0.1", "--port", str(port)]
    with serve_asgi(cmd, port, tmp_path) as server:
        server.wait_for(
            r"WARNING: +shmwheel: this server runs in one process, which nothing restarts: with kill=True, a "
            r"timed-out request ends the whole server; run it with --workers N"
        )
        driver = auto_driver_of(server)
        assert get(server.port, "/")[0] == 200
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left_of_asgi(server, driver)


def test_gunicorn_with_uvicorn_workers_wraps_the_app_and_ends_workers_without_a_core_dump(tmp_path: Path) -> None:
    """Gunicorn with uvicorn_worker.UvicornWorker and install() on an app that
    is not wrapped: each worker wraps it on the master's wheel; a stuck
    request's worker gets SIGTERM, not the SIGABRT that would dump its core
    (the worker class sets SIGABRT back to its default), then SIGKILL."""
    port = free_port()
    cmd = [str(BIN / "gunicorn"), "-c", str(EXAMPLES / "gunicorn_asgi.conf.py"), "--bind", f"127.0.0.1:{port}"]
    with serve([*cmd, "--no-control-socket", "asgi_app:routes"], port, tmp_path, "gunicorn") as server:
        server.wait_for(r"worker class uvicorn_worker\._workers\.UvicornWorker calls no request hook: each worker")
        stuck_requests_time_out_and_their_workers_are_replaced(server, r"Worker \(pid:{pid}\) was sent SIGKILL")
        log = server.log()
        assert "SIGABRT" not in log and "core dumped" not in log
        assert "running on wheel 'asgi-" not in log  # the master's wheel, no wheel of the workers' own
        assert server.stop(signal.SIGTERM) == 0
        assert "driver stopped, wheel" in server.log()
        assert_nothing_left(server)


FILE_APP = """
import os
from shmwheel.contrib.wsgi import TimeoutMiddleware


class CountedFile:
    # A file that says when it is read: one the server sends with sendfile never is.
    def __init__(self, path):
        self._file = open(path, "rb")

    def fileno(self):
        return self._file.fileno()

    def read(self, n=-1):
        os.write(2, b"file read() called\\n")
        return self._file.read(n)

    def seek(self, *args):
        return self._file.seek(*args)

    def tell(self):
        return self._file.tell()

    def close(self):
        os.write(2, b"file closed\\n")
        self._file.close()


def app(environ, start_response):
    start_response("200 OK", [("Content-Length", str(os.path.getsize({path!r})))])
    return environ["wsgi.file_wrapper"](CountedFile({path!r}), 8192)


middleware = TimeoutMiddleware(app, os.environ["SHMWHEEL_TEST_WHEEL"], timeout=0.5)
middleware._plain = {plain!r}  # False: every request the middleware's own Python way
application = middleware.direct() if {direct!r} else middleware
"""


@pytest.mark.parametrize("server_name", ["gunicorn", "uwsgi"])
@pytest.mark.parametrize(
    ("plain", "direct"), [(True, True), (True, False), (False, False)], ids=["direct", "c", "python"]
)
def test_the_wsgi_middleware_keeps_the_servers_sendfile_and_times_the_file_until_it_is_sent(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch, plain: bool, direct: bool, server_name: str
) -> None:
    """A file the application hands to the server's wsgi.file_wrapper is
    still sent by the server itself, with sendfile (the file is never read
    in Python), and the request's timer ends when the server closes it: no
    timeout fires after a response that was sent in time.  Gunicorn's
    wrapper is a class, whose body the middleware makes again; uWSGI's is
    a function, which sends the file only if the body is what it was given."""
    content = tmp_path / "content.txt"
    content.write_bytes(b"0123456789abcdef" * 8192)
    (tmp_path / "file_app.py").write_text(FILE_APP.format(path=str(content), plain=plain, direct=direct))
    monkeypatch.setenv("SHMWHEEL_TEST_WHEEL", name)
    driver_log = tmp_path / "driver.log"
    with open(driver_log, "wb") as out:
        driver = subprocess.Popen([sys.executable, "-m", "shmwheel.contrib.timeouts", name, "--create"], stderr=out)
    try:
        give_up = time.monotonic() + WAIT
        while "running on wheel" not in driver_log.read_text():
            assert driver.poll() is None and time.monotonic() < give_up, driver_log.read_text()
            time.sleep(0.05)
        port = free_port()
        if server_name == "gunicorn":
            cmd = [str(BIN / "gunicorn"), "-c", str(no_config(tmp_path)), "--bind", f"127.0.0.1:{port}"]
            cmd += ["--pythonpath", str(tmp_path), "--no-control-socket", "file_app:application"]
        else:
            cmd = [str(BIN / "uwsgi"), "--http-socket", f"127.0.0.1:{port}", "--pythonpath", str(tmp_path)]
            cmd += ["--module", "file_app:application", "--need-app", "--master", "--die-on-term"]
        with serve(cmd, port, tmp_path, server_name) as server:
            for _ in range(3):
                status, body = get(port, "/")
                assert (status, body) == (200, content.read_text())
            give_up = time.monotonic() + WAIT
            while server.log().count("file closed") < 4:  # the readiness probe's and the three above
                assert time.monotonic() < give_up, server.log()[-4000:]
                time.sleep(0.05)
            time.sleep(1.0)  # twice the timeout
            log = server.log()
            assert "file read() called" not in log, log[-4000:]
            with shmwheel.attach(name) as wheel:
                assert len(wheel) == 0
            assert "request timed out" not in driver_log.read_text()
            assert server.stop() == 0
    finally:
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(WAIT) == 0
