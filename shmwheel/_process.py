"""Process identity: a pid plus its start time, so that a reused pid is never
mistaken for the process that registered it."""

from __future__ import annotations

import psutil

__all__ = ["alive", "start_time"]


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in microseconds since the epoch, or
    None if there is no such process (a zombie counts as gone)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return round(proc.create_time() * 1e6)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def alive(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start``."""
    return pid > 0 and start_time(pid) == start
