"""uWSGI's options (shmwheel.contrib.uwsgi): the shmwheel-* options of its
ini file read, a bad one named, and an option given more than once read
whole, in a real uWSGI too.  (test_stages.py reads the stages and routes
there; test_servers.py runs real uWSGI servers.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from _servers import BIN, assert_nothing_left, free_port, get, serve, timed_out_line, uwsgi_ini

from shmwheel.contrib import TimeoutActions
from shmwheel.contrib import uwsgi as contrib_uwsgi
from shmwheel.contrib.uwsgi import read_options, repeated


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


# -- options given more than once ----------------------------------------------


def test_every_line_of_a_repeated_option_is_read_from_the_ini_uwsgi_was_given(tmp_path: Path) -> None:
    """uWSGI 2.0 on Python 3 keeps only the last of a repeated option in
    uwsgi.opt: the others are read again from its ini file, in its
    section, as its parser reads them."""
    ini = tmp_path / "server.ini"
    ini.write_text(
        "[other]\nshmwheel-route = /elsewhere 9\n"
        "[uwsgi]\n; a comment\nshmwheel-route = /report 6\n# another\n  shmwheel-route=POST /upload 5\n"
        "mule = shmwheel.contrib.uwsgi:driver\nmule = app:other_mule\nshmwheel-route = /health none\n"
    )
    opts = {"ini": str(ini).encode(), "shmwheel-route": b"/health none", "mule": b"app:other_mule"}
    assert repeated(opts, "shmwheel-route") == ["/report 6", "POST /upload 5", "/health none"]
    assert repeated(opts, "mule") == ["shmwheel.contrib.uwsgi:driver", "app:other_mule"]
    assert repeated({**opts, "ini": f"{ini}:other".encode(), "shmwheel-route": b"/elsewhere 9"}, "shmwheel-route") == [
        "/elsewhere 9"
    ]
    assert repeated({**opts, "shmwheel-route": [b"/a 1", b"/b 2"]}, "shmwheel-route") == ["/a 1", "/b 2"]  # a list
    assert repeated({"shmwheel-route": b"/a 1"}, "shmwheel-route") == ["/a 1"]  # no ini: what uWSGI has
    assert repeated(opts, "shmwheel-timeout") == []
    routes = read_options({**opts, "shmwheel-timeout": b"10"}, 1).timeouts.routes
    assert routes == {"/report": 6.0, "POST /upload": 5.0, "/health": None}


@pytest.mark.parametrize(
    ("lines", "why"),
    [
        ("shmwheel-route = /a 1\nshmwheel-route = %(prefix)/b 2\n", "placeholders"),
        ("shmwheel-route = /x $(SLOW)\nshmwheel-route = /api/b 2\n", "placeholders"),
        ("if-env = STAGING\nshmwheel-route = / none\nendif =\nshmwheel-route = /api/b 2\n", "config logic"),
        ("shmwheel-route = /a 1\nshmwheel-route = /b 2\n", "last reads '/b 2'"),
    ],
)
def test_repeated_lines_uwsgi_made_something_else_of_leave_its_own_value_and_say_so(
    lines: str, why: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines inside uWSGI's config logic, or with a placeholder, or whose
    last is not what uWSGI has: the file cannot be trusted, so uWSGI's own
    value counts alone (never a route uWSGI skipped, which could exempt
    every path), and one WARNING says what may be left out."""
    ini = tmp_path / "server.ini"
    ini.write_text("[uwsgi]\n" + lines)
    monkeypatch.setattr(contrib_uwsgi, "_warned", set())
    opts = {"ini": str(ini), "shmwheel-route": b"/api/b 2", "shmwheel-timeout": b"10"}
    for _ in range(2):
        assert repeated(opts, "shmwheel-route") == ["/api/b 2"]
    assert read_options(opts, 1).timeouts.routes == {"/api/b": 2.0}
    said = [r.getMessage() for r in caplog.records if "hands the application only the last" in r.getMessage()]
    assert len(said) == 1, said  # once a server
    assert "only '/api/b 2' applies" in said[0] and why in said[0]


def test_an_option_of_a_config_that_is_not_an_ini_file_is_uwsgis_own_value_with_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(contrib_uwsgi, "_warned", set())
    assert repeated({"yaml": b"server.yaml", "shmwheel-route": b"/a 1"}, "shmwheel-route") == ["/a 1"]
    fifo = tmp_path / "fifo.ini"
    os.mkfifo(fifo)  # read as an ini file it would block the master: not a regular file, so not read
    assert repeated({"ini": str(fifo), "mule": b"m"}, "mule") == ["m"]
    said = [r.getMessage() for r in caplog.records if "hands the application only the last" in r.getMessage()]
    assert len(said) == 2 and "this config is not an ini file" in said[0]


OTHER_MULE = "import time\n\ndef idle():\n    time.sleep(3600)\n"


def test_uwsgi_applies_every_route_line_and_finds_the_driver_among_several_mules(tmp_path: Path) -> None:
    """Three shmwheel-route lines and a second mule after the driver's, in
    a real uWSGI: the first route times its path out (only the last line
    applied before), and no false "no driver runs" is said."""
    (tmp_path / "other_mule.py").write_text(OTHER_MULE)
    port = free_port()
    ini = uwsgi_ini(tmp_path, port, **{"shmwheel-timeout": "30", "shmwheel-kill": "false"})
    with ini.open("a") as f:
        f.write(f"pythonpath = {tmp_path}\nmule = other_mule:idle\n")
        f.write("shmwheel-route = /sleep 0.5\nshmwheel-route = POST /upload 5\nshmwheel-route = /health none\n")
    with serve([str(BIN / "uwsgi"), "--ini", str(ini)], port, tmp_path, "uwsgi") as server:
        server.wait_for(r"driver \d+: running on wheel 'uwsgi-\d+'")
        status, body = get(server.port, "/sleep?s=1.5")
        assert status == 200
        pid = int(server.wait_for(timed_out_line("/sleep")).group(1))
        assert body == f"done by pid {pid}\n"
        assert "no driver runs on wheel" not in server.log()
        assert server.stop(signal.SIGINT) == 0
        assert_nothing_left(server)
