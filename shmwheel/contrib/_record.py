"""What a worker and the driver agree on: the request record a worker puts
in each request's timer, and the signal that asks a worker for its stacks.

The request record is a 24-byte head then the method, the request id and
the path (little-endian)::

    offset  size  field
         0     1  kind: 1 request, 2 the SIGKILL that follows kill_signal,
                  3 the kill_signal that follows a traceback dump
         1     1  method length in bytes
         2     1  request id length in bytes
         3     1  flags: bit 0 set if the path was cut to fit
         4     4  worker pid
         8     8  worker start time, clock ticks since boot (/proc/PID/stat)
        16     8  request start, time.monotonic_ns()
        24     -  method, request id, path (UTF-8, the path cut to fit)
"""

from __future__ import annotations

import re
import signal
import struct
import time
from typing import NamedTuple

__all__ = [
    "DEFAULT_TRACEBACK_SIGNAL",
    "KIND_GRACEFUL",
    "KIND_KILL",
    "KIND_REQUEST",
    "PAYLOAD_SIZE",
    "REQUEST_ID",
    "RequestRecord",
    "decode_request",
    "encode_request",
]

#: Bytes of request record per timer: room for a path of about 200 bytes.
PAYLOAD_SIZE = 256

KIND_REQUEST = 1
KIND_KILL = 2
KIND_GRACEFUL = 3
TRUNCATED = 1  # the flag of a path cut to fit
HEAD = struct.Struct("<BBBBIQq")
MAX_METHOD = 32
MAX_REQUEST_ID = 64
#: What a request id taken from a client header may hold: it is written into
#: log lines, so nothing that could forge one.
REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,64}")

#: faulthandler's signal.  SIGURG is ignored by default, so a dump request
#: that reaches a process without faulthandler registered on it does no harm,
#: and neither Gunicorn nor uWSGI gives it a meaning in a worker.
DEFAULT_TRACEBACK_SIGNAL = signal.SIGURG


class RequestRecord(NamedTuple):
    """A request record, decoded."""

    kind: int
    pid: int  #: the worker
    start: int  #: the worker's start time (with the pid, its identity)
    started_ns: int  #: when the request started, time.monotonic_ns()
    method: str
    request_id: str
    path: str
    truncated: bool  #: the path was cut to fit the payload

    def running_for(self, now_ns: int | None = None) -> float:
        """Seconds since the request started."""
        return ((time.monotonic_ns() if now_ns is None else now_ns) - self.started_ns) / 1e9

    def describe(self) -> str:
        """``GET /path (request ID, worker pid N)``, for log lines."""
        path = self.path + ("..." if self.truncated else "")
        return f"{self.method} {path} (request {self.request_id}, worker pid {self.pid})"


def encode_request(
    kind: int,
    pid: int,
    start: int,
    started_ns: int,
    method: str,
    request_id: str,
    path: str,
    size: int = PAYLOAD_SIZE,
) -> bytes:
    """A request record of at most ``size`` bytes: the path is cut to fit."""
    m = method.encode("ascii", "replace")[:MAX_METHOD]
    r = request_id.encode("ascii", "replace")[:MAX_REQUEST_ID]
    p = path.encode("utf-8", "surrogateescape")
    room = size - HEAD.size - len(m) - len(r)
    if room < 0:
        raise ValueError(f"a payload of {size} bytes has no room for a request record")
    flags = 0
    if len(p) > room:
        p = p[:room]
        flags |= TRUNCATED
    return HEAD.pack(kind, len(m), len(r), flags, pid, start, started_ns) + m + r + p


def decode_request(payload: bytes) -> RequestRecord | None:
    """The record in a timer's payload, or None if it holds none."""
    if len(payload) < HEAD.size:
        return None
    kind, m_len, r_len, flags, pid, start, started_ns = HEAD.unpack_from(payload)
    if kind not in (KIND_REQUEST, KIND_KILL, KIND_GRACEFUL) or HEAD.size + m_len + r_len > len(payload):
        return None
    at = HEAD.size
    method = payload[at : at + m_len].decode("ascii", "replace")
    at += m_len
    request_id = payload[at : at + r_len].decode("ascii", "replace")
    at += r_len
    path = payload[at:].decode("utf-8", "replace")
    return RequestRecord(kind, pid, start, started_ns, method, request_id, path, bool(flags & TRUNCATED))
