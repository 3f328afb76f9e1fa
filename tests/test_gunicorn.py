"""Gunicorn's hooks (shmwheel.contrib.gunicorn's install()): what Gunicorn
accepts of them, their arguments checked, the hooks in C (shmwheel._fast's
Hooks) filing what the Python hooks file, headers of other shapes, the
config's own hooks kept, and a second install(); and, under real Gunicorn,
an application wrapped both by hand and by install(), which says once which
settings win.  (test_servers.py runs real Gunicorn servers for the rest.)"""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any

import pytest
from _contrib import RAW_REQUESTS, _greenlet_that_meddles, _gunicorn_hooks, _gunicorn_request, _reuse_freed_memory
from _servers import GATEWAY_TIMEOUT, WAIT, Server, free_port, get, gunicorn_app, pid_of, serve, stopped_cleanly

from shmwheel.contrib import gunicorn as contrib_gunicorn
from shmwheel.contrib._record import decode_request


def test_gunicorn_install_defines_hooks_gunicorn_accepts_and_keeps_earlier_ones(path: str) -> None:
    from gunicorn.config import Config

    calls: list[str] = []
    namespace: dict[str, object] = {"post_request": lambda worker, req, environ, resp: calls.append("theirs")}
    contrib_gunicorn.install(namespace, timeout=5, kill=True, kill_signal="TERM")
    cfg = Config()
    for hook in contrib_gunicorn._HOOKS:
        cfg.set(hook, namespace[hook])  # gunicorn checks each hook's arity here

    class Req:
        headers = [("X-REQUEST-ID", "abc")]

    namespace["post_request"](None, Req(), {}, None)  # type: ignore[operator]
    assert calls == ["theirs"]


def test_gunicorns_hooks_take_the_c_path_with_interrupt_and_not_with_what_needs_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupted request is answered by the application's wrapper, not
    by the hooks: interrupt=True keeps them in C; routes and X-Request-Start,
    which each request's Python reads, do not."""
    monkeypatch.setattr(contrib_gunicorn, "_state", contrib_gunicorn._State())  # this test's own
    kinds = {}
    for name, kw in {
        "plain": {},
        "interrupt": {"interrupt": True},
        "routes": {"routes": {"/x": 1}},
        "x_request_start": {"x_request_start": True},
    }.items():
        namespace: dict[str, Any] = {}
        contrib_gunicorn.install(namespace, 5.0, **kw)
        kinds[name] = isinstance(namespace["pre_request"], types.BuiltinFunctionType)
    assert kinds == {"plain": True, "interrupt": True, "routes": False, "x_request_start": False}


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"timeout": 0}, ValueError), ({"timeout": "5"}, TypeError), ({"timeout": 5, "kill_signal": "X"}, ValueError)],
)
def test_gunicorn_install_checks_its_arguments(kwargs: dict[str, object], error: type[Exception]) -> None:
    with pytest.raises(error):
        contrib_gunicorn.install({}, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="globals"):
        contrib_gunicorn.install([], timeout=5)  # type: ignore[arg-type]


# -- the hooks in C (shmwheel._fast's Hooks) and in Python -----------------------------------------


@pytest.mark.parametrize(
    "raw", RAW_REQUESTS, ids=["id", "no-id", "two-ids", "utf8-path", "bad-id", "long-path", "empty-id"]
)
def test_gunicorns_hooks_in_c_file_what_the_python_hooks_file(make_wheel, monkeypatch, raw: bytes) -> None:
    wheel = make_wheel(payload_size=256)
    records = []
    for kw in ({}, {"x_request_start": True}):  # the second: the Python hooks
        hooks, timer = _gunicorn_hooks(wheel, monkeypatch, **kw)
        pre, post = hooks["pre_request"], hooks["post_request"]
        assert isinstance(pre, types.BuiltinMethodType) == (not kw)
        req: Any = _gunicorn_request(raw)
        pre(None, req)
        handle = req.shmwheel_handle
        assert handle is not None and timer.current_handle() == handle and len(wheel) == 1
        records.append(timer._active[handle].payload)
        post(None, req, {}, None)
        assert len(wheel) == 0 and not timer._active
        post(None, req, {}, None)  # finished already: nothing
    a, b = records
    assert a[:16] + a[24:] == b[:16] + b[24:]  # all but the start


@pytest.mark.parametrize(
    ("headers", "request_id"),
    [
        ((("X-REQUEST-ID", "abc"),), "abc"),  # a tuple
        ([["X-REQUEST-ID", "abc"]], "abc"),  # lists
        ([("X-REQUEST-ID", 12345)], "12345"),  # a value the Python hook takes the str() of
        ([(b"HOST", "h"), ("X-REQUEST-ID", "abc")], "abc"),
    ],
)
def test_gunicorns_c_hook_leaves_headers_of_another_shape_to_the_python_hook(
    make_wheel, monkeypatch, headers: object, request_id: str
) -> None:
    wheel = make_wheel()
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch)
    req: Any = types.SimpleNamespace(method="GET", path="/x", headers=headers)
    hooks["pre_request"](None, req)
    record = decode_request(timer._active[req.shmwheel_handle].payload)
    assert record is not None and record.request_id == request_id
    hooks["post_request"](None, req, {}, None)
    assert len(wheel) == 0


def test_gunicorns_hook_that_cannot_keep_the_handle_leaves_no_timer(make_wheel, monkeypatch, path: str) -> None:
    class Req:
        __slots__ = ("method", "path", "headers")

    wheel = make_wheel()
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch)
    req = Req()
    req.method, req.path, req.headers = "GET", "/x", []
    with pytest.raises(AttributeError, match="shmwheel_handle"):
        hooks["pre_request"](None, req)
    assert len(wheel) == 0 and not timer._active
    hooks["post_request"](None, req, {}, None)  # no handle: nothing


def test_gunicorns_hooks_call_the_configs_own_and_end_the_timer_if_theirs_fails(
    make_wheel, monkeypatch, path: str
) -> None:
    calls: list[str] = []

    def theirs_post(worker: object, req: object, environ: object, resp: object) -> None:
        calls.append("post")
        raise RuntimeError("their hook")

    namespace = {"pre_request": lambda worker, req: calls.append(f"pre {len(wheel)}"), "post_request": theirs_post}
    wheel = make_wheel()
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch, namespace=namespace)
    req: Any = _gunicorn_request(RAW_REQUESTS[0])
    hooks["pre_request"](None, req)
    with pytest.raises(RuntimeError, match="their hook"):
        hooks["post_request"](None, req, {}, None)
    assert calls == ["pre 1", "post"]  # theirs after the timer is added
    assert len(wheel) == 0 and not timer._active


def test_gunicorns_c_hooks_do_nothing_where_the_worker_has_no_timer(make_wheel, monkeypatch) -> None:
    from shmwheel.contrib import gunicorn as contrib_gunicorn

    wheel = make_wheel()
    hooks, _ = _gunicorn_hooks(wheel, monkeypatch)
    contrib_gunicorn._state.timer = None  # the master, or a worker class whose application is wrapped
    req: Any = _gunicorn_request(RAW_REQUESTS[0])
    hooks["pre_request"](None, req)
    hooks["post_request"](None, req, {}, None)
    assert not hasattr(req, "shmwheel_handle") and len(wheel) == 0
    with pytest.raises(TypeError, match=r"pre_request\(worker, req\)"):
        hooks["pre_request"](None)
    with pytest.raises(TypeError, match=r"post_request\(worker, req, environ, resp\)"):
        hooks["post_request"](None, req)


def test_gunicorns_c_hook_keeps_the_request_id_that_python_run_meanwhile_drops(make_wheel, monkeypatch) -> None:
    held: dict[str, Any] = {}
    junk: list[str] = []

    def meddle() -> None:
        if "req" in held:
            del held["req"].headers[:]  # the id's tuple and str freed, were they borrowed
            _reuse_freed_memory(junk)

    _greenlet_that_meddles(monkeypatch, meddle)
    wheel = make_wheel(payload_size=256)
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch)
    req: Any = _gunicorn_request(b"GET /x HTTP/1.1\r\nX-Request-Id: " + b"a" * 40 + b"\r\n\r\n")
    held["req"] = req
    hooks["pre_request"](None, req)
    record = decode_request(timer._active[req.shmwheel_handle].payload)
    assert record is not None and record.request_id == "a" * 40
    hooks["post_request"](None, req, {}, None)
    assert len(wheel) == 0


@pytest.mark.parametrize("kw", [{}, {"x_request_start": True}], ids=["c", "python"])
def test_a_second_install_in_one_config_takes_the_place_of_the_first(make_wheel, monkeypatch, kw) -> None:
    """A config that calls install() twice (a shared config and its own,
    say): one timer a request, cancelled, and the config's own hooks
    called once, whether defined before the first call or between them."""
    from shmwheel.contrib import gunicorn as contrib_gunicorn

    calls: list[str] = []
    namespace: dict[str, Any] = {"pre_request": lambda worker, req: calls.append("pre")}
    wheel = make_wheel(payload_size=256)
    monkeypatch.setattr(contrib_gunicorn, "_state", contrib_gunicorn._State())
    contrib_gunicorn.install(namespace, 5.0, name=wheel.name, tracebacks=False)
    namespace["post_request"] = lambda worker, req, environ, resp: calls.append("post")
    hooks, timer = _gunicorn_hooks(wheel, monkeypatch, namespace=namespace, fresh_state=False, **kw)
    req: Any = _gunicorn_request(RAW_REQUESTS[0])
    hooks["pre_request"](None, req)
    assert len(wheel) == 1 and len(timer._active) == 1
    hooks["post_request"](None, req, {}, None)
    assert len(wheel) == 0 and not timer._active
    assert calls == ["pre", "post"]


# -- an application wrapped both by hand and by install(), under real Gunicorn ----

GUNICORN_LINE = r"^\[[^]\n]+\] \[\d+\] \[WARNING\] shmwheel: "  # Gunicorn's error log, in its format


def said_once(server: Server, line: str) -> None:
    """``line`` (a pattern) is in the server's log, in Gunicorn's format, once."""
    server.wait_for(GUNICORN_LINE + line)
    assert len(re.findall(GUNICORN_LINE + line, server.log(), re.M)) == 1, server.log()[-4000:]


@pytest.mark.parametrize("worker_class", ["uvicorn_worker.UvicornWorker", "uvicorn.workers.UvicornWorker"])
def test_an_asgi_application_wrapped_already_is_timed_by_its_own_settings_and_the_worker_says_so(
    worker_class: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The application is TimeoutMiddleware(app, 30 s) itself: install()
    (1 s) does not wrap it again, so the middleware's settings time each
    request and install()'s do nothing; the worker says so at boot, once,
    in Gunicorn's log.  A request of 2 s is not timed out.  (Before,
    nothing was said: install()'s settings did nothing, silently.)"""
    monkeypatch.setenv("SHMWHEEL_TEST_TIMEOUT", "30")  # asgi_stuck's app
    port = free_port()
    cmd = gunicorn_app(tmp_path, port, worker_class, "--workers", "1", install="timeout=1.0", app="asgi_stuck:app")
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        said_once(
            server,
            r"the application is wrapped in shmwheel\.contrib\.asgi\.TimeoutMiddleware already, so install\(\) does "
            r"not wrap it again: that middleware's settings time each request \(timeout 30 s\), and install\(\)'s "
            r"\(timeout 1 s\) do nothing; install\(\)'s driver acts on its timeouts \(no kill, interrupt_grace 1 s\); "
            r"wrap the application or call install\(\), not both$",
        )
        pid_of(get(port, "/await-sleep?s=2", WAIT, "own-settings"))
        assert "request timed out" not in server.log(), server.log()[-4000:]


def test_an_asgi_middleware_that_install_wraps_again_says_at_its_first_request_that_the_outer_one_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The application is a function around TimeoutMiddleware(app, 30 s):
    install() wraps it in a middleware of its own (1 s), which times each
    request; the inner one passes them through, and says so at its first
    request, once, in Gunicorn's log.  A request of 2 s times out at 1 s.
    (Before, nothing was said: the inner one's settings did nothing,
    silently.)"""
    monkeypatch.setenv("SHMWHEEL_TEST_TIMEOUT", "30")
    port = free_port()
    cmd = gunicorn_app(
        tmp_path, port, "uvicorn_worker.UvicornWorker", "--workers", "1", install="timeout=1.0", app="asgi_stuck:nested"
    )
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        pid_of(get(port, "/await-sleep?s=2", WAIT, "outer-wins"))
        server.wait_for(r"request timed out: GET /await-sleep \(request outer-wins, ")
        pid_of(get(port, "/"))
        said_once(
            server,
            r"asgi_stuck\.spin_anywhere is wrapped in shmwheel\.contrib\.asgi\.TimeoutMiddleware \(timeout 30 s\) "
            r"inside another, which times its requests already \(timeout 1 s, on wheel 'gunicorn-\d+': under "
            r"Gunicorn, install\(\) wraps the application in one\): the outer one's settings win, and this one's do "
            r"nothing; wrap the application once$",
        )


@pytest.mark.parametrize("worker_class", ["sync", "gthread"])
def test_a_wsgi_application_wrapped_by_hand_too_is_timed_once_by_install_which_says_so(
    worker_class: str, tmp_path: Path
) -> None:
    """The application is wsgi.TimeoutMiddleware(app, 30 s) on install()'s
    wheel, and install()'s hooks (1 s, interrupt) time every request
    already: the middleware passes its requests through untimed, and the
    worker says so at boot, once.  A request that calls no_timeout() is
    exempt, and runs its 2 s; one that sleeps 2 s is answered 504, timed
    out once.  (Before, both timed each request: no_timeout() reached the
    middleware's timer only, and install()'s ended the request with a 504
    all the same.)"""
    port = free_port()
    cmd = gunicorn_app(
        tmp_path, port, worker_class, "--workers", "1", install="timeout=1.0, interrupt=True",
        app="flask_wrapped:application",
    )  # fmt: skip
    with serve(cmd, port, tmp_path, "gunicorn") as server, stopped_cleanly(server):
        status, body = get(port, "/no-timeout?s=2", WAIT, "exempt")
        assert body.startswith("no_timeout() returned True; "), (status, body)
        pid_of((status, body))
        assert get(port, "/sleep?s=2", WAIT, "timed-once") == GATEWAY_TIMEOUT
        assert len(re.findall(r"request timed out: GET /sleep \(request timed-once, ", server.log())) == 1
        said_once(
            server,
            r"install\(\)'s hooks time every request of this worker \(timeout 1 s, interrupt\), and the "
            r"shmwheel\.contrib\.wsgi\.TimeoutMiddleware its application made \(timeout 30 s, on wheel "
            r"'gunicorn-\d+'\) would time them again: install\(\)'s settings win, and the middleware passes its "
            r"requests through untimed; wrap the application or call install\(\), not both$",
        )
        assert "request timed out: GET /no-timeout" not in server.log()
