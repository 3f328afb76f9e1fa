# The worker's request timer on a path that keeps the GIL (csrc/python/fast.c).
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any, ClassVar

HEAD_SIZE: int
API_VERSION: int

class Core:
    def __init__(self, w: int, add_at: int, try_cancel: int, keep: object) -> None: ...
    def close(self) -> None: ...
    @property
    def closed(self) -> bool: ...

class Active:
    """A request in progress, as its worker's table holds it."""

    __hash__: ClassVar[None]  # type: ignore[assignment]
    def __init__(
        self, payload: bytes, deadline_ns: int, thread: int, task: Any, handle: int, timeout_ns: int, interrupt: bool
    ) -> None: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def deadline_ns(self) -> int: ...
    @property
    def thread(self) -> int: ...
    @property
    def task(self) -> Any: ...
    @property
    def handle(self) -> int: ...
    @property
    def timeout_ns(self) -> int: ...
    @property
    def interrupt(self) -> bool: ...
    def _replace(self, **fields: Any) -> Active: ...

class Timer:
    def __init__(
        self,
        core: Core,
        head: bytes,
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
        getcurrent: Any,
        interrupt: bool,
        warn_ns: int,
        warn_flag: int,
        look_ns: int,
        current_tasks: dict[Any, Any] | None = None,
        current_task: Callable[[], Any] | None = None,
    ) -> None: ...
    look_at: int
    def start(
        self,
        now_ns: int,
        method: str,
        path: str,
        request_id: str | None,
        task: object,
        timeout_ns: int | None = None,
        started_ns: int | None = None,
        /,
    ) -> int | None: ...
    def finish(self, handle: int, /) -> Any: ...
    def wsgi(self, app: Callable[..., Any], environ: dict[str, Any], start_response: Callable[..., Any], /) -> Any: ...

class Body:
    def __init__(self, body: Iterable[bytes], timer: object, handle: int | None) -> None: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def close(self) -> None: ...

class Send:
    def __call__(self, message: Any, /) -> Any: ...

class ASGI:
    def __init__(self, middleware: object) -> None: ...
    def __call__(self, scope: Any, receive: Any, send: Any, /) -> Awaitable[None] | None: ...

class Coroutine:
    __wrapped__: Callable[..., Awaitable[None]]
    def __init__(self, func: Callable[..., Awaitable[None]]) -> None: ...
    def __call__(self, middleware: Any, scope: Any, receive: Any, send: Any, /) -> Awaitable[None]: ...
    def __get__(self, obj: object, objtype: type | None = None) -> Any: ...

class WSGI:
    def __init__(self, middleware: object) -> None: ...
    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any], /) -> Iterable[bytes]: ...
    @property
    def middleware(self) -> object: ...

class Hooks:
    def __init__(self, state: object, slow: Callable[[Any, Any], None], header: str) -> None: ...
    def pre_request(self, worker: Any, req: Any, /) -> None: ...
    def post_request(self, worker: Any, req: Any, environ: Any, resp: Any, /) -> None: ...
