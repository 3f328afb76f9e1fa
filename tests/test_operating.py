"""Operating it: the requests in flight as ``shmwheel requests``, ``stat``
and ``ls`` show them, read from the wheel's timers; first from timers made
here, then under real servers with requests stuck in them."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _servers import (
    APPS,
    BIN,
    GATEWAY_TIMEOUT,
    WAIT,
    Server,
    assert_nothing_left,
    assert_nothing_left_of_asgi,
    auto_driver_of,
    booted,
    free_port,
    get,
    gunicorn_app,
    pid_of,
    serve,
    serve_asgi,
    stopped_cleanly,
    uwsgi_ini,
)
from conftest import entry, put_in_flight, wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_privileges import Child, as_root
from test_wire import assert_whole_504, exchange

import shmwheel
from shmwheel._process import start_time
from shmwheel._results import Timer
from shmwheel._segment import SHM
from shmwheel.contrib import PAYLOAD_SIZE, RequestTimer
from shmwheel.contrib._inflight import in_flight, read
from shmwheel.contrib._metrics import OUTCOMES, Counts, MetricsServer, render
from shmwheel.contrib._record import (
    KIND_CHECK,
    KIND_END,
    KIND_FINISHED,
    KIND_GRACE,
    KIND_KILL,
    KIND_REQUEST,
    KIND_TIMEOUT,
    RequestRecord,
    decode_request,
    encode_request,
    with_kind,
)
from shmwheel.contrib._settings import TimeoutActions, TimeoutSettings, metrics_address

MakeWheel = Callable[..., shmwheel.Wheel]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parsed(text: str) -> Samples:
    """The samples of Prometheus text, read with its reference parser (which rejects what is not the format)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float:
    (value,) = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    return value


WORKER, START, DRIVER = 4242, 777, 99


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shmwheel", *args], capture_output=True, text=True, timeout=30)


# -- Wheel.timers(): what the listing reads -------------------------------------------


def test_timers_lists_each_timer_pending_or_in_flight_once_across_shards_and_nothing_else(
    make_wheel: MakeWheel,
) -> None:
    """More timers than one look under a lock takes, spilled over two of
    four shards (a shard holds 512): each pending one once with its payload
    and owner, each in flight once with when it fired; a cancelled one and
    an acknowledged one are gone, and an entry scribbled on is left out."""
    w = make_wheel(capacity=2048, shards=4)
    later = {w.add(60, b"later %d" % i): b"later %d" % i for i in range(700)}
    due = {w.add(0, b"due %d" % i): b"due %d" % i for i in range(5)}
    put_in_flight(w, 5)
    cancelled = next(iter(later))
    assert w.cancel(cancelled)
    del later[cancelled]
    acknowledged = next(iter(due))
    assert w.acknowledge([acknowledged]) == 1
    del due[acknowledged]
    timers = w.timers()
    assert len(timers) == len({t.handle for t in timers}) == len(later) + len(due)
    seen = {t.handle: t for t in timers}
    for handle, payload in later.items():
        t = seen[handle]
        assert (t.payload, t.owner_pid, t.fired, t.fired_at_ns) == (payload, os.getpid(), False, 0)
    for handle, payload in due.items():
        t = seen[handle]
        assert (t.payload, t.fired) == (payload, True) and t.fired_at_ns >= t.deadline_ns
    scribbled = next(iter(later)) & ((1 << shmwheel._binding.lib.shmw_index_bits(w.capacity)) - 1)
    entry(w, scribbled).payload_len = 10_000  # more than an entry holds
    assert len(w.timers()) == len(timers) - 1
    assert w.repair() is not None  # the scribble is the audit's to quarantine


def test_timers_sees_each_timer_that_stays_once_while_others_come_and_go(make_wheel: MakeWheel) -> None:
    """Another process adds and cancels timers as fast as it can, all over
    the slab, while this one reads the wheel again and again: each read
    has every timer that stayed pending throughout, once."""
    w = make_wheel(capacity=4096, shards=2)
    stay = {w.add(600, b"stays %d" % i) for i in range(300)}
    churn = subprocess.Popen([sys.executable, "-c", CHURN, w.name])
    try:
        wait_for(lambda: w.stats().added > len(stay) + 5000)  # it churns
        reads, churned = 0, w.stats().added
        while reads < 20 or w.stats().added < churned + 20_000:  # reads while it churns some more
            seen = [t.handle for t in w.timers()]
            assert len(seen) == len(set(seen))
            assert stay <= set(seen)
            reads += 1
        assert churn.poll() is None, "the churn ended early: it did not run throughout"
    finally:
        churn.kill()
        churn.wait()
    assert len(w.timers()) >= len(stay)


CHURN = """
import sys, shmwheel
with shmwheel.attach(sys.argv[1]) as w:
    while True:
        handles = w.add_many([600.0] * 500)
        w.cancel_many(handles)
"""


# -- the stages, from the timers of one request ----------------------------------------


def record(kind: int = KIND_REQUEST, started_ns: int = 1_000_000_000, **kw: object) -> bytes:
    kw.setdefault("timeout_ms", 1000)
    return encode_request(kind, WORKER, START, started_ns, "GET", "req-1", "/slow", thread=7, **kw)  # type: ignore[arg-type]


def timer(payload: bytes, *, fired: bool = False, owner: int = WORKER, deadline_ns: int = 2_000_000_000) -> Timer:
    return Timer(hash(payload) & 0xFFFF, deadline_ns, payload, owner, fired, deadline_ns if fired else 0)


NOW = 3_500_000_000  # 2.5 s after the request started


@pytest.mark.parametrize(
    ("timers", "stage"),
    [
        ([timer(record())], "running"),
        ([timer(record(warn=True), fired=True), timer(with_kind(record(warn=True), KIND_TIMEOUT), owner=DRIVER)],
         "warned"),
        ([timer(record(), fired=True), timer(with_kind(record(), KIND_CHECK), owner=DRIVER)], "timed out"),
        ([timer(record(), fired=True)], "timed out"),  # its stages over, running on (kill off)
        ([timer(record(interrupt=True), fired=True), timer(with_kind(record(interrupt=True), KIND_GRACE),
                                                          owner=DRIVER)], "interrupted"),
        ([timer(record(interrupt=True), fired=True)], "interrupted"),  # past its grace, running on
        ([timer(record(), fired=True), timer(with_kind(record(), KIND_KILL), owner=DRIVER)], "being killed"),
    ],
)  # fmt: skip
def test_a_requests_stage_is_read_from_its_own_timer_and_the_drivers_follow_ups(
    timers: list[Timer], stage: str
) -> None:
    found = in_flight(timers, NOW)
    (request,) = found.requests
    assert request.stage == stage
    assert (request.record.request_id, request.record.path, request.record.pid) == ("req-1", "/slow", WORKER)
    assert request.age(NOW) == 2.5 and request.timeout() == 1.0
    assert request.as_dict(NOW) == {
        "request_id": "req-1",
        "method": "GET",
        "path": "/slow",
        "truncated": False,
        "worker_pid": WORKER,
        "thread": 7,
        "task": 0,
        "task_kind": "",
        "age_s": 2.5,
        "timeout_s": 1.0,
        "stage": stage,
    }


def test_what_is_not_a_request_in_flight_is_not_listed() -> None:
    """A request whose worker has said it finished; a record in a timer
    that the worker it names did not add; a follow-up of a request whose
    own timer is not there; a worker not among those that count; and a
    timer that carries no record at all."""
    finished = [timer(record(), fired=True), timer(with_kind(record(), KIND_FINISHED))]
    assert in_flight(finished, NOW).requests == []
    # Its worker has freed its fire as it ended, and the driver's follow-up has yet to come.
    assert in_flight([timer(with_kind(record(), KIND_GRACE), owner=DRIVER)], NOW).requests == []
    assert in_flight([timer(record(), owner=WORKER + 1)], NOW).requests == []
    assert in_flight([timer(with_kind(record(), KIND_KILL), owner=WORKER + 1)], NOW).requests == []
    assert in_flight([timer(record())], NOW, workers={(WORKER, START + 1)}).requests == []
    found = in_flight([timer(b"not a record")], NOW)
    assert (found.requests, found.others) == ([], 1)


def test_requests_are_listed_oldest_first_with_the_timeout_their_newest_timer_says() -> None:
    """Two requests; the older one was given more time (extend()) after its
    warn_after stage fired: its new timer's record says its timeout."""
    old, young = 500_000_000, 2_000_000_000
    extended = timer(record(started_ns=old, timeout_ms=9000), deadline_ns=old + 9_000_000_000)
    timers = [timer(record(started_ns=young)), timer(record(started_ns=old, warn=True), fired=True), extended]
    found = in_flight(timers, NOW)
    assert [(r.record.started_ns, r.stage, r.timeout()) for r in found.requests] == [
        (old, "running", 9.0),
        (young, "running", 1.0),
    ]
    assert found.pending_requests == 2 and found.late == 0


# -- under real servers -------------------------------------------------------------------


def listed(server: Server) -> dict[str, dict[str, object]]:
    """``shmwheel requests NAME --json``, by request id."""
    proc = cli("requests", server.wheel, "--json")
    assert proc.returncode == 0 and proc.stderr == "", proc
    return {r["request_id"]: r for r in json.loads(proc.stdout)}


def wait_listed(server: Server, request_id: str, stage: str | None) -> dict[str, object] | None:
    """The request as listed once it is at ``stage`` (None: once it is not listed any more)."""
    give_up = time.monotonic() + WAIT
    while True:
        found = listed(server).get(request_id)
        if (found is None) if stage is None else (found is not None and found["stage"] == stage):
            return found
        assert time.monotonic() < give_up, f"{request_id} never came to be {stage or 'gone'}: {found}"
        time.sleep(0.05)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as executor:
        yield executor


# The apps' stream, given a minute more before each chunk.  The requests
# beside it run as long (HELD s), so that both are still in flight after
# the tests' dozen commands on a slow machine.
HELD = 10
STREAMING = f"/stream?chunks={2 * HELD}&every=0.5&extend=60"


def uvicorn_cmd(port: int) -> list[str]:
    """Uvicorn, one worker, serving tests/apps/asgi_stuck.py's ``interrupting``."""
    return [str(BIN / "uvicorn"), "asgi_stuck:interrupting", "--app-dir", str(APPS), "--host", "127.0.0.1",
            "--port", str(port), "--workers", "1"]  # fmt: skip


def metrics_of(server: Server) -> Callable[[], Samples]:
    """A scrape of the driver's /metrics, at the port its log says it got (it was given port 0)."""
    port = int(server.wait_for(r"metrics of wheel '.*': serving http://127\.0\.0\.1:(\d+)/metrics").group(1))

    def scrape() -> Samples:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return parsed(response.read().decode())

    return scrape


def running_on_interrupted(server: Server, path: str, request_id: str) -> re.Match[str]:
    """The driver's line: the interrupted request has not ended within its grace, and runs on (kill off)."""
    return server.wait_for(
        rf"GET {re.escape(path)} \(request {request_id}, worker pid (\d+), thread 0x([0-9a-f]{{16}})(?:, task 0x"
        r"([0-9a-f]+))?\) has not ended 0\.5 s after it was interrupted: .*; it runs on \(kill is off\)$"
    )


def test_gthread_requests_and_metrics_show_a_request_past_its_timeout_and_a_running_one_until_each_ends(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """A request stuck in a C sleep, interrupted, runs on past its grace
    (kill off): it is listed as interrupted, with its path, worker,
    thread, age and timeout, beside a streaming request that extend()
    keeps running; the filters pick them; ``stat`` and ``ls`` count them.
    Once it ends (its client gets the 504) it is gone from the list.
    (Before, a request whose stages were over had nothing in the wheel.)
    The driver's /metrics moves with them: a request interrupted and ended
    in time beside it, the timeouts by route, the requests in flight."""
    port = free_port()
    stages = (
        "timeout=1.0, interrupt=True, interrupt_grace=0.5, kill=False, metrics='127.0.0.1:0', routes={'/c-sleep': 1.0}"
    )
    cmd = gunicorn_app(tmp_path, port, "gthread", "--workers", "1", "--threads", "4", install=stages)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        scrape = metrics_of(server)
        before = scrape()
        assert sample(before, "shmwheel_requests_in_flight", route="/c-sleep") == 0
        assert sample(before, "shmwheel_request_timeouts_total", route="/c-sleep") == 0
        stuck = pool.submit(get, port, f"/c-sleep?s={HELD}", WAIT, "stuck-c-sleep")
        streaming = pool.submit(get, port, STREAMING, WAIT, "streaming")
        assert get(port, f"/spin?s={WAIT}", WAIT, "spun") == GATEWAY_TIMEOUT
        line = running_on_interrupted(server, "/c-sleep", "stuck-c-sleep")
        server.wait_for(r"GET /spin \(request spun, .*\) ended [\d.]+ s after it was interrupted$")
        during = scrape()
        assert sample(during, "shmwheel_requests_in_flight", route="/c-sleep") == 1
        assert sample(during, "shmwheel_requests_in_flight", route="other") == 1  # the stream
        assert sample(during, "shmwheel_requests_past_timeout") == 1
        assert sample(during, "shmwheel_oldest_request_age_seconds") >= 1.5
        assert sample(during, "shmwheel_request_timeouts_total", route="/c-sleep") == 1
        assert sample(during, "shmwheel_request_timeouts_total", route="other") == 1  # the spin
        interrupted = {o: sample(during, "shmwheel_requests_interrupted_total", outcome=o) for o in OUTCOMES}
        assert interrupted == {"ended": 1, "ran_on": 1, "killed": 0}
        assert sample(during, "shmwheel_driver_running") == 1
        assert sample(during, "shmwheel_driver_lateness_seconds_count") >= 2
        pid, thread = int(line[1]), int(line[2], 16)
        requests = listed(server)
        assert set(requests) == {"stuck-c-sleep", "streaming"}, requests
        s, r = requests["stuck-c-sleep"], requests["streaming"]
        assert (s["stage"], s["method"], s["path"], s["worker_pid"], s["thread"], s["task"], s["timeout_s"]) == (
            "interrupted", "GET", "/c-sleep", pid, thread, 0, 1.0,
        )  # fmt: skip
        assert isinstance(s["age_s"], float) and s["age_s"] >= 1.5
        assert (r["stage"], r["path"], r["worker_pid"]) == ("running", "/stream", pid)
        assert isinstance(r["timeout_s"], float) and r["timeout_s"] > 30

        rows = cli("requests", server.wheel).stdout.splitlines()
        assert rows[0].split() == ["AGE", "TIMEOUT", "STAGE", "PID", "THREAD", "TASK", "REQUEST", "ID", "REQUEST"]
        assert any(
            re.fullmatch(rf" *[\d.]+ s +1 s +interrupted +{pid} +0x{thread:x} +- +stuck-c-sleep +GET /c-sleep", row)
            for row in rows
        ), rows
        assert json.loads(cli("requests", server.wheel, "--json", "--older-than", "600").stdout) == []
        assert json.loads(cli("requests", server.wheel, "--json", "--worker", str(pid + 1)).stdout) == []
        assert len(json.loads(cli("requests", server.wheel, "--json", "--worker", str(pid)).stdout)) == 2
        stat = json.loads(cli("stat", server.wheel, "--json", "--interval", "0.1").stdout)
        assert (stat["requests_in_flight"], stat["requests_late"]) == (2, 1), stat
        (seg,) = [s for s in json.loads(cli("ls", "--json").stdout) if s["name"] == server.wheel]
        assert seg["requests"] == 2

        assert stuck.result() == GATEWAY_TIMEOUT
        server.wait_for(r"GET /c-sleep \(request stuck-c-sleep, .*\) ended [\d.]+ s after it was interrupted$")
        wait_listed(server, "stuck-c-sleep", None)
        assert streaming.result()[0] == 200
        wait_listed(server, "streaming", None)
        after = scrape()
        assert sample(after, "shmwheel_requests_in_flight", route="/c-sleep") == 0
        assert sample(after, "shmwheel_requests_past_timeout") == 0
        assert sample(after, "shmwheel_request_timeouts_total", route="/c-sleep") == 1


def test_gthread_a_request_whose_worker_is_being_killed_is_listed_so_until_its_worker_is_gone(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """Kill on: between kill_signal and the SIGKILL kill_after later, the
    stuck request is listed as being killed; once its worker is gone, it
    is not listed, and a new worker serves."""
    port = free_port()
    stages = "timeout=1.0, kill=True, kill_after=3"
    cmd = gunicorn_app(tmp_path, port, "gthread", "--workers", "1", "--threads", "2", install=stages)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        doomed = pool.submit(get, port, "/c-sleep?s=30", WAIT, "doomed")
        request = wait_listed(server, "doomed", "being killed")
        assert request is not None
        pid = request["worker_pid"]
        server.wait_for(rf"killed worker pid {pid} with SIGKILL")
        wait_listed(server, "doomed", None)
        assert doomed.result()[0] in (0, 502)  # the connection dies with the worker
        assert get(port, "/")[0] == 200


def test_uwsgi_requests_and_metrics_show_a_request_that_runs_on_past_its_timeout_until_it_finishes(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """uWSGI, no interrupt and kill off: once its stack is written the
    request's stages are over, and it runs on; it is listed as timed out
    until it finishes, which the driver says.  (Before, it was in the
    wheel no more, and its end was never said.)"""
    port = free_port()
    options = {"shmwheel-timeout": "1", "shmwheel-kill": "false", "shmwheel-metrics": "127.0.0.1:0"}
    ini = uwsgi_ini(tmp_path, port, **options)
    with serve([str(BIN / "uwsgi"), "--ini", str(ini)], port, tmp_path, "uwsgi") as server:
        server.wait_for(r"driver \d+: running on wheel 'uwsgi-\d+'")
        scrape = metrics_of(server)
        slow = pool.submit(get, port, "/sleep?s=4", WAIT, "uwsgi-slow")
        server.wait_for(r"shmwheel: the stack of timed-out request GET /sleep \(request uwsgi-slow, ")
        time.sleep(0.6)  # past the check of the stack: the stages are over
        request = listed(server)["uwsgi-slow"]
        assert (request["stage"], request["path"], request["timeout_s"]) == ("timed out", "/sleep", 1.0)
        during = scrape()
        assert sample(during, "shmwheel_requests_in_flight") == sample(during, "shmwheel_requests_past_timeout") == 1
        assert sample(during, "shmwheel_request_timeouts_total") == 1
        assert slow.result()[0] == 200
        server.wait_for(r"GET /sleep \(request uwsgi-slow, .*\) finished [\d.]+ s after it timed out$")
        wait_listed(server, "uwsgi-slow", None)
        assert sample(scrape(), "shmwheel_requests_in_flight") == 0
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left(server)


def test_uvicorn_requests_and_metrics_show_a_task_that_runs_on_with_its_task_until_it_ends(
    tmp_path: Path, pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uvicorn, the ASGI middleware: a task waiting for its thread runs on
    past its interrupt's grace, listed as interrupted with its task, beside
    a stream that runs; once the thread is back it ends, and is gone."""
    port = free_port()
    cmd = uvicorn_cmd(port)
    monkeypatch.setenv("SHMWHEEL_TEST_METRICS", "127.0.0.1:0")  # the app's middleware's metrics=
    with serve_asgi(cmd, port, tmp_path) as server:
        driver = auto_driver_of(server)
        scrape = metrics_of(server)
        waiting = pool.submit(get, port, f"/thread-then-await?s={HELD}", WAIT, "asgi-waits")
        streaming = pool.submit(get, port, STREAMING, WAIT, "asgi-streaming")
        line = running_on_interrupted(server, "/thread-then-await", "asgi-waits")
        requests = listed(server)
        w, r = requests["asgi-waits"], requests["asgi-streaming"]
        assert (w["stage"], w["path"], w["worker_pid"], w["task_kind"]) == (
            "interrupted", "/thread-then-await", int(line[1]), "task",
        )  # fmt: skip
        assert w["task"] == int(line[3], 16) and w["thread"] == int(line[2], 16)
        assert (r["stage"], r["path"]) == ("running", "/stream")
        during = scrape()
        assert (sample(during, "shmwheel_requests_in_flight"), sample(during, "shmwheel_requests_past_timeout")) == (
            2,
            1,
        )
        assert sample(during, "shmwheel_request_timeouts_total") == 1
        assert waiting.result() == GATEWAY_TIMEOUT
        server.wait_for(r"GET /thread-then-await \(request asgi-waits, .*\) ended [\d.]+ s after it was interrupted$")
        wait_listed(server, "asgi-waits", None)
        assert streaming.result()[0] == 200
        assert sample(scrape(), "shmwheel_requests_interrupted_total", outcome="ran_on") == 1
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left_of_asgi(server, driver)


# -- metrics ------------------------------------------------------------------------------


def test_the_metrics_count_by_route_and_read_the_requests_in_flight_from_the_wheel(make_wheel: MakeWheel) -> None:
    """What a driver counts goes into the wheel; anyone reads it back as the
    same text, labelled with the routes its note names (never a raw path),
    with the requests in flight at that moment and a cumulative histogram."""
    w = make_wheel(payload_size=256)
    me = os.getpid()
    started = time.monotonic_ns() - 3_000_000_000

    def req(path: str, method: str = "GET") -> RequestRecord:
        rec = decode_request(encode_request(KIND_REQUEST, me, start_time(me) or 0, started, method, "id", path))
        assert rec is not None
        return rec

    w.add(60, encode_request(KIND_REQUEST, me, start_time(me) or 0, started, "GET", "in-flight", "/report/2024"))
    counts = Counts(w, TimeoutActions(routes=("/report", "POST /upload"), kill_signal=signal.SIGABRT))
    for path, method in [("/report/2024", "GET"), ("/upload", "POST"), ("/upload", "GET"), ("/reportage", "GET")]:
        counts.timeout(req(path, method))
    counts.warning(req("/report"))
    counts.interrupted("ended")
    counts.interrupted("ran_on")
    counts.kill()
    counts.kill(sigkill=True)
    counts.kill(sigkill=True)
    for ns in (500_000, 3_000_000, 3_000_000_000):
        counts.lateness(ns)
    text = render(w)
    printed = cli("metrics", w.name).stdout

    def aged(text: str) -> str:  # the age of the oldest request, which moves on
        return re.sub(r"(?m)^(shmwheel_oldest_request_age_seconds\S*) \S+$", r"\1 AGE", text)

    assert aged(printed) == aged(text) != text
    s = parsed(text)
    assert all(("wheel", w.name) in labels for _, labels in s)
    by_route = {
        route: sample(s, "shmwheel_request_timeouts_total", route=route)
        for route in ("/report", "POST /upload", "other")
    }
    assert by_route == {"/report": 1, "POST /upload": 1, "other": 2}
    assert sample(s, "shmwheel_request_warnings_total", route="/report") == 1
    assert sample(s, "shmwheel_requests_in_flight", route="/report") == 1
    assert sample(s, "shmwheel_requests_in_flight", route="other") == 0
    assert 3.0 <= sample(s, "shmwheel_oldest_request_age_seconds") < 60
    assert [sample(s, "shmwheel_requests_interrupted_total", outcome=o) for o in ("ended", "ran_on", "killed")] == [
        1,
        1,
        0,
    ]
    assert sample(s, "shmwheel_worker_kills_total", signal="SIGABRT") == 1
    assert sample(s, "shmwheel_worker_kills_total", signal="SIGKILL") == 2
    assert sample(s, "shmwheel_driver_lateness_seconds_bucket", le="0.001") == 1
    assert sample(s, "shmwheel_driver_lateness_seconds_bucket", le="0.005") == 2
    assert sample(s, "shmwheel_driver_lateness_seconds_bucket", le="2.5") == 2
    assert sample(s, "shmwheel_driver_lateness_seconds_bucket", le="+Inf") == 3
    assert sample(s, "shmwheel_driver_lateness_seconds_count") == 3
    assert sample(s, "shmwheel_driver_lateness_seconds_sum") == pytest.approx(3.0035)
    assert (sample(s, "shmwheel_wheel_pending"), sample(s, "shmwheel_wheel_capacity")) == (1, w.capacity)
    assert sample(s, "shmwheel_driver_running") == 0
    assert not any("/report/2024" in dict(labels).get("route", "") for _, labels in s)  # never a raw path


def test_metrics_of_a_wheel_whose_note_is_not_the_drivers_have_no_route_label(make_wheel: MakeWheel) -> None:
    w = make_wheel(payload_size=256)
    w.set_note(b"\xff not json")
    s = parsed(render(w))
    assert sample(s, "shmwheel_request_timeouts_total") == 0
    assert not any("route" in dict(labels) for _, labels in s)
    assert "no-such-wheel" in cli("metrics", "no-such-wheel").stderr


@pytest.mark.parametrize(
    "value", ["127.0.0.1", "127.0.0.1:", ":9464", "127.0.0.1:http", "127.0.0.1:70000", "a b:1", ""]
)
def test_a_metrics_address_that_is_not_host_colon_port_is_refused_with_its_value(value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(value))):
        TimeoutActions(metrics=value)


def test_the_metrics_address_and_routes_reach_the_driver_command() -> None:
    actions = TimeoutSettings(1.0, routes={"/report": 5.0, "POST /upload": None}, actions=TimeoutActions(
        metrics="[::1]:9464")).actions  # fmt: skip
    assert actions.routes == ("/report", "POST /upload")
    assert metrics_address(actions.metrics) == ("::1", 9464)
    args = actions.as_args()
    assert "--metrics=[::1]:9464" in args and "--route=POST /upload" in args
    assert "metrics on [::1]:9464" in actions.summary()


def test_a_metrics_address_in_use_is_tried_again_until_it_is_free(make_wheel: MakeWheel, caplog) -> None:
    w = make_wheel(payload_size=256)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    server = MetricsServer(w.name, "127.0.0.1", port)
    server.RETRY = 0.05
    with caplog.at_level(logging.INFO, "shmwheel.timeouts"):
        server.start()
        try:
            wait_for(lambda: "is in use; trying again" in caplog.text)
            holder.close()
            wait_for(lambda: f"serving http://127.0.0.1:{port}/metrics" in caplog.text)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                assert sample(parsed(response.read().decode()), "shmwheel_wheel_capacity") == w.capacity
            with pytest.raises(urllib.error.HTTPError, match="404"):
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10)
        finally:
            server.stop()


# -- by hand: a request's stack, and its end ------------------------------------------------


def end_by_hand(server: Server, request_id: str, *options: str) -> subprocess.CompletedProcess[str]:
    return cli("end", server.wheel, request_id, *options)


def test_gthread_stack_and_end_by_hand_leave_the_worker_and_its_siblings_serving(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """An operator's ``shmwheel stack`` prints a running request's own
    stack, naming the function it is in, and leaves it to finish (200);
    ``shmwheel end`` ends a request stuck in a Python loop long before its
    timeout: its client gets a whole 504 on a connection that serves on,
    the request beside it in the same worker finishes, the worker serves
    on, and the server's log says it was done by hand.  A request that is
    not in flight is a one-line error."""
    port = free_port()
    stages = "timeout=30.0, interrupt=True, interrupt_grace=0.5, kill=False"
    cmd = gunicorn_app(tmp_path, port, "gthread", "--workers", "1", "--threads", "4", install=stages)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        pid = pid_of(get(port, "/"))
        looked_at = pool.submit(get, port, "/spin?s=2", WAIT, "looked-at")
        wait_listed(server, "looked-at", "running")
        proc = cli("stack", server.wheel, "looked-at")
        assert proc.returncode == 0 and proc.stderr == "", proc
        assert proc.stdout.startswith(
            f"shmwheel: the stack of request GET /spin (request looked-at, worker pid {pid}, thread 0x"
        ), proc.stdout
        assert re.search(r'File ".*/tests/apps/flask_stuck\.py", line \d+, in stuck_in_spin\n', proc.stdout)
        server.wait_for(r"the stack of GET /spin \(request looked-at, .*\) was asked for by hand \(shmwheel stack\)")
        assert looked_at.result() == (200, f"done by pid {pid}\n")  # left as it was

        stuck = pool.submit(exchange, port, f"/spin?s={WAIT}", "ended-by-hand")
        sibling = pool.submit(get, port, "/sleep?s=1.5", WAIT, "sibling")
        wait_listed(server, "ended-by-hand", "running")
        wait_listed(server, "sibling", "running")
        proc = end_by_hand(server, "ended-by-hand")
        assert proc.returncode == 0, proc
        assert re.fullmatch(
            rf"request ended-by-hand \(GET /spin, worker pid {pid}\) ended [\d.]+ s after it was asked to\n",
            proc.stdout,
        ), proc.stdout
        assert_whole_504(*stuck.result())
        server.wait_for(
            rf"request ended by hand \(shmwheel end, pid \d+, uid {os.geteuid()}\): GET /spin \(request "
            rf"ended-by-hand, worker pid {pid}, .*\), running for [\d.]+ s; asking it to end the request"
        )
        server.wait_for(r"GET /spin \(request ended-by-hand, .*\) was ended by hand: answered 504 Gateway Timeout")
        assert sibling.result() == (200, f"done by pid {pid}\n")
        assert pid_of(get(port, "/")) == pid and booted(server) == 1
        assert "request timed out" not in server.log()

        proc = cli("stack", server.wheel, "ended-by-hand")
        assert proc.returncode == 1 and proc.stdout == "", proc
        assert proc.stderr.startswith("shmwheel: no request 'ended-by-hand' is in flight on wheel"), proc.stderr
        assert len(proc.stderr.splitlines()) == 1

        # A regular expression that holds the GIL for seconds: no Python runs
        # in the worker to write the stack, and the wait for it is bounded.
        held = pool.submit(get, port, "/regex?n=27", WAIT, "gil-held")
        wait_listed(server, "gil-held", "running")
        time.sleep(0.2)  # into the match
        proc = cli("stack", server.wheel, "gil-held", "--wait", "0.5")
        assert proc.returncode == 1 and proc.stdout == "", proc
        assert re.fullmatch(
            rf"shmwheel: worker pid {pid} did not write the stack of GET /regex \(request gil-held, .*\) within "
            rf"0\.5 s: no Python runs in it \(a C call that holds the GIL\?\); kill -s SIGRTMIN(?:\+\d+)? {pid} has "
            r"faulthandler "
            r"write every thread's stack to its stderr, where this request's is thread 0x[0-9a-f]{16}\n",
            proc.stderr,
        ), proc.stderr
        assert held.result() == (200, f"done by pid {pid}\n")
        assert not list((SHM).glob("shmwheel-stack.*")), "the pipe was left behind"


@as_root
def test_gthread_end_of_a_request_in_a_c_call_says_it_runs_on_and_with_kill_ends_its_worker(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """A request in a C call cannot be ended at once: ``shmwheel end``
    exits 3, saying it runs on; ``--kill`` then goes on to its worker's
    kill stage, though the server's kill is off, and exits 4 once the
    worker is gone; a new one serves.  An end asked by another user, who
    can write the wheel, is refused by the driver, and nothing is done."""
    port = free_port()
    stages = "timeout=30.0, interrupt=True, interrupt_grace=0.5, kill=False, kill_after=1.0"
    cmd = gunicorn_app(tmp_path, port, "gthread", "--workers", "1", "--threads", "2", install=stages)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        pid = pid_of(get(port, "/"))
        stuck = pool.submit(get, port, f"/c-sleep?s={WAIT}", WAIT, "in-c")
        request = wait_listed(server, "in-c", "running")
        assert request is not None

        # nobody, given write access to the wheel, asks for the end through it.
        os.chmod(SHM / server.wheel, 0o666)
        forged = Child(lambda: str(forge_end(server.wheel, "in-c")))
        try:
            server.wait_for(r"GET /c-sleep \(request in-c, .*\) was asked by hand to end, which is not done: pid \d+, "
                            r"which asked, runs as uid 65534: only the wheel's owner \(uid 0\) or root")  # fmt: skip
        finally:
            forged.end()
        os.chmod(SHM / server.wheel, 0o600)
        assert wait_listed(server, "in-c", "running") is not None

        proc = end_by_hand(server, "in-c")
        assert proc.returncode == 3, proc
        assert "has not ended 0.5 s after it was asked to: it runs on" in proc.stdout
        assert wait_listed(server, "in-c", "interrupted") is not None
        proc = end_by_hand(server, "in-c", "--kill")
        assert proc.returncode == 4, proc
        assert proc.stdout.startswith(f"request in-c (GET /c-sleep, worker pid {pid}) is over: its worker exited")
        server.wait_for(r"GET /c-sleep \(request in-c, .*\), past its timeout, ended by hand \(shmwheel end, .*\): "
                        r"its worker's kill stage")  # fmt: skip
        assert stuck.result()[0] in (0, 502)
        assert pid_of(get(port, "/")) != pid


def forge_end(wheel: str, request_id: str) -> int:
    """As another user: the end of a request, written into its wheel as
    ``shmwheel end`` writes it, the wheel kept open (mapped) as it does."""
    w = shmwheel.attach(wheel)
    _kept_open.append(w)
    (request,) = [r for r in read(w).requests if r.record.request_id == request_id]
    return w.add(0.0, with_kind(request.payload, KIND_END), reserved=True)


_kept_open: list[shmwheel.Wheel] = []  # in the child that forged, until it exits


@pytest.mark.parametrize("in_c", [True, False], ids=["c", "python"])
def test_a_request_that_ends_as_its_timer_is_moved_by_hand_tells_the_driver_so(make_wheel, in_c: bool) -> None:
    """The race an end by hand must never lose to: the driver moves the
    request's timer to now, and the request ends before its worker hears
    the ask.  Its finish finds its timer fired, though not due, and tells
    the driver that it finished, so no grace runs out on it, and no kill
    follows; had the request ended first, there would be no timer left to
    move.  (Before, a timer not due at its finish was passed over in
    silence: the driver would wait out the grace and, with --kill, kill a
    worker whose request had ended.)  Also on the C path of the worker."""
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    timer = RequestTimer(wheel.name, 30.0, traceback_signal=None)
    handle = timer.start("GET", "/moved", "moved-by-hand")
    assert handle is not None and timer._fast is not None  # its finish would take the C way
    if not in_c:
        with timer._lock:
            timer._drop_fast()  # its finish takes the Python way
    (own,) = wheel.timers()
    assert wheel.reset(own.handle, 0.0)  # the driver's move
    (fire,) = wheel.poll(time.monotonic() + 0.01)
    assert fire.handle == own.handle
    timer.finish(handle)
    (word,) = wheel.poll(time.monotonic() + 0.02)
    told = decode_request(word.payload)
    assert told is not None and (told.kind, told.request_id) == (KIND_FINISHED, "moved-by-hand")
    assert word.payload[1:] == own.payload[1:]  # the same request, as the driver keys it
    assert not wheel.reset(own.handle, 0.0)  # and one that ended first has no timer to move


def stack_then_end(
    server: Server, pool: ThreadPoolExecutor, path: str, request_id: str, file: str, function: str
) -> dict[str, object]:
    """A request to ``path``, stuck: ``shmwheel stack`` names ``function``
    (in ``file``, a pattern), then ``shmwheel end`` gets its client a 504.
    The request, as it was listed."""
    stuck = pool.submit(get, server.port, path, WAIT, request_id)
    request = wait_listed(server, request_id, "running")
    assert request is not None
    proc = cli("stack", server.wheel, request_id)
    assert proc.returncode == 0, proc
    assert re.search(rf'File ".*{file}", line \d+, in {function}\n', proc.stdout), proc.stdout
    proc = end_by_hand(server, request_id)
    assert proc.returncode == 0, proc
    assert stuck.result() == GATEWAY_TIMEOUT
    return request


def test_uwsgi_stack_and_end_by_hand(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """uWSGI: the stack of a request in a Python loop, by hand, names its
    function; its end by hand answers it 504, and the worker serves on
    (uWSGI respawns nothing)."""
    port = free_port()
    options = {"shmwheel-timeout": "30", "shmwheel-interrupt": "true", "shmwheel-kill": "false"}
    ini = uwsgi_ini(tmp_path, port, **options)
    with serve([str(BIN / "uwsgi"), "--ini", str(ini)], port, tmp_path, "uwsgi") as server:
        server.wait_for(r"driver \d+: running on wheel 'uwsgi-\d+'")
        stack_then_end(server, pool, f"/spin?s={WAIT}", "uwsgi-by-hand", r"/examples/app\.py", "_spin")
        server.wait_for(r"request ended by hand \(shmwheel end, pid \d+, uid \d+\): GET /spin \(request uwsgi-by-hand,")
        assert get(port, "/")[0] == 200
        assert "Respawned uWSGI worker" not in server.log()
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left(server)


def test_uvicorn_stack_and_end_by_hand_of_a_task(
    tmp_path: Path, pool: ThreadPoolExecutor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uvicorn: the stack of an asyncio task by hand is its await chain,
    down to the coroutine it awaits in; its end by hand cancels it and
    answers its client 504, while the event loop serves on."""
    port = free_port()
    monkeypatch.setenv("SHMWHEEL_TEST_TIMEOUT", "30")
    cmd = uvicorn_cmd(port)
    with serve_asgi(cmd, port, tmp_path) as server:
        driver = auto_driver_of(server)
        request = stack_then_end(
            server, pool, f"/await-sleep?s={WAIT}", "asgi-by-hand", r"/tests/apps/asgi_stuck\.py", "await_sleep"
        )
        assert request["task_kind"] == "task"
        assert get(port, "/")[0] == 200
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left_of_asgi(server, driver)


def test_gthread_end_of_a_warned_request_whose_worker_does_not_interrupt_is_its_kill(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """A request past its warn_after stage, whose worker does not
    interrupt requests: a plain ``shmwheel end`` is refused in one line
    (nothing could end it but its worker's kill); with ``--kill`` its
    timeout stage begins at once, by hand (its stack, then the kill the
    server's kill=False would not have sent), and the command exits 4 once
    the worker is gone; a new one serves.  The timeout stage its warn_after
    stage had added for later is dropped: when its time comes, nothing is
    said or done.  (Before, it began the stage again then, "timed out".)"""
    port = free_port()
    stages = "timeout=4.0, warn_after=0.5, kill=False, kill_after=1.0"
    cmd = gunicorn_app(tmp_path, port, "gthread", "--workers", "1", "--threads", "2", install=stages)
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        pid = pid_of(get(port, "/"))
        started = time.monotonic()
        stuck = pool.submit(get, port, f"/spin?s={WAIT}", WAIT, "warned-then-ended")
        wait_listed(server, "warned-then-ended", "warned")
        proc = end_by_hand(server, "warned-then-ended")
        assert proc.returncode == 1 and proc.stdout == "", proc
        assert "cannot be ended by itself: its worker ends requests only with interrupt=True" in proc.stderr
        proc = end_by_hand(server, "warned-then-ended", "--kill")
        assert proc.returncode == 4, proc
        server.wait_for(
            r"request ended by hand \(shmwheel end, pid \d+, uid \d+\): GET /spin \(request warned-then-ended, .*\), "
            r"running for [\d.]+ s; asking it for the request's stack \(SIG\w+(?:\+\d+)?\), then SIGABRT, and SIGKILL "
            r"1 s after that$"
        )
        server.wait_for(
            r"the stack of request GET /spin \(request warned-then-ended, .*\), running for [\d.]+ s, ended by hand"
        )
        assert stuck.result()[0] in (0, 502)
        assert pid_of(get(port, "/")) != pid
        time.sleep(max(0.0, started + 5.0 - time.monotonic()))  # its timeout stage, had it come, has said so
        assert "request timed out" not in server.log()
