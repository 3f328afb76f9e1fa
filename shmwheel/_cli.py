"""The ``shmwheel`` command line (``python -m shmwheel`` or ``shmwheel``).

``create``, ``stat``, ``ls``, ``check`` and ``unlink`` manage segments;
``requests`` lists the requests in flight on a request-timeout wheel,
``stack`` prints one's stack and ``end`` ends one, and ``metrics`` prints
its driver's metrics;
``driver`` runs a wheel's :class:`~shmwheel.Driver` in the foreground, its
fires going to a handler it loads by name, to stdout as lines of JSON
(``--jsonl``) or to the log; ``demo`` shows it all.
As the Unix tools around it do: results on stdout, an error as one line
"shmwheel: ..." on stderr and exit status 1, a usage error exit status 2
(argparse's), Ctrl-C 130, and a reader that goes away (``shmwheel ls | head
-1``) ends it quietly with 141, as SIGPIPE ends other tools.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import logging
import math
import os
import pwd
import signal
import stat
import sys
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Any, TypeVar

from ._binding import lib
from ._checks import CAPACITIES, PAYLOAD_SIZES, check_seconds, not_a_tick, not_a_wheel_size, not_between
from ._demo import demo
from ._driver import Driver, Handler, OutputFailed, dedicated_process
from ._errors import DriverRunningError, IncompatibleSegmentError, SegmentNotFoundError, ShmwheelError, one_line
from ._process import alive
from ._results import Fire, Producer, WheelStats
from ._segment import SHM, bare_name, wheel_stat
from ._wheel import create, observe, unlink
from .contrib import _inflight, _metrics
from .contrib._record import decode_request, shown

__all__ = ["main"]

_V = TypeVar("_V", int, float)


# -- option values ----------------------------------------------------------------
#
# argparse types: a value out of range is a usage error (exit status 2, with
# the usage), found by the same checks create() makes, before anything is
# created.


def _seconds(text: str) -> float:
    """A time in seconds: the text as a number, put through the package's
    one check of a time (check_seconds), whose error is a usage error here."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds: {text!r}") from None
    try:
        return check_seconds(value, "the time")
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> float:
    """A time in seconds that is finite and more than 0 (a duration, an interval)."""
    value = _seconds(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, not {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None


def _option(parse: Callable[[str], _V], problem: Callable[[_V], str | None]) -> Callable[[str], _V]:
    """An argparse type: ``parse``, then the library's own check of the value."""

    def check(text: str) -> _V:
        value = parse(text)
        if found := problem(value):
            raise argparse.ArgumentTypeError(found)
        return value

    return check


def _int_between(lo: int, hi: int) -> Callable[[str], int]:
    return _option(_int, lambda value: not_between(value, lo, hi))


def _octal(text: str) -> int:
    try:
        value = int(text, 8)
    except ValueError:
        value = -1
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"must be an octal mode between 000 and 777, like 600, not {text}")
    return value


# -- output helpers -----------------------------------------------------------


def _table(rows: Sequence[Sequence[object]], right: Collection[int] = ()) -> list[str]:
    """Rows aligned in columns, two spaces apart; the columns in ``right`` are
    right-aligned.  A row shorter than the longest ends in a cell (a reason,
    say) that is left out of the widths and runs on past its column."""
    ncols = max((len(row) for row in rows), default=0)
    widths = [0] * ncols
    for row in rows:
        for i, cell in enumerate(row if len(row) == ncols else row[:-1]):
            widths[i] = max(widths[i], len(str(cell)))

    def align(i: int, cell: object, runs_on: bool) -> str:
        text = str(cell)
        if runs_on:
            return text
        return text.rjust(widths[i]) if i in right else text.ljust(widths[i])

    return [
        "  ".join(align(i, cell, len(row) < ncols and i == len(row) - 1) for i, cell in enumerate(row)).rstrip()
        for row in rows
    ]


_UNITS = (
    (365.25 * 86400, "y"),
    (86400, "d"),
    (3600, "h"),
    (60, "min"),
    (1, "s"),
    (1e-3, "ms"),
    (1e-6, "us"),
    (1e-9, "ns"),
)


def _duration(seconds: float) -> str:
    """``seconds`` in the largest unit that keeps it >= 1 (to 3 digits): "1 ms", "65.5 s", "4.66 h"."""
    size, unit = next(((size, unit) for size, unit in _UNITS if seconds >= size), (1, "s"))
    value = seconds / size
    return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"


def _print(lines: Iterable[str]) -> None:
    for line in lines:
        print(line)
    sys.stdout.flush()


def _print_json(obj: object) -> None:
    print(json.dumps(obj), flush=True)


# -- the segments in /dev/shm -------------------------------------------------


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _segments() -> list[dict[str, Any]]:
    """Every shmwheel segment in /dev/shm, by name, as ``ls`` reports it."""
    found = []
    for entry in sorted(os.scandir(SHM), key=lambda e: e.name):
        try:
            st = wheel_stat(entry.name)
        except OSError:
            continue  # gone, or not readable by us: we cannot tell whose it is
        if st is None:
            continue
        seg: dict[str, Any] = {
            "name": entry.name,
            "size": st.st_size,
            "owner": _owner(st.st_uid),
            "mode": f"{stat.S_IMODE(st.st_mode):04o}",
            "capacity": None,
            "pending": None,
            "requests": None,
            "driver_pid": None,
            "error": None,
        }
        try:
            with observe(entry.name) as wheel:
                s = wheel.stats()
                seen = _inflight.read(wheel)
            seg.update(capacity=s.capacity, pending=s.pending, driver_pid=s.driver_pid)
            if seen.requests or not seen.others:  # not for a wheel whose timers are not requests'
                seg["requests"] = len(seen.requests)
        except SegmentNotFoundError:
            continue  # removed since the scan
        except (ShmwheelError, OSError, ValueError) as exc:
            seg["error"] = one_line(exc)
        found.append(seg)
    return found


# -- commands -------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    return demo(args.workers, args.duration)


def _create(args: argparse.Namespace) -> int:
    with create(
        args.name,
        capacity=args.capacity,
        tick=args.tick,
        payload_size=args.payload_size,
        reserve=args.reserve,
        shards=args.shards,
        mode=args.mode,
        wheel_size=args.wheel_size,
    ) as wheel:
        size = os.stat(SHM / wheel.name).st_size
        reserve = f" ({wheel.reserve} in reserve)" if wheel.reserve else ""
        shards = f" in {args.shards} shards" if args.shards > 1 else ""
        print(
            f"created wheel {wheel.name!r}: capacity {wheel.capacity}{reserve}{shards}, tick {_duration(wheel.tick)}, "
            f"payload {wheel.payload_size} bytes, {wheel.levels} levels of {wheel.wheel_size} buckets, "
            f"{size} bytes in {SHM / wheel.name}, mode {args.mode:04o}"
        )
    return 0


# -- the driver command ---------------------------------------------------------


def _load_handler(spec: str) -> Handler:
    """The function ``--handler pkg.module:function`` names.

    The module is looked for in the current directory first, as uvicorn and
    gunicorn do: ``python -m shmwheel`` has it on sys.path, the installed
    ``shmwheel`` script would not.  It stays there, so that the handler's own
    imports find their neighbours as they would under ``python -m``.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--handler takes pkg.module:function, not {spec!r}")
    cwd = os.getcwd()
    if sys.path[:1] != [cwd]:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import handler module {module_name!r}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no {attr!r}") from None
    if not callable(obj):
        raise ValueError(f"handler {spec!r} is not callable")
    handler: Handler = obj
    return handler


def _json_line(fire: Fire) -> bytes:
    obj: dict[str, object] = {
        "handle": fire.handle,
        "deadline": fire.deadline,
        "fired_at": fire.fired_at,
        "payload_hex": fire.payload.hex(),
        "owner_pid": fire.owner_pid,
        "redelivered": fire.redelivered,
        "kept": fire.kept,
    }
    record = decode_request(fire.payload)  # a request-timeout wheel's: decoded too
    if record is not None:
        obj["request"] = record.as_dict()
    return (json.dumps(obj) + "\n").encode()


class _JsonLinesDriver(Driver):
    """``driver --jsonl``: a line of JSON a fire on stdout.

    A fire counts as handled once its line is written, so a batch is written
    before it is acknowledged, with write(2) straight to the fd (one call for
    the batch, as a flush would be): on an error it is known which lines got
    out.  When the reader has gone (EPIPE) or the output fails otherwise,
    the driver stops and leaves the fire whose line did not get out, and
    those after it, in flight for the next driver.
    """

    def __init__(self, name: str, fd: int) -> None:
        super().__init__(name)
        self._out = fd

    def handle_batch(self, fires: list[Fire]) -> int:
        lines = [_json_line(fire) for fire in fires]
        data = memoryview(b"".join(lines))
        written = 0
        try:
            while written < len(data):
                written += os.write(self._out, data[written:])
        except OSError as exc:
            ends = itertools.accumulate(len(line) for line in lines)
            raise OutputFailed(sum(1 for end in ends if end <= written), exc) from None
        return 0


def _driver(args: argparse.Namespace) -> int:
    """``shmwheel driver NAME``: drive a wheel in the foreground until SIGTERM or SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    dedicated_process()
    if args.jsonl:
        sys.stdout.flush()  # the lines go straight to the fd, past this buffer
        driver: Driver = _JsonLinesDriver(args.name, sys.stdout.fileno())
    else:
        driver = Driver(args.name, _load_handler(args.handler) if args.handler else None)
    signal.signal(signal.SIGTERM, lambda *_: driver.stop())
    signal.signal(signal.SIGINT, lambda *_: driver.stop())
    driver.run()
    return 0


def _report(
    name: str,
    before: WheelStats,
    after: WheelStats,
    seconds: float,
    producers: list[Producer],
    found: _inflight.WheelRequests | None = None,
) -> dict[str, Any]:
    """What ``stat`` shows: every WheelStats field of the second sample under
    its own name, plus the rates between the two samples, and, for a
    request-timeout wheel (``found``), its requests in flight and the
    driver's follow-up timers told apart."""
    requests: dict[str, Any] = {"requests_in_flight": None, "requests_late": None, "pending_follow_ups": None}
    if found is not None and (found.requests or not found.others):
        requests = {
            "requests_in_flight": len(found.requests),
            "requests_late": found.late,
            "pending_follow_ups": found.pending_follow_ups,
        }
    return {
        "name": name,
        "time": time.time(),
        "interval": seconds,
        **after.as_dict(),
        "used_percent": 100 * (after.capacity - after.free) / after.capacity,
        "added_per_s": (after.added - before.added) / seconds,
        "cancelled_per_s": (after.cancelled - before.cancelled) / seconds,
        "fired_per_s": (after.fired - before.fired) / seconds,
        # A registration can outlive its driver (SIGKILL); say which it is.
        "driver_alive": after.driver_pid is not None and alive(after.driver_pid, after.driver_start or 0),
        "producers_alive": sum(1 for p in producers if p.alive),
        "producers_gone": sum(1 for p in producers if p.alive is False),
        # In another PID namespace (container): their pids mean nothing here.
        "producers_unseen": sum(1 for p in producers if p.alive is None),
        "producer_pids": [p.pid for p in producers if p.alive],
        **requests,
    }


def _stat_table(r: dict[str, Any]) -> list[str]:
    state = r["driver_state"] if r["driver_alive"] else "dead, registration left behind"
    driver = "none" if r["driver_pid"] is None else f"{r['driver_pid']} ({state})"
    pending = r["pending"]
    requests = bool(r["requests_in_flight"] or r["pending_follow_ups"])  # a request-timeout wheel's, in use
    if requests:
        follow_ups = r["pending_follow_ups"]
        pending = f"{pending} ({pending - follow_ups} of requests, {follow_ups} of the driver's follow-ups)"
    rows = [
        ("wheel", r["name"]),
        ("pending", pending),
        ("capacity", f"{r['capacity']} ({r['used_percent']:.1f}% used)"),
        ("free", f"{r['free']} ({r['reserve']} of them in reserve)" if r["reserve"] else r["free"]),
        ("in flight", r["in_flight"]),
        ("retired", r["retired"]),
        (
            "rates",
            f"{r['added_per_s']:.1f} added/s, {r['cancelled_per_s']:.1f} cancelled/s, "
            f"{r['fired_per_s']:.1f} fired/s (over {r['interval']:.2f} s)",
        ),
        ("timers", f"{r['added']} added, {r['cancelled']} cancelled, {r['fired']} fired, {r['resets']} resets"),
        (
            "handlers",
            f"{r['acked']} acked, {r['redelivered']} redelivered, {r['handler_errors']} failed, {r['refused']} refused",
        ),
        ("driver", driver),
        ("producers", f"{r['producers_alive']} attached, {r['producers_gone']} gone (not reaped yet)"),
        *(
            [("requests", f"{r['requests_in_flight']} in flight, {r['requests_late']} past their timeout and running")]
            if requests
            else []
        ),
        ("lag", _duration(r["lag"])),
        ("tick", _duration(r["tick"])),
        ("levels", f"{r['levels']} of {r['wheel_size']} buckets"),
        ("shards", f"{r['shards']} (a lock and a wheel each, {r['capacity'] // r['shards']} slots each)"),
    ]
    rows += [
        (f"level {i} ({_duration(r['tick'] * r['wheel_size'] ** i)}/bucket)", n)
        for i, n in enumerate(r["level_pending"])
    ]
    return _table(rows)


def _stat(args: argparse.Namespace) -> int:
    with observe(args.name) as wheel:
        if args.watch:
            signal.signal(signal.SIGTERM, signal.default_int_handler)  # ends the watch as Ctrl-C does
        before, t0 = wheel.stats(), time.monotonic()
        try:
            while True:
                time.sleep(max(0.0, t0 + args.interval - time.monotonic()))
                after, t1 = wheel.stats(), time.monotonic()
                report = _report(wheel.name, before, after, t1 - t0, wheel.producers(), _inflight.read(wheel))
                if args.json:
                    _print_json(report)
                else:
                    _print([*_stat_table(report), *([""] if args.watch else [])])
                if not args.watch:
                    return 0
                before, t0 = after, t1
        except KeyboardInterrupt:
            if args.watch:
                return 0
            raise


def _ls(args: argparse.Namespace) -> int:
    segments = _segments()
    if args.json:
        _print_json(segments)
    elif segments:
        head = ("NAME", "SIZE", "OWNER", "MODE", "CAPACITY", "PENDING", "REQUESTS", "DRIVER")
        rows = [
            [s["name"], s["size"], s["owner"], s["mode"]]
            + (
                [s["error"]]
                if s["error"]
                else [s["capacity"], s["pending"], _or_dash(s["requests"]), s["driver_pid"] or "-"]
            )
            for s in segments
        ]
        _print(_table([head, *rows], right=(1, 4, 5, 6, 7)))
    return 0


def _request_rows(found: _inflight.WheelRequests) -> list[str]:
    """``requests``' table: a row a request, the request line last, as ps puts the command."""
    head = ("AGE", "TIMEOUT", "STAGE", "PID", "THREAD", "TASK", "REQUEST ID", "REQUEST")
    rows: list[Sequence[object]] = [head]
    for request in found.requests:
        r, timeout = request.record, request.timeout()
        rows.append(
            (
                _duration(request.age(found.now_ns)),
                "-" if timeout is None else _duration(timeout),
                request.stage,
                r.pid,
                f"0x{r.thread:x}" if r.thread else "-",
                f"{r.task_kind} 0x{r.task:x}" if r.task else "-",
                shown(r.request_id),
                f"{shown(r.method)} {shown(r.path)}{'...' if r.truncated else ''}",
            )
        )
    return _table(rows, right=(0, 1, 3))


def _requests(args: argparse.Namespace) -> int:
    """``shmwheel requests NAME``: the requests in flight, oldest first."""
    with observe(args.name) as wheel:
        if args.watch:
            signal.signal(signal.SIGTERM, signal.default_int_handler)  # ends the watch as Ctrl-C does
        clear = args.watch and not args.json and sys.stdout.isatty()
        try:
            while True:
                t0 = time.monotonic()
                found = _inflight.read(wheel)
                requests = [
                    request
                    for request in found.requests
                    if request.age(found.now_ns) >= args.older_than
                    and (args.worker is None or request.record.pid == args.worker)
                ]
                found = _inflight.WheelRequests(
                    requests, found.pending_requests, found.pending_follow_ups, found.others, found.now_ns
                )
                if args.json:
                    _print_json([request.as_dict(found.now_ns) for request in requests])
                else:
                    lines = _request_rows(found)
                    if args.watch:
                        late = f", {found.late} past their timeout" if found.late else ""
                        n = f"{len(requests)} request{'s' * (len(requests) != 1)}"
                        title = f"wheel {wheel.name}: {n} in flight{late}, {time.strftime('%X')}"
                        lines = [title, "", *lines]
                    if clear:
                        sys.stdout.write("\x1b[H\x1b[2J")  # as top and watch(1) redraw
                    _print([*lines, *([""] if args.watch and not clear else [])])
                if not args.watch:
                    return 0
                time.sleep(max(0.0, t0 + args.interval - time.monotonic()))
        except KeyboardInterrupt:
            if args.watch:
                return 0
            raise


def _stack(args: argparse.Namespace) -> int:
    """``shmwheel stack NAME REQUEST_ID``: the request's own stack, now."""
    from .contrib import _operator

    print(_operator.stack(args.name, args.request_id, args.wait), end="", flush=True)
    return 0


def _end(args: argparse.Namespace) -> int:
    """``shmwheel end NAME REQUEST_ID [--kill]``: end it as its timeout would; the status says what came of it."""
    from .contrib import _operator

    outcome = _operator.end(args.name, args.request_id, args.kill)
    print(outcome.line, flush=True)
    return outcome.status


def _metrics_text(args: argparse.Namespace) -> int:
    """``shmwheel metrics NAME``: the metrics, once, as the driver serves them."""
    with observe(args.name) as wheel:
        sys.stdout.write(_metrics.render(wheel))
    return 0


def _or_dash(value: object) -> object:
    return "-" if value is None else value


def _check(args: argparse.Namespace) -> int:
    with observe(args.name) as wheel:
        wheel.check()
        print(f"{wheel.name}: ok")
    return 0


def _unlink(args: argparse.Namespace) -> int:
    name = bare_name(args.name)
    # Refuse another program's segment; a missing one is left to unlink() to report.
    if (SHM / name).exists() and wheel_stat(name) is None:
        raise IncompatibleSegmentError(f"segment {name!r} is not a shmwheel segment: not removing it")
    if not args.force and (users := _users(name)):
        if users.startswith("nobody can tell"):
            raise DriverRunningError(f"not removing wheel {name!r}: {users}; --force removes it all the same")
        raise DriverRunningError(
            f"wheel {name!r} is in use: {users}; removing it would leave them adding timers that nothing "
            "fires until they notice (--force removes it all the same)"
        )
    unlink(name)
    return 0


def _users(name: str) -> str | None:
    """Who uses a wheel (its live driver, its live producers), in words; None if nobody."""
    try:
        with observe(name) as wheel:
            st = wheel.stats()
            producers = [p for p in wheel.producers() if p.alive is not False]
    except SegmentNotFoundError:
        return None
    except ShmwheelError as exc:  # a lock held too long, another layout version...
        return f"nobody can tell who uses it ({one_line(exc)})"
    said = []
    if st.driver_pid and alive(st.driver_pid, st.driver_start or 0):
        said.append(f"its driver, pid {st.driver_pid}, is running")
    if producers:
        pids = ", ".join(str(p.pid) for p in producers[:5]) + (", ..." if len(producers) > 5 else "")
        said.append(f"{len(producers)} process{'es' if len(producers) != 1 else ''} attached to it (pid {pids})")
    return " and ".join(said) or None


#: The request-timeout driver's subcommand.
TIMEOUTS = "timeouts"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shmwheel", description="A timing wheel in POSIX shared memory.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(
        name: str, func: Callable[[argparse.Namespace], int], help: str, named: bool = True
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help[0].upper() + help[1:] + ".")
        if named:
            p.add_argument("name", metavar="NAME", help="the wheel's name: its segment is /dev/shm/NAME")
        p.set_defaults(func=func)
        return p

    def watched(p: argparse.ArgumentParser, json_help: str, interval_help: str) -> None:
        """--json, and --watch every --interval until Ctrl-C or SIGTERM."""
        p.add_argument("--json", action="store_true", help=json_help)
        p.add_argument("--watch", action="store_true", help="again every interval until Ctrl-C or SIGTERM")
        p.add_argument("--interval", type=_positive, default=1.0, metavar="SECONDS", help=interval_help)

    demo = command("demo", _demo, "run worker processes with per-request timeouts and show the fires", named=False)
    # Each worker takes an id in the segment's producer table; the demo and its driver take two more.
    workers = _int_between(1, lib.SHMW_MAX_PRODUCERS - 2)
    demo.add_argument("--workers", type=workers, default=3, metavar="N", help="worker processes (default 3)")
    demo.add_argument("--duration", type=_positive, default=5.0, help="seconds to run (default 5)")

    p = command("create", _create, "create a wheel's segment and leave it in /dev/shm")
    capacity = _int_between(*CAPACITIES)
    p.add_argument("--capacity", type=capacity, required=True, metavar="N", help="timers that can be pending at once")
    tick = _option(_seconds, not_a_tick)
    p.add_argument("--tick", type=tick, default=0.001, metavar="SECONDS", help="resolution (default 0.001)")
    payload = _int_between(*PAYLOAD_SIZES)
    p.add_argument(
        "--payload-size", type=payload, default=64, metavar="N", help="bytes of payload a timer (default 64)"
    )
    p.add_argument(
        "--reserve",
        type=_int_between(0, CAPACITIES[1] - 1),
        default=0,
        metavar="N",
        help="of the slots, those kept for reserved adds (default 0)",
    )
    p.add_argument(
        "--shards",
        type=_int_between(1, lib.SHMW_MAX_SHARDS),
        default=1,
        metavar="N",
        help="wheels of their own, each with its own lock: one a busy producer process, up to the CPUs (default 1)",
    )
    p.add_argument("--mode", type=_octal, default=0o600, metavar="OCTAL", help="permissions (default 600)")
    p.add_argument(
        "--wheel-size",
        type=_option(_int, not_a_wheel_size),
        default=256,
        metavar="N",
        help="buckets a level, a power of two (256)",
    )

    p = command("driver", _driver, "drive a wheel: advance its clock and run a handler for each fire")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--handler",
        metavar="MODULE:FUNCTION",
        help="call this function with each fire; MODULE is looked for in the current directory first, "
        "as python -m and uvicorn do",
    )
    how.add_argument("--jsonl", action="store_true", help="print each fire as a line of JSON")

    p = command(
        "stat",
        _stat,
        "show a wheel's state and its add/cancel/fire rates; it samples the wheel twice, "
        "--interval apart, so it takes that long",
    )
    watched(p, "print one JSON object (one a line with --watch)", "sampling interval (default 1)")

    # Parsed by the command itself (shmwheel.contrib.timeouts), which main() hands the rest of the line.
    sub.add_parser(
        TIMEOUTS,
        add_help=False,
        help="drive a request-timeout wheel: log the requests that time out, have their workers write their "
        "stacks, and kill the workers if asked (shmwheel timeouts --help)",
    )

    p = command(
        "requests",
        _requests,
        "list the requests in flight on a request-timeout wheel, oldest first: their age, timeout and stage "
        "(running, warned, timed out, interrupted, being killed), worker, thread or task, request id and path",
    )
    watched(
        p,
        "print a JSON array of objects (one array a line with --watch), with the keys request_id, method, path, "
        "worker_pid, thread, task, age_s, timeout_s and stage",
        "of --watch, which redraws the list as top does (default 1)",
    )
    p.add_argument(
        "--older-than", type=_seconds, default=0.0, metavar="SECONDS", help="only requests running this long or longer"
    )
    p.add_argument("--worker", type=_int_between(1, 2**31 - 1), metavar="PID", help="only this worker's requests")

    p = command(
        "stack",
        _stack,
        "print the stack of a request in flight, now, as its worker writes it at a timeout (its thread's, its "
        "task's or its greenlet's), and leave the request as it is; only the wheel's owner or root may",
    )
    p.add_argument("request_id", metavar="REQUEST_ID", help="the request, as shmwheel requests lists it")
    p.add_argument(
        "--wait",
        type=_positive,
        default=2.0,
        metavar="SECONDS",
        help="how long the worker has to write it (default 2): one that does not runs no Python (a C call that "
        "holds the GIL)",
    )
    p = command(
        "end",
        _end,
        "end a request in flight as its timeout would: its worker ends it at a safe point and its client gets a 504; "
        "the driver says so in the server's log.  Exit status 0: it ended; 3: it has not ended within its "
        "interrupt_grace, and runs on; 4: its worker was killed (--kill).  Only the wheel's owner or root may",
    )
    p.add_argument("request_id", metavar="REQUEST_ID", help="the request, as shmwheel requests lists it")
    p.add_argument(
        "--kill",
        action="store_true",
        help="if it has not ended within its grace, go on to its worker's kill stage, as the timeout would with "
        "kill: kill_signal, then SIGKILL (also for a request past its timeout already, or whose worker does not "
        "interrupt requests)",
    )

    command(
        "metrics",
        _metrics_text,
        "print a request-timeout wheel's metrics once, in Prometheus's text format, as its driver serves them "
        "(for node_exporter's textfile collector)",
    )

    p = command("ls", _ls, "list the shmwheel segments in /dev/shm", named=False)
    p.add_argument("--json", action="store_true", help="print a JSON array")

    command("check", _check, "check a wheel's invariants")
    p = command("unlink", _unlink, "remove a wheel's segment")
    p.add_argument("--force", action="store_true", help="even while its driver runs or processes are attached")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [TIMEOUTS]:
        from .contrib.timeouts import main as timeouts

        return timeouts(argv[1:], prog=f"shmwheel {TIMEOUTS}")
    args = _parser().parse_args(argv)
    try:
        status = int(args.func(args))
        sys.stdout.flush()  # a reader that went away shows here, not at exit
        return status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `shmwheel ls | head -1`: stop quietly, as a tool killed by SIGPIPE
        # does, and keep the interpreter from flushing into the pipe at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (ShmwheelError, OSError, ValueError, TypeError) as exc:
        print(f"shmwheel: {one_line(exc)}", file=sys.stderr)
        return 1
