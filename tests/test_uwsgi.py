"""uWSGI's settings (shmwheel.contrib.uwsgi): the shmwheel-* options of its
ini file read, and a bad one named.  (test_stages.py reads the stages and
routes there; test_servers.py runs real uWSGI servers.)"""

from __future__ import annotations

import signal

import pytest

from shmwheel.contrib import TimeoutActions
from shmwheel.contrib.uwsgi import read_options


def test_uwsgi_options_are_read_from_the_ini() -> None:
    opts = {
        "shmwheel-timeout": b"2.5",
        "shmwheel-kill": [b"false", b"yes"],  # given twice: the last one counts
        "shmwheel-kill-signal": b"QUIT",
        "shmwheel-tracebacks": True,  # a bare flag
        "shmwheel-capacity": b"100",
    }
    s = read_options(opts, 4321)
    assert s.name == "uwsgi-4321" and s.timeouts.timeout == 2.5 and s.timeouts.capacity == 100
    assert s.timeouts.actions == TimeoutActions(kill=True, kill_signal=signal.SIGQUIT, tracebacks=True)


@pytest.mark.parametrize(
    ("opts", "match"),
    [
        ({}, "no shmwheel-timeout option"),
        ({"shmwheel-timeout": b"soon"}, "shmwheel-timeout must be a number"),
        ({"shmwheel-timeout": b"-1"}, "positive"),
        ({"shmwheel-timeout": b"1", "shmwheel-kill": b"maybe"}, "shmwheel-kill must be true or false"),
        ({"shmwheel-timeout": b"1", "shmwheel-kill-signal": b"NOPE"}, "no signal named"),
    ],
)
def test_uwsgi_options_name_the_bad_one(opts: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_options(opts, 1)
