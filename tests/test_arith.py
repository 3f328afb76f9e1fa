"""The pure index arithmetic of the C core, at every level boundary.

The properties checked are the ones the wheel relies on, stated
independently of how the C code computes them:

* a timer's bucket covers its tick: expiry <= t < expiry + W**level;
* the bucket lies inside its level's window of W buckets ahead of the
  level's clock, so one slot never means two ranges;
* the level is the lowest whose window holds t;
* when the clock reaches a bucket of level >= 1, every timer in it not due
  at that tick lands in a strictly later bucket of a strictly lower level
  (the cascade makes progress and terminates);
* every delay up to the maximum, from any clock value, has a level.
"""

from __future__ import annotations

import itertools
import math

import pytest

from shmwheel._binding import ffi, lib

MAX_DELAY_NS = lib.SHMW_MAX_DELAY_NS
BITS = range(lib.SHMW_MIN_WHEEL_BITS, lib.SHMW_MAX_WHEEL_BITS + 1)


def placement(elapsed: int, t: int, bits: int) -> tuple[int, int, int]:
    level = lib.shmw_level_for(elapsed, t, bits)
    return level, lib.shmw_slot_for(t, level, bits), lib.shmw_bucket_expiry(t, level, bits)


def assert_placement(elapsed: int, t: int, bits: int) -> None:
    w = 1 << bits
    level, slot, expiry = placement(elapsed, t, bits)
    gran = w**level
    shift = level * bits
    assert expiry <= t < expiry + gran, (elapsed, t, level)
    assert expiry % gran == 0
    assert slot == (expiry // gran) % w
    assert 0 <= (t >> shift) - (elapsed >> shift) < w, "outside its level's window"
    if level > 0:
        below = (level - 1) * bits
        assert (t >> below) - (elapsed >> below) >= w, "a lower level would hold it"
        assert (t >> shift) != (elapsed >> shift), "level >= 1 never uses the current slot"
        # The cascade: with the clock at the bucket's expiry, t goes strictly down.
        if t > expiry:
            nlevel, _, nexpiry = placement(expiry, t, bits)
            assert nlevel < level
            assert nexpiry > expiry


def boundary_ticks(bits: int, levels: int) -> list[int]:
    """Values around every multiple of W**l that matters, for clocks and deltas."""
    out = {0, 1, 2}
    for level in range(levels + 1):
        g = (1 << bits) ** level
        for k in (1, 2, (1 << bits) - 1, 1 << bits):
            for d in (-2, -1, 0, 1, 2):
                if 0 <= k * g + d < 1 << 62:
                    out.add(k * g + d)
    return sorted(out)


@pytest.mark.parametrize("bits", [4, 6])
def test_level_for_exhaustive_small_range(bits: int) -> None:
    """Every clock in [0, 3W) against every tick in the next W**2 + W ticks."""
    w = 1 << bits
    for elapsed in range(0, 3 * w):
        for t in range(elapsed, elapsed + w * w + w + 2):
            assert_placement(elapsed, t, bits)


@pytest.mark.parametrize("bits", list(BITS))
def test_level_for_at_every_level_boundary(bits: int) -> None:
    levels = lib.shmw_levels_for(1_000_000, bits)
    ticks = boundary_ticks(bits, levels)
    for elapsed in ticks:
        for delta in ticks:
            assert_placement(elapsed, elapsed + delta, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_level_for_boundaries_exact_levels(bits: int) -> None:
    """From a clock at 0, tick W**l - 1 is level l - 1 and W**l is level l."""
    w = 1 << bits
    assert lib.shmw_level_for(0, 0, bits) == 0
    for level in range(1, 64 // bits):
        assert lib.shmw_level_for(0, w**level - 1, bits) == level - 1
        assert lib.shmw_level_for(0, w**level, bits) == level


def test_level_for_overdue_is_level_zero() -> None:
    assert lib.shmw_level_for(1000, 999, 8) == 0
    assert lib.shmw_level_for(1000, 0, 8) == 0
    assert lib.shmw_level_for(2**63, 5, 8) == 0


def test_slot_and_expiry_shift_past_64_bits() -> None:
    """Levels whose shift is >= 64 have one slot covering everything (no UB)."""
    assert lib.shmw_slot_for(2**64 - 1, 16, 4) == 0
    assert lib.shmw_bucket_expiry(2**64 - 1, 16, 4) == 0
    assert lib.shmw_level_for(0, 2**64 - 1, 4) == 15  # shift 60: 15 < 16
    assert lib.shmw_level_for(0, 2**64 - 1, 12) == 5


@pytest.mark.parametrize("bits", list(BITS))
@pytest.mark.parametrize("tick_ns", [lib.SHMW_MIN_TICK_NS, 1_000_000, 1_000_000_000, lib.SHMW_MAX_TICK_NS])
def test_levels_for_covers_max_delay_plus_lag(bits: int, tick_ns: int) -> None:
    """The top window exceeds twice the longest delay, and one level fewer would not."""
    levels = lib.shmw_levels_for(tick_ns, bits)
    assert 1 <= levels <= lib.SHMW_MAX_LEVELS
    w = 1 << bits
    need = 2 * math.ceil(MAX_DELAY_NS / tick_ns) + 2
    assert (w - 1) * w ** (levels - 1) > need
    if levels > 1:
        assert (w - 1) * w ** (levels - 2) <= need
    # From clocks around every boundary, the longest delay (plus as much lag) has a level.
    for elapsed in boundary_ticks(bits, levels)[:: max(1, levels // 2)]:
        assert lib.shmw_level_for(elapsed, elapsed + need - 2, bits) < levels


@pytest.mark.parametrize("tick_ns", [1000, 1_000_000, 7_000_001])
def test_ticks_ceil_boundaries(tick_ns: int) -> None:
    assert lib.shmw_ticks_ceil(0, tick_ns) == 0
    assert lib.shmw_ticks_ceil(-5, tick_ns) == 0
    assert lib.shmw_ticks_ceil(1, tick_ns) == 1
    for k in (1, 2, 1000, 2**40):
        assert lib.shmw_ticks_ceil(k * tick_ns - 1, tick_ns) == k
        assert lib.shmw_ticks_ceil(k * tick_ns, tick_ns) == k
        assert lib.shmw_ticks_ceil(k * tick_ns + 1, tick_ns) == k + 1
    big = 2**63 - 1
    assert lib.shmw_ticks_ceil(big, tick_ns) == -(-big // tick_ns)


def test_index_bits() -> None:
    for capacity, bits in [(1, 0), (2, 1), (3, 2), (4, 2), (5, 3), (1024, 10), (1025, 11), (2**31 - 1, 31)]:
        assert lib.shmw_index_bits(capacity) == bits


def seconds_to_ns(x: float) -> int:
    out = ffi.new("int64_t *")
    rc = lib.shmw_seconds_to_ns(x, out)
    return out[0] if rc == 0 else rc


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1e-9, -1.0])
def test_seconds_to_ns_rejects(bad: float) -> None:
    assert seconds_to_ns(bad) == lib.SHMW_ETIME


def test_seconds_to_ns_values() -> None:
    assert seconds_to_ns(0.0) == 0
    assert seconds_to_ns(-0.0) == 0
    assert seconds_to_ns(1.5) == 1_500_000_000
    assert seconds_to_ns(1e-9) == 1
    assert seconds_to_ns(123456.789012345) == 123456789012345
    assert seconds_to_ns(1e10) == lib.SHMW_ERANGE
    assert seconds_to_ns(9.2e9) == lib.SHMW_ERANGE
    assert seconds_to_ns(MAX_DELAY_NS / 1e9) == MAX_DELAY_NS


def test_every_pair_of_small_clocks_matches_a_brute_force_window() -> None:
    """For W=16, the level is the first whose W-bucket window from its clock holds t."""
    bits, w = 4, 16
    for elapsed, delta in itertools.product(range(0, 600, 7), range(0, 70000, 13)):
        t = elapsed + delta
        level = 0
        while not ((elapsed // w**level) * w**level <= t < (elapsed // w**level + w) * w**level):
            level += 1
        assert lib.shmw_level_for(elapsed, t, bits) == level, (elapsed, t)
