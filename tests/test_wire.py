"""End to end: what an interrupted request puts on the wire, read as raw bytes.

A plain WSGI application (tests/apps/plain_stuck.py, no framework) under
Gunicorn's sync, gthread and gevent workers and under uWSGI, with
``interrupt=True`` and a 1 s timeout.  Whatever the application said
before its timeout - ``start_response`` with a ``Content-Length`` of its
own, then a body that is late - the client gets one status line, one
``Content-Length`` and a body of that length, and a keep-alive connection
serves the next request as if nothing had happened.  (uWSGI's C
``start_response`` takes no ``exc_info`` before its headers are out, and
Gunicorn's appends a second call's headers to the first's.)
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
from _servers import (
    BIN,
    HOSTILE_PATH,
    WAIT,
    Server,
    assert_client_text_is_data,
    free_port,
    gunicorn_app,
    serve,
    uwsgi_ini,
)

from shmwheel.contrib._interrupt import RESPONSE_BODY

APPS = Path(__file__).resolve().parent / "apps"
STAGES = "timeout=1.0, interrupt=True"


def gunicorn(tmp_path: Path, port: int, worker_class: str, *options: str) -> list[str]:
    return gunicorn_app(tmp_path, port, worker_class, *options, install=STAGES, app="plain_stuck:app")


def uwsgi(tmp_path: Path, port: int) -> list[str]:
    options = {
        "module": "plain_stuck_uwsgi:application",
        "pythonpath": str(APPS),
        "processes": "1",
        "threads": "4",
        "shmwheel-timeout": "1",
        "shmwheel-interrupt": "true",
        "shmwheel-kill": "false",
        "shmwheel-kill-after": None,
    }
    return [str(BIN / "uwsgi"), "--ini", str(uwsgi_ini(tmp_path, port, **options))]


SERVERS = {
    "sync": lambda tmp_path, port: gunicorn(tmp_path, port, "sync", "--workers", "2"),
    "gthread": lambda tmp_path, port: gunicorn(tmp_path, port, "gthread", "--workers", "1", "--threads", "4"),
    "gevent": lambda tmp_path, port: gunicorn(tmp_path, port, "gevent", "--workers", "1"),
    "uwsgi": uwsgi,
}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    kind: str = request.param
    tmp_path, port = tmp_path_factory.mktemp(kind), free_port()
    with serve(SERVERS[kind](tmp_path, port), port, tmp_path, "uwsgi" if kind == "uwsgi" else "gunicorn") as server:
        if kind == "uwsgi":
            server.wait_for(r"driver \d+: running on wheel 'uwsgi-\d+'")
        yield server


class Response:
    """One HTTP/1.1 response as it came off the socket."""

    def __init__(self, status_line: bytes, headers: list[tuple[str, str]], body: bytes) -> None:
        self.status_line = status_line
        self.headers = headers
        self.body = body

    def values(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key.lower() == name.lower()]

    def __repr__(self) -> str:
        return f"Response({self.status_line!r}, {self.headers!r}, {self.body!r})"


def read_response(stream: BinaryIO) -> Response:
    """A response read by its own framing: the status line, the header
    lines up to the empty one, and as many bytes as its one
    Content-Length says (two, or none, fail the test)."""
    status_line = stream.readline()
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    headers = []
    while (line := stream.readline()) not in (b"\r\n", b""):
        assert line.endswith(b"\r\n") and b":" in line, line
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name, value.strip()))
    response = Response(status_line.rstrip(b"\r\n"), headers, b"")
    lengths = response.values("Content-Length")
    assert len(lengths) == 1, response
    response.body = stream.read(int(lengths[0]))
    return response


def request_line(path: str, request_id: str | None = None) -> bytes:
    request_id_header = "" if request_id is None else f"X-Request-Id: {request_id}\r\n"
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{request_id_header}\r\n".encode()


def exchange(port: int, path: str, request_id: str | None = None) -> tuple[Response, Response | None]:
    """``path`` on a new connection, then ``/`` on the same one: both
    responses, as the bytes framed them; None for the second if the server
    closed the connection after the first (uWSGI's http-socket does, with
    no keep-alive) with not a byte more."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock, sock.makefile("rb") as stream:
        sock.sendall(request_line(path, request_id))
        first = read_response(stream)
        try:
            sock.sendall(request_line("/"))
            if stream.peek(1) == b"":  # type: ignore[attr-defined]
                return first, None
        except ConnectionResetError:
            return first, None
        return first, read_response(stream)


def assert_whole_504(first: Response, then: Response | None) -> None:
    assert first.status_line == b"HTTP/1.1 504 Gateway Timeout", first
    assert first.values("Content-Length") == [str(len(RESPONSE_BODY))], first
    assert first.body == RESPONSE_BODY, first
    if then is not None:  # the connection kept its framing: the next request is answered as usual
        assert then.status_line == b"HTTP/1.1 200 OK", then
        assert re.fullmatch(rb"done by pid \d+\n", then.body), then


def test_a_timeout_after_an_early_start_response_goes_out_as_one_whole_504(server: Server) -> None:
    """start_response("200 OK", [Content-Length: 6]) at once, the body's one
    chunk after 30 s: at the timeout, only the 504's headers go out."""
    assert_whole_504(*exchange(server.port, "/early?s=30"))
    assert "SystemError" not in server.log()


def test_a_plain_application_stuck_in_its_call_gets_a_whole_504(server: Server) -> None:
    assert_whole_504(*exchange(server.port, "/spin?s=30"))
    assert "SystemError" not in server.log()


def test_a_hostile_path_is_data_in_the_servers_log(server: Server) -> None:
    """A client's path with a newline, ESC and a bidirectional override
    (percent-encoded): its 504 is whole, and the driver's line, the
    worker's stack header and its interrupt line show the path escaped.
    (Before, uWSGI's decoded path wrote a forged CRITICAL line and a raw
    escape sequence into the log.)"""
    first, _ = exchange(server.port, HOSTILE_PATH + "?s=30", "hostile")
    assert_whole_504(first, None)
    assert_client_text_is_data(server, "hostile")


def test_a_response_that_ends_in_time_is_sent_whole(server: Server) -> None:
    """The held start_response goes out with the first chunk: the
    application's own headers, once, and its whole body."""
    first, then = exchange(server.port, "/list")
    assert first.status_line == b"HTTP/1.1 200 OK", first
    assert first.values("Content-Length") == ["12"]
    assert first.body == b"first\nlast!\n"
    if then is not None:
        assert then.status_line == b"HTTP/1.1 200 OK", then
    time.sleep(0.1)
    assert "Traceback" not in server.log(), server.log()[-4000:]
