"""What the real-server tests share: starting a server on loopback as a
user would, reading its log, the client's requests, and the checks that a
server left nothing behind.  Not collected (no test_ prefix): the test
modules import it.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import shmwheel
from shmwheel._process import start_time
from shmwheel.contrib._interrupt import RESPONSE_BODY

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


BIN = Path(sys.executable).parent


WAIT = 30.0  # s: for things that take a second or two when all is well


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get(
    port: int, path: str, timeout: float = 10.0, request_id: str | None = None, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """GET a path (with an X-Request-Id if given, and ``headers``): (status, body); (0, error) if it broke."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        sent = dict(headers or {})
        if request_id is not None:
            sent["X-Request-Id"] = request_id
        conn.request("GET", path, headers=sent)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    except (OSError, http.client.HTTPException) as exc:
        return 0, repr(exc)
    finally:
        conn.close()


#: A path a hostile client sends, percent-encoded as HTTP has it: decoded,
#: a newline that would start a forged CRITICAL line in the server's log, an
#: escape sequence that would clear an operator's terminal, and a
#: right-to-left override.  For an endpoint that starts with /spin.
HOSTILE_PATH = (
    "/spin/x%0A%5B2026-01-01%2000:00:00%20+0000%5D%20%5B1%5D%20%5BCRITICAL%5D%20shmwheel:%20FORGED%1B%5B2J%E2%80%AE"
)


HOSTILE_SHOWN = r"/spin/x\n[2026-01-01 00:00:00 +0000] [1] [CRITICAL] shmwheel: FORGED\x1b[2J\u202e"


def assert_client_text_is_data(server: Server, request_id: str, its_own: str | None = None) -> None:
    """Once a request to HOSTILE_PATH has timed out, been asked for its
    stack and been interrupted: shmwheel's lines about it show the path as
    data, escaped (or still percent-encoded, where the server gives it so),
    and the log has no control byte and no line that begins with the
    client's text - but in the server's own line ``its_own`` (a pattern),
    if it writes one with the decoded path as it is."""
    # Decoded and escaped; or as it came, percent-encoded (Gunicorn's path).
    seen = rf"GET (?:{re.escape(HOSTILE_SHOWN)}|{re.escape(HOSTILE_PATH)}) \(request {request_id},"
    server.wait_for(rf"request timed out: {seen}")
    server.wait_for(rf"the stack of timed-out request {seen}")
    server.wait_for(rf"interrupting {seen}")
    log = server.log()
    if its_own is not None:  # the server's own line about the request, which is not shmwheel's to write
        log = re.sub(its_own, "", log, flags=re.S)
    assert "\x1b" not in log and "\u202e" not in log, log[-3000:]
    assert not re.search(r"^\[2026-01-01 00:00:00 \+0000\] \[1\] \[CRITICAL\]", log, re.M), log[-3000:]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    wheel: str = ""
    seen: int = field(default=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = WAIT) -> re.Match[str]:
        """The first match of ``pattern`` in the log's whole lines, waiting
        for it to appear (a line still being written, matched, could give a
        pid cut short; once the server has exited, its last line counts)."""
        give_up = time.monotonic() + timeout
        while True:
            exited = self.proc.poll() is not None
            text = self.log()
            m = re.search(pattern, text if exited else text[: text.rfind("\n") + 1], re.MULTILINE)
            if m:
                return m
            if time.monotonic() > give_up or exited:
                pytest.fail(f"no {pattern!r} in the server's log:\n{self.log()[-6000:]}")
            time.sleep(0.05)

    def wait_ready(self) -> None:
        give_up = time.monotonic() + WAIT
        while get(self.port, "/", timeout=2.0)[0] != 200:
            if time.monotonic() > give_up or self.proc.poll() is not None:
                pytest.fail(f"the server did not come up:\n{self.log()[-6000:]}")
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(WAIT)


@contextlib.contextmanager
def serve(cmd: list[str], port: int, tmp_path: Path, prefix: str) -> Iterator[Server]:
    """Run a server; on the way out make sure it, and its wheel, are gone."""
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=EXAMPLES, start_new_session=True)
    server = Server(proc, port, log_path, wheel=f"{prefix}-{proc.pid}")
    try:
        server.wait_ready()
        yield server
    finally:
        if proc.poll() is None:  # the test failed half-way
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers: workers, the driver
        with contextlib.suppress(shmwheel.SegmentNotFoundError):
            shmwheel.unlink(server.wheel)


def no_segment(name: str) -> bool:
    return not Path("/dev/shm", name).exists()


def live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that have not exited (a zombie waits
    only for its reaper, which for an orphan is init, slow in a container)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_bytes().rsplit(b")", 1)[1].split()
            if fields[0] != b"Z" and int(fields[2]) == pgid:
                pids.append(int(stat.parent.name))
    return pids


def where_they_wait(pids: list[int]) -> str:
    """Each thread of ``pids``: its name, state, the kernel function it
    sleeps in and its system call, for a test that found a process that
    would not exit."""

    def read(path: Path, part: Callable[[str], str] = str.strip) -> str:
        try:
            return part(path.read_text(errors="replace")) or "-"
        except (OSError, IndexError):  # gone meanwhile, or not ours to read
            return "?"

    lines = []
    for pid in pids:
        try:
            tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        except OSError:  # exited meanwhile
            continue
        for tid in tids:
            task = Path(f"/proc/{pid}/task/{tid}")
            state = read(task / "stat", lambda s: s.rsplit(")", 1)[1].split()[0])
            call = read(task / "syscall", lambda s: s.split()[0])  # its number, or "running"
            lines.append(f"  {pid}/{tid} {read(task / 'comm')} {state} {read(task / 'wchan')} syscall {call}")
    return "\n".join(lines)


def assert_nothing_left(server: Server) -> None:
    """Once the server has stopped: every process of its group is gone, and
    then its wheel (uWSGI's is removed by a process of the group that
    outlives the master by design: it waits for the master's end)."""
    assert server.proc.poll() is not None
    give_up = time.monotonic() + WAIT
    while live_members(server.proc.pid):
        assert time.monotonic() < give_up, "processes of the server outlived it"
        time.sleep(0.05)
    assert no_segment(server.wheel), f"{server.wheel} is still in /dev/shm"


def timed_out_line(path: str) -> str:
    return (
        rf"request timed out: GET {re.escape(path)} \(request \S+, worker pid (\d+), "
        r"thread 0x[0-9a-f]{16}(?:, (?:task|greenlet) 0x[0-9a-f]+)?\), running for ([\d.]+) s"
    )


DRIVER_TIMED_OUT = r"request timed out"  # the driver's line (the worker's header is "the stack of timed-out ...")


ASKED = r"; asking it for the request's stack \(SIGRTMIN\+\d\)"


def own_stack(path: str, function: str, file: str = "app.py") -> str:
    """The worker's report: one header line, then the request's stack down to ``function``."""
    return (
        rf"shmwheel: the stack of timed-out request GET {re.escape(path)} \(.*\), running for [\d.]+ s \(most "
        rf'recent call last\):\n(?:  .*\n)*?  File ".*/examples/{re.escape(file)}", line \d+, in {function}\n'
    )


def uwsgi_ini(tmp_path: Path, port: int, **options: str | None) -> Path:
    """examples/uwsgi.ini with another port (and other options; None drops one).

    A worker that uWSGI's SIGINT catches closing a response may not exit
    (about one shutdown in a hundred, see test_servers.py's group
    shutdowns); its master kills it after worker-reload-mercy, 60 s unless
    set, which is past what a test waits for a server to stop: 8 s here."""
    options = {"worker-reload-mercy": "8", **options}
    lines = []
    for line in (EXAMPLES / "uwsgi.ini").read_text().splitlines():
        key = line.split("=", 1)[0].strip()
        if key == "http-socket":
            line = f"http-socket = 127.0.0.1:{port}"
        elif key == "chdir":
            line = f"chdir = {EXAMPLES}"
        elif key in options:
            value = options.pop(key)
            if value is None:
                continue
            line = f"{key} = {value}"
        lines.append(line)
    lines += [f"{k} = {v}" for k, v in options.items() if v is not None]
    ini = tmp_path / "uwsgi.ini"
    ini.write_text("\n".join(lines) + "\n")
    return ini


# examples/asgi_app.py: ``app`` is wrapped in the ASGI middleware (2 s,
# killing on), ``routes`` is not.  /sleep awaits asyncio.sleep, /block is a
# synchronous endpoint in time.sleep, in the thread Starlette runs it in.
STUCK_ROUTES = ("/sleep", "/block")


def auto_driver_of(server: Server) -> int:
    """The pid of the driver the workers of a server started on its own wheel
    (at startup, or at the first request when the server sets its log up
    only once it serves, as Hypercorn does)."""
    assert get(server.port, "/")[0] == 200
    return int(server.wait_for(rf"driver (\d+): running on wheel '{server.wheel}'").group(1))


def assert_nothing_left_of_asgi(server: Server, driver: int) -> None:
    """Once the server has stopped: its processes are gone, and the driver its
    workers started (in a session of its own) has removed the wheel and exited."""
    give_up = time.monotonic() + WAIT
    while not no_segment(server.wheel) or start_time(driver) is not None:  # it outlives the workers by 2 s
        assert time.monotonic() < give_up, f"{server.wheel} or its driver outlived the server"
        time.sleep(0.05)
    assert f"driver {driver}: stopping: wheel '{server.wheel}' is not used any more" in server.log()
    assert_nothing_left(server)


@contextlib.contextmanager
def serve_asgi(cmd: list[str], port: int, tmp_path: Path) -> Iterator[Server]:
    """serve(), and the driver the workers started stopped if the test failed half-way."""
    with serve(cmd, port, tmp_path, "asgi") as server:
        try:
            yield server
        finally:
            with contextlib.suppress(shmwheel.ShmwheelError), shmwheel._wheel.observe(server.wheel) as wheel:
                pid = wheel.stats().driver_pid
                if pid is not None and server.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)


#: The apps of tests/apps, and a Gunicorn config that installs the hooks.
APPS = Path(__file__).resolve().parent / "apps"
CONFIG = "from shmwheel.contrib import gunicorn as shmwheel_gunicorn\nshmwheel_gunicorn.install(globals(), {args})\n"
STUCK_FOR = 30  # s a stuck request would last if nothing ended it
GATEWAY_TIMEOUT = (504, RESPONSE_BODY.decode())


def gunicorn_app(
    tmp_path: Path,
    port: int,
    worker_class: str,
    *options: str,
    install: str = "timeout=1.0",
    app: str = "flask_stuck:app",
) -> list[str]:
    config = tmp_path / "gunicorn.conf.py"
    config.write_text(CONFIG.format(args=install))
    cmd = [str(BIN / "gunicorn"), "-c", str(config), "--bind", f"127.0.0.1:{port}", "--worker-class", worker_class]
    return [*cmd, *options, "--pythonpath", str(APPS), "--no-control-socket", app]


def pid_of(answer: tuple[int, str]) -> int:
    """The worker that answered a request of the apps: "done by pid N"."""
    status, body = answer
    found = re.search(r"done by pid (\d+)\n$", body)
    assert status == 200 and found is not None, answer
    return int(found.group(1))


@contextlib.contextmanager
def stopped_cleanly(server: Server, signum: int = signal.SIGTERM) -> Iterator[Server]:
    yield server
    assert server.stop(signum) == 0
    assert_nothing_left(server)


def booted(server: Server) -> int:
    return len(re.findall(r"Booting worker with pid: \d+", server.log()))
