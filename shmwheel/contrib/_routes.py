"""Timeouts by route: which timeout a request gets, by its method and path.

``routes`` is either a mapping or a callable.  A mapping's keys are paths,
each optionally after a method (``"/upload"``, ``"POST /api"``), its
values seconds or None (no timeout).  A key's path covers itself and what
lies below it, whole segments at a time: ``"/report"`` (or ``"/report/"``)
covers ``/report`` and ``/report/2024``, not ``/reportage``; ``"/"``
covers every path.  A method matches whatever its case.  The longest path
that covers the request's wins, and of two equally long the one with a
method.  A request no key covers gets the default timeout.  A callable
``routes(method, path)`` returns the seconds itself, or None for no
timeout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from .._checks import check_seconds

__all__ = ["Routes", "compile_routes", "route_key"]

Routes = Mapping[str, float | None] | Callable[[str, str], float | None]
#: A route's timeout, in ns, or None for no timeout.
Lookup = Callable[[str, str], int | None]

_KEY = re.compile(r"(?:([!#$%&'*+.^_`|~0-9A-Za-z-]+) )?(/.*)")


def route_key(key: object) -> tuple[str | None, str]:
    """The method (or None) and the path of a route's key; ValueError if it is none."""
    if not isinstance(key, str) or not (match := _KEY.fullmatch(key)) or "//" in key:
        raise ValueError(f"routes: {key!r} is not a path, or a method and a path ('POST /api')")
    method, path = match.groups()
    return method, path


def compile_routes(routes: Routes | None, default_ns: int) -> Lookup | None:
    """The lookup of ``routes``, checked now (a bad key or value raises here,
    not at a request), or None if there are none."""
    if routes is None:
        return None
    if callable(routes):
        return _calling(routes)
    if not isinstance(routes, Mapping):
        raise TypeError(f"routes must be a mapping of paths or a callable, not {type(routes).__name__}")
    table: list[tuple[int, int, str | None, str, int | None]] = []
    seen: dict[tuple[str | None, str], str] = {}
    for key, seconds in routes.items():
        method, path = route_key(key)
        ns = None if seconds is None else round(check_seconds(seconds, f"routes[{key!r}]", positive=True) * 1e9)
        below = path.rstrip("/") + "/"  # "/report/" and "/report" alike: what lies below "/report"
        method = None if method is None else method.upper()
        same = seen.setdefault((method, below), key)
        if same != key:
            raise ValueError(f"routes: {same!r} and {key!r} are the same route")
        table.append((-len(below), method is None, method, below, ns))
    table.sort(key=lambda row: row[:2])
    rows = [(method, below, below[:-1], ns) for _, _, method, below, ns in table]

    def lookup(method: str, path: str) -> int | None:
        for m, below, itself, ns in rows:
            if (path.startswith(below) or path == itself) and (m is None or m == method.upper()):
                return ns
        return default_ns

    return lookup


def _calling(routes: Callable[[str, str], float | None]) -> Lookup:
    def lookup(method: str, path: str) -> int | None:
        seconds = routes(method, path)
        return None if seconds is None else round(check_seconds(seconds, "routes()", positive=True) * 1e9)

    return lookup
