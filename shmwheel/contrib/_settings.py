"""The settings every side of request timeouts shares: a request's timeout
and its stages (:class:`TimeoutSettings`, which every adapter makes once
from what it is given), what the driver does on a timeout
(:class:`TimeoutActions`, carried to a driver process on its command
line), and the request wheel's size and name.  The worker's side and the
driver's side both import from here, and neither from the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .._checks import CAPACITIES, check_flag, check_int, check_seconds, check_signal
from ._record import DEFAULT_TRACEBACK_SIGNAL, RequestRecord, check_traceback_signal, signal_name
from ._routes import Lookup, Routes, compile_routes, route_key

__all__ = [
    "COMMAND",
    "DEFAULT_CAPACITY",
    "DEFAULT_INTERRUPT_GRACE",
    "DEFAULT_KILL_AFTER",
    "WHEEL_ENV",
    "TimeoutActions",
    "TimeoutSettings",
    "metrics_address",
    "reserve_for",
    "shards_for",
]

#: Timers a request-timeout wheel holds: one per request in progress.
DEFAULT_CAPACITY = 65_536
#: The driver command's module: ``python -m shmwheel.contrib.timeouts``.
COMMAND = "shmwheel.contrib.timeouts"
#: The environment variable in which a server's master names the wheel it
#: made for its workers (the Gunicorn adapter sets it): a middleware without
#: a name of its own uses that wheel, and leaves its driver to the master.
WHEEL_ENV = "SHMWHEEL_WHEEL"
#: How long a worker may take to go after kill_signal before SIGKILL.
DEFAULT_KILL_AFTER = 5.0
#: How long an interrupted request has to end before the driver says it has
#: not, and goes on to the kill stage if ``kill`` is on.  Python code sees
#: the interrupt within milliseconds; a C call only once it returns.
DEFAULT_INTERRUPT_GRACE = 1.0


def shards_for(capacity: int) -> int:
    """The shards of a request-timeout wheel: one a CPU this process may
    run on (the workers' adds and cancels then share no lock, whichever
    CPU each runs on), rounded up to a power of two, at most 64, and
    never fewer than 256 slots a shard.  A wheel made with another count
    (on another machine, or a container given other CPUs) is as good: only
    the contention differs."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(1 << (cpus - 1).bit_length(), MAX_SHARDS, capacity // 256))


#: The most shards shards_for gives a request-timeout wheel.
MAX_SHARDS = 64


def reserve_for(capacity: int) -> int:
    """The slots a request-timeout wheel keeps for the timers that must get
    through when its workers' requests have filled it: the driver's
    follow-ups (the stack check, the interrupt's grace, the kill signal and
    the SIGKILL after it) and the workers' answers to them.  A sixteenth:
    4096 of the default 65536, room for the stages of hundreds of late
    requests at once."""
    return capacity // 16


def metrics_address(value: object, what: str = "metrics") -> tuple[str, int]:
    """The (host, port) of ``"HOST:PORT"`` (``"[::1]:9464"`` for an IPv6
    host; port 0: one the kernel picks, which the driver's log names)."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string HOST:PORT, not {type(value).__name__}")
    host, sep, port = value.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or int(port) > 65535 or any(c.isspace() for c in host):
        raise ValueError(f"{what} must be HOST:PORT, like 127.0.0.1:9464, not {value!r}")
    return host, int(port)


@dataclass(frozen=True)
class TimeoutActions:
    """What the driver does when a request's timer fires (see the module docs).

    Which signal asks a worker for a stack is the worker's to say: its
    records name it (``traceback_signal`` of the middlewares and of
    ``install()``)."""

    log: bool = True  #: the WARNING line
    tracebacks: bool = True  #: ask the worker for the request's stack
    kill: bool = False  #: kill_signal, then SIGKILL after kill_after
    kill_signal: int = signal.SIGTERM
    kill_after: float = DEFAULT_KILL_AFTER
    #: how long an interrupted request has to end before it is logged, and killed with kill
    interrupt_grace: float = DEFAULT_INTERRUPT_GRACE
    #: where the driver serves its metrics, HOST:PORT (None: it does not)
    metrics: str | None = None
    #: the routes (keys of a mapping of ``routes``) the metrics count requests by
    routes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for flag in ("log", "tracebacks", "kill"):
            check_flag(getattr(self, flag), flag)
        object.__setattr__(self, "kill_signal", check_signal(self.kill_signal, "kill_signal"))
        object.__setattr__(self, "kill_after", check_seconds(self.kill_after, "kill_after", positive=True))
        grace = check_seconds(self.interrupt_grace, "interrupt_grace", positive=True)
        object.__setattr__(self, "interrupt_grace", grace)
        if self.metrics is not None:
            metrics_address(self.metrics)
        if not isinstance(self.routes, tuple):
            raise TypeError(f"routes must be a tuple of route keys, not {type(self.routes).__name__}")
        for key in self.routes:
            route_key(key)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TimeoutActions:
        """The settings parsed from the arguments :meth:`as_args` makes."""
        return cls(
            log=args.log,
            tracebacks=args.tracebacks,
            kill=args.kill,
            kill_signal=args.kill_signal,
            kill_after=args.kill_after,
            interrupt_grace=args.interrupt_grace,
            metrics=args.metrics,
            routes=tuple(args.route or ()),
        )

    def summary(self) -> str:
        """What the driver does, in a few words for a log line:
        ``kill (SIGTERM, SIGKILL 5 s later), interrupt_grace 1 s``."""
        parts = [
            f"kill ({signal_name(self.kill_signal)}, SIGKILL {self.kill_after:g} s later)" if self.kill else "no kill"
        ]
        parts.append(f"interrupt_grace {self.interrupt_grace:g} s")
        if not self.tracebacks:
            parts.append("no stacks")
        if not self.log:
            parts.append("no log")
        if self.metrics is not None:
            parts.append(f"metrics on {self.metrics}")
        return ", ".join(parts)

    def as_args(self) -> list[str]:
        """The same settings as command-line arguments of ``python -m shmwheel.contrib.timeouts``."""
        args = [
            f"--kill-signal={signal.Signals(self.kill_signal).name}",
            f"--kill-after={self.kill_after!r}",
            f"--interrupt-grace={self.interrupt_grace!r}",
        ]
        if not self.log:
            args.append("--no-log")
        if not self.tracebacks:
            args.append("--no-tracebacks")
        if self.kill:
            args.append("--kill")
        if self.metrics is not None:
            args.append(f"--metrics={self.metrics}")
        args += [f"--route={key}" for key in self.routes]
        return args


@dataclass(frozen=True)
class TimeoutSettings:
    """A request's timeout, its stages and what the driver does, checked
    once, as every adapter takes them (the middlewares' and ``install()``'s
    arguments of the same names; ``stacks`` is ``actions.tracebacks``).

    ``traceback_signal`` is the signal the workers are asked on: None is
    refused where a stage needs it, and means no stacks otherwise; where
    nothing asks (no stacks, no stage) :attr:`signal` is None whatever was
    given, and the servers' workers listen on no signal.  ``actions`` and ``capacity`` matter where the adapter
    starts the driver and makes the wheel (``install()``, the ASGI
    middleware, uWSGI's master); elsewhere the driver command has its own.
    """

    timeout: float
    warn_after: float | None = None
    interrupt: bool = False
    routes: Routes | None = None
    on_timeout: Callable[[RequestRecord, str], object] | None = None
    x_request_start: bool = False
    traceback_signal: int | str | None = DEFAULT_TRACEBACK_SIGNAL
    actions: TimeoutActions = TimeoutActions()
    capacity: int = DEFAULT_CAPACITY
    #: The routes' look-up, made once (None: no routes).
    lookup: Lookup | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        timeout = check_seconds(self.timeout, "timeout", positive=True)
        object.__setattr__(self, "timeout", timeout)
        check_flag(self.interrupt, "interrupt")
        check_flag(self.x_request_start, "x_request_start")
        if self.on_timeout is not None and not callable(self.on_timeout):
            kind = type(self.on_timeout).__name__
            raise TypeError(f"on_timeout must be a function of (request, stack), not {kind}")
        if self.warn_after is not None:
            warn = check_seconds(self.warn_after, "warn_after", positive=True)
            if warn >= timeout:
                raise ValueError(f"warn_after ({warn:g} s) must be shorter than the timeout ({timeout:g} s)")
            object.__setattr__(self, "warn_after", warn)
        if not isinstance(self.actions, TimeoutActions):
            raise TypeError(f"actions must be TimeoutActions, not {type(self.actions).__name__}")
        object.__setattr__(self, "capacity", check_int(self.capacity, "capacity", *CAPACITIES))
        if self.traceback_signal is not None:
            object.__setattr__(self, "traceback_signal", check_traceback_signal(self.traceback_signal))
        elif self.staged:
            raise ValueError(
                "traceback_signal cannot be None with warn_after, interrupt or on_timeout: it is the signal on which "
                "the driver tells the worker that a request of its is late"
            )
        object.__setattr__(self, "lookup", compile_routes(self.routes, round(timeout * 1e9)))
        if isinstance(self.routes, Mapping) and not self.actions.routes:  # the metrics count by them too
            object.__setattr__(self, "actions", dataclasses.replace(self.actions, routes=tuple(self.routes)))

    def summary(self) -> str:
        """What each request gets, in a few words for a log line:
        ``timeout 30 s, warn_after 10 s, interrupt, routes``."""
        parts = [f"timeout {self.timeout:g} s"]
        if self.warn_after is not None:
            parts.append(f"warn_after {self.warn_after:g} s")
        flags = {
            "interrupt": self.interrupt,
            "routes": self.routes is not None,
            "on_timeout": self.on_timeout is not None,
            "x_request_start": self.x_request_start,
        }
        return ", ".join(parts + [name for name, on in flags.items() if on])

    @property
    def staged(self) -> bool:
        """Whether a stage needs the worker's word: warn_after, interrupt, on_timeout."""
        return self.interrupt or self.warn_after is not None or self.on_timeout is not None

    @property
    def signal(self) -> int | None:
        """The signal the workers listen on: None where nothing asks for it
        (no stacks, no stage)."""
        asks = self.actions.tracebacks or self.staged
        return self.traceback_signal if asks else None  # type: ignore[return-value]  # checked: an int
