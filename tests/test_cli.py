"""The command line, run as a real subprocess against real segments."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import pty
import pwd
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import posix_ipc
import pytest
from conftest import foreign_segment, fresh_name, header, wait_for

import shmwheel
from shmwheel._binding import lib
from shmwheel._process import start_time
from shmwheel._wheel import observe
from shmwheel.contrib._record import KIND_REQUEST, encode_request

SHM = Path("/dev/shm")

MakeWheel = Callable[..., shmwheel.Wheel]


def run(*args: str, prefix: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "shmwheel", *args], capture_output=True, text=True, timeout=30
    )


def one_line_error(proc: subprocess.CompletedProcess[str], status: int = 1) -> str:
    """Assert the command failed the Unix way: ``status``, nothing on stdout, one line on stderr."""
    assert proc.returncode == status, proc
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    if status == 1:
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("shmwheel: ")
    return lines[-1]


def table(stdout: str) -> dict[str, str]:
    """A two-column table as {label: value}, asserting that the values line up."""
    rows = [re.fullmatch(r"(\S+(?: \S+)*)(\s{2,})(.*)", line) for line in stdout.splitlines()]
    assert all(rows) and len({len(m[1] + m[2]) for m in rows if m}) == 1, stdout
    return {m[1]: m[3] for m in rows if m}


def _as_in_the_foreground() -> None:
    # Ctrl-C reaches a command in the foreground, whose SIGINT is at its
    # default.  A shell starts a background job (CI may run this suite as
    # one) with SIGINT ignored, children inherit that, and Python then
    # leaves it ignored, as a background job should.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def watching(wheel_name: str, *extra: str, command: str = "stat") -> Iterator[subprocess.Popen[str]]:
    """``stat --watch --json`` (or ``command``'s) running in the background; killed at the end if still running."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmwheel", command, wheel_name, "--watch", "--json", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_in_the_foreground,
    )
    watchdog = threading.Timer(20, proc.kill)  # a hung CLI fails the test instead of hanging it
    watchdog.start()
    try:
        with proc:
            yield proc
            proc.kill()
    finally:
        watchdog.cancel()


# -- create -------------------------------------------------------------------


def test_create_then_stat_shows_the_parameters(name: str) -> None:
    proc = run(
        "create", name, "--capacity", "500", "--tick", "0.002", "--payload-size", "32", "--wheel-size", "64",
        "--mode", "640",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    size = (SHM / name).stat().st_size
    assert proc.stdout.count("\n") == 1
    for part in (repr(name), "capacity 500", "tick 2 ms", "payload 32 bytes", "of 64 buckets", f"{size} bytes"):
        assert part in proc.stdout
    assert (SHM / name).stat().st_mode & 0o777 == 0o640

    proc = run("stat", name, "--interval", "0.1")
    assert proc.returncode == 0, proc.stderr
    rows = table(proc.stdout)
    assert rows["wheel"] == name
    assert rows["pending"] == "0"
    assert rows["capacity"] == "500 (0.0% used)"
    assert rows["tick"] == "2 ms"
    with shmwheel.attach(name) as w:
        levels = w.levels
    assert rows["levels"] == f"{levels} of 64 buckets"
    assert [k for k in rows if k.startswith("level ")][:2] == ["level 0 (2 ms/bucket)", "level 1 (128 ms/bucket)"]
    assert len([k for k in rows if k.startswith("level ")]) == levels


def test_create_in_shards_says_so_and_stat_shows_them(name: str) -> None:
    """A capacity that the shards do not divide is rounded up, and said."""
    proc = run("create", name, "--capacity", "1000", "--shards", "3")
    assert proc.returncode == 0, proc.stderr
    assert "capacity 1002 in 3 shards" in proc.stdout
    rows = table(run("stat", name, "--interval", "0.1").stdout)
    assert rows["capacity"] == "1002 (0.0% used)"
    assert rows["shards"] == "3 (a lock and a wheel each, 334 slots each)"
    error = one_line_error(run("create", name + "-2", "--capacity", "4", "--shards", "8"))
    assert error == "shmwheel: shards must be between 1 and 4, not 8"
    assert not (SHM / (name + "-2")).exists()


def test_create_over_an_existing_name_fails(name: str) -> None:
    assert run("create", name, "--capacity", "10").returncode == 0
    error = one_line_error(run("create", name, "--capacity", "20"))
    assert name in error and "exists" in error
    with shmwheel.attach(name) as w:
        assert w.capacity == 10  # the first one is untouched


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--capacity", "0"], f"argument --capacity: must be between 1 and {lib.SHMW_MAX_CAPACITY}, not 0"),
        (["--capacity", "many"], "argument --capacity: invalid int value: 'many'"),
        (["--capacity", "10", "--wheel-size", "100"], "argument --wheel-size: must be a power of two from 16 to"),
        (["--capacity", "10", "--wheel-size", "8192"], "argument --wheel-size: must be a power of two from 16 to"),
        (["--capacity", "10", "--tick", "0"], "argument --tick: must be between 1e-06 and 60 seconds, not 0"),
        (["--capacity", "10", "--tick", "nan"], "argument --tick: must be between 1e-06 and 60 seconds, not nan"),
        (["--capacity", "10", "--tick", "soon"], "argument --tick: invalid number of seconds: 'soon'"),
        (["--capacity", "10", "--payload-size", "999999"], "argument --payload-size: must be between 0 and 65536"),
        (["--capacity", "10", "--payload-size", "-1"], "argument --payload-size: must be between 0 and 65536"),
        (["--capacity", "10", "--mode", "800"], "argument --mode: must be an octal mode"),
    ],
)
def test_create_bad_values_are_usage_errors(name: str, args: list[str], says: str) -> None:
    """Out of range is a usage error as much as not a number: exit 2, the usage, the message."""
    proc = run("create", name, *args)
    assert says in one_line_error(proc, 2)
    assert proc.stderr.startswith("usage: shmwheel create ")
    assert not (SHM / name).exists()


def test_create_accepts_the_limits(name: str) -> None:
    """The parser's bounds are the library's own: the extremes it accepts, create() accepts."""
    proc = run(
        "create", name, "--capacity", "1", "--tick", "60", "--payload-size", str(lib.SHMW_MAX_PAYLOAD),
        "--wheel-size", str(1 << lib.SHMW_MIN_WHEEL_BITS),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with shmwheel.attach(name) as w:
        assert (w.capacity, w.tick, w.payload_size, w.wheel_size) == (1, 60, lib.SHMW_MAX_PAYLOAD, 16)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["stat", "x", "--interval", "soon"], "argument --interval: invalid number of seconds: 'soon'"),
        (["stat", "x", "--interval", "0"], "argument --interval: must be a finite number > 0, not 0"),
        (["demo", "--duration", "soon"], "argument --duration: invalid number of seconds: 'soon'"),
        (["demo", "--duration", "inf"], "argument --duration: must be a finite number > 0, not inf"),
    ],
)
def test_every_option_in_seconds_parses_as_tick_does(args: list[str], says: str) -> None:
    """--interval and --duration are read by the same type as --tick: one check of a time."""
    assert says in one_line_error(run(*args), 2)


# -- errors common to the commands that take a NAME --------------------------------


@pytest.mark.parametrize("command", ["stat", "check", "unlink"])
def test_missing_segment_is_an_error(name: str, command: str) -> None:
    assert one_line_error(run(command, name)) == f"shmwheel: no shmwheel segment named {name!r}"


def test_a_name_outside_dev_shm_is_refused() -> None:
    assert "invalid wheel name" in one_line_error(run("unlink", "../../etc/passwd"))


# -- stat ---------------------------------------------------------------------


def test_stat_json_reports_the_wheel(make_wheel: MakeWheel) -> None:
    w = make_wheel(capacity=200, payload_size=16)
    w.add_many([0.1, 10, 100, 10_000])
    w.cancel(w.add(50))
    proc = run("stat", w.name, "--json", "--interval", "0.2")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {k: report[k] for k in ("name", "pending", "capacity", "free", "added", "cancelled", "fired")} == {
        "name": w.name,
        "pending": 4,
        "capacity": 200,
        "free": 196,
        "added": 5,
        "cancelled": 1,
        "fired": 0,
    }
    assert report["used_percent"] == 2.0
    assert report["driver_pid"] is None and report["driver_state"] == "none"
    assert report["payload_size"] == 16 and report["tick"] == 0.001
    assert len(report["level_pending"]) == w.levels and sum(report["level_pending"]) == 4
    assert 0.2 <= report["interval"] < 5
    assert report["added_per_s"] == report["cancelled_per_s"] == report["fired_per_s"] == 0
    assert set(shmwheel.WheelStats.__dataclass_fields__) <= set(report)
    assert all(isinstance(report[k], (int, float)) for k in ("lag", "clock", "in_flight", "interval", "time"))


def test_stat_watch_json_rates_follow_the_counters(make_wheel: MakeWheel) -> None:
    """Each line's rates are the counters' change over the time since the line before."""
    w = make_wheel()
    with watching(w.name, "--interval", "0.2") as proc:
        assert proc.stdout is not None
        lines = [json.loads(proc.stdout.readline())]  # the watch has sampled: what we add now shows up later
        w.add_many([60.0] * 10)
        while lines[-1]["added"] < 10:
            lines.append(json.loads(proc.stdout.readline()))
        proc.terminate()
        assert proc.wait() == 0
    for before, after in itertools.pairwise(lines):
        assert after["added_per_s"] == pytest.approx((after["added"] - before["added"]) / after["interval"])
    assert max(line["added_per_s"] for line in lines) > 0
    assert lines[-1]["pending"] == 10


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stat_watch_prints_json_lines_until_a_signal_then_exits_0(make_wheel: MakeWheel, sig: signal.Signals) -> None:
    w = make_wheel()
    with watching(w.name, "--interval", "0.05") as proc:
        assert proc.stdout is not None
        lines = [json.loads(proc.stdout.readline()) for _ in range(3)]
        proc.send_signal(sig)
        rest, err = proc.communicate()
    assert proc.returncode == 0
    assert err == ""
    assert [line["name"] for line in lines] == [w.name] * 3
    assert lines[0]["time"] < lines[1]["time"] < lines[2]["time"]
    assert all(json.loads(line)["name"] == w.name for line in rest.splitlines())


# -- requests -----------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_requests_watch_prints_a_json_array_a_line_until_a_signal_then_exits_0(
    make_wheel: MakeWheel, sig: signal.Signals
) -> None:
    """A request of this process's, as a worker would add it: each line
    lists it, older each time, until the signal ends the watch."""
    w = make_wheel(payload_size=256)
    me = os.getpid()
    w.add(60, encode_request(KIND_REQUEST, me, start_time(me) or 0, time.monotonic_ns(), "GET", "watched", "/x"))
    with watching(w.name, "--interval", "0.05", command="requests") as proc:
        assert proc.stdout is not None
        lines = [json.loads(proc.stdout.readline()) for _ in range(3)]
        proc.send_signal(sig)
        _, err = proc.communicate()
    assert proc.returncode == 0 and err == ""
    assert [[(r["request_id"], r["stage"], r["worker_pid"]) for r in line] for line in lines] == [
        [("watched", "running", me)]
    ] * 3
    assert lines[0][0]["age_s"] < lines[1][0]["age_s"] < lines[2][0]["age_s"]


def test_requests_watch_on_a_terminal_redraws_the_list_as_top_does(make_wheel: MakeWheel) -> None:
    """On a terminal: the screen cleared and the list drawn again under a
    title line, each interval, until SIGTERM ends it with status 0."""
    w = make_wheel(payload_size=256)
    me = os.getpid()
    w.add(60, encode_request(KIND_REQUEST, me, start_time(me) or 0, time.monotonic_ns(), "GET", "on-a-tty", "/x"))
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmwheel", "requests", w.name, "--watch", "--interval", "0.05"],
        stdin=follower, stdout=follower, stderr=subprocess.PIPE, preexec_fn=_as_in_the_foreground,
    )  # fmt: skip
    os.close(follower)
    seen = b""
    try:
        give_up = time.monotonic() + 20
        # Four clears, so that the three frames between them are whole: the
        # last one read may still be on its way.
        while seen.count(b"\x1b[H\x1b[2J") < 4 and time.monotonic() < give_up:
            if select.select([leader], [], [], 1.0)[0]:
                seen += os.read(leader, 65536)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        proc.kill()
        os.close(leader)
        assert proc.stderr is not None
        proc.stderr.close()
    frames = seen.decode().split("\x1b[H\x1b[2J")[1:-1]
    assert len(frames) >= 3, seen
    assert all(re.match(rf"wheel {w.name}: 1 request in flight, \d\d:\d\d:\d\d\r\n\r\n +AGE ", f) for f in frames[:3])
    assert all("on-a-tty" in f and "GET /x" in f for f in frames[:3])


def test_requests_of_a_wheel_that_is_not_there_is_a_one_line_error() -> None:
    assert "no-such-wheel" in one_line_error(run("requests", "no-such-wheel"))


# -- ls -----------------------------------------------------------------------


def test_ls_lists_wheels_and_only_wheels(make_wheel: MakeWheel, name: str) -> None:
    w = make_wheel(capacity=77)
    w.add(60)
    foreign_segment(name, b"not a wheel, just bytes")
    old = fresh_name()
    foreign_segment(old, struct.pack("<QI", lib.SHMW_MAGIC, 999))  # a shmwheel of a layout version from the future
    try:
        proc = run("ls")
    finally:
        posix_ipc.unlink_shared_memory("/" + old)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()}
    assert rows["NAME"] == ["NAME", "SIZE", "OWNER", "MODE", "CAPACITY", "PENDING", "REQUESTS", "DRIVER"]
    size = (SHM / w.name).stat().st_size
    # Its timer carries no request record: it is no request-timeout wheel, and has no requests to count.
    assert rows[w.name] == [w.name, str(size), pwd.getpwuid(os.getuid()).pw_name, "0600", "77", "1", "-", "-"]
    assert name not in rows
    assert "has another layout version" in " ".join(rows[old])


def test_ls_json_is_an_array_of_segments(make_wheel: MakeWheel) -> None:
    w = make_wheel(capacity=33)
    proc = run("ls", "--json")
    assert proc.returncode == 0, proc.stderr
    segments = json.loads(proc.stdout)
    assert isinstance(segments, list)
    (mine,) = [s for s in segments if s["name"] == w.name]
    assert mine == {
        "name": w.name,
        "size": (SHM / w.name).stat().st_size,
        "owner": pwd.getpwuid(os.getuid()).pw_name,
        "mode": "0600",
        "capacity": 33,
        "pending": 0,
        "requests": 0,
        "driver_pid": None,
        "error": None,
    }


def test_ls_lists_a_wheel_it_cannot_attach_with_the_reason(make_wheel: MakeWheel) -> None:
    """A wheel others may read but not write: listed, with why there are no numbers."""
    w = make_wheel(mode=0o444)
    prefix: list[str] = []
    if os.geteuid() == 0:  # root opens anything: run ls without the capabilities that let it
        if not shutil.which("setpriv"):
            pytest.skip("running as root and setpriv is not there to drop CAP_DAC_OVERRIDE")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    proc = run("ls", "--json", prefix=prefix)
    assert proc.returncode == 0, proc.stderr
    (mine,) = [s for s in json.loads(proc.stdout) if s["name"] == w.name]
    assert mine["capacity"] is None
    assert mine["error"].startswith(f"cannot open segment {w.name!r}: ")  # one clean line, no "[Errno 13]"
    assert "permission" in mine["error"].lower()


def test_ls_into_a_closed_pipe_stops_quietly(make_wheel: MakeWheel) -> None:
    """`shmwheel ls | head -1` must not print a BrokenPipeError."""
    make_wheel()  # so that there is something to print
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "shmwheel", "ls"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=30
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 128 + signal.SIGPIPE
    assert proc.stderr == ""


# -- check and unlink -----------------------------------------------------------


def test_check_a_good_wheel(make_wheel: MakeWheel) -> None:
    w = make_wheel()
    w.add(1)
    proc = run("check", w.name)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{w.name}: ok\n", "")


def test_check_a_corrupt_wheel_names_the_broken_invariant(make_wheel: MakeWheel) -> None:
    w = make_wheel()
    w.add(1)
    hd = header(w)
    hd.free_count += 1
    try:
        error = one_line_error(run("check", w.name))
    finally:
        hd.free_count -= 1
    assert error.startswith(f"shmwheel: segment {w.name!r} is corrupt: ")
    assert f"free_count is {w.capacity} but {w.capacity - 1} entries are free" in error


def test_unlink_removes_the_segment(name: str) -> None:
    assert run("create", name, "--capacity", "10").returncode == 0
    proc = run("unlink", name)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert not (SHM / name).exists()
    one_line_error(run("unlink", name))


def test_unlink_refuses_a_wheel_in_use_unless_forced(name: str) -> None:
    """A live producer (this process) holds the wheel: removing it would leave
    it adding timers nothing fires.  --force removes it, marked removed, so
    the producer's next add says so instead of going into the void."""
    assert run("create", name, "--capacity", "10").returncode == 0
    with shmwheel.attach(name) as w:
        error = one_line_error(run("unlink", name))
        assert f"wheel {name!r} is in use: 1 process attached to it (pid {os.getpid()})" in error
        assert "--force" in error
        assert (SHM / name).exists()
        proc = run("unlink", "--force", name)
        assert (proc.returncode, proc.stderr) == (0, "")
        assert not (SHM / name).exists()
        with pytest.raises(shmwheel.SegmentRemovedError):
            w.add(1)


def test_unlink_refuses_a_damaged_wheel_in_use_too(name: str) -> None:
    """A wheel marked damaged is still looked into, and still in use."""
    assert run("create", name, "--capacity", "10").returncode == 0
    with shmwheel.attach(name) as w:
        header(w).flags |= lib.SHMW_F_DAMAGED
        assert f"wheel {name!r} is in use: 1 process attached" in one_line_error(run("unlink", name))
        assert (SHM / name).exists()
        w.repair()


def test_a_shrunk_segment_is_reported_by_check_stat_and_ls(name: str) -> None:
    """Shrinking the file under attached processes is beyond what they survive
    (SIGBUS), but the tools say so instead of dying of it."""
    assert run("create", name, "--capacity", "1000").returncode == 0
    size = (SHM / name).stat().st_size
    os.truncate(SHM / name, size // 2)
    for command in ("check", "stat"):
        assert "is smaller than its header says: its file was shrunk" in one_line_error(run(command, name))
    listed = {s["name"]: s for s in json.loads(run("ls", "--json").stdout)}
    assert "is smaller than its header says" in listed[name]["error"]


def test_unlink_leaves_another_programs_segment_alone(name: str) -> None:
    foreign_segment(name, b"someone else's")
    assert "not a shmwheel segment" in one_line_error(run("unlink", name))
    assert (SHM / name).exists()


# -- driver -----------------------------------------------------------------------


def test_driver_jsonl_whose_reader_goes_away_exits_141_and_leaves_the_rest_in_flight(make_wheel: MakeWheel) -> None:
    """`shmwheel driver NAME --jsonl | head -1`: the fires that could not be
    written are not acknowledged; the driver deregisters and the next one
    gets them, marked redelivered."""
    wheel = make_wheel(capacity=100)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmwheel", "driver", wheel.name, "--jsonl"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    watchdog = threading.Timer(30, proc.kill)  # a driver that never notices fails the test instead of hanging it
    watchdog.start()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        wait_for(lambda: wheel.stats().driver_pid == proc.pid)
        first = wheel.add(0.001, b"first")
        assert json.loads(proc.stdout.readline())["handle"] == first
        wait_for(lambda: wheel.stats().acked == 1)
        proc.stdout.close()  # the reader goes away, as head does after one line
        due = time.monotonic() + 0.5  # one deadline, after the last add: all fired together
        rest = {wheel.add_at(due, b"rest") for _ in range(20)}
        status = proc.wait(timeout=30)
        err = proc.stderr.read().decode()
        proc.stderr.close()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert status == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err and "Error" not in err
    st = wheel.stats()
    assert (st.acked, st.handler_errors, st.in_flight, st.driver_pid) == (1, 0, 20, None)
    fires = wheel.poll()
    assert {f.handle for f in fires} == rest
    assert all(f.redelivered and f.payload == b"rest" for f in fires)


def test_driver_jsonl_decodes_a_request_record(make_wheel: MakeWheel) -> None:
    """A request-timeout wheel's fire: the record decoded beside its bytes; another payload: only its bytes."""
    from shmwheel.contrib import KIND_REQUEST, encode_request

    wheel = make_wheel(capacity=100, payload_size=256)
    record = encode_request(KIND_REQUEST, 4321, 99, 12345, "POST", "abc-1", "/upload/é", thread=0x7F01, task=0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmwheel", "driver", wheel.name, "--jsonl"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        wait_for(lambda: wheel.stats().driver_pid == proc.pid)
        wheel.add(0.001, record)
        first = json.loads(proc.stdout.readline())
        wheel.add(0.001, b"\x01 not a record, though it starts like one" + bytes(60))
        second = json.loads(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(30)
    assert first["payload_hex"] == record.hex()
    assert first["request"] == {
        "method": "POST", "path": "/upload/é", "truncated": False, "request_id": "abc-1", "worker_pid": 4321,
        "thread": 0x7F01, "task": 0, "task_kind": "", "started_ns": 12345, "timeout_ms": 0, "warn": False,
        "interrupt": False,
        "queued_ms": 0,
    }  # fmt: skip
    assert "request" not in second


def _console_script() -> str:
    """The installed ``shmwheel`` entry point of the Python running the tests."""
    path = shutil.which("shmwheel", path=sysconfig.get_path("scripts"))
    if path is None:
        pytest.skip("the shmwheel console script is not installed (pip install -e .)")
    return path


def test_console_script_driver_imports_the_handler_from_the_current_directory(
    make_wheel: MakeWheel, tmp_path: Path
) -> None:
    """As `python -m shmwheel` (and uvicorn, gunicorn) do, `shmwheel driver --handler` finds cwd's modules."""
    wheel = make_wheel(capacity=10)
    module = f"handler_in_cwd_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text(
        "def on_fire(fire):\n    with open('fires.txt', 'a') as f:\n        f.write(f'{fire.handle}\\n')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.Popen(
        [_console_script(), "driver", wheel.name, "--handler", f"{module}:on_fire"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: wheel.stats().driver_pid == proc.pid or proc.poll() is not None)
        assert proc.poll() is None, proc.communicate()
        h = wheel.add(0.001)
        wait_for(lambda: wheel.stats().acked == 1)
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert (tmp_path / "fires.txt").read_text() == f"{h}\n"
    assert wheel.stats().handler_errors == 0


def test_driver_help_says_where_the_handler_module_is_looked_for() -> None:
    proc = run("driver", "--help")
    assert proc.returncode == 0
    assert "current directory" in " ".join(proc.stdout.split())


def test_timeouts_is_the_request_timeout_driver_command(name: str) -> None:
    """``shmwheel timeouts`` is ``python -m shmwheel.contrib.timeouts``
    under the one command line: it makes and drives a request wheel, stops
    on SIGTERM with status 0 and removes what it made; its usage errors
    name it."""
    assert "drive a request-timeout wheel" in run("--help").stdout
    assert "--kill-after" in run("timeouts", "--help").stdout
    bad = run("timeouts", "a/b")
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1].startswith(
        "shmwheel timeouts: error: invalid wheel name"
    )
    proc = subprocess.Popen([sys.executable, "-m", "shmwheel", "timeouts", name, "--create"], stderr=subprocess.PIPE,
                            text=True)  # fmt: skip

    def driven() -> bool:
        try:
            with observe(name) as wheel:
                return wheel.stats().driver_pid == proc.pid
        except shmwheel.ShmwheelError:  # not there yet, or not made whole yet
            return False

    try:
        wait_for(driven)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert not (SHM / name).exists()


# -- demo -------------------------------------------------------------------------


@pytest.mark.parametrize("workers", ["-2", "0", str(lib.SHMW_MAX_PRODUCERS)])
def test_demo_refuses_a_number_of_workers_it_cannot_run(workers: str) -> None:
    proc = run("demo", "--workers", workers, "--duration", "0.1")
    assert "argument --workers: must be between 1 and" in one_line_error(proc, 2)


def test_demo_ctrl_c_cleans_up_and_exits_130() -> None:
    """Ctrl-C as a terminal sends it, to the whole process group, while the workers start."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "shmwheel", "demo", "--workers", "4", "--duration", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_as_in_the_foreground,
        start_new_session=True,  # its own process group, as a shell gives a job
    )
    segment = SHM / f"shmwheel-demo-{proc.pid}"
    # The driver and the workers hold the pipes too: a hung demo is killed with its whole group.
    watchdog = threading.Timer(20, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        assert proc.stdout is not None
        while "the driver prints each timeout" not in (line := proc.stdout.readline()):
            assert line, "the demo ended before it started its workers"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate()
    finally:
        watchdog.cancel()
        if segment.exists():  # left behind by a demo that failed
            shmwheel.unlink(segment.name)
    assert proc.returncode == 128 + signal.SIGINT, (out, err)
    assert "Traceback" not in err
    assert "interrupted" in out and "removed" in out
    assert not segment.exists()
