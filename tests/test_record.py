"""The request record (shmwheel.contrib._record): what a worker's timer
carries for the driver to read back, its fields as log lines and JSON,
what is cut to fit, and payloads that are no record."""

from __future__ import annotations

import signal

import pytest

from shmwheel.contrib import KIND_REQUEST, decode_request, encode_request
from shmwheel.contrib._record import HEAD, KINDS, shown


def test_request_record_round_trips() -> None:
    payload = encode_request(KIND_REQUEST, 1234, 987654321, 42, "GET", "abc.7", "/a/b?c=d é")
    record = decode_request(payload)
    assert record is not None
    assert record == (
        KIND_REQUEST, 1234, 987654321, 42, "GET", "abc.7", "/a/b?c=d é", False, 0, 0, "", 0, 0, 0, False, False, 0
    )  # fmt: skip
    assert record.describe() == "GET /a/b?c=d é (request abc.7, worker pid 1234)"


def test_what_a_client_chose_is_shown_as_data_in_log_lines_and_kept_as_it_is_in_json() -> None:
    """A path with a newline, ESC, a C1 code, a right-to-left override, a
    line separator, a tab and a backslash: written visibly, so that no line
    of the log begins with the client's text and no terminal obeys it; the
    JSON fields keep the path as it came.  Plain text, é included, is left
    as it is."""
    path = "/a\n[x] [CRITICAL] forged\x1b[2J\x85\u202e\u2028\t\\ é"
    payload = encode_request(KIND_REQUEST, 1, 2, 3, "GET", "r", path)
    record = decode_request(payload)
    assert record is not None
    line = record.describe()
    assert line == r"GET /a\n[x] [CRITICAL] forged\x1b[2J\x85\u202e\u2028\t\\ é (request r, worker pid 1)"
    assert line.isprintable()
    assert record.as_dict()["path"] == path
    assert shown("x" * 300, 200) == "x" * 200 + "..."


@pytest.mark.parametrize("kind", ["task", "greenlet"])
def test_a_request_record_names_its_thread_its_task_and_its_signals(kind: str) -> None:
    payload = encode_request(
        KIND_REQUEST, 7, 8, 9, "GET", "r", "/x", thread=0x7F00AB, task=0xBEEF, task_kind=kind,
        stack_signal=signal.SIGURG, dump_signal=signal.SIGRTMIN,
    )  # fmt: skip
    record = decode_request(payload)
    assert record is not None
    assert (record.thread, record.task, record.task_kind) == (0x7F00AB, 0xBEEF, kind)
    assert (record.stack_signal, record.dump_signal) == (signal.SIGURG, signal.SIGRTMIN)
    # The thread as faulthandler writes it, so that a dump of every thread can be read.
    assert record.describe() == f"GET /x (request r, worker pid 7, thread 0x00000000007f00ab, {kind} 0xbeef)"
    assert record.as_dict() == {
        "method": "GET", "path": "/x", "truncated": False, "request_id": "r", "worker_pid": 7,
        "thread": 0x7F00AB, "task": 0xBEEF, "task_kind": kind, "started_ns": 9, "timeout_ms": 0, "warn": False,
        "interrupt": False, "queued_ms": 0,
    }  # fmt: skip


def test_a_long_path_is_cut_to_fit_and_marked() -> None:
    payload = encode_request(KIND_REQUEST, 1, 2, 3, "POST", "id", "/" + "x" * 1000, size=100)
    assert len(payload) == 100
    record = decode_request(payload)
    assert record is not None and record.truncated
    assert record.path == "/" + "x" * (100 - HEAD.size - len("POST") - len("id") - 1)
    assert record.describe().startswith("POST /xxx") and "x... (request id" in record.describe()


def test_a_payload_too_small_for_the_request_id_leaves_it_out() -> None:
    """The worker's pid and the request's start stand in for a client's id
    that does not fit; a payload too small for the method is refused."""
    payload = encode_request(KIND_REQUEST, 0x2A, 2, 0xABCDEF, "GET", "x" * 20, "/longer", size=HEAD.size + 8)
    record = decode_request(payload)
    assert record is not None and (record.request_id, record.path, record.truncated) == ("2a.00abcdef", "/long", True)
    with pytest.raises(ValueError, match="a payload of 54 bytes has no room for a request record"):
        encode_request(KIND_REQUEST, 1, 2, 3, "OPTIONS", "", "/", size=HEAD.size + 2)


def test_a_record_of_a_request_that_queued_knows_its_own_timeout() -> None:
    """X-Request-Start moved its start 700 ms back: its timeout counts from
    there, the driver's kill from when its worker took it."""
    payload = encode_request(KIND_REQUEST, 1, 2, 10**9, "GET", "q", "/", timeout_ms=1000, queued_ms=700)
    record = decode_request(payload)
    assert record is not None and record.queued_ms == 700
    assert (record.timeout_at(), record.own_timeout_at()) == (2 * 10**9, int(2.7 * 10**9))
    plain = decode_request(encode_request(KIND_REQUEST, 1, 2, 10**9, "GET", "q", "/", timeout_ms=1000))
    assert plain is not None and plain.own_timeout_at() is None


_GOOD = encode_request(KIND_REQUEST, 1, 2, 3, "GET", "id", "/")


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        _GOOD[: HEAD.size - 1],  # shorter than the head
        bytes([max(KINDS) + 1]) + _GOOD[1:],  # no such kind
        _GOOD[:1] + b"\xff\xff" + _GOOD[3:],  # sizes past the end
        _GOOD[:42] + b"\x00\x00" + _GOOD[44:],  # no magic number: another program's payload
        _GOOD[: HEAD.size] + b"G T" + _GOOD[HEAD.size + 3 :],  # a method that is no HTTP token
        b"\x01" * 100,
    ],
)
def test_a_payload_that_is_no_record_decodes_to_none(payload: bytes) -> None:
    assert decode_request(_GOOD) is not None
    assert decode_request(payload) is None


def test_a_payload_too_small_for_any_record_is_refused() -> None:
    with pytest.raises(ValueError, match="no room"):
        encode_request(KIND_REQUEST, 1, 2, 3, "GET", "x" * 64, "/", size=40)
