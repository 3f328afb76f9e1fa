"""The settings every side shares (shmwheel.contrib._settings).
TimeoutSettings checks a request's timeout, its stages and the driver's
actions once, says once which signal the workers listen on, and every
adapter (both middlewares, Gunicorn's install(), uWSGI's options) makes
the same object from the same arguments.  TimeoutActions, the driver's
part, refuses bad values and goes through the driver's command line.
(test_stages.py has the stages at work.)"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from typing import Any

import pytest

from shmwheel.contrib import TimeoutActions, TimeoutSettings, _settings, timeouts
from shmwheel.contrib import asgi as contrib_asgi
from shmwheel.contrib import gunicorn as contrib_gunicorn
from shmwheel.contrib import wsgi as contrib_wsgi
from shmwheel.contrib.uwsgi import read_options


def _report(request: object, stack: str) -> None:
    pass


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"timeout": 0}, ValueError, "timeout must be a positive number of seconds"),
        ({"timeout": "5"}, TypeError, "timeout"),
        ({"timeout": 5, "warn_after": 5}, ValueError, r"warn_after \(5 s\) must be shorter than the timeout"),
        ({"timeout": 5, "interrupt": 1}, TypeError, "interrupt"),
        ({"timeout": 5, "x_request_start": "yes"}, TypeError, "x_request_start"),
        ({"timeout": 5, "on_timeout": "module:function"}, TypeError, "on_timeout must be a function"),
        ({"timeout": 5, "interrupt": True, "traceback_signal": None}, ValueError, "traceback_signal cannot be None"),
        ({"timeout": 5, "traceback_signal": "SIGNOPE"}, ValueError, "SIGNOPE"),
        ({"timeout": 5, "routes": {"no-slash": 1}}, ValueError, "is not a path"),
        ({"timeout": 5, "capacity": 0}, ValueError, "capacity"),
        ({"timeout": 5, "actions": {"kill": True}}, TypeError, "actions must be TimeoutActions"),
    ],
)
def test_settings_refuse_a_bad_value_naming_it(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        TimeoutSettings(**kwargs)


def test_the_workers_listen_on_the_signal_only_where_something_asks_for_it() -> None:
    quiet = TimeoutActions(tracebacks=False)
    assert TimeoutSettings(5).signal == signal.SIGURG  # the stacks ask
    assert TimeoutSettings(5, actions=quiet).signal is None
    assert TimeoutSettings(5, actions=quiet, traceback_signal=None).signal is None
    for stage in ({"interrupt": True}, {"warn_after": 1.0}, {"on_timeout": _report}):
        assert TimeoutSettings(5, actions=quiet, **stage).signal == signal.SIGURG, stage  # type: ignore[arg-type]
    assert TimeoutSettings(5, traceback_signal="SIGUSR2").signal == signal.SIGUSR2


def test_a_wsgi_middleware_without_stacks_still_listens_on_its_signal(name: str) -> None:
    """As a RequestTimer made by hand does: an operator's kill of a custom
    traceback signal must never take the signal's default action (SIGUSR1's
    ends the process) in a worker that was told to write no stacks."""
    app = contrib_wsgi.TimeoutMiddleware(lambda e, s: [], name, 5.0, stacks=False, traceback_signal=signal.SIGUSR1)
    assert app.timer.traceback_signal == signal.SIGUSR1
    assert contrib_asgi.TimeoutMiddleware(lambda s, r, se: None, 5.0, tracebacks=False).traceback_signal is None


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Each routes table compiled, as _settings compiles it."""
    made: list[object] = []
    real = _settings.compile_routes

    def counting(routes: Any, default_ns: int) -> Any:
        made.append(routes)
        return real(routes, default_ns)

    monkeypatch.setattr(_settings, "compile_routes", counting)
    yield made


def test_every_adapter_makes_the_same_settings_from_the_same_arguments_and_checks_them_once(
    compiled: list[object], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both middlewares, Gunicorn's install() and uWSGI's options: one
    TimeoutSettings each, its routes compiled once, the timer made of it."""
    routes = {"/upload": 60.0, "POST /api/": 2.0}
    stages: dict[str, Any] = {"warn_after": 1.5, "interrupt": True, "routes": routes, "x_request_start": True}
    expected = TimeoutSettings(5.0, **stages)
    del compiled[:]

    app = contrib_wsgi.TimeoutMiddleware(lambda environ, start_response: [], name, 5.0, **stages)
    assert app.timer.settings == expected
    assert compiled == [routes]

    del compiled[:]
    asgi_app = contrib_asgi.TimeoutMiddleware(lambda scope, receive, send: None, 5.0, name=name, **stages)
    assert asgi_app.settings == expected
    assert asgi_app._timer_on(name).settings is asgi_app.settings
    assert compiled == [routes]

    abort = TimeoutSettings(5.0, **stages, actions=TimeoutActions(kill_signal=signal.SIGABRT))  # Gunicorn's own
    del compiled[:]
    monkeypatch.setattr(contrib_gunicorn, "_state", contrib_gunicorn._State())  # this test's own
    config: dict[str, Any] = {}
    contrib_gunicorn.install(config, 5.0, **stages)
    installed = contrib_gunicorn._state.settings
    assert installed is not None
    assert installed.timeouts == abort
    assert contrib_gunicorn._timer(name, installed).settings is installed.timeouts
    assert compiled == [routes]  # no throwaway timer to check them again

    opts = {
        "shmwheel-timeout": b"5",
        "shmwheel-warn-after": b"1.5",
        "shmwheel-interrupt": b"true",
        "shmwheel-route": [b"/upload 60", b"POST /api/ 2"],
        "shmwheel-x-request-start": True,
    }
    assert read_options(opts, 1).timeouts == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kill": 1}, TypeError, "kill must be True or False"),
        ({"kill_signal": "NOPE"}, ValueError, "no signal named 'NOPE'"),
        ({"kill_signal": 999}, ValueError, "999 is not a signal"),
        ({"kill_signal": 1.5}, TypeError, "signal number or name"),
        ({"kill_after": 0}, ValueError, "positive"),
        ({"kill_after": float("nan")}, ValueError, "positive"),
        ({"kill_after": "5"}, TypeError, "number of seconds"),
    ],
)
def test_actions_refuse_bad_settings(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        TimeoutActions(**kwargs)  # type: ignore[arg-type]


def test_actions_take_signal_names_and_round_trip_through_the_command_line() -> None:
    actions = TimeoutActions(kill=True, kill_signal="abrt", tracebacks=False, kill_after=2.5, log=False)
    assert actions.kill_signal == signal.SIGABRT
    again = TimeoutActions.from_args(timeouts._parser("shmwheel timeouts").parse_args(["w", *actions.as_args()]))
    assert again == actions


def test_settings_and_actions_say_in_a_few_words_what_they_set_for_a_log_line() -> None:
    """What the warnings about an application wrapped twice name of each side."""
    assert TimeoutSettings(30.0).summary() == "timeout 30 s"
    full = TimeoutSettings(
        2.5, warn_after=1.0, interrupt=True, routes={"/x": 1}, on_timeout=_report, x_request_start=True
    )
    assert full.summary() == "timeout 2.5 s, warn_after 1 s, interrupt, routes, on_timeout, x_request_start"
    assert TimeoutActions().summary() == "no kill, interrupt_grace 1 s"
    assert (
        TimeoutActions(kill=True, kill_signal="ABRT", kill_after=3, interrupt_grace=0.5, tracebacks=False, log=False)
        .summary()
        == "kill (SIGABRT, SIGKILL 3 s later), interrupt_grace 0.5 s, no stacks, no log"
    )  # fmt: skip
