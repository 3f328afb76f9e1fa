"""The package's layout: its import graph (tools/imports.py) and where its
public names live."""

from __future__ import annotations

import ast
import importlib.util
import re
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

import shmwheel.contrib

ROOT = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("imports_tool", ROOT / "tools" / "imports.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_has_no_import_circle_and_contrib_imports_only_downward() -> None:
    imports = _tool()
    graph = imports.graph()
    assert "shmwheel.contrib._worker" in graph and "shmwheel._wheel" in graph["shmwheel.contrib._worker"]
    assert imports.problems(graph) == []
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "imports.py")], capture_output=True, text=True)
    assert run.returncode == 0 and "no circle" in run.stdout, run.stdout + run.stderr


def test_the_import_rules_catch_a_circle_an_upward_import_a_worker_that_loads_the_driver_and_a_second_door() -> None:
    imports = _tool()
    graph = imports.graph()
    circle = {**graph, "shmwheel._results": graph["shmwheel._results"] | {"shmwheel._wheel"}}
    assert any("circle" in p and "shmwheel._results" in p for p in imports.problems(circle))
    upward = {**graph, "shmwheel.contrib._record": graph["shmwheel.contrib._record"] | {"shmwheel.contrib._stacks"}}
    assert any("not below it" in p for p in imports.problems(upward))
    worker = {**graph, "shmwheel.contrib._stacks": graph["shmwheel.contrib._stacks"] | {"shmwheel.contrib._handler"}}
    found = imports.problems(worker)
    assert any(p.startswith("the worker side loads the driver side: shmwheel.contrib._handler") for p in found), found
    imports._extension_importers.add("shmwheel.contrib._worker")
    found = imports.problems(graph)
    assert found == ["shmwheel.contrib._worker imports shmwheel._fast: only shmwheel.contrib._door may"], found


def test_a_worker_loads_none_of_the_drivers_side() -> None:
    """What the import graph says, as Python runs it: a worker that uses
    the middlewares and the public names it needs never loads the driver's
    side, however the package's own __init__ runs first."""
    code = (
        "import sys\n"
        "import shmwheel.contrib.wsgi, shmwheel.contrib.asgi\n"
        "from shmwheel.contrib import RequestTimer, RequestTimeout, TimeoutActions, extend, no_timeout\n"
        "print(sorted(m for m in sys.modules if m.startswith('shmwheel.contrib.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = ast.literal_eval(out)
    assert "shmwheel.contrib._worker" in loaded
    assert not {"shmwheel.contrib._handler", "shmwheel.contrib._supervisor", "shmwheel.contrib.timeouts"} & set(loaded)


def test_every_public_name_of_contrib_is_there_and_typed_where_it_lives() -> None:
    tree = ast.parse((ROOT / "shmwheel" / "contrib" / "__init__.py").read_text())
    typed = {
        alias.asname: node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name
    }
    homes = shmwheel.contrib._HOMES
    assert typed == {name: home for name, home in homes.items()}
    assert sorted(shmwheel.contrib.__all__) == sorted(homes)
    for name, home in homes.items():
        assert getattr(shmwheel.contrib, name) is getattr(importlib.import_module(f"shmwheel.contrib.{home}"), name)
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        shmwheel.contrib.Nothing  # noqa: B018


def test_the_driver_commands_module_still_gives_its_old_names_with_a_warning() -> None:
    from shmwheel.contrib import timeouts

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        timer = timeouts.RequestTimer
    assert timer is shmwheel.contrib.RequestTimer
    assert [str(w.message) for w in caught] == [
        "import RequestTimer from shmwheel.contrib, not shmwheel.contrib.timeouts, which is the driver command"
    ]
    with pytest.raises(AttributeError):
        timeouts.main_loop  # noqa: B018


def test_the_request_records_layout_is_the_c_headers() -> None:
    """Python packs and reads a record's head with a struct of its own; the
    layout is csrc/record.h's, whose offsets the compiler gives through the
    cffi module.  Each field the header places is where the struct puts it,
    and a record Python writes has each value at the header's offset."""
    from shmwheel._binding import lib
    from shmwheel.contrib import _record

    at, offsets = 0, []
    for code in _record.HEAD.format.lstrip("<"):
        offsets.append(at)
        at += struct.calcsize("<" + code)
    assert at == _record.HEAD.size == lib.SHMW_REQ_HEAD_SIZE
    placed = dict(zip(_HEAD_FIELDS, offsets, strict=True))
    header = {name: getattr(lib, f"SHMW_REQ_AT_{name.upper()}") for name in _PLACED}
    assert header == {name: placed[_PLACED[name]] for name in _PLACED}

    payload = _record.encode_request(
        _record.KIND_REQUEST, 4242, 77, 123_456_789, "GET", "rid", "/p", thread=0x1122334455667788, task=99,
        task_kind="task", stack_signal=10, timeout_ms=30_000, warn=True, queued_ms=250,
    )  # fmt: skip

    def field(code: str, at: int) -> int:
        value: int = struct.unpack_from("<" + code, payload, at)[0]
        return value

    assert field("B", lib.SHMW_REQ_AT_FLAGS) == lib.SHMW_REQ_TASK | lib.SHMW_REQ_WARN
    assert field("q", lib.SHMW_REQ_AT_STARTED) == 123_456_789
    assert field("Q", lib.SHMW_REQ_AT_THREAD) == 0x1122334455667788
    assert field("Q", lib.SHMW_REQ_AT_TASK) == 99
    assert field("B", lib.SHMW_REQ_AT_STACK_SIGNAL) == 10
    assert field("H", lib.SHMW_REQ_AT_MAGIC) == lib.SHMW_REQ_MAGIC
    assert field("I", lib.SHMW_REQ_AT_TIMEOUT) == 30_000
    assert field("I", lib.SHMW_REQ_AT_QUEUED) == 250


#: HEAD's fields in order, and which of them csrc/record.h names an offset of.
_HEAD_FIELDS = ("kind", "method_len", "request_id_len", "flags", "pid", "start", "started_ns", "thread", "task",
                "stack_signal", "dump_signal", "magic", "timeout_ms", "queued_ms")  # fmt: skip
_PLACED = {"flags": "flags", "started": "started_ns", "thread": "thread", "task": "task",
           "stack_signal": "stack_signal", "magic": "magic", "timeout": "timeout_ms",
           "queued": "queued_ms"}  # fmt: skip


def test_the_names_c_reads_back_are_the_protocols_members() -> None:
    """Every name fast.c reads, sets or calls on shmwheel's own Python
    objects is a member of a Protocol of _fast.pyi (so that mypy sees a
    rename where the object is handed to C), and every member is one C
    uses: the table in fast.c and the stub say the same."""
    c = (ROOT / "csrc" / "python" / "fast.c").read_text()
    ours = c[c.index("/* ---- ours begin */") : c.index("/* ---- ours end */")]
    in_c = set(re.findall(r'\{&str_\w+, "(\w+)"\}', ours))
    stub = ast.parse((ROOT / "shmwheel" / "_fast.pyi").read_text())
    members: set[str] = set()
    for node in stub.body:
        if isinstance(node, ast.ClassDef) and any(getattr(b, "id", None) == "Protocol" for b in node.bases):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    if not item.name.startswith("__"):
                        members.add(item.name)
                    members.update(a.arg for a in item.args.kwonlyargs)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
    assert len(in_c) > 10
    assert in_c == members, f"only in fast.c: {sorted(in_c - members)}; only in the stub: {sorted(members - in_c)}"
