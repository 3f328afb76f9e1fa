"""The driver's actions (shmwheel.contrib._settings's TimeoutActions): the
settings they refuse, and their way through the driver's command line.
(test_stages.py has the stages' own settings.)"""

from __future__ import annotations

import signal

import pytest

from shmwheel.contrib import TimeoutActions, timeouts


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
