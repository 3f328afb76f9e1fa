"""Arguments: the limits of a wheel's parameters and the checks every
public function makes before it touches a segment.

Each check says what is wrong with a value in words that ``create()`` puts
after the parameter's name and the command line after its option's, so
both parse against the same limits, stated once; and there is one check
for a time in seconds, and one for a signal, which the request-timeout
code uses too.
"""

from __future__ import annotations

import math
import numbers
import signal
from typing import Any

from ._binding import MAX_DELAY, lib

__all__ = [
    "CAPACITIES",
    "LOCK_TIMEOUT",
    "PAYLOAD_SIZES",
    "TICKS",
    "WHEEL_SIZES",
    "check_flag",
    "check_handle",
    "check_int",
    "check_lock_timeout",
    "check_owner",
    "check_payload",
    "check_seconds",
    "check_signal",
    "not_a_tick",
    "not_a_wheel_size",
    "not_between",
    "too_big",
]

#: The default of create()'s and attach()'s lock_timeout, seconds.
LOCK_TIMEOUT = lib.SHMW_LOCK_TIMEOUT_NS / 1e9

# The limits of create()'s parameters, as the C core defines them.  Each
# check below says what is wrong with a value (None: nothing), in words that
# create() puts after the parameter's name and the command line after its
# option's: both parse against the same limits, stated once.
CAPACITIES = (1, lib.SHMW_MAX_CAPACITY)
PAYLOAD_SIZES = (0, lib.SHMW_MAX_PAYLOAD)
WHEEL_SIZES = (1 << lib.SHMW_MIN_WHEEL_BITS, 1 << lib.SHMW_MAX_WHEEL_BITS)
TICKS = (lib.SHMW_MIN_TICK_NS / 1e9, lib.SHMW_MAX_TICK_NS / 1e9)


def not_between(value: float, lo: float, hi: float, unit: str = "") -> str | None:
    if lo <= value <= hi:  # NaN is not
        return None
    if isinstance(value, float) or isinstance(lo, float):
        return f"must be between {lo:g} and {hi:g}{unit}, not {value:g}"
    return f"must be between {lo} and {hi}{unit}, not {value}"


def not_a_wheel_size(value: int) -> str | None:
    lo, hi = WHEEL_SIZES
    if lo <= value <= hi and not value & (value - 1):
        return None
    return f"must be a power of two from {lo} to {hi}, not {value}"


def not_a_tick(value: float) -> str | None:
    return not_between(value, *TICKS, " seconds")


def check_int(value: object, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    value = int(value)
    if problem := not_between(value, lo, hi):
        raise ValueError(f"{what} {problem}")
    return value


def check_seconds(value: object, what: str, *, positive: bool = False) -> float:
    """Type errors for a time argument; the C core checks the value.

    A bool is a number here, as everywhere in Python (``time.sleep(True)``):
    the call into C takes it as 1 on the fast path, and this check, which
    runs only after that call has refused something, must agree with it.
    With ``positive``, for a duration no C call checks (a request timeout,
    a wait), the value must also be finite and above zero.
    """
    if not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, not {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:  # an int past the range of a double
        raise too_big(value, what) from None
    if positive and not 0 < seconds < math.inf:  # NaN is not
        raise ValueError(f"{what} must be a positive number of seconds, not {seconds}")
    return seconds


def check_flag(value: object, what: str) -> bool:
    """An on/off setting: True or False, and nothing merely truthy (a "no"
    string, a 0 that was meant as a number)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be True or False, not {value!r}")
    return value


def check_signal(value: object, what: str) -> signal.Signals:
    """A signal from a number, a Signals member or a name ("TERM", "SIGTERM")."""
    if isinstance(value, str):
        name = value.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        try:
            return signal.Signals[name]
        except KeyError:
            raise ValueError(f"{what}: no signal named {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be a signal number or name, not {type(value).__name__}")
    try:
        return signal.Signals(value)
    except ValueError:
        raise ValueError(f"{what}: {value} is not a signal number") from None


def check_payload(payload: object) -> bytes:
    if isinstance(payload, bytes):
        return payload
    try:
        return memoryview(payload).tobytes()  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"payload must be bytes or another bytes-like object, not {type(payload).__name__}") from None


def check_lock_timeout(value: object) -> float:
    seconds = check_seconds(value, "lock_timeout")
    if not 0 < seconds <= 86400 * 365:  # NaN is not
        raise ValueError(f"lock_timeout must be a positive number of seconds up to a year, not {value!r}")
    return seconds


def too_big(value: Any, what: str) -> ValueError:
    """A number too big even for a double (an int of over 308 digits): the
    same words as for one that is merely out of range."""
    shown = f"{value!r}" if len(repr(value)) <= 40 else f"of {len(str(abs(value)))} digits"
    if value < 0:
        return ValueError(f"{what} {shown} must be a finite, non-negative number of seconds")
    return ValueError(f"{what} {shown} is beyond the maximum delay of {MAX_DELAY:.0f} s (about 146 years)")


def check_handle(handle: object) -> int:
    if not isinstance(handle, int):  # a bool too: see check_seconds
        raise TypeError(f"a handle is an int, not {type(handle).__name__}")
    if not 0 <= handle < 1 << 63:
        raise ValueError(f"a handle is a non-negative int below 2**63, not {handle}")
    return handle


def check_owner(owner: object) -> tuple[int, int]:
    """create()'s ``owner``: a (uid, gid) of two ids, -1 for one to leave as it is (as chown(2) takes it)."""
    if not isinstance(owner, tuple) or len(owner) != 2:
        raise TypeError(f"owner must be a (uid, gid) tuple, not {owner!r}")
    uid = check_int(owner[0], "owner's uid", -1, 2**32 - 2)  # 2**32 - 1 is -1 in disguise
    gid = check_int(owner[1], "owner's gid", -1, 2**32 - 2)
    return uid, gid
