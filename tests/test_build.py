"""What the build refuses, with its reason: a CPython the C request path
cannot serve safely stops the install instead of installing something
that would not work."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to compile with")
def test_a_free_threaded_cpython_stops_the_build_with_its_reason() -> None:
    """fast.c compiled as a free-threaded CPython's headers would have it
    (Py_GIL_DISABLED defined, as their pyconfig.h does) fails with the
    reason in the compiler's output, the line pip shows."""
    include = sysconfig.get_paths()["include"]
    command = ["gcc", "-fsyntax-only", "-std=gnu11", f"-I{include}", f"-I{ROOT / 'csrc'}"]
    plain = subprocess.run([*command, str(ROOT / "csrc/python/fast.c")], capture_output=True, text=True)
    assert plain.returncode == 0, plain.stderr  # the same command compiles the module as it is built
    threaded = subprocess.run(
        [*command, "-DPy_GIL_DISABLED", str(ROOT / "csrc/python/fast.c")], capture_output=True, text=True
    )
    assert threaded.returncode != 0
    assert "shmwheel does not support free-threaded CPython: its C request path relies on the GIL" in threaded.stderr
