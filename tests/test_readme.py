"""The examples of the README and the docs run as written."""

from __future__ import annotations

import ast
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


# A test named in the docs: ``test_x.py``, ``tests/test_x.py::test_name``
# (a parametrized id's ``[...]`` left off), or ``::test_other``, which is in
# the file named last in the same table cell or paragraph.
_TEST_REFERENCE = re.compile(r"(?<![\w/.])(?:tests/)?(test_\w+\.py)(?:::(\w+))?|(?<![\w.:])::(\w+)")


def _cells_and_paragraphs(text: str) -> list[str]:
    """A page cut where a shorthand reference stops reaching back: each
    cell of a table row, each paragraph of the rest."""
    pieces: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text):
        if paragraph.lstrip().startswith("|"):
            pieces += [cell for line in paragraph.splitlines() for cell in line.split("|")]
        else:
            pieces.append(paragraph)
    return pieces


def _test_functions(path: Path) -> set[str]:
    """The functions of a test module, and the methods of its classes."""
    tree = ast.parse(path.read_text())
    bodies = [tree.body, *(node.body for node in tree.body if isinstance(node, ast.ClassDef))]
    return {node.name for body in bodies for node in body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_test_the_readme_and_the_docs_name_exists() -> None:
    """Each test named as holding a promise is in its file under tests/: a
    test renamed, moved or removed leaves no promise backed by nothing."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    functions: dict[str, set[str]] = {}
    wrong: list[str] = []
    checked = 0
    for page in pages:
        for piece in _cells_and_paragraphs(page.read_text()):
            module = None
            for found in _TEST_REFERENCE.finditer(piece):
                module = found.group(1) or module
                name = found.group(2) or found.group(3)
                checked += 1
                if module is None:
                    wrong.append(f"{page.name}: {found.group()} follows no test file")
                elif not (ROOT / "tests" / module).is_file():
                    wrong.append(f"{page.name}: {found.group()} names no file in tests/")
                elif name:
                    if module not in functions:
                        functions[module] = _test_functions(ROOT / "tests" / module)
                    if name not in functions[module]:
                        wrong.append(f"{page.name}: {found.group()} names no test in tests/{module}")
    assert not wrong, "\n".join(wrong)
    assert checked > 100
