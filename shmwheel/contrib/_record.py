"""What a worker and the driver agree on: the request record a worker puts
in each request's timer, and the signals that ask a worker for a stack.

The request record is a 52-byte head then the method, the request id and
the path (little-endian)::

    offset  size  field
         0     1  kind (KIND_*): a request, or a follow-up of the driver's
         1     1  method length in bytes
         2     1  request id length in bytes
         3     1  flags: TRUNCATED, the path was cut to fit; TASK, ``task``
                  is an asyncio task; GREENLET, ``task`` is a greenlet;
                  WARN, the timer is the request's warn_after stage, and
                  its timeout comes later; INTERRUPT, the worker ends the
                  request itself when asked at its timeout
         4     4  worker pid
         8     8  worker start time, clock ticks since boot (/proc/PID/stat)
        16     8  request start, time.monotonic_ns()
        24     8  the OS thread that runs the request, _thread.get_ident()
                  (the original, not gevent's or eventlet's patched one)
        32     8  its asyncio task or greenlet, id(), or 0
                  (the request id is empty when its client sent none: the
                  worker's pid and the request's start stand in)
        40     1  stack signal: the worker writes the request's own stack
                  on it (0: it cannot be asked).  A real-time one of
                  DUMP_SIGNALS where one is free, on which the driver's
                  asks queue, each with its value; else the traceback
                  signal (SIGURG by default), on which one that comes while
                  another is pending is merged with it
        41     1  dump signal: faulthandler writes every thread's stack on
                  it, when no Python can run in the worker (0: none)
        42     2  MAGIC, so that a payload of another kind is never read
                  as a request
        44     4  the request's timeout, milliseconds after its start (0:
                  this timer is the timeout); a WARN timer's driver adds
                  the timeout stage for then
        48     4  how long the request had queued before its worker took
                  it, by the proxy's X-Request-Start, in milliseconds
                  (rounded up); its start above is that much earlier than
                  the worker's own.  The driver times the kill from the
                  worker's own start, so that no header makes it sooner
        52     -  method, request id, path (UTF-8, the path cut to fit)

The worker names the signals itself, so a driver run elsewhere, with
settings of its own, still asks it in the way it listens.
"""

from __future__ import annotations

import re
import signal
import struct
import time
from typing import Any, NamedTuple

__all__ = [
    "DEFAULT_TRACEBACK_SIGNAL",
    "DUMP_SIGNAL",
    "DUMP_SIGNALS",
    "KIND_ANSWER",
    "KIND_CHECK",
    "KIND_FINISHED",
    "KIND_GRACE",
    "KIND_GRACEFUL",
    "KIND_LATE",
    "KIND_KILL",
    "KIND_RELEASED",
    "KIND_REQUEST",
    "KIND_TIMEOUT",
    "PAYLOAD_SIZE",
    "REQUEST_ID",
    "STACK_SIGNALS",
    "shown",
    "RequestRecord",
    "check_traceback_signal",
    "decode_request",
    "encode_request",
    "signal_name",
]

#: Bytes of request record per timer: room for a path of about 180 bytes.
PAYLOAD_SIZE = 256

KIND_REQUEST = 1  #: a request's own timer, added by its worker
KIND_KILL = 2  #: the driver's follow-up: SIGKILL, kill_after after kill_signal
KIND_GRACEFUL = 3  #: the driver's follow-up: kill_signal, once the stack is written
KIND_CHECK = 4  #: the driver's follow-up: did the worker write the stack it was asked for?
KIND_ANSWER = 5  #: the worker's: it has written the stack of the request this names
KIND_FINISHED = 6  #: the worker's: the request this names has finished, after its timer fired
KIND_TIMEOUT = 7  #: the driver's follow-up: the timeout stage of a request warned first
KIND_GRACE = 8  #: the driver's follow-up: has the request it interrupted ended?
KIND_RELEASED = 9  #: the worker's: the request this names was given a new timer, or none, after this one fired
#: The worker's, to a driver it has not told before: the request this names
#: still runs past its timeout, which a driver that died had asked about.
KIND_LATE = 10
KINDS = frozenset(range(KIND_REQUEST, KIND_LATE + 1))

TRUNCATED = 1  # flags: the path was cut to fit
TASK = 2  # flags: the task field is an asyncio task's id
GREENLET = 4  # flags: the task field is a greenlet's id
WARN = 8  # flags: this timer is the request's warn_after stage; its timeout is timeout_ms after its start
INTERRUPT = 16  # flags: at its timeout, the worker ends the request itself when asked
MAX_TIMEOUT_MS = 2**32 - 1  # what the timeout field holds: a longer timeout is written as this, about 49 days
MAGIC = 0x7273  # "sr": a request record
HEAD = struct.Struct("<BBBBIQqQQBBHII")  # the last two: the timeout and the time queued, in ms
_TIMEOUT_AT = 44  # the timeout field's offset
MAX_METHOD = 32
MAX_REQUEST_ID = 64
#: What a request id taken from a client header may hold: it is written into
#: log lines, so nothing that could forge one.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,64}")
_METHOD = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP token, or WEBSOCKET

#: The signal on which a worker writes the timed-out request's own stack
#: (from Python, in a thread of its own).  SIGURG is ignored by default, so
#: one that reaches a process without the handler does no harm, and neither
#: Gunicorn nor uWSGI nor Uvicorn gives it a meaning in a worker.
DEFAULT_TRACEBACK_SIGNAL = signal.SIGURG
#: The signal on which :mod:`faulthandler` writes every thread's stack of a
#: worker in which no Python can run (a C call that holds the GIL): the
#: fallback, sent only when the worker has not answered the first.
DUMP_SIGNAL = signal.SIGRTMIN
#: The signals a worker may have faulthandler dump on: the first of these
#: the application has no handler for (DUMP_SIGNAL, unless it took that).
DUMP_SIGNALS = tuple(range(signal.SIGRTMIN, min(signal.SIGRTMIN + 8, signal.SIGRTMAX + 1)))
#: The signals a worker may be asked for a stack with: none that stops,
#: ends or reloads a process or a server, so that a record that names one
#: (a forged one, say) can make the driver send nothing harmful.
STACK_SIGNALS = frozenset({signal.SIGURG, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH})


def check_traceback_signal(value: object, what: str = "traceback_signal") -> int:
    """A signal a worker may write a request's stack on: one a handler can catch, not the dump signal."""
    from .._checks import check_signal

    signum = check_signal(value, what)
    if signum not in STACK_SIGNALS:
        names = ", ".join(sorted(signal_name(s) for s in STACK_SIGNALS))
        raise ValueError(f"{what} cannot be {signal_name(signum)}: it is one of {names}")
    return signum


#: How long a name that is not the record's (a task's) may be in a log line.
SHOWN_MAX = 200
_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def shown(text: str, limit: int | None = None) -> str:
    """``text``, which a client (or the application) chose, as a log line
    may show it: data, never log structure.  Control characters (newlines,
    ESC, C1 codes), format characters (bidirectional overrides), line and
    paragraph separators and other unprintable characters are written
    visibly (``\\n``, ``\\x1b``, ``\\u202e``), and a backslash as ``\\\\``,
    so that no client starts a line of the server's log or moves its
    terminal's cursor, and what is shown reads back one way.  Longer than
    ``limit`` characters, it is cut, with ``...`` after it."""
    if limit is not None and len(text) > limit:
        text = text[:limit] + "..."
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(c if c.isprintable() and c != "\\" else _escaped(c) for c in text)


def _escaped(c: str) -> str:
    code = ord(c)
    if c in _ESCAPES:
        return _ESCAPES[c]
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def signal_name(signum: int) -> str:
    """``SIGTERM``, ``SIGRTMIN+2``: a signal's name for log lines."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}" if signal.SIGRTMIN < signum <= signal.SIGRTMAX else str(signum)


class RequestRecord(NamedTuple):
    """A request record, decoded: what a request's timer says about it."""

    kind: int
    pid: int  #: the worker
    start: int  #: the worker's start time (with the pid, its identity)
    started_ns: int  #: when the request started, time.monotonic_ns() (the host's clock)
    method: str
    request_id: str
    path: str
    truncated: bool  #: the path was cut to fit the payload
    thread: int = 0  #: the OS thread that runs it, as faulthandler names it (a pthread_t)
    task: int = 0  #: id() of its asyncio task or greenlet, or 0
    task_kind: str = ""  #: "task", "greenlet" or ""
    stack_signal: int = 0  #: the worker writes the request's stack on it (0: none)
    dump_signal: int = 0  #: faulthandler's signal in the worker (0: none)
    timeout_ms: int = 0  #: the request's timeout, ms after its start (0: this timer is the timeout)
    warn: bool = False  #: this timer is the request's warn_after stage
    interrupt: bool = False  #: at its timeout the worker ends the request itself, when asked
    queued_ms: int = 0  #: how much of its time it spent queued, by the proxy's X-Request-Start (0: none counted)

    def timeout_at(self) -> int | None:
        """time.monotonic_ns() when the request times out, if the record says."""
        return self.started_ns + self.timeout_ms * 1_000_000 if self.timeout_ms else None

    def own_timeout_at(self) -> int | None:
        """time.monotonic_ns() when the request times out counted from when
        its worker took it, its time queued left out; None for a record
        that counts no time queued."""
        if not (self.queued_ms and self.timeout_ms):
            return None
        return self.started_ns + (self.queued_ms + self.timeout_ms) * 1_000_000

    def running_for(self, now_ns: int | None = None) -> float:
        """Seconds since the request started."""
        return ((time.monotonic_ns() if now_ns is None else now_ns) - self.started_ns) / 1e9

    def describe(self) -> str:
        """``GET /path (request ID, worker pid N, thread 0x...)``, for log lines:
        what the client chose (the method, the path, the request id) as
        :func:`shown` writes it.  (:meth:`as_dict` keeps it as it is.)

        The thread is written as :mod:`faulthandler` writes it, so that the
        request's thread can be found in a dump of every thread."""
        path = shown(self.path) + ("..." if self.truncated else "")
        where = f"worker pid {self.pid}"
        if self.thread:
            where += f", thread 0x{self.thread:016x}"
        if self.task:
            where += f", {self.task_kind} 0x{self.task:x}"
        return f"{shown(self.method)} {path} (request {shown(self.request_id)}, {where})"

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready fields (``--jsonl``, a fire handler's log)."""
        return {
            "method": self.method,
            "path": self.path,
            "truncated": self.truncated,
            "request_id": self.request_id,
            "worker_pid": self.pid,
            "thread": self.thread,
            "task": self.task,
            "task_kind": self.task_kind,
            "started_ns": self.started_ns,
            "timeout_ms": self.timeout_ms,
            "warn": self.warn,
            "interrupt": self.interrupt,
            "queued_ms": self.queued_ms,
        }


def encode_request(
    kind: int,
    pid: int,
    start: int,
    started_ns: int,
    method: str,
    request_id: str,
    path: str,
    size: int = PAYLOAD_SIZE,
    *,
    thread: int = 0,
    task: int = 0,
    task_kind: str = "",
    stack_signal: int = 0,
    dump_signal: int = 0,
    timeout_ms: int = 0,
    warn: bool = False,
    interrupt: bool = False,
    queued_ms: int = 0,
) -> bytes:
    """A request record of at most ``size`` bytes: the path is cut to fit,
    and the request id left out where even an empty path would not."""
    m = method.encode("ascii", "replace")[:MAX_METHOD]
    r = request_id.encode("ascii", "replace")[:MAX_REQUEST_ID]
    p = path.encode("utf-8", "surrogateescape")
    room = size - HEAD.size - len(m) - len(r)
    if room < 0 and room + len(r) >= 0:
        room, r = room + len(r), b""  # a small payload: the record's own id stands in for the client's
    if room < 0:
        raise ValueError(f"a payload of {size} bytes has no room for a request record")
    flags = TASK if task_kind == "task" else GREENLET if task_kind == "greenlet" else 0
    if warn:
        flags |= WARN
    if interrupt:
        flags |= INTERRUPT
    if len(p) > room:
        p = p[:room]
        flags |= TRUNCATED
    head = HEAD.pack(
        kind, len(m), len(r), flags, pid, start, started_ns, thread, task, stack_signal, dump_signal, MAGIC,
        min(timeout_ms, MAX_TIMEOUT_MS), min(queued_ms, MAX_TIMEOUT_MS),
    )  # fmt: skip
    return head + m + r + p


def decode_request(payload: bytes) -> RequestRecord | None:
    """The request record in a timer's payload, or None if it holds none.

    A payload of another kind is not taken for one: the head must carry the
    record's magic number and sizes that add up, and the method be an HTTP
    token."""
    if len(payload) < HEAD.size:
        return None
    head = HEAD.unpack_from(payload)
    kind, m_len, r_len, flags, pid, start, started_ns, thread, task, stack, dump, magic, ms, queued_ms = head
    if magic != MAGIC or kind not in KINDS or HEAD.size + m_len + r_len > len(payload):
        return None
    at = HEAD.size
    method = payload[at : at + m_len].decode("ascii", "replace")
    at += m_len
    # A request without an id of its client's has one of its worker's: its
    # pid and its start, which no other request of that worker shares.
    request_id = payload[at : at + r_len].decode("ascii", "replace") or f"{pid:x}.{started_ns & 0xFFFFFFFF:08x}"
    at += r_len
    path = payload[at:].decode("utf-8", "replace")
    if not _METHOD.fullmatch(method):
        return None
    task_kind = "task" if flags & TASK else "greenlet" if flags & GREENLET else ""
    return RequestRecord(
        kind, pid, start, started_ns, method, request_id, path, bool(flags & TRUNCATED),
        thread, task, task_kind, stack, dump, ms, bool(flags & WARN), bool(flags & INTERRUPT), queued_ms,
    )  # fmt: skip


def rearmed(payload: bytes, timeout_ms: int) -> bytes:
    """The same request's record for a new timer, which is its timeout
    ``timeout_ms`` after its start (:func:`shmwheel.contrib.extend`)."""
    at = _TIMEOUT_AT
    ms = struct.pack("<I", min(timeout_ms, MAX_TIMEOUT_MS))
    return payload[:3] + bytes([payload[3] & ~WARN]) + payload[4:at] + ms + payload[at + 4 :]


def with_kind(payload: bytes, kind: int) -> bytes:
    """The same record as another kind: a follow-up or an answer names the request."""
    return bytes([kind]) + payload[1:]
