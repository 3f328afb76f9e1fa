"""The C core's own test (csrc/test_core.c), built with AddressSanitizer and
UndefinedBehaviorSanitizer: a model-checked run and thousands of scribbled
segments, where any out-of-bounds access, overflow or UB aborts."""

from __future__ import annotations

import subprocess
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def test_c_core_under_asan_and_ubsan(tmp_path: Path) -> None:
    exe = tmp_path / "test_core"
    build = subprocess.run(
        [
            "gcc", "-std=gnu11", "-g", "-O1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
            "-Wall", "-Wextra", "-Werror", f"-I{CSRC}", str(CSRC / "test_core.c"),
            *map(str, sorted((CSRC / "core").glob("*.c"))), "-lm", "-lpthread", "-o", str(exe),
        ],
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "no failures" in run.stdout
