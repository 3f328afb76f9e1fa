"""Who may do what: the wheel's owner, the driver's uid, and whom it signals.

The threat: a process of another user that can write the wheel (a wheel of
mode 0666, or group-writable) puts a record there naming a process it could
not signal itself, for a driver of more privilege to signal.  Most tests
here need root, because they drop a forked child to nobody/nogroup (65534)
to play that user; they are skipped otherwise (CI runs as root).  A child
drops privileges only after the test process has imported everything it
needs: /root, where the interpreter lives here, is mode 0700.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import entry, wait_for

import shmwheel
from shmwheel._binding import lib
from shmwheel._process import start_time
from shmwheel.contrib import (
    KIND_GRACEFUL,
    KIND_KILL,
    KIND_REQUEST,
    PAYLOAD_SIZE,
    DriverSupervisor,
    RequestTimer,
    TimeoutActions,
    TimeoutHandler,
    encode_request,
)

NOBODY = 65534  # nobody and nogroup
WAIT = 30.0

as_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the test drops a child to uid 65534 to play another user"
)


def become_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


class Child:
    """A forked child that drops to nobody, runs ``act``, reports what it
    returned (or the exception it raised) through a pipe, and then stays
    alive until :meth:`end`: a live process of another user."""

    def __init__(self, act: Callable[[], str]) -> None:
        r, w = os.pipe()
        hold_r, self._hold_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.close(r)
                os.close(self._hold_w)
                become_nobody()
                out = "ok " + act()
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                out = f"error {exc!r}"
            os.write(w, out.encode())
            os.close(w)
            os.read(hold_r, 1)  # until the test is done with us
            os._exit(0)
        os.close(w)
        os.close(hold_r)
        self.pid = pid
        with os.fdopen(r, "rb") as f:
            self.result = f.read().decode()

    def alive(self) -> bool:
        return os.waitpid(self.pid, os.WNOHANG) == (0, 0)

    def end(self) -> None:
        os.close(self._hold_w)
        os.waitpid(self.pid, 0)


@pytest.fixture
def children() -> Iterator[Callable[[Callable[[], str]], Child]]:
    made: list[Child] = []

    def start(act: Callable[[], str]) -> Child:
        made.append(Child(act))
        return made[-1]

    yield start
    for child in made:
        if child.alive():
            child.end()


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A root process that has nothing to do with any wheel."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


class RunningDriver:
    """A Driver with a TimeoutHandler in a thread of this process (as root)."""

    def __init__(self, name: str, actions: TimeoutActions) -> None:
        self.driver = shmwheel.Driver(name, TimeoutHandler(name, actions))
        self.thread = threading.Thread(target=self.driver.run)
        self.thread.start()

    def stop(self) -> None:
        self.driver.stop()
        self.thread.join(WAIT)
        assert not self.thread.is_alive()


def settled(wheel: shmwheel.Wheel) -> bool:
    """Nothing pending and nothing in flight: no follow-up timer is to come."""
    st = wheel.stats()
    return st.pending == 0 and st.in_flight == 0


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "but is not acted on" in r.getMessage()]


# -- the forged record ----------------------------------------------------------------


@as_root
@pytest.mark.parametrize("kind", [KIND_REQUEST, KIND_GRACEFUL, KIND_KILL], ids=["request", "graceful", "kill"])
def test_a_record_forged_by_another_user_signals_nothing(
    kind: int, make_wheel, victim, children, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 15's attack: nobody writes, into a wheel it can write, a record
    naming a root process; the root driver, killing on timeout, signals
    nothing and says why."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE, mode=0o666)
    start = start_time(victim.pid)
    assert start is not None
    forged = encode_request(kind, victim.pid, start, time.monotonic_ns(), "GET", "forged", "/")

    def forge() -> str:
        with shmwheel.attach(wheel.name) as w:  # the public API, as any user of the wheel could
            return str(w.add(0.05, forged))

    attacker = children(forge)
    assert attacker.result.startswith("ok "), attacker.result
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        driver = RunningDriver(wheel.name, TimeoutActions(kill=True, kill_after=0.2))
        try:
            wait_for(lambda: bool(refusals(caplog)) or victim.poll() is not None)
            wait_for(lambda: settled(wheel))
        finally:
            driver.stop()
    assert victim.poll() is None, "the driver signalled the victim"
    [line] = refusals(caplog)
    assert f"names GET / (request forged, worker pid {victim.pid}) but is not acted on: " in line
    if kind == KIND_REQUEST:
        assert f"the timer was added by pid {attacker.pid}, not by the worker it names" in line
    else:
        assert f"follow-up was added by pid {attacker.pid}, and only this driver's (pid {os.getpid()}) count" in line
    assert line.endswith("nothing was signalled")
    assert "request timed out" not in caplog.text


#: A root process that has nothing to do with any wheel, and catches the
#: stack and dump signals: it says which it got, and lives on.
CATCHER = """
import signal, sys, time
for signum in (signal.SIGURG, signal.SIGRTMIN):
    signal.signal(signum, lambda signum, frame: print("got", signum, flush=True))
print("ready", flush=True)
time.sleep(600)
"""


@as_root
@pytest.mark.parametrize("kind", [KIND_REQUEST, KIND_GRACEFUL, KIND_KILL], ids=["request", "graceful", "kill"])
def test_a_forgery_written_into_the_segment_by_hand_signals_nothing(
    kind: int, make_wheel, children, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 37's attack: nobody, whose group may write root's wheel, writes
    the bytes themselves: the timer's owner pid (the victim's for a request, the
    driver's for a follow-up) and a producer-table entry naming the victim,
    a root process that has nothing to do with the wheel.  The driver asks
    the kernel whether the victim maps the wheel or holds its lock: it
    does neither, so the stack signal, the dump signal, the graceful
    signal and the SIGKILL are all refused.  (Before, the victim got the
    stack and dump signals and was killed.)"""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE, owner=(0, NOBODY), mode=0o660)
    victim = subprocess.Popen([sys.executable, "-c", CATCHER], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout is not None and victim.stdout.readline() == "ready\n"
        start = start_time(victim.pid)
        assert start is not None
        forged = encode_request(kind, victim.pid, start, time.monotonic_ns(), "GET", "forged", "/",
                                stack_signal=signal.SIGURG, dump_signal=signal.SIGRTMIN)  # fmt: skip
        owner = victim.pid if kind == KIND_REQUEST else os.getpid()  # this process runs the driver

        def forge() -> str:
            with shmwheel.attach(wheel.name) as w:
                handle = w.add(0.05, forged)
                entry(w, handle & ((1 << lib.shmw_index_bits(w.capacity)) - 1)).owner_pid = owner
                slot = lib.shmw_producer_attach(w.core, victim.pid, start, 0)
                return f"{handle} {slot}"

        attacker = children(forge)
        assert attacker.result.startswith("ok ") and int(attacker.result.split()[2]) >= 0, attacker.result
        with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
            driver = RunningDriver(wheel.name, TimeoutActions(kill=True, kill_after=0.2))
            try:
                wait_for(lambda: bool(refusals(caplog)) or victim.poll() is not None)
                time.sleep(1.5)  # past the stack check, the dump and the kill, had any been sent
                wait_for(lambda: settled(wheel))
            finally:
                driver.stop()
        assert victim.poll() is None, "the driver signalled the victim"
        victim.terminate()
        heard = victim.communicate(timeout=WAIT)[0]
        assert heard == "", heard
        assert any(f"pid {victim.pid} neither maps wheel {wheel.name!r}" in line for line in refusals(caplog))
        assert wheel.stats().refused >= 1  # counted in the segment, for `shmwheel stats`
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


@as_root
def test_a_root_driver_does_not_signal_a_worker_of_another_user(make_wheel, children, caplog) -> None:
    """A real worker of uid 65534 times out under a root driver: the uid
    rule holds, the driver names the misconfiguration instead of acting."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE, mode=0o666)

    def serve_a_request() -> str:
        return str(RequestTimer(wheel.name, 0.05).start("GET", "/slow", "r1"))

    worker = children(serve_a_request)
    assert worker.result.startswith("ok ") and worker.result != "ok None", worker.result
    with caplog.at_level(logging.WARNING, "shmwheel.timeouts"):
        driver = RunningDriver(wheel.name, TimeoutActions(kill=True, kill_after=0.2))
        try:
            wait_for(lambda: bool(refusals(caplog)) or not worker.alive())
            wait_for(lambda: settled(wheel))
        finally:
            driver.stop()
    assert worker.alive(), "the root driver signalled another user's worker"
    [line] = refusals(caplog)
    assert f"pid {worker.pid} runs as uid {NOBODY} and this driver as uid 0" in line


# -- the wheel's owner and the worker's side ---------------------------------------------------


def test_create_checks_the_owner_argument(name: str) -> None:
    for owner, error in [((1,), TypeError), ("0:0", TypeError), ((-2, 0), ValueError), ((0, 2**32 - 1), ValueError)]:
        with pytest.raises(error, match="owner"):
            shmwheel.create(name, capacity=10, owner=owner)  # type: ignore[arg-type]
    assert not Path("/dev/shm", name).exists()


@as_root
def test_a_wheel_created_for_another_user_is_theirs(make_wheel, children) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE, owner=(NOBODY, NOBODY))
    st = os.stat(Path("/dev/shm", wheel.name))
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (NOBODY, NOBODY, 0o600)

    def use() -> str:
        with shmwheel.attach(wheel.name) as w:
            return str(w.cancel(w.add(1.0)))

    assert children(use).result == "ok True"


@as_root
def test_a_worker_that_may_not_open_the_wheel_serves_without_timeouts(make_wheel, children) -> None:
    """Root's wheel, mode 0600, a worker of uid 65534: PermissionError, logged, never raised."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)

    def serve() -> str:
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
        logging.getLogger("shmwheel.timeouts").addHandler(handler)
        timer = RequestTimer(wheel.name, 1.0)
        handles = [timer.prepare(), timer.start("GET", "/"), timer.start("GET", "/")]
        return repr(handles) + " " + " | ".join(lines)

    result = children(serve).result
    assert result.startswith("ok [False, None, None] "), result
    [line] = result.split("] ", 1)[1].split(" | ")  # rate-limited: once
    assert line.startswith(f"wheel {wheel.name!r}: requests run without a timeout: cannot open segment")
    assert line.endswith(f"(this process runs as uid {NOBODY}, gid {NOBODY})")


# -- the driver's uid ------------------------------------------------------------------------


def driver_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "shmwheel.contrib.timeouts", *args]


def ids_of(pid: int) -> tuple[list[str], list[str], str]:
    """The Uid:, Gid: and Groups: lines of /proc/PID/status."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return status["Uid"].split(), status["Gid"].split(), status["Groups"].strip()


def driver_of(name: str) -> int | None:
    with shmwheel._wheel.observe(name) as w:
        return w.stats().driver_pid


@as_root
def test_the_driver_command_runs_as_the_user_it_is_told(name: str) -> None:
    """--create --user nobody: the wheel is nobody's, the driver drops to it
    (groups too) before driving, and still removes the wheel on exit."""
    proc = subprocess.Popen(
        driver_command(name, "--create", "--user", "nobody", "--group", "nogroup"), stderr=subprocess.PIPE, text=True
    )
    try:
        wait_for(lambda: Path("/dev/shm", name).exists() and driver_of(name) == proc.pid)
        st = os.stat(Path("/dev/shm", name))
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
        assert ids_of(proc.pid) == ([str(NOBODY)] * 4, [str(NOBODY)] * 4, "")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 0, err
    assert f"running as uid {NOBODY}, gid {NOBODY}" in err
    assert not Path("/dev/shm", name).exists()


@as_root
@pytest.mark.parametrize("rotated_to", ["the workers' file", "root's file", "a symbolic link", "a FIFO"])
def test_the_driver_writes_on_after_logrotate_as_the_workers_user(name: str, rotated_to: str) -> None:
    """The driver opens the server's log as root, then runs as nobody; the
    log is rotated (moved, and a new one made, as logrotate's create does).
    A new file nobody may write is opened again, and the next line goes
    there.  One it may not, a symbolic link or a FIFO put where the file
    was (whose open would wait for a reader, who would get every line), is
    not: the driver writes on to the rotated file and says so once on
    stderr.  (Before, the reopen closed the old file first and every line
    after was a '--- Logging error ---' traceback, the line lost.)"""
    # Root's, mode 0755, as /var/log/APP is (pytest's tmp_path is in a
    # directory only root may enter).
    logs = Path(tempfile.mkdtemp(prefix="shmwheel-test-logs-"))
    logs.chmod(0o755)
    log, rotated = logs / "error.log", logs / "error.log.1"
    log.touch(mode=0o644)  # the server's file, as its root master made it
    cmd = driver_command(name, "--create", "--user", "nobody", "--group", "nogroup", f"--log-to={log}")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: f"running as uid {NOBODY}" in log.read_text())
        os.rename(log, rotated)
        if rotated_to == "a FIFO":
            os.mkfifo(log)
            os.chown(log, NOBODY, NOBODY)  # one the driver may open: it must not
        elif rotated_to == "a symbolic link":
            elsewhere = logs / "elsewhere"
            elsewhere.touch(mode=0o640)
            os.chown(elsewhere, NOBODY, NOBODY)
            log.symlink_to(elsewhere)
        else:
            log.touch(mode=0o640 if rotated_to == "the workers' file" else 0o600)
            if rotated_to == "the workers' file":
                os.chown(log, NOBODY, NOBODY)
        with shmwheel.attach(name) as w:
            w.add(0.01, b"not a request")
            w.add(0.2, b"nor this")
        written = log if rotated_to == "the workers' file" else rotated
        wait_for(lambda: written.read_text().count("carries no request record") == 2)
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=WAIT)
        except subprocess.TimeoutExpired:  # stuck (in the open of a FIFO, say): not left behind
            proc.kill()
            _, err = proc.communicate()
            err += "\n(the driver did not stop on SIGTERM, and was killed)"
            with contextlib.suppress(shmwheel.SegmentNotFoundError):
                shmwheel.unlink(name)
        texts = {path.name: path.read_text() for path in (log, rotated) if path.is_file()}
        shutil.rmtree(logs)
    assert proc.returncode == 0, err
    assert "Logging error" not in err, err
    said = f"cannot open {log} again after it was rotated, as uid {NOBODY}"
    if rotated_to == "the workers' file":
        assert "carries no request record" not in texts[rotated.name]
        assert said not in err, err
    else:
        assert err.count(said) == 1, err
        assert texts.get(log.name, "") == ""


@as_root
@pytest.mark.parametrize(
    ("create", "who"),
    [
        ({"owner": (NOBODY, NOBODY)}, f"its owner (uid {NOBODY})"),
        ({"mode": 0o660}, "its group (gid 0)"),
        ({"mode": 0o606}, "every user"),
    ],
    ids=["owner", "group", "others"],
)
def test_the_driver_command_refuses_root_on_a_wheel_others_can_write(
    make_wheel, create: dict[str, object], who: str
) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE, **create)
    proc = subprocess.run(driver_command(wheel.name), capture_output=True, text=True, timeout=WAIT)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"python -m shmwheel.contrib.timeouts: wheel {wheel.name!r} can be written by {who}, and a root driver would "
        "signal what they name: run it as the workers' user (--user, --group), or pass --allow-root"
    ]
    assert wheel.stats().driver_pid is None


@as_root
def test_the_driver_command_as_root_with_allow_root_warns_and_still_signals_no_stranger(
    make_wheel, victim, children
) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE, mode=0o666)
    start = start_time(victim.pid)
    assert start is not None
    forged = encode_request(KIND_KILL, victim.pid, start, time.monotonic_ns(), "GET", "forged", "/")
    proc = subprocess.Popen(driver_command(wheel.name, "--allow-root", "--kill"), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: driver_of(wheel.name) == proc.pid)

        def forge() -> str:
            with shmwheel.attach(wheel.name) as w:
                return str(w.add(0.01, forged))

        assert children(forge).result.startswith("ok ")
        wait_for(lambda: wheel.stats().acked == 1 or victim.poll() is not None)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=WAIT)
    assert victim.poll() is None
    assert proc.returncode == 0, err
    assert re.search(
        rf"\[WARNING\] .*running as root on wheel '{wheel.name}', which its group \(gid 0\) and every user can write",
        err,
    )
    assert re.search(rf"\[WARNING\] .*worker pid {victim.pid}\) but is not acted on: its SIGKILL follow-up", err)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--group", "0"], "--group goes with --user"),
        (["--user", "no-such-user-here"], "no user named 'no-such-user-here'"),
        (["--user", "0", "--group", "no-such-group-here"], "no group named 'no-such-group-here'"),
    ],
)
def test_the_driver_command_reports_a_bad_user_as_a_usage_error(name: str, args: list[str], message: str) -> None:
    proc = subprocess.run(driver_command(name, *args), capture_output=True, text=True, timeout=WAIT)
    assert proc.returncode == 2
    assert message in proc.stderr.splitlines()[-1]


@as_root
def test_the_supervisor_gives_the_wheel_and_the_driver_to_the_workers_user(name: str) -> None:
    sup = DriverSupervisor(name, TimeoutActions(tracebacks=False), owner=(NOBODY, NOBODY))
    sup.start()
    try:
        assert sup.pid is not None
        st = os.stat(Path("/dev/shm", name))
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY)
        assert ids_of(sup.pid) == ([str(NOBODY)] * 4, [str(NOBODY)] * 4, "")
        # Killed, the driver is replaced by one of the same user.
        first = sup.pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: sup.restarts == 1)
        assert sup.pid != first and ids_of(sup.pid)[0] == [str(NOBODY)] * 4
    finally:
        sup.stop()
    assert not Path("/dev/shm", name).exists()
