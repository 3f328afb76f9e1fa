"""What an operator does by hand to one request in flight: ``shmwheel
stack NAME REQUEST_ID`` (its own stack, now, printed) and ``shmwheel end
NAME REQUEST_ID [--kill]`` (its end, as its timeout would do it).

Only the wheel's owner, or root, may do either: both act on the wheel's
workers, which its owner runs.

The stack: the worker's stack signal, with a value that names the request
and asks for its stack (``ASK_STACK``), sent from here, as the driver
sends it, to a live worker of the wheel that uses it; the worker's
reporter thread writes the stack into a FIFO this command made for it in
/dev/shm (:func:`~shmwheel.contrib._record.stack_pipe`), of the worker's
user, and says so in the server's log.  The request goes on as it was.

The end: a timer of kind ``KIND_END`` (or ``KIND_END_KILL``) that names
the request, due at once, which the driver acts on
(:meth:`~shmwheel.contrib.TimeoutHandler._end_asked`): it moves the
request's own timer to now, and its fire begins the timeout stage, marked
as done by hand, in the server's log.  This command then watches the
wheel for what came of it.
"""

from __future__ import annotations

import os
import select
import time
from dataclasses import dataclass

from .._process import alive, signal_disposition, start_time, uids, uses_file
from .._segment import SHM, bare_name
from .._wheel import Wheel, attach, observe
from ._handler import DUMP_TIME, signal_if, uid_refusal
from ._inflight import KILLING, InFlight, read
from ._metrics import driver_note
from ._record import KIND_END, KIND_END_KILL, shown, signal_name, stack_pipe, with_kind
from ._settings import DEFAULT_INTERRUPT_GRACE, DEFAULT_KILL_AFTER
from ._stacks import ASK_STACK, asked_value

__all__ = ["ENDED", "KILLED", "RUNS_ON", "Outcome", "end", "stack"]

#: ``shmwheel end``'s exit statuses, beside 0 (it ended) and 1 (an error).
RUNS_ON = 3  #: it has not ended within its grace, and runs on
KILLED = 4  #: its worker was killed (--kill), or exited
ENDED = 0
#: How long a driver has to take up an end asked of it.
TAKE_UP = 2.0


class OperatorError(ValueError):
    """Why an operator's ask cannot be made: one line, exit status 1."""


def _may_act(name: str) -> None:
    """Refuse anyone but the wheel's owner and root."""
    me = os.geteuid()
    owner = os.stat(SHM / bare_name(name)).st_uid
    if me not in (owner, 0):
        raise OperatorError(
            f"only the owner of wheel {name!r} (uid {owner}) or root may act on its requests; this is uid {me}"
        )


def _find(wheel: Wheel, request_id: str) -> InFlight:
    """The request in flight with that id: exactly one."""
    found = [r for r in read(wheel).requests if r.record.request_id == request_id]
    if not found:
        raise OperatorError(
            f"no request {shown(request_id)!r} is in flight on wheel {wheel.name!r}: it has ended, or never was "
            "(shmwheel requests lists them)"
        )
    if len(found) > 1:
        pids = ", ".join(str(r.record.pid) for r in found)
        raise OperatorError(
            f"{len(found)} requests in flight on wheel {wheel.name!r} have the id {shown(request_id)!r} (their client "
            f"chose it: workers {pids}); none is acted on"
        )
    return found[0]


def _same(a: InFlight, b: InFlight) -> bool:
    return (a.record.pid, a.record.start, a.record.started_ns) == (b.record.pid, b.record.start, b.record.started_ns)


def _still(wheel: Wheel, request: InFlight) -> InFlight | None:
    """The request, as the wheel shows it now, if it is still in flight."""
    return next((r for r in read(wheel).requests if _same(r, request)), None)


def stack(name: str, request_id: str, wait: float) -> str:
    """The request's own stack, now, as its worker writes it; OperatorError
    if it cannot be had, saying why (the worker did not answer within
    ``wait`` seconds: no Python runs in it, most likely)."""
    with observe(name) as wheel:
        _may_act(name)
        request = _find(wheel, request_id)
        r = request.record
        if not r.stack_signal:
            raise OperatorError(
                f"{r.describe()}: its worker listens for no ask (with stacks and every stage off it is never asked)"
            )
        how = signal_disposition(r.pid, r.stack_signal)
        if how not in ("caught", None):
            raise OperatorError(f"{r.describe()}: its worker does not catch {signal_name(r.stack_signal)} ({how})")
        path = stack_pipe(wheel.name, r.pid, r.started_ns)
        try:
            os.mkfifo(path, 0o600)
        except FileExistsError:
            raise OperatorError(
                f"{path} exists: the stack of {r.describe()} is being asked for already (or that was left behind: "
                "remove it)"
            ) from None
        try:
            ids = uids(r.pid)
            if os.geteuid() == 0 and ids is not None and ids[1] != 0:
                os.chown(path, ids[1], -1)  # the worker writes only into a pipe of its own user's
            reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            # Held open until the worker has begun: a FIFO with no writer
            # reads as its end.
            holder = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                _ask(wheel, request, path)
                text = _read(reader, holder, wait)
            finally:
                os.close(reader)
        finally:
            os.unlink(path)
        if text:
            return text
        if _still(wheel, request) is None:
            raise OperatorError(f"{r.describe()} ended before its stack was written")
        dump = f"; kill -s {signal_name(r.dump_signal)} {r.pid} has faulthandler write every thread's stack to its " \
            f"stderr, where this request's is thread 0x{r.thread:016x}" if r.dump_signal else ""  # fmt: skip
        raise OperatorError(
            f"worker pid {r.pid} did not write the stack of {r.describe()} within {wait:g} s: no Python runs in it "
            f"(a C call that holds the GIL?){dump}"
        )


def _ask(wheel: Wheel, request: InFlight, path: str) -> None:
    """The stack signal to the request's worker, as the driver sends it: to
    the same live process, of a uid this one may signal, that uses the wheel."""
    r = request.record
    dev, ino = wheel.file_id()
    why: list[str] = []

    def may() -> bool:
        refusal = None if os.geteuid() == 0 else uid_refusal(r.pid)
        if refusal is None and uses_file(r.pid, r.start, dev, ino) is False:
            refusal = f"pid {r.pid} does not use wheel {wheel.name!r}"
        if refusal is not None:
            why.append(refusal)
        return refusal is None

    if not signal_if(r.pid, r.start, r.stack_signal, may, asked_value(r.started_ns, ASK_STACK)):
        raise OperatorError(why[0] if why else f"{r.describe()} has ended: its worker is gone")


def _read(reader: int, holder: int | None, wait: float) -> str:
    """What the worker writes into the pipe, once it has closed it, or what
    came within ``wait`` seconds."""
    chunks: list[bytes] = []
    give_up = time.monotonic() + wait
    while True:
        left = give_up - time.monotonic()
        if left <= 0:
            break
        if not select.select([reader], [], [], left)[0]:
            break
        try:
            data = os.read(reader, 65536)
        except BlockingIOError:
            continue
        if not data:
            break  # the worker has closed it
        chunks.append(data)
        if holder is not None:  # the worker has begun: its close is the end
            os.close(holder)
            holder = None
    if holder is not None:
        os.close(holder)
    return b"".join(chunks).decode("utf-8", "replace")


@dataclass(frozen=True)
class Outcome:
    """What came of ``shmwheel end``: its exit status and the line that says so."""

    status: int
    line: str


def end(name: str, request_id: str, kill: bool) -> Outcome:
    """End the request as its timeout would, through the wheel's driver, and
    wait to see what came of it."""
    with attach(name) as wheel:
        _may_act(name)
        wheel.show_use(start_time(os.getpid()) or 0)  # the kernel's word, which the driver asks, that this uses it
        request = _find(wheel, request_id)
        r = request.record
        stats = wheel.stats()
        if (
            stats.driver_pid is None
            or stats.driver_state != "running"
            or not alive(stats.driver_pid, stats.driver_start or 0)
        ):
            raise OperatorError(f"no driver runs on wheel {name!r}: nothing would end {r.describe()}")
        if not kill and not r.interrupt:
            raise OperatorError(
                f"{r.describe()} cannot be ended by itself: its worker ends requests only with interrupt=True; "
                "shmwheel end --kill ends it with its worker"
            )
        if not kill and request.late():
            raise OperatorError(
                f"{r.describe()} is past its timeout, and was asked to end already ({request.stage}): shmwheel end "
                "--kill goes on to its worker's kill stage"
            )
        note = driver_note(wheel)
        grace = float(note.get("interrupt_grace", DEFAULT_INTERRUPT_GRACE))
        kill_after = float(note.get("kill_after", DEFAULT_KILL_AFTER))
        asked = time.monotonic()
        wheel.add(0.0, with_kind(request.payload, KIND_END_KILL if kill else KIND_END), reserved=True)
        return _watch(wheel, request, asked, grace, kill_after if kill else None)


def _watch(wheel: Wheel, request: InFlight, asked: float, grace: float, kill_after: float | None) -> Outcome:
    """What came of an end asked at ``asked``: the request gone from the
    wheel (its worker there still: it ended; gone: killed), or not within
    its grace (and, with --kill, the kill stage after it)."""
    r = request.record
    what = f"request {shown(r.request_id)} ({shown(r.method)} {shown(r.path)}, worker pid {r.pid})"
    ends_by = asked + TAKE_UP + DUMP_TIME + grace + (kill_after + 1.0 + DUMP_TIME if kill_after is not None else 0)
    taken_up = False
    while True:
        request_now = _still(wheel, request)
        if request_now is None:
            took = time.monotonic() - asked
            if alive(r.pid, r.start):
                return Outcome(ENDED, f"{what} ended {took:.3f} s after it was asked to")
            return Outcome(KILLED, f"{what} is over: its worker exited, or was killed, {took:.3f} s after it was asked")
        taken_up = taken_up or request_now.stage != request.stage or request_now.handle != request.handle
        if not taken_up and time.monotonic() > asked + TAKE_UP:
            raise OperatorError(
                f"the driver of wheel {wheel.name!r} has not taken the end of {what} up within {TAKE_UP:g} s "
                "(its log says why)"
            )
        if time.monotonic() > ends_by:
            if request_now.stage == KILLING:
                return Outcome(RUNS_ON, f"{what} has not ended: its worker is being killed")
            return Outcome(
                RUNS_ON,
                f"{what} has not ended {grace:g} s after it was asked to: it runs on (a C call that has not returned, "
                "cleanup code, or code that caught RequestTimeout); shmwheel end --kill ends it with its worker",
            )
        time.sleep(0.05)
