"""The package ships py.typed, so its annotations are part of the API: a
user's type checker must accept what the documentation allows and reject
what the code would refuse at run time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mypy(*args: str, cwd: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    # MYPYPATH: an editable install is a path hook that mypy cannot follow.
    # What the user's checker finds wrong inside an installed package it
    # keeps to itself (the package's own check is the test above), hence
    # --follow-imports=silent for the user's code.
    env = {"MYPYPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_package_passes_strict_mypy(tmp_path: Path) -> None:
    result = mypy(cwd=ROOT, cache=tmp_path / "cache")  # pyproject.toml: strict, files = shmwheel
    assert result.returncode == 0, result.stdout + result.stderr
    assert "no issues found" in result.stdout


USER_CODE = """
import shmwheel

def use(wheel: shmwheel.Wheel) -> None:
    handle: int = wheel.add(0.5, b"bytes")
    wheel.add(0.5, bytearray(b"a bytearray"), cancel_on_exit=True)
    wheel.add_at(12.0, memoryview(b"a memoryview"))
    wheel.add_many([0.1, 0.2], [b"one", bytearray(b"two")])
    done: bool = wheel.cancel(handle)
    again: bool = wheel.reset(handle, 1.0)
    with wheel.timeout(2.0, b"block") as h:
        wheel.cancel(h)
    for fire in wheel.poll(max_fires=10):
        late: float = fire.lateness
        data: bytes = fire.payload
"""

MISUSE = """
import shmwheel

def misuse(wheel: shmwheel.Wheel) -> None:
    wheel.add(0.5, "a str is not a payload")
    wheel.cancel("not a handle")
"""


def test_documented_calls_type_check_and_misuse_does_not(tmp_path: Path) -> None:
    (tmp_path / "use.py").write_text(textwrap.dedent(USER_CODE))
    (tmp_path / "misuse.py").write_text(textwrap.dedent(MISUSE))
    good = mypy("--strict", "--follow-imports=silent", "use.py", cwd=tmp_path, cache=tmp_path / "cache")
    assert good.returncode == 0, good.stdout + good.stderr
    bad = mypy("--strict", "--follow-imports=silent", "misuse.py", cwd=tmp_path, cache=tmp_path / "cache")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    errors = [line for line in bad.stdout.splitlines() if ": error:" in line]
    assert [e.split(":")[1] for e in errors] == ["5", "6"], bad.stdout
    assert all("[arg-type]" in e for e in errors), bad.stdout
