"""The driver command, ``python -m shmwheel.contrib.timeouts``, as a real
subprocess: the wheel it creates and removes, and its errors, each in
one line with no traceback."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

from _contrib import WAIT, driver_pid, wait_until
from conftest import foreign_segment


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
