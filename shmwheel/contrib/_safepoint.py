"""Where a timed-out request may be interrupted, and having its own thread
raise there.

An exception raised into a thread from outside (CPython's
``PyThreadState_SetAsyncExc``) lands at whatever bytecode the thread is at:
between ``lock.acquire()`` and the ``try`` whose ``finally`` releases it,
halfway through a ``finally``, inside ``logging`` with the handler's lock
held.  It also meets CPython 3.13's misplaced asynchronous exceptions
(cpython #130279, #139622).  So nothing is raised from outside: the
reporter thread *arms* a check in the request's thread, which that thread
runs itself at the start of each line, and which raises only at a safe
point, synchronously, where the frame's exception table covers it exactly.

A point is **safe** when every frame of the thread's stack is at a safe
line of its code, and none is in code that is not the request's:

* not in cleanup code.  A line is unsafe if exception-handler code that
  does anything (calls, matches, ``__exit__``) is attributed to it: the
  bodies of ``except`` and ``finally`` (a ``finally`` body is compiled
  twice, once on the normal path, once on the exceptional one; both copies
  share their lines), the ``except`` lines themselves, and every ``with``
  and ``async with`` line, which runs ``__enter__`` and ``__exit__``.  A
  frame below them, whatever it is (``__exit__``, ``rollback()``), has its
  caller at such a line, so anything cleanup code calls is covered too;
* not on a ``try:`` line: its one instruction lies before the range the
  ``try`` protects, so an exception there leaves a resource acquired on
  the line before unreleased;
* not in the interpreter's machinery that other threads share: ``logging``
  (a handler's lock, a half-written line), ``importlib`` (a module half
  imported), ``threading`` (a condition's waiter list) - but for a thread's
  own entry functions, which sit at the bottom of every thread's stack;
* not in a weak reference's callback, a ``__del__`` or a ``gc.callbacks``
  hook (a profiler's, Hypothesis's), which run wherever an object happens
  to be freed or a collection to start, and whose exceptions Python only
  prints;
* not in shmwheel's own code, where the request's bookkeeping is being
  done (the innermost frame only: the middleware's frame that called the
  application sits lower on every request's stack);
* not in an event loop's own code (asyncio, trio and its outcome, anyio), whose locks,
  queues and schedulers are Python too, nor in what that code calls.  The
  loop's frames may be on the stack only in one piece, at the bottom of the
  request's: they run the task or the thread whose code lies above them.

Handler code that only moves values (an inlined comprehension's clean-up,
a generator's ``StopIteration`` guard) does not make its line unsafe.

The line tables are read off each code object once (:func:`unsafe_lines`),
and cached.  How a thread is made to run the check depends on the
interpreter, and is chosen once, here:

* CPython 3.12 and later: ``sys.monitoring``, with LINE events turned on
  only for the code objects on the thread's stack when it is armed; a
  callback that finds it is not the armed thread returns at once;
* CPython 3.11: a trace function set for that one thread
  (:mod:`shmwheel._linetrace`, in C), which keeps the thread's own.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import gc
import importlib
import importlib.util
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from .._process import after_fork
from ._calls import JUMPS, STATEMENT_ENDS, plain_call
from ._stacks import real

try:
    from .._linetrace import state_id
except ImportError as exc:  # a build without it: said where an interrupt is asked for
    state_id = None  # type: ignore[assignment]
    _no_linetrace = str(exc)

__all__ = ["arm", "armed", "can_arm", "check_from_signal", "unsafe_at", "unsafe_in_call", "unsafe_lines"]

#: check(frame): True to go on looking, False to stop; what it raises is
#: raised in the thread, at that line.
Check = Callable[[FrameType], bool]  # what it raises is raised in the thread; it stays armed

_OP = dis.opmap
#: Instructions after which control does not fall through to the next.
_ENDS = frozenset(
    _OP[name]
    for name in (
        "RETURN_VALUE", "RETURN_CONST", "RERAISE", "RAISE_VARARGS", "JUMP_FORWARD", "JUMP_BACKWARD",
        "JUMP_BACKWARD_NO_INTERRUPT", "JUMP_ABSOLUTE",
    )
    if name in _OP
)  # fmt: skip
#: Handler instructions that run nobody's code: they only move values,
#: jump, or raise again.  A line whose handler code is all of these is not
#: cleanup code.
_PLAIN = frozenset(
    _OP[name]
    for name in (
        "NOP", "CACHE", "EXTENDED_ARG", "RESUME", "PUSH_EXC_INFO", "POP_EXCEPT", "RERAISE", "COPY", "SWAP",
        "POP_TOP", "LOAD_CONST", "RETURN_CONST", "RETURN_VALUE", "LOAD_FAST", "LOAD_FAST_CHECK",
        "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST", "STORE_FAST", "STORE_FAST_LOAD_FAST",
        "STORE_FAST_STORE_FAST", "DELETE_FAST", "CALL_INTRINSIC_1", "END_FOR", "END_SEND", "CLEANUP_THROW",
        "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT",
    )
    if name in _OP
)  # fmt: skip

#: Calls: where a frame is while a C function it called runs.
_CALLS = frozenset(_OP[name] for name in ("CALL", "CALL_KW", "CALL_FUNCTION_EX", "PRECALL") if name in _OP)
_NONE: tuple[frozenset[int], frozenset[int], frozenset[int]] = (frozenset(), frozenset(), frozenset())
_lines: dict[CodeType, tuple[frozenset[int], frozenset[int], frozenset[int]]] = {}
MAX_CODES = 20_000  #: code objects whose lines are kept read, at most


def unsafe_lines(code: CodeType) -> frozenset[int]:
    """The lines of ``code`` at which the request may not be interrupted:
    those of its cleanup code and its ``try:`` lines.  Read once a code
    object, from its bytecode and exception table."""
    return _read(code)[0]


def _read(code: CodeType) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
    """unsafe_lines(code); the lines that come right before a ``try`` or
    ``with`` protects what follows; the offsets of its calls."""
    lines = _lines.get(code)
    if lines is None:
        if len(_lines) >= MAX_CODES:  # code made per request (a template's, exec's): not kept for ever
            _lines.clear()
        lines = _lines[code] = _read_lines(code)
    return lines


def _read_lines(code: CodeType) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
    bytecode = dis.Bytecode(code)
    instructions = list(bytecode)
    if not instructions:
        return _NONE
    index = {ins.offset: i for i, ins in enumerate(instructions)}

    def reach(starts: list[int]) -> set[int]:
        seen: set[int] = set()
        todo = list(starts)
        while todo:
            i = index.get(todo.pop())
            if i is None:
                continue
            ins = instructions[i]
            if ins.offset in seen:
                continue
            seen.add(ins.offset)
            if ins.opcode in JUMPS and isinstance(ins.argval, int):
                todo.append(ins.argval)
            if ins.opcode not in _ENDS and i + 1 < len(instructions):
                todo.append(instructions[i + 1].offset)
        return seen

    entries: list[Any] = getattr(bytecode, "exception_entries")  # noqa: B009 - 3.11 and later; not in typeshed
    normal = reach([instructions[0].offset])
    handlers = reach([entry.target for entry in entries]) - normal
    unsafe = set()
    for ins in instructions:
        line = ins.positions.lineno if ins.positions is not None else None
        if line is not None and ins.offset in handlers and ins.opcode not in _PLAIN:
            unsafe.add(line)
    # A try: line is the NOP just before the range it protects.  Not every
    # NOP before a range is one: where a try's or a with's body ends inside
    # an outer try, the table starts the outer range again after the body,
    # right after a NOP of the body's last line (try: / with: / try: work():
    # the line of work() is no try: line, and the call on it, which the
    # inner try covers, is as safe as any).  A try: statement begins its
    # line, so a NOP on a line that has code before it is no try: line.
    first = {}
    for ins in reversed(instructions):
        line = _line_of(ins)
        if line is not None and ins.opcode != _OP["NOP"]:
            first[line] = ins.offset
    for entry in entries:
        i = index.get(entry.start)
        if i:
            before = instructions[i - 1]
            line = _line_of(before)
            if before.opcode != _OP["NOP"] or line is None:
                continue
            if first.get(line, before.offset) < before.offset:
                continue  # its line began before it: the end of a body, not a try:
            unsafe.add(line)
    # The statement before a protected range's own unsafe line (the try:,
    # the with), every line of it: where a resource is acquired that the
    # range releases.
    acquiring = set()
    for entry in entries:
        if entry.start in handlers:
            continue  # a handler's own range
        # Back along the normal path: past the try: or with line, then over
        # the statement before it, to the end of the one before that.
        i = index.get(entry.start, 0) - 1
        while i >= 0 and instructions[i].offset in handlers:
            i -= 1
        protector = _line_of(instructions[i]) if i >= 0 else None
        while i >= 0 and (instructions[i].offset in handlers or _line_of(instructions[i]) == protector):
            i -= 1
        while i >= 0 and instructions[i].offset not in handlers:
            line = _line_of(instructions[i])
            if line is not None and line not in unsafe:
                acquiring.add(line)
            if i == 0 or instructions[i - 1].opname.startswith(STATEMENT_ENDS):
                break
            i -= 1
    # The calls that throw their value away, which a raise right after
    # their return drops harmlessly (see unsafe_in_call): the offsets a
    # frame in one has as f_lasti, the call's own or (3.11, 3.12) its
    # inline caches'.
    ends = [ins.offset for ins in instructions[1:]] + [len(code.co_code)]
    calls = frozenset(
        at
        for i, (ins, end) in enumerate(zip(instructions, ends, strict=True))
        if ins.opcode in _CALLS and _dropped_at(instructions, i + 1)
        for at in range(ins.offset, end, 2)
    )
    return frozenset(unsafe), frozenset(acquiring), calls


def _dropped_at(instructions: list[dis.Instruction], after: int) -> bool:
    """Whether the value of the call whose next instruction is ``after`` is
    thrown away: a call made for its effect, ``time.sleep(1)``."""
    return after < len(instructions) and instructions[after].opname == "POP_TOP"


def _line_of(ins: dis.Instruction) -> int | None:
    return ins.positions.lineno if ins.positions is not None else None


def _directory(module: Any) -> str:
    return os.path.dirname(str(module.__file__)) + os.sep


#: Code that is not the request's, anywhere on the stack: by directory,
#: and by file with the functions of it that may be there.
_NOT_THE_REQUESTS = (
    _directory(logging),
    _directory(importlib),
    # Weak references' callbacks, which run wherever an object is freed,
    # and whose exceptions Python only prints.
    os.path.join(os.path.dirname(os.__file__), "weakref.py"),
    os.path.join(os.path.dirname(os.__file__), "_weakrefset.py"),
)
#: Event loops' own code (their locks, queues and schedulers are Python
#: too): never the innermost frame, where a raise would leave their state
#: half-changed; lower on the stack, below a task's code, they are the
#: loop that runs it.
_LOOPS = tuple(
    os.path.dirname(str(spec.origin)) + os.sep
    for spec in (importlib.util.find_spec(name) for name in ("asyncio", "trio", "outcome", "anyio"))
    if spec is not None and spec.origin is not None
)
_FROZEN = "<frozen importlib"
_THREADING = threading.__file__
_THREAD_ENTRIES = frozenset({"_bootstrap", "_bootstrap_inner", "run"})
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the shmwheel package


def unsafe_at(frame: FrameType | None) -> str | None:
    """Why the thread whose innermost frame is ``frame`` may not be
    interrupted there, or None if it may."""
    innermost = True
    in_loop = below_loop = False
    collecting = {getattr(hook, "__code__", None) for hook in gc.callbacks}
    while frame is not None:
        code = frame.f_code
        name = code.co_filename
        if name.startswith(_NOT_THE_REQUESTS) or name.startswith(_FROZEN):
            return f"in {_where(frame)}, which is not the request's code"
        if name == _THREADING and code.co_name not in _THREAD_ENTRIES:
            return f"in {_where(frame)}, which is not the request's code"
        if code.co_name == "__del__" or code in collecting:
            return f"in {_where(frame)}, a finalizer or a collection's hook"
        if code in _handler_codes:
            return f"in {_where(frame)}, a signal handler, which runs between two bytecodes of the code below it"
        if innermost and name.startswith(_OURS):
            return f"in shmwheel's own {_where(frame)}"
        if _in_loop(frame) and (innermost or not _delegating(frame)):
            if innermost or below_loop:
                return f"in {_where(frame)}, the event loop's own code"
            in_loop = True
        elif in_loop:
            below_loop = True  # what the loop runs lies above: any loop code further down runs its caller
        line = frame.f_lineno
        unsafe, acquiring, _ = _read(code)
        if line is None or line in unsafe:
            return f"at {_where(frame)}, in cleanup code or before the try it protects"
        if innermost and line in acquiring:
            # A line starts again inside a statement that spans several
            # (its store is on its first line): after the acquire returned.
            # (A frame below is in a call that has not returned: nothing
            # is acquired yet.)
            return f"at {_where(frame)}, in the statement that acquires what the try or with after it releases"
        innermost = False
        frame = frame.f_back
    return None


_SUSPENDABLE = inspect.CO_COROUTINE | inspect.CO_ITERABLE_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_GENERATOR


def _delegating(frame: FrameType) -> bool:
    """Whether ``frame``, a coroutine's or a generator's, is awaiting the
    frame above it (``await``, ``yield from``: at a SEND), as a loop's
    coroutine that wraps the request's (``asyncio.wait_for`` on 3.12) does:
    an exception raised above comes to it as the awaited one's, which it is
    written to take."""
    return bool(frame.f_code.co_flags & _SUSPENDABLE) and frame.f_lasti in _sends(frame.f_code)


@functools.lru_cache(maxsize=1024)
def _sends(code: CodeType) -> frozenset[int]:
    # 3.12 leaves a delegating frame's f_lasti at the SEND's inline cache.
    sends = [ins.offset for ins in dis.get_instructions(code) if ins.opname in ("SEND", "YIELD_FROM")]
    return frozenset(sends + [offset + 2 for offset in sends])


def _in_loop(frame: FrameType) -> bool:
    """Whether ``frame`` runs an event loop's own code: its file is the
    loop's, or it is code generated at run time (an attrs ``__init__``, a
    dataclass's) that the loop's code called."""
    name = frame.f_code.co_filename
    if name.startswith("<") and frame.f_back is not None:
        name = frame.f_back.f_code.co_filename
    return name.startswith(_LOOPS)


#: The code of the Python signal handlers (the application's, the
#: server's): read when a thread is armed, and by the wake signal's handler.
_handler_codes: frozenset[CodeType] = frozenset()


def _read_handlers() -> None:
    global _handler_codes
    codes = set()
    for signum in signal.valid_signals():
        with contextlib.suppress(ValueError, OSError):
            code = getattr(signal.getsignal(signum), "__code__", None)
            if code is not None:
                codes.add(code)
    _handler_codes = frozenset(codes)


def unsafe_in_call(frame: FrameType) -> str | None:
    """Why a signal handler that Python runs at ``frame`` (the frame it
    interrupted) may not raise there, where :func:`unsafe_at` would let a
    line start raise.  The handler runs inside the C function the frame
    called, whose wait the signal ended - or right after that function
    returned, at the check CPython makes at the end of a call, which looks
    the same from here.  So: None only if the frame is at a call whose
    value a raise after its return may drop - one that throws it away
    (``time.sleep(1)``), or one of a function that returns plain data
    (``data = sock.recv(n)``, ``select.select``: :mod:`._calls`) - and not
    in the statement before a ``try`` or ``with`` (``lock.acquire()``)."""
    _, acquiring, calls = _read(frame.f_code)
    if frame.f_lasti not in calls and not plain_call(frame):
        return f"at {_where(frame)}, not in a call whose value may be dropped"
    if frame.f_lineno in acquiring:
        return f"at {_where(frame)}, which acquires what the try or with after it releases"
    return None


def check_from_signal(frame: FrameType) -> None:
    """From a signal handler that Python runs in this thread, with the frame
    it interrupted: the checks armed in this thread, run at that frame, if
    a handler may raise there (:func:`unsafe_in_call`); what they raise is
    raised from the handler, which ends the C call."""
    global _in_signal
    if _in_signal or frame.f_code.co_filename.startswith(_OURS):
        return  # shmwheel's own bookkeeping, halfway through
    thread = real("_thread", "get_ident")()
    # While this runs, the line checks of what it calls (dis, on 3.11 under
    # the thread's tracer) must not raise: their frames sit on top of the
    # interrupted frame, which would look like any safe line.
    _in_signal = thread
    try:
        _read_handlers()
        if thread in _checks and unsafe_in_call(frame) is None:
            _dispatch(thread, frame, signalled=True)
    finally:
        _in_signal = 0


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


class _Monitoring:
    """Arming by ``sys.monitoring`` (CPython 3.12 and later): LINE events on
    the code objects of an armed thread's stack, for as long as any thread
    is armed; the callback runs the check only in an armed thread."""

    _TOOL_IDS = (4, 3)  # the two that CPython's own conventions leave to others

    def __init__(self) -> None:
        self._tool: int | None = None
        self._armed: dict[int, Check] = {}
        self._codes: set[CodeType] = set()
        # Reentrant: _line may prune (and disarm) from a callback that runs
        # in a thread already inside _disarm (a finalizer, a signal handler).
        self._lock = threading.RLock()
        # The OS thread's id, as sys._current_frames() has it: under gevent's
        # monkey-patching threading.get_ident() is the greenlet's instead.
        self._get_ident: Callable[[], int] = threading.get_ident
        self._misses = 0  # callbacks in threads not armed, since the last look for armed ones that are gone
        after_fork(self._forget)

    def available(self) -> bool:
        """Whether a tool id is ours or free (taken at the first arm, not before)."""
        monitoring: Any = getattr(sys, "monitoring")  # noqa: B009 - 3.12 and later; typeshed may lack it
        return self._tool is not None or any(monitoring.get_tool(tool) is None for tool in self._TOOL_IDS)

    def _take(self) -> bool:
        if self._tool is not None:
            return True
        monitoring: Any = getattr(sys, "monitoring")  # noqa: B009
        for tool in self._TOOL_IDS:
            try:
                monitoring.use_tool_id(tool, "shmwheel")
            except ValueError:  # another tool's
                continue
            monitoring.register_callback(tool, monitoring.events.LINE, self._line)
            self._tool = tool
            return True
        return False

    def arm(self, thread: int, check: Check) -> bool:
        frame = sys._current_frames().get(thread)
        if frame is None or not self._take():
            return False
        self._get_ident = real("_thread", "get_ident")
        monitoring: Any = getattr(sys, "monitoring")  # noqa: B009
        line = monitoring.events.LINE
        with self._lock:
            self._armed[thread] = check
            while frame is not None:
                code = frame.f_code
                if code not in self._codes:
                    monitoring.set_local_events(self._tool, code, monitoring.get_local_events(self._tool, code) | line)
                    self._codes.add(code)
                frame = frame.f_back
        return True

    #: Callbacks in threads not armed between two looks for armed threads
    #: that have ended (a pool's thread that exits while armed): their code
    #: objects would otherwise keep their LINE events for good.
    PRUNE_EVERY = 10_000

    def _line(self, code: CodeType, line: int) -> None:
        thread = self._get_ident()
        check = self._armed.get(thread)
        if check is None:
            self._misses += 1
            if self._misses >= self.PRUNE_EVERY:
                self._misses = 0
                self._prune()
            return
        if not check(sys._getframe(1)):  # what it raises is raised there, and it stays armed
            self._disarm(thread)

    def _prune(self) -> None:
        """Disarm the armed threads that have ended."""
        alive = sys._current_frames()
        for thread in [thread for thread in self._armed if thread not in alive]:
            _drop_all(thread)
            self._disarm(thread)

    def _disarm(self, thread: int) -> None:
        monitoring: Any = getattr(sys, "monitoring")  # noqa: B009
        with self._lock:
            self._armed.pop(thread, None)
            if self._armed:
                return
            for code in self._codes:
                monitoring.set_local_events(self._tool, code, 0)
            self._codes.clear()

    def _forget(self) -> None:
        """In a forked child: no thread of the parent's is armed here."""
        self._lock = threading.RLock()
        self._armed.clear()
        if self._tool is not None:
            monitoring: Any = getattr(sys, "monitoring")  # noqa: B009
            for code in self._codes:
                monitoring.set_local_events(self._tool, code, 0)
        self._codes.clear()


def _choose() -> tuple[Callable[[int, Check], bool] | None, str]:
    """How a thread is armed here, or None and why it cannot be."""
    if state_id is None:
        return None, f"shmwheel._linetrace cannot be imported ({_no_linetrace})"
    if sys.version_info >= (3, 12):
        monitoring = _Monitoring()
        if not monitoring.available():
            return None, "sys.monitoring has no free tool id (3 and 4 are taken)"
        return monitoring.arm, ""
    from .._linetrace import trace_thread

    return trace_thread, ""


_arm, _why_not = _choose()
# The checks armed in each thread: more than one where requests that time
# out together may each run in it (a thread pool's), each until it is done.
# A thread id is used again by a later thread once its own has ended, so
# each check keeps the unique id of the thread state it was armed for, and
# runs only in that one.
_checks: dict[int, list[tuple[int, Check]]] = {}
_in_signal = 0  # the thread in check_from_signal (a main thread), if one is
# Reentrant: a signal handler (check_from_signal) runs between two bytecodes
# of the thread, which may hold it, and on 3.11 the thread's own line tracer
# runs _dispatch again for the lines of the handler's _dispatch.
_checks_lock = threading.RLock()


def can_arm() -> str:
    """Empty if threads can be armed here; else why not, for the log."""
    return _why_not


def arm(thread: int, check: Check) -> bool:
    """Have ``thread`` run ``check(frame)`` at the start of each line it
    runs, until it returns False; what it raises is raised in the thread,
    there, and it stays armed.  False if there is no such thread or no way
    to arm one."""
    if _arm is None:
        return False
    _read_handlers()
    state = state_id(thread)
    if state is None:
        return False
    with _checks_lock:
        alive = sys._current_frames()
        for gone in [gone for gone in _checks if gone not in alive]:  # threads that ended armed
            del _checks[gone]
        _checks.setdefault(thread, []).append((state, check))
    if _arm(thread, functools.partial(_dispatch, thread)):
        return True
    _drop(thread, check)
    return False


def armed(thread: int) -> bool:
    """Whether ``thread`` has a check armed."""
    return thread in _checks


def _dispatch(thread: int, frame: FrameType, *, signalled: bool = False) -> bool:
    """Every check armed in this thread, in it; whether any is left.  A
    check armed for an earlier thread of the same id is dropped unrun, and
    none runs at the lines of what check_from_signal calls."""
    if _in_signal == thread and not signalled:
        return True
    state = state_id()
    with _checks_lock:
        armed = list(_checks.get(thread, ()))
    for armed_in, check in armed:
        if armed_in != state or not check(frame):  # what it raises is raised here, and it stays armed
            _drop(thread, check)
    with _checks_lock:
        return thread in _checks


def _drop(thread: int, check: Check) -> None:
    with _checks_lock:
        armed = _checks.get(thread)
        if armed is None:
            return
        armed[:] = [pair for pair in armed if pair[1] is not check]
        if not armed:
            del _checks[thread]


def _drop_all(thread: int) -> None:
    with _checks_lock:
        _checks.pop(thread, None)


def _forget_checks() -> None:
    """In a forked child: no thread of the parent's is armed here."""
    global _checks_lock
    _checks_lock = threading.RLock()
    _checks.clear()


after_fork(_forget_checks)
