"""The examples of the README and the docs run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import fresh_name

ROOT = Path(__file__).resolve().parent.parent


def _block_under(heading: str, where: str) -> str:
    """The first ```python block after ``heading`` in file ``where``."""
    text = (ROOT / where).read_text()
    found = re.search(rf"^{re.escape(heading)}\n.*?```python\n(.*?)```", text, re.S | re.M)
    assert found, f"no python block under {heading!r} in {where}"
    return found.group(1)


def test_the_use_example_runs_as_a_script(tmp_path: Path) -> None:
    # Run as a file, as a reader would paste it: the driver's process is
    # spawned and imports it again, which is what the __main__ guard is for.
    code = _block_under("## Use", "docs/api.md")
    name = fresh_name()
    assert code.count('"requests"') >= 3
    script = tmp_path / "example.py"
    script.write_text(code.replace('"requests"', repr(name)))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"timed out: b'GET /slow' \d+\.\d ms after its deadline\n", done.stdout), done.stdout
    assert not (Path("/dev/shm") / name).exists()


def _slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_every_link_between_the_readme_and_the_docs_arrives() -> None:
    """A relative link names a file that is there, and an anchor a heading
    of its file: the README's quick start and the manual in docs/ point at
    each other's sections."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    anchors = {page.resolve(): {_slug(h) for h in re.findall(r"^#+ (.*)$", page.read_text(), re.M)} for page in pages}
    checked = 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            where = (page.parent / path).resolve() if path else page.resolve()
            assert where.exists(), f"{page.name}: {target} names no file"
            if anchor:
                assert anchor in anchors.get(where, set()), f"{page.name}: {target} names no heading"
            checked += 1
    assert checked > 20
