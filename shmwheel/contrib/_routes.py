"""Timeouts by route: which timeout a request gets, by its method and path.

``routes`` is either a mapping or a callable.  A mapping's keys are path
prefixes, each optionally after a method (``"/upload"``, ``"POST /api/"``),
its values seconds or None (no timeout); the longest prefix that matches
wins, and of two equally long the one with a method.  A request no key
matches gets the default timeout.  A callable ``routes(method, path)``
returns the seconds itself, or None for no timeout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from .._checks import check_seconds

__all__ = ["Routes", "compile_routes"]

Routes = Mapping[str, float | None] | Callable[[str, str], float | None]
#: A route's timeout, in ns, or None for no timeout.
Lookup = Callable[[str, str], int | None]

_KEY = re.compile(r"(?:([!#$%&'*+.^_`|~0-9A-Za-z-]+) )?(/.*)")


def compile_routes(routes: Routes | None, default_ns: int) -> Lookup | None:
    """The lookup of ``routes``, checked now (a bad key or value raises here,
    not at a request), or None if there are none."""
    if routes is None:
        return None
    if callable(routes):
        return _calling(routes)
    if not isinstance(routes, Mapping):
        raise TypeError(f"routes must be a mapping of path prefixes or a callable, not {type(routes).__name__}")
    table: list[tuple[int, int, str | None, str, int | None]] = []
    for key, seconds in routes.items():
        if not isinstance(key, str) or not (match := _KEY.fullmatch(key)):
            raise ValueError(f"routes: {key!r} is not a path prefix, or a method and a path prefix ('POST /api/')")
        method, prefix = match.groups()
        ns = None if seconds is None else round(check_seconds(seconds, f"routes[{key!r}]", positive=True) * 1e9)
        table.append((-len(prefix), method is None, method, prefix, ns))
    table.sort(key=lambda row: row[:2])
    rows = [(method, prefix, ns) for _, _, method, prefix, ns in table]

    def lookup(method: str, path: str) -> int | None:
        for m, prefix, ns in rows:
            if path.startswith(prefix) and (m is None or m == method):
                return ns
        return default_ns

    return lookup


def _calling(routes: Callable[[str, str], float | None]) -> Lookup:
    def lookup(method: str, path: str) -> int | None:
        seconds = routes(method, path)
        return None if seconds is None else round(check_seconds(seconds, "routes()", positive=True) * 1e9)

    return lookup
