"""Which C function a frame is calling, and whether what it returns is
plain data that a raise may drop.

The wake signal's handler runs inside the C call a main thread waits in
(``time.sleep``, a socket's ``recv``, ``select``), where it may end the
wait by raising - or right after that call returned, at the check CPython
makes at the end of every call, which looks the same from Python.  There
a raise drops the call's value.  That is harmless when the value is data
(bytes, a count, a list of ready descriptors) and harmful when it is an
obligation (a lock acquired, a connection accepted, an item taken off a
queue).  So the handler may raise in a call whose value the code keeps
only if the function called is one of :data:`PLAIN` below.

What is called is read off the frame's bytecode: the statement up to the
call is run on a stack of names instead of values (a local, a global, an
attribute of one of them), never a jump, and only through instructions
whose stack effect is known here.  The name is then looked up statically
(``inspect.getattr_static``: instance and class dictionaries, no property,
no ``__getattr__``), so nothing of the application runs in the handler.
Anything else is "not known", and the handler does not raise.
"""

from __future__ import annotations

import _io
import _socket
import dis
import functools
import inspect
import os
import select
import sys
import time
from types import CodeType, FrameType, MemberDescriptorType, ModuleType
from typing import Any

__all__ = ["JUMPS", "PLAIN", "STATEMENT_ENDS", "plain_call"]


def _plain() -> frozenset[Any]:
    names = {
        _socket.socket: (
            "recv", "recv_into", "recvfrom", "recvfrom_into", "recvmsg", "recvmsg_into",
            "send", "sendall", "sendto", "sendmsg", "connect", "connect_ex",
        ),
        _io.FileIO: ("read", "readinto", "readall", "write"),
        _io.BufferedReader: ("read", "read1", "readinto", "readinto1", "readline", "peek"),
        _io.BufferedWriter: ("write", "flush"),
        _io.BufferedRandom: ("read", "read1", "readinto", "readinto1", "readline", "peek", "write", "flush"),
        _io.TextIOWrapper: ("read", "readline", "write", "flush"),
    }  # fmt: skip
    try:
        import _ssl

        names[_ssl._SSLSocket] = ("read", "write", "do_handshake")  # type: ignore[attr-defined]
    except ImportError:  # a Python built without OpenSSL
        pass
    found: list[Any] = [klass.__dict__[name] for klass, some in names.items() for name in some]
    found += [type(select.poll()).poll, select.select, time.sleep]
    if hasattr(select, "epoll"):
        found.append(select.epoll.poll)
    found += [
        getattr(os, name)
        for name in ("read", "readv", "pread", "preadv", "write", "writev", "pwrite", "pwritev", "sendfile",
                     "wait", "waitpid", "wait3", "wait4", "waitid")
        if hasattr(os, name)
    ]  # fmt: skip
    return frozenset(found)


#: C functions that wait in an interruptible system call and return data
#: (bytes, a count, None, ready descriptors, an exit status), never
#: something the caller must release: a socket's receives and sends, a
#: file's reads and writes, ``select``, ``poll``, ``time.sleep``, the
#: ``os`` reads, writes and waits.  Not ``accept`` (a descriptor), not a
#: lock's ``acquire``, not a queue's ``get``.
PLAIN = _plain()

#: A call's stack: [method or NULL, callable or self, args...] before
#: 3.13; [callable, self or NULL, args...] from 3.13.
_OLD_CALLS = sys.version_info < (3, 13)
_Name = tuple[str, ...] | None  # what the stack holds: a value's name, None if it has none
_NULL: tuple[str, ...] = ("null",)
#: Instructions whose effect on the stack is known: (popped, pushed), or a
#: function of the argument.  Some call code (an operator's method), but
#: only to make an argument: that code has returned by the time the frame
#: is at the call this reads.
_SHAPES: dict[str, Any] = {
    "NOP": (0, 0), "CACHE": (0, 0), "EXTENDED_ARG": (0, 0), "KW_NAMES": (0, 0), "RESUME": (0, 0),
    "LOAD_CONST": (0, 1), "PUSH_NULL": (0, 1),
    "BUILD_TUPLE": lambda n: (n, 1), "BUILD_LIST": lambda n: (n, 1), "BUILD_SET": lambda n: (n, 1),
    "BUILD_STRING": lambda n: (n, 1), "BUILD_SLICE": lambda n: (n, 1), "BUILD_MAP": lambda n: (2 * n, 1),
    "BUILD_CONST_KEY_MAP": lambda n: (n + 1, 1),
    "FORMAT_SIMPLE": (1, 1), "FORMAT_WITH_SPEC": (2, 1), "CONVERT_VALUE": (1, 1),
    "FORMAT_VALUE": lambda flags: (2 if flags & 0x04 else 1, 1),
    "BINARY_OP": (2, 1), "BINARY_SUBSCR": (2, 1), "COMPARE_OP": (2, 1), "IS_OP": (2, 1), "CONTAINS_OP": (2, 1),
    "UNARY_NEGATIVE": (1, 1), "UNARY_NOT": (1, 1), "UNARY_INVERT": (1, 1), "TO_BOOL": (1, 1),
}  # fmt: skip
_CALL_NAMES = ("CALL", "PRECALL", "CALL_KW")
#: Where one statement's instructions end and the next one's begin.
STATEMENT_ENDS = ("POP_TOP", "STORE_", "RETURN_", "JUMP", "POP_JUMP", "NOP", "RESUME", "END_FOR", "RAISE", "RERAISE")
JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs) | frozenset(getattr(dis, "hasjump", ()))


def plain_call(frame: FrameType) -> bool:
    """Whether ``frame`` is at a call of one of :data:`PLAIN`, as far as
    its bytecode and a static look-up can tell."""
    path = _callee(frame.f_code, frame.f_lasti)
    if path is None:
        return False
    try:
        return _look_up(frame, path) in PLAIN
    except TypeError:  # an unhashable object found on the way
        return False


@functools.lru_cache(maxsize=4096)
def _callee(code: CodeType, lasti: int) -> tuple[str, ...] | None:
    """The name of what the call at ``lasti`` calls: ("local" | "global" |
    "name", name, attribute, ...), or None where the bytecode does not say
    it plainly."""
    instructions = list(dis.get_instructions(code))
    at = max((i for i, ins in enumerate(instructions) if ins.offset <= lasti), default=-1)
    if at < 0 or instructions[at].opname not in _CALL_NAMES or instructions[at].arg is None:
        return None
    start = at
    while start > 0 and not instructions[start - 1].opname.startswith(STATEMENT_ENDS):
        start -= 1
    targets = {ins.argval for ins in instructions if ins.opcode in JUMPS}
    stack: list[_Name] = []
    for ins in instructions[start:at]:
        if ins.offset in targets or ins.opcode in JUMPS:
            return None  # a jump in or out: more than one way here
        if not _step(ins, stack):
            return None
    call = instructions[at]
    depth = (call.arg or 0) + (3 if call.opname == "CALL_KW" else 2)  # 3.13 CALL_KW has its names' tuple on top
    if len(stack) < depth:
        return None
    first, second = stack[-depth], stack[-depth + 1]
    # [NULL, callable] and [callable, NULL] name the callable; [method,
    # self], either version's order, names the method.
    callee = second if first == _NULL else first
    return callee if callee is not None and callee != _NULL else None


def _step(ins: dis.Instruction, stack: list[_Name]) -> bool:
    """Run ``ins`` on ``stack`` of names (None: a value not named); False if
    it is not one this knows."""
    name, arg = ins.opname, ins.arg or 0
    value: _Name
    if name in ("LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF"):
        stack.append(("local", ins.argval))
    elif name == "LOAD_FAST_LOAD_FAST":
        stack.extend(("local", each) for each in ins.argval)
    elif name == "LOAD_NAME":
        stack.append(("name", ins.argval))
    elif name == "LOAD_GLOBAL":
        value = ("global", ins.argval)
        null: list[_Name] = [_NULL] if arg & 1 else []
        stack.extend(null + [value] if _OLD_CALLS else [value] + null)
    elif name in ("LOAD_ATTR", "LOAD_METHOD"):
        if not stack:
            return False
        of = stack.pop()
        value = of + (ins.argval,) if of is not None and of != _NULL else None
        method = name == "LOAD_METHOD" or (sys.version_info >= (3, 12) and arg & 1)
        stack.extend([value, None] if method else [value])  # [method, self]: in 3.13 too, callable first
    elif name in _CALL_NAMES:
        popped = arg + (3 if name == "CALL_KW" else 2)
        if name == "PRECALL":  # 3.11: the call itself is the CALL after it
            return True
        return _shape(stack, popped, 1)
    elif name in _SHAPES:
        shape = _SHAPES[name]
        popped, pushed = shape(arg) if callable(shape) else shape
        return _shape(stack, popped, pushed)
    else:
        return False
    return True


def _shape(stack: list[_Name], popped: int, pushed: int) -> bool:
    if len(stack) < popped:
        return False
    del stack[len(stack) - popped :]
    stack.extend([None] * pushed)
    return True


_MISSING = object()


def _look_up(frame: FrameType, path: tuple[str, ...]) -> Any:
    """What ``path`` names in ``frame``, looked up without running any of
    the application's code; _MISSING where it cannot be."""
    kind, name, *attributes = path
    spaces: list[dict[str, Any]] = []
    if kind in ("local", "name"):
        spaces.append(frame.f_locals)  # 3.13: a proxy that reads the frame
    if kind in ("global", "name"):
        spaces += [frame.f_globals, frame.f_builtins]
    value = next((space[name] for space in spaces if name in space), _MISSING)
    for attribute in attributes:
        if value is _MISSING:
            break
        if isinstance(value, ModuleType):
            value = value.__dict__.get(attribute, _MISSING)
        else:
            found = inspect.getattr_static(value, attribute, _MISSING)
            # A slot (__slots__) is read in C, by its descriptor.
            value = found.__get__(value, type(value)) if isinstance(found, MemberDescriptorType) else found
    return value
