"""The README's examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import fresh_name

README = Path(__file__).resolve().parent.parent / "README.md"


def _block_under(heading: str) -> str:
    """The first ```python block after ``heading``."""
    text = README.read_text()
    found = re.search(rf"^{re.escape(heading)}\n.*?```python\n(.*?)```", text, re.S | re.M)
    assert found, f"no python block under {heading!r} in README.md"
    return found.group(1)


def test_the_use_example_runs_as_a_script(tmp_path: Path) -> None:
    # Run as a file, as a reader would paste it: the driver's process is
    # spawned and imports it again, which is what the __main__ guard is for.
    code = _block_under("## Use")
    name = fresh_name()
    assert code.count('"requests"') >= 3
    script = tmp_path / "example.py"
    script.write_text(code.replace('"requests"', repr(name)))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"timed out: b'GET /slow' \d+\.\d ms after its deadline\n", done.stdout), done.stdout
    assert not (Path("/dev/shm") / name).exists()
