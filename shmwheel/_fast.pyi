# The worker's request timer on a path that keeps the GIL (csrc/python/fast.c).
from contextvars import ContextVar
from typing import Any

HEAD_SIZE: int

class Core:
    def __init__(self, w: int, add: int, try_cancel: int, keep: object) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...

class Timer:
    def __init__(
        self,
        core: Core,
        head: bytes,
        delay: float,
        due_ns: int,
        timeout_ns: int,
        size: int,
        max_method: int,
        max_request_id: int,
        task_flag: int,
        greenlet_flag: int,
        active: dict[int, Any],
        interrupted: set[int],
        var: ContextVar[Any],
        owner: object,
        active_type: type[tuple[Any, ...]],
        getcurrent: Any,
        interrupt: bool,
    ) -> None: ...
    def start(self, now_ns: int, method: str, path: str, request_id: str | None, task: object) -> int | None: ...
    def finish(self, handle: int) -> Any: ...
