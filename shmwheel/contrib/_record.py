"""What a worker and the driver agree on: the request record a worker puts
in each request's timer, and the signals that ask a worker for a stack.

The record's layout, kinds, flags and limits are written once, in C
(csrc/record.h, which shmwheel._fast packs from); the numbers here are
the compiled module's, and HEAD, the struct Python packs and reads the
head with, is checked against the header's offsets by tests/test_layout.py.
A record is the head, then the method, the request id and the path.

The worker names the signals itself, so a driver run elsewhere, with
settings of its own, still asks it in the way it listens.
"""

from __future__ import annotations

import re
import signal
import struct
import time
from typing import Any, NamedTuple

from .._binding import lib

__all__ = [
    "DEFAULT_TRACEBACK_SIGNAL",
    "DUMP_SIGNAL",
    "DUMP_SIGNALS",
    "KIND_ANSWER",
    "KIND_CHECK",
    "KIND_END",
    "KIND_END_KILL",
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
    "stack_pipe",
]

#: Bytes of request record per timer: room for a path of about 180 bytes.
PAYLOAD_SIZE: int = lib.SHMW_REQ_PAYLOAD_SIZE

KIND_REQUEST: int = lib.SHMW_REQ_KIND_REQUEST  #: a request's own timer, added by its worker
KIND_KILL: int = lib.SHMW_REQ_KIND_KILL  #: the driver's follow-up: SIGKILL, kill_after after kill_signal
KIND_GRACEFUL: int = lib.SHMW_REQ_KIND_GRACEFUL  #: the driver's follow-up: kill_signal, once the stack is written
KIND_CHECK: int = lib.SHMW_REQ_KIND_CHECK  #: the driver's follow-up: did the worker write the stack it was asked for?
KIND_ANSWER: int = lib.SHMW_REQ_KIND_ANSWER  #: the worker's: it has written the stack of the request this names
KIND_FINISHED: int = lib.SHMW_REQ_KIND_FINISHED  #: the worker's: the request has finished after its timer fired
KIND_TIMEOUT: int = lib.SHMW_REQ_KIND_TIMEOUT  #: the driver's follow-up: the timeout stage of a request warned first
KIND_GRACE: int = lib.SHMW_REQ_KIND_GRACE  #: the driver's follow-up: has the request it interrupted ended?
KIND_RELEASED: int = lib.SHMW_REQ_KIND_RELEASED  #: the worker's: the request has a new timer, or none, since this fired
#: The worker's, to a driver it has not told before: the request this names
#: still runs past its timeout, which a driver that died had asked about.
KIND_LATE: int = lib.SHMW_REQ_KIND_LATE
#: An operator's (``shmwheel end``), to the driver: end the request this
#: names now, as its timeout would (and, END_KILL, go on to its worker's
#: kill stage if it has not ended within its grace).
KIND_END: int = lib.SHMW_REQ_KIND_END
KIND_END_KILL: int = lib.SHMW_REQ_KIND_END_KILL
KINDS = frozenset(range(KIND_REQUEST, KIND_END_KILL + 1))

TRUNCATED: int = lib.SHMW_REQ_TRUNCATED  # flags: the path was cut to fit
TASK: int = lib.SHMW_REQ_TASK  # flags: the task field is an asyncio task's id
GREENLET: int = lib.SHMW_REQ_GREENLET  # flags: the task field is a greenlet's id
WARN: int = lib.SHMW_REQ_WARN  # flags: the warn_after stage; its timeout is timeout_ms after its start
INTERRUPT: int = lib.SHMW_REQ_INTERRUPT  # flags: at its timeout, the worker ends the request itself when asked
MAX_TIMEOUT_MS: int = lib.SHMW_REQ_MAX_TIMEOUT_MS  # a longer timeout is written as this, about 49 days
MAGIC: int = lib.SHMW_REQ_MAGIC
#: kind, method and request id lengths, flags, pid, start, started_ns,
#: thread, task, stack and dump signals, magic, timeout and time queued (ms).
HEAD = struct.Struct("<BBBBIQqQQBBHII")
AT_STARTED: int = lib.SHMW_REQ_AT_STARTED
AT_STACK_SIGNAL: int = lib.SHMW_REQ_AT_STACK_SIGNAL
AT_TIMEOUT: int = lib.SHMW_REQ_AT_TIMEOUT
MAX_METHOD: int = lib.SHMW_REQ_MAX_METHOD
#: A clock reading this close to a request's timeout counts as past it: the
#: wheel fires on its tick, and each side reads the clock at its own moment.
SLACK_NS = 5_000_000


def due(deadline_ns: int, now_ns: int) -> bool:
    """Whether a request whose stage is due at ``deadline_ns`` (its timeout,
    or its timer's deadline) is past it at ``now_ns``: the one definition,
    in the worker and in the driver alike, give or take SLACK_NS."""
    return now_ns >= deadline_ns - SLACK_NS


MAX_REQUEST_ID: int = lib.SHMW_REQ_MAX_REQUEST_ID
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


def stack_pipe(wheel: str, pid: int, started_ns: int) -> str:
    """Where ``shmwheel stack`` waits for the stack of the request that
    worker ``pid`` started at ``started_ns`` on ``wheel``: a FIFO in
    /dev/shm, beside the wheel, that the worker writes the stack into."""
    return f"/dev/shm/shmwheel-stack.{wheel.lstrip('/')}.{pid}.{started_ns}"


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
    at = AT_TIMEOUT
    ms = struct.pack("<I", min(timeout_ms, MAX_TIMEOUT_MS))
    return payload[:3] + bytes([payload[3] & ~WARN]) + payload[4:at] + ms + payload[at + 4 :]


def with_kind(payload: bytes, kind: int) -> bytes:
    """The same record as another kind: a follow-up or an answer names the request."""
    return bytes([kind]) + payload[1:]
