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
import os
import select
import sys
import time
from collections.abc import Callable, Mapping
from types import CodeType, FrameType, GetSetDescriptorType, MemberDescriptorType, ModuleType
from typing import Any

__all__ = ["JUMPS", "PLAIN", "STATEMENT_ENDS", "plain_call"]


def _plain() -> frozenset[Any]:
    names = {
        _socket.socket: (
            "recv", "recv_into", "recvfrom", "recvfrom_into", "send", "sendall", "sendto", "sendmsg",
            "connect", "connect_ex",
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
        for name in ("read", "readv", "pread", "preadv", "write", "writev", "pwrite", "pwritev", "sendfile")
        if hasattr(os, name)
    ]
    return frozenset(found)


#: C functions that wait in an interruptible system call and return data
#: (bytes, a count, None, ready descriptors), never something the caller
#: must release or can have only once: a socket's receives and sends, a
#: file's reads and writes, ``select``, ``poll``, ``time.sleep``, the
#: ``os`` reads and writes.  Not ``accept`` (a descriptor), not ``recvmsg``
#: (it may carry descriptors), not ``os.waitpid`` (a child's status, which
#: is reaped once), not a lock's ``acquire``, not a queue's ``get``.
PLAIN = _plain()
_PLAIN_IDS = frozenset(id(each) for each in PLAIN)  # compared by identity: no __eq__ or __hash__ of anyone's runs

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
    "LOAD_CONST": (0, 1),
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
    its bytecode and a static look-up can tell.  Never raises: it runs in a
    signal handler, where anything raised lands in the application."""
    try:
        path = _callee(frame.f_code, frame.f_lasti)
        return path is not None and id(_look_up(frame, path)) in _PLAIN_IDS
    except Exception:  # an object on the way that no static look-up can read
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
        if ins.opname in _CALL_NAMES and ins.opname != "PRECALL":
            # A call made for an argument may have bound the name to
            # something else since it was loaded: what is looked up later
            # is not sure to be what is called.
            return None
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
    elif name == "PUSH_NULL":
        stack.append(_NULL)
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
    elif name == "PRECALL":  # 3.11: the call itself is the CALL after it
        pass
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
    the application's code: only real dictionaries (a frame's, a module's,
    a class's, an instance's) and slots are read, through the C
    descriptors of ``type`` and ``object``; _MISSING where that cannot say."""
    kind, name, *attributes = path
    spaces: list[Any] = []
    if kind in ("local", "name"):
        spaces.append(frame.f_locals)  # 3.13: a proxy that reads the frame
    if kind in ("global", "name"):
        spaces += [frame.f_globals, frame.f_builtins]
    value: Any = _MISSING
    for space in spaces:
        if type(space) is not dict and type(space) is not _LOCALS_PROXY:  # a class body's __prepare__ mapping
            return _MISSING
        if name in space:
            value = space[name]
            break
    for attribute in attributes:
        if value is _MISSING:
            break
        value = _attribute(value, attribute)
    return value


def _attribute(value: Any, name: str) -> Any:
    """``value.name`` as Python would find it for a call, for an object
    whose type's attributes, and its own, are plain; _MISSING otherwise."""
    klass = type(value)
    if issubclass(klass, ModuleType):
        own = _dict_of(value, ModuleType)
        return _MISSING if own is None else own.get(name, _MISSING)
    found = _MISSING
    for each in _MRO(klass):
        mapping = _CLASS_DICT(each)
        if name in mapping:
            found = mapping[name]
            break
    if found is not _MISSING and _data_descriptor(type(found)):  # a data descriptor comes first
        if type(found) is MemberDescriptorType:  # a slot, read in C
            try:
                return found.__get__(value, klass)
            except AttributeError:  # not set
                return _MISSING
        return _MISSING  # a property, or another's descriptor: its code would run
    own = _dict_of(value, klass)
    if own is not None and name in own:
        return own[name]
    return found  # a function or method of the class: what a call would bind


def _data_descriptor(klass: type) -> bool:
    return any("__set__" in _CLASS_DICT(each) or "__delete__" in _CLASS_DICT(each) for each in _MRO(klass))


def _dict_of(value: Any, klass: type) -> Any:
    """The instance dictionary of ``value`` through the C descriptor its
    type has for it (a module's is a member, a class's instances' a
    getset), or None: no dictionary, or one that is not plain."""
    for each in _MRO(klass):
        descriptor = _CLASS_DICT(each).get("__dict__")
        if descriptor is not None:
            if type(descriptor) not in (GetSetDescriptorType, MemberDescriptorType):
                return None
            own = descriptor.__get__(value, klass)
            return own if type(own) is dict else None
    return None


# The C descriptors of type itself, so that no metaclass's code runs.
_MRO: Callable[[type], tuple[type, ...]] = type.__dict__["__mro__"].__get__
_CLASS_DICT: Callable[[type], Mapping[str, Any]] = type.__dict__["__dict__"].__get__


def _frame_locals_type() -> type:
    return type(sys._getframe().f_locals)


_LOCALS_PROXY: Any = _frame_locals_type()  # dict up to 3.12; FrameLocalsProxy from 3.13
