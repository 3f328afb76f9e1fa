"""One request-timeout workload, run against shmwheel and against the timers users pick today.

The workload.  Each producer process runs flat out for ``duration`` seconds
of one loop, the life of a web worker's requests: every request adds a timer
(its timeout) and, ``SERVICE_TIME_NS`` later, when it completes, cancels it;
every ``FIRE_EVERY``-th request hangs instead, and its timer, due
``HANG_TIMEOUT_NS`` after the add, is left to fire.  Requests overlap, as in a
worker that serves several at once: the loop starts a new one on every turn
and completes those whose service time is over first.  Throughput is the
number of requests started in the window, each an add and (nearly always) a
cancel, so "pairs/s".  Nothing paces the loop: what limits it is the cost of
an add and a cancel.  When the window ends the requests still in service
complete at once (their timers are cancelled) and no new ones start.

The backends.  Each is an adapter with the same three calls, ``add(key,
deadline_ns, delay_s) -> token``, ``cancel(token) -> bool`` (True: it will
never fire) and ``service(now_ns)``, called about every ``POLL_INTERVAL_NS``
from the loop (a no-op except in-process), and a consumer that collects the
fires, each stamped on CLOCK_MONOTONIC when it reaches Python code that could
act on it (``time.monotonic()`` is system-wide on Linux, so stamps from
different processes compare).  ``add`` is given the timer both ways: as the
deadline on the clock the loop last read, for the stores of absolute
deadlines, and as the delay from now, for the two APIs a web worker calls
with its timeout, shmwheel's ``add`` and asyncio's ``call_later``, which read
the clock themselves:

- ``shmwheel``: ``Wheel.add`` and ``Wheel.cancel`` on one segment, one driver
  (``start_driver``) whose handler records each fire, with the deadline the
  wheel stored.
- ``redis``: a sorted set on a ``redis-server`` started here on loopback
  (ZADD, ZREM), and a poller process that claims the due members every
  ``POLL_INTERVAL_NS`` with one Lua script (ZRANGEBYSCORE ... LIMIT, then ZREM),
  so that no member is claimed twice.
- ``manager``: a heap served by a ``multiprocessing`` manager over a Unix
  socket, with the same poller.
- ``socket``: a small single-threaded server around a heap, on a Unix socket
  with a fixed-size binary protocol, with the same poller.
- ``asyncio`` and ``heapq``: in one process, as lower bounds (they cannot
  cross processes): ``loop.call_later`` / ``TimerHandle.cancel`` with the
  loop given a turn every ``POLL_INTERVAL_NS``, and a heap popped as often.
  One producer only.  asyncio's own deadline is a fraction of a microsecond
  later than the loop's reading, which its fires are checked against: an
  early fire is still caught, and its lateness is overstated by as much.

Every heap here is :class:`TimerHeap`: lazy cancellation, compacted when
more than half of it is cancelled entries (what asyncio does too).

What is checked.  A payload or member is the key ``producer << KEY_BITS |
request number``.  Every hung request's timer, and every timer whose cancel
returned False, must fire exactly once; no other timer may fire; none may
fire before its deadline.  After the window the consumer is given until
nothing is pending (at most ``DRAIN_TIMEOUT``); then lost = expected and
never fired, duplicated = fired more than once, unexpected = fired although
its cancel succeeded.

What is measured, over the window: requests/s of each producer; lateness
(the stamp above minus the deadline) of every fire; the CPU time of the
consumer (shmwheel's driver, the pollers), of the servers and of the
producers (psutil); the memory that holds the timers at the end of the
window (the segment's size, Redis's ``used_memory``, a server's RSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import itertools
import multiprocessing as mp
import os
import pickle
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.managers import BaseManager
from typing import Any, Protocol

import psutil
from _common import (
    READY_TIMEOUT,
    CpuMeter,
    CpuUse,
    Delivery,
    FireLog,
    Segments,
    check_handles,
    collect,
    read_fire_log,
    segment_size,
    start_producers,
    stop_driver,
)

import shmwheel

# The workload.
SERVICE_TIME_NS = 2_000_000  # a request runs 2 ms, then cancels its timer
REQUEST_TIMEOUT_NS = 5_000_000_000  # the timer of a request that completes: far past its service time
HANG_TIMEOUT_NS = 20_000_000  # the timer of a request that hangs: it fires within the run
FIRE_EVERY = 50  # every 50th request hangs: 2 % of the timers fire
KEY_BITS = 40  # a key is producer << KEY_BITS | request number

TICK = 0.001  # s: shmwheel's resolution
CAPACITY_PER_PRODUCER = 1 << 16  # slab slots: a producer has a few thousand timers pending at a time
POLL_INTERVAL_NS = 1_000_000  # the pollers' and the in-process loops' period
CLAIM_LIMIT = 1_000  # the most timers a poller claims in one round trip
DRAIN_TIMEOUT = 30.0  # s: every fire collected after the window
START_LEAD = 0.2  # s from "go" to the start of the window: every producer is waiting by then

# The socket heap's protocol: a request is (op, a, b); replies are below.
REQUEST = struct.Struct("<Bqq")
COUNT = struct.Struct("<I")
RECORD = struct.Struct("<qq")
OP_ADD, OP_CANCEL, OP_CLAIM, OP_LEN, OP_CLEAR = range(5)  # add(key=a, deadline=b) -> 1 byte ...

PR_SET_PDEATHSIG = 1  # prctl: a signal for the child when its parent dies


class Skipped(Exception):
    """A backend that cannot run here (its server is not installed); the reason is the message."""


# -- a heap of timers ---------------------------------------------------------------------


class TimerHeap:
    """A min-heap of (deadline_ns, key) with lazy cancellation.

    ``cancel`` only forgets the key; the entry stays in the heap until it is
    popped or until cancelled entries are more than half the heap, when the
    heap is rebuilt from the live ones (amortised O(1) a cancel, and the
    memory stays within twice the live timers).  ``add`` returns the key,
    which is the token ``cancel`` takes.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []
        self._live: dict[int, int] = {}  # key -> deadline_ns

    def add(self, key: int, deadline_ns: int, delay_s: float = 0.0) -> int:
        """``delay_s`` is ignored: the adapters' signature (see the module docstring)."""
        heapq.heappush(self._heap, (deadline_ns, key))
        self._live[key] = deadline_ns
        return key

    def cancel(self, key: int) -> bool:
        if self._live.pop(key, None) is None:
            return False
        if len(self._heap) > 1024 and len(self._heap) > 2 * len(self._live):
            self._heap = [(d, k) for k, d in self._live.items()]
            heapq.heapify(self._heap)
        return True

    def claim(self, now_ns: int, limit: int) -> list[tuple[int, int]]:
        """Take out up to ``limit`` timers due at ``now_ns``: (key, deadline_ns), earliest first."""
        heap, live = self._heap, self._live
        due: list[tuple[int, int]] = []
        while heap and heap[0][0] <= now_ns and len(due) < limit:
            deadline, key = heapq.heappop(heap)
            if live.get(key) == deadline:
                del live[key]
                due.append((key, deadline))
        return due

    def size(self) -> int:
        """Timers pending (cancelled entries not counted)."""
        return len(self._live)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()


# -- fires, as the consumers record them ----------------------------------------------------


class Fires:
    """What a consumer saw: one (key, deadline_ns, stamp_ns) a fire, in arrays."""

    def __init__(self) -> None:
        self.keys = array("q")
        self.deadlines = array("q")
        self.stamps = array("q")

    def record(self, due: Sequence[tuple[int, int]]) -> None:
        """Fires claimed together, stamped now."""
        now = time.monotonic_ns()
        for key, deadline in due:
            self.keys.append(key)
            self.deadlines.append(deadline)
            self.stamps.append(now)

    def __len__(self) -> int:
        return len(self.keys)

    COLUMNS = ("keys", "deadlines", "stamps")

    def columns(self) -> dict[str, array[int]]:
        return {"keys": self.keys, "deadlines": self.deadlines, "stamps": self.stamps}


# -- clients: what producers and pollers call -----------------------------------------------


class Client(Protocol):
    def add(self, key: int, deadline_ns: int, delay_s: float) -> Any: ...

    def cancel(self, token: Any) -> bool: ...

    def service(self, now_ns: int) -> None: ...

    def claim(self, now_ns: int, limit: int) -> list[tuple[int, int]]: ...

    def pending(self) -> int: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Target:
    """Where a backend's timers live, picklable: what a producer or poller connects to."""

    kind: str
    address: str  # a segment name, a host:port, a socket path
    secret: bytes = b""  # the manager's authkey
    epoch_ns: int = 0  # Redis scores are ns after this, so that they stay exact in a double


def connect(target: Target) -> Client:
    clients: dict[str, Callable[[Target], Client]] = {
        "shmwheel": ShmwheelClient,
        "redis": RedisClient,
        "manager": ManagerClient,
        "socket": SocketClient,
        "asyncio": AsyncioClient,
        "heapq": HeapqClient,
    }
    return clients[target.kind](target)


def _no_service(now_ns: int) -> None:
    """What the loop calls every POLL_INTERVAL_NS for a backend that has its own consumer."""


class ShmwheelClient:
    def __init__(self, target: Target) -> None:
        self.wheel = shmwheel.attach(target.address)
        add = self.wheel.add
        self.add = lambda key, deadline_ns, delay_s: add(delay_s, key.to_bytes(8, "little"))
        self.cancel = self.wheel.cancel
        self.service = _no_service

    def claim(self, now_ns: int, limit: int) -> list[tuple[int, int]]:
        raise NotImplementedError("shmwheel's fires go to its driver")

    def pending(self) -> int:
        st = self.wheel.stats()
        return int(st.pending + st.in_flight)

    def close(self) -> None:
        self.wheel.close()


# Claims the due members atomically: no two pollers (and no retry) can take one twice.
CLAIM_SCRIPT = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'WITHSCORES', 'LIMIT', 0, ARGV[2])
for i = 1, #due, 2 do
    redis.call('ZREM', KEYS[1], due[i])
end
return due
"""
REDIS_KEY = "shmwheel-bench:timers"


class RedisClient:
    def __init__(self, target: Target) -> None:
        import redis

        host, port = target.address.rsplit(":", 1)
        self.redis = redis.Redis(host=host, port=int(port))
        self.epoch = target.epoch_ns
        self._claim = self.redis.register_script(CLAIM_SCRIPT)
        zadd, zrem, epoch = self.redis.zadd, self.redis.zrem, self.epoch

        def add(key: int, deadline_ns: int, delay_s: float) -> int:
            zadd(REDIS_KEY, {key: deadline_ns - epoch})
            return key

        self.add = add
        self.cancel = lambda key: zrem(REDIS_KEY, key) == 1
        self.service = _no_service

    def claim(self, now_ns: int, limit: int) -> list[tuple[int, int]]:
        flat = self._claim(keys=[REDIS_KEY], args=[now_ns - self.epoch, limit])
        return [(int(flat[i]), int(float(flat[i + 1])) + self.epoch) for i in range(0, len(flat), 2)]

    def pending(self) -> int:
        return int(self.redis.zcard(REDIS_KEY))

    def close(self) -> None:
        self.redis.close()


class LockedTimerHeap(TimerHeap):
    """The manager's heap: its server calls methods from one thread per connection."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add(self, key: int, deadline_ns: int, delay_s: float = 0.0) -> int:
        with self._lock:
            return super().add(key, deadline_ns)

    def cancel(self, key: int) -> bool:
        with self._lock:
            return super().cancel(key)

    def claim(self, now_ns: int, limit: int) -> list[tuple[int, int]]:
        with self._lock:
            return super().claim(now_ns, limit)

    def clear(self) -> None:
        with self._lock:
            super().clear()


_served_heap: LockedTimerHeap | None = None


def _the_heap() -> LockedTimerHeap:
    """In the manager's server process: the one heap every proxy refers to."""
    global _served_heap
    if _served_heap is None:
        _served_heap = LockedTimerHeap()
    return _served_heap


class HeapManager(BaseManager):
    """A manager serving one TimerHeap."""


HeapManager.register("heap", callable=_the_heap, exposed=("add", "cancel", "claim", "size", "clear"))


class ManagerClient:
    def __init__(self, target: Target) -> None:
        self.manager = HeapManager(address=target.address, authkey=target.secret)
        self.manager.connect()
        self.heap = self.manager.heap()  # type: ignore[attr-defined]
        self.add = self.heap.add
        self.cancel = self.heap.cancel
        self.claim = self.heap.claim
        self.service = _no_service

    def pending(self) -> int:
        return int(self.heap.size())

    def close(self) -> None:
        del self.heap


class SocketClient:
    def __init__(self, target: Target) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(target.address)
        send, recv, pack = self.sock.sendall, self.sock.recv, REQUEST.pack

        def add(key: int, deadline_ns: int, delay_s: float) -> int:
            send(pack(OP_ADD, key, deadline_ns))
            recv(1)
            return key

        def cancel(key: int) -> bool:
            send(pack(OP_CANCEL, key, 0))
            return recv(1) == b"\x01"

        self.add, self.cancel, self.service = add, cancel, _no_service

    def _ask(self, op: int, a: int = 0, b: int = 0) -> int:
        self.sock.sendall(REQUEST.pack(op, a, b))
        (n,) = COUNT.unpack(_recv_exact(self.sock, COUNT.size))
        return int(n)

    def claim(self, now_ns: int, limit: int) -> list[tuple[int, int]]:
        n = self._ask(OP_CLAIM, limit, now_ns)
        data = _recv_exact(self.sock, n * RECORD.size)
        return list(RECORD.iter_unpack(data))

    def pending(self) -> int:
        return self._ask(OP_LEN)

    def clear(self) -> None:
        self._ask(OP_CLEAR)

    def close(self) -> None:
        self.sock.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise ConnectionError("the heap server closed the connection")
        data += more
    return data


def serve_socket_heap(path: str, ready: Any) -> None:
    """The socket heap server: one thread, a selector, a TimerHeap.  Stopped by SIGTERM.

    Each client sends a request and waits for its reply; requests are
    handled in the order they arrive on each connection.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    heap = TimerHeap()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, None)
    ready.set()
    while True:
        for key, _ in selector.select():
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            if sock is listener:
                conn, _ = listener.accept()
                selector.register(conn, selectors.EVENT_READ, bytearray())
                continue
            data = sock.recv(1 << 16)
            if not data:
                selector.unregister(sock)
                sock.close()
                continue
            buf: bytearray = key.data
            buf += data
            replies = bytearray()
            done = 0
            while len(buf) - done >= REQUEST.size:
                op, a, b = REQUEST.unpack_from(buf, done)
                done += REQUEST.size
                if op == OP_ADD:
                    heap.add(a, b)
                    replies += b"\x01"
                elif op == OP_CANCEL:
                    replies += b"\x01" if heap.cancel(a) else b"\x00"
                elif op == OP_CLAIM:
                    due = heap.claim(b, a)
                    replies += COUNT.pack(len(due))
                    for record in due:
                        replies += RECORD.pack(*record)
                elif op == OP_LEN:
                    replies += COUNT.pack(heap.size())
                elif op == OP_CLEAR:
                    heap.clear()
                    replies += COUNT.pack(0)
            del buf[:done]
            if replies:
                sock.sendall(replies)


class AsyncioClient:
    """asyncio's timers in this process; the loop gets a turn at every service()."""

    def __init__(self, target: Target) -> None:
        self.loop = asyncio.new_event_loop()
        self.fires = Fires()
        call_later, fired = self.loop.call_later, self._fired
        self.add = lambda key, deadline_ns, delay_s: call_later(delay_s, fired, key, deadline_ns)

    def _fired(self, key: int, deadline_ns: int) -> None:
        self.fires.record(((key, deadline_ns),))

    @staticmethod
    def cancel(handle: asyncio.TimerHandle) -> bool:
        handle.cancel()  # a handle that has not run yet never will
        return True

    def service(self, now_ns: int) -> None:
        self.loop.call_soon(self.loop.stop)
        self.loop.run_forever()  # one turn: runs what is due, then stops

    def close(self) -> None:
        self.loop.close()


class HeapqClient:
    """A TimerHeap in this process, popped at every service()."""

    def __init__(self, target: Target) -> None:
        self.heap = TimerHeap()
        self.fires = Fires()
        self.add, self.cancel = self.heap.add, self.heap.cancel

    def service(self, now_ns: int) -> None:
        while due := self.heap.claim(now_ns, CLAIM_LIMIT):
            self.fires.record(due)

    def close(self) -> None:
        pass


# -- the processes of a run -----------------------------------------------------------------


def request_loop(
    client: Any, index: int, end_ns: int, monotonic_ns: Callable[[], int] = time.monotonic_ns
) -> tuple[int, array[int]]:
    """Producer ``index``'s requests on ``client`` until ``end_ns``, flat out.

    Returns how many requests started, and the keys whose cancel came too
    late (they must fire once).  The requests still in service at the end
    complete at once.  ``monotonic_ns`` is the loop's clock: instructions.py
    gives it a virtual one.
    """
    add, cancel, service = client.add, client.cancel, client.service
    base = index << KEY_BITS
    in_service: deque[tuple[int, Any, int]] = deque()  # (when it completes, token, key)
    push, pop = in_service.append, in_service.popleft
    too_late = array("q")  # keys whose cancel returned False: they must fire once
    seq = 0
    # Locals: the loop is the measurement, and a global costs a dict lookup.
    service_ns, timeout_ns, hang_ns, poll_ns = SERVICE_TIME_NS, REQUEST_TIMEOUT_NS, HANG_TIMEOUT_NS, POLL_INTERVAL_NS
    every, hangs = FIRE_EVERY, FIRE_EVERY - 1
    timeout_s, hang_s = timeout_ns / 1e9, hang_ns / 1e9

    now = monotonic_ns()
    next_service = now + poll_ns
    while now < end_ns:
        while in_service and in_service[0][0] <= now:
            _, token, key = pop()
            if not cancel(token):
                too_late.append(key)
        key = base | seq
        if seq % every == hangs:
            add(key, now + hang_ns, hang_s)
        else:
            push((now + service_ns, add(key, now + timeout_ns, timeout_s), key))
        seq += 1
        if now >= next_service:
            service(now)
            next_service = now + poll_ns
        now = monotonic_ns()
    for _, token, key in in_service:  # the window is over: these requests complete now
        if not cancel(token):
            too_late.append(key)
    return seq, too_late


def produce(target: Target, index: int, duration: float, channel: Any, go: Any, start_at: Any) -> None:
    """A producer process: the request loop for ``duration`` s from the common start, then a report."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    client: Any = connect(target)
    channel.put(("ready", index, None))
    if not go.wait(READY_TIMEOUT):
        return  # the parent is gone
    start_ns: int = start_at.value
    time.sleep(max(0.0, (start_ns - time.monotonic_ns()) / 1e9))
    seq, too_late = request_loop(client, index, start_ns + round(duration * 1e9))

    report: dict[str, Any] = {"requests": seq, "too_late": too_late}
    fires: Fires | None = getattr(client, "fires", None)
    if fires is not None:  # in-process: serve the loop until the hung requests have fired
        expected = seq // FIRE_EVERY + len(too_late)
        give_up = time.monotonic_ns() + round(DRAIN_TIMEOUT * 1e9)
        while len(fires) < expected and time.monotonic_ns() < give_up:
            time.sleep(POLL_INTERVAL_NS / 1e9)
            client.service(time.monotonic_ns())
        report["fires"] = fires.columns()
    client.close()
    channel.put(("done", index, report))


def poll_consumer(target: Target, path: str, ready: Any, stop: Any) -> None:
    """A poller process: claim what is due every POLL_INTERVAL_NS until told to stop; write the fires to ``path``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    client = connect(target)
    fires = Fires()
    ready.set()
    while True:
        last = stop.is_set()  # read before the claim: the last claim sees everything
        now = time.monotonic_ns()
        due = client.claim(now, CLAIM_LIMIT)
        fires.record(due)
        if last:
            break
        if len(due) < CLAIM_LIMIT:
            time.sleep(max(0.0, (now + POLL_INTERVAL_NS - time.monotonic_ns()) / 1e9))
    client.close()
    with open(f"{path}.part", "wb") as f:
        pickle.dump(fires.columns(), f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(f"{path}.part", path)


# -- backends: the parent's side -------------------------------------------------------------


class Backend:
    """A timer backend as the parent sees it: started once, then one ``begin``/``end`` a run."""

    name = ""
    label = ""
    in_process = False  # a lower bound: each producer its own timers, shared with no other process

    def start(self, tmp: str) -> None:
        """Start the server, if any; raise Skipped if it cannot run here."""

    def stop(self) -> None:
        """Stop the server, if any.  Safe to call more than once, and after a failed start."""

    def servers(self) -> dict[str, psutil.Process]:
        return {}

    def begin(self, run: int, producers: int) -> Target:
        raise NotImplementedError

    def attached(self, target: Target) -> None:
        """Every producer and the consumer have connected."""

    def memory(self, target: Target) -> tuple[int, str]:
        """Bytes that hold the timers now, and what they are."""
        return 0, ""

    def end(self, target: Target) -> None:
        """Undo begin."""


class ShmwheelBackend(Backend):
    name, label = "shmwheel", "shmwheel (one segment, one driver)"

    def __init__(self, segs: Segments) -> None:
        self.segs = segs
        self._wheels: dict[str, contextlib.ExitStack] = {}  # the open wheel of each run
        self._sizes: dict[str, int] = {}

    def begin(self, run: int, producers: int) -> Target:
        stack = contextlib.ExitStack()
        wheel = stack.enter_context(
            self.segs.wheel(capacity=CAPACITY_PER_PRODUCER * producers, tick=TICK, payload_size=8)
        )
        self._wheels[wheel.name] = stack
        self._sizes[wheel.name] = segment_size(wheel.name)
        return Target(self.name, wheel.name)

    def attached(self, target: Target) -> None:
        self.segs.release(target.address)  # everybody has it mapped: not even a SIGKILL leaves it now

    def memory(self, target: Target) -> tuple[int, str]:
        # The name is unlinked by now: this is the size begin saw, all of it reserved at create.
        return self._sizes.pop(target.address), "the segment (reserved at create)"

    def end(self, target: Target) -> None:
        self._sizes.pop(target.address, None)
        self._wheels.pop(target.address).close()


class RedisBackend(Backend):
    name, label = "redis", "Redis sorted set (ZADD / ZREM, Lua claim)"

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.client: Any = None

    def start(self, tmp: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise Skipped("redis-server not found")
        try:
            import redis
        except ImportError:
            raise Skipped("the redis package is not installed (pip install -e '.[bench]')") from None
        workdir = os.path.join(tmp, "redis")
        os.mkdir(workdir)
        for _ in range(3):  # a free port can be taken between our look and redis-server's bind
            port = free_port()
            self.proc = subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", workdir, "--logfile", os.path.join(workdir, "redis.log"), "--daemonize", "no"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )  # fmt: skip
            client = redis.Redis(host="127.0.0.1", port=port)
            give_up = time.monotonic() + 10.0
            while self.proc.poll() is None and time.monotonic() < give_up:
                try:
                    client.ping()
                except redis.ConnectionError:
                    time.sleep(0.02)
                    continue
                self.address, self.client = f"127.0.0.1:{port}", client
                return
            self.stop()
        raise RuntimeError(f"redis-server did not start; see {workdir}/redis.log")

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        _stop_process(self.proc)
        self.proc = None

    def servers(self) -> dict[str, psutil.Process]:
        assert self.proc is not None
        return {"redis-server": psutil.Process(self.proc.pid)}

    def begin(self, run: int, producers: int) -> Target:
        self.client.delete(REDIS_KEY)
        return Target(self.name, self.address, epoch_ns=time.monotonic_ns())

    def memory(self, target: Target) -> tuple[int, str]:
        return int(self.client.info("memory")["used_memory"]), "redis-server used_memory"

    def end(self, target: Target) -> None:
        self.client.delete(REDIS_KEY)


class ManagerBackend(Backend):
    name, label = "manager", "multiprocessing.Manager heap"

    def __init__(self) -> None:
        self.manager: HeapManager | None = None
        self.address = ""
        self.secret = os.urandom(16)

    def start(self, tmp: str) -> None:
        self.address = os.path.join(tmp, "manager.sock")
        self.manager = HeapManager(address=self.address, authkey=self.secret, ctx=mp.get_context("spawn"))
        self.manager.start(_manager_initializer)

    def stop(self) -> None:
        if self.manager is not None:
            self.manager.shutdown()
            self.manager = None

    def servers(self) -> dict[str, psutil.Process]:
        assert self.manager is not None
        return {"manager": psutil.Process(self.manager._process.pid)}  # type: ignore[attr-defined]

    def begin(self, run: int, producers: int) -> Target:
        assert self.manager is not None
        self.manager.heap().clear()  # type: ignore[attr-defined]
        return Target(self.name, self.address, self.secret)

    def memory(self, target: Target) -> tuple[int, str]:
        return int(self.servers()["manager"].memory_info().rss), "manager process RSS"


def _manager_initializer() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and shuts it down
    _die_with_parent()


class SocketBackend(Backend):
    name, label = "socket", "Unix-socket heap server"

    def __init__(self) -> None:
        self.proc: Any = None
        self.address = ""

    def start(self, tmp: str) -> None:
        ctx = mp.get_context("spawn")
        self.address = os.path.join(tmp, "heap.sock")
        ready = ctx.Event()
        self.proc = ctx.Process(target=serve_socket_heap, args=(self.address, ready), name="socket-heap", daemon=True)
        self.proc.start()
        if not ready.wait(READY_TIMEOUT):
            raise RuntimeError("the socket heap server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.join()
            self.proc = None

    def servers(self) -> dict[str, psutil.Process]:
        return {"socket server": psutil.Process(self.proc.pid)}

    def begin(self, run: int, producers: int) -> Target:
        target = Target(self.name, self.address)
        client = SocketClient(target)
        client.clear()
        client.close()
        return target

    def memory(self, target: Target) -> tuple[int, str]:
        return int(self.servers()["socket server"].memory_info().rss), "server process RSS"


class InProcessBackend(Backend):
    in_process = True

    def __init__(self, name: str, label: str) -> None:
        self.name, self.label = name, label

    def begin(self, run: int, producers: int) -> Target:
        return Target(self.name, "")


def all_backends(segs: Segments) -> list[Backend]:
    return [
        ShmwheelBackend(segs),
        RedisBackend(),
        ManagerBackend(),
        SocketBackend(),
        InProcessBackend("asyncio", "asyncio call_later / cancel (in-process)"),
        InProcessBackend("heapq", "heapq with lazy cancel (in-process)"),
    ]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In a child: SIGTERM when the parent dies, so that a SIGKILLed benchmark leaves no server behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _stop_process(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- one run --------------------------------------------------------------------------------


@dataclass
class StressRun:
    """One backend with N producers: the raw figures, for the report."""

    backend: str
    producers: int
    duration: float
    requests: list[int]  # each producer's, in the window
    lateness_ns: list[int]  # stamp - deadline, every fire, sorted
    delivery: Delivery
    cpu: CpuUse
    memory_bytes: int
    memory_note: str
    pending_at_end: int  # timers pending when the window ended (0 in-process: not looked at)
    fired_at_lateness_ns: list[int] = field(default_factory=list)  # shmwheel: fired_at - deadline, sorted

    @property
    def total_per_s(self) -> float:
        return sum(self.requests) / self.duration

    @property
    def per_producer_per_s(self) -> float:
        return self.total_per_s / self.producers

    def cpu_share(self, *names: str) -> float:
        """CPU time of the named processes over the window, as a share of one CPU."""
        return sum(self.cpu.processes.get(n, 0.0) for n in names) / self.duration

    @property
    def producer_cpu(self) -> float:
        """CPU time of the producers over the window, in CPUs."""
        return self.cpu_share(*(f"producer {i}" for i in range(self.producers)))

    @property
    def per_producer_cpu_second(self) -> float | None:
        """Requests per second of producer CPU time: the loop's speed, whatever share of the machine it got."""
        cpu = self.producer_cpu
        return self.total_per_s / cpu if cpu > 0 else None


def run_stress(backend: Backend, producers: int, duration: float, run: int, tmp: str) -> StressRun:
    """Run the workload on one backend with ``producers`` producer processes."""
    ctx = mp.get_context("spawn")
    target = backend.begin(run, producers)
    fire_path = os.path.join(tmp, f"fires-{run}.pickle")
    driver: shmwheel.DriverProcess | None = None
    poller: Any = None
    stop = ctx.Event()
    procs: list[Any] = []
    fires: dict[str, Any] = {}
    watcher: Client | None = None  # this process's own connection, to see what is pending
    try:
        if not backend.in_process:
            watcher = connect(target)
        consumers: dict[str, psutil.Process] = {}
        if backend.name == "shmwheel":
            driver = shmwheel.start_driver(target.address, FireLog(fire_path).record)
            consumers["consumer"] = psutil.Process(driver.pid)
        elif not backend.in_process:
            ready = ctx.Event()
            poller = ctx.Process(
                target=poll_consumer, args=(target, fire_path, ready, stop), name="bench-poller", daemon=True
            )
            poller.start()
            if not ready.wait(READY_TIMEOUT):
                raise RuntimeError(f"the {backend.name} poller did not start")
            consumers["consumer"] = psutil.Process(poller.pid)

        channel = ctx.Queue()
        go = ctx.Event()
        start_at = ctx.RawValue("q", 0)
        arglists = [(target, i, duration, channel, go, start_at) for i in range(producers)]
        procs = start_producers(ctx, produce, arglists, "bench-producer", channel)
        backend.attached(target)
        meter = CpuMeter(
            consumers
            | {f"producer {i}": psutil.Process(p.pid) for i, p in enumerate(procs)}
            | backend.servers()
            | {"this process": psutil.Process()}
        )
        start_ns = time.monotonic_ns() + round(START_LEAD * 1e9)
        start_at.value = start_ns
        go.set()
        time.sleep(max(0.0, (start_ns - time.monotonic_ns()) / 1e9))
        meter.start()
        time.sleep(max(0.0, (start_ns + round(duration * 1e9) - time.monotonic_ns()) / 1e9))
        cpu = meter.stop()
        memory, memory_note = backend.memory(target)
        pending_at_end = watcher.pending() if watcher is not None else 0

        reports = collect(channel, procs, "done")
        for p in procs:
            p.join()
        if watcher is not None:  # the consumer collects what is still due
            give_up = time.monotonic() + DRAIN_TIMEOUT
            while watcher.pending() and time.monotonic() < give_up:
                time.sleep(0.01)
    finally:
        # On the way out of an error or a Ctrl-C: stop everything, but
        # report nothing new - a poller that lost its server then is a
        # consequence, and would hide the cause.
        unwinding = sys.exc_info()[0] is not None
        if watcher is not None:
            watcher.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
            if p.pid is not None:
                p.join()
        if driver is not None:
            code = stop_driver(driver)
            if code != 0 and not unwinding:
                raise RuntimeError(f"the driver exited with code {code}")
            if not unwinding:
                log = read_fire_log(fire_path, code)
                fires = {
                    "keys": [int.from_bytes(p, "little") for p in log["payloads"]],
                    "deadlines": log["deadline_ns"],
                    "stamps": log["handled_ns"],
                    "fired_at": log["fired_at_ns"],
                }
        if poller is not None:
            stop.set()
            poller.join(READY_TIMEOUT)
            if poller.is_alive():
                poller.kill()
                poller.join()
            if poller.exitcode != 0 and not unwinding:
                raise RuntimeError(f"the {backend.name} poller exited with code {poller.exitcode}")
            if not unwinding:
                with open(fire_path, "rb") as f:
                    fires = pickle.load(f)
        with contextlib.suppress(Exception) if unwinding else contextlib.nullcontext():
            backend.end(target)
    if backend.in_process:  # each producer fired its own
        fires = {col: list(itertools.chain.from_iterable(r["fires"][col] for r in reports)) for col in Fires.COLUMNS}

    expected = set(itertools.chain.from_iterable(_hung_keys(i, r["requests"]) for i, r in enumerate(reports)))
    expected.update(itertools.chain.from_iterable(r["too_late"] for r in reports))
    delivery = check_handles(expected, fires["keys"])
    late = sorted(s - d for d, s in zip(fires["deadlines"], fires["stamps"], strict=True))
    delivery.early = sum(1 for x in late if x < 0)
    fired_at = sorted(f - d for d, f in zip(fires["deadlines"], fires.get("fired_at", ()), strict=False))
    return StressRun(
        backend=backend.name,
        producers=producers,
        duration=duration,
        requests=[r["requests"] for r in reports],
        lateness_ns=late,
        delivery=delivery,
        cpu=cpu,
        memory_bytes=memory,
        memory_note=memory_note,
        pending_at_end=pending_at_end,
        fired_at_lateness_ns=fired_at,
    )


def _hung_keys(index: int, requests: int) -> range:
    """The keys of producer ``index``'s requests that hung: every FIRE_EVERY-th."""
    base = index << KEY_BITS
    return range(base + FIRE_EVERY - 1, base + requests, FIRE_EVERY)


# -- the add+cancel pair alone ------------------------------------------------------------


def tight_pairs(backend: Backend, seconds: float) -> float:
    """ns per add+cancel pair from this process, through the backend's adapter, in a bare loop.

    No workload around it: what one pair costs through each adapter.  The
    timers are due far in the future and cancelled at once.  An in-process
    backend gets its turn every POLL_INTERVAL_NS, as in the request loop:
    asyncio's loop then drops the cancelled handles from its heap, as it
    does in a running program, instead of letting them pile up.
    """
    target = backend.begin(-1, 1)
    client: Any = connect(target)
    try:
        add, cancel, service, monotonic_ns = client.add, client.cancel, client.service, time.monotonic_ns
        delay = REQUEST_TIMEOUT_NS / 1e9
        deadline = monotonic_ns() + REQUEST_TIMEOUT_NS
        pairs = 0
        start = monotonic_ns()
        end = start + round(seconds * 1e9)
        now = next_service = start
        while now < end:
            for key in range(pairs, pairs + 100):
                cancel(add(key, deadline, delay))
            pairs += 100
            now = monotonic_ns()
            if now >= next_service:
                service(now)
                next_service = now + POLL_INTERVAL_NS
        return (now - start) / pairs
    finally:
        client.close()
        backend.end(target)


def round_trip_ns(n: int = 2_000) -> float:
    """One byte to another process and back through two pipes: what any server round trip costs here at least."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child echoes until its pipe closes
        try:
            os.close(w1)
            os.close(r2)
            while byte := os.read(r1, 1):
                os.write(w2, byte)
        finally:
            os._exit(0)
    os.close(r1)
    os.close(w2)
    try:
        start = time.perf_counter_ns()
        for _ in range(n):
            os.write(w1, b"x")
            os.read(r2, 1)
        return (time.perf_counter_ns() - start) / n
    finally:
        os.close(w1)  # the child's end of file
        os.close(r2)
        os.waitpid(pid, 0)
