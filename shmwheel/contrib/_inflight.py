"""The requests in flight on a request-timeout wheel, each at its stage,
read from one pass over the wheel's timers (:meth:`shmwheel.Wheel.timers`)
without disturbing the workers: what ``shmwheel requests`` lists, ``ls``
and ``stat`` count, and the driver's metrics report.

A request is in the wheel for as long as it runs: its own timer, pending
until its first stage; then, fired, that timer kept in flight by the
driver while the request's stages run and for as long as the request runs
on past them, until its worker frees it as the request ends (or the
driver does, once the worker is gone).  So a request is listed while its
own timer is there, and the driver's follow-up timers of its stages say
which stage it is at.
Every timer of a request carries its record, so they are told apart by
kind and put together by the request's identity: its worker (pid and
start time) and the moment it started.

What is read is what the segment says, and anyone who can write the
segment can write it: a request's own timer counts only if the worker it
names added it, and a follow-up says the stage of a request seen (a
driver's follow-ups outlive it: its successor's are another pid's).
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Any

from .._results import Timer
from .._wheel import Wheel
from ._record import (
    KIND_CHECK,
    KIND_FINISHED,
    KIND_GRACE,
    KIND_GRACEFUL,
    KIND_KILL,
    KIND_LATE,
    KIND_REQUEST,
    KIND_TIMEOUT,
    RequestRecord,
    decode_request,
    due,
)

__all__ = ["InFlight", "STAGES", "WheelRequests", "in_flight", "read"]

RUNNING, WARNED, TIMED_OUT, INTERRUPTED, KILLING = "running", "warned", "timed out", "interrupted", "being killed"
#: A request's stages, in the order it goes through them.
STAGES = (RUNNING, WARNED, TIMED_OUT, INTERRUPTED, KILLING)
_FOLLOW_UPS = frozenset({KIND_CHECK, KIND_GRACE, KIND_GRACEFUL, KIND_KILL, KIND_TIMEOUT, KIND_LATE})


@dataclass(frozen=True, slots=True)
class InFlight:
    """A request in flight, as its timers show it."""

    record: RequestRecord
    stage: str  #: one of STAGES
    timeout_ns: int | None  #: time.monotonic_ns() when it times out, if its timers say
    handle: int  #: its own timer
    payload: bytes = b""  #: the record of its own timer, as the timer holds it

    def age(self, now_ns: int) -> float:
        """Seconds since it started."""
        return max(now_ns - self.record.started_ns, 0) / 1e9

    def timeout(self) -> float | None:
        """Its timeout, in seconds after its start."""
        return None if self.timeout_ns is None else (self.timeout_ns - self.record.started_ns) / 1e9

    def late(self) -> bool:
        """Whether it is past its timeout and still runs."""
        return self.stage in (TIMED_OUT, INTERRUPTED, KILLING)

    def as_dict(self, now_ns: int) -> dict[str, Any]:
        """``shmwheel requests --json``'s object."""
        r = self.record
        timeout = self.timeout()
        return {
            "request_id": r.request_id,
            "method": r.method,
            "path": r.path,
            "truncated": r.truncated,
            "worker_pid": r.pid,
            "thread": r.thread,
            "task": r.task,
            "task_kind": r.task_kind,
            "age_s": round(self.age(now_ns), 6),
            "timeout_s": None if timeout is None else round(timeout, 6),
            "stage": self.stage,
        }


@dataclass(frozen=True, slots=True)
class WheelRequests:
    """What a pass over a wheel's timers found."""

    requests: list[InFlight]  #: oldest first
    pending_requests: int  #: requests' own timers pending (they have not reached a stage)
    pending_follow_ups: int  #: the driver's follow-up timers of requests' stages, pending
    others: int  #: timers that carry no request record: not a request wheel's, or scribbled on
    now_ns: int  #: time.monotonic_ns() when the pass ended

    @property
    def late(self) -> int:
        """Requests past their timeout that still run."""
        return sum(1 for request in self.requests if request.late())


def read(wheel: Wheel) -> WheelRequests:
    """The requests in flight on ``wheel``: those of its workers that are
    alive (or in another PID namespace, where that cannot be told), so
    that neither a worker killed in the middle of a request nor a record
    that names a process which never attached is listed."""
    timers = wheel.timers()
    workers = {(p.pid, p.start) for p in wheel.producers() if p.alive is not False}
    return in_flight(timers, workers=workers)


def in_flight(
    timers: Iterable[Timer], now_ns: int | None = None, workers: Container[tuple[int, int]] | None = None
) -> WheelRequests:
    """The requests ``timers`` (:meth:`shmwheel.Wheel.timers`) show in
    flight, oldest first; ``workers``: the (pid, start) of the workers
    whose requests count (None: any)."""
    groups: dict[tuple[int, int, int], list[tuple[Timer, RequestRecord]]] = {}
    own = follow_ups = others = 0
    for timer in timers:
        record = decode_request(timer.payload)
        if record is None:
            others += 1
            continue
        if not timer.fired:
            own += record.kind == KIND_REQUEST
            follow_ups += record.kind in _FOLLOW_UPS
        if workers is not None and (record.pid, record.start) not in workers:
            continue
        groups.setdefault((record.pid, record.start, record.started_ns), []).append((timer, record))
    now = time.monotonic_ns() if now_ns is None else now_ns
    found = [request for group in groups.values() if (request := _request(group, now)) is not None]
    found.sort(key=lambda request: request.record.started_ns)
    return WheelRequests(found, own, follow_ups, others, now)


def _request(group: list[tuple[Timer, RequestRecord]], now_ns: int) -> InFlight | None:
    """The request one identity's timers show, or None if they show none in flight."""
    own = [(t, r) for t, r in group if r.kind == KIND_REQUEST and t.owner_pid == r.pid]
    kinds = {r.kind for _, r in group}
    if KIND_FINISHED in kinds or not own:
        # It has ended: its worker's word is on its way, or its worker has
        # freed its fire (which the driver keeps in flight for as long as
        # the request's stages run, and it runs on), and the driver's
        # follow-ups of it have yet to come; or it is only a worker's word.
        return None
    pending = [(t, r) for t, r in own if not t.fired]
    # The newest record: a request given a new timer (extend()) has a new
    # timeout, and the one its worker added last says it.
    timer, record = max(pending or own, key=lambda tr: (not tr[0].fired, tr[0].deadline_ns))
    timeout_ns = record.timeout_at() or timer.deadline_ns
    if kinds & {KIND_KILL, KIND_GRACEFUL}:
        stage = KILLING
    elif KIND_GRACE in kinds:
        stage = INTERRUPTED
    elif pending:
        stage = RUNNING
    elif KIND_TIMEOUT in kinds or (record.warn and timeout_ns is not None and not due(timeout_ns, now_ns)):
        stage = WARNED
    elif record.interrupt:
        stage = INTERRUPTED  # asked to end, and run on past the grace (kill is off), or about to be asked
    else:
        stage = TIMED_OUT
    return InFlight(record, stage, timeout_ns, timer.handle, timer.payload)
