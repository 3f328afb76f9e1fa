"""The request-timeout driver's metrics, in Prometheus's text format.

What the driver counts (timeouts, warnings, interrupts and what came of
them, kills, how late it handled each fire) it keeps in the wheel's own
counters (:meth:`shmwheel.Wheel.count`), not in its memory: one driver
sees every request on the host, so there is nothing to add up across
processes (prometheus_client's multiprocess mode and its files of dead
workers), a driver restarted or taken over counts on from where the last
one was, and anyone who can read the wheel can print them
(``shmwheel metrics NAME``) with the gauges read from it at that moment:
the requests in flight (:mod:`shmwheel.contrib._inflight`), the wheel's
pending timers and capacity.  The driver serves the same text on
``/metrics`` (:class:`MetricsServer`) when given an address.

prometheus_client is not used: its registry holds a process's own
numbers, and these are the segment's; the text format is a few lines to
write, and the driver process imports nothing it does not need.

A route label, where the application has timeouts by route (a mapping):
each request is counted under the route that gives it its timeout, by
the same rule (:func:`~shmwheel.contrib._routes.compile_routes`), and
under ``other`` if none does: never its raw path, whose values a client
chooses.  The routes are written in the wheel's note, so that a reader
labels the counters as the driver counted them.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import http.server
import json
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .._errors import ShmwheelError, one_line
from .._wheel import COUNTERS, Wheel, observe
from ._inflight import read
from ._record import RequestRecord, signal_name
from ._routes import compile_routes
from ._settings import TimeoutActions, metrics_address

__all__ = ["Counts", "MetricsServer", "driver_note", "render", "serve_metrics"]

_log = logging.getLogger("shmwheel.timeouts")

#: Routes counted apart: route 0 is every request no labelled route
#: covers, routes 1 to ROUTES - 1 the first routes of the note.
ROUTES = 17
# The counters' places in the wheel's counters.
TIMEOUTS = 0  # + route
WARNINGS = TIMEOUTS + ROUTES  # + route
OUTCOMES = ("ended", "ran_on", "killed")  # of an interrupt: ended within its grace, ran on (kill off), killed
INTERRUPTED = WARNINGS + ROUTES  # + the outcome's place in OUTCOMES
KILL_SIGNAL = INTERRUPTED + len(OUTCOMES)  # kill_signal sent to a worker
SIGKILL = KILL_SIGNAL + 1
#: Upper bounds, in seconds, of the buckets of how late the driver handled
#: a fire after its deadline (and +Inf).
LATENESS_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LATENESS = SIGKILL + 1  # + bucket
LATENESS_NS = LATENESS + len(LATENESS_BOUNDS) + 1  # their sum, ns
BY_HAND = LATENESS_NS + 1  # requests an operator ended (shmwheel end)
assert BY_HAND < COUNTERS


class Counts:
    """What the driver of one wheel counts, into the wheel's counters.

    Made with the driver's actions, it writes the note that says what the
    counters are of (the routes, the kill signal), if the wheel does not
    hold that note already."""

    def __init__(self, wheel: Wheel, actions: TimeoutActions) -> None:
        self._wheel = wheel
        routes = actions.routes[: ROUTES - 1]
        self._lookup = compile_routes({key: place for place, key in enumerate(routes, 1)}, 0) if routes else None
        note = json.dumps(
            {
                "routes": list(routes),
                "kill_signal": signal_name(actions.kill_signal),
                "kill": actions.kill,
                "kill_after": actions.kill_after,
                "interrupt_grace": actions.interrupt_grace,
            }
        ).encode()
        with contextlib.suppress(ShmwheelError):
            if wheel.note != note:
                wheel.set_note(note)

    def route(self, record: RequestRecord) -> int:
        """The place of the route that gives ``record``'s request its timeout (0: none labelled)."""
        if self._lookup is None:
            return 0
        return (self._lookup(record.method, record.path) or 0) // 1_000_000_000

    def timeout(self, record: RequestRecord) -> None:
        self._add(TIMEOUTS + self.route(record))

    def warning(self, record: RequestRecord) -> None:
        self._add(WARNINGS + self.route(record))

    def interrupted(self, outcome: str) -> None:
        self._add(INTERRUPTED + OUTCOMES.index(outcome))

    def ended_by_hand(self) -> None:
        self._add(BY_HAND)

    def kill(self, sigkill: bool = False) -> None:
        self._add(SIGKILL if sigkill else KILL_SIGNAL)

    def lateness(self, ns: int) -> None:
        """A fire handled ``ns`` after its deadline."""
        ns = max(ns, 0)
        self._add(LATENESS + bisect.bisect_left(LATENESS_BOUNDS, ns / 1e9))
        self._add(LATENESS_NS, ns)

    def _add(self, counter: int, n: int = 1) -> None:
        try:
            self._wheel.count(counter, n)
        except ShmwheelError:
            pass  # the wheel is gone or replaced: its counts with it


def driver_note(wheel: Wheel) -> dict[str, Any]:
    """What the wheel's driver wrote in its note (:class:`Counts`): the
    routes it counts by, and its kill signal, kill, kill_after and
    interrupt_grace; empty if it wrote none (or it was scribbled on)."""
    try:
        note = json.loads(wheel.note or b"{}")
    except ValueError:
        return {}
    return note if isinstance(note, dict) else {}


def _note(wheel: Wheel) -> tuple[list[str], str]:
    """The routes and the kill signal the wheel's driver counts by, from its note."""
    note = driver_note(wheel)
    routes = note.get("routes")
    routes = [str(route) for route in routes][: ROUTES - 1] if isinstance(routes, list) else []
    return routes, str(note.get("kill_signal", "kill_signal"))


def _value(text: str) -> str:
    """A label's value as the text format writes it."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    return "{" + ",".join(f'{key}="{_value(value)}"' for key, value in pairs) + "}"


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


class _Text:
    def __init__(self, wheel: str) -> None:
        self.wheel = wheel
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help: str, samples: Sequence[tuple[dict[str, str], float]]) -> None:
        self.lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
        for labels, value in samples:
            self.lines.append(f"{name}{_labels([('wheel', self.wheel), *labels.items()])} {_number(value)}")


def render(wheel: Wheel) -> str:
    """The metrics of the wheel, in Prometheus's text format (version 0.0.4)."""
    stats = wheel.stats()
    counters = wheel.counters()
    found = read(wheel)
    routes, kill_signal = _note(wheel)
    lookup = compile_routes({key: place for place, key in enumerate(routes, 1)}, 0) if routes else None
    by_route = [0] * ROUTES
    for request in found.requests:
        r = request.record
        by_route[(lookup(r.method, r.path) or 0) // 1_000_000_000 if lookup else 0] += 1

    def per_route(values: Sequence[int]) -> Sequence[tuple[dict[str, str], float]]:
        if not routes:
            return [({}, values[0])]
        return [({"route": key}, values[place]) for place, key in enumerate(routes, 1)] + [
            ({"route": "other"}, values[0])
        ]

    text = _Text(wheel.name)
    text.family("shmwheel_requests_in_flight", "gauge", "Requests in flight.", per_route(by_route))
    text.family(
        "shmwheel_requests_past_timeout", "gauge", "Requests past their timeout that still run.", [({}, found.late)]
    )
    oldest = found.requests[0].age(found.now_ns) if found.requests else 0.0
    text.family(
        "shmwheel_oldest_request_age_seconds", "gauge", "How long the oldest request in flight has run.", [({}, oldest)]
    )
    text.family(
        "shmwheel_request_timeouts_total",
        "counter",
        "Requests that reached their timeout.",
        per_route(counters[TIMEOUTS : TIMEOUTS + ROUTES]),
    )
    text.family(
        "shmwheel_request_warnings_total",
        "counter",
        "Requests that reached their warn_after stage.",
        per_route(counters[WARNINGS : WARNINGS + ROUTES]),
    )
    text.family(
        "shmwheel_requests_interrupted_total",
        "counter",
        "Requests asked to end at their timeout, by what came of it: ended within the grace, ran on, killed.",
        [({"outcome": outcome}, counters[INTERRUPTED + place]) for place, outcome in enumerate(OUTCOMES)],
    )
    text.family(
        "shmwheel_requests_ended_by_hand_total",
        "counter",
        "Requests an operator ended (shmwheel end).",
        [({}, counters[BY_HAND])],
    )
    kills = [({"signal": kill_signal}, counters[KILL_SIGNAL])]
    if kill_signal == "SIGKILL":
        kills = [({"signal": "SIGKILL"}, counters[KILL_SIGNAL] + counters[SIGKILL])]
    else:
        kills.append(({"signal": "SIGKILL"}, counters[SIGKILL]))
    text.family("shmwheel_worker_kills_total", "counter", "Signals sent to end a worker.", kills)
    text.family("shmwheel_wheel_pending", "gauge", "Timers pending in the wheel.", [({}, stats.pending)])
    text.family("shmwheel_wheel_capacity", "gauge", "Timers the wheel can hold.", [({}, stats.capacity)])
    running = stats.driver_pid is not None and stats.driver_state == "running"
    text.family("shmwheel_driver_running", "gauge", "Whether a driver runs on the wheel.", [({}, int(running))])
    name = "shmwheel_driver_lateness_seconds"
    text.lines += [
        f"# HELP {name} How late after its deadline the driver handled each fire.",
        f"# TYPE {name} histogram",
    ]
    total = 0
    base = [("wheel", wheel.name)]
    for place, bound in enumerate((*LATENESS_BOUNDS, float("inf"))):
        total += counters[LATENESS + place]
        le = "+Inf" if bound == float("inf") else repr(bound)
        text.lines.append(f"{name}_bucket{_labels([*base, ('le', le)])} {total}")
    text.lines.append(f"{name}_sum{_labels(base)} {_number(counters[LATENESS_NS] / 1e9)}")
    text.lines.append(f"{name}_count{_labels(base)} {total}")
    return "\n".join(text.lines) + "\n"


def serve_metrics(name: str, actions: TimeoutActions) -> MetricsServer | None:
    """The driver's metrics of wheel ``name``, served from now on where
    ``actions`` say, if they say."""
    if actions.metrics is None:
        return None
    server = MetricsServer(name, *metrics_address(actions.metrics))
    server.start()
    return server


class MetricsServer:
    """``/metrics`` of one wheel over HTTP, from a thread of the driver's
    process.  An address in use (a driver that takes over from one that
    still holds it) is tried again every second until it is free, said
    once; any other failure to listen is said, and the driver drives on
    without metrics."""

    RETRY = 1.0

    def __init__(self, name: str, host: str, port: int) -> None:
        self.name = name
        self.address = (host, port)
        self._server: http.server.ThreadingHTTPServer | None = None
        self._stopped = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._serve, name="shmwheel-metrics", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.shutdown()

    def _serve(self) -> None:
        said = False
        where = f"{self.address[0]}:{self.address[1]}"
        while not self._stopped.is_set():
            try:
                server = http.server.ThreadingHTTPServer(self.address, _handler_for(self.name))
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    _log.error("metrics of wheel %r: cannot listen on %s: %s; none are served", self.name, where,
                               one_line(exc))  # fmt: skip
                    return
                if not said:
                    _log.warning("metrics of wheel %r: %s is in use; trying again every %g s", self.name, where,
                                 self.RETRY)  # fmt: skip
                    said = True
                time.sleep(self.RETRY)
                continue
            server.daemon_threads = True
            self._server = server
            host, port = server.server_address[:2]
            _log.info("metrics of wheel %r: serving http://%s:%d/metrics", self.name, host, port)
            server.serve_forever()
            server.server_close()
            return


def _handler_for(name: str) -> type[http.server.BaseHTTPRequestHandler]:
    wheels: list[Wheel] = []
    lock = threading.Lock()

    class Metrics(http.server.BaseHTTPRequestHandler):
        server_version = "shmwheel"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] != "/metrics":
                self._answer(404, b"not found: the metrics are at /metrics\n")
                return
            try:
                with lock:
                    if not wheels:
                        wheels.append(observe(name))
                    body = render(wheels[0]).encode()
            except ShmwheelError as exc:
                self._answer(503, f"wheel {name!r}: {one_line(exc)}\n".encode())
                return
            self._answer(200, body, "text/plain; version=0.0.4; charset=utf-8")

        def _answer(self, status: int, body: bytes, kind: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # a scrape every few seconds is no news for the server's log

    return Metrics
