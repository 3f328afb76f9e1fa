#!/usr/bin/env python3
"""The package's import graph, and the rules it must keep.

Reads every module of ``shmwheel/`` (not imports them) and collects each
``import`` and ``from ... import`` of a module of the package, at module
level and inside functions alike, but not under ``if TYPE_CHECKING:``,
which runs for the type checker only.  A compiled module (``_fast``,
``_shmwheel``) is a leaf: it imports nothing of the package.  Checked:

* no circle: no module imports itself, however far round;
* contrib's floors (FLOORS below): a module imports only from floors below
  its own;
* the worker side never imports the driver side: nothing that a worker
  loads (WORKER) reaches, however far down, a module of DRIVER;
* one door: no module but ``shmwheel.contrib._door`` imports the C
  extension shmwheel._fast.

Usage::

    python tools/imports.py            # the rules; exit status 1 if one is broken
    python tools/imports.py --graph    # each module and what it imports
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shmwheel"

#: contrib, bottom to top.  A module may import from a floor below its own
#: and from the core package, never from its own floor or one above.
FLOORS: list[tuple[str, ...]] = [
    ("_record", "_routes", "_logs", "_calls"),  # what both sides share
    ("_settings", "_inflight"),
    ("_metrics",),  # the driver's counts, in the wheel, and its metrics
    ("_body",),  # the WSGI body, below the one door to C, which chooses it
    ("_door",),  # the only import of shmwheel._fast
    ("_stacks",),  # the worker's side: stacks and the reporter thread
    ("_safepoint", "_autodriver"),
    ("_interrupt",),
    ("_worker",),  # the request's timer
    ("_views",),  # a view's own timeout, on the request's timer
    ("_handler",),  # the driver's side
    ("_supervisor", "_operator"),
    ("wsgi", "asgi", "timeouts", "sentry", "otel"),  # the adapters, the driver command, the trackers' integrations
    ("uwsgi", "gunicorn"),
    ("__init__",),
]

#: What a worker loads, and what it must never load.
WORKER = (
    "shmwheel.contrib._worker",
    "shmwheel.contrib._views",
    "shmwheel.contrib.wsgi",
    "shmwheel.contrib.asgi",
    "shmwheel.contrib.sentry",
    "shmwheel.contrib.otel",
)
DRIVER = (
    "shmwheel.contrib._handler",
    "shmwheel.contrib._metrics",
    "shmwheel.contrib._operator",
    "shmwheel.contrib._supervisor",
    "shmwheel.contrib.timeouts",
)


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, but those under ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


#: The C extension of the request path, and the one module that may import it.
EXTENSION = "shmwheel._fast"
DOOR = "shmwheel.contrib._door"
_extension_importers: set[str] = set()


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` imports (and, aside, in
    _extension_importers, whether it imports the extension)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # "from . import x": x is a module of its own if there is one.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known or _compiled(f"{base}.{alias.name}") else base
                for alias in node.names
            ]
        for target in targets:
            if _compiled(target):
                if target == EXTENSION:
                    _extension_importers.add(name)
                continue  # a leaf
            while target and target not in known:  # "from shmwheel.x import y" names x
                target = target.rpartition(".")[0] if target.startswith("shmwheel.") else ""
            if target and target != name:
                out.add(target)
    return out


def _compiled(name: str) -> bool:
    """Whether ``name`` is an extension module of the package: its stub or
    its build is there."""
    *where, last = name.split(".")
    folder = ROOT.joinpath(*where)
    return where[:1] == ["shmwheel"] and (
        (folder / f"{last}.pyi").exists() or any(folder.glob(f"{last}.*.so")) or (folder / f"{last}.so").exists()
    )


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: edges(name, path, known) for name, path in known.items()}


def circles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            connect(v)
    return found


def floor_of(name: str) -> int | None:
    if not name.startswith("shmwheel.contrib"):
        return None
    short = name.removeprefix("shmwheel.contrib").lstrip(".") or "__init__"
    for k, floor in enumerate(FLOORS):
        if short in floor:
            return k
    return -1


def reach(g: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` loads, each with the module that imports it."""
    seen = {start: ""}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in sorted(g[v]):
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def problems(g: dict[str, set[str]]) -> list[str]:
    found = [f"an import circle: {' -> '.join(c)}" for c in circles(g)]
    for name in sorted(g):
        mine = floor_of(name)
        if mine == -1:
            found.append(f"{name}: on no floor of tools/imports.py's FLOORS")
            continue
        for target in sorted(g[name]):
            theirs = floor_of(target)
            if mine is not None and theirs is not None and theirs >= mine:
                found.append(f"{name} (floor {mine}) imports {target} (floor {theirs}): not below it")
            if mine is None and theirs is not None and name != "shmwheel._cli":
                found.append(f"{name}, of the core, imports {target}, of contrib")
    for name in sorted(_extension_importers - {DOOR}):
        found.append(f"{name} imports {EXTENSION}: only {DOOR} may")
    for start in WORKER:
        loaded = reach(g, start)
        for bad in DRIVER:
            if bad in loaded:
                path = [bad]
                while loaded[path[-1]]:
                    path.append(loaded[path[-1]])
                found.append(f"the worker side loads the driver side: {' <- '.join(path)}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--graph", action="store_true", help="print each module and what it imports")
    args = parser.parse_args()
    g = graph()
    if args.graph:
        for name in sorted(g):
            print(f"{name}: {', '.join(sorted(g[name])) or '-'}")
        return 0
    found = problems(g)
    for line in found:
        print(line)
    if not found:
        print(
            f"{len(g)} modules: no circle, contrib in {len(FLOORS)} floors, the worker side apart from the driver side"
        )
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
