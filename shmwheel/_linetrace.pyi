# A check run by another thread at each line it starts, on CPython 3.11 (csrc/python/linetrace.c).
# Built on every CPython; trace_thread is there on 3.11 only (3.12 and later have sys.monitoring).
from collections.abc import Callable
from types import FrameType

def trace_thread(ident: int, check: Callable[[FrameType], bool], /) -> bool: ...
def state_id(ident: int | None = None, /) -> int | None: ...
