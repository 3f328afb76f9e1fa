"""The WSGI middleware (shmwheel.contrib.wsgi) and the body it gives back
(shmwheel.contrib._body; shmwheel._fast's Body): the whole response
timed; its call in C files what its own path files; direct(); the
body's close ends the timer whatever the application's close does, in
the wheel it started in, and in the process that started it; a
server's wsgi.file_wrapper left to send the file itself."""

from __future__ import annotations

import io
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _contrib import _greenlet_that_meddles, _reuse_freed_memory, _timer

import shmwheel
from shmwheel import _fast
from shmwheel.contrib import PAYLOAD_SIZE, _body, decode_request
from shmwheel.contrib._record import KIND_FINISHED
from shmwheel.contrib.wsgi import TimeoutMiddleware


def test_middleware_times_the_whole_response_and_cancels_on_close(make_wheel) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    seen: list[object] = []

    def app(environ, start_response):
        seen.append(environ["shmwheel.handle"])
        start_response("200 OK", [])
        yield b"a"
        yield b"b"

    mw = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None)
    body = mw({"REQUEST_METHOD": "GET", "PATH_INFO": "/caf\xc3\xa9"}, lambda *a: None)
    assert len(wheel) == 1  # the app has returned, the body is not sent yet
    assert b"".join(body) == b"ab"
    assert len(wheel) == 1  # sent, but the server has not closed it yet
    body.close()  # PEP 3333: the server closes the body once it is sent
    assert len(wheel) == 0 and wheel.stats().cancelled == 1

    # The timer carries the request, path and all, should it fire.
    body = mw({"REQUEST_METHOD": "GET", "PATH_INFO": "/caf\xc3\xa9"}, lambda *a: None)
    assert b"".join(body) == b"ab"
    [fire_payload] = [decode_request(f.payload) for f in wheel.poll(time.monotonic() + 3600)]
    assert fire_payload is not None and fire_payload.path == "/café"  # PEP 3333's latin-1, read back as UTF-8
    body.close()  # after the fire: nothing left to cancel; its driver is told it finished
    assert wheel.stats().cancelled == 1
    [word] = [decode_request(f.payload) for f in wheel.poll(time.monotonic() + 7200)]
    assert word is not None and (word.kind, word.path) == (KIND_FINISHED, "/café")


def test_middleware_cancels_when_the_body_is_closed_or_the_app_raises(make_wheel, path: str) -> None:
    wheel = make_wheel(payload_size=PAYLOAD_SIZE)
    closed: list[bool] = []

    class Body(list):  # type: ignore[type-arg]
        def close(self) -> None:
            closed.append(True)

    mw = TimeoutMiddleware(lambda e, s: Body([b"x"]), wheel.name, 30.0, traceback_signal=None)
    assert mw.timer.prepare()  # attached: the first request may take the C path too
    body = mw({"REQUEST_METHOD": "GET", "PATH_INFO": "/"}, lambda *a: None)
    assert len(wheel) == 1
    body.close()  # type: ignore[attr-defined]
    assert closed == [True] and len(wheel) == 0

    def broken(environ, start_response):
        raise RuntimeError("boom")

    raising = TimeoutMiddleware(broken, wheel.name, 30.0, traceback_signal=None)
    assert raising.timer.prepare()
    with pytest.raises(RuntimeError, match="boom"):
        raising({}, lambda *a: None)
    assert len(wheel) == 0
    with pytest.raises(TypeError, match="WSGI application"):
        TimeoutMiddleware("app", wheel.name, 1.0)  # type: ignore[arg-type]


# -- its call in C (Clerk.wsgi), direct(), and its Body --------------------------------------------


ENVIRONS = [
    {"REQUEST_METHOD": "GET", "SCRIPT_NAME": "/app", "PATH_INFO": "/items/1", "HTTP_X_REQUEST_ID": "r-1"},
    {"REQUEST_METHOD": "DELETE", "PATH_INFO": "/x", "HTTP_X_REQUEST_ID": "no spaces please"},
    {},  # no method, no path: "-" and ""
    {"REQUEST_METHOD": "GET", "PATH_INFO": "/caf\xc3\xa9"},  # PEP 3333's latin-1: the middleware's own path
    {"REQUEST_METHOD": "POST", "PATH_INFO": "/" + "p" * 300},  # cut to fit: its own path too
]


def _count_detours(mw: TimeoutMiddleware) -> list[object]:
    """The requests that direct()'s C call hands back to the middleware
    itself from now on (by their PATH_INFO)."""
    taken: list[object] = []

    class Counting(type(mw)):  # type: ignore[misc]
        def _serve(self, environ: dict[str, Any], start_response: Any, declined: bool = False) -> Any:
            taken.append(environ.get("PATH_INFO"))
            return super()._serve(environ, start_response, declined)

    mw.__class__ = Counting
    return taken


def _recording_middleware(wheel: shmwheel.Wheel) -> tuple[TimeoutMiddleware, list[int]]:
    """A middleware around an app that answers "ok" and keeps each request's handle."""
    handles: list[int] = []

    def app(env: dict[str, object], start_response: object) -> list[bytes]:
        handles.append(env["shmwheel.handle"])  # type: ignore[arg-type]
        return [b"ok"]

    return TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None), handles


@pytest.mark.parametrize("environ", ENVIRONS)
def test_the_middlewares_call_in_c_files_what_its_own_path_files(make_wheel, environ: dict[str, str]) -> None:
    wheel = make_wheel(payload_size=256)
    mw, handles = _recording_middleware(wheel)
    assert mw.timer.prepare() and mw._plain
    own_path: list[str] = []
    start, start_declined = mw.timer.start, mw.timer.start_declined
    mw.timer.start = lambda *a, **k: own_path.append(a[1]) or start(*a, **k)  # type: ignore[method-assign]
    mw.timer.start_declined = lambda *a, **k: own_path.append(a[1]) or start_declined(*a, **k)  # type: ignore[method-assign]
    in_c = mw(dict(environ), lambda *a: None)
    taken = bool(own_path)
    # Given back having tried it (a record to cut): the waiting path, not C again.
    assert mw.timer._fast.declined == (environ is ENVIRONS[4])
    mw._plain = False  # every request the middleware's own way
    mine = mw(dict(environ), lambda *a: None)
    assert own_path, "the control did not take the middleware's own path"
    assert taken == (environ in ENVIRONS[3:]), "the C call took a request it gives back, or gave back a plain one"
    assert type(in_c) is type(mine) is _fast.Body
    a, b = (mw.timer._active[h] for h in handles)
    assert a.payload[:16] + a.payload[24:] == b.payload[:16] + b.payload[24:]  # all but the start
    assert a._replace(payload=b"", deadline_ns=0, handle=0, timeout_ns=0) == b._replace(
        payload=b"", deadline_ns=0, handle=0, timeout_ns=0
    )
    assert list(in_c) == [b"ok"] and len(wheel) == 2
    in_c.close()  # type: ignore[attr-defined]
    mine.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0 and not mw.timer._active


@pytest.mark.parametrize("way", ["c", "python", "direct"])
def test_an_app_wrapped_twice_is_timed_once_by_the_outer_middleware(make_wheel, caplog, way: str) -> None:
    """The inner middleware passes the request through, and says once that
    its settings do nothing, naming the outer one's, which win; the outer
    called through its C path, its own, or the direct C callable.
    (Before, each timed the request: two timers, each acting at its own
    timeout, and no_timeout() or extend() reached the inner one only.)"""
    outer_wheel, inner_wheel = make_wheel(payload_size=PAYLOAD_SIZE), make_wheel(payload_size=PAYLOAD_SIZE)
    seen: list[int] = []

    def app(environ: dict[str, object], start_response: Any) -> list[bytes]:
        seen.append(len(outer_wheel) + len(inner_wheel))
        start_response("204 No Content", [])
        return []

    inner = TimeoutMiddleware(app, inner_wheel.name, 20.0, traceback_signal=None)
    outer = TimeoutMiddleware(inner, outer_wheel.name, 30.0, traceback_signal=None)
    assert outer.timer.prepare()
    outer._plain = way != "python"
    call = outer.direct() if way == "direct" else outer
    with caplog.at_level(logging.WARNING, "shmwheel"):
        for _ in range(2):
            body = call({"REQUEST_METHOD": "GET", "PATH_INFO": "/twice"}, lambda *a: None)
            list(body)
            body.close()  # type: ignore[attr-defined]
    assert seen == [1, 1]
    assert (outer_wheel.stats().added, inner_wheel.stats().added) == (2, 0)
    assert len(outer_wheel) == 0
    # A handle left in an environ that a server reuses: its request has
    # ended, and this one is timed.
    body = inner({"REQUEST_METHOD": "GET", "PATH_INFO": "/reused", "shmwheel.handle": 12345}, lambda *a: None)
    body.close()  # type: ignore[attr-defined]
    assert (seen[-1], inner_wheel.stats().added, len(inner_wheel)) == (1, 1, 0)
    [said] = [r.getMessage() for r in caplog.records if "inside another" in r.getMessage()]
    assert said == (
        f"shmwheel: {__name__}.test_an_app_wrapped_twice_is_timed_once_by_the_outer_middleware.<locals>.app is "
        "wrapped in shmwheel.contrib.wsgi.TimeoutMiddleware (timeout 20 s) inside another, which times its "
        f"requests already (timeout 30 s, on wheel {outer_wheel.name!r}): the outer one's settings win, and this "
        "one's do nothing; wrap the application once"
    )


def test_a_bodys_close_is_the_body_itself_as_servers_look_it_up(make_wheel) -> None:
    """uWSGI looks close() up twice a request (PyObject_HasAttrString, then
    PyObject_GetAttrString) and Gunicorn once (hasattr): the body answers
    with itself, callable as close(), so that no bound method is made for
    each, and close() is still what PEP 3333 asks for."""
    wheel = make_wheel()
    timer = _timer(wheel)
    body = _fast.Body([b"x"], timer, timer.start("GET", "/x"))
    assert hasattr(body, "close") and body.close is body and callable(body.close)
    assert sys.getrefcount(body) == 2  # the lookups kept nothing
    with pytest.raises(TypeError, match="no arguments"):
        body.close(True)  # type: ignore[call-arg]
    assert len(wheel) == 1, "a refused call ended the timer"
    close = body.close  # as uWSGI calls it: looked up, then called
    close()
    assert len(wheel) == 0 and wheel.stats().cancelled == 1


@pytest.mark.parametrize("body_type", [_fast.Body, _body.ClosingBody], ids=["c", "python"])
def test_a_body_closes_the_applications_then_ends_the_timer_whatever_happens(make_wheel, body_type) -> None:
    wheel = make_wheel()
    timer = _timer(wheel)
    order: list[str] = []

    class Closing(list):  # type: ignore[type-arg]
        def __init__(self, fail: bool) -> None:
            super().__init__([b"a", b"b"])
            self.fail = fail

        def close(self) -> None:
            order.append(f"close, {len(wheel)} pending")
            if self.fail:
                raise OSError("the client went away")

    handle = timer.start("GET", "/x")
    body = body_type(Closing(False), timer, handle)
    assert list(body) == [b"a", b"b"]
    body.close()
    assert order == ["close, 1 pending"] and len(wheel) == 0 and wheel.stats().cancelled == 1
    body.close()  # again: the body is closed again, the timer ended once
    assert len(order) == 2 and wheel.stats().cancelled == 1

    handle = timer.start("GET", "/x")
    body = body_type(Closing(True), timer, handle)
    with pytest.raises(OSError, match="went away"):
        body.close()
    assert len(wheel) == 0 and not timer._active  # ended all the same

    body = body_type(iter([b"c"]), timer, None)  # a request without a timer: no close() to call either
    assert list(body) == [b"c"]
    body.close()


@pytest.mark.parametrize("way", ["middleware", "direct"])
def test_a_body_ends_a_timer_in_the_wheel_it_started_in_after_a_replacement(name: str, way: str) -> None:
    """Also through direct(), which keeps the RequestTimer's Clerk from one
    request to the next: the one the replacement retires is not used again."""
    old = shmwheel.create(name, capacity=16, payload_size=256)
    mw = TimeoutMiddleware(lambda e, s: [b"x"], name, 30.0, traceback_signal=None)
    call = mw.direct() if way == "direct" else mw
    detours = _count_detours(mw)
    try:
        assert mw.timer.prepare()
        body = call({"PATH_INFO": "/before"}, lambda *a: None)  # made in C: its close ends it through its Clerk
        first = mw.timer._fast
        assert type(body) is _fast.Body and len(old) == 1 and first is not None
        shmwheel.unlink(name)
        new = shmwheel.create(name, capacity=16, payload_size=256)
        try:
            later = call({"PATH_INFO": "/after"}, lambda *a: None)  # the old wheel refuses: the own path attaches
            assert len(new) == 1 and mw.timer._fast is not None
            assert first.retired and mw.timer._fast is not first and not mw.timer._fast.retired
            again = call({"PATH_INFO": "/again"}, lambda *a: None)
            assert (len(old), len(new)) == (1, 2)
            if way == "direct":
                assert detours == ["/after"], "direct() went on calling the Clerk the replacement retired"
            for each in (body, later, again):
                each.close()  # type: ignore[attr-defined]
            assert (len(old), len(new)) == (0, 0), "a request's timer was left behind"
        finally:
            new.close()
            shmwheel.unlink(name)
    finally:
        old.close()


def test_a_direct_call_used_before_a_fork_serves_the_child_with_the_childs_timer(make_wheel) -> None:
    """direct() keeps the Clerk of its last request: in a forked child it is
    the parent's, which must not file the child's requests."""
    wheel = make_wheel(payload_size=256)
    mw, handles = _recording_middleware(wheel)
    direct = mw.direct()
    direct({"PATH_INFO": "/parent"}, lambda *a: None).close()  # type: ignore[attr-defined]
    parents = mw.timer._fast
    pending = direct({"PATH_INFO": "/pending"}, lambda *a: None)  # the parent's, open across the fork
    detours = _count_detours(mw)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        pending.close()  # type: ignore[attr-defined]
        ok = len(wheel) == 1  # the parent's request is the parent's to end
        for _ in range(3):  # the first takes the middleware's own path, the others the child's Clerk
            body = direct({"PATH_INFO": "/child"}, lambda *a: None)
            record = decode_request(mw.timer._active[handles[-1]].payload)
            ok = ok and record is not None and record.pid == os.getpid() and len(wheel) == 2
            body.close()  # type: ignore[attr-defined]
        ok = ok and mw.timer._fast is not parents and len(wheel) == 1 and detours == ["/child"]
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's requests were filed as the parent's, or it ended one"
    assert mw.timer._fast is parents and not parents.retired and len(wheel) == 1
    pending.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0


def test_the_middleware_called_directly_in_c_is_the_middleware(make_wheel) -> None:
    """direct(): the same requests and records, with the middleware's own
    Python taking what the C call gives back (a path that is not ASCII)."""
    wheel = make_wheel(payload_size=256)
    mw, handles = _recording_middleware(wheel)
    direct = mw.direct()
    assert type(direct) is _fast.WSGI and direct.middleware is mw
    assert mw.timer.prepare()
    own_path: list[object] = []
    start, start_declined = mw.timer.start, mw.timer.start_declined
    mw.timer.start = lambda *a, **k: own_path.append(a) or start(*a, **k)  # type: ignore[method-assign]
    mw.timer.start_declined = lambda *a, **k: own_path.append(a) or start_declined(*a, **k)  # type: ignore[method-assign]
    for environ in ENVIRONS:
        body = direct(dict(environ), lambda *a: None)
        assert list(body) == [b"ok"] and len(wheel) == 1
        record = decode_request(mw.timer._active[handles[-1]].payload)
        assert record is not None and record.method == environ.get("REQUEST_METHOD", "-")
        body.close()  # type: ignore[attr-defined]
        assert len(wheel) == 0
    assert len(own_path) == 2  # the two of ENVIRONS[3:]
    assert TimeoutMiddleware(mw.app, wheel.name, 30.0, interrupt=True).direct().__class__ is TimeoutMiddleware


def test_a_middleware_that_stands_aside_passes_requests_through_untimed_however_it_is_called(make_wheel) -> None:
    """What Gunicorn's install() does to a WSGI middleware of an application
    whose requests its hooks time already: neither its own call nor its C
    callable, which had a Clerk from a request before, adds a timer."""
    wheel = make_wheel(payload_size=256)
    seen: list[object] = []

    def app(env: dict[str, object], start_response: object) -> list[bytes]:
        seen.append(env.get("shmwheel.handle", "untimed"))
        return [b"ok"]

    mw = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None)
    direct = mw.direct()
    body = direct({"PATH_INFO": "/before"}, lambda *a: None)
    assert list(body) == [b"ok"] and len(wheel) == 1
    body.close()  # type: ignore[attr-defined]
    mw.stand_aside("install()")
    for call in (direct, mw):
        assert list(call({"PATH_INFO": "/aside"}, lambda *a: None)) == [b"ok"]
    assert seen[1:] == ["untimed", "untimed"] and wheel.stats().added == 1 and len(wheel) == 0


def test_the_middlewares_c_call_keeps_the_environs_values_that_python_run_meanwhile_drops(
    make_wheel, monkeypatch
) -> None:
    held: dict[str, Any] = {}
    junk: list[str] = []

    def meddle() -> None:
        if "environ" in held:
            held.pop("environ").clear()  # its values freed, were they borrowed
            _reuse_freed_memory(junk)

    _greenlet_that_meddles(monkeypatch, meddle)
    wheel = make_wheel(payload_size=256)
    mw, handles = _recording_middleware(wheel)
    assert mw.timer.prepare() and mw._plain
    environ = {
        "REQUEST_METHOD": "".join(["PA", "TCH"]),  # none of them interned or kept elsewhere
        "SCRIPT_NAME": "/s" + "c" * 40,
        "PATH_INFO": "/p" + "q" * 40,
        "HTTP_X_REQUEST_ID": "r" * 40,
    }
    expected = ("PATCH", "/s" + "c" * 40 + "/p" + "q" * 40, "r" * 40)
    held["environ"] = environ
    body = mw.direct()(environ, lambda *a: None)
    record = decode_request(mw.timer._active[handles[0]].payload)
    assert record is not None and (record.method, record.path, record.request_id) == expected
    body.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0


# -- the server's wsgi.file_wrapper ----------------------------------------------------------------


class _Wrapper:
    """A server's wsgi.file_wrapper as Gunicorn's and wsgiref's keep their file."""

    def __init__(self, filelike: Any, blksize: int = 8192) -> None:
        self.filelike, self.blksize = filelike, blksize

    def __iter__(self) -> Iterator[bytes]:
        return iter(lambda: self.filelike.read(self.blksize), b"")

    def close(self) -> None:
        self.filelike.close()


class _OtherWrapper:
    """One that keeps its file under another name: not made again."""

    def __init__(self, filelike: Any, blksize: int = 8192) -> None:
        self.wrapped = _Wrapper(filelike, blksize)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.wrapped)

    def close(self) -> None:
        self.wrapped.close()


class _RefusingWrapper(_Wrapper):
    """One that makes no second wrapper: its body goes the way of any other."""

    made = 0

    def __init__(self, filelike: Any, blksize: int = 8192) -> None:
        _RefusingWrapper.made += 1
        if _RefusingWrapper.made > 1:
            raise RuntimeError("once")
        super().__init__(filelike, blksize)


class _File(io.BytesIO):
    def close(self) -> None:
        super().close()
        raise OSError("the file's close failed")


@pytest.mark.parametrize("way", ["direct", "c", "python", "interrupt"])
@pytest.mark.parametrize("wrapper", [_Wrapper, _OtherWrapper, _RefusingWrapper])
def test_a_body_of_the_servers_file_wrapper_stays_one_whose_close_ends_the_timer(make_wheel, way, wrapper) -> None:
    wheel = make_wheel(payload_size=256)
    _RefusingWrapper.made = 0

    def app(environ: dict[str, Any], start_response: object) -> Any:
        return environ["wsgi.file_wrapper"](_File(b"abc" * 5000), 4096)

    kw: dict[str, Any] = {"interrupt": True} if way == "interrupt" else {"traceback_signal": None}
    mw = TimeoutMiddleware(app, wheel.name, 30.0, **kw)
    assert mw.timer.prepare()
    mw._plain = way in ("direct", "c")
    call = mw.direct() if way == "direct" else mw
    body = call({"REQUEST_METHOD": "GET", "PATH_INFO": "/f", "wsgi.file_wrapper": wrapper}, lambda *a: None)
    assert len(wheel) == 1
    if wrapper is _Wrapper:
        assert type(body) is _Wrapper and body.blksize == 4096  # the server's own: it sends the file itself
    else:
        assert type(body) in (_fast.Body, _body.ClosingBody)
    assert b"".join(body) == b"abc" * 5000
    with pytest.raises(OSError, match="close failed"):
        body.close()  # type: ignore[attr-defined]
    assert len(wheel) == 0 and not mw.timer._active


class _FunctionWrapperServer:
    """A server whose wsgi.file_wrapper is a function, as uWSGI's is: it
    hands back the file it is given, and sends a file itself (sendfile)
    only if the body is the object it was last given."""

    def __init__(self) -> None:
        self.given: Any = None

    def file_wrapper(self, filelike: Any, blksize: int = 8192) -> Any:
        if not hasattr(filelike, "read"):
            raise AttributeError("object has no attribute 'read'")
        self.given = filelike
        return filelike


@pytest.mark.parametrize("way", ["direct", "c", "python", "interrupt"])
def test_a_file_handed_to_a_function_file_wrapper_is_the_body_and_its_close_ends_the_timer(make_wheel, way) -> None:
    wheel = make_wheel(payload_size=256)
    server = _FunctionWrapperServer()
    files: list[_File] = []

    def app(environ: dict[str, Any], start_response: object) -> Any:
        files.append(_File(b"abc" * 5000))
        return environ["wsgi.file_wrapper"](files[-1], 4096)

    kw: dict[str, Any] = {"interrupt": True} if way == "interrupt" else {"traceback_signal": None}
    mw = TimeoutMiddleware(app, wheel.name, 30.0, **kw)
    assert mw.timer.prepare()
    mw._plain = way in ("direct", "c")
    call = mw.direct() if way == "direct" else mw
    file_wrapper = server.file_wrapper  # one object, as uWSGI's is
    for _ in range(2):  # the second through the stand-in kept for the server's wrapper
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/f", "wsgi.file_wrapper": file_wrapper}
        body = call(environ, lambda *a: None)
        assert body is server.given and type(body) is _body.TimedFile  # the server sends it itself
        assert body.read(3) == b"abc" and body.seek(0) == 0  # the file's own, as the server reads it
        assert len(wheel) == 1 and len(mw.timer._active) == 1
        with pytest.raises(OSError, match="close failed"):
            body.close()  # type: ignore[attr-defined]
        assert files[-1].closed and len(wheel) == 0 and not mw.timer._active


@pytest.mark.parametrize("way", ["direct", "c", "python"])
def test_a_file_the_application_closes_before_it_answers_leaves_the_request_its_timer(make_wheel, way) -> None:
    """What the stand-in wrapper hands out ends the timer only once it is
    the body: closed by the application before then, the rest of the
    request still has its timer."""
    wheel = make_wheel(payload_size=256)
    server = _FunctionWrapperServer()
    seen: list[int] = []

    def app(environ: dict[str, Any], start_response: object) -> Any:
        environ["wsgi.file_wrapper"](io.BytesIO(b"read here")).close()
        seen.append(len(wheel))
        return environ["wsgi.file_wrapper"](io.BytesIO(b"sent"))

    mw = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None)
    assert mw.timer.prepare()
    mw._plain = way != "python"
    call = mw.direct() if way == "direct" else mw
    body = call({"REQUEST_METHOD": "GET", "PATH_INFO": "/f", "wsgi.file_wrapper": server.file_wrapper}, lambda *a: None)
    assert seen == [1] and body is server.given and len(wheel) == 1
    body.close()
    assert len(wheel) == 0 and not mw.timer._active


@pytest.mark.parametrize("way", ["direct", "c", "python"])
def test_a_function_file_wrapper_whose_file_is_not_the_body_leaves_the_body_to_end_the_timer(make_wheel, way) -> None:
    """The application gave the wrapper a file, then answered otherwise: the
    server iterates the body, whose close() ends the timer (the file's
    second end, should it be closed too, changes nothing)."""
    wheel = make_wheel(payload_size=256)
    server = _FunctionWrapperServer()

    def app(environ: dict[str, Any], start_response: object) -> Any:
        timed = environ["wsgi.file_wrapper"](io.BytesIO(b"unused"))
        return [b"other", timed.read()]

    mw = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None)
    assert mw.timer.prepare()
    mw._plain = way != "python"
    call = mw.direct() if way == "direct" else mw
    body = call({"REQUEST_METHOD": "GET", "PATH_INFO": "/f", "wsgi.file_wrapper": server.file_wrapper}, lambda *a: None)
    assert type(body) in (_fast.Body, _body.ClosingBody) and b"".join(body) == b"otherunused"
    assert len(wheel) == 1
    body.close()
    assert len(wheel) == 0 and not mw.timer._active
    server.given.close()
    assert len(wheel) == 0


def test_a_request_without_a_timer_hands_the_server_its_file_as_it_is(make_wheel) -> None:
    wheel = make_wheel(payload_size=256)
    server = _FunctionWrapperServer()
    file = io.BytesIO(b"free")

    def app(environ: dict[str, Any], start_response: object) -> Any:
        return environ["wsgi.file_wrapper"](file)

    mw = TimeoutMiddleware(app, wheel.name, 30.0, traceback_signal=None, routes={"/free": None})
    assert mw.timer.prepare()
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/free", "wsgi.file_wrapper": server.file_wrapper}
    body = mw(environ, lambda *a: None)
    assert body is file is server.given and environ["wsgi.file_wrapper"] == server.file_wrapper
    assert len(wheel) == 0
