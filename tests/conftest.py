"""Fixtures shared by the whole suite.

Every wheel a test makes itself goes through ``make_wheel``, which runs
the C invariant checker on it after the test and removes its segment; a
session hook fails the run if a segment named like the fixtures' wheels,
or like the wheels the servers and the demo that this run started make,
is left in /dev/shm anyway.  Tests marked ``long`` run only with --long.

The suite runs on the core built with the test hooks,
shmwheel._shmwheel_testing, which the package does not ship: this file
builds it into the package's directory when it is missing or stale.
Where it cannot (an installed package's read-only directory), the suite
runs on the shipped core and the tests that need a hook skip.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import posix_ipc
import pytest


class _TestingCore(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Gives the package the core built for the tests (csrc/testing.h) where
    it imports its shipped one: the same sources with a crash point before
    every store, the test hooks and the segment's structs.  In this process
    only: the servers and commands the tests start run the shipped core."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "shmwheel._shmwheel":
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> object:
        return importlib.import_module("shmwheel._shmwheel_testing")

    def exec_module(self, module: object) -> None:
        pass


def _build_testing_core() -> str | None:
    """Build shmwheel._shmwheel_testing into the package's directory if it
    is not there for this CPython or is older than a source of it; return
    why it cannot be had, or None.  It is not shipped (setup.py builds only
    the shipped core): it is built here, beside the package's modules, so
    that the processes the tests start import it too, once per CPython: a
    later run finds it (csrc/build_shmwheel.py)."""
    spec = importlib.util.find_spec("shmwheel")  # found, not imported: the finder is not in place yet
    assert spec is not None and spec.origin is not None, "the shmwheel package is not importable"
    package = Path(spec.origin).parent
    script = Path(__file__).resolve().parent.parent / "csrc" / "build_shmwheel.py"
    if not script.exists():
        return f"no {script} to build it from"
    build_spec = importlib.util.spec_from_file_location("build_shmwheel", script)
    assert build_spec is not None and build_spec.loader is not None
    build = importlib.util.module_from_spec(build_spec)
    build_spec.loader.exec_module(build)
    module = package / f"_shmwheel_testing{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    if module.exists() and module.stat().st_mtime >= build.newest_source():
        return None
    if not os.access(package, os.W_OK):
        return f"{package} is not writable (an installed package?)"
    compiler = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    if shutil.which(compiler.split()[0]) is None:
        return f"no C compiler ({compiler.split()[0]}) to build it with"
    build.build_in_place(build.testing_ffibuilder, package)
    return None


#: Why the suite runs on the shipped core, without the test hooks (then
#: every test that reaches for one skips, see pytest_runtest_makereport);
#: None when it runs on the tests' core, as it should.
TESTING_CORE_MISSING = _build_testing_core()
if TESTING_CORE_MISSING is None:
    sys.meta_path.insert(0, _TestingCore())

import shmwheel  # noqa: E402  (after the finder: the package binds the core it imports)
from shmwheel._binding import ffi, lib  # noqa: E402
from shmwheel._process import start_time  # noqa: E402
from shmwheel.contrib._record import PAYLOAD_SIZE  # noqa: E402

PREFIX = f"shmwheel-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="run the tests marked long too, and the torture tests at full length (10,000 kills)",
    )


def _names_a_test_hook(exc: BaseException) -> bool:
    """Whether ``exc`` is the shipped core's answer to a name only the
    tests' core has: a test hook, a constant or a struct of the segment."""
    if isinstance(exc, BaseExceptionGroup):  # Hypothesis's, for several failures
        return all(_names_a_test_hook(e) for e in exc.exceptions)
    if isinstance(exc, AttributeError):
        return str(exc).startswith("cffi library 'shmwheel._shmwheel' has no ")
    return isinstance(exc, ffi.error) and str(exc).startswith("undefined struct/union name")


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """A test, or a fixture of it, that reached for a test hook is reported
    as skipped where the tests' core could not be built, whichever test it
    is (a unittest-style one such as Hypothesis's state machines included:
    here, after pytest's unittest support has put its error on ``call``,
    and before the report is made of it)."""
    if TESTING_CORE_MISSING is None or call.excinfo is None or not _names_a_test_hook(call.excinfo.value):
        return
    try:
        pytest.skip(f"needs shmwheel._shmwheel_testing: {TESTING_CORE_MISSING}")
    except pytest.skip.Exception:
        call.excinfo = pytest.ExceptionInfo.from_current()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long: run with --long")
    for item in items:
        if item.get_closest_marker("long") is not None:
            item.add_marker(skip)


@pytest.fixture
def long_run(request: pytest.FixtureRequest) -> bool:
    """True under --long: torture tests scale themselves up."""
    return bool(request.config.getoption("--long"))


_counter = itertools.count()


def fresh_name() -> str:
    return f"{PREFIX}-{next(_counter)}"


@pytest.fixture
def name() -> Iterator[str]:
    """A wheel name no other test uses; its segment is removed afterwards."""
    n = fresh_name()
    yield n
    try:
        shmwheel.unlink(n)
    except shmwheel.SegmentNotFoundError:
        pass


def foreign_segment(name: str, data: bytes) -> None:
    """A segment some other program made: ``data`` at its start (the ``name`` fixture removes it)."""
    shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, size=4096)
    try:
        os.pwrite(shm.fd, data, 0)
    finally:
        shm.close_fd()


@pytest.fixture
def make_wheel() -> Iterator[Callable[..., shmwheel.Wheel]]:
    """create() with test defaults; each wheel is checked, closed and unlinked after the test."""
    made: list[shmwheel.Wheel] = []

    def make(capacity: int = 1000, **kw: object) -> shmwheel.Wheel:
        w = shmwheel.create(kw.pop("name", None) or fresh_name(), capacity=capacity, **kw)  # type: ignore[arg-type]
        made.append(w)
        return w

    yield make
    errors = []
    for w in made:
        try:
            probe = shmwheel.attach(w.name) if w.closed else w
        except shmwheel.SegmentNotFoundError:
            continue  # the test removed it itself
        try:
            probe.check()
        except shmwheel.CorruptSegmentError as exc:
            errors.append(f"{w.name}: {exc}")
        finally:
            probe.close()
            w.close()
            try:
                shmwheel.unlink(w.name)
            except shmwheel.SegmentNotFoundError:
                pass
    if errors:
        pytest.fail(f"check() failed after the test: {errors}")


class Layout(NamedTuple):
    """Byte offsets of a segment's regions, as the C core computes them."""

    buckets: int
    heap: int
    lists: int
    slab: int


def layout(w: shmwheel.Wheel) -> Layout:
    outs = [ffi.new("uint64_t *") for _ in Layout._fields]
    assert lib.shmw_test_layout(w.core, *outs) == 0
    return Layout(*(int(o[0]) for o in outs))


def mutex_span() -> tuple[int, int]:
    """Where shard 0's mutex lies, from the segment's first byte: it is
    64-byte aligned and the free-list head follows it (40 bytes with glibc
    on x86-64)."""
    hi = ffi.offsetof("struct shmw_header", "free_head")
    return top_size() + hi - hi % 64, top_size() + hi


def top_size() -> int:
    """Where shard 0 begins: the top, rounded up to 64 bytes."""
    return -(-ffi.sizeof("struct shmw_top") // 64) * 64


def top(w: shmwheel.Wheel):  # type: ignore[no-untyped-def]
    """The segment's top: what its shards share (the producer table, the futex words)."""
    return ffi.cast("struct shmw_top *", w._buf)


def header(w: shmwheel.Wheel, shard: int = 0):  # type: ignore[no-untyped-def]
    """Shard ``shard``'s header, as a ``struct shmw_header *`` (of a wheel made
    without ``shards``, the only one)."""
    return ffi.cast("struct shmw_header *", w._buf + top_size() + shard * top(w).shard_size)


def entry(w: shmwheel.Wheel, index: int):  # type: ignore[no-untyped-def]
    """Slab slot ``index`` (of the whole slab) as a ``struct shmw_entry *``, to read or scribble on."""
    shard, index = divmod(index, top(w).shard_capacity)
    return ffi.cast(
        "struct shmw_entry *",
        w._buf + layout(w).slab + shard * top(w).shard_size + index * header(w).stride,
    )


def adds_to(w: shmwheel.Wheel, shard: int) -> None:
    """Make this process's next adds through ``w`` go to ``shard``: it
    attaches again as a producer of another start time, until the id it
    gets is of that shard (ids go round the shards in blocks of 8).  Also
    in a forked child, which adds to its pid's shard until it attaches."""
    shards, start = top(w).shards, 5_000_000
    while lib.shmw_producer_attach(w.core, os.getpid(), start, 0) // 8 % shards != shard:
        start += 1


def handle_of(w: shmwheel.Wheel, index: int, generation: int) -> int:
    """The handle of slab slot ``index`` at ``generation``, as the C core makes it."""
    index_bits = lib.shmw_index_bits(w.capacity)
    key = header(w).handle_key & ((1 << (63 - index_bits)) - 1)
    return (generation ^ key) << index_bits | index


def wait_for(predicate: Callable[[], bool], timeout: float = 15.0) -> None:
    """Wait until predicate() holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def put_in_flight(w: shmwheel.Wheel, at_least: int) -> None:
    """Fire what is due into the in-flight list, as a driver's clock does, and
    step back: this process registers as the driver, runs the clock until
    ``at_least`` timers are in flight, and deregisters (they stay there, to
    be handed out again)."""
    me = os.getpid()
    me_start = start_time(me)
    assert me_start is not None
    assert lib.shmw_driver_register(w.core, me, me_start, 0, 0) == 0
    stop = ffi.new("int *")
    result: list[int] = []
    clock = threading.Thread(target=lambda: result.append(lib.shmw_driver_clock(w.core, stop, 8)))
    clock.start()
    give_up = time.monotonic() + 10
    while w.stats().in_flight < at_least and time.monotonic() < give_up:
        time.sleep(0.0005)
    stop[0] = 1
    lib.shmw_wake(w.core)
    clock.join()
    assert result == [0]
    assert lib.shmw_driver_register(w.core, 0, 0, me, me_start) == 0
    assert w.stats().in_flight >= at_least, "the clock put too few in flight"


@pytest.fixture
def driven(make_wheel, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """A wheel driven by the driver command, with these arguments (its
    name), the driver killed after the test; ``.log``: the driver's log."""
    procs: list[subprocess.Popen[bytes]] = []
    log = tmp_path / "driver.log"

    def start(*args: str) -> str:
        wheel = make_wheel(payload_size=PAYLOAD_SIZE)
        cmd = [sys.executable, "-m", "shmwheel.contrib.timeouts", wheel.name, "--log-to", str(log), *args]
        procs.append(subprocess.Popen(cmd))
        give_up = time.monotonic() + 30
        while wheel.stats().driver_pid != procs[-1].pid:
            assert time.monotonic() < give_up and procs[-1].poll() is None
            time.sleep(0.02)
        return wheel.name

    start.log = log  # type: ignore[attr-defined]
    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(30)


@pytest.fixture
def wheel(make_wheel: Callable[..., shmwheel.Wheel]) -> shmwheel.Wheel:
    return make_wheel()


@pytest.fixture(params=["c", "python"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The way the adapters made during the test serve a request: "c", in
    shmwheel._fast wherever their settings allow (the WSGI and ASGI
    middlewares' calls, Gunicorn's hooks); "python", their own Python for
    every request, as where their settings need it (a route, X-Request-Start,
    an interrupt).  Each adapter asks shmwheel.contrib._door.in_c once, when
    it is made, under the name it imported; for "python" each of those names
    answers no.  The worker's timer below them is the same either way."""
    if request.param == "python":
        from shmwheel.contrib import _door, asgi, gunicorn, wsgi

        for module in (_door, wsgi, asgi, gunicorn):
            monkeypatch.setattr(module, "in_c", lambda *settings, **named: False)
    return str(request.param)


# Besides the fixtures' names: the wheels that the servers under test
# (Gunicorn, uWSGI, the ASGI middleware's own) and the demo name after the
# pid of their main process, which this run started (or is: an ASGI
# middleware or a demo made in this process).  A wheel so named after any
# other pid is another run's (a suite running beside this one): not ours to
# judge.  So the run notes the pid of every process it starts, through
# subprocess or a fork (multiprocessing's fork context among them).
OTHER_NAMES = ("gunicorn-*", "uwsgi-*", "asgi-*", "shmwheel-demo-*")
_started: set[int] = {os.getpid()}
_there_before: set[str] = set()

_popen_init = subprocess.Popen.__init__
_fork = os.fork


def _popen_init_noted(self: subprocess.Popen[bytes], *args: object, **kwargs: object) -> None:
    _popen_init(self, *args, **kwargs)  # type: ignore[arg-type]
    _started.add(self.pid)


def _fork_noted() -> int:
    pid = _fork()
    if pid > 0:
        _started.add(pid)
    return pid


subprocess.Popen.__init__ = _popen_init_noted  # type: ignore[method-assign]
os.fork = _fork_noted


def _ours() -> set[str]:
    shm = Path("/dev/shm")
    ours = {p.name for p in shm.glob(f"{PREFIX}*")}
    for pattern in OTHER_NAMES:
        for p in shm.glob(pattern):
            pid = p.name.rsplit("-", 1)[1]
            if pid.isdigit() and int(pid) in _started:
                ours.add(p.name)
    return ours


def pytest_sessionstart(session: pytest.Session) -> None:
    _there_before.update(_ours())  # made before this run by a process of a pid it has now: not its own


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    left = sorted(_ours() - _there_before)
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nshmwheel: the suite left segments in /dev/shm: {left}")


@contextlib.contextmanager
def script_processes(tmp_path: Path, script: str, stem: str) -> Iterator[Callable[[list[str]], subprocess.Popen[str]]]:
    """Start ``python -c script ARGS...`` processes that print "ready" once
    set up; their stderr goes to a file (``proc.err``).  Each is killed and
    reaped on the way out."""
    procs: list[subprocess.Popen[str]] = []

    def start(args: list[str]) -> subprocess.Popen[str]:
        err = open(tmp_path / f"{stem}{len(procs)}.err", "w+")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=err, text=True)
        proc.err = err  # type: ignore[attr-defined]
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.err.close()  # type: ignore[attr-defined]
